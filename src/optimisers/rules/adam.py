"""Adam and its relatives: first and second moments of the gradient."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from optimisers import ops
from optimisers.core.rule import check_range, concrete
from optimisers.rules.common import (
    Elementwise,
    Moments,
    adam_direction,
    adam_moments,
    cast,
    real_zeros,
    state_dtype,
    step_scalars,
    stored_in,
)

__all__ = [
    "Adam",
    "RAdam",
    "AdaMax",
    "OAdam",
    "AMSGrad",
    "NAdam",
    "AdamW",
    "AdaBelief",
    "Lion",
    "ADOPT",
    "AdEMAMix",
]


class AdamArgs(NamedTuple):
    """The arguments of a backend's "adam" kernel (torch's fused Adam/AdamW, NumPy's compiled
    one), which computes `Adam` and `AdamW(couple=True)` exactly on a state `(m, v, t)`."""

    lr: float
    beta1: float
    beta2: float
    epsilon: float
    weight_decay: float
    decoupled: bool  # AdamW's decay of the parameter, not Adam's L2 term in the gradient


def _adam_args(rule, kernel, decay, decoupled) -> AdamArgs | None:
    if kernel != "adam" or rule.mu_dtype is not None:
        return None  # (the kernels keep m in the parameter's dtype)
    values = [concrete(v) for v in (rule.eta, *rule.beta, rule.epsilon, decay)]
    if None in values:
        return None  # a schedule or a traced value: the rule's own apply evaluates it
    return AdamArgs(*values, decoupled)


@dataclass(frozen=True)
class _AdamFamily(Moments):
    """The fields shared by Adam and its variants."""

    eta: float = 0.001
    beta: tuple = (0.9, 0.999)
    epsilon: float = 1e-8


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

    `mu_dtype` (keyword only): the dtype of `m`, None for the parameter's (optax's `mu_dtype`;
    bfloat16 halves its memory for float32 parameters). The step is computed from `m` before it
    is stored in that dtype, as optax does; without the fused kernels.
    """

    nonnegative_state = (1,)  # (LowBit's unsigned maps)

    mu_dtype: Any = state_dtype()

    def apply(self, state, x, dx):
        m, v, t, bc1, bc2 = adam_moments(x, dx, state, self.beta)
        eta, eps = ops.scalar(self.eta, x), ops.epsilon(self.epsilon, x)
        return (stored_in(m, self.mu_dtype), v, t), adam_direction(m, v, bc1, bc2, eta, eps)

    def kernel_args(self, kernel):
        return _adam_args(self, kernel, 0.0, False)


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

    nonnegative_state = (1,)  # (LowBit's unsigned maps)

    def apply(self, state, x, dx):
        m, v, t, bc1, bc2 = adam_moments(x, dx, state, self.beta)
        eta, eps = ops.scalar(self.eta, x), ops.epsilon(self.epsilon, x)
        b2 = self.beta[1]
        rho_inf = 2 / (1 - b2) - 1
        rho = rho_inf - 2 * t * b2**t / (1 - b2**t)

        def rectified():
            r = ops.sqrt((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho))
            return adam_direction(m, v, bc1, bc2, ops.scalar(r, x) * eta, eps)

        return (m, v, t), ops.cond(rho > 4, rectified, lambda: (eta / bc1) * m)


@dataclass(frozen=True)
class AdaMax(_AdamFamily):
    """AdaMax, Adam with the infinity norm (Kingma & Ba, 2015, section 7).

    State `(m, w, t)`. Each step: `m ← β₁m + (1−β₁)g`, `w ← max(β₂w, |g|)`,
    `step = (η/(1−β₁ᵗ)) · m / (w + ε)`. For complex parameters `w` is real.

    Defaults: `eta=0.001, beta=(0.9, 0.999), epsilon=1e-8`. optax: `optax.adamax(eta, b1, b2,
    eps)`. PyTorch: `torch.optim.Adamax(lr=eta, betas=beta, eps=epsilon)` adds ε inside the
    maximum (`w ← max(β₂w, |g| + ε)`, `step ∝ m/w`), so its steps differ slightly.
    """

    nonnegative_state = (1,)  # (LowBit's unsigned maps)

    def init(self, x):
        return ops.zeros_like(x), real_zeros(x), 0

    def apply(self, state, x, dx):
        m, w, t = state
        t = t + 1
        b1, b2 = self.beta
        cb1, cm, rate = cast(x, b1, 1 - b1, self.eta / (1 - b1**t))
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

    nonnegative_state = (1,)  # (LowBit's unsigned maps)

    beta: tuple = (0.5, 0.9)
    moments = 3  # and q

    def apply(self, state, x, dx):
        m, v, t, bc1, bc2 = adam_moments(x, dx, state, self.beta)
        eta, eps = ops.scalar(self.eta, x), ops.epsilon(self.epsilon, x)
        q_new = adam_direction(m, v, bc1, bc2, eta, eps)
        return (m, v, q_new, t), 2 * q_new - state[2]  # minus the last step's q


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

    nonnegative_state = (1, 2)  # (LowBit's unsigned maps)

    def init(self, x):
        return ops.zeros_like(x), real_zeros(x), real_zeros(x), 0

    def apply(self, state, x, dx):
        m, v, vmax, t = state
        t = t + 1
        b1, b2 = self.beta
        eta, cb1, cm, bc1 = cast(x, self.eta, b1, 1 - b1, 1 - b1**t)
        cb2, cv, bc2 = cast(v, b2, 1 - b2, 1 - b2**t)  # v is real for complex x
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

    nonnegative_state = (1,)  # (LowBit's unsigned maps)

    def apply(self, state, x, dx):
        m, v, t, _, bc2 = adam_moments(x, dx, state, self.beta)
        b1 = self.beta[0]
        eta, cm, cg = cast(x, self.eta, b1 / (1 - b1 ** (t + 1)), (1 - b1) / (1 - b1**t))
        eps = ops.epsilon(self.epsilon, x)
        mhat = cm * m + cg * dx
        return (m, v, t), eta * mhat / (ops.sqrt(v / bc2) + eps)


@dataclass(frozen=True)
class AdamW(Moments):
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
    `mu_dtype` (keyword only): the dtype of `m`, as for `Adam`.
    """

    nonnegative_state = (1,)  # (LowBit's unsigned maps)

    eta: float = 0.001
    beta: tuple = (0.9, 0.999)
    lambd: float = 0.0
    epsilon: float = 1e-8
    couple: bool = field(default=True, kw_only=True)
    mu_dtype: Any = state_dtype()

    def apply(self, state, x, dx):
        m, v, t, bc1, bc2 = adam_moments(x, dx, state, self.beta)
        eta, lambd = cast(x, self.eta, self.lambd)
        eps = ops.epsilon(self.epsilon, x)
        decay = eta * lambd if self.couple else lambd
        return (stored_in(m, self.mu_dtype), v, t), adam_direction(m, v, bc1, bc2, eta, eps) + decay * x

    def kernel_args(self, kernel):
        return _adam_args(self, kernel, self.lambd, True) if self.couple else None


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

    nonnegative_state = (1,)  # (LowBit's unsigned maps)

    epsilon: float = 1e-16

    def apply(self, state, x, dx):
        t, cb1, cm, cb2, cs, bc1, bc2 = step_scalars(x, state[-1], self.beta)
        eta, eps = ops.scalar(self.eta, x), ops.epsilon(self.epsilon, x)
        m = cb1 * state[0] + cm * dx
        s = cb2 * state[1] + cs * ops.abs2(dx - m) + eps
        return (m, s, t), eta * (m / bc1) / (ops.sqrt(s / bc2) + eps)


@dataclass(frozen=True)
class Lion(Elementwise):
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

    eta: float = 0.001
    beta: tuple = (0.9, 0.999)
    real_only = True

    def validate(self):
        check_range(self, "beta", 0.0, 1.0)  # β = 1 is allowed: no bias correction divides by 1 − β

    def init(self, x):
        return ops.zeros_like(x)

    def apply(self, state, x, dx):
        b1, b2 = self.beta
        eta, cb1, cg1, cb2, cg2 = cast(x, self.eta, b1, 1 - b1, b2, 1 - b2)
        step = eta * ops.sign(cb1 * state + cg1 * dx)
        return cb2 * state + cg2 * dx, step


@dataclass(frozen=True)
class ADOPT(_AdamFamily):
    """ADOPT (Taniguchi et al., "ADOPT: Modified Adam Can Converge with Any β₂ with the Optimal
    Rate", 2024), with its update clipping.

    State `(m, v, t)`. The first step only records `v ← |g|²` and does not move. Each later step
    normalises the gradient by the second moment of the steps *before* it, clips, then averages:
    `u = clip(g / max(√v, ε), ±(t−1)^¼)`, `m ← β₁m + (1−β₁)u`, `v ← β₂v + (1−β₂)|g|²`,
    `step = η·m`. Not for complex parameters (the clipping needs an order).

    Defaults: `eta=0.001, beta=(0.9, 0.9999), epsilon=1e-6`. optax:
    `optax.contrib.adopt(eta, b1, b2, eps)` at its defaults (clipping at `(t−1)^¼`, no Nesterov).
    """

    nonnegative_state = (1,)  # (LowBit's unsigned maps)

    beta: tuple = (0.9, 0.9999)
    epsilon: float = 1e-6
    real_only = True

    def apply(self, state, x, dx):
        m, v, t = state
        t = t + 1
        b1, b2 = self.beta
        later = ops.minimum(t - 1, 1)  # 0 at the first step, 1 after (a traced value under jit)
        limit = (t - 1) ** 0.25  # the clipping bound grows with the step
        cb1, cm, cb2, cv, limit, eta = cast(x, b1, 1 - b1, b2 * later, 1 - b2 * later, limit, self.eta)
        u = ops.clip(dx / ops.maximum(ops.sqrt(v), ops.epsilon(self.epsilon, x)), -limit, limit)
        m = cb1 * m + cm * u
        v = cb2 * v + cv * dx * dx
        return (m, v, t), eta * m


@dataclass(frozen=True)
class AdEMAMix(Moments):
    """AdEMAMix, Adam with a mixture of a fast and a slow momentum (Pagliardini, Ablin &
    Grangier, "The AdEMAMix Optimizer: Better, Faster, Older", 2024).

    State `(m₁, m₂, v, t)`. Each step: `m₁ ← β₁m₁ + (1−β₁)g` (fast), `m₂ ← β₃m₂ + (1−β₃)g`
    (slow), `v ← β₂v + (1−β₂)|g|²`,
    `step = η · ((m₁/(1−β₁ᵗ) + α·m₂) / (√(v/(1−β₂ᵗ)) + ε) + λ·x)`, with `x` the parameter before
    the step. The slow momentum is not bias-corrected, so it fills in slowly (as in the paper).
    α and β₃ are constants: the paper's warm-up schedulers for them (optax's `alpha` and `b3`
    given as schedules) are not built in. The weight decay is scaled by η, as in AdamW.

    Defaults: `eta=0.001, beta=(0.9, 0.999, 0.9999), alpha=5.0, epsilon=1e-8, lambd=0.0`, with
    `beta = (β₁, β₂, β₃)`. optax: `optax.contrib.ademamix(eta, b1, b2, b3, alpha, eps,
    eps_root=0, weight_decay=lambd)` with constant `b3` and `alpha` computes the same steps.
    PyTorch has no AdEMAMix.
    """

    nonnegative_state = (2,)  # (LowBit's unsigned maps)

    eta: float = 0.001
    beta: tuple = (0.9, 0.999, 0.9999)
    alpha: float = 5.0
    epsilon: float = 1e-8
    lambd: float = 0.0
    moments = 3  # m₁, m₂, v

    def apply(self, state, x, dx):
        fast, slow, v, t = state
        t = t + 1
        b1, b2, b3 = self.beta
        cb1, cg1, cb2, cg2, cb3, cg3 = cast(x, b1, 1 - b1, b2, 1 - b2, b3, 1 - b3)
        # η folded into the scalars: the bias correction of the fast momentum, α, and the decay
        rate_fast, rate_slow, bc2, decay = cast(
            x, self.eta / (1 - b1**t), self.eta * self.alpha, 1 - b2**t, self.eta * self.lambd
        )
        eps = ops.epsilon(self.epsilon, x)
        fast = cb1 * fast + cg1 * dx
        slow = cb3 * slow + cg3 * dx
        v = cb2 * v + cg2 * ops.abs2(dx)
        step = (rate_fast * fast + rate_slow * slow) / (ops.sqrt(v / bc2) + eps) + decay * x
        return (fast, slow, v, t), step
