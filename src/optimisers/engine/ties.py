"""Tied parameters: the one place where the gradients of a parameter's places are added.

Each place of a tied array contributes its own gradient and the rule runs once on their sum
(the tie invariants in docs/tied-weights.md). Every path of an update asks this module for that
sum: the per-Leaf and pure paths, engine groups and spans, and a replayed step. So the sum is
written once, left to right in the order of the places, and every path gives the same bits.
"""

from __future__ import annotations

from optimisers import ops


def summed(grads, out=None):
    """The sum of the places' gradients `grads`, left to right: a new array, or written into
    `out` (a buffer of the parameter's dtype and layout, kept between steps) when given."""
    if out is not None:
        ops.backend(out).sum_into(out, grads)
        return out
    dx = grads[0]
    for g in grads[1:]:
        dx = dx + g
    return dx
