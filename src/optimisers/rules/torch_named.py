"""Rules with torch.optim's formulas, for the drop-in classes of `optimisers.torch`, where torch
computes something the library's rules do not (SGD's momentum keeps the learning rate out of the
velocity, Adamax adds ε inside the maximum, ...): each writes torch's single-tensor formula in the
order torch computes it, on `ops`, so it gets ties, flat buffers, checkpoints and every backend
like any rule. They take the real view of a complex parameter (as torch does): `|g|²` is `g²`.

Private: users reach them through `optimisers.torch.SGD`, `RMSprop`, ... (torch's group and
`state[p]` keys). The drop-in class applies torch's L2 `weight_decay` and `maximize` to the
gradient before the rule sees it, as torch does first; `eta` is torch's `lr`.
"""

from __future__ import annotations

from dataclasses import dataclass

from optimisers import ops
from optimisers.rules.common import Elementwise, Moments, cast, nonnegative


def _decay(rule, x, step):
    """`step` plus decoupled weight decay `lr·λ·x` (torch multiplies the parameter by `1 − lr·λ`
    before the step)."""
    if rule.decoupled_decay == 0:
        return step
    (scale,) = cast(x, rule.eta * rule.decoupled_decay)
    return step + scale * x


def _moments(x, dx, state, beta):
    """`(m, v, t)` of a state `(m, v, ..., t)`: torch's `m ← β₁·m + (1−β₁)·g`,
    `v ← β₂·v + (1−β₂)·g·g`, multiplied in torch's order (not `ops.abs2`, which rounds otherwise),
    and the new step number."""
    b1, b2 = beta
    cb1, cm, cb2, cv = cast(x, b1, 1 - b1, b2, 1 - b2)
    return cb1 * state[0] + cm * dx, cb2 * state[1] + cv * dx * dx, state[-1] + 1


@dataclass(frozen=True)
class _TorchAdam(Moments):
    """The fields torch.optim's Adam-like classes share."""

    eta: float = 1e-3
    beta: tuple = (0.9, 0.999)
    eps: float = 1e-8


@dataclass(frozen=True)
class TorchSGD(Moments):
    """torch.optim.SGD with momentum: `buf ← g` at the first step, then
    `buf ← μ·buf + (1−dampening)·g`; `step = lr·(g + μ·buf)` with Nesterov, else `lr·buf`."""

    eta: float = 1e-3
    momentum: float = 0.9
    dampening: float = 0.0
    nesterov: bool = False
    moments = 1  # buf

    def validate(self):
        nonnegative(self, "momentum")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("TorchSGD: Nesterov momentum requires a momentum and zero dampening")

    def apply(self, state, x, dx):
        buf, t = state
        mu, damp, lr = cast(x, self.momentum, 1 - self.dampening, self.eta)
        buf = ops.copy(dx) if t == 0 else mu * buf + damp * dx
        direction = dx + mu * buf if self.nesterov else buf
        return (buf, 1), lr * direction


@dataclass(frozen=True)
class TorchRMSprop(Elementwise):
    """torch.optim.RMSprop: `s ← α·s + (1−α)·g²`; centred: `c ← α·c + (1−α)·g`,
    `d = √(s − c²) + ε`, else `d = √s + ε`; with momentum `buf ← μ·buf + g/d`, `step = lr·buf`,
    else `step = lr·g/d`. State `(s, [c], [buf], t)`: `c` only when centred, `buf` only with
    momentum."""

    eta: float = 1e-2
    alpha: float = 0.99
    eps: float = 1e-8
    momentum: float = 0.0
    centered: bool = False

    def init(self, x):
        arrays = 1 + int(self.centered) + int(self.momentum > 0)  # s, [c], [buf]
        return (*(ops.zeros_like(x) for _ in range(arrays)), 0)

    def apply(self, state, x, dx):
        s, *rest, t = state
        a, ca, eps, lr = cast(x, self.alpha, 1 - self.alpha, self.eps, self.eta)
        s = a * s + ca * dx * dx
        out = [s]
        if self.centered:
            c = a * rest.pop(0) + ca * dx
            out.append(c)
            d = ops.sqrt(s - c * c) + eps
        else:
            d = ops.sqrt(s) + eps
        if self.momentum > 0:
            (mu,) = cast(x, self.momentum)
            buf = mu * rest.pop(0) + dx / d
            out.append(buf)
            return (*out, t + 1), lr * buf
        return (*out, t + 1), lr * (dx / d)


@dataclass(frozen=True)
class TorchAdagrad(Elementwise):
    """torch.optim.Adagrad: `sum ← sum + g²` (starting at `initial_accumulator_value`),
    `step = lr/(1 + (t−1)·lr_decay) · g/(√sum + ε)`."""

    eta: float = 1e-2
    lr_decay: float = 0.0
    eps: float = 1e-10
    initial_accumulator_value: float = 0.0

    def init(self, x):
        return ops.full_like(x, self.initial_accumulator_value), 0

    def apply(self, state, x, dx):
        total, t = state
        t = t + 1
        clr, eps = cast(x, self.eta / (1 + (t - 1) * self.lr_decay), self.eps)
        total = total + dx * dx
        return (total, t), clr * (dx / (ops.sqrt(total) + eps))


@dataclass(frozen=True)
class TorchAdadelta(Moments):
    """torch.optim.Adadelta: `s ← ρ·s + (1−ρ)·g²`, `δ = √(a + ε)/√(s + ε) · g`,
    `a ← ρ·a + (1−ρ)·δ²`, `step = lr·δ`."""

    eta: float = 1.0
    rho: float = 0.9
    eps: float = 1e-6

    def apply(self, state, x, dx):
        s, a, t = state
        rho, crho, eps, lr = cast(x, self.rho, 1 - self.rho, self.eps, self.eta)
        s = rho * s + crho * dx * dx
        delta = ops.sqrt(a + eps) / ops.sqrt(s + eps) * dx
        a = rho * a + crho * delta * delta
        return (s, a, t + 1), lr * delta


@dataclass(frozen=True)
class TorchAdamax(_TorchAdam):
    """torch.optim.Adamax: `m ← β₁·m + (1−β₁)·g`, `u ← max(β₂·u, |g| + ε)`,
    `step = lr/(1−β₁ᵗ) · m/u` (ε inside the maximum, unlike the library's AdaMax)."""

    eta: float = 2e-3

    def apply(self, state, x, dx):
        m, u, t = state
        t = t + 1
        b1, b2 = self.beta
        cb1, cm, cb2, eps, clr = cast(x, b1, 1 - b1, b2, self.eps, self.eta / (1 - b1**t))
        m = cb1 * m + cm * dx
        u = ops.maximum(cb2 * u, ops.abs(dx) + eps)
        return (m, u, t), clr * (m / u)


@dataclass(frozen=True)
class TorchNAdam(_TorchAdam):
    """torch.optim.NAdam: momentum schedule `μₜ = β₁(1 − ½·0.96^(t·ψ))`, `Π ← Π·μₜ`; `m, v` as
    Adam; `d = √(v/(1−β₂ᵗ)) + ε`;
    `step = lr(1−μₜ)/(1−Π) · g/d + lr·μₜ₊₁/(1−Π·μₜ₊₁) · m/d` (+ `lr·λ·x` decoupled decay).
    State `(m, v, Π, t)`."""

    eta: float = 2e-3
    momentum_decay: float = 4e-3
    decoupled_decay: float = 0.0

    def init(self, x):
        return ops.zeros_like(x), ops.zeros_like(x), 1.0, 0

    def apply(self, state, x, dx):
        m, v, t = _moments(x, dx, state, self.beta)
        b1, b2 = self.beta
        mu = b1 * (1.0 - 0.5 * 0.96 ** (t * self.momentum_decay))
        mu_next = b1 * (1.0 - 0.5 * 0.96 ** ((t + 1) * self.momentum_decay))
        product = state[2] * mu
        bc2, eps = cast(x, 1 - b2**t, self.eps)
        cg, cmom = cast(
            x, self.eta * (1.0 - mu) / (1.0 - product), self.eta * mu_next / (1.0 - product * mu_next)
        )
        d = ops.sqrt(v / bc2) + eps
        return (m, v, product, t), _decay(self, x, cg * (dx / d) + cmom * (m / d))


@dataclass(frozen=True)
class TorchRAdam(_TorchAdam):
    """torch.optim.RAdam: `m, v` as Adam; `ρ∞ = 2/(1−β₂) − 1`, `ρₜ = ρ∞ − 2tβ₂ᵗ/(1−β₂ᵗ)`; when
    `ρₜ > 5`: `step = lr · m/(1−β₁ᵗ) · r · √(1−β₂ᵗ)/(√v + ε)` with
    `r = √((ρₜ−4)(ρₜ−2)ρ∞ / ((ρ∞−4)(ρ∞−2)ρₜ))`, else `step = lr · m/(1−β₁ᵗ)` (+ `lr·λ·x`
    decoupled decay)."""

    decoupled_decay: float = 0.0

    def apply(self, state, x, dx):
        m, v, t = _moments(x, dx, state, self.beta)
        b1, b2 = self.beta
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        rho_inf = 2 / (1 - b2) - 1
        rho = rho_inf - 2 * t * b2**t / bc2
        if rho > 5.0:
            rect = ((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho)) ** 0.5
            (scale,) = cast(x, self.eta * rect * bc2**0.5 / bc1)
            step = scale * m / (ops.sqrt(v) + ops.scalar(self.eps, x))
        else:
            (scale,) = cast(x, self.eta / bc1)
            step = scale * m
        return (m, v, t), _decay(self, x, step)


@dataclass(frozen=True)
class TorchRprop(Elementwise):
    """torch.optim.Rprop: with `s = sign(g·prev)`, the step size is multiplied by `etas[1]`
    where `s > 0`, by `etas[0]` where `s < 0`, and clamped to `step_sizes`; where `s < 0` the
    gradient counts as 0; `step = sign(g)·step_size`, `prev ← g`. The step sizes start at `lr`."""

    eta: float = 1e-2
    etas: tuple = (0.5, 1.2)
    step_sizes: tuple = (1e-6, 50.0)

    def init(self, x):
        return ops.zeros_like(x), ops.full_like(x, self.eta), 0

    def apply(self, state, x, dx):
        prev, size, t = state
        minus, plus, low, high = cast(x, *self.etas, *self.step_sizes)
        turn = ops.sign(dx * prev)
        size = ops.clip(ops.where(turn > 0, size * plus, ops.where(turn < 0, size * minus, size)), low, high)
        g = ops.where(turn < 0, ops.zeros_like(dx), dx)
        return (g, size, t + 1), ops.sign(g) * size


@dataclass(frozen=True)
class TorchAMSGrad(_TorchAdam):
    """torch.optim.Adam/AdamW with `amsgrad=True`: `m, v` as Adam, `v̂ ← max(v̂, v)`,
    `step = lr/(1−β₁ᵗ) · m / (√v̂/√(1−β₂ᵗ) + ε)` (+ `lr·λ·x` decoupled decay)."""

    decoupled_decay: float = 0.0
    moments = 3  # and v̂

    def apply(self, state, x, dx):
        m, v, t = _moments(x, dx, state, self.beta)
        b1, b2 = self.beta
        clr, root_bc2, eps = cast(x, self.eta / (1 - b1**t), (1 - b2**t) ** 0.5, self.eps)
        vmax = ops.maximum(state[2], v)
        return (m, v, vmax, t), _decay(self, x, clr * m / (ops.sqrt(vmax) / root_bc2 + eps))
