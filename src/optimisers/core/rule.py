"""The rule contract: `Rule`, the base class of every optimisation rule.

A rule holds hyperparameters only. `init(x)` makes the state for one parameter array, `apply(state,
x, dx)` returns `(new_state, step)`, never writing to its inputs, and the interface sets `x_new = x -
step`; a step may also be `None` (no move this time) or `NewValue(v)` (set the parameter to `v`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, ClassVar, NamedTuple

import numpy as np


class NewValue(NamedTuple):
    """A step that sets the parameter to `value` instead of subtracting from it."""

    value: Any


class Scheduled(NamedTuple):
    """The state of a rule with a scheduled hyperparameter: `count`, the number of steps taken
    (the schedules are evaluated at it, 0 on the first step, as optax does), and `state`, the
    rule's own state."""

    count: Any
    state: Any


def concrete(value):
    """A float for a concrete number, None for a traced or otherwise opaque value."""
    try:
        return float(value)
    except Exception:
        return None


def is_complex(x) -> bool:
    """Whether `x` (an array of any backend, or a Python number) has a complex dtype. Generic:
    reads the dtype (`torch.dtype.is_complex`, else NumPy's dtype kind), so backends need nothing."""
    if isinstance(x, complex):
        return True
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    flag = getattr(dtype, "is_complex", None)  # torch.dtype
    return flag if isinstance(flag, bool) else np.dtype(dtype).kind == "c"


def _is_number(value) -> bool:
    # 0-d arrays of any backend (and JAX tracers) stand for numbers
    return not isinstance(value, bool) and (
        isinstance(value, numbers.Number) or getattr(value, "shape", None) == ()
    )


def _is_schedule(value) -> bool:
    """A callable of the step count standing for a hyperparameter (a class is not one, nor a
    number in a box of HELD_VALUES: a Flax Variable is callable)."""
    return callable(value) and not isinstance(value, type) and not _is_held(value)


def _check_field(rule: str, name: str, value, default):
    """Check `value` against the type of the field's default, converting ints to floats. A float
    field may also hold a schedule."""
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise TypeError(f"{rule}: {name} must be True or False, got {value!r}")
        return value
    if isinstance(default, float):
        if _is_schedule(value):
            return value
        if isinstance(value, complex) or not _is_number(value):
            raise TypeError(
                f"{rule}: {name} must be a real number or a schedule (a callable of the step "
                f"count), got {value!r}"
            )
        return float(value) if isinstance(value, numbers.Integral) else value
    if isinstance(default, int):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise TypeError(f"{rule}: {name} must be an integer, got {value!r}")
        return value
    if isinstance(default, tuple):
        if not isinstance(value, (tuple, list)) or len(value) != len(default):
            raise TypeError(f"{rule}: {name} must be a tuple of {len(default)} numbers, got {value!r}")
        return tuple(_check_field(rule, f"{name}[{i}]", v, d) for i, (v, d) in enumerate(zip(value, default)))
    return value


def _labelled(name: str, value) -> list:
    """`[(name, value)]`, or `(name[i], entry)` for each entry of a tuple: for error messages."""
    if isinstance(value, tuple):
        return [(f"{name}[{i}]", v) for i, v in enumerate(value)]
    return [(name, value)]


def _check_finite(rule, name: str, value) -> None:
    """NaN is never a hyperparameter, and inf only where the rule says so; traced values pass."""
    for label, v in _labelled(name, value):
        c = concrete(v) if not isinstance(v, (bool, str)) else None
        if c is not None and not math.isfinite(c) and not (math.isinf(c) and name in rule.infinite_ok):
            raise ValueError(f"{type(rule).__name__}: {label} must be a finite number, got {c}")


class Rule:
    """Base class of optimisation rules: a frozen dataclass of hyperparameters, each checked
    against the type of its default, with `validate()` for a rule's own checks; override `init`
    and `apply` (and optionally `eval_value`), and set the flags below (docs/custom-rules.md)."""

    elementwise: ClassVar[bool] = False  #: each element stepped alone, given scalar state
    never_raises: ClassVar[bool] = False  #: `apply` cannot raise on inputs the update checked
    scales_gradient: ClassVar[bool] = False  #: the step is `gradient_factor(dx) · dx` (ClipNorm)
    #: elementwise given one factor per array that `step_factors` finds first over whole arrays
    #: (a chain that clips the gradient's norm first; LAMB and LARS): `apply_scaled`
    scaled_elementwise: ClassVar[bool] = False
    stacks: ClassVar[bool] = False  #: `apply_stacked` steps parameters stacked on a first axis
    infinite_ok: ClassVar[tuple[str, ...]] = ()  #: fields that may be infinite (ClipNorm's `p`)
    real_only: ClassVar[bool] = False  #: `init` refuses complex parameters (the maths needs order)
    #: positions, in the state `init` returns (flattened in order), of the arrays `apply` keeps
    #: non-negative, such as Adam's second moment: `LowBit` gives them its unsigned maps
    nonnegative_state: ClassVar[tuple[int, ...]] = ()
    #: positions of arrays that must keep their precision, copies of the parameter such as
    #: schedule-free's `z`: `LowBit` leaves them as they are
    exact_state: ClassVar[tuple[int, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _wrap_methods(cls)

    def __post_init__(self):
        _check_fields(self)
        self.validate()

    def validate(self) -> None:
        """Rule-specific checks of the hyperparameters; raise ValueError or TypeError."""

    def init(self, x):
        """The initial state for parameter array `x`."""
        _check_one_array(self, x)
        return Scheduled(0, None) if scheduled_fields(self) else None

    def apply(self, state, x, dx):
        """`(new_state, step)` for parameter `x` with gradient `dx`; `x_new = x - step`."""
        raise NotImplementedError(f"{type(self).__name__} must define apply(state, x, dx)")

    def eval_value(self, state, x):
        """The parameter at the rule's evaluation point (docs/evaluation-weights.md)."""
        return x

    init._wrapped = eval_value._wrapped = True  # (checks its argument; has no state of its own)

    def nonnegative_parts(self, state) -> frozenset:
        """The positions, among the parts of `state` (this rule's state, flattened in order by
        `optimisers.core.state.flatten_state`), of the arrays this rule keeps non-negative.
        Rules that hold other rules' states (chains, wrappers) override it."""
        return _positions(self.nonnegative_state, state)

    def exact_parts(self, state) -> frozenset:
        """The positions, as in `nonnegative_parts`, of the arrays that must keep their precision."""
        return _positions(self.exact_state, state)

    def dequantised_rule(self):
        """The rule whose step this one's is on a state whose `Quantised` arrays are dequantised
        to float32, the new ones stored quantised in the same formats (`LowBit`'s rule), else
        None. The compiled way then quantises inside its pass (`engine.compiled`)."""
        return None

    def hyperparameters(self) -> tuple[str, ...]:
        """The names `adjust` accepts for this rule (an explicit state dtype is not one)."""
        return tuple(f.name for f in dataclasses.fields(self) if not f.metadata.get("state_dtype"))

    def adjust(self, **hyper) -> Rule:
        """A copy with the named hyperparameters replaced; names this rule lacks are ignored."""
        return adjusted(self, hyper)

    def with_counters(self, state):
        """`state` with a step count for each schedule that `adjust` gave after `setup`."""
        return Scheduled(0, state) if type(state) is not Scheduled and scheduled_fields(self) else state

    def update(self, *args, **kwargs):  # not optax's: the error says how to wrap a rule for optax
        raise TypeError(_not_a_transformation(self))

    def gradient_factor(self, dx):  # for a rule that scales_gradient
        raise NotImplementedError(f"{type(self).__name__} does not scale the gradient by one factor")

    def gradient_factors(self, dxs):
        return [self.gradient_factor(dx) for dx in dxs]

    def direction(self, state, x, dx):
        """For a `scaled_elementwise` rule: the array whose norm `step_factors` reads (the
        gradient, unless the rule says otherwise), elementwise in its arguments."""
        return dx

    def step_factors(self, xs, us):
        """For a `scaled_elementwise` rule: each array's factor as a 1-D array of `xs[0]`'s dtype,
        from the parameters `xs` and their `direction`s `us` (whole arrays; lists, or matrices
        whose rows are arrays of one size: read them with `ops.norms`)."""
        raise NotImplementedError(f"{type(self).__name__} is not scaled_elementwise")

    def apply_scaled(self, state, x, dx, factor):
        """`apply` given the array's factor from `step_factors`; `x`, `dx` and the state may be
        a chunk of the whole array, `factor` one number (or one per element of the chunk)."""
        raise NotImplementedError(f"{type(self).__name__} is not scaled_elementwise")

    def apply_stacked(self, state, x, dx):
        raise NotImplementedError(f"{type(self).__name__} does not stack")

    def kernel_args(self, kernel: str):
        """The arguments of a backend's kernel `kernel` (in its `FAST_PATHS`) for this rule, or None."""
        return None


def _positions(own, state) -> frozenset:
    """`own` positions in a rule's state, after the step count of a Scheduled state."""
    return frozenset(i + 1 for i in own) if type(state) is Scheduled else frozenset(own)


def _wrap_methods(cls) -> None:
    for name, wrap in _WRAPPERS:
        own = cls.__dict__.get(name)
        if callable(own) and not getattr(own, "_wrapped", False):
            setattr(cls, name, wrap(own))
    if "apply" in cls.__dict__ and "kernel_args" not in cls.__dict__:
        cls.kernel_args = Rule.kernel_args  # a kernel computes the apply it was matched to
    own = [v for v in cls.__dict__.values() if isinstance(v, dataclasses.Field)]
    fields = [*getattr(cls, "__dataclass_fields__", {}).values(), *own]
    if "__repr__" not in cls.__dict__ and any(f.metadata.get("state_dtype") for f in fields):
        cls.__repr__ = _repr_without_unset_dtypes  # (the dataclass keeps a __repr__ of the class)


def _repr_without_unset_dtypes(rule) -> str:
    """The dataclass repr, an explicit state dtype shown only when given (reprs stay as before)."""
    shown = [f for f in dataclasses.fields(rule) if f.repr]
    shown = [f for f in shown if not (f.metadata.get("state_dtype") and getattr(rule, f.name) is None)]
    return f"{type(rule).__name__}({', '.join(f'{f.name}={getattr(rule, f.name)!r}' for f in shown)})"


def _check_state_dtype(rule: str, name: str, value) -> None:
    """An explicit dtype for a state array (`Adam(mu_dtype=...)`): None (the parameter's), or a
    floating or complex dtype: NumPy's or its name (`"bfloat16"`), or the backend's own."""
    if value is None:
        return
    if getattr(value, "is_floating_point", None) is not None:  # torch.dtype
        ok = value.is_floating_point or value.is_complex
    else:
        try:
            dtype = np.dtype(value)
            ok = dtype.kind in "fc" or dtype.name.startswith(("bfloat", "float"))
        except TypeError:  # "bfloat16" before ml_dtypes is imported
            ok = isinstance(value, str) and value.startswith(("bfloat", "float", "complex"))
    if not ok:
        raise TypeError(
            f"{rule}: {name} must be None (the parameter's dtype) or a floating or complex dtype, "
            f"got {value!r}"
        )


def _check_fields(rule: Rule) -> None:
    """Each field checked against the type of its default (converted where it may be), numbers
    finite unless `infinite_ok`, and `eta` not negative."""
    name = type(rule).__name__
    for f in dataclasses.fields(rule):
        value = getattr(rule, f.name)
        default = f.default if f.default is not dataclasses.MISSING else None
        checked = _check_field(name, f.name, value, default)
        if checked is not value:
            object.__setattr__(rule, f.name, checked)
        if isinstance(default, (float, tuple)):
            _check_finite(rule, f.name, checked)
        if f.metadata.get("state_dtype"):
            _check_state_dtype(name, f.name, value)
    eta = concrete(getattr(rule, "eta", 0.0))
    if eta is not None and eta < 0:
        raise ValueError(f"{name}: the learning rate eta cannot be negative, got {eta}")


def adjusted(rule: Rule, hyper: dict) -> Rule:
    """`rule.adjust(**hyper)`. In a stacked state (states stacked along a first axis for
    `jax.vmap`) a hyperparameter is an array of one value per member; it takes such an array or a
    number (the same for every member)."""
    names = rule.hyperparameters()
    own = {k: _held_like(getattr(rule, k), v) for k, v in hyper.items() if k in names}
    if not own:
        return rule
    # an array of values, one per member of a stacked (vmapped) ensemble of states
    if any(getattr(v, "ndim", 0) for k in own for v in _entries((own[k], getattr(rule, k)))):
        return _adjusted_stacked(rule, own)
    return dataclasses.replace(rule, **own)


def _entries(value):
    """The entries of a field's value: itself, or each entry of a (nested) tuple."""
    if isinstance(value, tuple):
        for v in value:
            yield from _entries(v)
    else:
        yield value


def _each_entry(fn, value):
    """`fn` of a field's value, or of each entry of a (nested) tuple, as a tuple of that shape."""
    if isinstance(value, tuple):
        return tuple(_each_entry(fn, v) for v in value)
    return fn(value)


def _shape(value):
    return _each_entry(lambda v: tuple(getattr(v, "shape", ())), value)


def _member(value, i):
    return _each_entry(lambda v: v[i] if getattr(v, "ndim", 0) else v, value)


def _like_stacked(value, old):
    """`value` for a field that holds `old`: a number where `old` is an array of members is
    repeated for each member (as an array of `old`'s dtype, which vmap can map over)."""
    if isinstance(old, tuple) and isinstance(value, tuple):
        return tuple(_like_stacked(v, o) for v, o in zip(value, old))
    if getattr(old, "ndim", 0) and not getattr(value, "ndim", 0) and isinstance(value, numbers.Real):
        return np.full(old.shape, value, dtype=np.dtype(old.dtype))
    return value


def _adjusted_stacked(rule, own):
    """`rule.adjust(**own)` for a rule of a stacked state: the new values must have the shape of
    the old ones (a number is repeated); each member's values are checked as one rule's."""
    name = type(rule).__name__
    own = {k: _like_stacked(v, getattr(rule, k)) for k, v in own.items()}
    for k, v in own.items():
        old = getattr(rule, k)
        if _shape(v) != _shape(old):
            raise ValueError(
                f"{name}: {k} has shape {_shape(v)} where this rule's {k} has shape {_shape(old)}. "
                "An array of hyperparameters (one value per member) is for a stacked state (states "
                "stacked along a first axis for jax.vmap), and must have the shape of the "
                "hyperparameter it replaces"
            )
    fields = {f.name: own.get(f.name, getattr(rule, f.name)) for f in dataclasses.fields(rule) if f.init}
    n = min(len(v) for v in _entries(tuple(fields.values())) if getattr(v, "ndim", 0))
    for i in range(n):  # each member's numbers pass the rule's own checks
        dataclasses.replace(rule, **{k: _member(v, i) for k, v in fields.items()})
    return _unchecked(rule, fields)


def _unchecked(rule, values: dict):
    """A copy of `rule` with the fields named in `values` replaced, made without the checks (which
    a stack's arrays or a traced value would not pass)."""
    new = object.__new__(type(rule))
    for f in dataclasses.fields(rule):
        object.__setattr__(new, f.name, values.get(f.name, getattr(rule, f.name)))
    return new


#: `(is_held, held_like)` pairs that adapters register, for hyperparameters that a framework holds
#: in a box of its own: `held_like(box, value)` is a new box of the same kind holding `value`.
#: (`nnx.Optimizer` holds every number of an optax state in a Flax `Variable`; a bare number in
#: its place would break its next update.)
HELD_VALUES: list = []


def _held_like(old, new):
    """`new` held as `old` is held (see HELD_VALUES); `new` itself for a plain `old`."""
    if isinstance(old, tuple) and isinstance(new, (tuple, list)) and len(new) == len(old):
        return tuple(map(_held_like, old, new)) if any(map(_is_held, old)) else new
    for is_held, held_like in HELD_VALUES:
        if is_held(old):
            return held_like(old, new)
    return new


def _is_held(value) -> bool:
    return any(is_held(value) for is_held, _ in HELD_VALUES)


def _not_a_transformation(rule) -> str:
    return (
        f"{rule!r} is an optimisers rule, not an optax GradientTransformation; to hand it to optax "
        "or Flax (optax.chain, nnx.Optimizer, TrainState.create), wrap it: "
        "optimisers.optax.transform(rule). To train a whole model with it directly, use "
        "optimisers.setup(rule, model) and optimisers.update."
    )


def _check_one_array(rule, x) -> None:
    # optax and Flax call `tx.init(params)` with a whole tree: a rule handed where a transformation
    # belongs would otherwise build garbage state and fail later, somewhere else
    if not hasattr(x, "shape"):
        raise TypeError(
            f"{type(rule).__name__}.init(x) takes one parameter array, got a {type(x).__name__}. "
            + _not_a_transformation(rule)
        )
    if rule.real_only and is_complex(x):
        raise TypeError(
            f"{type(rule).__name__} is not defined for complex parameters (it uses the sign or the "
            f"order of numbers); got an array of dtype {x.dtype}"
        )


def _checked_init(init):
    @functools.wraps(init)
    def checked(self, x):
        _check_one_array(self, x)
        names = scheduled_fields(self)
        if names:  # the state counts steps for the schedules; init sees their values at step 0
            return Scheduled(0, init(at_step(self, names, 0), x))
        return init(self, x)

    checked._wrapped = True
    return checked


# --- schedules as hyperparameters ---------------------------------------------------------------


def scheduled_fields(rule) -> tuple[str, ...]:
    """The names of `rule`'s own fields that hold a schedule (in a tuple field: any element).
    Asked at every `apply`, so a rule (immutable) keeps the answer."""
    own = getattr(rule, "__dict__", None)
    found = own.get("_scheduled_fields") if own is not None else None
    if found is None:
        found = tuple(
            n for n in _schedulable(type(rule)) if any(map(_is_schedule, _entries(getattr(rule, n, None))))
        )
        if own is not None:
            own["_scheduled_fields"] = found  # not a field: equality, hashing and repr ignore it
    return found


@functools.cache
def _schedulable(cls) -> tuple[str, ...]:
    """The fields of a rule class that may hold schedules: those with a float or tuple default."""
    if not dataclasses.is_dataclass(cls):
        return ()
    return tuple(f.name for f in dataclasses.fields(cls) if isinstance(f.default, (float, tuple)))


def has_schedules(rule) -> bool:
    """Does `rule`, or a rule inside it (a chain's member, a wrapper's rule), hold a schedule?"""
    if scheduled_fields(rule):
        return True
    fields = dataclasses.fields(rule) if dataclasses.is_dataclass(rule) else ()
    inner = (r for f in fields for r in _entries(getattr(rule, f.name, None)))
    return any(isinstance(r, Rule) and has_schedules(r) for r in inner)


def _value_at(value, count):
    if not _is_schedule(value):
        return value
    out = value(count)
    # eagerly (a Python count) a plain float, whatever array type the schedule returns (an optax
    # schedule gives a JAX array), so that it serves NumPy and PyTorch parameters too
    return float(out) if type(count) is int else out


def at_step(rule, names, count):
    """A copy of `rule` with the schedules in fields `names` replaced by their values at `count`
    (made without validation: under `jax.jit` the values are traced)."""
    return _unchecked(rule, {n: _each_entry(lambda v: _value_at(v, count), getattr(rule, n)) for n in names})


def _scheduled_apply(apply):
    """`apply` for a rule that may hold schedules: evaluated at the state's count, which it
    advances. A state without a count (the rule was given a schedule by `adjust` after `setup`)
    starts counting then; a rule adjusted back to numbers keeps counting."""

    @functools.wraps(apply)
    def wrapped(self, state, x, dx, *extra):
        names = scheduled_fields(self)
        if not names and type(state) is not Scheduled:
            return apply(self, state, x, dx, *extra)
        count, inner = state if type(state) is Scheduled else (0, state)
        inner, step = apply(at_step(self, names, count) if names else self, inner, x, dx, *extra)
        return Scheduled(count + 1, inner), step

    wrapped._wrapped = True
    return wrapped


def _own_state(method):
    """`eval_value` or `direction` given the state that `apply` sees: without a schedule's step
    count."""

    @functools.wraps(method)
    def wrapped(self, state, x, *rest):
        return method(self, state.state if type(state) is Scheduled else state, x, *rest)

    wrapped._wrapped = True
    return wrapped


#: what `Rule.__init_subclass__` wraps each method of a rule class in (a stack's count is one for
#: all its members)
_WRAPPERS = (
    ("init", _checked_init),
    ("apply", _scheduled_apply),
    ("apply_stacked", _scheduled_apply),
    ("apply_scaled", _scheduled_apply),
    ("eval_value", _own_state),
    ("direction", _own_state),
)


def check_range(rule: Rule, name: str, low: float, high: float, *, high_open: bool = False):
    """Raise ValueError unless `low <= rule.name <= high` (or `< high`); traced values pass."""
    for label, value in _labelled(name, getattr(rule, name)):
        v = concrete(value)
        if v is not None and not (low <= v and (v < high if high_open else v <= high)):
            bracket = ")" if high_open else "]"
            raise ValueError(f"{type(rule).__name__}: {label} must be in [{low}, {high}{bracket}, got {v}")
