"""The initial state of many parameters at once: where parameters that share an elementwise rule
fill one flat buffer back to back (a span, `optimisers.engine.span`), their state is made by
one `rule.init` over the buffer and each gets views of it. The engine then steps that state as
it is, instead of copying every parameter's state into one buffer at the first step (a moment
holding the state twice)."""

from __future__ import annotations

import itertools
import math

from optimisers import ops
from optimisers.core.state import flatten_state, unflatten_state
from optimisers.core.tree import format_path


def initial_states(items, one=None) -> list:
    """`items`: `[(rule, x, where)]`; their initial states, in order: views of one state made
    over a span where parameters fill one, else `one(rule, x, where)` (default `init`, which names
    the path `where` in a refusal)."""
    states: list = [None] * len(items)
    for members in _candidates(items):
        _init_span([items[i] for i in members], members, states)
    for i, (rule, x, where) in enumerate(items):
        if states[i] is None:
            states[i] = (one or init)(rule, x, where)
    return states


def init(rule, x, path):
    """`rule.init(x)`, with the parameter's path named in a refusal (a rule that is not defined
    for complex parameters, or for arrays of this shape)."""
    try:
        return rule.init(x)
    except (TypeError, ValueError) as e:
        if e.args and isinstance(e.args[0], str):  # the same exception, its message prefixed
            e.args = (f"the parameter at {format_path(path)}: {e.args[0]}", *e.args[1:])
        raise


def _candidates(items) -> list[list[int]]:
    """Positions of parameters the engine would group (one elementwise rule object, backend,
    dtype, device), for groups of two or more."""
    by_key: dict = {}
    for i, (rule, x, _) in enumerate(items):
        b = ops.backend(x)
        if rule.elementwise and b.IN_PLACE_ENGINE and b.engine_ok(x):
            by_key.setdefault((id(rule), b, x.dtype, getattr(x, "device", None)), []).append(i)
    return [members for members in by_key.values() if len(members) > 1]


def _init_span(group, members, states) -> None:
    """Fill `states` at `members` with views of one state made over the span `group`'s parameters
    fill, if they fill one; else leave them for `init`."""
    b = ops.backend(group[0][1])
    xs = [x for _, x, _ in group]
    where = b.addresses(xs)
    order = sorted(range(len(xs)), key=where.__getitem__)
    span = b.flat_span([xs[k] for k in order])
    if span is None:
        return
    try:
        with b.no_grad():
            whole = group[0][0].init(span)
    except (TypeError, ValueError):
        return  # each parameter's own `init` reports it, with its path
    parts: list = []
    spec = flatten_state(whole, parts)
    if not all(p.shape == span.shape for p in parts if b.is_buffer(p)):
        return
    shapes = [xs[k].shape for k in order]
    pieces = [_pieces(b, p, shapes) if b.is_buffer(p) else itertools.repeat(p) for p in parts]
    for k, views in zip(order, zip(*pieces)):
        states[members[k]] = unflatten_state(spec, iter(views))


def _pieces(b, flat, shapes) -> list:
    """Views of the 1-D `flat` cut back to back into arrays of `shapes`: one view of each run of
    equal shapes, taken apart along its first axis in one call (a view per parameter of a model
    of thousands of small ones would be most of `setup`)."""
    out, lo = [], 0
    for shape, run in itertools.groupby(shapes):
        k, n = len(list(run)), math.prod(shape)
        if k == 1:
            out.append(b.shaped_in(flat[lo : lo + n], shape, None))
        else:
            out.extend(b.shaped_in(flat[lo : lo + k * n], (k, *shape), None))
        lo += k * n
    return out
