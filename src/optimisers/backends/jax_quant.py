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
