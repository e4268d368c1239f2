"""Replay: a later `update_` that reuses the plan of the step before (docs/architecture.md, step
2). Where every Leaf stepped in the engine's groups, `Route.record` keeps what the general step
walked; a later step walks it in code written for the route (`_compiled`), applies the tie policy
(`ties.given`) and asks each group's backend one question (`Group.still`). If anything differs,
nothing has been written: the general path runs, reports any error, and records the route anew.
"""

from __future__ import annotations

import operator

from optimisers.backends.objects import SameObjects
from optimisers.core.state import Leaf
from optimisers.core.tree import kind_of
from optimisers.engine import plan as planning
from optimisers.engine import ties
from optimisers.engine.gather import _grad_children


class _Off(Exception):
    """This step does not follow the route."""


_SEQUENCES = (list, tuple)


class _Node:
    """A container of the state tree (`snode`, its `keys`) and what the model had there."""

    __slots__ = ("parent", "key", "snode", "type", "kind", "seq", "child_keys", "leaf_keys", "fields",
                 "field_of")

    def __init__(self, parent, key, snode, node, children):
        self.parent, self.key, self.snode = parent, key, snode
        self.type, self.kind = type(node), kind_of(node)
        self.seq = type(node) in _SEQUENCES  # its children and gradients are read by position
        self.child_keys = len(node) if self.seq else frozenset(children)
        self.leaf_keys = [k for k, sub in snode.items() if type(sub) is Leaf]
        self.fields, self.field_of = _fields(self.kind, node, children)

    def children(self, node):
        """`node`'s children by key (a node other than a list, tuple or dict), if they are the
        ones the route was made with; else `_Off`."""
        kids = dict(self.kind.children(node))
        if kids.keys() != self.child_keys:
            raise _Off
        return kids

    def gradients(self, node, grad):
        """The gradient of each child of `node` in `grad` (in a form the walk does not read where
        it is), as a function of its key: as `gather` reads it."""
        return _grad_children(node, self.kind, dict(self.kind.children(node)), grad, ()).get


def _fields(kind, node, children):
    """The key sets of the dicts holding `node`'s children (`NodeKind.fields`) and, for each child,
    the dict it is in, where those dicts hold exactly the children (a module with a frozen
    parameter or a `None` slot is read through `children` instead); else `(None, None)`."""
    if kind.fields is None:
        return None, None
    dicts = kind.fields(node)
    field_of = {k: j for j, d in enumerate(dicts) for k in d}
    if field_of.keys() != children.keys() or any(dicts[j][k] is not children[k] for k, j in field_of.items()):
        return None, None
    return [frozenset(d) for d in dicts], field_of


def _apart(gs) -> bool:
    """Is each gradient given once? (`gather` refuses one given twice in a module's dict: where
    the route reads such dicts where they are, a step that gives one twice anywhere goes the
    general way.)"""
    given = [g for g in gs if g is not None]
    return len(set(map(id, given))) == len(given)


def _record(snode, node, parent, key, nodes, ranks, xs):
    """Append the `_Node`s of `snode` and its sub-trees to `nodes` (depth first); to `ranks` each
    place's position in the order `gather` visits places (a tie's first place, and the order its
    gradients are summed in, are those of `gather`); and to `xs` the parameters the walk reads."""
    children = dict(kind_of(node).children(node))
    here = _Node(parent, key, snode, node, children)
    index = len(nodes)
    nodes.append(here)
    xs += [children[k] for k in here.leaf_keys]
    for k, sub in snode.items():
        if type(sub) is Leaf:
            ranks[(index, k)] = len(ranks)
        elif sub:
            _record(sub, children[k], index, k, nodes, ranks, xs)


def _copied(snode) -> dict:
    """A copy of the state tree's containers (its Leafs the same objects): a later step compares
    the tree with it in one `==`, which compares Leafs by identity."""
    return {k: _copied(v) if type(v) is dict else v for k, v in snode.items()}


def _namer(names: dict):
    """`one(value)`: the global of the walk's code (in `names`) that holds `value`, one for each
    distinct type, key set or accessor."""
    named: dict = {}

    def one(value) -> str:
        if value not in named:
            named[value] = f"V{len(named)}"
            names[named[value]] = value
        return named[value]

    return one


def _compiled(nodes):
    """The route's walk as a Python function of `(model, grads)`, written out node by node (a
    loop over nodes cost more per container than the work itself): each place's parameter and
    gradient in the route's order; `_Off` where the model differs from the route (the caller
    compares the state tree with its copy). A node's locals are named by its depth (depth first,
    its parent's are still in them), and the code is compiled in parts of `_PART` nodes."""
    names: dict = {"Off": _Off, "SEQ": _SEQUENCES}
    one = _namer(names)
    parts: list[list] = []
    depth = [0] * len(nodes)
    for i, r in enumerate(nodes):
        if i % _PART == 0:
            parts.append([])
        d = depth[i] = depth[r.parent] + 1 if i else 0
        parts[-1] += _lines(i, r, nodes[r.parent], d, names, one)
    # the parts hand the locals on (`walk` starts them: the root is n0, g0)
    local = [f"{v}{d}" for d in range(max(depth) + 1) for v in ("n", "g", "get", "f", "k")]
    held = ", ".join(local)
    walk = ["def walk(model, grads):", "    xs = []; gs = []",
            f"    {held} = (model, grads) + (None,) * {len(local) - 2}"]
    outer: dict = {}  # the parts, for `walk` (kept in `names`, their globals, a reference cycle)
    for j, lines in enumerate(parts):
        source = "\n".join([f"def P{j}(xs, gs, {held}):", *lines, f"    return {held}"])
        exec(compile(source, f"<the route's walk, part {j}>", "exec"), names)  # noqa: S102 - our own code
        outer[f"P{j}"] = names.pop(f"P{j}")
        walk.append(f"    {held} = P{j}(xs, gs, {held})")
    walk.append("    return xs, gs")
    exec(compile("\n".join(walk), "<the route's walk>", "exec"), outer)  # noqa: S102 - our own code
    return outer.pop("walk")  # (kept in its globals, `outer`, it would be a reference cycle)


def _lines(i, r, parent, d, names, one) -> list:
    """The walk's code for node `i` (`r`, at depth `d`): lists, tuples and dicts, and dicts of
    gradients, read where they are, a module's parameter and submodule dicts too (`fields`); any
    other node through its `_Node` (`children`, `gradients`)."""
    names[f"N{i}"] = r
    lines, p = [], d - 1
    t, c = one(r.type), r.child_keys if r.seq else one(r.child_keys)
    if i:
        key = _literal(r.key, names, f"K{i}")
        if parent.fields is not None:
            lines.append(f"    n{d} = f{p}[{parent.field_of[r.key]}][{key}]")
        else:
            lines.append(f"    n{d} = {'n' if parent.seq or parent.type is dict else 'k'}{p}[{key}]")
        lines.append(f"    g{d} = None if get{p} is None else get{p}({key})")
    lines.append(f"    if type(n{d}) is not {t}: raise Off")
    if r.seq:
        lines.append(f"    if len(n{d}) != {c}: raise Off")
    elif r.type is dict:
        lines.append(f"    if n{d}.keys() != {c}: raise Off")
    elif r.fields is not None:
        lines.append(f"    f{d} = {one(r.kind.fields)}(n{d})")
        lines += [f"    if f{d}[{j}].keys() != {one(keys)}: raise Off" for j, keys in enumerate(r.fields)]
    else:
        lines.append(f"    k{d} = N{i}.children(n{d})")
    fast = f"type(g{d}) in SEQ and len(g{d}) == {c}" if r.seq else (
        f"type(g{d}) is dict and g{d}.keys() <= {c}")
    getter = "__getitem__" if r.seq else "get"
    lines.append(f"    get{d} = None if g{d} is None else g{d}.{getter} if {fast} "
                 f"else N{i}.gradients(n{d}, g{d})")
    if r.leaf_keys:
        kids = f"n{d}" if r.seq or r.type is dict else f"k{d}"
        if r.fields is not None:
            held_in = {r.field_of[k] for k in r.leaf_keys}
            kids = f"f{d}[{held_in.pop()}]" if len(held_in) == 1 else f"N{i}.children(n{d})"
        keys = _literal(tuple(r.leaf_keys), names, f"L{i}")
        whole = r.seq and r.leaf_keys == list(range(r.child_keys))  # (every entry a place)
        lines.append(f"    xs += {kids}" if whole else f"    xs += map({kids}.__getitem__, {keys})")
        given = f"g{d} if type(g{d}) in SEQ else " if whole else ""
        nones = (None,) * len(r.leaf_keys)
        lines.append(f"    gs += {nones} if get{d} is None else {given}map(get{d}, {keys})")
    return lines


_PART = 200  # nodes a function: compiling one function of thousands of nodes takes ~100 MB


def _literal(key, names, name) -> str:
    """`key` written into the walk's code: an int or str (or a tuple of them) as itself (a
    constant of the code, read faster than a global), anything else as the global `name`."""
    if type(key) in (int, str) or type(key) is tuple and all(type(k) in (int, str) for k in key):
        return repr(key)
    names[name] = key
    return name


class Route:
    """The places of a State's planned step (see the module's docstring)."""

    def __init__(self, tree, model, groups):
        self.tree = tree
        self.nodes: list[_Node] = []
        ranks: dict = {}
        xs: list = []
        _record(tree, model, 0, None, self.nodes, ranks, xs)
        self.same_xs, self.copy = SameObjects(xs), _copied(tree)
        self.walk = None  # written at the first step that follows the route (`_compiled`)
        self.modules = any(r.kind.grad_children is not None for r in self.nodes)  # (see `_apart`)
        member = {id(leaf): (g, m) for g, group in enumerate(groups) for m, leaf in enumerate(group.leaves)}
        places = [(i, k) for i, r in enumerate(self.nodes) for k in r.leaf_keys]
        first: list[list] = [[None] * len(group.leaves) for group in groups]
        extra: list[dict] = [{} for _ in groups]
        for place in sorted(range(len(places)), key=lambda p: ranks[places[p]]):
            i, k = places[place]
            g, m = member[id(self.nodes[i].snode[k])]
            if first[g][m] is None:
                first[g][m] = place
            else:
                extra[g].setdefault(m, []).append(place)
        # per group: each member's first place, and a tied member's others
        self.groups = [
            (group, operator.itemgetter(*firsts), sorted(more.items()))
            for group, firsts, more in zip(groups, first, extra)
        ]
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
        try:
            if self.walk is None:
                self.walk = _compiled(self.nodes)
            xs, gs = self.walk(model, grads)
            if not (self.tree == self.copy and self.same_xs(xs)):
                raise _Off
            if self.modules and not _apart(gs):
                raise _Off
            return [_ready(group, pick, tied, xs, gs) for group, pick, tied in self.groups]
        except Exception:  # noqa: BLE001 - any difference: the general path reports it
            self.stale = True
            for group, _, _ in self.groups:
                if group.span is not None:
                    group.span.now = None  # (a view `expect` found is for a replayed step only)
            return None


def _listed(picked) -> list:
    return list(picked) if type(picked) is tuple else [picked]  # (itemgetter of one key)


def _ready(group, pick, tied, xs, gs):
    """One group's `(group, xs, dxs, given)` from the places' parameters `xs` and gradients `gs`,
    if the group's snapshot still holds for them; else `_Off`."""
    if not group.steppable():
        raise _Off
    pxs, dxs = _listed(pick(xs)), _listed(pick(gs))
    extra, sums = [], []
    for m, more in tied:
        given = ties.given([dxs[m], *map(gs.__getitem__, more)])
        if not given:
            raise _Off  # (no gradient at any place: the member does not step, the group cannot)
        dxs[m] = given[0]
        extra.extend(given[1:])
        sums.append((m, given))
    if not group.still(pxs, dxs + extra):
        raise _Off
    for m, given in sums:
        if len(given) > 1:
            dxs[m] = ties.member_sum(group, m, pxs[m], given)
    return group, pxs, dxs, dxs


def remember(state, model, found, work, results) -> None:
    """After a general `update_`: record its route where every Leaf stepped in the engine's
    groups (and the State's plan has none that still serves), each group with its snapshot."""
    plan = planning.PLANS.get(state)
    if plan is None or results or plan.converted or len(work) != len(plan.groups):
        return
    for group, members in work:
        firsts = [c.grads[0] for c in members]
        given = [m for m, c in enumerate(members) for _ in c.grads[1:]]
        group.snapshot([c.x for c in members], firsts + [g for c in members for g in c.grads[1:]], given)
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
