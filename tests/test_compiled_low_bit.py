"""`LowBit` in the compiled way (`optimisers.engine.compiled._step_quantised`): the inner rule's
step traced as any elementwise step, with the dequantising and quantising inside numba's loop, a
block at a time. Against the eager step it replaces (dequantise, the rule's own maths, quantise:
the compiled way switched off), bit for bit on NumPy: the parameter, the codes and the scales, on
every format, dtype and layout, through `update_` and `update`."""

from __future__ import annotations

import numpy as np
import pytest

import optimisers as opt
import optimisers.engine.compiled as compiled
from optimisers.backends import numba_lowering
from optimisers.core.state import flatten_state

pytest.importorskip("numba")
ml_dtypes = pytest.importorskip("ml_dtypes")

FORMATS = [8, 4, "fp8"]
RULES = {
    "adamw": lambda: opt.AdamW(1e-2, lambd=0.01),
    "lion": lambda: opt.Lion(1e-3),
    "momentum": lambda: opt.Momentum(0.01),
    "rmsprop": lambda: opt.RMSProp(1e-3),
    "ademamix": lambda: opt.AdEMAMix(1e-3),
    "decay-clip-adam": lambda: opt.OptimiserChain(opt.ClipGrad(0.5), opt.WeightDecay(0.1), opt.Adam(1e-2)),
}
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


@pytest.fixture
def runs(monkeypatch):
    """`runs()` -> how many quantised passes ran since the fixture began."""
    calls = []
    real = compiled._run_blocks
    monkeypatch.setattr(compiled, "_run_blocks", lambda *a: (calls.append(1), real(*a))[1])
    return lambda: len(calls)


def _model(dtype, rng):
    """Big enough to be quantised and split among the threads, with a short last block (and an
    odd count, for 4-bit codes); a Fortran-order matrix; a tie; a small array left in float32."""
    w = rng.standard_normal((130, 140)).astype(dtype)
    return {
        "big": rng.standard_normal(2 * 65536 + 301).astype(dtype),
        "t": np.asfortranarray(rng.standard_normal((130, 170))).astype(dtype),
        "w": w, "tied": w,
        "small": rng.standard_normal(100).astype(dtype),
    }


def _grads(model, rng, nan=False):
    out = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in model.items()}
    out["tied"] = out["w"] * 0.5  # (summed with the first place's)
    if nan:
        out["big"][7] = np.nan  # (one block's scale becomes NaN: as the quantiser makes it)
    return out


def _train(rule, bits, dtype, verb, enabled, monkeypatch, steps=3, nan=False):
    rng = np.random.default_rng(0)
    model = _model(dtype, rng)
    state = opt.setup(opt.LowBit(rule, bits=bits, min_size=4096), model)
    with monkeypatch.context() as m:
        m.setattr(compiled, "ENABLED", enabled)
        for _ in range(steps):
            state, model = getattr(opt, verb)(state, model, _grads(model, rng, nan))
    return state, model


def _parts(state, key):
    parts: list = []
    flatten_state(state[key].state, parts)
    return parts


def _assert_same_state(a, b, key):
    for p, q in zip(_parts(a, key), _parts(b, key), strict=True):
        assert type(p) is type(q), key
        if isinstance(p, opt.Quantised):
            assert (p.bits, p.signed, p.block, p.shape) == (q.bits, q.signed, q.block, q.shape)
            np.testing.assert_array_equal(p.codes, q.codes, err_msg=key)
            np.testing.assert_array_equal(p.scale, q.scale, err_msg=key)
        elif isinstance(p, np.ndarray):
            np.testing.assert_array_equal(p, q, err_msg=key)
        else:
            assert p == q, key


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("bits", FORMATS)
def test_numpy_quantised_pass_equals_the_eager_step_bit_for_bit(bits, rule, dtype, monkeypatch, runs):
    dt = DTYPES[dtype]
    eager_state, eager = _train(RULES[rule](), bits, dt, "update_", False, monkeypatch)
    assert runs() == 0
    state, fast = _train(RULES[rule](), bits, dt, "update_", True, monkeypatch)
    assert runs() >= 3 * 3, "the quantised pass did not take the big parameters' steps"
    pure_state, pure = _train(RULES[rule](), bits, dt, "update", True, monkeypatch)
    for k in ("big", "t", "w", "small"):
        assert fast[k].dtype == eager[k].dtype == dt
        np.testing.assert_array_equal(fast[k], eager[k], err_msg=k)
        np.testing.assert_array_equal(pure[k], eager[k], err_msg=k)
        _assert_same_state(state, eager_state, k)
        _assert_same_state(pure_state, eager_state, k)
    assert fast["w"] is fast["tied"] and pure["w"] is pure["tied"]
    assert any(isinstance(p, opt.Quantised) for p in _parts(state, "big"))


@pytest.mark.parametrize("bits", FORMATS)
def test_a_nan_gradient_gives_the_eager_steps_codes_and_scales(bits, monkeypatch, runs):
    eager_state, eager = _train(RULES["adamw"](), bits, np.float32, "update_", False, monkeypatch, nan=True)
    state, fast = _train(RULES["adamw"](), bits, np.float32, "update_", True, monkeypatch, nan=True)
    assert runs() > 0
    assert np.isnan(fast["big"]).any()
    np.testing.assert_array_equal(fast["big"], eager["big"])
    _assert_same_state(state, eager_state, "big")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bits", FORMATS)
def test_torch_cpu_tensors_take_the_pass_and_agree_with_the_eager_step(bits, dtype, monkeypatch, runs):
    """torch's CPU tensors go through the same loop over their memory: a channels_last weight,
    a tie, bfloat16. torch's eager maths differs from IEEE's in a last bit (its square root, see
    test_compiled), which can move a code to its neighbour: so, to a rounding, and `update`
    equals `update_` exactly."""
    torch = pytest.importorskip("torch")
    dt = getattr(torch, dtype)
    rng = np.random.default_rng(3)
    arrays = {"conv": rng.standard_normal((16, 8, 13, 13)), "lin": rng.standard_normal((64, 300))}
    grads = [{k: rng.standard_normal(v.shape) for k, v in arrays.items()} for _ in range(3)]

    def train(enabled, verb="update_"):
        model = {k: torch.nn.Parameter(torch.from_numpy(v).to(dt)) for k, v in arrays.items()}
        model["conv"].data = model["conv"].data.to(memory_format=torch.channels_last)
        model["head"] = model["lin"]
        state = opt.setup(opt.LowBit(opt.AdamW(1e-2), bits=bits), model)
        with monkeypatch.context() as m:
            m.setattr(compiled, "ENABLED", enabled)
            for g in grads:
                tg = {k: torch.from_numpy(v).to(dt) for k, v in g.items()}
                state, model = getattr(opt, verb)(state, model, {**tg, "head": tg["lin"]})
        return state, model

    eager_state, eager = train(False)
    assert runs() == 0
    state, fast = train(True)
    assert runs() == 2 * 3
    pure_state, pure = train(True, "update")
    assert fast["conv"].is_contiguous(memory_format=torch.channels_last)
    assert fast["head"] is fast["lin"] and pure["head"] is pure["lin"]
    for k in ("conv", "lin"):
        assert torch.equal(fast[k], pure[k])
        torch.testing.assert_close(fast[k], eager[k], rtol=0, atol=1e-2 * 3 * 0.05)  # (5% of a step)
        for p, q, r in zip(_parts(state, k), _parts(eager_state, k), _parts(pure_state, k), strict=True):
            if isinstance(p, opt.Quantised):
                assert torch.equal(p.codes, r.codes) and torch.equal(p.scale, r.scale)
                assert (p.codes != q.codes).double().mean() < 0.01
                torch.testing.assert_close(p.scale, q.scale, rtol=1e-2, atol=0)


def test_float64_parameters_and_a_missing_compiler_run_eagerly(monkeypatch, runs):
    rng = np.random.default_rng(1)
    x = rng.standard_normal(20000)
    state = opt.setup(opt.LowBit(opt.Adam(), bits=8), x)
    state, new = opt.update(state, x, rng.standard_normal(20000))
    assert runs() == 0 and new.dtype == np.float64  # (its state is dequantised to float64)
    monkeypatch.setattr(numba_lowering, "available", lambda: False)
    monkeypatch.setattr(numba_lowering, "_KERNELS", {})
    x = x.astype(np.float32)
    state = opt.setup(opt.LowBit(opt.Adam(), bits=8), x)
    state, _ = opt.update(state, x, np.ones(20000, np.float32))
    assert runs() == 0


def test_adjusting_reuses_the_kernel(monkeypatch, runs):
    rng = np.random.default_rng(2)
    model = {"w": rng.standard_normal(30000).astype(np.float32)}
    state = opt.setup(opt.LowBit(opt.AdamW(1e-3), bits=4), model)
    state, model = opt.update_(state, model, {"w": rng.standard_normal(30000).astype(np.float32)})
    known = len(numba_lowering._KERNELS)
    for eta in (1e-2, 3e-3):
        state = opt.adjust(state, eta=eta)
        state, model = opt.update_(state, model, {"w": rng.standard_normal(30000).astype(np.float32)})
    assert len(numba_lowering._KERNELS) == known and runs() == 3
