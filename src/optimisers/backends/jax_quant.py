"""Blockwise quantisation of JAX arrays, traceable under `jit` (shapes and the format are static):
the NumPy version's steps (`numpy_quant`) in `jax.numpy`, the tables as constants."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from optimisers.core.quantised import SMALLEST_SCALE


def quantise_blocks(x, book, block: int):
    x = jnp.asarray(x).astype(jnp.float32)
    blocks = _blocks(x, block)
    scale = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1, initial=0.0), jnp.float32(SMALLEST_SCALE))
    if book.divisor != 1:
        scale = _divided(scale, jnp.float32(book.divisor))
    codes = codes_of(_divided(x, _each_element(scale, block, x.shape)), book)
    codes = pack_nibbles(codes.reshape(-1)) if book.nibbles else codes
    return _placed_like(x, codes), _placed_like(x, scale.reshape(-1))


def _blocks(x, block: int):
    """`x` cut into blocks along a new last axis, in row-major order. Where its rows hold whole
    blocks only the last axis is split, `(..., n/block, block)`, which keeps the other axes (and
    their sharding) as they are; otherwise the flattened array, zeros padding its last block."""
    if _whole_rows(x.shape, block):
        return x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))
    return _padded(x.reshape(-1), block).reshape(-1, block)


def _each_element(scale, block: int, shape: tuple):
    """The scale of each element of an array of `shape`: the scales of its blocks (as `_blocks`
    shapes them), each repeated over its block. Codes and values are then computed in the
    array's own shape, where XLA keeps its sharding, whether or not its rows hold whole blocks."""
    each = jnp.broadcast_to(scale[..., None], scale.shape + (block,))
    if _whole_rows(shape, block):  # (..., n/block, block)
        return each.reshape(shape)
    return each.reshape(-1)[: math.prod(shape)].reshape(shape)


def _whole_rows(shape: tuple, block: int) -> bool:
    return len(shape) > 0 and shape[-1] % block == 0


def _placed_like(x, out):
    """`out` on the devices of `x`, a sharded array (a state that `setup` quantises): codes of the
    parameter's shape take its sharding; 1-D arrays (scales, 4-bit codes), which hold the blocks
    in row-major order, are split along the mesh axes that split its rows (each device keeps
    the blocks of its own rows when those hold whole blocks), and replicated where its rows are
    whole on every device or the length does not divide evenly over those devices. Under `jit`
    (a tracer) XLA propagates the inputs' placement, which gives the same."""
    sharding = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
    if not isinstance(sharding, jax.sharding.NamedSharding) or isinstance(x, jax.core.Tracer):
        return out
    if out.shape == x.shape:
        return jax.device_put(out, sharding)
    rows = sharding.spec[0] if x.ndim and len(sharding.spec) else None
    split = math.prod(sharding.mesh.shape[a] for a in _axes(rows))
    spec = (rows,) if rows is not None and out.shape[0] % split == 0 else ()
    return jax.device_put(out, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec)))


def _axes(entry) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _divided(a, b):
    """`a / b` rounded as a division: XLA rewrites a division by a broadcast value as a product
    with its reciprocal (off by one ulp about half the time), which the barrier prevents."""
    return a / jax.lax.optimization_barrier(jnp.broadcast_to(b, a.shape))


def codes_of(y, book):
    if book.name == "fp8":
        return _float8_codes(y)
    bits = jax.lax.bitcast_convert_type(y, jnp.int32)
    magnitude = bits & np.int32(0x7FFFFFFF)
    i = jnp.clip((magnitude >> book.shift) - (book.first - 1), 0, book.buckets - 1)
    i = i + ((bits >> 31) & book.buckets)  # the negative half of the tables
    up = (magnitude >= jnp.asarray(book.threshold)[i]).astype(jnp.int32) << 3
    return (jnp.asarray(book.pairs)[i] >> up).astype(jnp.uint8)  # (two lookups, not three)


_FP8_LARGEST = 448.0


def _float8_codes(y):
    """The tables' FP8 codes by XLA's float8_e4m3fn cast, which rounds as they do (ties to even)
    without a lookup. The cast gives NaN from 464 on, where the tables saturate: anything past 448,
    NaN and infinities included, becomes ±448 by its sign bit first, as the tables have it."""
    inside = jnp.abs(y) <= _FP8_LARGEST  # False for NaN
    y = jnp.where(inside, y, jnp.copysign(jnp.float32(_FP8_LARGEST), y))
    return jax.lax.bitcast_convert_type(y.astype(jnp.float8_e4m3fn), jnp.uint8)


def _values_of(codes, book):
    """The float32 value of each code: FP8 codes by the cast back (exact; the table holds the
    same values), the other formats by a lookup in their map."""
    if book.name == "fp8":
        return jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(jnp.float32)
    return jnp.asarray(book.values)[codes]


def _pair_values(book):
    """The two float32 values of each byte of 4-bit codes (high nibble first), 256 × 2: one lookup
    a byte, rather than unpacking the nibbles to look each up."""
    return np.stack([np.repeat(book.values, 16), np.tile(book.values, 16)], axis=1)


def dequantise_blocks(codes, scale, book, block: int, shape: tuple):
    n = math.prod(shape)
    if book.nibbles:
        values = jnp.asarray(_pair_values(book))[codes].reshape(-1)[:n].reshape(shape)
    else:
        values = _values_of(codes.reshape(shape), book)
    return values * _each_element(scale.reshape(_blocks(values, block).shape[:-1]), block, shape)


def pack_nibbles(codes):
    if codes.size % 2:
        codes = jnp.concatenate([codes, jnp.zeros(1, codes.dtype)])
    return (codes[0::2] << 4) | codes[1::2]


def _padded(flat, block: int):
    extra = -flat.size % block
    return flat if extra == 0 else jnp.concatenate([flat, jnp.zeros(extra, flat.dtype)])


# --- rounding float32 values to bfloat16's grid (numpy_quant.bfloat16_rounded says how) ------------


def fmix32(h):
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def bfloat16_rounded(x, seed, step):
    x = jnp.asarray(x, jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    if seed is None:
        rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) & np.uint32(0xFFFF0000)
    else:
        # (seed·golden + step) mod 2^32, step possibly traced
        start = jnp.uint32((int(seed) * 0x9E3779B9) & 0xFFFFFFFF)
        key = fmix32(start + jnp.asarray(step).astype(jnp.uint32))
        h = jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape) * np.uint32(0x9E3779B1) + key
        up = (fmix32(h) >> 16) < (bits & np.uint32(0xFFFF))
        rounded = (bits & np.uint32(0xFFFF0000)) + (up.astype(jnp.uint32) << 16)
    out = jax.lax.bitcast_convert_type(rounded, jnp.float32)
    return jnp.where(jnp.isnan(x), x, out)
