"""Training bfloat16 (and float16) parameters without a float32 master copy: `StochasticRounding`
and `KahanSummation` put back what rounding each step to the parameter's dtype would lose."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from optimisers import ops
from optimisers.core.narrow import narrow_dtype_of
from optimisers.core.rule import NewValue, Rule
from optimisers.rules.combinators import _Wrapper

__all__ = ["StochasticRounding", "KahanSummation"]


def _float32(a):
    return a if str(a.dtype).rpartition(".")[2] == "float32" else ops.cast(a, np.float32)


def _target(x32, step):
    """The parameter's new value in float32, as `rule` asked for it."""
    return _float32(step.value) if isinstance(step, NewValue) else x32 - _float32(step)


@dataclass(frozen=True, repr=False)
class StochasticRounding(_Wrapper):
    """Round a bfloat16 parameter's new value stochastically (Gupta et al., "Deep Learning with
    Limited Numerical Precision", 2015): `rule`'s step is taken in float32, and the result goes
    to one of its two bfloat16 neighbours with the probabilities that make it right on average,
    so updates smaller than bfloat16's resolution (about 0.4% of the value) still move the
    parameter in expectation instead of rounding away.

    State `(inner, t, dtype)`: `rule`'s state, the number of steps taken and a static marker of a
    bfloat16 parameter (None for others, which `rule` steps as usual). The 16 random bits of each
    element come from a counter-based hash of (`seed`, `t`, the element's row-major index in its
    array): reproducible, the same on NumPy, PyTorch and JAX, with or without `flatten_` or `jit`
    (`optimisers.ops.bfloat16_rounded` gives the formula). Not elementwise: each parameter is
    stepped whole, so that an element's index is its index in its array.

    Defaults: `seed=0`. torchao: `_AdamW(bf16_stochastic_round=True)` and its 8-bit classes'
    `bf16_stochastic_round`, with torch's random generator; optax has none.
    """

    rule: Rule
    seed: int = 0
    elementwise = False
    inner_at = 0  # (inner, t, dtype)

    def __repr__(self):
        return f"StochasticRounding({self.rule!r}, seed={self.seed})"

    def init(self, x):
        return self.rule.init(x), 0, narrow_dtype_of(x, ("bfloat16",))

    def apply(self, state, x, dx):
        inner, t, dtype = state
        inner, step = self.rule.apply(inner, x, dx)
        if step is None or dtype is None:
            return (inner, t, dtype), step
        t = t + 1
        new = ops.bfloat16_rounded(_target(_float32(x), step), self.seed, t)
        return (inner, t, dtype), NewValue(new)


@dataclass(frozen=True, repr=False)
class KahanSummation(_Wrapper):
    """Kahan-compensated updates of bfloat16 and float16 parameters (Kahan, 1965; Zamirai et al.,
    "Revisiting BFloat16 Training", 2020): a compensation buffer in the parameter's dtype keeps
    what rounding the new value to that dtype lost, and adds it to the next step, so that small
    updates accumulate as they would in float32.

    State `(inner, c, dtype)`: `rule`'s state, the compensation `c = 0` (an array of the
    parameter's dtype; None, with `dtype` None, for parameters of other dtypes, which `rule`
    steps as usual), and a static marker of the dtype. Each step, in float32, with `u` the
    update `rule` asks for (`x_new − x`): `s = c + u`; `x ← round(x + s)` (nearest, in the
    parameter's dtype); `c ← s − (x_new − x)`, stored in the parameter's dtype.

    torch-optimi: `kahan_sum=True` (its default for low-precision parameters), which adds in
    the parameter's dtype throughout; optax has none.
    """

    rule: Rule
    elementwise = False
    inner_at = 0  # (inner, c, dtype)

    def __repr__(self):
        return f"KahanSummation({self.rule!r})"

    def init(self, x):
        dtype = narrow_dtype_of(x)
        return self.rule.init(x), (None if dtype is None else ops.zeros_like(x)), dtype

    def apply(self, state, x, dx):
        inner, c, dtype = state
        inner, step = self.rule.apply(inner, x, dx)
        if step is None or dtype is None:
            return (inner, c, dtype), step
        x32 = _float32(x)
        # (the update itself, not x_new − x: that would round it at x's magnitude first)
        update = _float32(step.value) - x32 if isinstance(step, NewValue) else -_float32(step)
        s = _float32(c) + update
        new = _rounded(x32 + s, dtype.name)
        return (inner, ops.astype(s - (new - x32), c), dtype), NewValue(new)


def _rounded(v, name: str):
    """float32 `v` rounded to the nearest value of dtype `name`, kept in float32."""
    if name == "bfloat16":
        return ops.bfloat16_rounded(v)
    return ops.cast(ops.cast(v, np.float16), np.float32)
