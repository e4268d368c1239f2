"""The pure update of one large parameter, chunk by chunk (`update` of an elementwise rule), and
the copy of a grouped Leaf's state that leaves the engine's buffers behind.
"""

from __future__ import annotations

from optimisers import ops
from optimisers.core.rule import NewValue
from optimisers.core.state import flatten_state, unflatten_state
from optimisers.engine import layout, precision
from optimisers.engine.layout import scales_gradient


def independent(leaf, state):
    """`state` with every part that is a view of the engine's buffers for `leaf` replaced by a
    copy, so that a pure result never changes when the original is later stepped in place."""
    if leaf._group is None:
        return state
    own: list = []
    flatten_state(leaf._state, own)
    views = {id(p) for p, a in zip(own, leaf._group.array_at) if a}
    parts: list = []
    spec = flatten_state(state, parts)
    return unflatten_state(spec, iter([ops.copy(p) if id(p) in views else p for p in parts]))


def pure_step(rule, state, x, dx):
    """The pure update of one parameter, chunk by chunk: `(new_state, new_x)`, or None where
    that does not apply (a rule that is not elementwise, a backend without the engine, a
    parameter of at most one chunk, state arrays not shaped like it). The new state and parameter
    are allocated once and filled chunk by chunk, so the step and the rule's temporaries never
    exist at full size; the numbers are those of `rule.apply` on the whole arrays."""
    scaled = scales_gradient(rule)
    if not (rule.elementwise or scaled):
        return None
    b = ops.backend(x)
    if not (b.IN_PLACE_ENGINE and b.engine_ok(x)):
        return None
    n, chunk = b.numel(x), max(4, b.ENGINE_CHUNK // layout.CHUNK_SCALE)
    parts: list = []
    spec = flatten_state(state, parts)
    array_at = [b.is_buffer(p) for p in parts]
    if n <= chunk or not all(p.shape == x.shape and b.engine_ok(p) for p, a in zip(parts, array_at) if a):
        return None
    factor = rule.gradient_factors([precision.widened(dx)])[0] if scaled else None
    order = b.memory_order(x)  # every array is read in the parameter's memory order
    flat_x, flat_dx = b.flat_in(x, order), b.flat_in(dx, order)
    flat_parts = [b.flat_in(p, order) if a else p for p, a in zip(parts, array_at)]
    new_x = ops.copy(x)
    if b.memory_order(new_x) != order:
        return None  # a copy in another layout: its flat view would not be a view
    flat_new_x = b.flat_in(new_x, order)
    outs = [ops.zeros_like(p) if a else None for p, a in zip(flat_parts, array_at)]
    scalars = None
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        sub = [p[lo:hi] if a else p for p, a in zip(flat_parts, array_at)]
        chunk_state = unflatten_state(spec, iter(sub))
        if factor is None:
            new_state, step = precision.run(rule.apply, chunk_state, flat_x[lo:hi], flat_dx[lo:hi])
        else:
            new_state, step = precision.run(
                rule.apply_scaled, chunk_state, flat_x[lo:hi], flat_dx[lo:hi], factor
            )
        new_parts: list = []
        if flatten_state(new_state, new_parts) != spec:
            return None  # (before anything is returned: the caller takes the whole-array path)
        for k, a in enumerate(array_at):
            if a:
                if new_parts[k].dtype != outs[k].dtype:
                    return None  # the rule changes the state's dtype: whole arrays, as it wants
                b.copy_into(outs[k][lo:hi], new_parts[k])
        if scalars is None:
            scalars = [None if a else p for a, p in zip(array_at, new_parts)]
        value = step.value if isinstance(step, NewValue) else step
        if value is not None and ops.is_complex(value) and not ops.is_complex(x):
            return None  # a step that cannot be written: the whole-array path reports it
        if isinstance(step, NewValue):
            b.assign_(flat_new_x[lo:hi], step.value)
        elif step is not None:
            b.subtract_(flat_new_x[lo:hi], step)
    merged = [b.shaped_in(o, x.shape, order) if a else s for a, o, s in zip(array_at, outs, scalars)]
    return unflatten_state(spec, iter(merged)), new_x
