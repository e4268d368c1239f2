"""What several rules share: hyperparameter checks, casts, and Adam's moments.

The conventions every rule here follows are in `optimisers.rules`.
"""

from __future__ import annotations

import math

from optimisers import ops
from optimisers.core.rule import Rule, check_range


def nonnegative(rule: Rule, *names: str) -> None:
    for name in names:
        check_range(rule, name, 0.0, math.inf)


def real_only(rule: Rule, x) -> None:
    if ops.is_complex(x):
        raise TypeError(
            f"{type(rule).__name__} is not defined for complex parameters (it uses the sign or the "
            f"order of numbers); got an array of dtype {x.dtype}"
        )


def cast(x, *values):
    """Each value as a scalar of `x`'s dtype."""
    return tuple(ops.scalar(v, x) for v in values)


def adam_moments(x, dx, m, v, beta, t):
    """Adam's moment updates at step `t`: `(m, v, 1−β₁ᵗ, 1−β₂ᵗ)`, the bias corrections as scalars
    of `x`'s dtype, so that a rule can fold them into its other scalars before touching arrays."""
    b1, b2 = beta
    cb1, cm, cb2, cv, bc1, bc2 = cast(x, b1, 1 - b1, b2, 1 - b2, 1 - b1**t, 1 - b2**t)
    m = cb1 * m + cm * dx
    v = cb2 * v + cv * ops.abs2(dx)
    return m, v, bc1, bc2


def adam_direction(m, v, bc1, bc2, scale, eps):
    """`scale · (m/bc1) / (√(v/bc2) + ε)`, with `scale/bc1` one scalar: a pass over the arrays
    fewer than dividing `m` first, and a NumPy step costs about its number of passes."""
    return (scale / bc1) * m / (ops.sqrt(v / bc2) + eps)


def real_zeros(x):
    """Zeros shaped like `x` in its real dtype (for a real `x`, just its dtype)."""
    return ops.abs(ops.zeros_like(x))
