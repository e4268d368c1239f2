"""The optimisation rules. Each is a frozen dataclass of hyperparameters with `init` and `apply`
(see `_rule.Rule`); the maths uses `_ops`, so one formula serves every backend.

Conventions shared by every rule here:

* Hyperparameters are cast to the parameter's dtype when a step is taken (`ops.scalar`), and
  epsilons to its real dtype with Optimisers.jl's float16 floor (`ops.epsilon`), so float16, bfloat16,
  float32 and float64 parameters keep their dtype. Scalars derived from hyperparameters (`1−β`,
  the bias corrections `1−βᵗ`, RAdam's ρ) are computed in the hyperparameters' own precision
  (Python floats, or traced values under `jax.jit`) and cast last: in bfloat16, 0.999 rounds to 1,
  so `1 − bf16(β₂)` would be 0 where `bf16(1 − β₂)` is 0.001. (Optimisers.jl casts β first.)
  The library's updates call `apply` for a float16/bfloat16 parameter with float32 copies of the
  parameter, gradient and state (`optimisers._precision`), so the maths here meets float32 there.
* State arrays have the parameter's dtype, except MixedPrecision's master copy (its `dtype`) and a
  running *maximum* of magnitudes (AdaMax, AMSGrad): complex numbers have no order, so for a complex
  parameter those arrays hold the real dtype. Step counters are Python ints counting completed
  steps, so `t` is 1 on the first step.
* Rules whose step for each element depends only on that element and on scalar state set
  `elementwise = True`, so the update engine may run them over packed chunks of parameters.
  ClipNorm does not (its norm couples the whole array); chains and MixedPrecision inherit the flag
  from their members.
* `apply` never writes to its inputs; the interface decides whether parameters change in place.
* Complex parameters work wherever the maths is defined (`|g|²` is `ops.abs2`). Rules built on the
  sign or the order of numbers (Rprop, Lion, SignDecay, ClipGrad) raise TypeError for them in `init`.
* `x_new = x - step`. In the formulas `g` is the gradient and `t` the step number.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from optimisers import ops
from optimisers.core.rule import NewValue, Rule, _concrete, check_range, has_schedules
from optimisers.core.state import flatten_state, unflatten_state

# --- helpers -----------------------------------------------------------------------------------


def _nonnegative(rule: Rule, *names: str) -> None:
    for name in names:
        check_range(rule, name, 0.0, math.inf)


def _real_only(rule: Rule, x) -> None:
    if ops.is_complex(x):
        raise TypeError(
            f"{type(rule).__name__} is not defined for complex parameters (it uses the sign or the "
            f"order of numbers); got an array of dtype {x.dtype}"
        )


def _cast(x, *values):
    """Each value as a scalar of `x`'s dtype."""
    return tuple(ops.scalar(v, x) for v in values)


def _adam_moments(x, dx, m, v, beta, t):
    """Adam's moment updates at step `t`: `(m, v, 1−β₁ᵗ, 1−β₂ᵗ)`, the bias corrections as scalars
    of `x`'s dtype, so that a rule can fold them into its other scalars before touching arrays."""
    b1, b2 = beta
    cb1, cm, cb2, cv, bc1, bc2 = _cast(x, b1, 1 - b1, b2, 1 - b2, 1 - b1**t, 1 - b2**t)
    m = cb1 * m + cm * dx
    v = cb2 * v + cv * ops.abs2(dx)
    return m, v, bc1, bc2


def _adam_direction(m, v, bc1, bc2, scale, eps):
    """`scale · (m/bc1) / (√(v/bc2) + ε)`, with `scale/bc1` one scalar: a pass over the arrays
    fewer than dividing `m` first, and a NumPy step costs about its number of passes."""
    return (scale / bc1) * m / (ops.sqrt(v / bc2) + eps)


def _real_zeros(x):
    """Zeros shaped like `x` in its real dtype (for a real `x`, just its dtype)."""
    return ops.abs(ops.zeros_like(x))


# --- plain gradient descent and momentum ---------------------------------------------------------


@dataclass(frozen=True)
class Descent(Rule):
    """Plain gradient descent: `x ← x − η·g`.

    Defaults: `eta=0.1`. PyTorch: `torch.optim.SGD(lr=eta)`; optax: `optax.sgd(eta)`.
    """

    elementwise = True
    never_raises = True

    eta: float = 0.1

    def apply(self, state, x, dx):
        return state, ops.scalar(self.eta, x) * dx


@dataclass(frozen=True)
class _MomentumFamily(Rule):
    """The fields, check and velocity state shared by Momentum and Nesterov."""

    elementwise = True
    never_raises = True

    eta: float = 0.01
    rho: float = 0.9

    def validate(self):
        check_range(self, "rho", 0.0, 1.0)

    def init(self, x):
        return ops.zeros_like(x)


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
        eta, rho = _cast(x, self.eta, self.rho)
        v = rho * state + eta * dx
        return v, v


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
        cg, cv = _cast(x, (1 + rho) * eta, rho * rho)
        step = cg * dx - cv * state
        eta, rho = _cast(x, eta, rho)
        return rho * state - eta * dx, step


# --- adaptive rules ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RMSProp(Rule):
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

    elementwise = True
    never_raises = True

    eta: float = 0.001
    rho: float = 0.9
    epsilon: float = 1e-8
    centred: bool = field(default=False, kw_only=True)

    def validate(self):
        check_range(self, "rho", 0.0, 1.0)
        _nonnegative(self, "epsilon")

    def adjust(self, **hyper):
        if "centred" in hyper:
            raise ValueError(
                "RMSProp: centred cannot be adjusted (the centred variant keeps different state); "
                "set up a new RMSProp(..., centred=...) instead"
            )
        return super().adjust(**hyper)

    def init(self, x):
        s = ops.zeros_like(x)
        return (s, ops.zeros_like(x)) if self.centred else s

    def apply(self, state, x, dx):
        eta, rho, keep = _cast(x, self.eta, self.rho, 1 - self.rho)
        eps = ops.epsilon(self.epsilon, x)
        s = state[0] if self.centred else state
        s = rho * s + keep * ops.abs2(dx)
        if self.centred:
            c = rho * state[1] + keep * dx
            return (s, c), eta * dx / (ops.sqrt(s - ops.abs2(c)) + eps)
        return s, eta * dx / (ops.sqrt(s) + eps)


@dataclass(frozen=True)
class Rprop(Rule):
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

    elementwise = True
    never_raises = True

    eta: float = 1e-3
    ell: tuple = (0.5, 1.2)
    gamma: tuple = (1e-6, 50.0)
    infinite_ok: ClassVar[tuple[str, ...]] = ("gamma",)  # no bound on the step size

    def validate(self):
        shrink, grow = (_concrete(v) for v in self.ell)
        if shrink is not None and not 0 < shrink <= 1:
            raise ValueError(f"Rprop: ell[0] (the shrink factor) must be in (0, 1], got {shrink}")
        if grow is not None and not grow >= 1:
            raise ValueError(f"Rprop: ell[1] (the growth factor) must be >= 1, got {grow}")
        low, high = (_concrete(v) for v in self.gamma)
        if low is not None and not low >= 0:
            raise ValueError(f"Rprop: gamma[0] (the smallest step) must be >= 0, got {low}")
        if low is not None and high is not None and not low <= high:
            raise ValueError(f"Rprop: gamma must be (smallest, largest) step, got {self.gamma}")

    def init(self, x):
        _real_only(self, x)
        return ops.zeros_like(x), ops.full_like(x, self.eta)

    def apply(self, state, x, dx):
        dx = ops.astype(dx, x)  # a float64 gradient must not widen a float32 state
        p, s = state
        shrink, grow, low, high = _cast(x, *self.ell, *self.gamma)
        turn = p * dx
        s = ops.where(
            turn > 0,
            ops.minimum(s * grow, high),
            ops.where(turn < 0, ops.maximum(s * shrink, low), s),
        )
        p = ops.where(turn < 0, ops.zeros_like(dx), dx)
        return (p, s), s * ops.sign(p)


@dataclass(frozen=True)
class _AdamFamily(Rule):
    """The fields, checks and `(m, v, t)` state shared by Adam and its variants."""

    elementwise = True
    never_raises = True

    eta: float = 0.001
    beta: tuple = (0.9, 0.999)
    epsilon: float = 1e-8

    def validate(self):
        check_range(self, "beta", 0.0, 1.0, high_open=True)
        _nonnegative(self, "epsilon")

    def init(self, x):
        return ops.zeros_like(x), ops.zeros_like(x), 0


@dataclass(frozen=True)
class Adam(_AdamFamily):
    """Adam (Kingma & Ba, "Adam: A Method for Stochastic Optimization", 2015).

    State `(m, v, t)`. Each step:
    `m ← β₁m + (1−β₁)g`, `v ← β₂v + (1−β₂)|g|²`,
    `step = η · (m/(1−β₁ᵗ)) / (√(v/(1−β₂ᵗ)) + ε)`.

    Defaults: `eta=0.001, beta=(0.9, 0.999), epsilon=1e-8`. PyTorch: `torch.optim.Adam(lr=eta,
    betas=beta, eps=epsilon)`; optax: `optax.adam(eta, b1, b2, eps)`. On PyTorch tensors
    (CPU/CUDA, float64 down to bfloat16) both `update` and `update_` run torch's own fused Adam
    kernel (same maths, its rounding).
    """

    def apply(self, state, x, dx):
        m, v, t = state
        t = t + 1
        m, v, bc1, bc2 = _adam_moments(x, dx, m, v, self.beta, t)
        eta, eps = ops.scalar(self.eta, x), ops.epsilon(self.epsilon, x)
        return (m, v, t), _adam_direction(m, v, bc1, bc2, eta, eps)


@dataclass(frozen=True)
class RAdam(_AdamFamily):
    """Rectified Adam (Liu et al., "On the Variance of the Adaptive Learning Rate and Beyond",
    2020).

    State `(m, v, t)`; `m, v` as in Adam. With `ρ∞ = 2/(1−β₂) − 1` and
    `ρ = ρ∞ − 2t·β₂ᵗ/(1−β₂ᵗ)`: if `ρ > 4`,
    `r = √((ρ−4)(ρ−2)ρ∞ / ((ρ∞−4)(ρ∞−2)ρ))` and `step = η·r·(m/(1−β₁ᵗ)) / (√(v/(1−β₂ᵗ)) + ε)`;
    otherwise (the first few steps) `step = η·m/(1−β₁ᵗ)`, momentum without adaptive scaling.
    The branch is taken with `ops.cond`, so it works on traced values under `jax.jit`. Eagerly ρ
    is computed with Python floats; traced, in float32, where ρ (a small difference of two numbers
    near ρ∞ ≈ 2000) is off by ~0.01 at the first rectified steps, changing those steps by about a
    percent (as in optax).

    Defaults: `eta=0.001, beta=(0.9, 0.999), epsilon=1e-8`. optax: `optax.radam(eta, b1, b2,
    eps, threshold=4.0)` (optax's default threshold is 5). PyTorch: `torch.optim.RAdam(lr=eta,
    betas=beta, eps=epsilon)` uses threshold 5 and puts ε outside `√v/√(1−β₂ᵗ)`, so its steps
    differ slightly.
    """

    def apply(self, state, x, dx):
        m, v, t = state
        t = t + 1
        m, v, bc1, bc2 = _adam_moments(x, dx, m, v, self.beta, t)
        eta, eps = ops.scalar(self.eta, x), ops.epsilon(self.epsilon, x)
        b2 = self.beta[1]
        rho_inf = 2 / (1 - b2) - 1
        rho = rho_inf - 2 * t * b2**t / (1 - b2**t)

        def rectified():
            r = ops.sqrt((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho))
            return _adam_direction(m, v, bc1, bc2, ops.scalar(r, x) * eta, eps)

        def unrectified():
            return (eta / bc1) * m

        return (m, v, t), ops.cond(rho > 4, rectified, unrectified)


@dataclass(frozen=True)
class AdaMax(_AdamFamily):
    """AdaMax, Adam with the infinity norm (Kingma & Ba, 2015, section 7).

    State `(m, w, t)`. Each step: `m ← β₁m + (1−β₁)g`, `w ← max(β₂w, |g|)`,
    `step = (η/(1−β₁ᵗ)) · m / (w + ε)`. For complex parameters `w` is real.

    Defaults: `eta=0.001, beta=(0.9, 0.999), epsilon=1e-8`. optax: `optax.adamax(eta, b1, b2,
    eps)`. PyTorch: `torch.optim.Adamax(lr=eta, betas=beta, eps=epsilon)` adds ε inside the
    maximum (`w ← max(β₂w, |g| + ε)`, `step ∝ m/w`), so its steps differ slightly.
    """

    def init(self, x):
        return ops.zeros_like(x), _real_zeros(x), 0

    def apply(self, state, x, dx):
        m, w, t = state
        t = t + 1
        b1, b2 = self.beta
        cb1, cm, rate = _cast(x, b1, 1 - b1, self.eta / (1 - b1**t))
        eps = ops.epsilon(self.epsilon, x)
        m = cb1 * m + cm * dx
        w = ops.maximum(ops.scalar(b2, w) * w, ops.abs(dx))  # w is real for complex x
        return (m, w, t), rate * m / (w + eps)


@dataclass(frozen=True)
class OAdam(_AdamFamily):
    """Optimistic Adam (Daskalakis et al., "Training GANs with Optimism", 2018), for
    saddle-point problems such as GANs.

    State `(m, v, q, t)`; `m, v` as in Adam. Each step:
    `q_new = η·(m/(1−β₁ᵗ)) / (√(v/(1−β₂ᵗ)) + ε)` (an Adam step), `step = 2·q_new − q`, `q ← q_new`
    (`q = 0` before the first step).

    Defaults: `eta=0.001, beta=(0.5, 0.9), epsilon=1e-8`. optax:
    `optax.optimistic_adam_v2(eta, alpha=1.0, beta=1.0, b1=0.5, b2=0.9, eps=epsilon,
    nesterov=False)` takes the same steps from the second step on; on the first it uses the
    current Adam step in place of the missing previous one, so its first step is half of ours.
    PyTorch has no OAdam.
    """

    beta: tuple = (0.5, 0.9)

    def init(self, x):
        return ops.zeros_like(x), ops.zeros_like(x), ops.zeros_like(x), 0

    def apply(self, state, x, dx):
        m, v, q, t = state
        t = t + 1
        m, v, bc1, bc2 = _adam_moments(x, dx, m, v, self.beta, t)
        eta, eps = ops.scalar(self.eta, x), ops.epsilon(self.epsilon, x)
        q_new = _adam_direction(m, v, bc1, bc2, eta, eps)
        return (m, v, q_new, t), 2 * q_new - q


@dataclass(frozen=True)
class AdaGrad(Rule):
    """AdaGrad (Duchi, Hazan & Singer, "Adaptive Subgradient Methods", 2011).

    State: the sum of squared gradients, `a = ε` everywhere initially. Each step:
    `a ← a + |g|²`, `step = η·g / (√a + ε)`.

    Defaults: `eta=0.1, epsilon=1e-8`. PyTorch: `torch.optim.Adagrad(lr=eta,
    initial_accumulator_value=epsilon, eps=epsilon)`. optax: `optax.adagrad(eta,
    initial_accumulator_value=epsilon, eps=0)` is close but puts its ε inside the root.
    """

    elementwise = True
    never_raises = True

    eta: float = 0.1
    epsilon: float = 1e-8

    def validate(self):
        _nonnegative(self, "epsilon")

    def init(self, x):
        return ops.zeros_like(x) + ops.epsilon(self.epsilon, x)

    def apply(self, state, x, dx):
        eta, eps = ops.scalar(self.eta, x), ops.epsilon(self.epsilon, x)
        a = state + ops.abs2(dx)
        return a, eta * dx / (ops.sqrt(a) + eps)


@dataclass(frozen=True)
class AdaDelta(Rule):
    """AdaDelta (Zeiler, "ADADELTA: An Adaptive Learning Rate Method", 2012). It has no learning
    rate, so `adjust(state, eta)` leaves it unchanged (and is an error if no other rule has `eta`).

    State `(a, d)`, both 0. Each step: `a ← ρa + (1−ρ)|g|²`,
    `step = g·√(d + ε) / √(a + ε)` (with the old `d`), then `d ← ρd + (1−ρ)|step|²`.

    Defaults: `rho=0.9, epsilon=1e-8`. PyTorch: `torch.optim.Adadelta(lr=1.0, rho=rho,
    eps=epsilon)`; optax: `optax.adadelta(1.0, rho=rho, eps=epsilon)`.
    """

    elementwise = True
    never_raises = True

    rho: float = 0.9
    epsilon: float = 1e-8

    def validate(self):
        check_range(self, "rho", 0.0, 1.0)
        _nonnegative(self, "epsilon")

    def init(self, x):
        return ops.zeros_like(x), ops.zeros_like(x)

    def apply(self, state, x, dx):
        a, d = state
        rho, keep = _cast(x, self.rho, 1 - self.rho)
        eps = ops.epsilon(self.epsilon, x)
        a = rho * a + keep * ops.abs2(dx)
        step = dx * ops.sqrt(d + eps) / ops.sqrt(a + eps)
        d = rho * d + keep * ops.abs2(step)
        return (a, d), step


@dataclass(frozen=True)
class AMSGrad(_AdamFamily):
    """AMSGrad (Reddi, Kale & Kumar, "On the Convergence of Adam and Beyond", 2018): Adam whose
    denominator never decreases.

    State `(m, v, v̂max, t)`, all zero. Each step: `m, v` as in Adam;
    `v̂max ← max(v̂max, v/(1−β₂ᵗ))`; `step = η·(m/(1−β₁ᵗ)) / (√v̂max + ε)`.
    For complex parameters `v` and `v̂max` are real.

    This is optax's AMSGrad (`optax.amsgrad(eta, b1, b2, eps)`): zero initial state and bias
    correction, the maximum taken over the bias-corrected `v`. Optimisers.jl instead fills all
    three arrays with ε and does no bias correction (its first steps are ≈ η·sign(g)/√(1−β₂)
    smaller); the paper's Algorithm 2 has no bias correction either. PyTorch
    (`torch.optim.Adam(amsgrad=True)`) takes the maximum of the *uncorrected* `v` and then
    divides by the current `√(1−β₂ᵗ)`, which differs from this after `v` has decayed.

    Defaults: `eta=0.001, beta=(0.9, 0.999), epsilon=1e-8`.
    """

    def init(self, x):
        return ops.zeros_like(x), _real_zeros(x), _real_zeros(x), 0

    def apply(self, state, x, dx):
        m, v, vmax, t = state
        t = t + 1
        b1, b2 = self.beta
        eta, cb1, cm, bc1 = _cast(x, self.eta, b1, 1 - b1, 1 - b1**t)
        cb2, cv, bc2 = _cast(v, b2, 1 - b2, 1 - b2**t)  # v is real for complex x
        eps = ops.epsilon(self.epsilon, x)
        m = cb1 * m + cm * dx
        v = cb2 * v + cv * ops.abs2(dx)
        vmax = ops.maximum(vmax, v / bc2)
        return (m, v, vmax, t), eta * (m / bc1) / (ops.sqrt(vmax) + eps)


@dataclass(frozen=True)
class NAdam(_AdamFamily):
    """NAdam, Adam with Nesterov momentum (Dozat, "Incorporating Nesterov Momentum into Adam",
    2016).

    State `(m, v, t)`; `m, v` as in Adam. Each step:
    `m̂ = β₁·m/(1−β₁ᵗ⁺¹) + (1−β₁)·g/(1−β₁ᵗ)`, `v̂ = v/(1−β₂ᵗ)`, `step = η·m̂ / (√v̂ + ε)`.

    This is the paper's formula and optax's `optax.nadam(eta, b1, b2, eps)`. Optimisers.jl has an
    extra factor β₂ under the root (`√(β₂·v̂)`); we follow the paper, as optax does.
    PyTorch's `torch.optim.NAdam` uses Dozat's momentum-decay schedule
    `μₜ = β₁(1 − ½·0.96^(t·ψ))` (`momentum_decay=ψ=4e-3`), which no setting turns into this rule
    (`momentum_decay=0` gives `μ = β₁/2`), so its steps differ.

    Defaults: `eta=0.001, beta=(0.9, 0.999), epsilon=1e-8`.
    """

    def apply(self, state, x, dx):
        m, v, t = state
        t = t + 1
        m, v, _, bc2 = _adam_moments(x, dx, m, v, self.beta, t)
        b1 = self.beta[0]
        eta, cm, cg = _cast(x, self.eta, b1 / (1 - b1 ** (t + 1)), (1 - b1) / (1 - b1**t))
        eps = ops.epsilon(self.epsilon, x)
        mhat = cm * m + cg * dx
        return (m, v, t), eta * mhat / (ops.sqrt(v / bc2) + eps)


@dataclass(frozen=True)
class AdamW(Rule):
    """AdamW, Adam with decoupled weight decay (Loshchilov & Hutter, "Decoupled Weight Decay
    Regularization", 2019).

    State `(m, v, t)`; `m, v` as in Adam. With the unit-rate Adam direction
    `a = (m/(1−β₁ᵗ)) / (√(v/(1−β₂ᵗ)) + ε)` and `x` the parameter before the step:
    `couple=True` (default): `step = η·(a + λ·x)`; `couple=False`: `step = η·a + λ·x`
    (the decay is not scaled by η; the same as `OptimiserChain(Adam(η), WeightDecay(λ))`).

    Defaults: `eta=0.001, beta=(0.9, 0.999), lambd=0.0, epsilon=1e-8, couple=True` (keyword
    only). PyTorch: `torch.optim.AdamW(lr=eta, betas=beta, weight_decay=lambd, eps=epsilon)`
    (torch's default weight decay is 0.01); optax: `optax.adamw(eta, b1, b2, eps,
    weight_decay=lambd)` (default 1e-4). Both are `couple=True`. Optimisers.jl casts ε without the
    float16 floor here; we apply the floor as in every other rule. With `couple=True`, on
    PyTorch tensors (CPU/CUDA, float64 down to bfloat16) both update paths run torch's fused AdamW kernel.
    """

    elementwise = True
    never_raises = True

    eta: float = 0.001
    beta: tuple = (0.9, 0.999)
    lambd: float = 0.0
    epsilon: float = 1e-8
    couple: bool = field(default=True, kw_only=True)

    def validate(self):
        check_range(self, "beta", 0.0, 1.0, high_open=True)
        _nonnegative(self, "lambd", "epsilon")

    def init(self, x):
        return ops.zeros_like(x), ops.zeros_like(x), 0

    def apply(self, state, x, dx):
        m, v, t = state
        t = t + 1
        m, v, bc1, bc2 = _adam_moments(x, dx, m, v, self.beta, t)
        eta, lambd = _cast(x, self.eta, self.lambd)
        eps = ops.epsilon(self.epsilon, x)
        decay = eta * lambd if self.couple else lambd
        return (m, v, t), _adam_direction(m, v, bc1, bc2, eta, eps) + decay * x


@dataclass(frozen=True)
class AdaBelief(_AdamFamily):
    """AdaBelief (Zhuang et al., "AdaBelief Optimizer: Adapting Stepsizes by the Belief in
    Observed Gradients", 2020).

    State `(m, s, t)`. Each step: `m ← β₁m + (1−β₁)g`; `s ← β₂s + (1−β₂)|g − m|² + ε` (with the new
    `m`, and ε inside the recursion); `step = η·(m/(1−β₁ᵗ)) / (√(s/(1−β₂ᵗ)) + ε)`.

    Defaults: `eta=0.001, beta=(0.9, 0.999), epsilon=1e-16` (float16 raises ε to ≈1.2e-7).
    optax: `optax.adabelief(eta, b1, b2, eps=epsilon, eps_root=epsilon)`. PyTorch has no
    AdaBelief.
    """

    epsilon: float = 1e-16

    def apply(self, state, x, dx):
        m, s, t = state
        t = t + 1
        b1, b2 = self.beta
        eta, cb1, cm, cb2, cs, bc1, bc2 = _cast(x, self.eta, b1, 1 - b1, b2, 1 - b2, 1 - b1**t, 1 - b2**t)
        eps = ops.epsilon(self.epsilon, x)
        m = cb1 * m + cm * dx
        s = cb2 * s + cs * ops.abs2(dx - m) + eps
        step = eta * (m / bc1) / (ops.sqrt(s / bc2) + eps)
        return (m, s, t), step


@dataclass(frozen=True)
class Lion(Rule):
    """Lion, evolved sign momentum (Chen et al., "Symbolic Discovery of Optimization Algorithms",
    2023).

    State: `m = 0`. Each step: `step = η·sign(β₁·m + (1−β₁)·g)` (with the old `m`), then
    `m ← β₂·m + (1−β₂)·g`.

    This is the paper's recursion and optax's `optax.lion(eta, b1, b2, weight_decay=0)` (optax's
    defaults are `b2=0.99` and `weight_decay=1e-3`). Optimisers.jl writes the momentum update as
    `m ← β₂·g + (1−β₂)·m`, with the coefficients swapped relative to the paper; we follow the
    paper. Use a learning rate 3-10× smaller than Adam's. PyTorch has no Lion. Real parameters
    only.

    Defaults: `eta=0.001, beta=(0.9, 0.999)`.
    """

    elementwise = True
    never_raises = True

    eta: float = 0.001
    beta: tuple = (0.9, 0.999)

    def validate(self):
        check_range(self, "beta", 0.0, 1.0)

    def init(self, x):
        _real_only(self, x)
        return ops.zeros_like(x)

    def apply(self, state, x, dx):
        b1, b2 = self.beta
        eta, cb1, cg1, cb2, cg2 = _cast(x, self.eta, b1, 1 - b1, b2, 1 - b2)
        step = eta * ops.sign(cb1 * state + cg1 * dx)
        return cb2 * state + cg2 * dx, step


# --- gradient modifiers (usually first in an OptimiserChain) -----------------------------------


@dataclass(frozen=True)
class WeightDecay(Rule):
    """Weight decay (L2 regularisation): `step = g + λ·x`.

    First in a chain, it adds `λ/2·‖x‖²` to the loss: `OptimiserChain(WeightDecay(λ), Adam())` is
    Adam with L2 regularisation (PyTorch's `Adam(weight_decay=λ)`); after the optimiser,
    `OptimiserChain(Adam(η), WeightDecay(λ))` is decoupled decay (`AdamW(couple=False)`). Alone it
    subtracts the whole modified gradient, like `Descent(1)`.

    Defaults: `lambd=5e-4`. optax: `optax.add_decayed_weights(lambd)`.
    """

    elementwise = True
    never_raises = True

    lambd: float = 5e-4

    def validate(self):
        _nonnegative(self, "lambd")

    def apply(self, state, x, dx):
        return state, dx + ops.scalar(self.lambd, x) * x


@dataclass(frozen=True)
class SignDecay(Rule):
    """Sign decay (L1 regularisation): `step = g + λ·sign(x)` (with `sign(0) = 0`).

    First in a chain, it adds `λ·‖x‖₁` to the loss; `OptimiserChain(SignDecay(0.012),
    WeightDecay(0.034), Adam())` is Adam on the loss plus `0.012‖x‖₁ + 0.017‖x‖²`.

    Defaults: `lambd=1e-3`. No direct PyTorch/optax rule (optax:
    `optax.add_decayed_weights` is the L2 analogue). Real parameters only.
    """

    elementwise = True
    never_raises = True

    lambd: float = 1e-3

    def validate(self):
        _nonnegative(self, "lambd")

    def init(self, x):
        _real_only(self, x)
        return None

    def apply(self, state, x, dx):
        return state, dx + ops.scalar(self.lambd, x) * ops.sign(x)


@dataclass(frozen=True)
class ClipGrad(Rule):
    """Clip every gradient entry to `[−δ, δ]`: `step = clamp(g, −δ, δ)`.

    Defaults: `delta=10.0`. PyTorch: `torch.nn.utils.clip_grad_value_(params, delta)` before the
    optimiser step; optax: `optax.clip(delta)`. Real parameters only.
    """

    elementwise = True
    never_raises = True

    delta: float = 10.0
    infinite_ok: ClassVar[tuple[str, ...]] = ("delta",)  # no clipping

    def validate(self):
        _nonnegative(self, "delta")

    def init(self, x):
        _real_only(self, x)
        return None

    def apply(self, state, x, dx):
        delta = ops.scalar(self.delta, x)
        return state, ops.clip(dx, -delta, delta)


@dataclass(frozen=True)
class ClipNorm(Rule):
    """Rescale each parameter's gradient so that its p-norm is at most ω:
    `n = ‖g‖_p`, `step = min(ω/n, 1)·g`.

    `p` is any real: 2 (Euclidean), 1, `inf` (largest |gᵢ|), `-inf` (smallest), 0 (the number of
    non-zero entries), or another value for `(Σ|gᵢ|ᵖ)^(1/p)`. With `throw=True` (default) a norm
    that is not finite (an inf or NaN in the gradient) raises ValueError; with `throw=False` an
    infinite norm scales the gradient by 0 (so an infinite entry becomes NaN) and a NaN norm gives
    NaN. The check is skipped when the norm cannot be inspected (traced under `jax.jit`).

    The norm is per parameter array. PyTorch's `torch.nn.utils.clip_grad_norm_(params,
    max_norm=omega, norm_type=p)` and optax's `optax.clip_by_global_norm(omega)` (p = 2) compute
    one norm over all parameters instead, so they agree with this for a single array only.

    Defaults: `omega=10.0, p=2.0, throw=True` (keyword only).
    """

    omega: float = 10.0
    infinite_ok: ClassVar[tuple[str, ...]] = ("omega", "p")  # no clipping; the max-norm
    p: float = field(default=2.0, metadata={"static": True})
    throw: bool = field(default=True, kw_only=True)

    def validate(self):
        omega = _concrete(self.omega)
        if omega is not None and not omega > 0:
            raise ValueError(f"ClipNorm: omega (the largest norm) must be positive, got {omega}")
        p = _concrete(self.p)
        if p is not None and math.isnan(p):
            raise ValueError("ClipNorm: p must be a number, got nan")

    def gradient_factor(self, dx):
        """`min(ω/‖dx‖, 1)`, a scalar of `dx`'s dtype: the step is `factor · dx`. The in-place
        engine computes it over a parameter's whole gradient first, then steps the rest of a
        chain in chunks (see `OptimiserChain.apply_scaled`)."""
        n = ops.norm(dx, self.p)
        if self.throw and ops.isfinite(n) is False:
            raise ValueError(
                f"ClipNorm: the {self.p}-norm of the gradient is {float(n)}, which is not finite; "
                "use ClipNorm(..., throw=False) to continue anyway"
            )
        omega = ops.scalar(self.omega, n)
        # min(ω/n, 1) written as ω/max(n, ω): n = 0 needs no division by zero, NaN propagates;
        # the norm may be wider than dx (float16 sums in float32), so cast the factor back
        return ops.scalar(omega / ops.maximum(n, omega), dx)

    def apply(self, state, x, dx):
        return state, self.gradient_factor(dx) * dx


# --- composite rules -----------------------------------------------------------------------------


@dataclass(frozen=True, init=False, repr=False)
class OptimiserChain(Rule):
    """Apply several rules in sequence, each one's step being the next one's gradient:
    `OptimiserChain(ClipGrad(1.0), WeightDecay(), Adam())`.

    State: a tuple with each member's state. If a member returns `None` (do not move, e.g.
    `AccumGrad` between its updates), the chain stops there: the parameter does not move and the
    remaining members keep their old state. `OptimiserChain()` subtracts the raw gradient.
    Chains nest. `MixedPrecision` may not be a member: it must wrap the whole chain
    (`MixedPrecision(OptimiserChain(...))`).

    `hyperparameters()` is the union of the members' names, and `adjust(name=value)` changes every
    member that has `name`. optax: `optax.chain(...)`; in PyTorch one writes the chain by hand.
    """

    rules: tuple

    def __init__(self, *rules):
        object.__setattr__(self, "rules", tuple(rules))
        self.__post_init__()

    def validate(self):
        for i, rule in enumerate(self.rules):
            if isinstance(rule, type) and issubclass(rule, Rule):
                raise TypeError(
                    f"OptimiserChain: member {i} is the class {rule.__name__}; pass an instance, "
                    f"e.g. {rule.__name__}()"
                )
            if not isinstance(rule, Rule):
                raise TypeError(f"OptimiserChain: member {i} is {rule!r}, not an optimisers.Rule")
            if isinstance(rule, MixedPrecision):
                raise TypeError(
                    "OptimiserChain: MixedPrecision cannot be a member of a chain; wrap the chain "
                    "instead: MixedPrecision(OptimiserChain(...))"
                )

    @property
    def elementwise(self):
        return all(getattr(rule, "elementwise", False) for rule in self.rules)

    @property
    def never_raises(self):
        return all(getattr(rule, "never_raises", False) for rule in self.rules)

    @property
    def scaled_elementwise(self):
        """A first member that scales the whole gradient by one factor (`ClipNorm`: it has a
        `gradient_factor`), then elementwise members: `update_`'s engine computes the factor per
        parameter first and runs `apply_scaled` in chunks."""
        rules = self.rules
        return (
            len(rules) > 1
            and hasattr(rules[0], "gradient_factor")
            and not has_schedules(rules[0])  # its factor is computed outside `apply`
            and all(getattr(rule, "elementwise", False) for rule in rules[1:])
        )

    def __repr__(self):
        return f"OptimiserChain({', '.join(repr(r) for r in self.rules)})"

    def hyperparameters(self):
        names: dict[str, None] = {}
        for rule in self.rules:
            names.update(dict.fromkeys(rule.hyperparameters()))
        return tuple(names)

    def adjust(self, **hyper):
        new = tuple(rule.adjust(**hyper) for rule in self.rules)
        if all(a is b for a, b in zip(new, self.rules)):
            return self
        return OptimiserChain(*new)

    def init(self, x):
        return tuple(rule.init(x) for rule in self.rules)

    def with_counters(self, state):
        new = tuple(rule.with_counters(s) for rule, s in zip(self.rules, state))
        return state if all(a is b for a, b in zip(new, state)) else new

    def apply(self, state, x, dx):
        return self.apply_scaled(state, x, dx, None)

    def apply_scaled(self, state, x, dx, factor):
        """`apply`, where a `factor` given is the first member's `gradient_factor` of the whole
        gradient (of which `dx` may be a chunk): exactly what that member's `apply` computes."""
        states = list(state)
        last = len(self.rules) - 1
        for i, rule in enumerate(self.rules):
            if i == 0 and factor is not None:
                dx = factor * dx  # as ClipNorm.apply: the state unchanged
                continue
            states[i], dx = rule.apply(states[i], x, dx)
            if dx is None:
                break
            if isinstance(dx, NewValue) and i < last:
                raise TypeError(
                    f"OptimiserChain: {type(rule).__name__} sets the parameter's value, so it must "
                    "be the last member of a chain"
                )
        return tuple(states), dx


@dataclass(frozen=True)
class AccumGrad(Rule):
    """Accumulate the gradients of `n` calls and act once: the parameter moves on every n-th call,
    by the mean of the last `n` gradients, and is left alone on the others.

    State `(acc, k)`: the running mean so far and the number of gradients in it. Each call:
    `k ← k+1`; `acc ← g/n` if `k = 1`, else `acc ← acc + g/n`; if `k = n`, `step = acc` and `k ← 0`,
    otherwise no step. First in a chain, e.g. `OptimiserChain(AccumGrad(4), Adam())`, the rules
    after it see the mean gradient once every `n` calls and keep their state in between.

    Not compatible with `jax.jit` (the counter decides in Python whether to step). optax:
    `optax.MultiSteps(opt, every_k_schedule=n)`; PyTorch: call `optimizer.step()` every n
    backward passes (with the loss divided by n).
    """

    elementwise = True
    never_raises = True

    n: int

    def validate(self):
        n = self.n
        if isinstance(n, bool) or not (isinstance(n, numbers.Integral) or getattr(n, "shape", None) == ()):
            raise TypeError(f"AccumGrad: n must be a positive integer, got {n!r}")
        value = _concrete(n)
        if value is not None and not (value >= 1 and value == int(value)):
            raise ValueError(f"AccumGrad: n must be a positive integer, got {n!r}")

    def init(self, x):
        return ops.zeros_like(x), 0

    def apply(self, state, x, dx):
        acc, k = state
        k = k + 1
        share = dx / ops.scalar(self.n, x)
        acc = share if k == 1 else acc + share
        if k >= self.n:
            return (acc, 0), acc
        return (acc, k), None


def _dtype_name(dtype) -> str:
    try:
        return np.dtype(dtype).name
    except TypeError:
        return repr(dtype)


class _Wrapper(Rule):
    """A rule around another rule, its `rule` field, whose hyperparameters it shows as its own:
    `hyperparameters()` and `adjust` forward to the inner rule."""

    def validate(self):
        if not isinstance(self.rule, Rule):
            raise TypeError(f"{type(self).__name__}: rule must be an optimisers.Rule, got {self.rule!r}")

    def hyperparameters(self):
        return self.rule.hyperparameters()

    def adjust(self, **hyper):
        rule = self.rule.adjust(**hyper)
        return self if rule is self.rule else dataclasses.replace(self, rule=rule)


@dataclass(frozen=True, repr=False)
class MixedPrecision(_Wrapper):
    """Keep a master copy of each parameter in a wider `dtype` (float32 by default) and let `rule`
    train it; the parameter (e.g. float16) is set to the master copy rounded to its own dtype
    after every step (Micikevicius et al., "Mixed Precision Training", 2018).

    State `(master, inner)`: `master` is a copy of `x` in `dtype` and `inner = rule.init(master)`.
    Each step: `(inner, step) = rule.apply(inner, master, g)` with `g` converted to `dtype`;
    `master ← master − step`; the parameter becomes `master` converted to its dtype.

    Defaults: `dtype=numpy.float32` (a NumPy dtype, or the backend's own such as `torch.float32`).
    `hyperparameters()` and `adjust` forward to `rule`; the dtype stays. It cannot be a member of
    an `OptimiserChain`; wrap the chain instead. PyTorch's AMP (`torch.autocast`) keeps float32
    parameters and casts activations instead; optax has no wrapper.
    """

    rule: Rule
    dtype: Any = np.float32

    def validate(self):
        super().validate()
        try:
            dtype = np.dtype(self.dtype)
        except TypeError:
            if getattr(self.dtype, "is_floating_point", False):  # torch.float32 and friends
                return
            raise TypeError(f"MixedPrecision: dtype must be a floating dtype, got {self.dtype!r}") from None
        if not (dtype.kind == "f" or dtype.name.startswith(("bfloat", "float"))):
            raise ValueError(f"MixedPrecision: dtype must be a real floating dtype, got {dtype}")

    @property
    def elementwise(self):
        return getattr(self.rule, "elementwise", False)

    @property
    def never_raises(self):
        return getattr(self.rule, "never_raises", False)

    def __repr__(self):
        return f"MixedPrecision({self.rule!r}, dtype={_dtype_name(self.dtype)})"

    def init(self, x):
        _real_only(self, x)
        master = ops.cast(x, self.dtype)
        return master, self.rule.init(master)

    def with_counters(self, state):
        master, inner = state
        new = self.rule.with_counters(inner)
        return state if new is inner else (master, new)

    def apply(self, state, x, dx):
        master, inner = state
        inner, step = self.rule.apply(inner, master, ops.astype(dx, master))
        if step is None:
            return (master, inner), None
        if isinstance(step, NewValue):
            master = ops.astype(step.value, master)
        else:
            master = ops.astype(master - step, master)
        return (master, inner), NewValue(ops.astype(master, x))


@dataclass(frozen=True, repr=False)
class SkipNonFinite(_Wrapper):
    """Let `rule` step only on gradients that are finite everywhere: a gradient holding an inf or
    NaN is skipped (the parameter and `rule`'s state stay as they were) and counted.

    State `(inner, skipped)`: `rule`'s state and how many steps were skipped so far. Each step:
    if every entry of `g` is finite, `(inner, step) = rule.apply(inner, x, g)`; otherwise no step,
    and `skipped ← skipped + 1`. Without it, one NaN gradient turns Adam's moments (and so every
    later step) into NaN. The check is per parameter, on the sum of a tied parameter's places;
    under `jax.jit` both outcomes are computed and one is selected, in one compiled program.
    `hyperparameters()` and `adjust` forward to `rule`. optax: `optax.apply_if_finite(opt,
    max_consecutive_errors)`, which checks the whole update tree at once (and gives up after that
    many); PyTorch's `GradScaler` skips the whole `optimizer.step()` on inf/NaN gradients.
    """

    rule: Rule

    def __repr__(self):
        return f"SkipNonFinite({self.rule!r})"

    def init(self, x):
        return self.rule.init(x), 0

    def with_counters(self, state):
        inner, skipped = state
        new = self.rule.with_counters(inner)
        return state if new is inner else (new, skipped)

    def apply(self, state, x, dx):
        inner, skipped = state
        finite = ops.isfinite(dx)
        if finite is True:
            inner, step = self.rule.apply(inner, x, dx)
            return (inner, skipped), step
        if finite is False:
            return (inner, skipped + 1), None
        # traced (under jax.jit): no Python branch on array values, so select between both
        ok = ops.all_finite(dx)
        new_inner, step = self.rule.apply(inner, x, dx)
        old_parts: list = []
        flatten_state(inner, old_parts)
        new_parts: list = []
        spec = flatten_state(new_inner, new_parts)
        kept = [ops.where(ok, n, o) for n, o in zip(new_parts, old_parts)]
        if isinstance(step, NewValue):
            step = NewValue(ops.where(ok, step.value, x))
        elif step is not None:
            step = ops.where(ok, step, ops.zeros_like(step))
        skipped = ops.where(ok, skipped, skipped + 1)
        return (unflatten_state(spec, iter(kept)), skipped), step
