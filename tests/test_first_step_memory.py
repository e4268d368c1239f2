"""The first `update_` after `setup`, a `deepcopy` or a load needs no copy of the state: the
engine keeps a large parameter's own state arrays as its buffers (the state is counted once), and
only arrays that no other State can see are taken that way. benchmarks/memory.py measures the
same at benchmark sizes, beside torch.optim's fused Adam."""

from __future__ import annotations

import copy
import gc
import tracemalloc

import numpy as np
import pytest

import optimisers as opt
from optimisers.core.state import flatten_state


def model_and_grads(make=lambda a: a, seed=0):
    """Two large matrices (one of them tied) and 64 small vectors: large members keep their own
    arrays, the small ones are packed into runs."""
    rng = np.random.default_rng(seed)
    w = make(rng.standard_normal((512, 512)).astype(np.float32))
    model = {"embed": w, "mlp": make(rng.standard_normal((512, 384)).astype(np.float32)),
             "biases": [make(rng.standard_normal(256).astype(np.float32)) for _ in range(64)],
             "unembed": w}

    def grads():
        g = {k: make(rng.standard_normal(np.shape(v)).astype(np.float32)) for k, v in model.items()
             if k != "biases"}
        g["biases"] = [make(rng.standard_normal(256).astype(np.float32)) for _ in range(64)]
        return g

    return model, grads


def param_bytes(model) -> int:
    return sum(int(x.nbytes) for x in opt.trainables(model))


def state_bytes(state) -> int:
    return sum(int(v.nbytes) for v in opt.state_dict(state).values() if getattr(v, "ndim", 0) > 0)


def numpy_peak(call):
    """Bytes held at the peak of `call()` above what was held before it, bytes it leaves held,
    and its result."""
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    result = call()
    peak = tracemalloc.get_traced_memory()[1] - before
    gc.collect()
    return peak, tracemalloc.get_traced_memory()[0] - before, result


def loaded(state, model):
    saved = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in opt.state_dict(state).items()}
    return opt.load_state_dict(opt.setup(opt.Adam(1e-3), model), saved)


@pytest.mark.parametrize("start", ["setup", "deepcopy", "load"])
def test_numpy_first_step_needs_no_more_than_a_steady_step(start, compiled_kernels):
    """Before, the first update_ copied the whole state into the engine's buffers (2x the
    parameters for Adam on top of a steady step's temporaries)."""
    tracemalloc.start()
    try:
        model, grads = model_and_grads()
        g = grads()
        n = param_bytes(model)
        if start == "setup":
            peak, kept, (state, model) = numpy_peak(
                lambda: opt.update_(opt.setup(opt.Adam(1e-3), model), model, g)
            )
            made = state_bytes(state)  # the state itself, made inside the measured call
        else:
            state = opt.setup(opt.Adam(1e-3), model)
            state, model = opt.update_(state, model, g)
            state = copy.deepcopy(state) if start == "deepcopy" else loaded(state, model)
            peak, kept, (state, model) = numpy_peak(lambda: opt.update_(state, model, g))
            made = 0
        for _ in range(2):
            state, model = opt.update_(state, model, g)
        steady, _, _ = numpy_peak(lambda: opt.update_(state, model, g))
    finally:
        tracemalloc.stop()
    # what the first step keeps besides the state: the buffer that sums the tied embedding's
    # two gradients at every step (made once), and the plan with each array's marks (with numba,
    # its header read in bulk: about 100 bytes, kept as read and as compared); no copy of the state
    tied = model["embed"].nbytes
    marks = 256 * len(opt.trainables(model))
    assert kept - made <= tied + 0.05 * n + marks, (kept - made) / n
    # beyond a steady step's temporaries (which vary with the threads' timing): small parameters'
    # state packed a run at a time, and the plan; a copy of the state would be 2x
    assert peak - kept <= steady + 0.2 * n, ((peak - kept) / n, steady / n)


def _torch_peak(call):
    """Peak bytes the torch allocator held during `call()` above what it held before."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    level = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for e in sorted(events, key=lambda e: e.start_ns()):
        level += e.nbytes()
        peak = max(peak, level)
    assert events
    return peak


@pytest.mark.parametrize("start", ["setup", "deepcopy", "load"])
def test_torch_first_step_peak_is_a_small_part_of_the_parameters(start):
    torch = pytest.importorskip("torch")
    model, grads = model_and_grads(torch.from_numpy)
    g = grads()
    n = param_bytes(model)
    state = None
    if start != "setup":
        state = opt.setup(opt.Adam(1e-3), model)
        for _ in range(2):
            state, model = opt.update_(state, model, g)
        if start == "deepcopy":
            state = copy.deepcopy(state)
        else:
            saved = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                     for k, v in opt.state_dict(state).items()}
            state = opt.load_state_dict(opt.setup(opt.Adam(1e-3), model), saved)
            del saved
    holder = [state, model]

    def first_step():
        if holder[0] is None:
            holder[0] = opt.setup(opt.Adam(1e-3), holder[1])
        holder[0], holder[1] = opt.update_(holder[0], holder[1], g)

    peak = _torch_peak(first_step)
    made = state_bytes(holder[0]) if start == "setup" else 0
    made += model["embed"].nbytes  # the tied embedding's gradient-sum buffer, kept between steps
    assert peak - made <= 0.25 * n, (peak - made) / n


# --- only arrays that no other State sees are stepped in place ------------------------------------


def arrays_of(state):
    out: list = []
    for leaf in _leaves(state):
        parts: list = []
        flatten_state(leaf.state, parts)
        out.extend(np.array(p, copy=True) for p in parts if isinstance(p, np.ndarray))
    return out


def _leaves(state):
    tree = state.tree if isinstance(state, opt.State) else state
    if isinstance(tree, opt.Leaf):
        return [tree]
    values = tree.values() if isinstance(tree, dict) else tree
    return [leaf for v in values for leaf in _leaves(v)]


@pytest.mark.parametrize("make", ["adjust", "update", "assigned"])
def test_update_in_place_never_writes_arrays_another_state_holds(make):
    """`adjust` and the pure `update` give States that share unchanged arrays with their input,
    and a user's arrays given as a Leaf's state are theirs: the engine copies these."""
    model, grads = model_and_grads()
    original = opt.setup(opt.Adam(1e-3), model)
    if make == "adjust":
        other = opt.adjust(original, 2e-3)
    elif make == "update":  # mlp gets no gradient: its Leaf keeps its arrays
        g = grads()
        g["mlp"] = None
        other, model = opt.update(original, model, g)
    else:
        other, users = copy.deepcopy(original), []
        for leaf in _leaves(other):
            m, v, t = leaf.state
            leaf.state = (np.ones_like(m), np.ones_like(v), t)
            users.extend(leaf.state[:2])
    before = arrays_of(original)
    reference_state, reference_model = copy.deepcopy(other), copy.deepcopy(model)
    for _ in range(2):
        g = grads()
        other, model = opt.update_(other, model, g)
        reference_state, reference_model = opt.update(reference_state, reference_model, g)
    if make != "assigned":
        for p, q in zip(before, arrays_of(original)):
            np.testing.assert_array_equal(p, q)
    else:  # the user's arrays themselves: unchanged, the Leafs hold the steps' new state
        assert all((p == 1).all() for p in users)
    for x, y in zip(opt.trainables(model), opt.trainables(reference_model)):
        np.testing.assert_array_equal(x, y)
    for p, q in zip(arrays_of(other), arrays_of(reference_state)):
        np.testing.assert_array_equal(p, q)


def test_state_arrays_that_alias_each_other_are_copied():
    """A hand-made state whose two arrays are one array: stepped in place as one buffer, the
    second write would overwrite the first; the engine gives the pure step's numbers."""
    model, grads = model_and_grads()
    state = opt.setup(opt.Adam(1e-3), model)
    for leaf in _leaves(state):
        m, v, t = leaf.state
        leaf.state = (m, m, t)  # both zero: Adam's m and v start equal
        leaf._owns = True  # as if setup had made it: only the aliasing check stands in the way
    reference_state, reference_model = copy.deepcopy(state), copy.deepcopy(model)
    for _ in range(3):
        g = grads()
        state, model = opt.update_(state, model, g)
        reference_state, reference_model = opt.update(reference_state, reference_model, g)
    for x, y in zip(opt.trainables(model), opt.trainables(reference_model)):
        np.testing.assert_array_equal(x, y)
    for p, q in zip(arrays_of(state), arrays_of(reference_state)):
        np.testing.assert_array_equal(p, q)


def test_a_deepcopy_steps_independently_of_its_original():
    model, grads = model_and_grads()
    state = opt.setup(opt.Adam(1e-3), model)
    state, model = opt.update_(state, model, grads())
    copied, copied_model = copy.deepcopy(state), copy.deepcopy(model)
    before = arrays_of(state)
    copied, copied_model = opt.update_(copied, copied_model, grads())
    for p, q in zip(before, arrays_of(state)):
        np.testing.assert_array_equal(p, q)
    assert not any(np.array_equal(p, q) for p, q in zip(before, arrays_of(copied)) if p.ndim > 0)


def test_copies_that_share_arrays_do_not_step_each_other():
    """A shallow copy of a Leaf, and two States copied together that shared arrays (one made
    from the other by `adjust`), share arrays in the copy as well: stepping one in place must
    not move the other."""
    model, grads = model_and_grads()
    original = opt.setup(opt.Adam(1e-3), model)
    adjusted = opt.adjust(original, 2e-3)
    pair = copy.deepcopy((original, adjusted))
    shallow = copy.copy(pair[0]["mlp"])
    for stepped, watched in [(pair[1], pair[0]), (opt.State({"mlp": shallow}), pair[0])]:
        before = arrays_of(watched)
        m = {"mlp": model["mlp"].copy()} if "embed" not in stepped.tree else copy.deepcopy(model)
        g = grads()
        opt.update_(stepped, m, {k: g[k] for k in m})
        for p, q in zip(before, arrays_of(watched)):
            np.testing.assert_array_equal(p, q)


@pytest.mark.parametrize("kind", ["adapter", "dropin"])
@pytest.mark.parametrize("start", ["first-gradient", "load"])
def test_torch_optimizer_first_step_keeps_the_state_it_makes(kind, start):
    """The adapter makes a parameter's state at its first gradient, and a load decodes copies: in
    both cases the engine takes those arrays as its buffers instead of copying them again."""
    torch = pytest.importorskip("torch")
    import optimisers.torch as ot

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(512, 512)), torch.nn.Parameter(torch.randn(512, 384))]
    params += [torch.nn.Parameter(torch.randn(256)) for _ in range(64)]
    n = sum(p.numel() * p.element_size() for p in params)

    def make():
        if kind == "adapter":
            return ot.Optimizer(params, opt.Adam(1e-3))
        return ot.AdamW(params, lr=1e-3)

    def step(optimizer):
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()

    optimizer = make()
    if start == "load":
        step(optimizer)
        saved = copy.deepcopy(optimizer.state_dict())
        optimizer = make()
        optimizer.load_state_dict(saved)
        del saved
        made = 0
    else:
        made = 2 * n  # Adam's two moments, made by this step
    for p in params:
        p.grad = torch.randn_like(p)
    peak = _torch_peak(optimizer.step)
    assert peak - made <= 0.25 * n, (peak - made) / n
