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
    """Each member's factor, a 1-D array indexed by member: each big member's on a worker of
    its own, then the packed members' together. The rule's factors are read from the gradients
    as they were given (`given`: a norm's rounding depends on the order it sums in) where its
    direction is the gradient, else from its directions (staged: `chunks.stage`)."""
    rule, b, p0 = group.leaves[0].rule, group.b, group.packed_from
    own = _own_direction(rule)
    # (packed members whose factors and steps cannot raise: each run's factors are found as
    # the compiled way steps it, in cache, with no staging buffers for all of them: `Runs`)
    apart = own and rule.never_raises and not b.raises_on_values() and compiled.runs_apart(group)
    pieces = None
    if own:
        if not apart:
            chunks.stage(group, xs, dxs)
        pieces = compiled.group_pieces(group, xs, dxs)
    # (the norms of a big member on a worker: NumPy's loop, on torch's CPU tensors too)
    spread = p0 > 1 and chunks.WORKERS > 1 and getattr(group.device, "type", "cpu") == "cpu"

    def factors(first, last, threads):
        if not own:
            return rule.step_factors(xs[first:last], [precision.widened(g) for g in given[first:last]])
        return _factors(group, rule, xs, pieces[first if last - first == 1 else -1], first, last, threads)

    found = chunks._map(lambda i: factors(i, i + 1, not spread), range(p0), spread)
    if apart:
        like = found[0] if found else precision.widened(xs[p0])  # (the dtype the maths runs in)
        found.append(b.zeros((len(xs) - p0,), like))  # (each run's own, or `Runs.fill`)
    elif p0 < len(xs):
        found.append(factors(p0, len(xs), True))
    if len(found) == 1:
        joined = found[0]
    else:
        joined = b.empty_flat(len(xs), found[0])
        b.join_into(joined, found, [None] * len(found))
    if apart:
        group.runs_apart = Runs(group, rule, xs, dxs, joined)
    return joined


class Runs:
    """The packed members of a scaled group whose rule never raises, stepped run by run
    (`compiled.step_group`): each run's parameters and gradients joined into buffers of its own,
    its directions and factors found, and the run stepped and copied back while in cache. Where
    the compiled way does not take the step, `fill` finds every packed member's factor first, as
    for any scaled group (`chunks.step` then steps them)."""

    def __init__(self, group, rule, xs, dxs, factors):
        self.group, self.rule, self.xs, self.dxs, self.factors = group, rule, xs, dxs, factors

    def of_run(self, first, last, piece, u):
        """The factors of members `first:last`, whose elements `piece` holds back to back, and
        their directions `u`."""
        return _factors(self.group, self.rule, self.xs, piece, first, last, False, u)

    def fill(self) -> None:
        """Stage the packed members and write their factors into the group's factors."""
        group, p0, n = self.group, self.group.packed_from, len(self.xs)
        group.runs_apart = None
        chunks.stage(group, self.xs, self.dxs)
        piece = compiled.group_pieces(group, self.xs, self.dxs)[-1]
        found = _factors(group, self.rule, self.xs, piece, p0, n, True)
        group.b.copy_into(self.factors[p0:], found)


def _factors(group, rule, xs, piece, first, last, threads, u=None):
    """The factors of members `first:last`, whose elements `piece` holds back to back, from
    their directions `u` (None: written out here; `threads`: the pass shared among the workers)."""
    b, base = group.b, group.offsets[first]
    bounds = [group.offsets[k] - base for k in range(first, last + 1)]
    wide = precision.widened if precision.narrow(xs[0]) else _itself
    u = _direction(group, rule, piece, threads) if u is None else u
    sizes = group.sizes[first:last]
    if last - first > 1 and min(sizes) == max(sizes) and not any(group.orders[first:last]):
        # (thousands of one size: the rows of the staged parameters and of their directions)
        shape = (last - first, sizes[0])
        return rule.step_factors(wide(ops.reshape(piece[0], shape)), ops.reshape(u, shape))
    us = [_member(b, group, k, u[lo:hi]) for k, lo, hi in zip(range(first, last), bounds, bounds[1:])]
    return rule.step_factors(list(map(wide, xs[first:last])), us)


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
