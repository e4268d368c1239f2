"""Execute: how each Leaf steps, chosen in one place (`step`), and the two phases of an update
that lead there (docs/architecture.md: the five ways, fused, span, flat chunks, stack and
per-Leaf, each in its own module). An update gathers (`gather`), then steps; `update_` first
tries its last step's route (`replay`) and steps engine groups (`plan`) in place. Nothing is
written until every result has been computed and checked.
"""

from __future__ import annotations

import functools

from optimisers import ops
from optimisers.backends.ranges import ByteRanges
from optimisers.core.state import path_of
from optimisers.core.tree import format_path
from optimisers.engine import checks, chunks, compiled, fused, plan, precision, replay, scaled, ties
from optimisers.engine import stacked as stacks
from optimisers.engine.gather import gather
from optimisers.rules.common import sharing_step_scalars


class _Applied(tuple):
    """`(new_state, new_x)` of a pure step in chunks: the step is applied already."""


def step(c=None, group=None, *, xs=None, dxs=None, factors=None, stacked=None, pure=False):
    """Step one engine group in place (`group`, its parameters `xs`, summed gradients `dxs`, a
    scaled group's `factors`), or compute one Leaf's `(new_state, step)` (`c`, its gathered
    contribution; `stacked`, the results of this update's stacks; `pure`: `update`'s, where a
    large parameter may step in chunks into a new array, `(new_state, new_x)`). The ways are
    tried in this order; a kernel may decline a parameter it cannot take."""
    if group is not None:
        kernel = fused.find(group.b, group.leaves[0].rule) if factors is None else None
        if kernel is not None and fused.step_group(group, kernel, xs, dxs):
            return None  # fused: every member (a span as one array) in one kernel call
        if compiled.step_group(group, xs, dxs, factors):
            return None  # compiled: the rule's own maths, traced, in one pass over each array
        return chunks.step(group, xs, dxs, factors)  # span, or flat chunks of members and runs
    if id(c.leaf) in stacked:
        return stacked[id(c.leaf)]  # stack: computed with the others of its stack
    rule, state, x, dx = c.leaf.rule, c.leaf.state, c.x, c.dx()
    b = ops.backend(x)
    # rules compute data, not graphs: a step that uses the parameter (WeightDecay, AdamW) must
    # not leave state holding an autograd graph that grows every step
    with b.no_grad():
        kernel = fused.find(b, rule)
        result = None if kernel is None else fused.step_leaf(kernel, state, x, dx)
        if result is not None:
            return result  # fused
        # (a scaled step's factor, computed once if a way below takes it)
        factor = None
        if chunks.scaled(rule):
            factor = functools.cache(functools.partial(scaled.of_one, rule, state, x, dx))
        result = compiled.step_leaf(rule, state, x, dx, pure, factor)
        if result is not None:  # compiled: the rule's own maths, traced, in one pass
            return _Applied(result) if pure and result[1] is not None else result
        if pure:
            result = chunks.pure_step(rule, state, x, dx, factor)
            if result is not None:
                return _Applied(result)  # flat chunks, into a new array (no step at full size)
        return precision.run(rule.apply, state, x, dx)  # per-Leaf


def compute(found, tree, skip=frozenset(), pure=False) -> dict[int, tuple]:
    """Run each Leaf's rule once (the Leafs of `found` not in `skip`): `{id(leaf): (new_state,
    step)}` for Leafs that move, each step checked to fit its parameter, so that writing the
    results cannot fail half way. With `pure`, `{id(leaf): (new_state, new_value)}`: each step
    is applied to a new array at once, so that no step outlives its Leaf's turn."""
    results = {}
    stacked = stacks.stacked_results(found, skip)  # small arrays of a rule that stacks: one call
    moving = [(key, c) for key, c in found.items() if not (c.leaf.frozen or not c.grads or key in skip)]
    with sharing_step_scalars(), compiled.one_update():
        ahead = _ahead(moving, stacked, pure)
        for key, c in moving:
            try:
                result = ahead[key] if key in ahead else step(c, stacked=stacked, pure=pure)
                if isinstance(result, Exception):
                    raise result
                if type(result) is not _Applied:
                    checks.check_step(c.leaf.rule, result, c.x)
                    result = (result[0], checks.new_value(c.x, result[1])) if pure else result
                results[key] = tuple(result)
            except ops.GradientError as e:
                raise checks.located(e, tree) from None
            except Exception as e:
                if hasattr(e, "add_note"):  # Python >= 3.11: say where, keeping the exception's type
                    e.add_note(f"(while updating the parameter at {format_path(path_of(tree, c.leaf))})")
                raise
    checks.share_scalar_state(found, results)
    return results


# elements: NumPy parameters this large that step one by one (not in a group or a stack) step
# on the workers, two at a time (its ufuncs release the GIL; torch's ops use every core already)
AHEAD_FROM = 1 << 16


def _ahead(moving, stacked, pure) -> dict:
    """`{key: result or the exception it raised}` of the large NumPy parameters of `moving`
    that step on their own, computed on the workers (in copies of this update's context: its
    shared step scalars and traces, NumPy's error handling) where there are two or more; else
    nothing."""
    if chunks.WORKERS < 2:
        return {}
    big = [(key, c) for key, c in moving if id(c.leaf) not in stacked and _big_numpy(c.x)]
    if len(big) < 2:
        return {}

    def one(c):
        try:
            return step(c, stacked=stacked, pure=pure)
        except Exception as e:  # noqa: BLE001 - raised in turn, as one by one would
            return e

    return dict(zip((key for key, _ in big), chunks._map(one, [c for _, c in big], True)))


def _big_numpy(x) -> bool:
    b = ops.backend(x)
    return b.IN_PLACE_ENGINE and b.ENGINE_THREADS and b.numel(x) >= AHEAD_FROM


def out_of_place(state, model, grads, pure=False):
    """`update`'s work: `(found, results)` as `compute` gives them; nothing is written."""
    found = gather(state.tree, model, grads, state._keys)
    return found, compute(found, state.tree, pure=pure)


def in_place(state, model, grads):
    """`update_`'s work before the verb commits: every engine group stepped in place, and
    `(found, results, in_engine)` for the rest; None where the step followed the last step's
    route (every parameter stepped). A failure raises before anything is written."""
    try:
        ready = replay.ready(state, model, grads)  # the usual step: as the last one went
        if ready is not None:
            step_groups(ready, checked=True)
            return None
    except ops.GradientError as e:
        raise checks.located(e, state.tree) from None
    found = gather(state.tree, model, grads, state._keys)
    work = plan.select(state, found)
    in_engine = {id(leaf) for group, _ in work for leaf in group.leaves}
    done = compute(found, state.tree, skip=in_engine)  # may raise: nothing written yet
    try:
        ready = []
        for group, members in work:
            dxs, given = ties.group_gradients(group, members)
            ready.append((group, [c.x for c in members], dxs, given))
        step_groups(ready)  # checks everything before it writes
    except ops.GradientError as e:
        raise checks.located(e, state.tree) from None
    replay.remember(state, model, found, work, done)
    return found, done, in_engine


def step_groups(ready, checked=False) -> None:
    """Step engine groups in place: `ready` lists `(group, xs, dxs, given)`, the members'
    parameters and summed gradients (`dxs` laid out as the parameters, `given` as they came;
    `checked`: their snapshots found no gradient in a parameter's memory). Every scaled group's
    factors are computed first, and a group whose rule may raise is rehearsed, all of them before
    any is stepped, so that an error changes nothing. A rule is traced once for all its groups'
    arrays (`compiled.one_update`), not once for each big one."""
    with compiled.one_update():
        prepared = [(group, xs, dxs, _factors(group, xs, dxs, given)) for group, xs, dxs, given in ready]
        if not checked:
            _unalias(prepared)
        try:
            for group, xs, dxs, factors in prepared:
                if not _trusted(group):
                    chunks.rehearse(group, xs, dxs, factors)
            for group, xs, dxs, factors in prepared:
                step(group=group, xs=xs, dxs=dxs, factors=factors)
        finally:
            for group, *_ in prepared:
                chunks.unstage(group)  # (a failed rehearsal leaves the gradients it staged)


def _unalias(prepared) -> None:
    """Copy each gradient whose memory overlaps a parameter about to be stepped (a view of it
    such as `W[::-1]`, another parameter, or an array made over the same buffer apart from it):
    chunks write parameters while later chunks still read gradients, so `update_` would
    otherwise differ from `update`. Byte ranges are compared, whatever owns the memory."""
    spans: dict = {}  # (backend, device) -> the byte ranges of its parameters in this step
    for group, xs, _, _ in prepared:
        spans.setdefault((group.b, group.device), []).extend(map(group.b.memory_span, xs))
    ranges = {key: ByteRanges(*zip(*found)) for key, found in spans.items()}
    for group, _, dxs, _ in prepared:
        b = group.b
        starts, stops = zip(*map(b.memory_span, dxs))
        for i in ranges[(b, group.device)].reached(starts, stops).nonzero()[0].tolist():
            dxs[i] = b.copy(dxs[i])


def _factors(group, xs, dxs, given):
    """For a scaled group, each member's factor over its whole arrays, indexed by member (a
    list, or a 1-D array); else None. This may raise: ClipNorm of a non-finite gradient."""
    if not group.scaled:
        return None
    with group.b.no_grad():
        return scaled.of_group(group, xs, dxs, given)


def _trusted(group) -> bool:
    """Can this step run without a rehearsal: does the rule promise not to raise?"""
    return group.leaves[0].rule.never_raises and not group.b.raises_on_values()  # (np.seterr)
