"""The drop-in classes (and `Optimizer(params, rule)`) against torch.optim when a training loop
edits `param_groups[i]["params"]` between steps: torch.optim reads those lists at every step, so
a tensor added is trained from its first gradient (with fresh state), one removed is no longer
stepped and keeps its `state[p]` (taken up again if it is listed again), and `state_dict()`
numbers the parameters as the lists are now. Compared step by step, on separate tensors and
after `flatten_`. Every size is a multiple of 64 elements: torch's fused Adam gives the same
numbers on the flat buffer as on each tensor."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import optimisers  # noqa: E402
import optimisers.torch as ot  # noqa: E402
from optimisers.torch.dropin_base import DropIn  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

SHAPES = [(8, 8), (64,), (2, 32), (64,), (128,)]
EXTRA = [(64,), (4, 16)]  # tensors the loop lists later
STEPS = 7

# a name -> (our optimizer, torch.optim's, exact): the drop-ins and the generic adapter
KINDS = {
    "Adam": (lambda ps: ot.Adam(ps, lr=1e-2), lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True), True),
    "AdamW": (
        lambda ps: ot.AdamW(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
        True,
    ),
    "Optimizer(AdamW)": (
        lambda ps: ot.Optimizer(ps, optimisers.AdamW(1e-2, lambd=0.1)),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
        True,
    ),
    "SGD-momentum": (
        lambda ps: ot.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False),
        False,
    ),
    "RMSprop": (
        lambda ps: ot.RMSprop(ps, lr=1e-2),
        lambda ps: torch.optim.RMSprop(ps, lr=1e-2, foreach=False),
        False,
    ),
}


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    made = [nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES + EXTRA]
    return made[: len(SHAPES)], made[len(SHAPES) :]


def _twins(flat: bool):
    """(our parameters, our extra tensors), (torch's), equal values; ours flattened if `flat`."""
    ps, extra = _tensors()
    qs = [nn.Parameter(p.detach().clone()) for p in ps]
    qextra = [nn.Parameter(p.detach().clone()) for p in extra]
    if flat:
        ot.flatten_(ps)
    return (ps, extra), (qs, qextra)


def _give_gradients(tensors, step: int, frozen_stay=True) -> None:
    """A gradient for each tensor that requires grad (as backward gives): into a `flatten_` view
    where the tensor has one, else a new tensor."""
    g = torch.Generator().manual_seed(100 + step)
    for t in tensors:
        grad = torch.randn(t.shape, generator=g)
        if not t.requires_grad and frozen_stay:
            continue  # backward gives a frozen parameter nothing
        if t.grad is None:
            t.grad = grad
        else:
            t.grad.copy_(grad)


def _assert_same(ours, theirs, exact: bool, what: str) -> None:
    for k, (x, y) in enumerate(zip(ours, theirs, strict=True)):
        if exact:
            assert torch.equal(x.detach(), y.detach()), f"{what}: tensor {k}"
        else:
            torch.testing.assert_close(
                x.detach(), y.detach(), rtol=1e-5, atol=1e-6, msg=f"{what}: tensor {k}"
            )


def _assert_same_state(o, t, ours, theirs, exact: bool, what: str) -> None:
    assert len(o.state) == len(t.state), what
    for k, (p, q) in enumerate(zip(ours, theirs)):
        assert (p in o.state) == (q in t.state), f"{what}: tensor {k}"
        if q in t.state:
            mine, ref = o.state[p], t.state[q]
            if not isinstance(o, DropIn):  # the library's format: its rule's state parts, in order
                mine = {key: mine[f"state/{i}"] for i, key in enumerate(["exp_avg", "exp_avg_sq", "step"])}
            assert set(mine) == set(ref), f"{what}: tensor {k}"
            mine = [torch.as_tensor(mine[key], dtype=ref[key].dtype) for key in sorted(ref)]
            _assert_same(mine, [ref[key] for key in sorted(ref)], exact, what)


# each edit: (the step before which it is made, what it does to (params, extra) and the optimizer)
def _append(o, ps, extra):
    o.param_groups[0]["params"].append(extra[0])


def _remove(o, ps, extra):
    del o.param_groups[0]["params"][1]


def _remove_and_list_again(o, ps, extra):
    listed = o.param_groups[0]["params"]
    if any(x is ps[3] for x in listed):
        listed.pop(3)
    else:
        listed.append(ps[3])


def _replace_the_list(o, ps, extra):
    o.param_groups[0]["params"] = [ps[0], extra[1], ps[2], extra[0]]


def _insert_at_the_front(o, ps, extra):
    o.param_groups[0]["params"].insert(0, extra[1])


def _move_to_a_new_group(o, ps, extra):
    del o.param_groups[0]["params"][2]
    o.add_param_group({"params": [ps[2], extra[0]], "lr": 3e-2})


def _replace_the_group_dict(o, ps, extra):
    o.param_groups[0] = {**o.param_groups[0], "params": [extra[0], *ps[1:]]}


def _new_lr(o, ps, extra):
    o.param_groups[0]["lr"] = 3e-2


EDITS = {
    "a tensor appended": [(2, _append)],
    "a tensor removed": [(2, _remove)],
    "a tensor removed, then listed again": [(2, _remove_and_list_again), (4, _remove_and_list_again)],
    "a tensor removed, lr changed, listed again": [
        (2, _remove_and_list_again),
        (3, _new_lr),
        (4, _remove_and_list_again),
    ],
    "the list replaced": [(3, _replace_the_list)],
    "a tensor inserted at the front": [(1, _insert_at_the_front)],
    "a tensor moved to a new group": [(3, _move_to_a_new_group)],
    "the group's dict replaced": [(2, _replace_the_group_dict)],
}


def _run(kind: str, edits, flat: bool):
    ours_of, theirs_of, exact = KINDS[kind]
    (ps, extra), (qs, qextra) = _twins(flat)
    o, t = ours_of(list(ps)), theirs_of(list(qs))
    for step in range(STEPS):
        for at, edit in edits:
            if at == step:
                edit(o, ps, extra)
                edit(t, qs, qextra)
        _give_gradients([*ps, *extra], step)
        _give_gradients([*qs, *qextra], step)
        o.step()
        t.step()
        what = f"{kind}, step {step}"
        _assert_same([*ps, *extra], [*qs, *qextra], exact, what)
        _assert_same_state(o, t, [*ps, *extra], [*qs, *qextra], exact, what)
    return o, t, (ps, extra), (qs, qextra)


@pytest.mark.parametrize("flat", [False, True], ids=["tensors", "flatten_"])
@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_an_edit_of_a_groups_params_is_followed_as_torch_optim_follows_it(kind, edit, flat):
    o, t, _, _ = _run(kind, EDITS[edit], flat)
    assert [len(g["params"]) for g in o.param_groups] == [len(g["params"]) for g in t.param_groups]


@pytest.mark.parametrize("kind", ["Adam", "Optimizer(AdamW)"])
def test_state_dict_numbers_the_parameters_as_listed_now_and_refuses_a_removed_one_with_state(kind):
    o, t, (ps, extra), (qs, qextra) = _run(kind, EDITS["a tensor inserted at the front"], flat=False)
    ours, theirs = o.state_dict(), t.state_dict()
    assert [g["params"] for g in ours["param_groups"]] == [g["params"] for g in theirs["param_groups"]]
    assert sorted(ours["state"]) == sorted(theirs["state"])
    del o.param_groups[0]["params"][2]
    del t.param_groups[0]["params"][2]
    with pytest.raises(KeyError):
        t.state_dict()
    with pytest.raises(KeyError, match=r"del optimizer.state\[p\]"):
        o.state_dict()
    del o.state[ps[1]]  # (extra[1] is at the front: the third tensor listed is ps[1])
    del t.state[qs[1]]
    assert [g["params"] for g in o.state_dict()["param_groups"]] == [
        g["params"] for g in t.state_dict()["param_groups"]
    ]
    assert sorted(o.state_dict()["state"]) == sorted(t.state_dict()["state"])


def test_a_state_dict_reloaded_after_an_edit_resumes_as_torch_optim():
    o, t, (ps, extra), (qs, qextra) = _run("Adam", EDITS["a tensor appended"], flat=False)
    saved, saved_t = o.state_dict(), t.state_dict()
    o2 = ot.Adam([*ps, extra[0]], lr=1e-2)
    t2 = torch.optim.Adam([*qs, qextra[0]], lr=1e-2, fused=True)
    o2.load_state_dict(saved)
    t2.load_state_dict(saved_t)
    for step in range(STEPS, STEPS + 2):
        _give_gradients([*ps, *extra], step)
        _give_gradients([*qs, *qextra], step)
        o2.step()
        t2.step()
        _assert_same([*ps, *extra], [*qs, *qextra], True, f"step {step}")


def test_a_tensor_listed_since_the_last_step_has_empty_state_as_in_torch():
    ps, extra = _tensors()
    o = ot.Adam(ps, lr=1e-2)
    o.param_groups[0]["params"].append(extra[0])
    assert o.state[extra[0]] == {} and extra[0] not in o.state
    with pytest.raises(KeyError):
        o.state[extra[1]]  # not listed


@pytest.mark.parametrize(
    "edit, error",
    [
        (lambda o, extra: o.param_groups[0]["params"].append("weight"), r"param_groups\[0\].*tensors"),
        (
            lambda o, extra: o.param_groups[1]["params"].append(o.param_groups[0]["params"][0]),
            "more than one",
        ),
        (lambda o, extra: o.param_groups[0].pop("params"), "lost its 'params'"),
    ],
    ids=["not a tensor", "in two groups", "no params"],
)
def test_an_edit_that_torch_optim_would_choke_on_is_refused_at_the_step_and_changes_nothing(edit, error):
    ps, extra = _tensors()
    o = ot.Adam([{"params": ps[:3]}, {"params": ps[3:], "lr": 0.1}], lr=1e-2)
    _give_gradients(ps, 0)
    o.step()
    before = [p.detach().clone() for p in ps]
    state = {k: v.clone() for k, v in o.state[ps[0]].items()}
    edit(o, extra)
    with pytest.raises((TypeError, ValueError, KeyError), match=error):
        o.step()
    _assert_same(ps, before, True, "after the refused step")
    assert all(torch.equal(v, o.state[ps[0]][k]) for k, v in state.items())


def test_muon_refuses_a_vector_added_to_its_group_naming_the_group():
    w = [nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(4, 4))]
    o = ot.Muon(w, lr=1e-2)
    o.param_groups[0]["params"].append(nn.Parameter(torch.randn(8)))
    for p in w:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=r"param_groups\[0\], parameter 2: Muon only supports"):
        o.step()


def test_a_module_optimizer_follows_an_appended_tensor_too():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    ref = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    ref.load_state_dict(model.state_dict())
    extra, qextra = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    o = ot.Optimizer(model, optimisers.Adam(1e-2))
    t = torch.optim.Adam(ref.parameters(), lr=1e-2, fused=True)
    o.param_groups[0]["params"].append(extra)
    t.param_groups[0]["params"].append(qextra)
    for step in range(3):
        for m, e in ((model, extra), (ref, qextra)):
            m.zero_grad()
            m(torch.ones(5, 4)).square().sum().backward()
            e.grad = torch.full((3,), float(step + 1))
        o.step()
        t.step()
        _assert_same([*model.parameters(), extra], [*ref.parameters(), qextra], True, f"step {step}")
    assert "0" in o.optimiser_state and extra in o.state
