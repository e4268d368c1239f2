"""float16 and bfloat16 parameters: a rule's maths runs in float32, as torch's fused kernels do.

Adam's second moment of a float16 gradient underflows (|g|² · (1 − β₂) of a gradient of 1e-3 is
1e-9, below float16's smallest number), and its step then divides by ε alone: elements moved by
tens in one step. So the update widens the parameter, its gradient and the state arrays of the
parameter's dtype to float32, runs the rule, and stores the new state back in the dtypes it had:
the optimiser state stays in the parameter's dtype (as torch.optim keeps `exp_avg` for a float16
parameter), so memory and checkpoints are those of the parameter's dtype. The step stays float32,
so the parameter is rounded once, when the step is subtracted (`MixedPrecision` keeps a float32
master copy and float32 state for those who want the parameter's rounding out of the maths).
"""

from __future__ import annotations

import numpy as np

from optimisers import ops
from optimisers.core.state import flatten_state, unflatten_state

_NARROW = frozenset({"float16", "bfloat16"})


def narrow(x) -> bool:
    """Is `x` an array of float16 or bfloat16 (any backend: torch.float16, NumPy, ml_dtypes)?"""
    dtype = getattr(x, "dtype", None)  # (None: not an array, str(None) names no dtype)
    try:
        return _NARROW_DTYPES[dtype]
    except KeyError:
        found = _NARROW_DTYPES[dtype] = str(dtype).rpartition(".")[2] in _NARROW
        return found
    except TypeError:  # an unhashable dtype
        return str(dtype).rpartition(".")[2] in _NARROW


_NARROW_DTYPES: dict = {}  # dtype -> narrow? (a dtype's name is slow to make: asked every chunk)


def widened(x):
    """A float32 copy of a float16/bfloat16 array; anything else as it is."""
    return ops.cast(x, np.float32) if narrow(x) else x


def direction(rule, state, x, dx):
    """`rule.direction(state, x, dx)` (a scaled step's, `Rule.step_factors`), in float32 for a
    float16/bfloat16 `x`, as `run` computes the step."""
    if not narrow(x):
        return rule.direction(state, x, dx)
    return rule.direction(_widened_state(state), widened(x), widened(dx))


def _widened_state(state):
    parts: list = []
    spec = flatten_state(state, parts)
    return unflatten_state(spec, iter([widened(p) for p in parts]))


def run(method, state, x, dx, *extra):
    """`method(state, x, dx, *extra)`, a rule's `apply` (or `apply_scaled`), in float32 for a
    float16/bfloat16 `x`: the new state's arrays go back to the dtypes the old ones had."""
    if not narrow(x):
        return method(state, x, dx, *extra)
    parts: list = []
    spec = flatten_state(state, parts)
    wide = unflatten_state(spec, iter([widened(p) for p in parts]))
    new_state, step = method(wide, widened(x), widened(dx), *extra)
    new_parts: list = []
    if flatten_state(new_state, new_parts) != spec:
        return new_state, step  # a rule that reshapes its state: it chose its dtypes itself
    restored = [
        ops.astype(new, old) if narrow(old) and getattr(new, "dtype", None) != old.dtype else new
        for new, old in zip(new_parts, parts)
    ]
    return unflatten_state(spec, iter(restored)), step
