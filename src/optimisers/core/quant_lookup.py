"""Codes from values without a search: the tables that turn a scaled value into its code.

A code is the nearest value of a format's map (a tie goes to the larger code; FP8 rounds as the
float8_e4m3fn cast does, ties to the even code). Rather than a binary search over the map, a
value's float32 bits pick a bucket: its sign, its exponent and the top `M` bits of its
mantissa (everything below the map's first decision point shares bucket 0). The dynamic maps
are piecewise logarithmic, so buckets that narrow with the magnitude hold at most one decision
point each once `M` is large enough; the table keeps, per bucket, the code below that point,
the code from it on, and the point itself as float32 bits. A code is then one comparison of
integers: `above[i] if bits(|y|) >= threshold[i] else below[i]`. Non-negative floats compare
as their bits do, so no float work is left at all. The tables are built once per format by
exact arithmetic on the map (the decision points are exact midpoints in float64) and checked.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from optimisers.core import quant_maps

_MAGNITUDE = 0x7FFFFFFF
_MAX_MANTISSA_BITS = 12


@dataclasses.dataclass(frozen=True, eq=False)
class Codebook:
    """One format: the value of each code, and the tables that find codes (module docstring).
    For a scaled float32 value `y` with bits `b` (as int32) and `a = b & 0x7fffffff`:
    `i = clip((a >> shift) - first + 1, 0, buckets - 1) + (buckets if b < 0 else 0)`, then
    `code = above[i] if a >= threshold[i] else below[i]`."""

    name: str
    values: np.ndarray  # float32, the value of each code
    divisor: float  # a block's scale is its absmax (at least 1e-12) divided by this
    nibbles: bool  # 4-bit codes, two to a byte
    shift: int
    first: int
    buckets: int
    threshold: np.ndarray  # int32 bits of |y| from which a bucket takes `above`
    below: np.ndarray  # uint8
    above: np.ndarray  # uint8

    @functools.cached_property
    def pairs(self) -> np.ndarray:
        """int32 `below | above << 8`: a code is `pairs[i] >> (8 if a >= threshold[i] else 0)`
        (its low byte), one load and a shift where a compiled loop would otherwise branch
        between two loads (LLVM turns such a select into a branch, mispredicted half the time
        where a bucket holds a decision point)."""
        pairs = self.below.astype(np.int32) | (self.above.astype(np.int32) << 8)
        pairs.setflags(write=False)
        return pairs


def _nearest_ties_up(values: np.ndarray):
    """The exact code of magnitudes `a` (float64 holding float32 values) of sign `negative`, for an
    ascending map: the nearest value, a tie to the larger code."""
    mids = (values[:-1].astype(np.float64) + values[1:]) / 2  # exact in float64

    def code(a, negative):
        return np.searchsorted(mids, np.where(negative, -a, a), side="right")

    return code, mids


def _float8_e4m3fn_cast():
    """The float8_e4m3fn cast of `±a`: the nearest magnitude, a tie to the even code, saturating at
    448 (the values past 448 that a block's scaling can give round to it), sign bit kept."""
    magnitudes = quant_maps.float8_e4m3fn_values()[:127].astype(np.float64)
    mids = (magnitudes[:-1] + magnitudes[1:]) / 2

    def code(a, negative):
        i = np.searchsorted(mids, a, side="left")  # mids below a
        at_tie = (i < len(mids)) & (mids[np.minimum(i, len(mids) - 1)] == a)
        i = i + (at_tie & ((i + 1) % 2 == 0))  # the tie goes to the even code
        return i | np.where(negative, 0x80, 0)

    return code, mids


def _bits_as_float(bits) -> np.ndarray:
    return np.asarray(bits, np.int64).astype(np.int32).view(np.float32).astype(np.float64)


def _tables(code, mids, top: float, mantissa_bits: int):
    """(shift, first, buckets, threshold, below, above), or None if some bucket holds two
    decision points at this resolution."""
    shift = 23 - mantissa_bits
    smallest = float(np.min(np.abs(mids[mids != 0])))
    low_exponent = max(int(np.floor(np.log2(smallest))) + 127, 1)  # bucket 0: |y| < 2^(e - 127)
    first = low_exponent << mantissa_bits
    last = (((int(np.float32(top).view(np.int32)) >> 23) + 1) << mantissa_bits) - 1
    buckets = last - first + 2
    k = np.arange(first - 1, last + 1, dtype=np.int64)
    start = np.where(k < first, 0, k << shift)
    end = np.where(k < first, (low_exponent << 23) - 1, ((k + 1) << shift) - 1)
    thresholds, belows, aboves = [], [], []
    for negative in (False, True):
        below = code(_bits_as_float(start), negative)
        above = code(_bits_as_float(end), negative)
        if np.any(np.abs(above - below) > 1):
            return None
        lo, hi = start.copy(), end.copy()  # the first bits in [start, end] whose code is `above`
        while np.any(lo < hi):
            mid = (lo + hi) // 2
            upper = code(_bits_as_float(mid), negative) == above
            hi, lo = np.where(upper, mid, hi), np.where(upper, lo, mid + 1)
        thresholds.append(lo)
        belows.append(below)
        aboves.append(above)
    threshold = np.concatenate(thresholds).astype(np.int32)
    below, above = (np.concatenate(c).astype(np.uint8) for c in (belows, aboves))
    for a in (threshold, below, above):
        a.setflags(write=False)
    return shift, first, buckets, threshold, below, above


def _codebook(name, values, code, mids, top, divisor, nibbles) -> Codebook:
    for mantissa_bits in range(_MAX_MANTISSA_BITS + 1):
        found = _tables(code, mids, top, mantissa_bits)
        if found is not None:
            return Codebook(name, values, divisor, nibbles, *found)
    raise AssertionError(f"{name}: no bucket resolution separates the map's decision points")


@functools.cache
def codebook(bits, signed: bool) -> Codebook:
    """The Codebook of format `bits` (8, 4 or "fp8") for signed or non-negative values."""
    if bits == "fp8":  # one format for both: the cast keeps the sign
        code, mids = _float8_e4m3fn_cast()
        return _codebook("fp8", quant_maps.float8_e4m3fn_values(), code, mids, 448.0, 448.0, False)
    if bits == 8:
        values = quant_maps.dynamic_map(signed, 7, 8)
    elif signed:
        values = quant_maps.dynamic_map(True, 3, 4)
    else:
        values = quant_maps.linear_map_without_zero(4)
    code, mids = _nearest_ties_up(values)
    name = f"{bits}-bit {'signed' if signed else 'unsigned'}"
    return _codebook(name, values, code, mids, float(values[-1]), 1.0, bits == 4)
