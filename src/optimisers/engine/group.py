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
from optimisers.engine import chunks, layout
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
        self.staged = None  # `(xs, dxs)` whose packed members are in `staging_now` this step
        self.staging_now = None  # this step's staging buffers `(flat_x, flat_g)` (`chunks.stage`)
        self.runs_apart = None  # this step's packed members, stepped run by run (`scaled.Runs`)
        self._steppable_at = None  # `Leaf.edits` when `steppable` last found every member ready

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
        if self.span is None:
            return True
        at = getattr(self.b, "gradients_at", None)
        return self.span.intact() and self.span.expect(gs, None if at is None else at(self.token))

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
