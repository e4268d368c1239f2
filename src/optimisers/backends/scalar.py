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


abs, maximum, minimum = builtins.abs, builtins.max, builtins.min  # noqa: A001


def abs2(x):
    return builtins.abs(x) ** 2


def sign(x):
    return (x > 0) - (x < 0)


def clip(x, low, high):
    return builtins.min(builtins.max(x, low), high)


def where(condition, x, y):
    return x if condition else y


def isfinite(x):
    return math.isfinite(builtins.abs(x))


def cond(predicate, if_true, if_false):
    return if_true() if predicate else if_false()


def is_traced(x):  # (NumPy's and torch's values are never traced either)
    return False


def scalar(value, like):
    return type(like)(value)


def epsilon(value, like):
    return float(value)


# --- what schedules ask (a step that is a Python int) -----------------------------------------


def is_integer(x):
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


as_integer, as_real = int, float


def real_scalar(value, like):
    return float(value)


real_where = where
cos = math.cos
