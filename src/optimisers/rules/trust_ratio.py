"""Layer-wise adaptive rules: a direction rescaled per parameter array by the trust ratio
`‖x‖/‖u‖`, so each array moves by a fixed fraction of its own norm (not elementwise)."""

from __future__ import annotations

from dataclasses import dataclass, field

from optimisers import ops
from optimisers.core.rule import Rule, check_range, scheduled_fields
from optimisers.rules.common import Moments, adam_direction, adam_moments, cast, nonnegative

__all__ = ["LAMB", "LARS"]


def trust_ratios(norm_x, norm_u, trust, epsilon):
    """`trust·‖x‖/(‖u‖ + ε)` of each pair of Euclidean norms of whole arrays (1-D arrays), or 1
    where either norm is 0 (a zero parameter would never move, a zero direction needs no
    scaling), as optax's `scale_by_trust_ratio`. Chosen with `ops.where`, so it is traceable."""
    trust, epsilon = ops.scalar(trust, norm_x), ops.epsilon(epsilon, norm_x)
    one = ops.full_like(norm_x, 1)
    zero = (norm_x == 0) | (norm_u == 0)
    # the inner `where` keeps the division finite (no warning) in the branch that is not taken
    return ops.where(zero, one, trust * norm_x / ops.where(zero, one, norm_u + epsilon))


class _TrustRatio(Rule):
    """What LAMB and LARS share: a direction `u` (`direction`), of which each parameter array
    steps by `η·r` (`step_factors`, `r` its trust ratio), elementwise given that one factor
    (`apply_scaled`). The engine steps them as it steps a chain that clips the gradient's norm
    first: the factors of every array first, then one elementwise pass each."""

    elementwise = False  # the norms couple the array
    never_raises = True
    stacks = True

    @property
    def scaled_elementwise(self):
        return not scheduled_fields(self)  # (the factors are computed outside `apply`)

    def step_factors(self, xs, us):
        # (a norm may be wider than x: float16 sums in float32)
        return ops.astype(self._norm_factors(ops.norms(xs, 2), ops.norms(us, 2)), xs[0])

    def apply(self, state, x, dx):
        return self.apply_scaled(state, x, dx, self.step_factors([x], [self.direction(state, x, dx)])[0])

    def apply_stacked(self, state, x, dx):
        """`apply` of parameters of one shape stacked along a new first axis, the same numbers."""
        factors = self.step_factors(list(x), list(self.direction(state, x, dx)))
        return self.apply_scaled(state, x, dx, ops.reshape(factors, (-1,) + (1,) * (len(x.shape) - 1)))


@dataclass(frozen=True)
class LAMB(_TrustRatio, Moments):
    """LAMB, Adam with a layer-wise trust ratio (You et al., "Large Batch Optimization for Deep
    Learning: Training BERT in 76 minutes", 2020).

    State `(m, v, t)`; `m, v` as in Adam. With `x` the parameter before the step, the Adam
    direction plus the weight decay `u = (m/(1−β₁ᵗ)) / (√(v/(1−β₂ᵗ)) + ε) + λ·x` and the trust
    ratio `r = ‖x‖/‖u‖` (Euclidean norms of this parameter array, never of the whole model):
    `step = η·r·u`. When `‖x‖ = 0` or `‖u‖ = 0`, `r = 1` (as optax), so zero-initialised
    parameters such as biases still move, by plain Adam steps. Not elementwise: the norms couple
    the array. The decay applies to every array the rule is given; to exempt some (optax's
    `mask`), give them `lambd=0` with a per-parameter `setup((path, x) -> rule, model)`.

    Defaults: `eta=0.001, beta=(0.9, 0.999), epsilon=1e-6, lambd=0.0`. optax:
    `optax.lamb(eta, b1, b2, eps, eps_root=0, weight_decay=lambd)` computes the same steps.
    PyTorch has no LAMB.
    """

    eta: float = 0.001
    beta: tuple = (0.9, 0.999)
    epsilon: float = 1e-6
    lambd: float = 0.0

    def direction(self, state, x, dx):
        return self._moments_and_direction(state, x, dx)[1]

    def _norm_factors(self, norm_xs, norm_us):
        return ops.scalar(self.eta, norm_xs) * trust_ratios(norm_xs, norm_us, 1, 0)

    def apply_scaled(self, state, x, dx, factor):
        new_state, u = self._moments_and_direction(state, x, dx)
        return new_state, factor * u

    def _moments_and_direction(self, state, x, dx):
        m, v, t, bc1, bc2 = adam_moments(x, dx, state, self.beta)
        lambd, one = cast(x, self.lambd, 1)
        return (m, v, t), adam_direction(m, v, bc1, bc2, one, ops.epsilon(self.epsilon, x)) + lambd * x


@dataclass(frozen=True)
class LARS(_TrustRatio):
    """LARS, momentum with a layer-wise trust ratio (You, Gitman & Ginsburg, "Large Batch
    Training of Convolutional Networks", 2017).

    State: velocity `v = 0`. With `x` the parameter before the step, the gradient plus the
    weight decay `u = g + λ·x` and the trust ratio `r = trust·‖x‖/(‖u‖ + ε)` (Euclidean norms of
    this parameter array; `r = 1` when `‖x‖ = 0` or `‖u‖ = 0`, as optax): `v ← β·v + η·r·u`,
    `step = v`; with `nesterov=True`, `step = η·r·u + β·v` (with the new `v`). η is inside the
    velocity, as in `Momentum`. Not elementwise: the norms couple the array.

    The decay and the trust ratio apply to every array the rule is given, as in optax's defaults;
    the paper and most recipes exclude biases and normalisation weights: give those another rule
    with a per-parameter `setup((path, x) -> rule, model)` (optax's `weight_decay_mask` and
    `trust_ratio_mask`).

    Defaults: `eta=0.001, beta=0.9, lambd=0.0, trust=0.001, epsilon=0.0, nesterov=False`
    (`nesterov` keyword only). optax: `optax.lars(eta, weight_decay=lambd,
    trust_coefficient=trust, eps=epsilon, momentum=beta, nesterov=nesterov)` computes the same
    steps (it also scales by the learning rate before its momentum). PyTorch has no LARS.
    """

    eta: float = 0.001
    beta: float = 0.9
    lambd: float = 0.0
    trust: float = 0.001
    epsilon: float = 0.0
    nesterov: bool = field(default=False, kw_only=True)

    def validate(self):
        check_range(self, "beta", 0.0, 1.0)
        nonnegative(self, "lambd", "trust", "epsilon")

    def init(self, x):
        return ops.zeros_like(x)

    def direction(self, state, x, dx):
        return dx + ops.scalar(self.lambd, x) * x

    def _norm_factors(self, norm_xs, norm_us):
        return ops.scalar(self.eta, norm_xs) * trust_ratios(norm_xs, norm_us, self.trust, self.epsilon)

    def apply_scaled(self, state, x, dx, factor):
        beta = ops.scalar(self.beta, x)
        w = factor * self.direction(state, x, dx)
        v = beta * state + w
        return v, (w + beta * v if self.nesterov else v)
