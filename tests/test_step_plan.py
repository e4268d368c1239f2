"""One step plan: a later `update_` reuses the plan of the step before only where one check per
backend confirms everything its kernels rely on; each thing a user may do between steps is
followed with torch.optim's numbers, or refused with a clear error that changes nothing."""

import copy
import dataclasses
from typing import NamedTuple

import numpy as np
import pytest

import optimisers as opt

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from optimisers.torch import flatten_  # noqa: E402


class TiedLM(nn.Module):
    def __init__(self, tied=True):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)])
        self.head = nn.Linear(16, 50, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _loss(model, step):
    ids = torch.randint(0, 50, (4, 9), generator=torch.Generator().manual_seed(step))
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, 50), ids[:, 1:].reshape(-1))


def test_a_tied_module_stepped_with_grads_replays_with_torch_optims_numbers(replays):
    """The README's loop: `zero_grad()`, `backward()` and `update_(state, lm, grads(lm))`, where
    `grads` gives None at the tie's later place. Every later step replays the plan, and the
    numbers are torch.optim's fused Adam's, bit for bit."""
    torch.manual_seed(0)
    ours = TiedLM()
    theirs = TiedLM()
    theirs.load_state_dict(ours.state_dict())
    theirs.head.weight = theirs.embed.weight
    state = opt.setup(opt.Adam(1e-2), ours)
    reference = torch.optim.Adam(theirs.parameters(), lr=1e-2, fused=True)
    for step in range(6):
        for model in (ours, theirs):
            model.zero_grad()
            _loss(model, step).backward()
        state, ours = opt.update_(state, ours, opt.grads(ours))
        reference.step()
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            assert torch.equal(p, q)
    assert ours.head.weight is ours.embed.weight
    assert replays[1:] == [True] * 5


def test_a_tie_whose_later_place_brings_a_gradient_too_sums_both_on_replays(replays):
    """The one tie policy on every path: a later place may bring None or a gradient, step by step;
    each step equals `update` on copies."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    model = {"a": w, "b": [rng.standard_normal(3).astype(np.float32)], "c": w}
    ref = {"a": w.copy(), "b": [model["b"][0].copy()]}
    ref["c"] = ref["a"]
    state, ref_state = opt.setup(opt.Adam(1e-2), model), opt.setup(opt.Adam(1e-2), ref)
    for step in range(8):
        def draw(*shape):
            return rng.standard_normal(shape).astype(np.float32)

        g = {"a": draw(4, 3), "b": [draw(3)], "c": draw(4, 3) if step % 3 == 2 else None}
        state, model = opt.update_(state, model, g)
        ref_state, ref = opt.update(ref_state, ref, g)
        for k in ("a", "c"):
            np.testing.assert_array_equal(model[k], ref[k])
        np.testing.assert_array_equal(model["b"][0], ref["b"][0])
    assert model["a"] is model["c"] and model["a"] is w
    assert True in replays


@pytest.mark.parametrize("flat", [False, True], ids=["separate", "flatten_"])
@pytest.mark.parametrize("kind", ["list", "dict"])
def test_a_parameter_frozen_between_steps_is_refused_pointing_at_freeze(kind, flat, replays):
    """`requires_grad_(False)` on a parameter of a list or dict model after some (replayed)
    steps: a KeyError that points at `freeze_`, nothing moved; as on a first step."""
    params = [nn.Parameter(torch.randn(64)) for _ in range(3)]
    if flat:
        flatten_(params)
    model = params if kind == "list" else {str(i): p for i, p in enumerate(params)}

    def grads():
        gs = [torch.ones(64) for _ in params]
        return gs if kind == "list" else {str(i): g for i, g in enumerate(gs)}

    for first in (False, True):
        state = opt.setup(opt.Adam(0.1), model)
        for _ in range(0 if first else 3):
            state, model = opt.update_(state, model, grads())
        assert first or replays[-1] is True
        params[1].requires_grad_(False)
        before = [p.detach().clone() for p in params]
        with pytest.raises(KeyError, match=r"at 1.*requires_grad=False.*freeze_"):
            opt.update_(state, model, grads())
        for p, q in zip(params, before, strict=True):
            assert torch.equal(p, q)
        params[1].requires_grad_(True)


def _transpose_parameter(p):
    p.t_()


def _transpose_gradient(p):
    p.grad.t_()


@pytest.mark.parametrize("change", [_transpose_parameter, _transpose_gradient], ids=["parameter", "gradient"])
@pytest.mark.parametrize("use", ["update_", "drop-in"])
def test_t_of_a_square_weight_after_flatten_steps_as_torch_optim(change, use):
    """After `flatten_`, `t_()` under `no_grad` of a square weight (or of its gradient) between
    steps keeps the same memory and shape: only its strides say it moved. The step equals
    torch.optim's."""
    torch.manual_seed(0)
    shapes = [(8, 8), (64,), (8, 8), (64,)]
    ours = [nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    flatten_(ours)
    state = opt.setup(opt.Adam(1e-2), ours) if use == "update_" else None
    dropin = opt.torch.Adam(ours, lr=1e-2) if use == "drop-in" else None
    reference = torch.optim.Adam(theirs, lr=1e-2)
    for step in range(6):
        g = torch.Generator().manual_seed(step)
        for p, q in zip(ours, theirs):
            q.grad = torch.randn(p.shape, generator=g)
            with torch.no_grad():
                p.grad.copy_(q.grad)
        if step == 3:
            with torch.no_grad():
                change(ours[2])
                change(theirs[2])
        if dropin is None:
            state, ours = opt.update_(state, ours, [p.grad for p in ours])
        else:
            dropin.step()
        reference.step()
        for p, q in zip(ours, theirs, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_flat_storage_freed_and_reloaded_elsewhere_keeps_training(replays):
    """After `flatten_`, the flat storage freed with `resize_(0)` (as FSDP frees) and each
    parameter pointed at a view of a fresh buffer, which the allocator may place at the same
    address: later steps train on, with torch.optim's numbers and the optimiser state kept."""
    torch.manual_seed(0)
    shapes = [(64, 64), (64,), (32, 64)]
    ours = [nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    (buffers,) = flatten_(ours, gradients=False)
    state = opt.setup(opt.Adam(1e-2), ours)
    reference = torch.optim.Adam(theirs, lr=1e-2)
    for step in range(7):
        if step == 3:
            values = [p.detach().clone() for p in ours]
            buffers.params.untyped_storage().resize_(0)
            fresh = torch.empty(buffers.params.numel())
            at = 0
            for p, v in zip(ours, values):
                n = v.numel()
                p.data = fresh[at : at + n].view_as(v)
                with torch.no_grad():
                    p.copy_(v)
                at += n
            del buffers
        g = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=g) for p in ours]
        for q, gq in zip(theirs, grads):
            q.grad = gq.clone()
        state, ours = opt.update_(state, ours, grads)
        reference.step()
        for p, q in zip(ours, theirs, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert replays[-2:] == [True, True]



@pytest.mark.parametrize("size", ["same", "other"])
def test_gradient_storage_freed_and_reloaded_keeps_training(size, replays):
    """After `flatten_`, the flat gradient storage freed with `resize_(0)` and allocated again (at
    the same address or elsewhere), the gradients still views of it: later steps read them where
    they are now, with torch.optim's numbers."""
    torch.manual_seed(0)
    shapes = [(32, 32), (32,), (16, 32)]
    ours = [nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    (buffers,) = flatten_(ours)
    state = opt.setup(opt.Adam(1e-2), ours)
    reference = torch.optim.Adam(theirs, lr=1e-2)
    storage = buffers.grads.untyped_storage()
    for step in range(7):
        if step == 3:
            nbytes = storage.nbytes()
            storage.resize_(0)
            if size == "other":
                keep = torch.empty(nbytes // 4)  # (the freed block taken, so the storage moves)
            storage.resize_(nbytes)
        g = torch.Generator().manual_seed(step)
        for p, q in zip(ours, theirs):
            gq = torch.randn(p.shape, generator=g)
            with torch.no_grad():
                p.grad.copy_(gq)
            q.grad = gq.clone()
        state, ours = opt.update_(state, ours, [p.grad for p in ours])
        reference.step()
        for p, q in zip(ours, theirs, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert replays[-2:] == [True, True]
    if size == "other":
        del keep


class _Pair(NamedTuple):
    w: np.ndarray
    b: np.ndarray


@dataclasses.dataclass
class _Block:
    pair: _Pair
    scales: tuple
    name: str = "block"


def test_every_kind_of_container_replays_with_updates_numbers(replays):
    """The route's walk reads lists, tuples and dicts where they are, and namedtuples and
    dataclasses through their node kind, gradients in each form `gather` takes (the same type,
    a mapping of field names, None); each step equals `update` on copies."""
    rng = np.random.default_rng(1)

    def arr(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    model = {"blocks": [_Block(_Pair(arr(3, 2), arr(2)), (arr(4), arr(4))) for _ in range(3)], "head": arr(2)}
    reference = copy.deepcopy(model)
    state, ref_state = opt.setup(opt.Adam(1e-2), model), opt.setup(opt.Adam(1e-2), reference)
    for step in range(8):
        blocks = []
        for k in range(len(model["blocks"])):
            pair = _Pair(arr(3, 2), arr(2)) if (step + k) % 2 else {"w": arr(3, 2), "b": arr(2)}
            scales = (arr(4), None) if (k, step) == (1, 4) else [arr(4), arr(4)]
            blocks.append(_Block(pair, scales) if step % 3 else {"pair": pair, "scales": scales})
        grads = {"blocks": blocks, "head": arr(2)}
        state, model = opt.update_(state, model, grads)
        ref_state, reference = opt.update(ref_state, reference, copy.deepcopy(grads))
        for x, y in zip(opt.trainables(model), opt.trainables(reference), strict=True):
            np.testing.assert_array_equal(x, y)
    assert replays[1:4] == [True] * 3 and replays[4] is False and replays[6:] == [True] * 2


def test_a_module_gradient_giving_a_tensor_twice_is_refused_on_replayed_steps(replays):
    """`gather` refuses a module's gradient dict that gives one tensor under two names (autograd
    already summed a tie's places into it); a replayed step refuses it the same way, and nothing
    moves."""
    model = nn.Module()
    model.w1 = nn.Parameter(torch.randn(4))
    model.w2 = model.w1  # the tie, twice in one module
    model.b = nn.Parameter(torch.randn(4))
    state = opt.setup(opt.Adam(1e-2), model)
    for _ in range(3):
        state, model = opt.update_(state, model, {"w1": torch.randn(4), "b": torch.randn(4)})
    assert replays[-1] is True
    g = torch.randn(4)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="twice"):
        opt.update_(state, model, {"w1": g, "w2": g, "b": torch.randn(4)})
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def _new_weight(model):
    model[0].weight = nn.Parameter(model[0].weight.detach() + 1)


def _frozen_bias(model):
    model[1].bias.requires_grad_(False)


def _new_layer(model):
    model.append(nn.Linear(4, 4))


def _no_bias(model):
    model[1].bias = None


@pytest.mark.parametrize(
    "change, error",
    [(_new_weight, None), (_frozen_bias, r"1\.bias.*freeze_"), (_new_layer, r"2\.weight"),
     (_no_bias, r"'bias' at 1")],
    ids=["replaced-parameter", "frozen", "added-layer", "removed-parameter"],
)
def test_a_module_changed_between_replayed_steps_is_seen(change, error, replays):
    """A replayed step reads a module's parameter and submodule dicts where they are: a
    parameter replaced, frozen or removed, or a layer added, between replayed steps is seen (the
    replaced one is stepped as `update` steps it; the others refused naming the place, as on a
    first step, and nothing moves)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    state = opt.setup(opt.Adam(1e-2), model)

    def grads(m):
        return {k: {n: torch.ones_like(p) for n, p in layer.named_parameters() if p.requires_grad}
                for k, layer in m.named_children()}

    for _ in range(3):
        state, model = opt.update_(state, model, grads(model))
    assert replays[-1] is True
    change(model)
    if error is None:
        ref_state, reference = copy.deepcopy((state, model))
        state, model = opt.update_(state, model, grads(model))
        ref_state, reference = opt.update(ref_state, reference, grads(reference))
        for x, y in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(x, y)
        return
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises((KeyError, ValueError), match=error):
        opt.update_(state, model, grads(model))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_a_model_of_many_containers_replays_across_the_walks_parts(replays):
    """The route's walk is compiled in parts of a few hundred containers: a model of 302 of them
    replays with `update`'s numbers, and an array replaced in the last part is seen."""
    rng = np.random.default_rng(3)

    def arr(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    model = {"blocks": [{"a": {"w": arr(3, 2), "b": arr(2)}, "c": [arr(4), arr(1)]} for _ in range(100)]}
    reference = copy.deepcopy(model)
    state, ref_state = opt.setup(opt.Adam(1e-2), model), opt.setup(opt.Adam(1e-2), reference)
    for step in range(6):
        if step == 4:
            model["blocks"][99]["c"][1] = new = arr(1)
            reference["blocks"][99]["c"][1] = new.copy()
        grads = {"blocks": [{"a": {"w": arr(3, 2), "b": arr(2)}, "c": [arr(4), arr(1)]} for _ in range(100)]}
        state, model = opt.update_(state, model, grads)
        ref_state, reference = opt.update(ref_state, reference, copy.deepcopy(grads))
        for x, y in zip(opt.trainables(model), opt.trainables(reference), strict=True):
            np.testing.assert_array_equal(x, y)
    assert model["blocks"][99]["c"][1] is new
    assert replays[1:] == [True, True, True, False, True]
