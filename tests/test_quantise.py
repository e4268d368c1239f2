"""`quantise` / `dequantise`: the maps against their published formulas and the oracles'
(bitsandbytes' maps and dequantisation, torchao's quantiser bit for bit), codes against an exact
nearest-value search, blocks and scales against their definition, on NumPy, PyTorch and JAX."""

from __future__ import annotations

import math

import numpy as np
import pytest

import optimisers as opt
from optimisers.core import quant_maps

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy

FORMATS = [(8, True), (8, False), (4, True), (4, False), ("fp8", True)]
BLOCK = {8: 256, 4: 128, "fp8": 256}


def to_backend(x, name):
    return {"numpy": lambda a: a, "torch": torch.from_numpy, "jax": jnp.asarray}[name](np.array(x))


def host(a):
    return a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


def values_of(bits, signed):
    if bits == "fp8":
        return quant_maps.float8_e4m3fn_values()
    if bits == 8:
        return quant_maps.dynamic_map(signed, 7, 8)
    return quant_maps.dynamic_map(True, 3, 4) if signed else quant_maps.linear_map_without_zero(4)


def unpacked(q):
    codes = host(q.codes).reshape(-1)
    if q.bits != 4:
        return codes
    return np.stack([codes >> 4, codes & 15], axis=-1).reshape(-1)[: q.size]


def mixed_magnitudes(rng, shape):
    """Values over many decades, as moments are: each row a different magnitude."""
    rows = shape[0]
    return (rng.standard_normal(shape) * np.exp(rng.uniform(-12, 4, (rows, 1)))).astype(np.float32)


# --- the maps, from their formulas -----------------------------------------------------------


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_is_the_midpoints_of_linear_fractions_in_each_decade(signed):
    values = quant_maps.dynamic_map(signed).astype(np.float64)
    expected = [0.0, 1.0]
    for i in range(7):  # decade 10^(i-6): 2^i fractions a sign (signed), 2^(i+1) (unsigned)
        n = 2**i if signed else 2 ** (i + 1)
        mids = 0.1 + 0.9 * (np.arange(n) + 0.5) / n
        expected += list(10.0 ** (i - 6) * mids)
        if signed:
            expected += list(-(10.0 ** (i - 6)) * mids)
    np.testing.assert_allclose(values, np.sort(expected), rtol=3e-7, atol=0)
    assert values.dtype == np.float64 and len(values) == 256 and np.all(np.diff(values) > 0)


def test_four_bit_maps_from_their_formulas():
    signed = quant_maps.dynamic_map(True, 3, 4).astype(np.float64)
    positive = [10.0 ** (i - 2) * (0.1 + 0.9 * (j + 0.5) / 2**i) for i in range(3) for j in range(2**i)]
    np.testing.assert_allclose(signed, np.sort([0.0, 1.0, *positive, *(-p for p in positive)]), rtol=3e-7)
    np.testing.assert_array_equal(quant_maps.linear_map_without_zero(4), np.arange(1, 17) / 16)


def test_float8_values_are_the_cast_of_every_bit_pattern():
    patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    expected = patterns.view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(quant_maps.float8_e4m3fn_values(), expected)  # NaN equal NaN


def test_maps_equal_bitsandbytes_and_torchao_bit_for_bit():
    functional = pytest.importorskip("bitsandbytes.functional")
    for signed in (True, False):
        theirs = functional.create_dynamic_map(signed=signed).numpy()
        assert theirs.tobytes() == quant_maps.dynamic_map(signed).tobytes()
    pytest.importorskip("torchao.optim")
    from torchao.optim import subclass_4bit, subclass_8bit

    pairs = [
        (subclass_8bit.get_qmap_signed(), quant_maps.dynamic_map(True)),
        (subclass_8bit.get_qmap_unsigned(), quant_maps.dynamic_map(False)),
        (subclass_4bit.get_qmap_signed(), quant_maps.dynamic_map(True, 3, 4)),
        (subclass_4bit.get_qmap_unsigned(), quant_maps.linear_map_without_zero(4)),
    ]
    for theirs, ours in pairs:
        assert np.array(theirs, np.float32).tobytes() == ours.tobytes()


# --- codes: the nearest value, exactly ---------------------------------------------------------


def nearest_codes(y, values):
    """The nearest map value's code for each of `y` by brute force, a tie to the larger code."""
    distance = np.abs(y.astype(np.float64)[:, None] - values.astype(np.float64)[None, :])
    nearest = distance == distance.min(axis=1, keepdims=True)
    return np.where(nearest, np.arange(len(values)), -1).max(axis=1)


def hard_values(values, rng):
    """Scaled values in [-1, 1] at and beside every decision point, plus random ones."""
    mids = ((values[:-1].astype(np.float64) + values[1:]) / 2).astype(np.float32)
    near = [mids, np.nextafter(mids, np.float32(2)), np.nextafter(mids, np.float32(-2)), values]
    spread = rng.uniform(-1, 1, 3000) * np.exp(rng.uniform(-25, 0, 3000))
    y = np.concatenate([*near, spread.astype(np.float32), np.float32([0.0, -0.0, 1.0, -1.0])])
    return np.clip(y, -1, 1).astype(np.float32)


@pytest.mark.parametrize("bits,signed", [f for f in FORMATS if f[0] != "fp8"])
@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_codes_are_the_nearest_value_with_ties_to_the_larger_code(bits, signed, backend):
    values = values_of(bits, signed)
    y = hard_values(values, np.random.default_rng(0))
    # a block of one element would scale each to ±1: blocks of the whole array, whose absmax is 1
    q = opt.quantise(to_backend(y, backend), bits=bits, signed=signed, block=y.size)
    assert host(q.scale).tolist() == [1.0]
    np.testing.assert_array_equal(unpacked(q), nearest_codes(y, values))


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_fp8_codes_are_the_float8_cast_ties_to_even(backend):
    magnitudes = quant_maps.float8_e4m3fn_values()[:127].astype(np.float64)
    mids = ((magnitudes[:-1] + magnitudes[1:]) / 2).astype(np.float32)  # exact: ties
    rng = np.random.default_rng(1)
    y = np.concatenate([mids, np.nextafter(mids, np.float32(0)), rng.uniform(-448, 448, 4000)])
    y = np.concatenate([y, -y, np.float32([448.0, -0.0, 0.0, 1e-30])]).astype(np.float32)
    q = opt.quantise(to_backend(y, backend), bits="fp8", block=y.size)
    assert host(q.scale)[0] == np.float32(448) / np.float32(448)
    expected = torch.from_numpy(y).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(host(q.codes), expected)


# --- blocks and scales -------------------------------------------------------------------------


@pytest.mark.parametrize("bits,signed", FORMATS)
@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("shape", [(3, 300), (1000,), (7,), (2, 3, 129)])
def test_blocks_tile_the_array_in_row_major_order_a_short_last_block_its_own(bits, signed, backend, shape):
    rng = np.random.default_rng(2)
    x = mixed_magnitudes(rng, (shape[0], math.prod(shape[1:]))).reshape(shape)
    x = x if signed else np.abs(x)
    q = opt.quantise(to_backend(x, backend), bits=bits, signed=signed)
    block = BLOCK[bits]
    assert (q.bits, q.block, q.signed, q.shape) == (bits, block, signed, shape)
    flat = x.reshape(-1)
    starts = range(0, flat.size, block)
    absmax = np.array([np.abs(flat[s : s + block]).max() for s in starts], np.float32)
    scale = np.maximum(absmax, np.float32(1e-12))
    if bits == "fp8":
        scale = scale / np.float32(448)
    assert host(q.scale).dtype == np.float32
    np.testing.assert_array_equal(host(q.scale), scale)
    values = values_of(bits, signed)
    codes = unpacked(q)
    assert host(q.codes).dtype == np.uint8
    if bits == 4:
        assert host(q.codes).shape == ((flat.size + 1) // 2,)
    else:
        assert host(q.codes).shape == shape
    each_scale = np.repeat(scale, block)[: flat.size]
    y = flat / each_scale
    if bits == "fp8":
        expected = torch.from_numpy(y).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    else:
        expected = nearest_codes(y, values)
    np.testing.assert_array_equal(codes, expected)
    back = opt.dequantise(q)
    assert type(back) is type(to_backend(x, backend)) or backend == "jax"
    assert tuple(back.shape) == shape and str(back.dtype).endswith("float32")
    np.testing.assert_array_equal(host(back).reshape(-1), values[codes] * each_scale)


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_zeros_and_tiny_blocks_use_the_smallest_scale(backend):
    x = np.zeros(300, np.float32)
    x[280] = 1e-14
    q = opt.quantise(to_backend(x, backend), bits=8)
    np.testing.assert_array_equal(host(q.scale), np.float32([1e-12, 1e-12]))
    np.testing.assert_array_equal(host(opt.dequantise(q))[:256], 0)


def test_other_dtypes_are_quantised_as_float32():
    x = np.random.default_rng(3).standard_normal(512)
    for dtype in (np.float64, np.float16):
        q = opt.quantise(x.astype(dtype))
        reference = opt.quantise(x.astype(dtype).astype(np.float32))
        np.testing.assert_array_equal(q.codes, reference.codes)
        assert opt.dequantise(q).dtype == np.float32
    t = torch.from_numpy(x).to(torch.bfloat16)
    assert torch.equal(opt.quantise(t).codes, opt.quantise(t.float()).codes)


def test_backends_agree_bit_for_bit():
    x = mixed_magnitudes(np.random.default_rng(4), (16, 1000))
    for bits, signed in FORMATS:
        x_ = x if signed else np.abs(x)
        backends = ("numpy", "torch", "jax")
        results = [opt.quantise(to_backend(x_, b), bits=bits, signed=signed) for b in backends]
        jitted = jax.jit(lambda a, bits=bits, signed=signed: opt.quantise(a, bits, signed))(jnp.asarray(x_))
        for q in [*results[1:], jitted]:
            np.testing.assert_array_equal(host(q.codes), results[0].codes)
            np.testing.assert_array_equal(host(q.scale), results[0].scale)
            np.testing.assert_array_equal(host(opt.dequantise(q)), opt.dequantise(results[0]))


# --- the oracles -------------------------------------------------------------------------------


def torchao_state(bits, signed, x):
    """torchao's quantised state of tensor `x` (its size a multiple of the block): the classes'
    own quantiser, through `copy_` as its optimisers store moments."""
    pytest.importorskip("torchao.optim")
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit
    from torchao.optim.subclass_fp8 import OptimStateFp8

    if bits == 8:
        state = OptimState8bit.zeros(x.shape, signed, 256)
    elif bits == 4:
        state = OptimState4bit.zeros(x.shape, signed, 128)
    else:
        state = OptimStateFp8.zeros(x.shape, 256)
    state.copy_(x)
    codes = state.codes.view(torch.uint8) if bits == "fp8" else state.codes
    return codes, state.scale, state.dequantize()


@pytest.mark.parametrize("bits,signed", FORMATS)
@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_codes_and_scales_equal_torchao_bit_for_bit(bits, signed, backend):
    x = mixed_magnitudes(np.random.default_rng(5), (32, 1024))
    x = x if signed else np.abs(x)
    codes, scale, values = torchao_state(bits, signed, torch.from_numpy(x))
    q = opt.quantise(to_backend(x, backend), bits=bits, signed=signed)
    np.testing.assert_array_equal(host(q.codes).reshape(-1), codes.numpy().reshape(-1))
    np.testing.assert_array_equal(host(q.scale), scale.numpy())
    np.testing.assert_array_equal(host(opt.dequantise(q)), values.numpy())


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_dequantisation_equals_bitsandbytes(signed, backend):
    functional = pytest.importorskip("bitsandbytes.functional")
    x = mixed_magnitudes(np.random.default_rng(6), (8, 1000))  # a short last block too
    x = x if signed else np.abs(x)
    q = opt.quantise(to_backend(x, backend), bits=8, signed=signed)
    theirs = functional.dequantize_blockwise(
        torch.from_numpy(host(q.codes).copy()),
        absmax=torch.from_numpy(host(q.scale).copy()),
        code=functional.create_dynamic_map(signed=signed),
        blocksize=256,
    )
    np.testing.assert_array_equal(host(opt.dequantise(q)), theirs.numpy())


# --- JAX: a pytree of traced codes and scales, static format -------------------------------------


def test_quantised_is_a_jax_pytree_with_static_format():
    q = opt.quantise(jnp.ones((4, 64)), bits=4, signed=False, block=32)
    leaves, treedef = jax.tree_util.tree_flatten(q)
    assert [leaf.dtype for leaf in leaves] == [jnp.uint8, jnp.float32]
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert (back.bits, back.signed, back.block, back.shape) == (4, False, 32, (4, 64))
    traces = []

    @jax.jit
    def roundtrip(q):
        traces.append(1)
        return opt.quantise(opt.dequantise(q) * 2, bits=q.bits, signed=q.signed, block=q.block)

    out = roundtrip(roundtrip(q))
    assert len(traces) == 1 and isinstance(out, opt.Quantised) and out.shape == (4, 64)
    np.testing.assert_array_equal(np.asarray(opt.dequantise(out)), 4 * np.asarray(opt.dequantise(q)))


# --- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        ({"bits": 16}, ValueError, "bits must be 8, 4 or 'fp8'"),
        ({"bits": True}, ValueError, "bits must be 8, 4 or 'fp8'"),
        ({"block": 0}, ValueError, "block must be a positive integer"),
        ({"block": 2.5}, ValueError, "block must be a positive integer"),
        ({"signed": 1}, TypeError, "signed must be True or False"),
    ],
)
def test_bad_arguments_raise_naming_what_was_expected(kwargs, error, words):
    with pytest.raises(error, match=words):
        opt.quantise(np.ones(4, np.float32), **kwargs)


@pytest.mark.parametrize("x", [np.ones(4, np.int32), np.ones(4, np.complex64), [1.0, 2.0], 3.0])
def test_only_real_floating_arrays_are_quantised(x):
    with pytest.raises(TypeError, match="real floating dtype"):
        opt.quantise(x)


def test_dequantise_takes_a_quantised():
    with pytest.raises(TypeError, match="expected an optimisers.Quantised"):
        opt.dequantise(np.ones(3))


@pytest.mark.parametrize("bits,signed", FORMATS)
def test_numpys_compiled_quantiser_equals_its_ufuncs(bits, signed, monkeypatch):
    pytest.importorskip("numba")
    from optimisers.backends import numpy_kernels

    x = mixed_magnitudes(np.random.default_rng(7), (9, 1000))  # a short last block too
    x[0, :5] = [np.nan, np.inf, -np.inf, 0.0, -0.0]  # a block of specials: whatever they give, alike
    x = x if signed else np.abs(x)
    monkeypatch.setattr(numpy_kernels, "AVAILABLE", True)
    compiled = opt.quantise(x, bits, signed)
    monkeypatch.setattr(numpy_kernels, "AVAILABLE", False)
    ufuncs = opt.quantise(x, bits, signed)
    np.testing.assert_array_equal(compiled.codes, ufuncs.codes)
    np.testing.assert_array_equal(compiled.scale, ufuncs.scale)


def test_dequantise_refuses_codes_or_scales_that_do_not_fit():
    q = opt.quantise(np.ones(300, np.float32), bits=4)
    import dataclasses

    with pytest.raises(ValueError, match=r"has 150 codes and 3 scales; this one has 150 and 2"):
        opt.dequantise(dataclasses.replace(q, scale=q.scale[:2]))
    with pytest.raises(ValueError, match="bits must be 8, 4 or 'fp8'"):
        opt.dequantise(dataclasses.replace(q, bits=3))
