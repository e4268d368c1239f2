"""Plain Python numbers: the scalar maths of rules on backends (PyTorch) whose kernels take Python
scalars without promoting the array's dtype."""

from __future__ import annotations

import builtins
import cmath
import math


def sqrt(x):
    return cmath.sqrt(x) if isinstance(x, complex) else math.sqrt(x)


def abs(x):  # noqa: A001
    return builtins.abs(x)


def abs2(x):
    return builtins.abs(x) ** 2


def sign(x):
    return (x > 0) - (x < 0)


def maximum(x, y):
    return builtins.max(x, y)


def minimum(x, y):
    return builtins.min(x, y)


def clip(x, low, high):
    return builtins.min(builtins.max(x, low), high)


def where(condition, x, y):
    return x if condition else y


def isfinite(x):
    return math.isfinite(builtins.abs(x))


def cond(predicate, if_true, if_false):
    return if_true() if predicate else if_false()


def scalar(value, like):
    return type(like)(value)


def epsilon(value, like):
    return float(value)
