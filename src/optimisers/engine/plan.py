"""The plan of `update_`: which Leafs step together in engine groups, kept between steps and
checked against each step's gradients, and the step of every group once all of them are ready.
"""

from __future__ import annotations

import weakref

from optimisers import ops
from optimisers.core.state import flatten_state
from optimisers.engine.group import Group, eligible

# State -> its plan: the engine's side table (a State copied, pickled or rebuilt by JAX has none)
PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _as_initialised(leaf, x, parts=None) -> bool:
    """Are the state's arrays in the dtypes and on the device that `rule.init` gives this
    parameter now? Not after a parameter was converted (a torch module's `.double()`): the rule's
    maths would then promote the state, which the group's buffers, kept in their old dtype, would
    round back; the per-Leaf path promotes it, and the next plan groups it again."""
    if parts is None:
        parts = []
        flatten_state(leaf.state, parts)
    b = ops.backend(x)
    with b.no_grad():
        fresh: list = []
        flatten_state(leaf.rule.init(x.reshape(-1)[:1]), fresh)  # a one-element probe: cheap
    if len(fresh) != len(parts):
        return False
    return all(
        p.dtype == getattr(q, "dtype", None) and getattr(p, "device", None) == getattr(q, "device", None)
        for p, q in zip(parts, fresh)
        if b.is_buffer(p)
    )


class Plan:
    """The groups of one State; rebuilt when a member leaves its group, changes rule, or a new
    candidate Leaf appears."""

    def __init__(self, entries):
        self.considered = {id(leaf) for leaf, _ in entries}
        self.converted: list = []  # left out until the per-Leaf path has promoted their state
        by_key: dict = {}
        for leaf, x in entries:
            b = ops.backend(x)
            parts: list = []
            spec = flatten_state(leaf.state, parts)
            if not all(p.shape == x.shape for p in parts if b.is_buffer(p)):
                continue
            if not _as_initialised(leaf, x, parts):
                self.converted.append(leaf)
                continue
            scalars = tuple(None if b.is_buffer(p) else p for p in parts)
            key = (id(leaf.rule), b, x.dtype, getattr(x, "device", None), repr(spec), scalars)
            try:
                by_key.setdefault(key, []).append((leaf, x))
            except TypeError:  # scalar state that cannot be a key: not grouped
                continue
        self.groups = [Group([m[0] for m in ms], [m[1] for m in ms]) for ms in by_key.values()]
        self.route = None  # where its members sit in the model (`optimisers.engine.replay`)

    def outgrown(self, found) -> bool:
        """Has a Leaf left out for its converted parameter been brought up to date since?"""
        for leaf in self.converted:
            c = found.get(id(leaf))
            if c is not None and _ready(c) and _as_initialised(leaf, c.x):
                return True
        return False


def _ready(c) -> bool:
    return bool(c.grads) and not c.copies and eligible(c.leaf, c.x)


def select(state, found):
    """The groups of `state` that can step as a whole now, as `[(group, contributions)]`.

    `found` maps `id(leaf)` to the update's gathered contributions (`leaf`, `x`, `grads`,
    `copies`, `dx()`). Plans (or re-plans) the State's groups when needed.
    """
    plan = PLANS.get(state)
    if (
        plan is None
        or not all(group.intact() for group in plan.groups)
        or plan.considered - found.keys()  # a planned Leaf left the tree (tied by hand?)
        or plan.outgrown(found)
        or any(_ready(found[k]) for k in found.keys() - plan.considered)
    ):
        ready = [c for c in found.values() if _ready(c)]
        if not ready:
            return []
        plan = PLANS[state] = Plan([(c.leaf, c.x) for c in ready])
    work = [(group, _ready_members(group, found)) for group in plan.groups]
    return [(group, members) for group, members in work if members is not None]


def _ready_members(group, found):
    """Every member's contribution to this update, or None if some member cannot step in
    the group now (no gradient, frozen, reshaped, converted (a torch module's `.double()` or
    `.to(device)` swaps its parameters' data in place), not writable in place). Each
    parameter is checked as it is (the full check: a later step checks it against `token`)."""
    members = []
    for leaf in group.leaves:
        c = found.get(id(leaf))
        if c is None or not c.grads or c.copies or leaf.frozen:
            return None
        members.append(c)
    xs = [c.x for c in members]
    if not _as_planned(group, xs):
        return None
    if group.span is not None and not group.span.holds(xs):
        group.broken = True  # (a parameter moved out of the buffer: it steps on its own)
        return None
    return members


def _as_planned(group, xs) -> bool:
    """Is each parameter still as planned: its shape, dtype, device and memory order, and
    fit for the engine (a `.data` swap or `.to()` may have changed any of them)?"""
    b, dtype, device = group.b, group.dtype, group.device
    for x, shape, order in zip(xs, group.shapes, group.orders):
        if x.shape != shape or x.dtype != dtype or not b.engine_ok(x) or b.memory_order(x) != order:
            return False
        if device is not None and x.device != device:
            return False
    return True
