"""The value of every code of the low-precision state formats, as float32 NumPy arrays.

8-bit: the dynamic maps of Dettmers et al. ("8-bit Optimizers via Block-wise Quantization",
2021), as bitsandbytes defines them: a sign bit, then an exponent in unary (as many leading
zeros as decades below 1, at most `exponent_bits - 1`), then a linear fraction filling what
is left. Decade `i` (0 the smallest) holds the midpoints of a float32 `linspace(0.1, 1, n + 1)`
scaled by `10^(i - exponent_bits + 1)`, with `n = 2^(i + bits - 1 - exponent_bits)` (signed:
each sign) or twice that (unsigned); then 0 and 1. 4-bit: torchao's signed map is the same
construction with 3 exponent bits in 4 bits; its unsigned map is `linspace(0, 1, 17)[1:]`
(no zero: a second moment is rarely exactly 0, and 0 would waste one of 16 codes). FP8: the
value of each float8_e4m3fn bit pattern (0x7f and 0xff are NaN).

Every value is computed in float32 as the published definitions compute it, so the maps are
those libraries' maps bit for bit (tests/test_quantise.py compares them).
"""

from __future__ import annotations

import functools

import numpy as np

_F32 = np.float32


def linspace32(start: float, end: float, n: int) -> np.ndarray:
    """torch's float32 `linspace`: the step rounded to float32, then each point rounded once from
    `start + k·step` (first half) or `end − (n−1−k)·step` (second half)."""
    start32, end32 = _F32(start), _F32(end)
    step = np.float64(_F32((end32 - start32) / _F32(n - 1)))
    k = np.arange(n)
    # (exact in float64: 24-bit values times k < 2^9, added at exponents a few apart)
    first = np.float64(start32) + step * k
    second = np.float64(end32) - step * (n - 1 - k)
    return np.where(k < n // 2, first, second).astype(_F32)


@functools.cache
def dynamic_map(signed: bool, exponent_bits: int = 7, bits: int = 8) -> np.ndarray:
    """The dynamic map of `bits` bits, ascending (`2^bits` values); read-only."""
    values: list = []
    fraction_bits = bits - 1 - exponent_bits
    for i in range(exponent_bits):
        n = 2 ** (i + fraction_bits) if signed else 2 ** (i + fraction_bits + 1)
        bounds = linspace32(0.1, 1.0, n + 1)
        means = (bounds[:-1] + bounds[1:]) / _F32(2)
        scaled = _F32(10.0 ** (i - exponent_bits + 1)) * means
        values.extend(scaled)
        if signed:
            values.extend(-scaled)
    extra = 2 ** fraction_bits - 1  # codes left when no exponent bit is set (none in these maps)
    if extra > 0:
        raise ValueError(f"no dynamic map of {bits} bits with {exponent_bits} exponent bits here")
    values += [_F32(0.0), _F32(1.0)]
    if len(values) != 2**bits:
        raise ValueError(f"a dynamic map of {bits} bits has {len(values)} values")
    return _frozen(np.sort(np.array(values, _F32)))


@functools.cache
def linear_map_without_zero(bits: int = 4) -> np.ndarray:
    """`k / 2^bits` for `k = 1 .. 2^bits` (torchao's unsigned 4-bit map)."""
    return _frozen(linspace32(0.0, 1.0, 2**bits + 1)[1:])


@functools.cache
def float8_e4m3fn_values() -> np.ndarray:
    """The value of each of the 256 float8_e4m3fn bit patterns: sign, 4 exponent bits (bias 7),
    3 mantissa bits; exponent 0 is subnormal; all ones (S.1111.111) is NaN; no infinities."""
    code = np.arange(256)
    exponent, mantissa = (code >> 3) & 15, code & 7
    magnitude = np.where(
        exponent == 0,
        mantissa * 2.0**-9,
        (1 + mantissa / 8) * 2.0 ** (exponent - 7),
    )
    magnitude[(code & 0x7F) == 0x7F] = np.nan
    return _frozen(np.where(code >= 128, -magnitude, magnitude).astype(_F32))


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a
