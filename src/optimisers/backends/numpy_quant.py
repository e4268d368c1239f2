"""Blockwise quantisation of NumPy arrays (`optimisers.core.quantised` says what the codes and
scales are; `optimisers.core.quant_lookup` how a code is found without a search)."""

from __future__ import annotations

import math

import numpy as np

from optimisers.backends import numpy_kernels
from optimisers.core.quantised import SMALLEST_SCALE

_F32 = np.float32


def quantise_blocks(x, book, block: int):
    """`(codes, scale)` of array `x` in the format of Codebook `book`, `block` elements a block."""
    flat = np.asarray(x).astype(_F32, copy=False).reshape(-1)
    n = flat.size
    if numpy_kernels.AVAILABLE and n:
        codes, scale = _compiled(flat, book, block)
        return (pack_nibbles(codes) if book.nibbles else codes.reshape(np.shape(x))), scale
    blocks = _padded(flat, block).reshape(-1, block)
    scale = np.maximum(np.abs(blocks).max(axis=1, initial=0), _F32(SMALLEST_SCALE))
    if book.divisor != 1:
        scale = scale / _F32(book.divisor)
    scaled = (blocks / scale[:, None]).reshape(-1)[:n]
    codes = codes_of(scaled, book)
    return (pack_nibbles(codes) if book.nibbles else codes.reshape(np.shape(x))), scale


def _compiled(flat, book, block):
    from optimisers.backends import numpy_quant_numba

    codes = np.empty(flat.size, np.uint8)
    scale = np.empty(-(-flat.size // block), _F32)
    numpy_quant_numba.quantise_flat(
        np.ascontiguousarray(flat), block, _F32(book.divisor), _F32(SMALLEST_SCALE), book.shift,
        book.first, book.buckets, book.threshold, book.pairs, codes, scale,
    )
    return codes, scale


def codes_of(y, book):
    """The code of each float32 value of `y` (a 1-D array)."""
    bits = y.view(np.int32)
    magnitude = bits & np.int32(0x7FFFFFFF)
    i = magnitude >> book.shift
    i -= book.first - 1
    np.clip(i, 0, book.buckets - 1, out=i)
    i += (bits >> 31) & book.buckets  # the negative half of the tables
    return np.where(magnitude >= book.threshold.take(i), book.above.take(i), book.below.take(i))


def dequantise_blocks(codes, scale, book, block: int, shape: tuple):
    """float32 values of `shape` from the codes and scales `quantise_blocks` made."""
    n = math.prod(shape)
    flat = unpack_nibbles(codes, n) if book.nibbles else np.asarray(codes).reshape(-1)
    values = _padded(book.values.take(flat), block).reshape(-1, block) * scale[:, None]
    return values.reshape(-1)[:n].reshape(shape)


def pack_nibbles(codes):
    """4-bit codes two a byte, the first in the high nibble (an odd count ends with a zero)."""
    if codes.size % 2:
        codes = np.append(codes, np.uint8(0))
    return (codes[0::2] << 4) | codes[1::2]


def unpack_nibbles(packed, n: int):
    return np.stack([packed >> 4, packed & np.uint8(15)], axis=-1).reshape(-1)[:n]


def _padded(flat, block: int):
    """`flat` with zeros after it up to a whole number of blocks (a short last block's absmax,
    and its scaling, are its own elements')."""
    extra = -flat.size % block
    return flat if extra == 0 else np.concatenate([flat, np.zeros(extra, flat.dtype)])


# --- rounding float32 values to bfloat16's grid ------------------------------------------------

_GOLDEN = 0x9E3779B9  # (spreads seeds and element indices over 32 bits before mixing)
_GOLDEN_INDEX = 0x9E3779B1


def fmix32(h):
    """MurmurHash3's finaliser: every bit of a uint32 array mixed into every other, in place."""
    h ^= h >> 16
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> 13
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> 16
    return h


def bfloat16_rounded(x, seed, step):
    """float32 `x` rounded to bfloat16's grid, still float32: to nearest, ties to even (seed
    None), or away from zero with probability (low 16 bits of x)/2^16, the 16 random bits of
    element `i` (row-major) being the top half of `fmix32(i·0x9E3779B1 + key)`,
    `key = fmix32(seed·0x9E3779B9 + step)` (all mod 2^32): reproducible, and the same on
    every backend."""
    x = np.asarray(x, np.float32)
    bits = x.view(np.uint32)
    if seed is None:
        rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) & np.uint32(0xFFFF0000)
    else:
        key = fmix32(np.array([(int(seed) * _GOLDEN + int(step)) & 0xFFFFFFFF], np.uint32))
        h = np.arange(x.size, dtype=np.uint32).reshape(x.shape)
        h *= np.uint32(_GOLDEN_INDEX)
        h += key[0]
        random16 = fmix32(h) >> 16
        up = random16 < (bits & np.uint32(0xFFFF))
        rounded = (bits & np.uint32(0xFFFF0000)) + (up.astype(np.uint32) << 16)
    out = rounded.view(np.float32)
    return np.where(np.isnan(x), x, out)  # (a NaN's payload could round to infinity)
