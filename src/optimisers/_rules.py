"""The optimisation rules. Each is a frozen dataclass of hyperparameters with `init` and `apply`
(see `_rule.Rule`); the maths uses `_ops`, so one formula serves every backend."""

from __future__ import annotations

from dataclasses import dataclass

from . import _ops as ops
from ._rule import Rule, check_range


@dataclass(frozen=True)
class Descent(Rule):
    """Plain gradient descent: `x ← x − η·g`.

    Defaults: `eta=0.1`. PyTorch: `torch.optim.SGD(lr=eta)`; optax: `optax.sgd(eta)`.
    """

    eta: float = 0.1

    def apply(self, state, x, dx):
        return state, ops.scalar(self.eta, x) * dx


@dataclass(frozen=True)
class Adam(Rule):
    """Adam (Kingma & Ba, 2015).

    State `(m, v, t)`. Each step, with `t` counting steps from 1:
    `m ← β₁m + (1−β₁)g`, `v ← β₂v + (1−β₂)|g|²`,
    `step = η · (m/(1−β₁ᵗ)) / (√(v/(1−β₂ᵗ)) + ε)`.

    Defaults: `eta=0.001, beta=(0.9, 0.999), epsilon=1e-8`. PyTorch: `torch.optim.Adam(lr=eta,
    betas=beta, eps=epsilon)`; optax: `optax.adam(eta, b1, b2, eps)`.
    """

    eta: float = 0.001
    beta: tuple = (0.9, 0.999)
    epsilon: float = 1e-8

    def validate(self):
        check_range(self, "beta", 0.0, 1.0, high_open=True)

    def init(self, x):
        return ops.zeros_like(x), ops.zeros_like(x), 0

    def apply(self, state, x, dx):
        m, v, t = state
        t = t + 1
        eta, b1, b2 = (ops.scalar(h, x) for h in (self.eta, *self.beta))
        eps = ops.epsilon(self.epsilon, x)
        m = b1 * m + (1 - b1) * dx
        v = b2 * v + (1 - b2) * ops.abs2(dx)
        mhat = m / (1 - b1**t)
        vhat = v / (1 - b2**t)
        return (m, v, t), eta * mhat / (ops.sqrt(vhat) + eps)
