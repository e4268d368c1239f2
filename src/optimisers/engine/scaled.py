"""The factors of a scaled step (`Rule.scaled_elementwise`: a chain that clips the gradient's
norm first, LAMB, LARS): one number for each parameter array, found over whole arrays before
any element steps, from the parameters and the rule's `direction` of each (the gradient, or an
array the rule computes elementwise: the compiled way's one pass where it can, else eagerly).
Then each array steps elementwise, in chunks or compiled, given its factor."""

from __future__ import annotations

from optimisers import ops
from optimisers.core.rule import Rule
from optimisers.core.state import flatten_state, unflatten_state
from optimisers.engine import chunks, compiled, precision


def of_one(rule, state, x, dx):
    """The factor of one parameter's scaled step, a scalar of the dtype its maths runs in."""
    if not _own_direction(rule):
        return rule.step_factors([x], [precision.widened(dx)])[0]
    b = ops.backend(x)
    parts: list = []
    spec = flatten_state(state, parts)
    array_at = [b.is_buffer(p) for p in parts]
    u = None
    arrays = [x, dx, *[p for p, a in zip(parts, array_at) if a]]
    if b.IN_PLACE_ENGINE and all(b.kernel_ok(a) and a.shape == x.shape for a in arrays):
        order = b.memory_order(x)
        piece = [b.flat_in(a, order) for a in arrays]
        scalars = [None if a else p for a, p in zip(array_at, parts)]
        u = compiled.direction(b, rule, spec, array_at, scalars, piece, getattr(x, "device", None))
        u = None if u is None else b.shaped_in(u, x.shape, order)
    if u is None:
        u = precision.direction(rule, state, x, dx)
    return rule.step_factors([precision.widened(x)], [u])[0]


def of_group(group, xs, dxs, given):
    """Each member's factor, a 1-D array indexed by member: from the gradients as they were
    given (`given`: a norm's rounding depends on the order it sums in) for a rule whose direction
    is the gradient; else from the members' directions, the big members' each on a worker of
    its own, then the packed members' together (staged: `chunks.stage`), one array of directions
    a worker at a time."""
    rule, b = group.leaves[0].rule, group.b
    if not _own_direction(rule):
        return rule.step_factors(xs, [precision.widened(g) for g in given])
    chunks.stage(group, xs, dxs)
    pieces = compiled.group_pieces(group, xs, dxs)
    wide = precision.widened if precision.narrow(xs[0]) else _itself

    def big(i):  # (on one worker: the pass itself on one thread, else shared among them)
        u = _direction(group, rule, pieces[i], threads=not group.threads)
        return rule.step_factors([wide(xs[i])], [_member(b, group, i, u)])

    found = chunks._map(big, list(range(group.packed_from)), group.threads)
    p0 = group.packed_from
    if p0 < len(xs):
        u, base, sizes = _direction(group, rule, pieces[-1]), group.offsets[p0], group.sizes[p0:]
        if min(sizes) == max(sizes) and not any(group.orders[p0:]):
            # (thousands of one size: the rows of the staged parameters and of their directions)
            shape = (len(sizes), sizes[0])
            found.append(rule.step_factors(wide(ops.reshape(pieces[-1][0], shape)), ops.reshape(u, shape)))
        else:
            bounds = [(k, group.offsets[k] - base, group.offsets[k + 1] - base) for k in range(p0, len(xs))]
            us = [_member(b, group, k, u[lo:hi]) for k, lo, hi in bounds]
            found.append(rule.step_factors(list(map(wide, xs[p0:])), us))
    if len(found) == 1:
        return found[0]
    joined = b.empty_flat(len(xs), found[0])
    b.join_into(joined, found, [None] * len(found))
    return joined


def _member(b, group, k, flat):
    """Member `k`'s 1-D `flat` (in its memory order) as a norm reads it: as it is for a member
    in row-major order (the same elements in the same order), else shaped as the member."""
    order = group.orders[k]
    return flat if order is None else b.shaped_in(flat, group.shapes[k], order)


def _itself(x):
    return x


def _own_direction(rule) -> bool:
    """Does `rule` step along an array of its own (LAMB, LARS), not the gradient (a chain)?"""
    return type(rule).direction is not Rule.direction


def _direction(group, rule, piece, threads=True):
    """`rule.direction` over one of `compiled.group_pieces`: compiled, else eagerly."""
    b = group.b
    u = compiled.direction(b, rule, group.spec, group.array_at, group.scalars, piece, group.device, threads)
    if u is None:
        arrays = iter(piece[2:])
        parts = [next(arrays) if a else s for a, s in zip(group.array_at, group.scalars)]
        u = precision.direction(rule, unflatten_state(group.spec, iter(parts)), piece[0], piece[1])
    return u
