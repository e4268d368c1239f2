"""Where an engine group's state lives: the members' state arrays as flat 1-D buffers (a large
parameter's own arrays raveled, one buffer per state position for each run of small parameters
packed together), each member's state a view into them, and the chunks that cover the buffers.
Made once when a group is planned; `optimisers.engine.execute` chooses how it steps. Any dense
layout works (channels_last, transposed): every array of a member is read in the memory order of
its parameter (the backend's `memory_order`), so chunks are views of the parameter's memory.
"""

from __future__ import annotations

import os
import weakref

import numpy as np

from optimisers import ops
from optimisers.core.state import flatten_state, register_held_states, unflatten_state
from optimisers.engine import chunks
from optimisers.engine.span import Span, state_buffers


class _Held:
    """Which group's buffers hold a Leaf's state (`Leaf.state` reads it whole from there): by
    `id(leaf)`, a weak reference to the group, one shared by its members (a few bytes per Leaf,
    for models of thousands of small arrays). When the group goes (its State dropped, or planned
    anew), each member it still holds gets its state back whole: views of the buffers and the
    group's last scalars. (A member lives at least as long as its group, which holds it.)"""

    def __init__(self):
        self.refs: dict[int, weakref.ref] = {}

    def __bool__(self) -> bool:
        return bool(self.refs)

    def get(self, leaf):
        ref = self.refs.get(id(leaf))
        return None if ref is None else ref()

    def pop(self, leaf, default=None) -> None:
        self.refs.pop(id(leaf), default)

    def hold(self, group) -> None:
        ref = weakref.ref(group)
        for leaf in group.leaves:
            self.refs[id(leaf)] = ref
        kept = (group.leaves, group.spec, group.array_at, group.scalars)  # (not the group itself)
        done = weakref.finalize(group, self._let_go, ref, *kept)
        done.atexit = False  # (at exit nobody reads the states)

    def _let_go(self, ref, leaves, spec, array_at, scalars) -> None:
        for leaf in leaves:
            if self.refs.get(id(leaf)) is ref:
                del self.refs[id(leaf)]
                leaf._state = _whole(leaf._state, spec, array_at, scalars)


def _whole(state, spec, array_at, scalars):
    """A held state (views of a group's buffers) with the group's `scalars` in it."""
    merged = [s if not a else p for a, s, p in zip(array_at, scalars, _parts(state))]
    return unflatten_state(spec, iter(merged))


def _parts(state) -> list:
    parts: list = []
    flatten_state(state, parts)
    return parts


HELD = _Held()
register_held_states(HELD)
holder = HELD.get  # the group that holds a Leaf's state, or None


def independent(leaf, state):
    """`state` with every part that is a view of the engine's buffers for `leaf` replaced by a
    copy, so that a pure result never changes when the original is later stepped in place."""
    group = holder(leaf)
    if group is None:
        return state
    views = {id(p) for p, a in zip(_parts(leaf._state), group.array_at) if a}
    parts: list = []
    spec = flatten_state(state, parts)
    return unflatten_state(spec, iter([ops.copy(p) if id(p) in views else p for p in parts]))


class GroupLayout:
    """The buffers and chunks of one group of Leafs (one rule, dtype, device, scalar state)."""

    def __init__(self, leaves, xs):
        self.b = b = ops.backend(xs[0])
        b.engine_start()
        sizes = [b.numel(x) for x in xs]
        self.scaled = chunks.scaled(leaves[0].rule)  # a factor per member: see `factors`
        total = sum(sizes)
        many = total >= chunks.THREADS_FROM // chunks.CHUNK_SCALE
        self.threads = b.ENGINE_THREADS and many and (os.cpu_count() or 1) > 1
        self.chunk = chunks.chunk_size(b, total, self.threads)
        # small parameters last, so that they pack into a few long runs however the model
        # interleaves them with large ones (a bias after each weight matrix)
        order = sorted(range(len(xs)), key=lambda i: sizes[i] < self.chunk // 4)
        # parameters that are views of one flat buffer, back to back (`optimisers.torch.flatten_`,
        # or a model built over one array): the chunks step that buffer itself, in address order
        self.span = None
        if not self.scaled and len(xs) > 1:
            where = b.addresses(xs)
            by_address = sorted(range(len(xs)), key=where.__getitem__)
            self.span = Span.of(b, [xs[i] for i in by_address])
            if self.span is not None:
                order = by_address
        leaves, xs, self.sizes = [leaves[i] for i in order], [xs[i] for i in order], [sizes[i] for i in order]
        self.leaves = leaves  # their rule is read from the first at each step: adjust_ may change it
        self.dtype, self.device = xs[0].dtype, getattr(xs[0], "device", None)
        self.shapes = [x.shape for x in xs]
        self.orders = [b.memory_order(x) for x in xs]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(int).tolist()
        per_leaf = [[] for _ in leaves]  # (only these lists hold the old arrays: see _take_state)
        for leaf, parts in zip(leaves, per_leaf):
            self.spec = flatten_state(leaf.state, parts)
        del parts
        self.array_at = [b.is_buffer(p) for p in per_leaf[0]]
        self.scalars = [None if a else p for a, p in zip(self.array_at, per_leaf[0])]
        self.chunks = chunks.plan(self.sizes, self.offsets, self.chunk, self.span is not None)
        runs = [c for c in self.chunks if c[0] == "run"]
        # the packed members (the smallest, sorted last; in a span, all): one flat range of
        # every buffer
        self.packed_from = 0 if self.span is not None else runs[0][1] if runs else len(leaves)
        self.buffers = _take_state(self, leaves, per_leaf, xs)
        HELD.hold(self)
        self.has_runs = bool(runs)  # (a span has none: its chunks step the span itself)
        self._member_parts: dict[int, list] = {}

    def state_of(self, leaf):
        """A held member's state with the group's current scalars."""
        return _whole(leaf._state, self.spec, self.array_at, self.scalars)

    def staging(self, like):
        """`(flat_x, flat_g)`: new buffers for the packed members' parameters and gradients,
        joined, which their runs' chunks read and step. Made for one step: kept, they would hold
        twice the packed parameters' bytes between steps. `like`: a parameter of the group."""
        n = self.offsets[-1] - self.offsets[self.packed_from]
        return self.b.empty_flat(n, like), self.b.empty_flat(n, like)

    def member_parts(self, k):
        """Part `k` of every member's state: for an array part, each member's view of buffer `k`
        (made once; the views stay valid while the group is intact)."""
        if k not in self._member_parts:
            self._member_parts[k] = [_parts(leaf._state)[k] for leaf in self.leaves]
        return self._member_parts[k]


def _take_state(layout, leaves, per_leaf, xs):
    """The members' state arrays in the form the chunks read, for each array part a dict
    from a big member or a packed run (by its first member) to a 1-D array (a packed run's:
    its range of one buffer that holds every packed member), and each member's state made
    views of them. A big member whose arrays are its own (`Leaf._owns`: made by
    setup, a copy or a load) keeps them (raveled views, no copy: a copy of the whole state at
    once was the first step's peak); a run's small members are copied into one buffer, a run
    at a time, and their old arrays are let go before the next run is copied. Arrays that
    another State may share, or that are not contiguous, not writable, or share memory with
    another member's state or a parameter, are copied (steps write the buffers in place)."""
    b, array_at = layout.b, layout.array_at
    buffers = [{} if a else None for a in array_at]
    seen = set(b.memory_owners(xs))
    mine = [leaf._owns or holder(leaf) is not None for leaf in leaves]  # (engine buffers already)
    # a span whose members' own state arrays already fill one flat buffer each: kept, no copy
    spans = all(mine) and layout.span is not None
    packed = state_buffers(b, per_leaf, array_at, layout.shapes, layout.dtype, seen) if spans else None
    if packed is not None:
        layout.packed = packed  # (each member's state is already views of the buffers)
        return [None if p is None else {0: p} for p in packed]
    runs = chunks.member_runs(layout.offsets, layout.chunk) if layout.span is not None else layout.chunks
    for chunk in runs:
        i = chunk[1]
        if chunk[0] == "big":
            if per_leaf[i] is None:  # taken at its first chunk
                continue
            order = layout.orders[i]
            flats = [
                _own(layout, p, seen, mine[i], order) if a else None for p, a in zip(per_leaf[i], array_at)
            ]
            members = [i]
        else:
            j = chunk[2]
            members = list(range(i, j))
            if packed is None:  # one buffer per array part for all packed members
                n = layout.offsets[-1] - layout.offsets[layout.packed_from]
                packed = [b.zeros((n,), p) if a else None for p, a in zip(per_leaf[i], array_at)]
            lo = layout.offsets[i] - layout.offsets[layout.packed_from]
            hi = lo + layout.offsets[j] - layout.offsets[i]
            flats = [p[lo:hi] if a else None for p, a in zip(packed, array_at)]
            for k, flat in enumerate(flats):
                if flat is not None:  # a run at a time: its old arrays go before the next's are read
                    b.join_into(flat, [per_leaf[m][k] for m in members], layout.orders[i:j])
        for k, flat in enumerate(flats):
            if flat is not None:
                buffers[k][i] = flat
        for m in members:
            lo, hi = layout.offsets[m] - layout.offsets[i], layout.offsets[m + 1] - layout.offsets[i]
            parts = [
                b.shaped_in(f[lo:hi], layout.shapes[m], layout.orders[m]) if a else p
                for a, f, p in zip(array_at, flats, per_leaf[m])
            ]
            per_leaf[m] = None  # the old arrays go as soon as the member holds the new ones
            leaves[m]._state = unflatten_state(layout.spec, iter(parts))
    layout.packed = packed  # the packed members' buffers, whole (None: no packed members)
    if layout.span is not None:  # the flat chunks read the whole packed buffers
        buffers = [None if p is None else {0: p} for p in packed]
    return buffers


def _own(layout, p, seen, mine, order):
    """`p` raveled in its parameter's memory order `order`: a view of it where the step may
    write it in place (it is laid out as the parameter), else a copy."""
    b = layout.b
    owner = b.memory_owners([p])[0]
    keep = mine and owner not in seen and b.engine_ok(p) and b.memory_order(p) == order
    seen.add(owner)
    return b.flat_in(p, order) if keep else b.concat([b.flat_in(p, order)])
