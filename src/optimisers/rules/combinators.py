"""Rules built from other rules: chains, accumulation, mixed precision, skipping bad steps,
lookahead."""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from optimisers import ops
from optimisers.core.rule import NewValue, Rule, check_range, concrete, has_schedules, scheduled_fields
from optimisers.core.state import flatten_state, unflatten_state

__all__ = ["OptimiserChain", "AccumGrad", "MixedPrecision", "SkipNonFinite", "Lookahead"]


@dataclass(frozen=True, init=False, repr=False)
class OptimiserChain(Rule):
    """Apply several rules in sequence, each one's step being the next one's gradient:
    `OptimiserChain(ClipGrad(1.0), WeightDecay(), Adam())`.

    State: a tuple of the members' states. A member that returns `None` (`AccumGrad` between its
    updates) stops the chain: no move, and the members after it keep their state. Chains nest;
    `MixedPrecision` wraps a chain, it is not a member. `hyperparameters()` is the union of the
    members' names; `adjust(name=value)` changes every member that has `name`. optax:
    `optax.chain(...)`; in PyTorch one writes the chain by hand. `OptimiserChain()` subtracts
    the raw gradient.
    """

    rules: tuple

    def __init__(self, *rules):
        object.__setattr__(self, "rules", tuple(rules))
        self.__post_init__()

    def validate(self):
        _check_members(self.rules)

    elementwise = property(lambda self: all(rule.elementwise for rule in self.rules))

    @property
    def never_raises(self):
        # a scaled chain's first member has run already, in `step_factors`
        return all(rule.never_raises for rule in self.rules[1 if self.scaled_elementwise else 0 :])

    @property
    def scaled_elementwise(self):
        first, *rest = self.rules or (None,)
        if not rest or not first.scales_gradient or has_schedules(first):  # (factor found outside apply)
            return False
        return all(r.elementwise for r in rest)

    def __repr__(self):
        return f"OptimiserChain({', '.join(repr(r) for r in self.rules)})"

    def hyperparameters(self):
        return tuple(dict.fromkeys(name for rule in self.rules for name in rule.hyperparameters()))

    def adjust(self, **hyper):
        new = tuple(rule.adjust(**hyper) for rule in self.rules)
        return self if all(a is b for a, b in zip(new, self.rules)) else OptimiserChain(*new)

    def init(self, x):
        return tuple(rule.init(x) for rule in self.rules)

    def nonnegative_parts(self, state):
        return _members_parts(self.rules, state, "nonnegative_parts")

    def exact_parts(self, state):
        return _members_parts(self.rules, state, "exact_parts")

    def with_counters(self, state):
        new = tuple(rule.with_counters(s) for rule, s in zip(self.rules, state))
        return state if all(a is b for a, b in zip(new, state)) else new

    def apply(self, state, x, dx):
        return self.apply_scaled(state, x, dx, None)

    def step_factors(self, xs, us):
        return self.rules[0].gradient_factors(us)  # (`us`: the gradients, the default `direction`)

    def eval_value(self, state, x):
        for rule, s in zip(self.rules, state):  # each member's evaluation point of the last's
            x = rule.eval_value(s, x)
        return x

    def apply_scaled(self, state, x, dx, factor):
        """`apply`, where a `factor` given is the first member's `gradient_factor` of the whole
        gradient (of which `dx` may be a chunk): exactly what that member's `apply` computes."""
        states = list(state)
        for i, rule in enumerate(self.rules):
            if i == 0 and factor is not None:
                dx = factor * dx  # as ClipNorm.apply: the state unchanged
                continue
            if isinstance(dx, NewValue):
                raise TypeError(
                    f"OptimiserChain: {type(self.rules[i - 1]).__name__} sets the parameter's "
                    "value, so it must be the last member of a chain"
                )
            states[i], dx = rule.apply(states[i], x, dx)
            if dx is None:
                break
        return tuple(states), dx


def _check_members(rules) -> None:
    for i, rule in enumerate(rules):
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
        value = concrete(n)
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


class _Wrapper(Rule):
    """A rule around its field `rule`, to which `hyperparameters()` and `adjust` forward; its state
    holds the rule's at `inner_at`. Elementwise, and never raising, when its rule is."""

    inner_at = 0

    elementwise = property(lambda self: self.rule.elementwise)
    never_raises = property(lambda self: self.rule.never_raises)

    def validate(self):
        if not isinstance(self.rule, Rule):
            raise TypeError(f"{type(self).__name__}: rule must be an optimisers.Rule, got {self.rule!r}")

    def hyperparameters(self):
        return self.rule.hyperparameters()

    def adjust(self, **hyper):
        rule = self.rule.adjust(**hyper)
        return self if rule is self.rule else dataclasses.replace(self, rule=rule)

    def with_counters(self, state):
        i = self.inner_at
        inner = self.rule.with_counters(state[i])
        return state if inner is state[i] else (*state[:i], inner, *state[i + 1 :])

    def eval_value(self, state, x):
        return self.rule.eval_value(state[self.inner_at], x)

    def nonnegative_parts(self, state):
        return self._with_inner(state, self.nonnegative_state, "nonnegative_parts")

    def exact_parts(self, state):
        return self._with_inner(state, self.exact_state, "exact_parts")

    def _with_inner(self, state, own, method):
        """Among its state's parts: the positions of this wrapper's `own` entries of its state
        tuple (each one array) and those its rule's `method` gives."""
        i = self.inner_at
        offset = _count_parts(state[:i])
        inner = getattr(self.rule, method)(state[i])
        return frozenset({_count_parts(state[:p]) for p in own} | {offset + j for j in inner})


def _members_parts(rules, state, method) -> frozenset:
    """The positions that each member's `method` gives, among the parts of a chain's state."""
    found, offset = set(), 0
    for rule, s in zip(rules, state):
        found.update(offset + i for i in getattr(rule, method)(s))
        offset += _count_parts(s)
    return frozenset(found)


def _count_parts(state) -> int:
    parts: list = []
    flatten_state(state, parts)
    return len(parts)


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
    inner_at = 1  # (master, inner)
    exact_state = (0,)  # the master copy
    real_only = True

    def validate(self):
        super().validate()
        _check_float_dtype(self.dtype)

    def __repr__(self):
        try:
            dtype = np.dtype(self.dtype).name
        except TypeError:
            dtype = repr(self.dtype)
        return f"MixedPrecision({self.rule!r}, dtype={dtype})"

    def init(self, x):
        master = ops.cast(x, self.dtype)
        return master, self.rule.init(master)

    def eval_value(self, state, x):
        master, inner = state
        value = self.rule.eval_value(inner, master)
        return x if value is master else ops.astype(value, x)

    def apply(self, state, x, dx):
        master, inner = state
        inner, step = self.rule.apply(inner, master, ops.astype(dx, master))
        if step is None:
            return (master, inner), None
        master = ops.astype(step.value if isinstance(step, NewValue) else master - step, master)
        return (master, inner), NewValue(ops.astype(master, x))


def _check_float_dtype(dtype) -> None:
    try:
        kind = np.dtype(dtype)
    except TypeError:
        if getattr(dtype, "is_floating_point", False):  # torch.float32 and friends
            return
        raise TypeError(f"MixedPrecision: dtype must be a floating dtype, got {dtype!r}") from None
    if not (kind.kind == "f" or kind.name.startswith(("bfloat", "float"))):
        raise ValueError(f"MixedPrecision: dtype must be a real floating dtype, got {kind}")


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
    elementwise = never_raises = False  # the check is over the whole gradient

    def __repr__(self):
        return f"SkipNonFinite({self.rule!r})"

    def init(self, x):
        return self.rule.init(x), 0

    def apply(self, state, x, dx):
        inner, skipped = state
        finite = ops.isfinite(dx)
        if finite is False:
            return (inner, skipped + 1), None
        new, step = self.rule.apply(inner, x, dx)
        if finite is True:
            return (new, skipped), step
        # traced (under jax.jit): no Python branch on array values, so select between both
        ok = ops.all_finite(dx)
        new, step = _selected(ok, new, inner, step, x)
        return (new, ops.where(ok, skipped, skipped + 1)), step


def _selected(ok, new, old, step, x):
    """The state `new` where `ok`, else `old` (of one structure), and `step` or no move."""
    old_parts: list = []
    flatten_state(old, old_parts)
    new_parts: list = []
    spec = flatten_state(new, new_parts)
    # None parts (Descent's state, SOAP's axes without a basis) have nothing to select
    kept = [n if n is None else ops.where(ok, n, o) for n, o in zip(new_parts, old_parts)]
    if isinstance(step, NewValue):
        step = NewValue(ops.where(ok, step.value, x))
    elif step is not None:
        step = ops.where(ok, step, ops.zeros_like(step))
    return unflatten_state(spec, iter(kept)), step


@dataclass(frozen=True, repr=False)
class Lookahead(_Wrapper):
    """Lookahead (Zhang et al., "Lookahead Optimizer: k steps forward, 1 step back", 2019): the
    parameter (the fast weights) takes `k` steps of `rule`; then slow weights, kept in the state,
    move a fraction `alpha` of the way to it, and the parameter is set to them.

    State `(slow, inner, n)`: the slow weights (a copy of `x` at setup), `rule`'s state and the
    number of its steps since the last synchronisation. Each step: `(inner, step) =
    rule.apply(inner, x, g)`, `fast = x − step`, `n ← n+1`; if `n = k`: `slow ← slow +
    α·(fast − slow)`, the parameter becomes `slow` and `n ← 0`; otherwise it becomes `fast`. A call
    on which `rule` does not move (`AccumGrad`) does not count (optax counts every call).
    `optimisers.eval_params(state, model)` gives the model at the slow weights, to evaluate and save.

    Defaults: `k=6, alpha=0.5` (α a number). `hyperparameters()` and `adjust` forward to `rule`.
    optax: `optax.lookahead(rule, sync_period=k, slow_step_size=alpha)`, up to rounding, on
    `LookaheadParams(fast, slow)` where this keeps `slow` in the state. PyTorch has none.
    """

    rule: Rule
    k: int = 6
    alpha: float = 0.5
    inner_at = 1  # (slow, inner, n)
    exact_state = (0,)  # the slow weights

    def validate(self):
        super().validate()
        _check_lookahead(self)

    def __repr__(self):
        return f"Lookahead({self.rule!r}, k={self.k}, alpha={self.alpha})"

    def init(self, x):
        # a cast is always a new plain array (ops.copy of a torch Parameter would be a Parameter)
        return ops.cast(x, x.dtype), self.rule.init(x), 0

    def eval_value(self, state, x):
        return state[0]

    def apply(self, state, x, dx):
        slow, inner, n = state
        inner, step = self.rule.apply(inner, x, dx)
        if step is None:
            return (slow, inner, n), None
        n = n + 1
        sync = n == self.k
        known = concrete(sync)
        if known is not None and not known:
            return (slow, inner, n), step
        fast = ops.astype(step.value if isinstance(step, NewValue) else x - step, x)  # as written
        synced = slow + ops.scalar(self.alpha, x) * (fast - slow)
        if known is not None:  # the parameter's own copy: no buffer shared with the state
            return (synced, inner, 0), NewValue(ops.copy(synced))
        # traced (under jax.jit): both outcomes, selected on the counter
        slow = ops.where(sync, synced, slow)
        return (slow, inner, n % self.k), NewValue(ops.where(sync, synced, fast))


def _check_lookahead(rule: Lookahead) -> None:
    if rule.k < 1:
        raise ValueError(f"Lookahead: k (steps between synchronisations) must be >= 1, got {rule.k}")
    if "alpha" in scheduled_fields(rule):
        raise TypeError(f"Lookahead: alpha must be a number, not a schedule, got {rule.alpha!r}")
    if isinstance(rule.rule, MixedPrecision):
        # its master copy would keep the fast weights after a synchronisation
        raise TypeError(
            "Lookahead: MixedPrecision cannot be its rule; wrap the Lookahead instead: "
            "MixedPrecision(Lookahead(...))"
        )
    check_range(rule, "alpha", 0.0, 1.0)
