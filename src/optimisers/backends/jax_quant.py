"""Blockwise quantisation of JAX arrays, traceable under `jit` (shapes and the format are static):
the NumPy version's steps (`numpy_quant`) in `jax.numpy`, the tables as constants."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from optimisers.core.quantised import SMALLEST_SCALE


def quantise_blocks(x, book, block: int):
    flat = jnp.reshape(x, (-1,)).astype(jnp.float32)
    n = flat.size
    blocks = _padded(flat, block).reshape(-1, block)
    scale = jnp.maximum(jnp.max(jnp.abs(blocks), axis=1, initial=0.0), jnp.float32(SMALLEST_SCALE))
    if book.divisor != 1:
        scale = _divided(scale, jnp.float32(book.divisor))
    scaled = _divided(blocks, scale[:, None]).reshape(-1)[:n]
    codes = codes_of(scaled, book)
    return (pack_nibbles(codes) if book.nibbles else codes.reshape(x.shape)), scale


def _divided(a, b):
    """`a / b` rounded as a division: XLA rewrites a division by a broadcast value as a product
    with its reciprocal (off by one ulp about half the time), which the barrier prevents."""
    return a / jax.lax.optimization_barrier(jnp.broadcast_to(b, a.shape))


def codes_of(y, book):
    bits = jax.lax.bitcast_convert_type(y, jnp.int32)
    magnitude = bits & np.int32(0x7FFFFFFF)
    i = jnp.clip((magnitude >> book.shift) - (book.first - 1), 0, book.buckets - 1)
    i = i + ((bits >> 31) & book.buckets)  # the negative half of the tables
    threshold, below, above = (jnp.asarray(a) for a in (book.threshold, book.below, book.above))
    return jnp.where(magnitude >= threshold[i], above[i], below[i])


def dequantise_blocks(codes, scale, book, block: int, shape: tuple):
    n = math.prod(shape)
    flat = unpack_nibbles(codes, n) if book.nibbles else codes.reshape(-1)
    values = _padded(jnp.asarray(book.values)[flat], block).reshape(-1, block) * scale[:, None]
    return values.reshape(-1)[:n].reshape(shape)


def pack_nibbles(codes):
    if codes.size % 2:
        codes = jnp.concatenate([codes, jnp.zeros(1, codes.dtype)])
    return (codes[0::2] << 4) | codes[1::2]


def unpack_nibbles(packed, n: int):
    return jnp.stack([packed >> 4, packed & np.uint8(15)], axis=-1).reshape(-1)[:n]


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
