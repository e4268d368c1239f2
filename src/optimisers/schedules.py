"""Learning-rate schedules: small callables `step -> value` to use with `adjust_` every step, or
as a rule's hyperparameter (docs/hyperparameters.md).

    sched = schedules.Cosine(1e-3, 10_000, warmup=500)
    for step in range(10_000):
        opt.adjust_(state, eta=sched(step))
        state, model = opt.update_(state, model, grads)

Each is a frozen dataclass (readable repr, equal by value). Steps count from 0, as in optax and
`torch.optim.lr_scheduler`; negative steps count as 0. A step may be a Python int (the value is a
Python float), a NumPy integer (a NumPy float64), a PyTorch tensor (a float64 tensor), or a JAX
integer, traced or not (a JAX float scalar of the default float dtype); the maths never branches
in Python on it, so a jitted update compiles once for all steps (docs/checkpoints.md lists the
optax and PyTorch equivalents). `import optimisers.schedules` imports neither jax nor torch.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from optimisers.core import dispatch

__all__ = [
    "Constant",
    "Cosine",
    "Exponential",
    "Join",
    "Linear",
    "PiecewiseConstant",
    "Schedule",
    "StepDecay",
]


# --- arithmetic that works on Python ints, NumPy, PyTorch and (traced) JAX scalars -------------
# Each backend (optimisers.backends, `ScheduleMaths` in its protocol) does a step's arithmetic in
# its library; this module imports none of them.


def _is_array(step) -> bool:
    return dispatch.is_array_library(dispatch.library_of(type(step)))


def _maths(step):
    """The backend that computes with this kind of step, chosen by its type."""
    if _is_array(step):
        return dispatch.backend(step)
    if isinstance(step, numbers.Integral) and not isinstance(step, bool):
        return dispatch.backend(0)  # Python ints' (and those of an Integral of another library)
    raise TypeError(f"a schedule takes an integer step (int, or a NumPy/PyTorch/JAX integer), got {step!r}")


def _steps(step):
    """`(maths, s)`: `_maths(step)` and the step as its integer, negative steps counted as 0."""
    o = _maths(step)
    if not o.is_integer(step):
        raise TypeError(f"a schedule takes an integer step, got {step!r}")
    return o, o.maximum(o.as_integer(step), 0)


# --- checks --------------------------------------------------------------------------------------


def _real(owner, name, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: {name} must be a real number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{owner}: {name} must be finite, got {value!r}")
    return value


def _count(owner, name, value, *, positive: bool) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{owner}: {name} must be an integer number of steps, got {value!r}")
    if value < (1 if positive else 0):
        need = "positive" if positive else "non-negative"
        raise ValueError(f"{owner}: {name} must be {need}, got {value!r}")
    return int(value)


def _boundaries(owner, what, pieces, boundaries) -> tuple:
    """`boundaries` as increasing step counts, one fewer than `pieces` (`what`: their name)."""
    if not isinstance(pieces, (tuple, list)) or not isinstance(boundaries, (tuple, list)):
        raise TypeError(f"{owner}: {what} and boundaries must be tuples")
    bounds = tuple(_count(owner, f"boundaries[{i}]", b, positive=False) for i, b in enumerate(boundaries))
    if len(pieces) != len(bounds) + 1:
        raise ValueError(
            f"{owner}: needs one more {what[:-1]} than boundaries, got {len(pieces)} {what} and "
            f"{len(bounds)} boundaries"
        )
    if any(b >= c for b, c in zip(bounds, bounds[1:])):
        raise ValueError(f"{owner}: boundaries must increase, got {bounds}")
    return bounds


class Schedule:
    """Base class of schedules: a callable `step -> value`. Subclass it (as a frozen dataclass) and
    define `__call__` with the arithmetic of `_maths(step)` to get every backend and `jax.jit`."""

    def __call__(self, step):  # pragma: no cover - the subclasses define it
        raise NotImplementedError


class _Numbers(Schedule):
    """A schedule of numbers checked by their annotations: a `float` finite (stored as a float),
    an `int` a number of steps, positive unless it defaults to 0 (`begin`, `warmup`)."""

    def __post_init__(self):
        owner = type(self).__name__
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("float", "float | None") and value is not None:
                object.__setattr__(self, f.name, _real(owner, f.name, value))
            elif f.type == "int":
                _count(owner, f.name, value, positive=f.default != 0)


# --- the schedules -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Constant(_Numbers):
    """`value` at every step. optax: `constant_schedule(value)`."""

    value: float

    def __call__(self, step):
        return _maths(step).real_scalar(self.value, step)


@dataclasses.dataclass(frozen=True)
class Linear(_Numbers):
    """From `start` to `end` in a straight line over `steps` steps beginning at step `begin`;
    `start` before, `end` after. A linear warm-up is `Linear(0.0, peak, warmup_steps)`.

    `value(t) = (start − end)·(1 − c/steps) + end` with `c = clip(t − begin, 0, steps)`, exactly
    optax's `linear_schedule(start, end, steps, begin)`. PyTorch: `LinearLR(start/base,
    end/base, steps)` on base learning rate `base`.
    """

    start: float
    end: float
    steps: int
    begin: int = 0

    def __call__(self, step):
        o, s = _steps(step)
        c = o.minimum(o.maximum(s - self.begin, 0), self.steps)
        value = (self.start - self.end) * (1 - o.as_real(c) / self.steps) + self.end
        # exactly `end` once there (XLA divides by multiplying with a rounded reciprocal)
        return o.real_where(c >= self.steps, self.end, value)


@dataclasses.dataclass(frozen=True)
class Cosine(_Numbers):
    """Half a cosine from `peak` down to `final`, ending at step `steps`, after an optional linear
    warm-up from `start` to `peak` over the first `warmup` steps; `final` from step `steps` on.

    With `w = warmup`: `value(t) = start + (peak − start)·t/w` for `t < w`, then
    `final + (peak − final)·(1 + cos(π·(t − w)/(steps − w)))/2`, and `final` for `t >= steps`.
    optax: `warmup_cosine_decay_schedule(start, peak, warmup, steps, final)` (with `warmup=0`:
    `cosine_decay_schedule(peak, steps, alpha=final/peak)`). PyTorch: `CosineAnnealingLR(steps,
    eta_min=final)` up to step `steps` (PyTorch's rises again after it; this one stays at `final`).
    """

    peak: float
    steps: int
    final: float = 0.0
    warmup: int = 0
    start: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if self.warmup >= self.steps:
            raise ValueError(
                f"Cosine: warmup ({self.warmup}) must be shorter than steps ({self.steps}), which "
                "counts the warm-up too"
            )

    def __call__(self, step):
        o, s = _steps(step)
        length = self.steps - self.warmup
        c = o.minimum(o.maximum(s - self.warmup, 0), length)
        value = self.final + (self.peak - self.final) * 0.5 * (1 + o.cos(math.pi * o.as_real(c) / length))
        value = o.real_where(c >= length, self.final, value)  # exactly `final` from then on
        if self.warmup:
            w = o.as_real(o.minimum(s, self.warmup))
            rising = self.start + (self.peak - self.start) * (w / self.warmup)
            value = o.real_where(s < self.warmup, rising, value)
        return value


@dataclasses.dataclass(frozen=True)
class StepDecay(_Numbers):
    """`init`, multiplied by `gamma` every `step_size` steps: `init·gamma^⌊t/step_size⌋`.

    PyTorch: `StepLR(step_size, gamma)`; optax: `exponential_decay(init, step_size, gamma,
    staircase=True)`.
    """

    init: float
    step_size: int
    gamma: float = 0.1

    def __call__(self, step):
        o, s = _steps(step)
        k = o.as_real(s // self.step_size)
        return self.init * self.gamma**k


@dataclasses.dataclass(frozen=True)
class Exponential(_Numbers):
    """`init·rate^(c/steps)` with `c = max(t − begin, 0)`; when `end` is given, the value stops
    there (a floor when `rate < 1`, a ceiling when `rate > 1`).

    PyTorch: `ExponentialLR(rate)` (with `steps=1, begin=0`); optax: `exponential_decay(init,
    steps, rate, begin, end_value=end)`.
    """

    init: float
    rate: float
    steps: int = 1
    begin: int = 0
    end: float | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.rate <= 0:
            raise ValueError(f"Exponential: rate must be positive, got {self.rate!r}")

    def __call__(self, step):
        o, s = _steps(step)
        c = o.as_real(o.maximum(s - self.begin, 0))
        value = self.init * self.rate ** (c / self.steps)
        if self.end is not None:
            value = o.maximum(value, self.end) if self.rate < 1 else o.minimum(value, self.end)
        return value


@dataclasses.dataclass(frozen=True)
class PiecewiseConstant(Schedule):
    """`values[0]` before `boundaries[0]`, `values[i]` from step `boundaries[i-1]` on.

    PyTorch: `MultiStepLR(boundaries, gamma)` when each value is `gamma` times the previous;
    optax: `piecewise_constant_schedule(values[0], {b: values[i+1]/values[i]})` (optax multiplies
    scales, so its values equal these up to rounding).
    """

    values: tuple
    boundaries: tuple

    def __post_init__(self):
        bounds = _boundaries("PiecewiseConstant", "values", self.values, self.boundaries)
        values = tuple(_real("PiecewiseConstant", f"values[{i}]", v) for i, v in enumerate(self.values))
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "boundaries", bounds)

    def __call__(self, step):
        o, s = _steps(step)
        value = o.real_scalar(self.values[0], step)
        for b, v in zip(self.boundaries, self.values[1:]):
            value = o.real_where(s >= b, v, value)
        return value


@dataclasses.dataclass(frozen=True)
class Join(Schedule):
    """Schedules one after another: `schedules[0]` until step `boundaries[0]`, then
    `schedules[i]` from step `boundaries[i-1]`, each restarted at its own step 0 there.

    `Join((Linear(0.0, 1e-3, 100), Cosine(1e-3, 900)), (100,))` is a warm-up then a decay.
    optax: `join_schedules(schedules, boundaries)`; PyTorch: `SequentialLR(opt, schedulers,
    milestones)`.
    """

    schedules: tuple
    boundaries: tuple

    def __post_init__(self):
        bounds = _boundaries("Join", "schedules", self.schedules, self.boundaries)
        for i, s in enumerate(self.schedules):
            if not callable(s):
                raise TypeError(f"Join: schedules[{i}] is not callable: {s!r}")
        object.__setattr__(self, "schedules", tuple(self.schedules))
        object.__setattr__(self, "boundaries", bounds)

    def __call__(self, step):
        o, s = _steps(step)
        if not _is_array(step):  # a Python int: only the schedule in force is evaluated
            start, current = 0, self.schedules[0]
            for b, sched in zip(self.boundaries, self.schedules[1:]):
                if s >= b:
                    start, current = b, sched
            return float(current(s - start))
        value = self.schedules[0](s)
        for b, sched in zip(self.boundaries, self.schedules[1:]):
            value = o.real_where(s >= b, sched(o.maximum(s - b, 0)), value)
        return value
