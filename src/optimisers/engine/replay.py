"""Replay: an `update_` that follows the route of an earlier step.

Where every parameter of a State steps in place in the engine's groups, the general path
(`gather`, then `plan.select` and `ties.group_gradients`) does Python work per parameter on every
step: it walks the trees, checks each gradient, builds a contribution and compares marks, one
array at a time. A `Route`, recorded after such a step, holds what that step found: the
containers it walked, the array at each place and the group member each place feeds. A later
step walks only those containers and compares what it finds with the route in bulk: the same
state tree, the same arrays with unchanged engine marks, and gradients that the backend would
use as they are (type, dtype, layout, shape). If all agree the groups step; if anything differs
nothing has been written, and the general path runs instead (reporting any error as it always
does) and records a new route.
"""

from __future__ import annotations

from optimisers.backends.objects import SameObjects
from optimisers.core.state import Leaf
from optimisers.core.tree import kind_of
from optimisers.engine import plan as planning
from optimisers.engine import ties
from optimisers.engine.gather import _grad_children


class _Off(Exception):
    """This step does not follow the route."""


class _Container:
    """A container of the state tree and the model node it stood for when the route was made."""

    __slots__ = ("snode", "keys", "same", "leaf_keys", "subs", "model_type", "child_keys", "whole")

    def __init__(self, snode, node, leaf_keys, subs, child_keys):
        self.snode = snode
        self.keys = list(snode)
        self.same = SameObjects(snode.values())  # its values: Leafs and sub-trees
        self.leaf_keys = leaf_keys  # the keys of its Leafs, in the order of the route's places
        self.subs = subs  # [(key, _Container)] of its non-empty sub-trees
        self.model_type = type(node)
        self.child_keys = child_keys  # the model node's child keys (new ones: new parameters)
        # a list, tuple or dict whose every entry is a place (a model of many small arrays): its
        # arrays, and gradients in a container of its type, are taken whole
        self.whole = type(node) in (list, tuple, dict) and not subs and leaf_keys == list(
            node if type(node) is dict else range(len(node))
        )

    def unchanged(self) -> bool:
        snode = self.snode
        return self.same(list(snode.values())) and list(snode) == self.keys


def _walk(container, node, grad, xs, gs):
    """Append the model's array and the gradient at each of the route's places under `node`."""
    if type(node) is not container.model_type or not container.unchanged():
        raise _Off
    if container.whole and type(grad) is type(node) and len(grad) == len(node) == len(container.leaf_keys):
        if type(node) is dict:  # (a key of `grad` the model lacks leaves a None: no replay)
            keys = container.leaf_keys  # (in the same order, the values are read whole)
            xs.extend(node.values() if list(node) == keys else map(node.__getitem__, keys))
            gs.extend(grad.values() if list(grad) == keys else map(grad.get, keys))
        else:
            xs.extend(node)
            gs.extend(grad)
        return
    kind = kind_of(node)
    children = dict(kind.children(node))
    if children.keys() != container.child_keys:
        raise _Off
    grad_of = _grad_children(node, kind, children, grad, ()).get
    xs.extend(map(children.__getitem__, container.leaf_keys))
    gs.extend(map(grad_of, container.leaf_keys))
    for key, sub in container.subs:
        _walk(sub, children[key], grad_of(key), xs, gs)


def _record(snode, node, leaves, xs):
    """The `_Container` of `snode` (and its sub-trees), appending each place's Leaf and array."""
    kind = kind_of(node)
    children = dict(kind.children(node))
    leaf_keys, subs = [], []
    for key, sub in snode.items():
        if type(sub) is Leaf:
            leaf_keys.append(key)
            leaves.append(sub)
            xs.append(children[key])
    for key, sub in snode.items():
        if type(sub) is not Leaf and sub:
            subs.append((key, _record(sub, children[key], leaves, xs)))
    return _Container(snode, node, leaf_keys, subs, frozenset(children))


class Route:
    """The places of a State's planned step (see the module's docstring)."""

    def __init__(self, tree, model, groups):
        self.tree = tree
        leaves: list = []
        self.xs: list = []
        self.root = _record(tree, model, leaves, self.xs)
        self.same = SameObjects(self.xs)
        member = {id(leaf): (g, m) for g, group in enumerate(groups) for m, leaf in enumerate(group.leaves)}
        first: list[list] = [[None] * len(group.leaves) for group in groups]
        extra: list[dict] = [{} for _ in groups]
        for place, leaf in enumerate(leaves):
            g, m = member[id(leaf)]
            if first[g][m] is None:
                first[g][m] = place
            else:
                extra[g].setdefault(m, []).append(place)
        # per group: its members' parameters, each member's first place, a tied member's others
        self.groups = [
            (group, [self.xs[p] for p in places], places, sorted(more.items()))
            for group, places, more in zip(groups, first, extra)
        ]
        self.every_place = first[0] if len(groups) == 1 and first[0] == list(range(len(leaves))) else None
        self.stale = False  # a step did not follow it: the next general step records anew
        self.recorded = 1  # how many routes this plan has recorded, this one included

    @classmethod
    def record(cls, state, model, plan):
        """The route of the general step just taken, or None where a replay could not serve it
        (a model that is one array)."""
        if type(state.tree) is not dict or not state.tree:
            return None
        return cls(state.tree, model, plan.groups)

    def ready(self, state, model, grads):
        """`[(group, xs, dxs, given)]` for `execute.step_groups` if this step follows the route,
    else None."""
        if state.tree is not self.tree:
            return None
        xs: list = []
        gs: list = []
        try:
            _walk(self.root, model, grads, xs, gs)
            if not self.same(xs):
                raise _Off
        except Exception:  # noqa: BLE001 - any difference: the general path reports it
            self.stale = True
            return None
        return self._gradients(gs)

    def _gradients(self, gs):
        ready = []
        for group, xs, places, tied in self.groups:
            # (one group at every place, in order: the walk's list itself)
            dxs = gs if places is self.every_place else list(map(gs.__getitem__, places))
            span = group.span
            if span is not None and not tied and group.steppable() and span.ready(xs, dxs):
                ready.append((group, xs, dxs, dxs))  # the gradients of the step before, in place
                continue
            if not (group.steppable() and group.unchanged(xs)):
                return None
            if not group.gradients_fit(dxs, xs):
                return None
            for m, more in tied:
                others = [gs[p] for p in more]
                n = len(others)
                if not group.fit(others, [xs[m]] * n, [group.shapes[m]] * n):
                    return None
                dxs[m] = ties.member_sum(group, m, xs[m], [dxs[m], *others])
            ready.append((group, xs, dxs, dxs))
        return ready


def remember(state, model, found, work, results) -> None:
    """After a general `update_`: record its route where every Leaf stepped in the engine's
    groups (and the State's plan has none that still serves)."""
    plan = planning.PLANS.get(state)
    if plan is None or results or plan.converted or len(work) != len(plan.groups):
        return
    route = plan.route
    if route is not None and (not route.stale or route.recorded >= _RECORDINGS):
        return  # it serves; or it went stale every time (a new model each step): stop walking
    if sum(len(group.leaves) for group, _ in work) != len(found):
        return  # some Leaf had no gradient, or steps outside the engine
    new = Route.record(state, model, plan)
    if new is not None:
        new.recorded = 1 if route is None else route.recorded + 1
    plan.route = new


_RECORDINGS = 8  # routes recorded for one plan at most (each is a walk of the whole model)


def ready(state, model, grads):
    """The groups of the State's plan, ready to step along its route, if this step follows it;
    else None (nothing was written)."""
    route = getattr(planning.PLANS.get(state), "route", None)
    return None if route is None else route.ready(state, model, grads)
