"""Memory of a step: the pure `update` steps large parameters chunk by chunk (the step and the
rule's temporaries never exist at full size), `update_` runs chains led by ClipNorm in the engine,
and both give exactly the numbers of the rule's whole-array maths. benchmarks/memory.py measures
the same at benchmark sizes."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

import optimisers as opt
import optimisers.engine.chunks as _engine_chunks
import optimisers.engine.compiled as _engine_compiled
from optimisers.core.state import flatten_state

RULES = [
    opt.Adam(0.01),
    opt.AdamW(0.01, lambd=0.1),
    opt.Lion(0.01),
    opt.OptimiserChain(opt.ClipNorm(1.0), opt.Adam(0.01)),
    opt.OptimiserChain(opt.ClipGrad(0.5), opt.WeightDecay(0.01), opt.Adam(0.01)),
    opt.OptimiserChain(opt.AccumGrad(2), opt.Momentum(0.01)),  # no step on odd calls
    opt.MixedPrecision(opt.Adam(0.01), np.float64),  # sets the value (NewValue), wider state
]


def whole_array_step(rule, state, x, g):
    """The rule's own maths on whole arrays, written out here: what every path must equal."""
    new_state, step = rule.apply(state, x, g)
    if step is None:
        return new_state, x.copy()
    if isinstance(step, opt.NewValue):
        return new_state, np.asarray(step.value).astype(x.dtype)
    return new_state, (x - step).astype(x.dtype)


def parts_of(state):
    parts: list = []
    flatten_state(state, parts)
    return parts


@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_pure_update_in_chunks_gives_the_whole_array_numbers(rule, monkeypatch, tiny_chunks):
    # 256-element chunks: 5 and a ragged tail
    taken = []
    real = _engine_chunks.pure_step

    def spy(*args):
        result = real(*args)
        taken.append(result is not None)
        return result

    monkeypatch.setattr(_engine_chunks, "pure_step", spy)
    monkeypatch.setattr(_engine_compiled, "ENABLED", False)  # the eager chunks, as without numba
    rng = np.random.default_rng(0)
    x = rng.standard_normal((37, 29)).astype(np.float32)
    x_orig = x.copy()
    model = {"w": x, "tied": x, "small": np.ones(3, np.float32)}
    state = opt.setup(rule, model)
    ref_state, ref_x = rule.init(x), x.copy()
    for _ in range(3):
        g1, g2 = (rng.standard_normal(x.shape).astype(np.float32) for _ in range(2))
        grads = {"w": g1, "tied": g2, "small": np.ones(3, np.float32)}
        state, model = opt.update(state, model, grads)
        ref_state, ref_x = whole_array_step(rule, ref_state, ref_x, g1 + g2)
        np.testing.assert_array_equal(model["w"], ref_x)
        assert model["w"] is model["tied"] and model["w"].dtype == np.float32
        for p, q in zip(parts_of(state["w"].state), parts_of(ref_state)):
            np.testing.assert_array_equal(p, q)
            assert np.asarray(p).dtype == np.asarray(q).dtype
    np.testing.assert_array_equal(x, x_orig)  # the caller's array untouched
    assert taken.count(True) == 3  # the chunked path stepped w (not the small one) every time


@pytest.mark.parametrize("rule", RULES[:5], ids=repr)
def test_torch_pure_update_in_chunks_gives_the_whole_array_numbers(rule, tiny_chunks):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal((37, 29)).astype(np.float32)
    x = torch.from_numpy(x0.copy())
    state = opt.setup(rule, x)
    ref_state, ref_x = rule.init(x0), x0.copy()
    for _ in range(3):
        g = rng.standard_normal(x0.shape).astype(np.float32)
        state, x = opt.update(state, x, torch.from_numpy(g))
        ref_state, ref_x = whole_array_step(rule, ref_state, ref_x, g)
        # torch and NumPy round float32 maths alike except where torch fuses (Adam's own kernel)
        np.testing.assert_allclose(x.numpy(), ref_x, rtol=1e-6, atol=1e-7)


def test_update_and_update_agree_bit_for_bit_on_a_chunked_parameter(tiny_chunks):
    rng = np.random.default_rng(1)
    rule = opt.OptimiserChain(opt.ClipNorm(2.0), opt.WeightDecay(0.01), opt.Adam(0.01))
    a = {"w": rng.standard_normal((40, 30)).astype(np.float32), "b": np.zeros(7, np.float32)}
    b = {k: v.copy() for k, v in a.items()}
    sa, sb = opt.setup(rule, a), opt.setup(rule, b)
    for _ in range(4):
        grads = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in a.items()}
        sa, a = opt.update_(sa, a, grads)
        sb, b = opt.update(sb, b, grads)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


def peak_and_kept(step, state, model, grads):
    """Bytes held at the peak of one call above the start, and bytes it leaves held."""
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    result = step(state, model, grads)
    peak = tracemalloc.get_traced_memory()[1]
    gc.collect()
    kept = tracemalloc.get_traced_memory()[0] - before
    del result
    return peak - before, kept


@pytest.mark.parametrize(
    "rule",
    [opt.Adam(1e-3), opt.OptimiserChain(opt.ClipNorm(1.0), opt.Adam(1e-3))],
    ids=repr,
)
def test_peak_memory_of_a_step(rule, compiled_kernels):
    """One 4M-element parameter (16 MB): `update_` stays well under half a parameter's bytes
    above its start (the ClipNorm chain took 6x before it ran in the engine), and the pure
    `update` holds little beyond its results (new parameter and state: 3x for Adam)."""
    tracemalloc.start()
    try:
        rng = np.random.default_rng(0)
        x = rng.standard_normal((2048, 2048)).astype(np.float32)
        g = rng.standard_normal(x.shape).astype(np.float32)
        state = opt.setup(rule, x)
        for _ in range(2):
            state, x = opt.update_(state, x, g)
        peak, kept = peak_and_kept(opt.update_, state, x, g)
        assert peak < 0.5 * x.nbytes and kept < 0.05 * x.nbytes
        pure_state = opt.update(state, x, g)[0]  # a State without engine groups
        peak, kept = peak_and_kept(opt.update, pure_state, x, g)
        assert 2.9 * x.nbytes < kept < 3.1 * x.nbytes  # the new parameter, m and v
        assert peak - kept < 0.75 * x.nbytes  # was 2x (the step and a temporary, full size)
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("rule", [opt.LAMB(), opt.LARS(), opt.Adafactor()], ids=repr)
def test_packed_members_of_a_scaled_step_need_no_staging_of_all_of_them(rule, compiled_kernels):
    """4000 vectors of 256 (4 MB): a rule that finds a factor per array first steps its packed
    members run by run, so `update_` holds a few runs' buffers, not copies of every parameter,
    gradient and direction (3.1x their bytes when they were staged at once), with new gradients
    each step; the numbers are those of the eager chunks (`test_compiled`)."""
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(256).astype(np.float32) for _ in range(4000)]
    nbytes = sum(x.nbytes for x in xs)
    tracemalloc.start()
    try:
        state = opt.setup(rule, xs)
        for _ in range(3):  # (the second compiles the route of the steps that follow)
            state, xs = opt.update_(state, xs, [rng.standard_normal(256).astype(np.float32) for _ in xs])
        grads = [rng.standard_normal(256).astype(np.float32) for _ in xs]
        peak, kept = peak_and_kept(opt.update_, state, xs, grads)
        assert peak < 0.5 * nbytes and kept < 0.05 * nbytes
    finally:
        tracemalloc.stop()


def _numpy_steps():
    model = {"a": np.ones(3, np.float32), "b": [np.ones((2, 2), np.float32)]}
    model["tied"] = model["a"]
    grads = {"a": np.ones(3, np.float32), "b": [np.ones((2, 2), np.float32)], "tied": np.ones(3, np.float32)}
    state = opt.setup(opt.Adam(1e-3), model)
    for _ in range(3):
        state, model = opt.update_(state, model, grads)  # the general path, then replays
    for _ in range(2):
        state, model = opt.update(state, model, grads)
    opt.load_state_dict(state, opt.state_dict(state))
    opt.adjust_(state, eta=1e-4)
    one = np.ones(3, np.float32)  # a model that is one array
    opt.update(opt.setup(opt.Adam(1e-3), one), one, np.ones(3, np.float32))


def _jax_steps():
    jax = pytest.importorskip("jax")
    model = {"a": jax.numpy.ones(3), "b": [jax.numpy.ones((2, 2))]}
    grads = jax.tree_util.tree_map(jax.numpy.ones_like, model)
    state = opt.setup(opt.Adam(1e-3), model)
    state, model = opt.update(state, model, grads)
    step = jax.jit(opt.update)
    for _ in range(2):
        state, model = step(state, model, grads)


def _torch_steps():
    torch = pytest.importorskip("torch")
    import optimisers.torch as ot

    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(3)]
    optimizer = ot.Adam(params, lr=1e-3)
    for _ in range(3):
        for p in params:
            p.grad = torch.ones(3)
        optimizer.step()
    optimizer.load_state_dict(optimizer.state_dict())


@pytest.mark.parametrize("steps", [_numpy_steps, _jax_steps, _torch_steps], ids=["numpy", "jax", "torch"])
def test_steps_leave_no_reference_cycles(steps):
    """setup, update, update_, state dicts and the torch drop-ins free what they made as soon as
    it is unused: a reference cycle (a recursive walk's closure) would hold parameters, gradients
    and Leafs until the garbage collector runs, and make that run cost time per array."""
    steps()  # (caches filled once: what stays is not garbage)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        steps()
        gc.collect()
        cycles = [getattr(o, "__qualname__", type(o).__qualname__) for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert cycles == []
