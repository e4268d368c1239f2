"""Schedule-free rules (Defazio et al., "The Road Less Scheduled", 2024): a constant learning rate
with no decay schedule, and an average `x` of the base iterates `z` to evaluate at. The parameter
holds `y = (1−β₁)·z + β₁·x`, where gradients are taken (as in the `schedulefree` package's train
mode), so a rule returns the new `y`; `x` is recovered from `y` and `z` by `eval_value`.
"""

from __future__ import annotations

from dataclasses import dataclass

from optimisers import ops
from optimisers.core.rule import NewValue, concrete
from optimisers.rules.common import Elementwise, cast, nonnegative

__all__ = ["ScheduleFreeAdamW", "ScheduleFreeSGD"]


def lerp(start, end, weight):
    """`start + weight·(end − start)` for a scalar `weight`, written as torch's `lerp` writes it
    (from `end` when |weight| ≥ ½), so that the parameter lands where the `schedulefree` package
    puts it, and exactly on `end` at weight 1. Traced weights select with `ops.where`."""
    w, one = ops.scalar(weight, start), ops.scalar(1.0, start)
    known = concrete(weight)
    if known is not None:
        return start + w * (end - start) if abs(known) < 0.5 else end - (one - w) * (end - start)
    return ops.where(abs(weight) < 0.5, start + w * (end - start), end - (one - w) * (end - start))


def average_weight(rule, k, lr_max, weight_sum):
    """The scalars of step `k + 1` (`k` steps taken before it), as the `schedulefree` package
    computes them: the learning rate with the linear warm-up, the largest one so far, the new
    sum of the averaging weights and the weight `c` of the new `z` in the average `x`.

    `lr = η·min((k+1)/warmup, 1)`, `lr_max ← max(lr_max, lr)`, `w = (k+1)^r · lr_max^p`
    (p = `weight_lr_power`), `Σw ← Σw + w`, `c = w/Σw` (0 while `Σw` is 0)."""
    lr = rule.eta
    if rule.warmup > 0:
        lr = lr * ops.minimum((k + 1) / rule.warmup, 1.0)
    # the backend from a value that is not a plain number (a traced or stacked one), if either is
    lr_max = ops.maximum(lr, lr_max) if isinstance(lr_max, (int, float)) else ops.maximum(lr_max, lr)
    weight = (k + 1) ** rule.r * lr_max**rule.weight_lr_power
    weight_sum = weight_sum + weight
    c = weight / ops.where(weight_sum != 0, weight_sum, 1.0)  # w is 0 where Σw is 0
    return lr, lr_max, weight_sum, c


def step_y(y, z, u, lr, b1, c):
    """The new `(y, z)` after `z ← z − lr·u`, `x ← (1−c)·x + c·z`, `y = (1−β₁)·z + β₁·x`,
    written on `y` without forming `x`: `y ← lerp(y, z, c) + lr·(β₁(1−c) − 1)·u`."""
    scale, rate = cast(y, lr * (b1 * (1 - c) - 1), lr)
    return lerp(y, z, c) + scale * u, z - rate * u


class _ScheduleFree(Elementwise):
    """What both rules share: the checks, the counters and the evaluation point."""

    exact_state = (0,)  # z, the parameter's sequence itself (LowBit leaves it exact)

    def validate(self):
        name, (b1, label) = type(self).__name__, _b1(self)
        b1 = concrete(b1)
        if b1 is not None and not 0.0 < b1 <= 1.0:
            raise ValueError(
                f"{name}: {label} must be in (0, 1] (the evaluation point divides by it), got {b1}"
            )
        nonnegative(self, "lambd", "r", "weight_lr_power")
        if self.warmup < 0:
            raise ValueError(f"{name}: warmup must be >= 0 steps, got {self.warmup}")
        if isinstance(self.beta, tuple):
            b2 = concrete(self.beta[1])
            if b2 is not None and not 0.0 <= b2 < 1.0:
                raise ValueError(f"{name}: beta[1] must be in [0.0, 1.0), got {b2}")
            nonnegative(self, "epsilon")

    def eval_value(self, state, x):
        # x = (y − (1−β₁)·z)/β₁, as the package's `eval()` computes it
        return lerp(x, state[0], 1 - 1 / _b1(self)[0])


def _b1(rule):
    """β₁ (ScheduleFreeSGD's `beta`, ScheduleFreeAdamW's `beta[0]`) and its name in errors."""
    return (rule.beta[0], "beta[0]") if isinstance(rule.beta, tuple) else (rule.beta, "beta")


@dataclass(frozen=True)
class ScheduleFreeAdamW(_ScheduleFree):
    """Schedule-free AdamW (Defazio et al., "The Road Less Scheduled", 2024): AdamW without
    momentum and without a learning-rate schedule, whose iterates are averaged instead.

    State `(z, v, k, lr_max, Σw)`: the base sequence `z` (a copy of the parameter at setup), the
    second moment `v`, the number of steps taken `k`, the largest learning rate so far and the sum
    of the averaging weights. The parameter is `y`, where gradients are taken. Each step, with
    `lr = η·min((k+1)/warmup, 1)`, `w = (k+1)^r · max lr^p`, `c = w/Σw`:
    `v ← β₂v + (1−β₂)|g|²`, `u = g/(√(v/(1−β₂ᵏ⁺¹)) + ε) + λ·y`, `z ← z − lr·u`,
    `x ← (1−c)·x + c·z`, `y ← (1−β₁)·z + β₁·x`, computed without forming `x` as
    `y ← lerp(y, z, c) + lr·(β₁(1−c) − 1)·u` and set as the parameter's value.
    `optimisers.eval_params(state, model)` gives the average `x = (y − (1−β₁)·z)/β₁`.

    Defaults: `eta=2.5e-3, beta=(0.9, 0.999), epsilon=1e-8, lambd=0.0, warmup=0, r=0.0,
    weight_lr_power=2.0` (β₁ in (0, 1], β₂ in [0, 1)). The `schedulefree` package's
    `AdamWScheduleFree` (`optimisers.torch.AdamWScheduleFree`) computes the same steps; optax's
    `optax.contrib.schedule_free_adamw` too, up to rounding, when `warmup=0` and `r=0` (docs/api.md
    maps the names).
    """

    nonnegative_state = (1,)  # (LowBit's unsigned maps)

    eta: float = 2.5e-3
    beta: tuple = (0.9, 0.999)
    epsilon: float = 1e-8
    lambd: float = 0.0
    warmup: int = 0
    r: float = 0.0
    weight_lr_power: float = 2.0

    def init(self, x):
        # z starts at the parameter (a cast is always a new plain array); lr_max starts below any
        # learning rate, as the package's
        return ops.cast(x, x.dtype), ops.zeros_like(x), 0, -1.0, 0.0

    def apply(self, state, x, dx):
        z, v, k, lr_max, weight_sum = state
        lr, lr_max, weight_sum, c = average_weight(self, k, lr_max, weight_sum)
        b1, b2 = self.beta
        cb2, cv, bc2, lambd = cast(x, b2, 1 - b2, 1 - b2 ** (k + 1), self.lambd)
        v = cb2 * v + cv * ops.abs2(dx)
        u = dx / (ops.sqrt(v / bc2) + ops.epsilon(self.epsilon, x)) + lambd * x
        y, z = step_y(x, z, u, lr, b1, c)
        return (z, v, k + 1, lr_max, weight_sum), NewValue(y)


@dataclass(frozen=True)
class ScheduleFreeSGD(_ScheduleFree):
    """Schedule-free SGD (Defazio et al., "The Road Less Scheduled", 2024): gradient descent
    without momentum and without a learning-rate schedule, whose iterates are averaged instead.

    State `(z, k, lr_max, Σw)`, as `ScheduleFreeAdamW`'s without `v`. The parameter is `y`,
    where gradients are taken. Each step, with `lr` and `c` as in `ScheduleFreeAdamW`:
    `u = g + λ·y`, `z ← z − lr·u`, `x ← (1−c)·x + c·z`, `y ← (1−β)·z + β·x`, computed as
    `y ← lerp(y, z, c) + lr·(β(1−c) − 1)·u` and set as the parameter's value (a `NewValue`).
    Evaluate and save `x = (y − (1−β)·z)/β`: `optimisers.eval_params(state, model)`.

    Defaults: `eta=1.0, beta=0.9, lambd=0.0, warmup=0, r=0.0, weight_lr_power=2.0` (β in
    (0, 1]). The `schedulefree` package's `SGDScheduleFree` (`optimisers.torch.SGDScheduleFree`)
    computes the same steps; optax's `optax.contrib.schedule_free_sgd` too, up to rounding, when
    `warmup=0` and `r=0` (docs/api.md maps the names).
    """

    eta: float = 1.0
    beta: float = 0.9
    lambd: float = 0.0
    warmup: int = 0
    r: float = 0.0
    weight_lr_power: float = 2.0

    def init(self, x):
        return ops.cast(x, x.dtype), 0, -1.0, 0.0

    def apply(self, state, x, dx):
        z, k, lr_max, weight_sum = state
        lr, lr_max, weight_sum, c = average_weight(self, k, lr_max, weight_sum)
        u = dx + ops.scalar(self.lambd, x) * x
        y, z = step_y(x, z, u, lr, self.beta, c)
        return (z, k + 1, lr_max, weight_sum), NewValue(y)
