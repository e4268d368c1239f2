"""Many small parameters of one rule that stacks and of one shape, stepped as one stack.

A rule that looks across a whole array (Muon's matrix products, LAMB's and LARS's norms,
Adafactor's RMS) cannot be cut into chunks as an elementwise one can, so each parameter is its
own call, and for a model of thousands of small arrays (per-head or per-expert weights) the
calls cost far more than the arithmetic. A rule that sets `stacks = True` also has
`apply_stacked(state, x, dx)`: `apply` for arrays with a leading axis of parameters, giving each
parameter the numbers its own `apply` gives it (on NumPy bit for bit; torch's batched matrix
product may round otherwise than its single one). Here such parameters are stacked, stepped in
one call, and each Leaf gets views of the stacked new state and step.

Only on eager backends: under `jit` (JAX) XLA compiles each slice taken out of a stack about as
slowly as a whole step of that parameter. Only small parameters, in stacks of bounded size: a
big matrix gains nothing from sharing a call, and a stack is a copy of what it holds.
"""

from __future__ import annotations

from optimisers import ops
from optimisers.core.rule import NewValue
from optimisers.core.state import flatten_state, scalar_key, unflatten_state
from optimisers.engine import compiled, precision

STACK_BELOW = 1 << 16  # elements: larger parameters step alone
# elements in one stack at most: a stack is a copy and its temporaries (~10 stacks for Newton–Schulz)
# live at once, so small stacks keep a step near the memory of parameters stepped one by one (and
# in cache): on 4000 vectors of 256, NumPy LAMB held 9.7x the parameters' bytes at 1M, 4.2x here
STACK_ELEMENTS = 1 << 16


def stacked_results(found, skip) -> dict:
    """`{id(leaf): (new_state, step)}` for the Leafs of `found` (not in `skip`) that step in
    stacks of two or more. A stack whose `apply_stacked` raises is left out: its Leafs step one
    by one, which reports the error where it happens."""
    stacks: dict = {}
    for key, c in found.items():
        rule = c.leaf.rule
        if key in skip or c.leaf.frozen or not c.grads or not rule.stacks:
            continue
        b = ops.backend(c.x)
        if not (b.IN_PLACE_ENGINE and b.engine_ok(c.x) and b.numel(c.x) < STACK_BELOW):
            continue
        parts: list = []
        spec = flatten_state(c.leaf.state, parts)
        array_at = tuple(map(b.is_buffer, parts))
        # state arrays of any shape (Adafactor's row and column factors), one shape per place
        shapes = tuple(tuple(p.shape) for p, a in zip(parts, array_at) if a)
        if compiled.takes(b, rule, b.numel(c.x)) and all(s == tuple(c.x.shape) for s in shapes):
            continue  # (its kernel: the numbers of the engine's, which the eager stack may miss)
        scalars = tuple(scalar_key(p) for p, a in zip(parts, array_at) if not a)
        where = (b, tuple(c.x.shape), c.x.dtype, getattr(c.x, "device", None))
        kind = (id(rule), *where, spec, array_at, shapes, scalars)
        stacks.setdefault(kind, (b.numel(c.x), spec, array_at, []))[3].append((c, parts))
    results: dict = {}
    for size, spec, array_at, members in stacks.values():
        per_stack = max(2, STACK_ELEMENTS // size)
        for lo in range(0, len(members), per_stack):
            part = members[lo : lo + per_stack]
            if len(part) >= 2:
                results.update(_step_stack(part, spec=spec, array_at=array_at))
    return results


def _step_stack(members, spec, array_at) -> dict:
    """Step `members` (`(Contribution, its state's parts)` of one rule, shape, dtype and state
    layout `spec`, `array_at`) as one stack."""
    rule, b = members[0][0].leaf.rule, ops.backend(members[0][0].x)
    try:
        dxs = [c.dx() for c, _ in members]
        first = members[0][1]
        stacked = [
            ops.stack([parts[i] for _, parts in members]) if a else first[i] for i, a in enumerate(array_at)
        ]
        with b.no_grad():
            new_state, step = precision.run(
                rule.apply_stacked,
                unflatten_state(spec, iter(stacked)),
                ops.stack([c.x for c, _ in members]),
                ops.stack(dxs),
            )
    except Exception:  # noqa: BLE001 - one by one, the per-Leaf path reports it where it is
        return {}
    new_parts: list = []
    new_spec = flatten_state(new_state, new_parts)
    value = step.value if isinstance(step, NewValue) else step
    # each member's views, split off in one call per array
    columns = [list(p) if b.is_buffer(p) else [p] * len(members) for p in new_parts]
    steps = [None] * len(members) if value is None else list(value)
    if isinstance(step, NewValue):
        steps = [NewValue(v) for v in steps]
    return {
        id(c.leaf): (unflatten_state(new_spec, iter(own)), own_step)
        for (c, _), own_step, own in zip(members, steps, zip(*columns))
    }
