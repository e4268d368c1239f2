"""Gradient descent, with and without momentum.

The conventions every rule here follows are in `optimisers.rules`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from optimisers import ops
from optimisers.rules.common import Elementwise, cast, real_zeros

__all__ = ["Descent", "Momentum", "Nesterov"]


@dataclass(frozen=True)
class Descent(Elementwise):
    """Plain gradient descent: `x ← x − η·g`.

    Defaults: `eta=0.1`. PyTorch: `torch.optim.SGD(lr=eta)`; optax: `optax.sgd(eta)`.
    """

    eta: float = 0.1

    def apply(self, state, x, dx):
        return state, ops.scalar(self.eta, x) * dx


def check_state_dtype(rule, name: str) -> None:
    """A rule's explicit dtype for a state array (`Adam(mu_dtype=...)`): None (the parameter's
    dtype), or a floating or complex dtype: a NumPy one or its name (`"bfloat16"` once JAX or
    ml_dtypes is imported), or the backend's own (`torch.bfloat16`, `jnp.bfloat16`)."""
    value = getattr(rule, name)
    if value is None:
        return
    if getattr(value, "is_floating_point", None) is not None:  # torch.dtype
        ok = value.is_floating_point or value.is_complex
    else:
        try:
            dtype = np.dtype(value)
            ok = dtype.kind in "fc" or dtype.name.startswith(("bfloat", "float"))
        except TypeError:  # "bfloat16" before ml_dtypes is imported
            ok = isinstance(value, str) and value.startswith(("bfloat", "float", "complex"))
    if not ok:
        raise TypeError(
            f"{type(rule).__name__}: {name} must be None (the parameter's dtype) or a floating or "
            f"complex dtype, got {value!r}"
        )


def zeros_in(x, dtype):
    """Zeros shaped like `x`, in `dtype` (None: x's own; made from real zeros, so that a real
    dtype for a complex `x` discards no imaginary part)."""
    return ops.zeros_like(x) if dtype is None else ops.cast(real_zeros(x), dtype)


def stored_in(new, dtype):
    """A new state array in the explicit state dtype `dtype` (None: as computed)."""
    return new if dtype is None else ops.cast(new, dtype)


#: the metadata of an explicit state dtype field: not a hyperparameter (`adjust` leaves it), and
#: left out of a checkpoint's rule text while it is None, as rules without it were written
STATE_DTYPE = {"static": True, "state_dtype": True}


def repr_without(rule, name: str) -> str:
    """The dataclass repr of `rule`, without field `name` while it is None (its default): an
    explicit state dtype shows only when given."""
    shown = [f for f in fields(rule) if f.repr and not (f.name == name and getattr(rule, name) is None)]
    inner = ", ".join(f"{f.name}={getattr(rule, f.name)!r}" for f in shown)
    return f"{type(rule).__name__}({inner})"


@dataclass(frozen=True)
class _MomentumFamily(Elementwise):
    """The fields and velocity state shared by Momentum and Nesterov. `accumulator_dtype`
    (keyword only): the velocity's dtype, None for the parameter's (optax's `accumulator_dtype`);
    the step is computed in the promoted dtype, and the velocity stored in this one."""

    eta: float = 0.01
    rho: float = 0.9
    accumulator_dtype: Any = field(default=None, kw_only=True, metadata=STATE_DTYPE)

    def validate(self):
        super().validate()
        check_state_dtype(self, "accumulator_dtype")

    def hyperparameters(self) -> tuple[str, ...]:
        return tuple(n for n in super().hyperparameters() if n != "accumulator_dtype")

    def init(self, x):
        return zeros_in(x, self.accumulator_dtype)


@dataclass(frozen=True)
class Momentum(_MomentumFamily):
    """Gradient descent with (heavy-ball) momentum (Polyak, 1964).

    State: velocity `v = 0`. Each step: `v ← ρ·v + η·g`, `step = v`.

    Defaults: `eta=0.01, rho=0.9`. PyTorch: `torch.optim.SGD(lr=eta, momentum=rho)`; optax:
    `optax.sgd(eta, momentum=rho)`. Those keep η *outside* the velocity (`v ← ρv + g`,
    `step = ηv`); the two agree while η is constant, but after `adjust` changes η here the old
    velocity keeps the old learning rate (as in Optimisers.jl).
    """

    def __repr__(self):
        return repr_without(self, "accumulator_dtype")

    def apply(self, state, x, dx):
        eta, rho = cast(x, self.eta, self.rho)
        v = rho * state + eta * dx
        return stored_in(v, self.accumulator_dtype), v


@dataclass(frozen=True)
class Nesterov(_MomentumFamily):
    """Gradient descent with Nesterov momentum (Nesterov, 1983; Sutskever et al., 2013).

    State: `v = 0`, a displacement (it has the sign of `x_new − x`). Each step, with the old `v`:
    `step = (1+ρ)·η·g − ρ²·v`, then `v ← ρ·v − η·g`.

    Defaults: `eta=0.001, rho=0.9`. PyTorch: `torch.optim.SGD(lr=eta, momentum=rho,
    nesterov=True)`; optax: `optax.sgd(eta, momentum=rho, nesterov=True)`. Same steps while η is
    constant (they keep η outside the velocity; see `Momentum`).
    """

    eta: float = 0.001

    def __repr__(self):
        return repr_without(self, "accumulator_dtype")

    def apply(self, state, x, dx):
        eta, rho = self.eta, self.rho
        cg, cv = cast(x, (1 + rho) * eta, rho * rho)
        step = cg * dx - cv * state
        eta, rho = cast(x, eta, rho)
        return stored_in(rho * state - eta * dx, self.accumulator_dtype), step
