"""What several rules share: hyperparameter checks, casts, and Adam's moments."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import ClassVar

import numpy as np

from optimisers import ops
from optimisers.core.rule import Rule, check_range


def nonnegative(rule: Rule, *names: str) -> None:
    for name in names:
        check_range(rule, name, 0.0, math.inf)


@dataclasses.dataclass(frozen=True)
class Elementwise(Rule):
    """An elementwise rule that never raises, checked by the names of its hyperparameters: each
    `beta` in [0, 1) (a bias correction divides by `1 − βᵗ`), `rho` in [0, 1], and every other
    one but the learning rate non-negative (ε, weight decay, ...). A rule whose checks differ
    overrides `validate`."""

    elementwise = True
    never_raises = True

    def validate(self):
        for f in dataclasses.fields(self):
            if f.name in ("beta", "rho"):
                check_range(self, f.name, 0.0, 1.0, high_open=f.name == "beta")
            elif f.name != "eta":
                nonnegative(self, f.name)


@dataclasses.dataclass(frozen=True)
class Moments(Elementwise):
    """A state of `moments` arrays and a step count, all zero: `(m, v, t)` for Adam, for its
    relatives here and in `torch_named`; `m` in the rule's `mu_dtype`, if it has one."""

    moments: ClassVar[int] = 2

    def init(self, x):
        m = zeros_in(x, getattr(self, "mu_dtype", None))
        return (m, *(ops.zeros_like(x) for _ in range(self.moments - 1)), 0)


def cast(x, *values):
    """Each value as a scalar of `x`'s dtype."""
    return tuple(ops.scalar(v, x) for v in values)


def adam_moments(x, dx, state, beta):
    """Adam's moment updates of a state `(m, v, ..., t)`: `(m, v, t, 1−β₁ᵗ, 1−β₂ᵗ)` at the new step
    number `t`, the bias corrections as scalars of `x`'s dtype, so that a rule can fold them into
    its other scalars before touching arrays."""
    t, cb1, cm, cb2, cv, bc1, bc2 = step_scalars(x, state[-1], beta)
    m = cb1 * state[0] + cm * dx
    v = cb2 * state[1] + cv * ops.abs2(dx)
    return m, v, t, bc1, bc2


# Within one update (`sharing_step_scalars`), each counter's scalars are computed once: the Leafs
# of a rule share one counter (under `jax.jit`, one traced value per rule), so thousands of
# Leafs would otherwise each add the same dozen scalar operations for XLA to compile and merge.
_SHARED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("step_scalars", default=None)


@contextlib.contextmanager
def sharing_step_scalars(share: bool = True):
    """Within, each counter's scalars are computed once; with `share` False, neither shared with
    nor taken from the update's (a step traced inside a JAX loop, `lax.map`, whose values must
    not leave it)."""
    token = _SHARED.set({} if share else None)
    try:
        yield
    finally:
        _SHARED.reset(token)


def step_scalars(x, count, beta):
    """`(t, β₁, 1−β₁, β₂, 1−β₂, 1−β₁ᵗ, 1−β₂ᵗ)` at `t = count + 1`, the rest as scalars of `x`'s
    type, dtype and device; one computation per counter, betas and kind of array of an update."""
    shared, (b1, b2) = _SHARED.get(), beta
    traced = ops.backend(x).is_traced(x)  # (a tracer's missing `.device` costs milliseconds)
    key = (id(count), id(b1), id(b2), type(x), x.dtype, None if traced else getattr(x, "device", None))
    kept = None if shared is None else shared.get(key)
    if kept is not None and kept[0] is count and kept[1] is b1 and kept[2] is b2:
        return kept[3]
    t = count + 1
    scalars = (t, *cast(x, b1, 1 - b1, b2, 1 - b2, 1 - b1**t, 1 - b2**t))
    if shared is not None:
        shared[key] = (count, b1, b2, scalars)  # (holding them: their ids stay theirs)
    return scalars


def adam_direction(m, v, bc1, bc2, scale, eps):
    """`scale · (m/bc1) / (√(v/bc2) + ε)`, with `scale/bc1` one scalar: a pass over the arrays
    fewer than dividing `m` first, and a NumPy step costs about its number of passes."""
    return (scale / bc1) * m / (ops.sqrt(v / bc2) + eps)


def at_least_float32(a):
    """`a` in float32 when its dtype is narrower (float16, bfloat16): for a decomposition or an
    iteration that half precision is too coarse for (and NumPy has no float16 `eigh`)."""
    return ops.cast(a, np.float32) if ops.dtype_epsilon(a) > np.finfo(np.float32).eps else a


def real_zeros(x):
    """Zeros shaped like `x` in its real dtype (for a real `x`, just its dtype)."""
    return ops.abs(ops.zeros_like(x))


def state_dtype():
    """A keyword-only field for an explicit dtype of a state array (None: the parameter's): not a
    hyperparameter, and shown in the repr and a checkpoint's rule text only when given."""
    return dataclasses.field(default=None, kw_only=True, metadata={"static": True, "state_dtype": True})


def zeros_in(x, dtype):
    """Zeros shaped like `x`, in `dtype` (None: x's own; made from real zeros, so that a real
    dtype for a complex `x` discards no imaginary part)."""
    return ops.zeros_like(x) if dtype is None else ops.cast(real_zeros(x), dtype)


def stored_in(new, dtype):
    """A new state array in the explicit state dtype `dtype` (None: as computed)."""
    return new if dtype is None else ops.cast(new, dtype)
