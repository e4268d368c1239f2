"""Rules that scale each element's step by its own gradient history (Adam's family aside)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from optimisers import ops
from optimisers.core.rule import concrete
from optimisers.rules.common import Elementwise, cast

__all__ = ["RMSProp", "Rprop", "AdaGrad", "AdaDelta"]


@dataclass(frozen=True)
class RMSProp(Elementwise):
    """RMSProp (Hinton, Lecture 6e of "Neural Networks for Machine Learning", 2012); the centred
    variant divides by an estimate of the standard deviation instead (Graves, 2013).

    State: `s = 0`, plus `c = 0` when centred (state `(s, c)`). Each step:
    `s ← ρ·s + (1−ρ)·|g|²`; centred: `c ← ρ·c + (1−ρ)·g`;
    `step = η·g / (√(s − |c|²) + ε)` (`c = 0` when not centred).

    Defaults: `eta=0.001, rho=0.9, epsilon=1e-8, centred=False` (keyword only). `centred` cannot be
    changed by `adjust`, since the two variants keep different state.
    PyTorch: `torch.optim.RMSprop(lr=eta, alpha=rho, eps=epsilon, centered=centred)` (torch's
    default `alpha` is 0.99). optax: `optax.rmsprop(eta, decay=rho, eps=epsilon,
    eps_in_sqrt=False, centered=centred)` (optax's default puts ε inside the root).
    """

    nonnegative_state = (0,)  # (LowBit's unsigned maps)

    eta: float = 0.001
    rho: float = 0.9
    epsilon: float = 1e-8
    centred: bool = field(default=False, kw_only=True)

    def adjust(self, **hyper):
        if "centred" in hyper:
            raise ValueError(
                "RMSProp: centred cannot be adjusted (the centred variant keeps different state); "
                "set up a new RMSProp(..., centred=...) instead"
            )
        return super().adjust(**hyper)

    def init(self, x):
        return (ops.zeros_like(x), ops.zeros_like(x)) if self.centred else ops.zeros_like(x)

    def apply(self, state, x, dx):
        eta, rho, keep = cast(x, self.eta, self.rho, 1 - self.rho)
        eps = ops.epsilon(self.epsilon, x)
        s = state[0] if self.centred else state
        s = rho * s + keep * ops.abs2(dx)
        if self.centred:
            c = rho * state[1] + keep * dx
            return (s, c), eta * dx / (ops.sqrt(s - ops.abs2(c)) + eps)
        return s, eta * dx / (ops.sqrt(s) + eps)


@dataclass(frozen=True)
class Rprop(Elementwise):
    """Resilient backpropagation (Riedmiller & Braun, 1993), in the variant without weight
    backtracking ("Rprop−", Igel & Hüsken, 2000), as in Optimisers.jl and PyTorch.

    Each element has its own step size `s`, grown by `ℓ⁺` while the gradient keeps its sign and
    shrunk by `ℓ⁻` when it flips. State `(p, s)`: the previous (masked) gradient `p = 0` and
    `s = η` everywhere. Each step, elementwise, with the old `p`:
    if `p·g > 0`: `s ← min(ℓ⁺·s, Γmax)`; if `p·g < 0`: `s ← max(ℓ⁻·s, Γmin)`; otherwise `s` stays;
    `p ← 0` where `p·g < 0`, else `p ← g`; `step = s·sign(p)` (so no move on a sign flip).

    Defaults: `eta=1e-3, ell=(0.5, 1.2), gamma=(1e-6, 50.0)`. PyTorch: `torch.optim.Rprop(lr=eta,
    etas=ell, step_sizes=gamma)`; torch clamps every step size to `gamma` each step, not only the
    changed ones, which differs only when `eta` lies outside `gamma`. optax has no Rprop.
    Real parameters only. The state keeps the parameter's dtype whatever the gradient's.
    """

    nonnegative_state = (1,)  # (LowBit's unsigned maps)

    eta: float = 1e-3
    ell: tuple = (0.5, 1.2)
    gamma: tuple = (1e-6, 50.0)
    infinite_ok: ClassVar[tuple[str, ...]] = ("gamma",)  # no bound on the step size
    real_only = True

    def validate(self):
        shrink, grow = (concrete(v) for v in self.ell)
        if shrink is not None and not 0 < shrink <= 1:
            raise ValueError(f"Rprop: ell[0] (the shrink factor) must be in (0, 1], got {shrink}")
        if grow is not None and not grow >= 1:
            raise ValueError(f"Rprop: ell[1] (the growth factor) must be >= 1, got {grow}")
        low, high = (concrete(v) for v in self.gamma)
        if low is not None and not low >= 0:
            raise ValueError(f"Rprop: gamma[0] (the smallest step) must be >= 0, got {low}")
        if low is not None and high is not None and not low <= high:
            raise ValueError(f"Rprop: gamma must be (smallest, largest) step, got {self.gamma}")

    def init(self, x):
        return ops.zeros_like(x), ops.full_like(x, self.eta)

    def apply(self, state, x, dx):
        dx = ops.astype(dx, x)  # a float64 gradient must not widen a float32 state
        p, s = state
        shrink, grow, low, high = cast(x, *self.ell, *self.gamma)
        turn = p * dx
        s = ops.where(
            turn > 0,
            ops.minimum(s * grow, high),
            ops.where(turn < 0, ops.maximum(s * shrink, low), s),
        )
        p = ops.where(turn < 0, ops.zeros_like(dx), dx)
        return (p, s), s * ops.sign(p)


@dataclass(frozen=True)
class AdaGrad(Elementwise):
    """AdaGrad (Duchi, Hazan & Singer, "Adaptive Subgradient Methods", 2011).

    State: the sum of squared gradients, `a = ε` everywhere initially. Each step:
    `a ← a + |g|²`, `step = η·g / (√a + ε)`.

    Defaults: `eta=0.1, epsilon=1e-8`. PyTorch: `torch.optim.Adagrad(lr=eta,
    initial_accumulator_value=epsilon, eps=epsilon)`. optax: `optax.adagrad(eta,
    initial_accumulator_value=epsilon, eps=0)` is close but puts its ε inside the root.
    """

    nonnegative_state = (0,)  # (LowBit's unsigned maps)

    eta: float = 0.1
    epsilon: float = 1e-8

    def init(self, x):
        return ops.zeros_like(x) + ops.epsilon(self.epsilon, x)

    def apply(self, state, x, dx):
        eta, eps = ops.scalar(self.eta, x), ops.epsilon(self.epsilon, x)
        a = state + ops.abs2(dx)
        return a, eta * dx / (ops.sqrt(a) + eps)


@dataclass(frozen=True)
class AdaDelta(Elementwise):
    """AdaDelta (Zeiler, "ADADELTA: An Adaptive Learning Rate Method", 2012). It has no learning
    rate, so `adjust(state, eta)` leaves it unchanged (and is an error if no other rule has `eta`).

    State `(a, d)`, both 0. Each step: `a ← ρa + (1−ρ)|g|²`,
    `step = g·√(d + ε) / √(a + ε)` (with the old `d`), then `d ← ρd + (1−ρ)|step|²`.

    Defaults: `rho=0.9, epsilon=1e-8`. PyTorch: `torch.optim.Adadelta(lr=1.0, rho=rho,
    eps=epsilon)`; optax: `optax.adadelta(1.0, rho=rho, eps=epsilon)`.
    """

    nonnegative_state = (0, 1)  # (LowBit's unsigned maps)

    rho: float = 0.9
    epsilon: float = 1e-8

    def init(self, x):
        return ops.zeros_like(x), ops.zeros_like(x)

    def apply(self, state, x, dx):
        a, d = state
        rho, keep = cast(x, self.rho, 1 - self.rho)
        eps = ops.epsilon(self.epsilon, x)
        a = rho * a + keep * ops.abs2(dx)
        step = dx * ops.sqrt(d + eps) / ops.sqrt(a + eps)
        d = rho * d + keep * ops.abs2(step)
        return (a, d), step
