"""Plain Python numbers: the scalar maths of rules on backends (PyTorch) whose kernels take Python
scalars without promoting the array's dtype, and the arithmetic of schedules called with a Python
int step."""

from __future__ import annotations

import builtins
import cmath
import math
import numbers


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


# --- what schedules ask (a step that is a Python int) -----------------------------------------


def is_integer(x):
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def as_integer(x):
    return int(x)


def as_real(x):
    return float(x)


def real_scalar(value, like):
    return float(value)


def real_where(condition, x, y):
    return x if condition else y


cos = math.cos
