"""`LowBit`: another rule's moments kept blockwise in 8 bits, 4 bits or FP8."""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from optimisers import ops
from optimisers.core.quantised import Quantised, checked_format
from optimisers.core.rule import Rule
from optimisers.core.state import flatten_state, unflatten_state
from optimisers.rules.combinators import _Wrapper
from optimisers.rules.common import sharing_step_scalars

__all__ = ["LowBit"]


@dataclass(frozen=True, repr=False)
class LowBit(_Wrapper):
    """Keep `rule`'s moments in low precision: each array of its state that has the parameter's
    shape and at least `min_size` elements is stored blockwise-quantised (an
    `optimisers.Quantised`), cutting Adam's 8 bytes of state per parameter to about 2 (8 bits,
    FP8) or 1 (4 bits) (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", 2021;
    Li et al., "Memory Efficient Optimizers with 4-bit States", 2023).

    Each step dequantises the state to float32, runs `rule`, steps the parameter with the new
    float32 moments, and stores them quantised again (bitsandbytes' and torchao's order). The
    formats (`bits`): 8, bitsandbytes' dynamic maps in blocks of 256; 4, torchao's 4-bit maps in
    blocks of 128; "fp8", float8_e4m3fn codes in blocks of 256 (`block` overrides the size).
    Arrays that the rule declares non-negative (`Rule.nonnegative_state`: Adam's `v`) take the
    unsigned maps, whose codes are all ≥ 0. State smaller than `min_size` (4096, as in both
    libraries), or of another shape (step counters, Adafactor's factors), stays as it is. The
    threshold counts the parameter's elements: a tied array has one state, quantised or not.

    Arrays that a rule declares exact (`Rule.exact_state`: copies of the parameter such as
    `MixedPrecision`'s master, `Lookahead`'s slow weights, the schedule-free rules' `z`, SOAP's
    bases) are never quantised. `hyperparameters()` and `adjust` forward to `rule`. Not
    elementwise (blocks look across elements): each parameter is stepped on its own.
    PyTorch: `bnb.optim.AdamW8bit`, `torchao.optim.AdamW8bit/AdamW4bit/AdamWFp8` for
    `LowBit(AdamW(...), bits=8/4/"fp8")`; optax has none.
    """

    rule: Rule
    bits: Any = dataclasses.field(default_factory=lambda: 8)  # (8, 4 or "fp8": no type from a default)
    block: Any = None
    min_size: int = 4096
    elementwise = False

    def validate(self):
        super().validate()
        checked_format(self.bits, self.block, "LowBit")
        size = self.min_size
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 0:
            raise ValueError(f"LowBit: min_size must be a non-negative integer, got {self.min_size!r}")

    def __repr__(self):
        return f"LowBit({self.rule!r}, bits={self.bits!r}, block={self.block!r}, min_size={self.min_size})"

    def init(self, x):
        inner = self.rule.init(x)
        parts: list = []
        spec = flatten_state(inner, parts)
        nonnegative, exact = self.rule.nonnegative_parts(inner), self.rule.exact_parts(inner)
        kept = [p if i in exact else self._stored(p, x, i not in nonnegative) for i, p in enumerate(parts)]
        return unflatten_state(spec, iter(kept))

    def dequantised_rule(self):
        return self.rule

    def with_counters(self, state):
        return self.rule.with_counters(state)

    def eval_value(self, state, x):
        return self.rule.eval_value(_dequantised(state, x)[0], x)

    def apply(self, state, x, dx):
        # (JAX on one CPU device: piece by piece, `backends.jax_pieces` says why)
        in_pieces = getattr(ops.backend(x), "step_in_pieces", None) if self.rule.elementwise else None
        stepped = in_pieces(self._step_apart, state, x, dx) if in_pieces is not None else None
        return self._step(state, x, dx) if stepped is None else stepped

    # (its state is its rule's, a schedule's step count included: passed on whole, not unwrapped
    # as a rule's own schedules are)
    apply._wrapped = True

    def _step_apart(self, state, x, dx):
        with sharing_step_scalars(share=False):  # (traced inside `lax.map`: its scalars stay there)
            return self._step(state, x, dx)

    def _step(self, state, x, dx):
        wide, spec, parts = _dequantised(state, x)
        new_state, step = self.rule.apply(wide, x, dx)
        new_parts: list = []
        if flatten_state(new_state, new_parts) != spec:
            raise TypeError(
                f"LowBit: {type(self.rule).__name__} changed the structure of its state; LowBit "
                "needs a rule whose state keeps one structure from step to step"
            )
        kept = [
            ops.quantise(new, p.bits, p.signed, p.block) if isinstance(p, Quantised) else new
            for new, p in zip(new_parts, parts)
        ]
        return unflatten_state(spec, iter(kept)), step

    def _stored(self, part, x, signed: bool):
        """`part` quantised if it is a real floating array shaped like `x`, of `min_size` or more."""
        if getattr(part, "shape", None) is None or tuple(part.shape) != tuple(x.shape):
            return part
        if getattr(part, "ndim", 0) == 0 or _size(part) < self.min_size or ops.is_complex(part):
            return part
        b = ops.backend(part)
        if not (b.is_array(part) and b.is_param(part)):
            return part
        return _zero_scales_for_zeros(ops.quantise(part, self.bits, signed, self.block), part)


def _zero_scales_for_zeros(q, part):
    """`q` with zero scales where `part` is all zeros (as torchao and bitsandbytes start a
    state), so that it dequantises to exactly zero: the unsigned 4-bit map has no zero, and
    1e-12 of its smallest value would enter the first step."""
    if ops.backend(part).is_traced(part) or float(ops.norm(part, np.inf)) != 0:
        return q
    return dataclasses.replace(q, scale=ops.zeros_like(q.scale))


def _size(x) -> int:
    size = 1
    for n in x.shape:
        size *= int(n)
    return size


def _dequantised(state, x):
    """`(state with arrays for its Quantised parts, its spec, its parts)`: float32 arrays, or
    float64 for a float64 parameter (whose rule would otherwise mix float32 arrays with float64
    scalars, which NumPy and torch promote differently)."""
    parts: list = []
    spec = flatten_state(state, parts)
    wider = ops.dtype_epsilon(x) < _FLOAT32_EPS
    wide = [_float_array(p, wider) if isinstance(p, Quantised) else p for p in parts]
    return unflatten_state(spec, iter(wide)), spec, parts


_FLOAT32_EPS = float(np.finfo(np.float32).eps)


def _float_array(q, wider: bool):
    values = ops.dequantise(q)
    return ops.cast(values, np.float64) if wider else values
