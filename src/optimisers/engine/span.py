"""The span way: parameters that are views of one flat buffer, back to back, step as that buffer.

`optimisers.torch.flatten_`, or a model built over one array, puts a group's parameters in one
flat buffer. The chunks then step the buffer itself, and where the gradients are views of one
flat buffer too they are read where they are: nothing is joined or split. Whether the
parameters still fill the span is the group's check (`Group.still`, the backend's `unchanged`
on the parameters, and on the span's buffer itself).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from optimisers.backends.objects import SameObjects


class _Kept(NamedTuple):
    """What a step found its gradients to be: compared with a later step's (`Span._found`)."""

    same: SameObjects  # the gradients
    at: list  # where each one starts (and `at_array`, the same as an array)
    result: Any  # the view of their buffer (`gradient`), or the pieces (`gradient_pieces`)
    views: list  # the views `result` holds
    views_at: list  # where they start: a storage freed by `resize_(0)` moves them
    at_array: np.ndarray


class Span:
    """The flat buffer `flat` that a group's parameters fill, in order. The span holds the buffer,
    so no other allocation can take its memory while it lives; its own snapshot says whether the
    buffer is still where it was (a storage freed by `resize_(0)`, or reloaded elsewhere, is not)."""

    def __init__(self, b, flat):
        self.b, self.flat = b, flat
        self.token = b.snapshot([flat], [])
        self.grads = None  # `_Kept`: the gradients last found to be views of one buffer
        self.pieces = None  # the same for `gradient_pieces`
        self.now = None  # this replayed step's gradient view, found by `expect` (used once)

    @classmethod
    def of(cls, b, xs):
        """The span of `xs` (in this order), or None where they do not fill one flat buffer."""
        flat = b.flat_span(xs)
        return None if flat is None else cls(b, flat)

    def intact(self) -> bool:
        """Is the buffer still where it was, with all its memory?"""
        return self.token is not None and self.b.unchanged(self.token, [self.flat], [])

    def holds(self, xs) -> bool:
        """Do `xs` fill this span's buffer, in order (checked array by array)?"""
        flat = self.b.flat_span(xs) if self.intact() else None
        return flat is not None and self.b.addresses([flat]) == self.b.addresses([self.flat]) and (
            flat.shape == self.flat.shape
        )

    def expect(self, gs, at) -> bool:
        """Before a replayed step, whose check just read the gradients' pointers `at` (None where
        the backend keeps none): if `gs` begin with the gradients last found to be views of one
        buffer, where they were, that view is this step's (`gradient`). Always True."""
        found, self.now = self.grads, None
        if found is None or at is None:
            return True
        n = len(found.at)
        if found.same(gs[:n]) and np.array_equal(at[:n], found.at_array) and self._alive(found):
            self.now = found.result
        return True

    def _found(self, found, dxs):
        """`found.result` where `dxs` are the gradients it was made of, where they were, and its
        views where they were."""
        if found is None or not found.same(dxs) or self.b.addresses(dxs) != found.at:
            return None
        return found.result if self._alive(found) else None

    def _alive(self, found) -> bool:
        return self.b.addresses(found.views) == found.views_at

    def _keep(self, dxs, result) -> _Kept:
        views = [v for *_, v in result] if type(result) is list else [result]
        at = self.b.addresses(dxs)
        return _Kept(SameObjects(dxs), at, result, views, self.b.addresses(views), np.asarray(at, np.int64))

    def gradient(self, dxs, group):
        """The gradients `dxs` as one 1-D array in the span's order: a view of the flat buffer
        they are views of (kept to compare with the next step's), else joined into a new one."""
        b, flat, self.now = self.b, self.now, None
        if flat is None or not self.grads.same(dxs):  # (a tied member's sum is not the one found)
            flat = self._found(self.grads, dxs)
        if flat is not None:
            return flat
        flat = b.flat_span(dxs) if dxs[0].dtype == group.dtype else None
        if flat is not None and [g.shape for g in dxs] == group.shapes:
            self.grads = self._keep(dxs, flat)
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
        found = self._found(self.pieces, dxs)
        if found is not None:
            return found
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
        self.pieces = self._keep(dxs, pieces)
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
