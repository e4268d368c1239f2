"""bfloat16 parameters without a master copy: `ops.bfloat16_rounded` against the float8-free
definition (bits and a hash written out in Python integers), `StochasticRounding` and
`KahanSummation` against explicit loops, on NumPy, PyTorch and JAX, with flat buffers, `jit`
and checkpoints."""

from __future__ import annotations

import numpy as np
import pytest

import optimisers as opt
from optimisers import ops

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
ml_dtypes = pytest.importorskip("ml_dtypes")
jnp = jax.numpy
BF16 = ml_dtypes.bfloat16


def to(name, x, dtype=None):
    if name == "numpy":
        return x if dtype is None else x.astype(BF16)
    if name == "torch":
        t = torch.from_numpy(np.array(x, np.float32))
        return t if dtype is None else t.to(torch.bfloat16)
    return jnp.asarray(x, None if dtype is None else jnp.bfloat16)


def host32(a):
    if isinstance(a, torch.Tensor):
        return a.detach().float().numpy()
    return np.asarray(a, np.float32)


# --- the rounding itself, from its definition ---------------------------------------------------


def fmix32(h: int) -> int:
    M = 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M
    return h ^ (h >> 16)


def stochastic_reference(x: np.ndarray, seed: int, step: int) -> np.ndarray:
    """Element by element in Python integers: up (away from zero) iff the 16 random bits are
    below the 16 bits bfloat16 drops."""
    key = fmix32((seed * 0x9E3779B9 + step) & 0xFFFFFFFF)
    out = []
    for i, bits in enumerate(x.reshape(-1).view(np.uint32).tolist()):
        random16 = fmix32((i * 0x9E3779B1 + key) & 0xFFFFFFFF) >> 16
        kept = bits & 0xFFFF0000
        out.append(kept + (0x10000 if random16 < (bits & 0xFFFF) else 0))
    return np.array(out, np.uint32).view(np.float32).reshape(x.shape)


def awkward(n=3000, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * np.exp(rng.uniform(-30, 30, n))
    exact = np.float32([1.0, -2.5, 0.0, -0.0, 1 + 2**-8, 1 + 3 * 2**-9])  # on the grid, and ties
    return np.concatenate([x.astype(np.float32), exact]).reshape(-1, 6)


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_nearest_is_the_bfloat16_cast(backend):
    x = awkward()
    expected = x.astype(BF16).astype(np.float32)
    np.testing.assert_array_equal(host32(ops.bfloat16_rounded(to(backend, x))), expected)


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_stochastic_rounding_is_its_definition_on_every_backend(backend):
    x = awkward(600)
    expected = stochastic_reference(x, seed=5, step=3)
    np.testing.assert_array_equal(host32(ops.bfloat16_rounded(to(backend, x), 5, 3)), expected)
    if backend == "jax":  # the step traced
        jitted = jax.jit(lambda a, t: ops.bfloat16_rounded(a, 5, t))(to(backend, x), jnp.int32(3))
        np.testing.assert_array_equal(host32(jitted), expected)


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
    x = np.full(200_000, 1 + 2**-10, np.float32)  # an eighth of the way from 1 to its next bfloat16
    up = 1 + 2**-7
    out = ops.bfloat16_rounded(x, seed=1, step=1)
    assert set(np.unique(out).tolist()) == {1.0, up}
    share = np.mean(out == up)
    assert abs(share - 0.125) < 4 * np.sqrt(0.125 * 0.875 / x.size)  # within four standard errors
    assert not np.array_equal(out, ops.bfloat16_rounded(x, seed=1, step=2))
    assert not np.array_equal(out, ops.bfloat16_rounded(x, seed=2, step=1))
    np.testing.assert_array_equal(out, ops.bfloat16_rounded(x, seed=1, step=1))


def test_nan_and_infinity_stay():
    x = np.float32([np.nan, np.inf, -np.inf])
    for seed in (None, 0):
        out = ops.bfloat16_rounded(x, seed, 1)
        assert np.isnan(out[0]) and out[1] == np.inf and out[2] == -np.inf


# --- StochasticRounding ------------------------------------------------------------------------


def test_stochastic_rounding_descent_is_the_explicit_loop():
    x0 = np.random.default_rng(0).standard_normal((8, 16)).astype(BF16)
    g = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)
    eta = 1e-4  # below bfloat16's resolution: plain rounding would not move most elements
    x = x0.copy()
    state = opt.setup(opt.StochasticRounding(opt.Descent(eta), seed=7), x)
    expected = x0.astype(np.float32)
    for t in range(1, 6):
        state, x = opt.update_(state, x, g.astype(BF16))
        g16 = g.astype(BF16).astype(np.float32)
        expected = stochastic_reference(expected - np.float32(eta) * g16, seed=7, step=t)
    assert x.dtype == BF16
    np.testing.assert_array_equal(x.astype(np.float32), expected)


@pytest.mark.parametrize("rule", [opt.StochasticRounding(opt.Adam(1e-3)), opt.KahanSummation(opt.Adam(1e-3))])
def test_other_dtypes_step_as_the_rule_does(rule):
    x, g = np.ones(50, np.float32), np.linspace(-1, 1, 50).astype(np.float32)
    state, y = opt.update(opt.setup(rule, x), x, g)
    _, expected = opt.update(opt.setup(opt.Adam(1e-3), x), x, g)
    np.testing.assert_array_equal(y, expected)
    assert opt.setup(rule, x).tree.state[2] is None


def bf16_run(rule, backend, steps=200, jit=False):
    x = to(backend, np.ones(512, np.float32), "bf16")
    g = to(backend, np.linspace(0.5, 1.5, 512).astype(np.float32), "bf16")
    state = opt.setup(rule, x)
    step = jax.jit(opt.update) if jit else opt.update_
    for _ in range(steps):
        state, x = step(state, x, g)
    return state, host32(x)


def test_small_updates_accumulate_in_expectation():
    g = np.linspace(0.5, 1.5, 512).astype(BF16).astype(np.float32)
    exact = 1 - 200 * 1e-4 * g  # float32 Descent, 200 steps of 1e-4·g
    _, plain = bf16_run(opt.Descent(1e-4), "numpy")
    _, rounded = bf16_run(opt.StochasticRounding(opt.Descent(1e-4)), "numpy")
    _, kahan = bf16_run(opt.KahanSummation(opt.Descent(1e-4)), "numpy")
    assert np.all(plain == 1.0)  # each update is below half a bfloat16 ulp of 1: lost
    # a random walk of 200 roundings, each off by under one ulp (2^-8 below 1): about 0.02 apart
    # per element, but right on average where plain rounding is off by 0.02 everywhere
    assert abs(np.mean(rounded - exact)) < 0.1 * np.mean(np.abs(plain - exact))
    assert np.max(np.abs(rounded - exact)) < 0.1
    assert np.max(np.abs(kahan - exact)) <= 2**-8  # within one bfloat16 ulp, every element


@pytest.mark.parametrize("wrapper", [opt.StochasticRounding, opt.KahanSummation])
def test_backends_and_jit_agree_bit_for_bit(wrapper):
    rule = wrapper(opt.Adam(1e-3))
    _, reference = bf16_run(rule, "numpy", steps=20)
    _, on_torch = bf16_run(rule, "torch", steps=20)
    _, jitted = bf16_run(rule, "jax", steps=20, jit=True)
    np.testing.assert_array_equal(on_torch, reference)
    np.testing.assert_allclose(jitted, reference, rtol=0, atol=2**-7)  # XLA's Adam rounds its own way


def test_stochastic_rounding_is_the_same_with_flat_buffers():
    from optimisers.torch import flatten_

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4)).to(torch.bfloat16)

    results = []
    for flat in (False, True):
        m = model()
        if flat:
            flatten_(m)
        state = opt.setup(opt.StochasticRounding(opt.Adam(1e-3), seed=3), m)
        for _ in range(3):
            m.zero_grad()
            m(torch.ones(2, 16, dtype=torch.bfloat16)).float().sum().backward()
            state, m = opt.update_(state, m, opt.grads(m))
        results.append([p.detach().float().numpy().copy() for p in m.parameters()])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_kahan_summation_is_the_explicit_loop():
    x0 = np.random.default_rng(2).standard_normal(64).astype(np.float16)
    g = np.random.default_rng(3).standard_normal(64).astype(np.float16)
    state, x = opt.setup(opt.KahanSummation(opt.Descent(1e-3)), x0.copy()), x0.copy()
    xs, c = x0.astype(np.float32), np.zeros(64, np.float16)
    for _ in range(10):
        state, x = opt.update_(state, x, g)
        s = c.astype(np.float32) - np.float32(1e-3) * g.astype(np.float32)
        new = (xs + s).astype(np.float16).astype(np.float32)
        c = (s - (new - xs)).astype(np.float16)
        xs = new
    assert x.dtype == np.float16 and state.tree.state[1].dtype == np.float16
    np.testing.assert_array_equal(x.astype(np.float32), xs)
    np.testing.assert_array_equal(state.tree.state[1], c)


# --- jit, checkpoints --------------------------------------------------------------------------


@pytest.mark.parametrize("wrapper", [opt.StochasticRounding, opt.KahanSummation])
def test_jit_compiles_once(wrapper):
    traces = []

    def step(s, p, g):
        traces.append(1)
        return opt.update(s, p, g)

    x = jnp.ones(64, jnp.bfloat16)
    state = opt.setup(wrapper(opt.Adam(1e-3)), {"w": x, "b": jnp.zeros(3)})
    jitted = jax.jit(step)
    for _ in range(3):
        grads = {"w": jnp.ones(64, jnp.bfloat16), "b": jnp.ones(3)}
        state, params = jitted(state, {"w": x, "b": jnp.zeros(3)}, grads)
    assert len(traces) == 1 and params["w"].dtype == jnp.bfloat16


@pytest.mark.parametrize("wrapper", [opt.StochasticRounding, opt.KahanSummation])
def test_checkpoints_resume_bit_for_bit(wrapper, tmp_path):
    rule = wrapper(opt.Adam(1e-3))
    x = torch.ones(256, dtype=torch.bfloat16)
    g = torch.linspace(-1, 1, 256).to(torch.bfloat16)
    state = opt.setup(rule, x)
    for _ in range(3):
        state, x = opt.update_(state, x, g)
    opt.save(tmp_path / "s.npz", state)
    resumed = opt.load(tmp_path / "s.npz", opt.setup(rule, x.clone()))
    y = x.clone()
    for _ in range(3):
        state, x = opt.update_(state, x, g)
        resumed, y = opt.update_(resumed, y, g)
    assert torch.equal(x, y)


def test_bad_input():
    with pytest.raises(TypeError, match="rule must be an optimisers.Rule"):
        opt.StochasticRounding(opt.Adam)
    with pytest.raises(TypeError, match="seed must be an integer"):
        opt.StochasticRounding(opt.Adam(), seed=0.5)
    with pytest.raises(TypeError, match="rule must be an optimisers.Rule"):
        opt.KahanSummation("adam")
