"""The results of Leafs stepped outside engine groups: each checked to fit its parameter before
anything is written, errors located, and scalar state shared where a pytree backend wants it.
"""

from __future__ import annotations

from optimisers import ops
from optimisers.core.rule import NewValue
from optimisers.core.state import (
    flatten_state,
    is_scalar,
    path_of,
    scalar_key,
    unflatten_state,
)
from optimisers.core.tree import format_path


def located(e, tree) -> Exception:
    """A gradient error from the compute phase, saying where (nothing was written yet)."""
    where = format_path(path_of(tree, e.leaf)) if getattr(e, "leaf", None) is not None else "?"
    return ops.GradientError(f"gradient at {where}: {e}; nothing was changed")


def check_step(rule, result, x) -> None:
    """A rule's step must fit its parameter (its shape, or a scalar; no complex step for a real
    parameter), or writing it in place would fail after other parameters were written."""
    if not isinstance(result, tuple) or len(result) != 2:
        raise TypeError(f"{type(rule).__name__}.apply must return (state, step), got {result!r:.80}")
    value = check_step_shape(rule, result[1], x)
    if getattr(value, "dtype", None) != x.dtype and ops.is_complex(value) and not ops.is_complex(x):
        raise TypeError(
            f"{type(rule).__name__}.apply returned a complex step for a real parameter "
            f"(dtype {x.dtype}); was the state set up for a complex parameter?"
        )


def check_step_shape(rule, step, x):
    """The array of `step` (a `NewValue`'s value), refused unless it is None, a scalar or shaped
    as the parameter `x`."""
    value = step.value if isinstance(step, NewValue) else step
    shape = getattr(value, "shape", ())
    if value is not None and tuple(shape) not in ((), tuple(x.shape)):
        raise ValueError(
            f"{type(rule).__name__}.apply returned a step of shape {tuple(shape)} for a parameter of "
            f"shape {tuple(x.shape)}"
        )
    return value


def new_value(x, step):
    """The parameter after `step`, as a new array."""
    if step is None:
        return ops.copy(x)
    if isinstance(step, NewValue):
        return ops.backend(x).replaced(x, step.value)
    return ops.backend(x).subtract(x, step)


def share_scalar_state(found, results) -> None:
    """Give Leafs of one elementwise rule that began this step with the same scalar state (step
    counters, say: the same objects, or equal Python numbers) the same new objects, on backends
    that ask for it (JAX).

    An elementwise rule's scalar state cannot depend on array values (the engine's chunks rely on
    that as well), so those values are equal anyway. Sharing the objects lets a State's pytree
    store them once, and under `jit` thousands of per-Leaf scalar computations (t + 1, 1 - β^t)
    become one, which shortens both compiling and the step (`benchmarks/jax_state.py`)."""
    first: dict = {}
    for key, (new_state, step) in results.items():
        c = found[key]
        if not (c.leaf.rule.elementwise and ops.backend(c.x).SHARE_SCALAR_STATE):
            continue
        old: list = []
        flatten_state(c.leaf.state, old)
        new: list = []
        spec = flatten_state(new_state, new)
        scalar_at = tuple(i for i, p in enumerate(new) if is_scalar(p))
        if not scalar_at:
            continue
        origin = (id(c.leaf.rule), spec, scalar_at, tuple(scalar_key(p) for p in old if is_scalar(p)))
        shared = first.setdefault(origin, new)
        if shared is not new:
            for i in scalar_at:
                new[i] = shared[i]
            results[key] = (unflatten_state(spec, iter(new)), step)
