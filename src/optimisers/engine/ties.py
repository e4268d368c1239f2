"""Tied parameters: the one place where the gradients of a parameter's places are added.

Each place of a tied array contributes its own gradient and the rule runs once on their sum
(the tie invariants in docs/tied-weights.md). Every path of an update asks this module for that
sum: the per-Leaf and pure paths, engine groups and spans, and a replayed step. So the sum is
written once, left to right in the order of the places, and every path gives the same bits.
"""

from __future__ import annotations

import functools
import operator

from optimisers import ops


def given(grads) -> list:
    """The gradients that a Leaf's places bring, in the order of its places: a place without one
    (None) adds nothing. The one tie policy of every path (`gather` applies it place by place)."""
    return [g for g in grads if g is not None]


def summed(grads, out=None):
    """The sum of the places' gradients `grads`, left to right: a new array, or written into
    `out` (a buffer of the parameter's dtype and layout, kept between steps) when given."""
    if out is not None:
        ops.backend(out).sum_into(out, grads)
        return out
    return functools.reduce(operator.add, grads)


def member_sum(group, i, x, grads):
    """The gradients of engine group `group`'s member `i` (each fit for its parameter `x` as it
    is), summed into a buffer the group keeps for that member: a fresh parameter-sized array
    every step is memory the kernel has to fault in again."""
    buf = group.sums.get(i)
    if buf is None:
        buf = group.sums[i] = ops.zeros_like(x)
    return summed(grads, out=buf)


def group_gradients(group, members) -> tuple[list, list]:
    """Each member's summed gradient, laid out as its parameter (what the chunks read), and as it
    was given (what a scaled group's factor is computed on, as the per-Leaf and pure paths
    compute it: a norm's rounding depends on the order it sums in)."""
    out, given = [], []
    xs = [c.x for c in members]
    # one pass over the usual case, where the backend has one
    fit = group.b.fit_as_they_are([c.grads[0] for c in members], xs, group.dtype, group.device)
    for i, c in enumerate(members):
        grads, x = c.grads, c.x
        if fit is not None and fit[i] and len(grads) == 1:
            dx = laid_out = grads[0]
        # summed in place only when each gradient fits the parameter as it is (what the
        # backend's astype hands back unchanged), so that the sum equals `dx()` bit for bit
        elif len(grads) == 1 or not all(c.fitted(g) is g for g in grads):
            dx = c.dx()
            laid_out = group.b.laid_out_like(dx, x)  # chunks read it in x's memory order
        else:
            dx = laid_out = member_sum(group, i, x, grads)
        out.append(laid_out)
        given.append(dx)
    return out, given
