"""`update_` along a recorded route (`optimisers.engine.replay`): after a general step, later steps
walk only the recorded containers and compare in bulk. Each test steps one copy of a model with
`update_` (which replays from its second step) and another with the pure `update` (which always
takes the general path), and requires the same numbers bit for bit; the changes a user can make
between steps must make the replay give way to the general path, which steps or refuses them as
it always does."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest

import optimisers as opt
from optimisers.engine import replay

pytestmark = pytest.mark.usefixtures("tiny_chunks")  # packed runs and split arrays on small models


def _numpy_model(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    shared = rng.standard_normal((6, 5)).astype(dtype)
    return {
        "embed": shared,
        "blocks": [
            {"w": rng.standard_normal((5, 5)).astype(dtype), "b": rng.standard_normal(5).astype(dtype)}
            for _ in range(30)
        ],
        "big": rng.standard_normal(3000).astype(dtype),
        "fortran": np.asfortranarray(rng.standard_normal((7, 9)).astype(dtype)),
        "head": shared,  # tied to the embedding
    }


def _grads_like(model, seed):
    rng = np.random.default_rng(seed)

    def grad(x):
        return np.asarray(rng.standard_normal(x.shape), dtype=x.dtype, order="K").copy(order="K")

    return {
        "embed": grad(model["embed"]),
        "blocks": [{"w": grad(b["w"]), "b": grad(b["b"])} for b in model["blocks"]],
        "big": grad(model["big"]),
        "fortran": np.asfortranarray(grad(model["fortran"])),
        "head": grad(model["head"]),
    }


def _arrays(tree):
    if isinstance(tree, dict):
        return [a for k in sorted(tree) for a in _arrays(tree[k])]
    if isinstance(tree, list):
        return [a for v in tree for a in _arrays(v)]
    return [tree]


def _same(a, b):
    for x, y in zip(_arrays(a), _arrays(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


RULES = {
    "adam": lambda: opt.Adam(1e-2),
    "adamw": lambda: opt.AdamW(1e-2, lambd=0.1),
    "momentum": lambda: opt.Momentum(1e-2, 0.9),
    "clipnorm-adam": lambda: opt.OptimiserChain(opt.ClipNorm(1.0), opt.Adam(1e-2)),
    "descent": lambda: opt.Descent(0.1),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_replayed_steps_equal_the_general_path(rule, replays):
    model = _numpy_model()
    reference = copy.deepcopy(model)
    state = opt.setup(RULES[rule](), model)
    ref_state = opt.setup(RULES[rule](), reference)
    for k in range(5):
        state, model = opt.update_(state, model, _grads_like(model, k))
        ref_state, reference = opt.update(ref_state, reference, _grads_like(reference, k))
        _same(model, reference)
    assert model["head"] is model["embed"]  # the tie holds
    assert replays[1:] == [True] * 4  # the first step records the route, the others replay it
    _same(opt.state_dict(state), opt.state_dict(ref_state))


def test_torch_adapter_replays_and_equals_torch_optim(replays):
    torch = pytest.importorskip("torch")
    import optimisers.torch as ot

    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=gen) for s in [(8,)] * 40 + [(3, 4)] * 10 + [(2000,)]]
    ours = [torch.nn.Parameter(v.clone()) for v in values]
    theirs = [torch.nn.Parameter(v.clone()) for v in values]
    mine = ot.Optimizer(ours, opt.Momentum(1e-2, 0.9))
    ref = torch.optim.SGD(theirs, lr=1e-2, momentum=0.9)
    for k in range(4):
        gen = torch.Generator().manual_seed(100 + k)
        for a, b in zip(ours, theirs):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g.clone(), g.clone()
        mine.step()
        ref.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
    assert replays[-2:] == [True, True]


def _stepped_pair(rule=lambda: opt.Adam(1e-2), steps=2):
    model = _numpy_model()
    reference = copy.deepcopy(model)
    state, ref_state = opt.setup(rule(), model), opt.setup(rule(), reference)
    for k in range(steps):
        state, model = opt.update_(state, model, _grads_like(model, k))
        ref_state, reference = opt.update(ref_state, reference, _grads_like(reference, k))
    return state, model, ref_state, reference


def _unchanged_by(call, state, model):
    before_model, before_state = copy.deepcopy(model), copy.deepcopy(opt.state_dict(state))
    call()
    _same(model, before_model)
    _same(opt.state_dict(state), before_state)


def test_a_bad_gradient_after_replays_is_refused_naming_its_path(replays):
    state, model, _, _ = _stepped_pair(steps=3)
    grads = _grads_like(model, 9)
    grads["blocks"][4]["w"] = np.zeros((5, 4), np.float32)

    def call():
        with pytest.raises(ValueError, match=r"blocks.*4.*w.*shape \(5, 4\)"):
            opt.update_(state, model, grads)

    _unchanged_by(call, state, model)
    assert replays[-1] is False


def test_a_gradient_left_out_steps_the_rest_as_update_does(replays):
    state, model, ref_state, reference = _stepped_pair()
    grads = _grads_like(model, 5)
    grads["blocks"][3]["b"] = None
    state, model = opt.update_(state, model, grads)
    ref_state, reference = opt.update(ref_state, reference, copy.deepcopy(grads))
    _same(model, reference)
    assert replays[-1] is False
    for k in range(6, 8):  # and back to replaying once every gradient is there again
        state, model = opt.update_(state, model, _grads_like(model, k))
        ref_state, reference = opt.update(ref_state, reference, _grads_like(reference, k))
    _same(model, reference)
    assert replays[-1] is True


def test_gradients_of_another_dtype_are_converted_as_update_does(replays):
    state, model, ref_state, reference = _stepped_pair()
    grads = _grads_like(model, 5)
    grads["big"] = grads["big"].astype(np.float64) * 1.1  # not the parameter's dtype
    grads["blocks"][0]["w"] = np.ascontiguousarray(grads["blocks"][0]["w"].T).T  # another layout
    state, model = opt.update_(state, model, grads)
    ref_state, reference = opt.update(ref_state, reference, grads)
    _same(model, reference)
    assert replays[-1] is False


def test_a_gradient_that_is_a_view_of_a_parameter(replays):
    state, model, ref_state, reference = _stepped_pair()
    grads = _grads_like(model, 5)
    grads["big"] = model["big"][::-1]  # reads the parameter that the step writes
    ref_grads = _grads_like(reference, 5)
    ref_grads["big"] = reference["big"][::-1].copy()
    state, model = opt.update_(state, model, grads)
    ref_state, reference = opt.update(ref_state, reference, ref_grads)
    _same(model, reference)


def test_a_replaced_parameter_is_stepped_and_the_route_recorded_again(replays):
    state, model, ref_state, reference = _stepped_pair()
    new = np.arange(5, dtype=np.float32)
    model["blocks"][2]["b"] = new
    reference["blocks"][2]["b"] = new.copy()
    for k in range(5, 8):
        state, model = opt.update_(state, model, _grads_like(model, k))
        ref_state, reference = opt.update(ref_state, reference, _grads_like(reference, k))
    _same(model, reference)
    assert model["blocks"][2]["b"] is new  # stepped in place
    assert replays[-3:] == [False, True, True]


def _add_a_parameter(model):
    model["blocks"][1]["extra"] = np.ones(3, np.float32)


def _reshape_in_place(model):
    model["blocks"][0]["w"].shape = (25,)  # the same object, another shape


@pytest.mark.parametrize(
    "change, error, match",
    [
        (_add_a_parameter, KeyError, r"blocks.*1.*extra"),
        (_reshape_in_place, ValueError, r"blocks.*0.*w.*shape \(25,\)"),
    ],
    ids=["added-after-setup", "reshaped"],
)
def test_a_model_changed_after_replays_is_refused(replays, change, error, match, numpy_marks):
    state, model, _, _ = _stepped_pair()
    change(model)
    grads = _grads_like(model, 5)

    def call():
        with pytest.raises(error, match=match):
            opt.update_(state, model, grads)

    _unchanged_by(call, state, model)


def test_a_read_only_parameter_is_not_written(replays, numpy_marks):
    state, model, ref_state, reference = _stepped_pair()
    model["big"].flags.writeable = False
    state, model = opt.update_(state, model, _grads_like(model, 5))
    ref_state, reference = opt.update(ref_state, reference, _grads_like(reference, 5))
    _same(model, reference)
    assert replays[-1] is False


def test_state_changes_between_steps(replays):
    state, model, ref_state, reference = _stepped_pair()
    # a Leaf replaced in a sub-tree (its container is the same dict)
    state["blocks"][3]["w"] = opt.setup(opt.Momentum(1e-2), model["blocks"][3]["w"])
    ref_state["blocks"][3]["w"] = opt.setup(opt.Momentum(1e-2), reference["blocks"][3]["w"])
    for k in range(5, 7):
        state, model = opt.update_(state, model, _grads_like(model, k))
        ref_state, reference = opt.update(ref_state, reference, _grads_like(reference, k))
    _same(model, reference)
    # a changed hyperparameter, and a frozen part
    opt.adjust_(state, eta=1e-3)
    opt.freeze_(state["blocks"][5])
    ref_state = opt.adjust(ref_state, eta=1e-3)
    opt.freeze_(ref_state["blocks"][5])
    for k in range(7, 10):
        state, model = opt.update_(state, model, _grads_like(model, k))
        ref_state, reference = opt.update(ref_state, reference, _grads_like(reference, k))
    _same(model, reference)


def test_torch_parameter_swapped_under_the_route(replays):
    torch = pytest.importorskip("torch")
    import optimisers.torch as ot

    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=gen) for s in [(6,)] * 30 + [(4, 4)]]
    ours = [torch.nn.Parameter(v.clone()) for v in values]
    theirs = [torch.nn.Parameter(v.clone()) for v in values]
    mine = ot.Optimizer(ours, opt.Momentum(1e-2, 0.9))
    ref = torch.optim.SGD(theirs, lr=1e-2, momentum=0.9)

    def step(k):
        gen = torch.Generator().manual_seed(100 + k)
        for a, b in zip(ours, theirs):
            g = torch.randn(a.shape, generator=gen)  # laid out as its parameter, as autograd's are
            a.grad, b.grad = torch.empty_like(a).copy_(g), torch.empty_like(b).copy_(g)
        mine.step()
        ref.step()

    step(0)
    step(1)
    for p in (ours[-1], theirs[-1]):  # same values, transposed memory: the marks must notice
        p.data = p.data.t().contiguous().t()
    for p in (ours[3], theirs[3]):
        p.data = p.data.clone()
    for k in range(2, 5):
        step(k)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
    # the swap is seen; the engine plans its groups and route again, and replays them
    assert replays[-3] is False and replays[-1] is True


def test_a_model_that_changes_every_step_stops_being_recorded(replays, monkeypatch):
    """A route that goes stale at every step (new arrays each time) is recorded a bounded number
    of times, and the steps still equal the pure path's."""
    recorded: list = []
    original = replay.Route.record.__func__

    def counting(cls, *args):
        recorded.append(1)
        return original(cls, *args)

    monkeypatch.setattr(replay.Route, "record", classmethod(counting))
    model = [np.ones(4, np.float32) * k for k in range(20)]
    state = opt.setup(opt.Momentum(1e-2, 0.9), model)
    reference_state = opt.setup(opt.Momentum(1e-2, 0.9), copy.deepcopy(model))
    reference = copy.deepcopy(model)
    for step in range(2 * replay._RECORDINGS + 4):
        model = [x.copy() for x in model]  # new arrays, the same values
        grads = [np.full(4, step + k, np.float32) for k in range(20)]
        state, model = opt.update_(state, model, grads)
        reference_state, reference = opt.update(reference_state, reference, grads)
    _same(model, reference)
    assert len(recorded) == replay._RECORDINGS


def _torch_model(torch, dtype):
    gen = torch.Generator().manual_seed(0)
    model = {f"v{i}": torch.randn(6, generator=gen, dtype=dtype) for i in range(30)}
    model.update({f"m{i}": torch.randn(4, 3, generator=gen, dtype=dtype) for i in range(5)})
    model["tied"] = model["v0"]  # one tensor at two places: its second gradient is summed
    model["c0"] = torch.randn(2, 3, 4, 5, generator=gen, dtype=dtype).to(memory_format=torch.channels_last)
    return model


def _torch_grads(torch, model, k):
    """Gradients laid out as their parameters (channels_last for one)."""
    gen = torch.Generator().manual_seed(100 + k)
    return {key: torch.empty_like(x).copy_(torch.randn(x.shape, generator=gen, dtype=x.dtype))
            for key, x in model.items()}


def _a_change_after_replays(replays, model, reference, grads_of, change, same):
    """Replayed steps of `model` (`update_`) beside `reference` (`update`); then `change(model,
    grads)` to each and one more step, which must not replay and must step (`same(model,
    reference)`) or refuse exactly as `update` does."""
    state, ref_state = opt.setup(opt.Adam(1e-2), model), opt.setup(opt.Adam(1e-2), reference)
    for k in range(4):
        state, model = opt.update_(state, model, grads_of(model, k))
        ref_state, reference = opt.update(ref_state, reference, grads_of(reference, k))
    assert replays[-3:] == [True, True, True]
    grads, ref_grads = grads_of(model, 4), grads_of(reference, 4)
    change(model, grads)
    change(reference, ref_grads)
    try:
        ref_state, reference = opt.update(ref_state, reference, ref_grads)
    except (ValueError, TypeError) as e:
        with pytest.raises(type(e), match=re.escape(str(e))):
            opt.update_(state, model, grads)
    else:
        state, model = opt.update_(state, model, grads)
        same(model, reference)
    assert replays[-1] is False


_TORCH_CHANGES = {  # what a user may hand in, or do to a parameter, between two steps
    "gradient float64": lambda torch, model, grads: grads.__setitem__("v3", grads["v3"].double()),
    "gradient requires grad": lambda torch, model, grads: grads["v4"].requires_grad_(),
    "gradient transposed": lambda torch, model, grads: grads.__setitem__(
        "m1", grads["m1"].t().contiguous().t()),
    "gradient strided": lambda torch, model, grads: grads.__setitem__(
        "v5", torch.stack([grads["v5"], grads["v5"]], 1)[:, 0]),
    "gradient of another shape": lambda torch, model, grads: grads.__setitem__("v6", torch.zeros(7)),
    "parameter float64": lambda torch, model, grads: setattr(model["v7"], "data", model["v7"].data.double()),
    "parameter transposed": lambda torch, model, grads: setattr(
        model["m2"], "data", model["m2"].data.t().contiguous().t()),
    "parameter moved": lambda torch, model, grads: setattr(model["v8"], "data", model["v8"].data.clone()),
    "channels_last parameter made contiguous": lambda torch, model, grads: setattr(
        model["c0"], "data", model["c0"].data.contiguous()),
    # the same memory: only the bulk check of shapes, strides and dtypes can see these
    "parameter restrided": lambda torch, model, grads: setattr(
        model["m3"], "data", model["m3"].data.as_strided((4, 3), (1, 4))),
    "parameter transposed in place": lambda torch, model, grads: model["m4"].t_(),
    "parameter viewed as int32": lambda torch, model, grads: setattr(
        model["v9"], "data", model["v9"].data.view(torch.int32)),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bulk", [True, False], ids=["bulk", "attributes"])
@pytest.mark.parametrize("change", list(_TORCH_CHANGES))
def test_torch_bulk_checks_see_each_change(replays, change, bulk, dtype, monkeypatch):
    """After replays whose parameters and gradients torch checks in bulk (`unchanged`: torch's
    tensor guard and each tensor's data pointer; new gradient tensors each step, as autograd
    makes them), each change a user can make is seen: the step does not replay, and it steps or
    refuses as `update` does. The same without the tensor guard (another torch), where every
    step takes the full check."""
    torch = pytest.importorskip("torch")
    from optimisers.backends import torch as torch_backend

    if not bulk:
        monkeypatch.setattr(torch_backend, "_tensor_guard", lambda: None)
    model = _torch_model(torch, getattr(torch, dtype))
    assert (torch_backend._tensor_guard() is not None) == bulk
    reference = {k: v.clone() for k, v in model.items()}
    reference["tied"] = reference["v0"]

    def same(model, reference):
        for key in model:
            assert torch.equal(model[key], reference[key]), key

    _a_change_after_replays(replays, model, reference, lambda m, k: _torch_grads(torch, m, k),
                            lambda m, g: _TORCH_CHANGES[change](torch, m, g), same)


class _Sub(np.ndarray):
    pass


_NUMPY_CHANGES = {  # what a user may hand in as a gradient between two steps, or do to a parameter
    "gradient float64": lambda model, grads: grads.__setitem__("v3", grads["v3"].astype(np.float64)),
    "gradient transposed": lambda model, grads: grads.__setitem__("m1", np.asfortranarray(grads["m1"])),
    "gradient strided": lambda model, grads: grads.__setitem__("v5", np.repeat(grads["v5"], 2)[::2]),
    "gradient of another shape": lambda model, grads: grads.__setitem__("v6", np.zeros(7, np.float32)),
    "gradient a subclass": lambda model, grads: grads.__setitem__("v7", grads["v7"].view(_Sub)),
    "gradient swapped bytes": lambda model, grads: grads.__setitem__("v8", grads["v8"].astype(">f4")),
    "parameter reshaped in place": lambda model, grads: setattr(model["m2"], "shape", (3, 4)),
    "parameter viewed as int32": lambda model, grads: setattr(model["v9"], "dtype", np.int32),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("change", list(_NUMPY_CHANGES))
def test_numpy_bulk_checks_see_each_change(replays, change, dtype):
    """The NumPy side of `test_torch_bulk_checks_see_each_change`: the backend's `unchanged`,
    new arrays each step."""
    rng = np.random.default_rng(0)
    model = {f"v{i}": rng.standard_normal(6).astype(dtype) for i in range(30)}
    model.update({f"m{i}": rng.standard_normal((4, 3)).astype(dtype) for i in range(5)})
    model["tied"] = model["v0"]
    reference = copy.deepcopy(model)

    def grads_of(model, k):
        rng = np.random.default_rng(100 + k)
        return {key: rng.standard_normal(x.shape).astype(x.dtype) for key, x in model.items()}

    _a_change_after_replays(replays, model, reference, grads_of, _NUMPY_CHANGES[change], _same)
