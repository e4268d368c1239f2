"""Gradient descent, with and without momentum."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from optimisers import ops
from optimisers.rules.common import Elementwise, cast, state_dtype, stored_in, zeros_in

__all__ = ["Descent", "Momentum", "Nesterov"]


@dataclass(frozen=True)
class Descent(Elementwise):
    """Plain gradient descent: `x ← x − η·g`.

    Defaults: `eta=0.1`. PyTorch: `torch.optim.SGD(lr=eta)`; optax: `optax.sgd(eta)`.
    """

    eta: float = 0.1

    def apply(self, state, x, dx):
        return state, ops.scalar(self.eta, x) * dx


@dataclass(frozen=True)
class _MomentumFamily(Elementwise):
    """The fields and velocity state shared by Momentum and Nesterov. `accumulator_dtype`
    (keyword only): the velocity's dtype, None for the parameter's (optax's `accumulator_dtype`);
    the step is computed in the promoted dtype, and the velocity stored in this one."""

    eta: float = 0.01
    rho: float = 0.9
    accumulator_dtype: Any = state_dtype()

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

    def apply(self, state, x, dx):
        eta, rho = self.eta, self.rho
        cg, cv, eta, rho = cast(x, (1 + rho) * eta, rho * rho, eta, rho)
        return stored_in(rho * state - eta * dx, self.accumulator_dtype), cg * dx - cv * state
