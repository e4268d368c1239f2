"""`Quantised`: an array kept blockwise in low precision, and the formats it can have.

The array, flattened in row-major order, is cut into blocks of `block` elements (the last may be
shorter); each block keeps a float32 `scale` (its largest magnitude, at least 1e-12; FP8: that
divided by 448) and each element a code, the nearest value of the format's map to the element
divided by its block's scale. The formats, their maps (`optimisers.core.quant_maps`) and default
blocks: 8 (bitsandbytes' dynamic maps, 256), 4 (torchao's 4-bit maps, 128; two codes a byte,
the first in the high nibble) and "fp8" (float8_e4m3fn bit patterns, 256).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

DEFAULT_BLOCK = {8: 256, 4: 128, "fp8": 256}
SMALLEST_SCALE = 1e-12  # a block of zeros still divides by something


@dataclasses.dataclass(frozen=True, eq=False)
class Quantised:
    """An array of `shape` kept blockwise in low precision (`optimisers.quantise` makes one,
    `optimisers.dequantise` gives back float32 values).

    `codes`: uint8, of `shape` (formats 8 and "fp8", where a code is a float8_e4m3fn bit pattern)
    or 1-D with two codes a byte (format 4); `scale`: float32, one per block of `block` elements
    in row-major order. `signed`: whether the map holds negative values (the unsigned maps spend
    every code on values ≥ 0, for a state the rule keeps non-negative). `bits`, `block`, `shape`
    and `signed` are static: under JAX a `Quantised` is a pytree whose leaves are `codes` and
    `scale`.
    """

    codes: Any
    scale: Any
    signed: bool = True
    bits: Any = 8
    block: int = 256
    shape: tuple = ()

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __repr__(self):
        kind = "signed" if self.signed else "unsigned"
        return f"Quantised(bits={self.bits!r}, {kind}, shape={self.shape}, block={self.block})"


def checked_format(bits, block, who: str = "quantise") -> tuple:
    """`(bits, block)` with the default block filled in; a clear error for anything else."""
    if isinstance(bits, bool) or bits not in DEFAULT_BLOCK:
        raise ValueError(f"{who}: bits must be 8, 4 or 'fp8', got {bits!r}")
    if block is None:
        return bits, DEFAULT_BLOCK[bits]
    if isinstance(block, bool) or not isinstance(block, numbers.Integral) or block < 1:
        raise ValueError(
            f"{who}: block must be a positive integer or None (the format's default), got {block!r}"
        )
    return bits, int(block)
