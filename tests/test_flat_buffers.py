"""Parameters that are views of one flat buffer (a span): the engine steps the buffer itself.

NumPy models built over one array and torch models moved by `optimisers.torch.flatten_` must give
the numbers of the per-array path bit for bit (and torch.optim's, where its kernels agree), take
the span path, and fall back to the general path on every change a user can make between steps.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

import optimisers as opt
from optimisers.engine.plan import PLANS

SIZES = [(3, 5), (7,), (11, 13), (1,), (64,), (2, 3, 4)] * 5


def _views(values, base):
    """Each of `values` copied into `base` back to back; the views, in order."""
    out, at = [], 0
    for v in values:
        view = base[at : at + v.size].reshape(v.shape)
        view[...] = v
        out.append(view)
        at += v.size
    return out


def _numpy_flat(seed=0, dtype=np.float32):
    """`(model, gradient views, the flat gradient buffer)`: a list of views of one buffer."""
    rng = np.random.default_rng(seed)
    values = [rng.standard_normal(s).astype(dtype) for s in SIZES]
    total = sum(v.size for v in values)
    model = _views(values, np.empty(total, dtype))
    gbase = np.zeros(total, dtype)
    grads = _views([np.zeros(s, dtype) for s in SIZES], gbase)
    return model, grads, gbase


def _span_groups(state):
    return [g for g in PLANS[state].groups if g.span is not None]


NUMPY_RULES = {
    "adam": lambda: opt.Adam(1e-2),
    "adamw": lambda: opt.AdamW(1e-2, lambd=0.1),
    "momentum": lambda: opt.Momentum(1e-2, 0.9),
    "lion": lambda: opt.Lion(1e-3),
    "descent": lambda: opt.Descent(0.1),
}


@pytest.mark.parametrize("chunks", ["default", "tiny"])
@pytest.mark.parametrize("rule", list(NUMPY_RULES))
def test_numpy_span_equals_per_array_path(rule, chunks, replays, request):
    if chunks == "tiny":
        request.getfixturevalue("tiny_chunks")  # a span cut into many chunks
    model, grads, gbase = _numpy_flat()
    reference = [x.copy() for x in model]  # separate arrays: no span
    state = opt.setup(NUMPY_RULES[rule](), model)
    ref_state = opt.setup(NUMPY_RULES[rule](), reference)
    rng = np.random.default_rng(1)
    held = list(model)
    for _ in range(5):
        gbase[...] = rng.standard_normal(gbase.shape).astype(gbase.dtype)
        state, model = opt.update_(state, model, grads)
        ref_state, reference = opt.update(ref_state, reference, [g.copy() for g in grads])
        for x, y in zip(model, reference, strict=True):
            np.testing.assert_array_equal(x, y)
    assert all(x is y for x, y in zip(model, held))  # stepped in place
    assert len(_span_groups(state)) == 1
    assert replays[1:] == [True] * 4  # steps 2-5 followed the route, on the span's checks
    # the state reads as per-array state
    for a, b in zip(opt.state_dict(state).values(), opt.state_dict(ref_state).values()):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_numpy_span_state_is_made_flat_and_kept():
    """`setup` makes the state of a span as views of one buffer per state array, and the first
    step keeps that buffer (no copy of the whole state, which would hold it twice)."""
    model, grads, gbase = _numpy_flat()
    state = opt.setup(opt.Adam(1e-2), model)
    m_views = [state[i].state[0] for i in range(len(model))]
    assert all(np.shares_memory(m_views[0].base, m) for m in m_views)
    gbase[...] = 0.25
    state, model = opt.update_(state, model, grads)
    (group,) = _span_groups(state)
    assert np.shares_memory(group.packed[0], m_views[0].base)  # the buffer setup made
    assert all(np.shares_memory(state[i].state[0], m) for i, m in enumerate(m_views))


def _numpy_pair(rule="adam"):
    model, grads, gbase = _numpy_flat()
    reference = [x.copy() for x in model]
    return (opt.setup(NUMPY_RULES[rule](), model), model, grads, gbase), (
        opt.setup(NUMPY_RULES[rule](), reference),
        reference,
    )


def _step_both(ours, ref, grads_for_ours, grads_for_ref):
    state, model = opt.update_(ours[0], ours[1], grads_for_ours)
    ref_state, reference = opt.update(ref[0], ref[1], grads_for_ref)
    for x, y in zip(model, reference, strict=True):
        np.testing.assert_array_equal(x, y)
    return (state, model, *ours[2:]), (ref_state, reference)


@pytest.mark.parametrize(
    "change",
    [
        "fresh gradients",
        "gradient views moved",
        "parameter replaced",
        "frozen member",
        "gradients are parameters",
    ],
)
def test_numpy_span_changes_between_steps(change):
    ours, ref = _numpy_pair()
    rng = np.random.default_rng(3)
    gbase = ours[3]
    for step in range(6):
        gbase[...] = rng.standard_normal(gbase.shape).astype(gbase.dtype)
        grads = ours[2]
        if step >= 2:
            if change == "fresh gradients":  # separate arrays: joined for the step
                grads = [g.copy() for g in grads]
            elif change == "gradient views moved":  # views of another buffer, same values
                grads = _views(grads, np.empty_like(gbase))
            elif change == "parameter replaced" and step == 2:
                ours[1][4] = ours[1][4].copy()
            elif change == "frozen member" and step == 2:
                opt.freeze_(ours[0][4])
                opt.freeze_(ref[0][4])
            elif change == "gradients are parameters":  # each gradient is its parameter
                grads = ours[1]
        ref_grads = [x.copy() for x in ref[1]] if grads is ours[1] else [g.copy() for g in grads]
        ours, ref = _step_both(ours, ref, grads, ref_grads)


def _outcome(call):
    """What `call()` did: its exception's type and message, or None."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - compared, not hidden
        return type(e), str(e)
    return None


IN_PLACE_CHANGES = {  # what a user can set on an ndarray that stays the same object
    "parameter reshaped": lambda xs, gs: setattr(xs[2], "shape", (13, 11)),
    "parameter read-only": lambda xs, gs: setattr(xs[2].flags, "writeable", False),
    "parameter dtype": lambda xs, gs: setattr(xs[4], "dtype", np.int32),
    "gradient reshaped": lambda xs, gs: setattr(gs[2], "shape", (13, 11)),
    "gradient dtype": lambda xs, gs: setattr(gs[4], "dtype", np.int32),
}


@pytest.mark.parametrize("change", list(IN_PLACE_CHANGES))
def test_numpy_span_sees_in_place_changes_as_separate_arrays_do(change, numpy_marks, replays):
    """A span's checks read marks of each view, not every attribute: a change set in place on a
    view (the same object) must give what it gives to separate arrays, error or numbers; with the
    marks read in one compiled call and without."""
    ours, _ = _numpy_pair()
    theirs = [x.copy() for x in ours[1]], [g.copy() for g in ours[2]]
    ref_state = opt.setup(opt.Adam(1e-2), theirs[0])
    gbase = ours[3]
    for step in range(3):
        gbase[...] = np.float32(0.25 * (step + 1))
        for g in theirs[1]:
            g[...] = np.float32(0.25 * (step + 1))
        opt.update_(ours[0], ours[1], ours[2])
        opt.update_(ref_state, *theirs)
    assert replays[-1] is True  # on the span's checks
    IN_PLACE_CHANGES[change](*ours[1:3])
    IN_PLACE_CHANGES[change](*theirs)
    before = [x.copy() for x in ours[1]]
    got = _outcome(lambda: opt.update_(ours[0], ours[1], ours[2]))
    assert got == _outcome(lambda: opt.update_(ref_state, *theirs))
    assert replays[-1] is False  # the span's checks saw it
    if got is not None:  # refused: nothing changed
        for x, y in zip(ours[1], before):
            np.testing.assert_array_equal(x, y)
    for x, y in zip(ours[1], theirs[0], strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("tied_at", [0, 7, len(SIZES) - 1])
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_span_with_a_tied_member_steps_in_pieces(backend, tied_at):
    """A member at a second place has a second gradient: its summed gradient is its own array,
    and the kernel steps the span in pieces around it (no copy of the other gradients), with the
    numbers of separate arrays: bit for bit on NumPy; on torch to the rounding of its fused
    kernel, which takes a tensor's last elements on another path."""
    model, grads, gbase = _numpy_flat()
    reference = [x.copy() for x in model]
    if backend == "torch":  # views of one tensor each: the parameters, and the gradients
        torch = pytest.importorskip("torch")
        as_torch = torch.from_numpy
        model = [as_torch(np.concatenate([x.ravel() for x in model]))]
        model = [v.view(x.shape) for v, x in zip(model[0].split([x.size for x in reference]), reference)]
        grads = [v.view(s) for v, s in zip(as_torch(gbase).split([g.size for g in grads]), SIZES)]
        reference = [as_torch(x) for x in reference]
    else:
        as_torch = None
    rule = opt.AdamW(1e-2, lambd=0.1)
    tree, ref_tree = {"ps": model, "tie": model[tied_at]}, {"ps": reference, "tie": reference[tied_at]}
    state, ref_state = opt.setup(rule, tree), opt.setup(rule, ref_tree)
    rng = np.random.default_rng(5)
    for _ in range(4):
        gbase[...] = rng.standard_normal(gbase.shape).astype(gbase.dtype)  # (torch's view it)
        extra = rng.standard_normal(SIZES[tied_at]).astype(np.float32)
        extra = extra if as_torch is None else as_torch(extra)
        state, tree = opt.update_(state, tree, {"ps": grads, "tie": extra})
        copies = [g.clone() if as_torch else g.copy() for g in grads]
        ref_state, ref_tree = opt.update(ref_state, ref_tree, {"ps": copies, "tie": extra})
        for x, y in zip(tree["ps"], ref_tree["ps"], strict=True):
            if as_torch is None:
                np.testing.assert_array_equal(x, y)
            else:
                np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=1e-6, atol=1e-7)
    (group,) = _span_groups(state)
    assert group.span.pieces is not None
    assert len(group.span.pieces[2]) == (2 if tied_at in (0, len(SIZES) - 1) else 3)
    assert tree["tie"] is tree["ps"][tied_at]


def test_numpy_wrong_gradient_after_span_steps_is_refused():
    ours, ref = _numpy_pair()
    gbase = ours[3]
    gbase[...] = 0.5
    for _ in range(2):
        ours, ref = _step_both(ours, ref, ours[2], [g.copy() for g in ours[2]])
    state, model, grads = ours[0], ours[1], list(ours[2])
    before = [x.copy() for x in model]
    grads[7] = np.ones((2, 2), np.float32)
    with pytest.raises(ValueError, match=r"gradient at 7 has shape \(2, 2\)"):
        opt.update_(state, model, grads)
    for x, y in zip(model, before):
        np.testing.assert_array_equal(x, y)


# --- torch -------------------------------------------------------------------------------------

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import optimisers.backends.torch as torch_backend  # noqa: E402
from optimisers.torch import SGD as DropInSGD  # noqa: E402
from optimisers.torch import AdamW as DropInAdamW  # noqa: E402
from optimisers.torch import FlatBuffers, flatten_  # noqa: E402


class TiedNet(nn.Module):
    """An embedding reused as the output layer; every size a multiple of 64 elements."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 64)
        self.body = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64))
        self.head = nn.Linear(64, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.body(self.embed(tokens)))


def _loss(model, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32, (6,), generator=g)
    return nn.functional.cross_entropy(model(tokens), torch.randint(0, 32, (6,), generator=g))


def test_flatten_moves_parameters_and_keeps_ties():
    torch.manual_seed(0)
    model = TiedNet()
    params = list(model.parameters())
    values = [p.detach().clone() for p in params]
    buffers = flatten_(model)
    assert len(buffers) == 1 and isinstance(buffers[0], FlatBuffers)
    flat = buffers[0]
    assert flat.members == params  # a tied parameter once
    assert list(model.parameters()) == params and model.head.weight is model.embed.weight
    assert flat.params.numel() == sum(p.numel() for p in params)
    for p, v in zip(params, values):
        assert torch.equal(p, v)
        assert p.untyped_storage().data_ptr() == flat.params.untyped_storage().data_ptr()
        assert p.grad is not None
        assert p.grad.untyped_storage().data_ptr() == flat.grads.untyped_storage().data_ptr()
    _loss(model, 0).backward()  # backward adds into the flat gradient
    assert torch.equal(flat.grads, torch.cat([p.grad.reshape(-1) for p in params]))
    assert flat.grads.abs().sum() > 0


def test_adamw_on_flat_buffers_equals_torch_fused_per_tensor():
    """Sizes that are multiples of 64: one fused call over the buffer equals torch.optim's fused
    AdamW over each tensor bit for bit (`optimisers.torch.flat`)."""
    torch.manual_seed(0)
    ours = TiedNet()
    theirs = copy.deepcopy(ours)
    flatten_(ours)
    o = DropInAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    t = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(5):
        for model, optimizer in ((ours, o), (theirs, t)):
            optimizer.zero_grad()
            _loss(model, step).backward()
            optimizer.step()
        for p, q in zip(ours.parameters(), theirs.parameters()):
            assert torch.equal(p, q)
    assert len(_span_groups(o._book.flat)) == 1
    assert ours.head.weight is ours.embed.weight


def test_adam_on_flat_buffers_equals_torch_fused_on_one_flat_tensor(monkeypatch):
    """Any sizes: the buffer steps as one tensor, in one call, as torch's kernel steps one
    parameter holding every element."""
    calls = []
    run = torch_backend._run_fused
    monkeypatch.setattr(
        torch_backend, "_run_fused", lambda k, a, xs, *r: (calls.append(len(xs)), run(k, a, xs, *r))
    )
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(s)) for s in SIZES]
    whole = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in ps]))
    flatten_(ps)
    state = opt.setup(opt.Adam(1e-2), ps)
    reference = torch.optim.Adam([whole], lr=1e-2, fused=True)
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        for p in ps:
            p.grad.copy_(torch.randn(p.shape, generator=g))
        whole.grad = torch.cat([p.grad.reshape(-1) for p in ps])
        state, ps = opt.update_(state, ps, [p.grad for p in ps])
        reference.step()
        assert torch.equal(torch.cat([p.detach().reshape(-1) for p in ps]), whole.detach())
    assert calls == [1] * 5  # one kernel call per step, on the whole buffer


def test_adapter_makes_a_span_state_flat():
    model = TiedNet()
    flatten_(model)
    o = DropInAdamW(model.parameters())
    _loss(model, 0).backward()
    o.step()
    (group,) = _span_groups(o._book.flat)
    states = [o.state[p] for p in model.parameters()]
    storage = group.packed[0].untyped_storage().data_ptr()
    assert all(s["exp_avg"].untyped_storage().data_ptr() == storage for s in states)


def test_sgd_on_flat_buffers_equals_sgd_per_tensor():
    """A rule without a fused kernel (the chunks step the buffer) gives the numbers of the same
    optimizer over separate tensors bit for bit, and torch.optim.SGD's to rounding."""
    torch.manual_seed(0)
    ours = TiedNet()
    separate, theirs = copy.deepcopy(ours), copy.deepcopy(ours)
    flatten_(ours)
    kw = dict(lr=0.1, momentum=0.9, weight_decay=1e-3)
    pairs = [
        (ours, DropInSGD(ours.parameters(), **kw)),
        (separate, DropInSGD(separate.parameters(), **kw)),
        (theirs, torch.optim.SGD(theirs.parameters(), **kw)),
    ]
    for step in range(5):
        for model, optimizer in pairs:
            optimizer.zero_grad()
            _loss(model, step).backward()
            optimizer.step()
        for p, q, r in zip(ours.parameters(), separate.parameters(), theirs.parameters()):
            assert torch.equal(p, q)
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-5)
    assert len(_span_groups(pairs[0][1]._book.flat)) == 1 and not _span_groups(pairs[1][1]._book.flat)


def test_zero_grad_keeps_the_views():
    model = TiedNet()
    flatten_(model)
    o = DropInAdamW(model.parameters())
    _loss(model, 0).backward()
    grads = [p.grad for p in model.parameters()]
    for set_to_none in (True, False):
        o.zero_grad(set_to_none=set_to_none)
        assert all(p.grad is g for p, g in zip(model.parameters(), grads))
        assert all(torch.count_nonzero(g) == 0 for g in grads)
    extra = nn.Parameter(torch.ones(3))  # not moved: torch.optim's behaviour
    extra.grad = torch.ones(3)
    o.add_param_group({"params": [extra]})
    o.zero_grad()
    assert extra.grad is None and all(p.grad is g for p, g in zip(model.parameters(), grads))


@pytest.mark.parametrize("change", ["module zero_grad", "double", "data swap"])
def test_flat_model_changed_between_steps(change):
    """Gradients dropped by torch's `model.zero_grad()`, a `.double()`, a `.data` swap: the steps
    still equal the same optimizer's over an unflattened copy bit for bit, and torch.optim's fused
    AdamW (which cannot step a model made double after its state)."""
    torch.manual_seed(0)
    ours = TiedNet()
    separate, theirs = copy.deepcopy(ours), copy.deepcopy(ours)
    flatten_(ours)
    models = [ours, separate] + ([theirs] if change != "double" else [])
    optimizers = [DropInAdamW(m.parameters(), lr=1e-2) for m in (ours, separate)]
    optimizers += [torch.optim.AdamW(theirs.parameters(), lr=1e-2, fused=True)][: len(models) - 2]
    for step in range(6):
        if step == 3:
            if change == "double":
                ours.double()
                separate.double()
            elif change == "data swap":
                ours.body[0].weight.data = ours.body[0].weight.data.clone()
        for model, optimizer in zip(models, optimizers):
            (model.zero_grad if change == "module zero_grad" and model is ours else optimizer.zero_grad)()
            _loss(model, step).backward()
            optimizer.step()
        for others in models[1:]:
            for p, q in zip(ours.parameters(), others.parameters()):
                assert p.dtype == q.dtype and torch.equal(p, q)


def test_flatten_leaves_what_it_cannot_move():
    frozen = nn.Parameter(torch.ones(4), requires_grad=False)
    channels_last = nn.Parameter(torch.randn(2, 3, 4, 4).contiguous(memory_format=torch.channels_last))
    moved = nn.Parameter(torch.randn(5))
    before = {id(p): p.data_ptr() for p in (frozen, channels_last)}
    (flat,) = flatten_([frozen, channels_last, moved])
    assert flat.members == [moved]
    assert all(p.data_ptr() == before[id(p)] for p in (frozen, channels_last))
    assert frozen.grad is None and channels_last.grad is None


def test_flatten_refuses_parameters_that_share_memory():
    base = torch.randn(10)
    a, b = nn.Parameter(base[:6]), nn.Parameter(base[4:])
    ptrs = (a.data_ptr(), b.data_ptr())
    with pytest.raises(ValueError, match="shares memory"):
        flatten_([a, b])
    assert (a.data_ptr(), b.data_ptr()) == ptrs and a.grad is None  # nothing moved


def test_flatten_an_optimizer_makes_buffers_per_param_group():
    model = TiedNet()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    o = DropInAdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}])
    buffers = flatten_(o)
    assert [b.members for b in buffers] == [decay, rest]
    _loss(model, 0).backward()
    o.step()
    assert len(_span_groups(o._book.flat)) == 2  # each group's rule steps its own buffer


def _swap(a, b, name):
    """Swap the attribute `name` (`data` or `grad`) of the tensors `a` and `b`."""
    x, y = getattr(a, name), getattr(b, name)
    setattr(a, name, y)
    setattr(b, name, x)


def _set_elsewhere(p):
    with torch.no_grad():
        p.set_(p.detach().clone())


TORCH_SPAN_CHANGES = {  # what a user can do to flattened parameters or their gradients between steps
    "parameters swap their data": lambda ps: _swap(ps[1], ps[2], "data"),  # (one storage)
    "parameter moved": lambda ps: setattr(ps[3], "data", ps[3].data.clone()),
    "parameter set_ elsewhere": lambda ps: _set_elsewhere(ps[4]),
    "gradients swap their data": lambda ps: _swap(ps[5].grad, ps[6].grad, "data"),  # (one storage)
    "gradient moved": lambda ps: setattr(ps[7].grad, "data", ps[7].grad.data.clone()),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bulk", [True, False], ids=["tensor guard", "attributes"])
@pytest.mark.parametrize("change", list(TORCH_SPAN_CHANGES))
def test_torch_span_sees_each_change_as_separate_tensors_do(change, bulk, dtype, replays, monkeypatch):
    """After `flatten_` a later step checks where each parameter and gradient is (`unchanged`,
    with torch's tensor guard or reading attributes): a change that leaves a tensor in the same
    storage at another offset, or moves it elsewhere, steps as separate tensors do (float32 and
    bfloat16). Every size is a multiple of 64 elements, so torch's fused kernel gives the same
    numbers for the buffer and for each tensor."""
    if not bulk:
        monkeypatch.setattr(torch_backend, "_tensor_guard", lambda: None)
    torch.manual_seed(0)
    shapes = [(8, 8), (64,), (64,), (4, 16), (64,), (2, 32), (2, 32), (64,)]
    ours = [nn.Parameter(torch.randn(s).to(dtype)) for s in shapes]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    flatten_(ours)
    state, ref_state = opt.setup(opt.Adam(1e-2), ours), opt.setup(opt.Adam(1e-2), theirs)
    for step in range(5):
        if step == 4:
            TORCH_SPAN_CHANGES[change](ours)
            TORCH_SPAN_CHANGES[change](theirs)
        g = torch.Generator().manual_seed(step)
        for p, q in zip(ours, theirs):  # (ours: into the same `.grad` tensors, as backward adds)
            q.grad = torch.randn(p.shape, generator=g).to(dtype)
            p.grad.copy_(q.grad)
        state, ours = opt.update_(state, ours, [p.grad for p in ours])
        ref_state, theirs = opt.update_(ref_state, theirs, [q.grad for q in theirs])
        for p, q in zip(ours, theirs, strict=True):
            assert torch.equal(p, q)
        if step == 3:  # (`replays` holds both States' steps, turn by turn)
            assert replays[4::2] == [True, True] and len(_span_groups(state)) == 1


