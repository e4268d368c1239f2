"""An engine group: Leafs of one elementwise rule, stepped in place together over flat buffers.

Leafs that share a rule object, backend, dtype, device and scalar state (step counters) form a
group (`optimisers.engine.plan`), their state in the flat buffers of `GroupLayout`. A first step
checks every member (`ready_members`) and keeps the backend's snapshot of what it found; a later
step along the same route checks that in one call (`still`), and `optimisers.engine.execute`
chooses how it steps. Only rules whose update of an element depends
on that element and on shared scalars alone are grouped (`elementwise`, or a chain that scales
each gradient by one factor first: `scaled_elementwise`), so a chunk computes what the whole
array would.
"""

from __future__ import annotations

import operator

from optimisers import ops
from optimisers.core.state import Leaf
from optimisers.engine import chunks, layout, precision
from optimisers.engine.layout import GroupLayout

_FROZEN = operator.attrgetter("frozen")


def eligible(leaf, x) -> bool:
    """Can this Leaf's parameter be stepped by the engine?"""
    rule = leaf.rule
    if not (rule.elementwise or chunks.scaled(rule)) or leaf.frozen:
        return False
    b = ops.backend(x)
    return b.IN_PLACE_ENGINE and b.engine_ok(x)


class Group(GroupLayout):
    """Leafs stepped together: what each step checks, and the buffers it steps."""

    def __init__(self, leaves, xs):
        super().__init__(leaves, xs)
        self.sums: dict[int, object] = {}  # member -> its summed-gradient buffer (`ties`)
        self.token = None  # the backend's snapshot of the members' arrays at the last full check
        self.broken = False  # its parameters left the span it was laid out for: plan anew
        self._staged = None  # `(xs, dxs)` whose packed members are in `staging_now` this step
        self.staging_now = None  # this step's staging buffers `(flat_x, flat_g)`
        self._steppable_at = None  # `Leaf.edits` when `steppable` last found every member ready

    def ready_members(self, found):
        """Every member's contribution to this update, or None if some member cannot step in
        the group now (no gradient, frozen, reshaped, converted (a torch module's `.double()` or
        `.to(device)` swaps its parameters' data in place), not writable in place). Each
        parameter is checked as it is (the full check: a later step checks it against `token`)."""
        members = []
        for leaf in self.leaves:
            c = found.get(id(leaf))
            if c is None or not c.grads or c.copies or leaf.frozen:
                return None
            members.append(c)
        xs = [c.x for c in members]
        if not self._fit(xs):
            return None
        if self.span is not None and not self.span.holds(xs):
            self.broken = True  # (a parameter moved out of the buffer: it steps on its own)
            return None
        return members

    def snapshot(self, xs, gs, given) -> None:
        """Keep the backend's snapshot of the members' parameters `xs` and gradients `gs` (each
        member's first, then a tied member's others: `given` of them), where every gradient is
        what the kernels take as it is; else none (later steps then take the full check)."""
        fit = self.b.fit_as_they_are(gs, xs + [xs[m] for m in given], self.dtype, self.device)
        self.token = self.b.snapshot(xs, gs) if fit is not None and all(fit) else None

    def still(self, xs, gs) -> bool:
        """Can `xs` and `gs` (as for `snapshot`) step as the snapshotted ones did?"""
        if self.token is None or not self.b.unchanged(self.token, xs, gs):
            return False
        return self.span is None or self.span.intact()

    def _fit(self, xs) -> bool:
        """Is each parameter still as planned: its shape, dtype, device and memory order, and
        fit for the engine (a `.data` swap or `.to()` may have changed any of them)?"""
        b, dtype, device = self.b, self.dtype, self.device
        for x, shape, order in zip(xs, self.shapes, self.orders):
            if x.shape != shape or x.dtype != dtype or not b.engine_ok(x) or b.memory_order(x) != order:
                return False
            if device is not None and x.device != device:
                return False
        return True

    def own_sums(self, dxs) -> list:
        """The members whose gradient this step is their summed-gradient buffer (tied)."""
        return sorted(i for i, buf in self.sums.items() if dxs[i] is buf)

    def intact(self) -> bool:
        """Is the group still the holder of every member's state, all of the group's rule?"""
        rule, held = self.leaves[0].rule, layout.HELD.get
        return not self.broken and all(held(leaf) is self and leaf.rule is rule for leaf in self.leaves)

    def steppable(self) -> bool:
        """Intact, and no member frozen: checked again only after some Leaf was edited."""
        if self._steppable_at == Leaf.edits:
            return True
        ok = self.intact() and not any(map(_FROZEN, self.leaves))
        if ok:
            self._steppable_at = Leaf.edits
        return ok

    def factors(self, dxs):
        """For a scaled group, each member's factor over its whole gradient, indexed by member (a
        list, or a 1-D array); else None. This may raise: ClipNorm of a non-finite gradient."""
        if not self.scaled:
            return None
        with self.b.no_grad():
            return self.leaves[0].rule.gradient_factors([precision.widened(dx) for dx in dxs])

    def trusted(self) -> bool:
        """Can this step run without a rehearsal: does the rule promise not to raise?"""
        return self.leaves[0].rule.never_raises and not self.b.raises_on_values()  # (np.seterr)

    # --- the staging buffers of one step -------------------------------------------------------

    def stage(self, xs, dxs) -> None:
        """Join the packed members' parameters and gradients into the staging buffers (once per
        step: a rehearsal does it before the step). A span is its own staging buffer for the
        parameters, and so are the gradients where they are views of one flat buffer too."""
        staged = self._staged
        if staged is not None and staged[0] is xs and staged[1] is dxs:
            return
        if self.span is not None:
            self.staging_now = self.span.flat, self.span.gradient(dxs, self)
        elif self.has_runs:
            p0 = self.packed_from
            self.staging_now = flat_x, flat_g = self.staging(xs[p0])
            orders = self.orders[p0:]
            self.b.join_into(flat_x, xs[p0:], orders)
            self.b.join_into(flat_g, dxs[p0:], orders)
        self._staged = xs, dxs

    def unpack(self, xs) -> None:
        """Copy the stepped packed parameters from the staging buffer back into `xs`."""
        p0 = self.packed_from
        self.b.split_into(self.staging_now[0], xs[p0:], self.orders[p0:])

    def unstage(self) -> None:
        """Let go of what `stage` made and refers to (after a step, or a failed rehearsal)."""
        self._staged = self.staging_now = None
