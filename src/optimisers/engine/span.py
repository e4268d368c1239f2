"""The span way: parameters that are views of one flat buffer, back to back, step as that buffer.

`optimisers.torch.flatten_`, or a model built over one array, puts a group's parameters in one
flat buffer. The chunks then step the buffer itself, and where the gradients are views of one
flat buffer too they are read where they are: nothing is joined or split. A `Span` remembers
what it found (the parameters, the gradients' buffer) and each step compares cheap marks with
that, in bulk, instead of checking every array.
"""

from __future__ import annotations

from optimisers.backends.objects import SameObjects


class _Found:
    """Arrays found at a step (a span's parameters, or gradients that are views of one buffer)
    and what was made of them: a later step may use `value` while it finds the same objects with
    the same marks (`b.marker`: their addresses taken once, where the backend can)."""

    def __init__(self, b, xs, value):
        self.same, self.value = SameObjects(xs), value
        self.marks_now = b.marker(self.same.xs, b.span_marks)
        self.marks = self.marks_now()

    def still(self, xs) -> bool:
        return self.same(xs) and self.marks_now() == self.marks


class Span:
    """The flat buffer `flat` that the parameters `xs` fill, in order, and what later steps
    compare with."""

    def __init__(self, b, flat, xs):
        self.b, self.flat = b, flat
        self.params = _Found(b, xs, flat)
        self.last_list = None  # a list of parameters found to be `xs` (a replay passes the same one)
        self.grads = None  # the gradients last found to be views of one buffer (`_Found`: the view)
        self.pieces = None  # the same for `gradient_pieces` (`_Found`: the pieces)
        self.checked = None  # the gradients `ready` found in `grads` this step

    @classmethod
    def of(cls, b, xs):
        """The span of `xs` (in this order), or None where they do not fill one flat buffer."""
        flat = b.flat_span(xs)
        return None if flat is None else cls(b, flat, xs)

    def holds(self, xs) -> bool:
        """Are `xs` the parameters this span holds, where they were?"""
        params = self.params
        if not (xs is self.last_list or params.same(xs)):
            return False
        if params.marks_now() != params.marks:
            return False
        self.last_list = xs
        return True

    def ready(self, xs, dxs) -> bool:
        """Can this step use the span as the last did: the same parameters, and the same
        gradients, still views of one flat buffer? Two bulk reads."""
        if self.grads is None or not self.grads.still(dxs) or not self.holds(xs):
            return False
        self.checked = dxs
        return True

    def gradient_owner(self, dxs):
        """The memory owner of the gradients `dxs` where `ready` found them in one buffer this
        step; else None."""
        return self.b.memory_owners([self.grads.value])[0] if self.checked is dxs else None

    def gradient(self, dxs, group):
        """The gradients `dxs` as one 1-D array in the span's order: a view of the flat buffer
        they are views of (kept to compare with the next step's), else joined into a new one."""
        b = self.b
        if self.checked is dxs or (self.grads is not None and self.grads.still(dxs)):
            return self.grads.value
        flat = b.flat_span(dxs) if dxs[0].dtype == group.dtype else None
        if flat is not None and [g.shape for g in dxs] == group.shapes:
            self.grads = _Found(b, dxs, flat)
            return flat
        flat = b.empty_flat(group.offsets[-1], self.flat)
        b.join_into(flat, dxs, group.orders)
        return flat

    def gradient_pieces(self, dxs, own, group):
        """Where the members `own` (tied) have gradients of their own (their sums) and the
        others' are views of one flat buffer: `[(lo, hi, gradient)]`, the span cut around each
        own member, each gradient 1-D, so that a kernel steps the pieces in one call and no
        gradient is copied; else None."""
        if not own:
            return None
        if self.pieces is not None and self.pieces.still(dxs):
            return self.pieces.value
        b, offsets, pieces, i = self.b, group.offsets, [], 0
        for j in [*own, len(dxs)]:
            if i < j:  # members i..j-1: views of one buffer, back to back?
                flat = b.flat_span(dxs[i:j]) if dxs[i].dtype == group.dtype else None
                if flat is None or [g.shape for g in dxs[i:j]] != group.shapes[i:j]:
                    return None
                pieces.append((offsets[i], offsets[j], flat))
            if j < len(dxs):
                pieces.append((offsets[j], offsets[j + 1], b.flat_in(dxs[j], group.orders[j])))
            i = j + 1
        self.pieces = _Found(b, dxs, pieces)
        return pieces


def state_buffers(b, per_leaf, array_at, shapes, dtype, seen):
    """For a span's members whose state arrays (`per_leaf`, each member's state parts) already
    fill one flat buffer per part, in the span's order (made so by `setup`:
    `optimisers.engine.initial_state`) and apart from the parameters (memory owners `seen`):
    those buffers (None at a scalar part). Else None."""
    packed = []
    for k, a in enumerate(array_at):
        if not a:
            packed.append(None)
            continue
        parts = [p[k] for p in per_leaf]
        flat = b.flat_span(parts) if all(p.shape == x for p, x in zip(parts, shapes)) else None
        if flat is None or parts[0].dtype != dtype or b.memory_owners([flat])[0] in seen:
            return None
        seen.add(b.memory_owners([flat])[0])
        packed.append(flat)
    return packed
