"""The traced backend: an elementwise step recorded as a program that a backend compiles into one
pass over memory (`optimisers.engine.compiled` traces, `numba_lowering` compiles).

A rule's `apply` runs once on `Traced` stand-ins for its arrays, and each array operation it asks
of `ops` (or of Python's operators) becomes a node of the program. Scalars stay real: a
hyperparameter, a step count and what the rule computes from them are the numbers the eager step
computes, with the same library's rounding. Where one meets an array it becomes a *constant
slot*: its value is an argument of the compiled kernel, not part of its code, so a new learning
rate or step count reuses the kernel. Every node's dtype is the one the real array library gives
the same operation (asked once of one-element arrays), so a kernel rounds where the eager step
rounds. An operation that is not elementwise, or that reads an array's values in Python, raises
`Untraceable`: that rule runs eagerly.

A program is a tuple of nodes `(op, args, dtype)`: `args` holds node numbers, or `~k` for
constant slot `k`; `("in", (k,), dtype)` reads input array `k` (the parameter, the gradient,
then the state arrays). Its outputs are nodes each stored in a dtype, into arrays the caller
gives (for a step in place, the inputs themselves). Equal programs compile once.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import numpy as np

from optimisers.core import dispatch
from optimisers.core.rule import is_complex as _is_complex

_REAL_NUMBERS = {float, int, np.float32, np.float64, np.float16}


class Untraceable(Exception):
    """The step asked for something a compiled elementwise pass cannot do."""


class Program(NamedTuple):
    nodes: tuple  # (op, args, dtype)
    outputs: tuple  # (node number, dtype): the kernel's outputs, each node stored in that dtype

    @property
    def inputs(self) -> list:
        """Each input's dtype, by input number."""
        found = {args[0]: dtype for op, args, dtype in self.nodes if op == "in"}
        return [found[k] for k in range(len(found))]


def compared_in(args, dtype: str, names: list) -> str:
    """The dtype (by name) a node of dtype `dtype` computes in, given its operands `args` and
    each node's computing dtype `names`: its own, but a comparison (a bool) computes in its
    operands' dtype (the wider of two nodes'; a constant takes the node's)."""
    if dtype != "bool":
        return dtype
    nodes = [names[a] for a in args if a >= 0]
    return "float64" if "float64" in nodes or not nodes else nodes[0]


class Recorder:
    """The program being traced: its nodes, and the values of its constant slots."""

    def __init__(self, n: int):
        self.n = n  # elements of every input
        self.nodes: list = []
        self.consts: list[float] = []
        self._index: dict = {}  # node -> its number (a node asked twice is recorded once)

    def node(self, op: str, args: tuple, sample) -> Traced:
        dtype = sample.dtype
        key = (op, args, dtype)
        at = self._index.get(key)
        if at is None:
            at = self._index[key] = len(self.nodes)
            self.nodes.append(key)
        return Traced(self, at, sample, dtype)

    def input(self, k: int, sample) -> Traced:
        return self.node("in", (k,), sample)

    def operand(self, value) -> int:
        """A node number for a Traced value; a new constant slot `~k` for a number."""
        if type(value) is Traced:
            if value.rec is not self:
                raise Untraceable("a value of another trace")
            return value.at
        if type(value) in _REAL_NUMBERS:  # (the usual constants, without the checks below)
            self.consts.append(float(value))
            return ~(len(self.consts) - 1)
        if _is_complex(value):
            raise Untraceable("a complex constant")
        try:
            number = float(value)
        except (TypeError, ValueError):  # not a number
            raise Untraceable(f"a constant {value!r} that is not a real number") from None
        self.consts.append(number)
        return ~(len(self.consts) - 1)

    def program(self, outputs) -> Program:
        return Program(tuple(self.nodes), tuple(outputs))


class Traced:
    """An array of the step being traced: node `at` of `rec`; `sample`, a one-element array of
    the real library with this node's dtype, answers what dtype an operation gives."""

    __slots__ = ("rec", "at", "sample", "dtype")
    __array_ufunc__ = None  # NumPy scalars defer to our reflected operators

    def __init__(self, rec: Recorder, at: int, sample, dtype):
        self.rec, self.at, self.sample, self.dtype = rec, at, sample, dtype

    shape = property(lambda self: (self.rec.n,))
    ndim = property(lambda self: 1)
    size = property(lambda self: self.rec.n)
    device = property(lambda self: getattr(self.sample, "device", None))

    def __bool__(self):
        raise Untraceable("an array's values read as a Python bool")

    def __float__(self):
        raise Untraceable("an array's values read as a Python number")

    __int__ = __index__ = __float__

    def __len__(self):
        return self.rec.n

    def __neg__(self):
        return _op("neg", operator.neg, self)

    def __abs__(self):
        return _op("abs", abs, self)

    def __pow__(self, exponent):
        if isinstance(exponent, Traced):
            return _op("pow", operator.pow, self, exponent)
        try:  # a fixed exponent is part of the code: libraries take x**2 as x*x, x**0.5 as √x
            value = float(exponent)
        except (TypeError, ValueError):
            raise Untraceable(f"an exponent {exponent!r} that is not a real number") from None
        sample = _result(("pow", value, _key(self.sample), _key(exponent)), lambda: self.sample**exponent)
        return self.rec.node(f"pow {value!r}", (self.at,), sample)


def _rpow(self, base):
    return _op("pow", operator.pow, base, self)


Traced.__rpow__ = _rpow


def _binary(name, fn):
    def forward(self, other):
        return _op(name, fn, self, other)

    def reflected(self, other):
        return _op(name, fn, other, self)

    return forward, reflected


for _name, _fn in [("add", operator.add), ("sub", operator.sub), ("mul", operator.mul),
                   ("truediv", operator.truediv)]:
    _forward, _reflected = _binary(_name, _fn)
    setattr(Traced, f"__{_name}__", _forward)
    setattr(Traced, f"__r{_name}__", _reflected)
for _name, _fn in [("lt", operator.lt), ("le", operator.le), ("gt", operator.gt), ("ge", operator.ge),
                   ("eq", operator.eq), ("ne", operator.ne), ("and", operator.and_), ("or", operator.or_)]:
    setattr(Traced, f"__{_name}__", _binary(_name, _fn)[0])
Traced.__hash__ = object.__hash__  # (`==` records a node)


# --- dtypes: what the real library gives, asked once of one-element arrays --------------------

_RESULTS: dict = {}  # (op, operand kinds) -> a one-element array of the result's dtype


def _key(value):
    """What decides an operand's part in a result's dtype: an array's dtype; a number's type (a
    Python float is weak in NumPy 2 and torch, a NumPy float32 is not); a 0-d array's dtype."""
    if type(value) is Traced:
        return value.dtype
    return (type(value), getattr(value, "dtype", None))


def _sample(value):
    return value.sample if isinstance(value, Traced) else value


def _result(key, compute):
    found = _RESULTS.get(key)
    if found is None:
        found = _RESULTS[key] = compute()
    return found


def _op(name, fn, *operands):
    """Record `fn(*operands)` as node `name`: its dtype is what `fn` gives the samples."""
    rec = next(v.rec for v in operands if type(v) is Traced)
    key = (name, *map(_key, operands))
    sample = _RESULTS.get(key)
    if sample is None:
        sample = fn(*map(_sample, operands))
        if getattr(sample, "dtype", None) is None or getattr(sample, "ndim", 0) != 1:
            raise Untraceable(f"{name} gave {sample!r}, not an array")
        _RESULTS[key] = sample
    return rec.node(name, tuple(map(rec.operand, operands)), sample)


def _real(x):
    return dispatch.backend(x.sample)


# --- the backend functions that rules reach through `ops` --------------------------------------


def is_traced(x):
    return False  # (its scalars are real: rules compute them eagerly)


def scalar(value, like):
    return _real(like).scalar(value, like.sample)


def epsilon(value, like):
    return _real(like).epsilon(value, like.sample)


def sqrt(x):
    return _op("sqrt", _real(x).sqrt, x)


def abs(x):  # noqa: A001 - mirrors the array-API name
    return _op("abs", _real(x).abs, x)


def abs2(x):
    if _is_complex(x.sample):
        raise Untraceable("|x|² of a complex array")
    return x * x


def sign(x):
    return _op("sign", _real(x).sign, x)


def maximum(x, y):
    return _op("maximum", _real(x).maximum, x, y)


def minimum(x, y):
    return _op("minimum", _real(x).minimum, x, y)


def clip(x, low, high):
    return minimum(maximum(x, low), high)


def where(condition, x, y):
    real = next(v for v in (x, y, condition) if isinstance(v, Traced))
    return _op("where", _real(real).where, condition, x, y)


def cast(x, dtype):
    sample = _result(("cast", x.dtype, dtype), lambda: _real(x).cast(x.sample, dtype))
    return x.rec.node("cast", (x.at,), sample)


def astype(x, like):
    if not isinstance(x, Traced):
        raise Untraceable("an array made from a number")
    sample = _result(("astype", x.dtype, like.dtype), lambda: _real(like).astype(x.sample, like.sample))
    return x if sample.dtype == x.dtype else x.rec.node("cast", (x.at,), sample)


def copy(x):
    return x  # (a traced value is never written in place)


def full_like(x, value):
    return _op("full", lambda s, v: _real(x).full_like(s, v), x, value)


def zeros_like(x):
    return full_like(x, 0)


def isfinite(x):
    return None  # (as for a traced JAX value: cannot be read)


def same_values(x, y):
    return None


def dtype_epsilon(x):
    return _real(x).dtype_epsilon(x.sample)


def cond(predicate, if_true, if_false):
    raise Untraceable("a branch on an array's value")


dispatch.register_type(Traced, __name__)


class NotElementwise(Untraceable, AttributeError):
    """An operation this backend lacks: still an AttributeError to `getattr` and `hasattr`."""


def __getattr__(name: str):
    """Any other array operation (a norm, a reshape, a matrix product) cannot be traced."""
    raise NotElementwise(f"ops.{name}, which is not elementwise")
