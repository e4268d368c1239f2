"""The optimiser state tree: `Leaf` holds one parameter's rule and state, `State` wraps the tree.

A state tree mirrors the model: a dict from child key to sub-tree for each container that holds
parameters, and a `Leaf` at each parameter. Tied parameters share one `Leaf` object; identity of
Leafs, not of arrays, is what `update` uses to decide what is tied.
"""

from __future__ import annotations

import numbers
from typing import Any

from optimisers.core.tree import format_path, walked

_WATCHED = frozenset(("rule", "frozen", "_state"))
# Leafs whose state the update engine keeps in buffers of its own, each to the object whose
# `state_of(leaf)` reads that state whole: a table (`get`, `pop`) that `optimisers.engine.layout`
# owns and registers here, holding no Leaf alive (a Leaf given another state leaves it)
_held_by: Any = None


def register_held_states(table) -> None:
    """Called once by the update engine: see `_held_by`."""
    global _held_by
    _held_by = table


class Leaf:
    """One trainable array's optimiser: its `rule`, the rule's `state`, and whether it is `frozen`.

    Place the same Leaf at several positions of a state tree to tie those parameters.
    """

    __slots__ = ("rule", "_state", "frozen", "_shape", "_placed", "_owns", "__weakref__")
    # how many times any Leaf's rule, frozen flag or state was set: the engine checks its groups'
    # members again only after one was (`Group.steppable`), not on every step
    edits = 0

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        if name in _WATCHED:
            Leaf.edits += 1

    def __init__(self, rule, state, frozen: bool = False):
        init = object.__setattr__  # a new Leaf is in no engine group yet: nothing to count
        init(self, "rule", rule)
        init(self, "_state", state)
        init(self, "frozen", frozen)
        # the shape of the parameter the state was made for (None: read from the state's arrays at
        # the next update), which an update requires: the state's arrays would not fit another
        init(self, "_shape", None)
        # placed at another position by hand (`state["b"] = state["a"]`): its places may hold
        # different arrays, which the next update makes equal (else an update refuses them)
        init(self, "_placed", False)
        # its state's arrays are its own alone (made by setup, a copy or a load): the engine may
        # step them in place as its buffers (arrays a user assigned, or another State shares, are copied)
        init(self, "_owns", False)

    def _successor(self, rule, state) -> Leaf:
        """A new Leaf with `rule` and `state`, frozen as this one is and knowing what it knows of
        its parameter (what `update` and `adjust` return in place of this Leaf)."""
        new = Leaf(rule, state, self.frozen)
        new._shape, new._placed = self._shape, self._placed
        return new

    @property
    def state(self):
        """The rule's state for this parameter."""
        held = _held_by
        if held:
            holder = held.get(self)
            if holder is not None:
                return holder.state_of(self)
        return self._state

    @state.setter
    def state(self, value):
        if _held_by:
            _held_by.pop(self, None)  # a replaced state leaves the engine's buffers; it re-plans
        self._owns = False
        self._state = value

    def __repr__(self) -> str:
        frozen = ", frozen=True" if self.frozen else ""
        return f"Leaf({self.rule!r}, {describe(self.state)}{frozen})"

    # pickle and copy.deepcopy see the state itself, not the update engine's buffers it may live
    # in (the engine plans again at the next update_)
    def __getstate__(self):
        return (self.rule, self.state, self.frozen, self._shape, self._placed)

    def __setstate__(self, saved):
        self.rule, self._state, self.frozen, self._shape, self._placed = saved
        self._owns = True  # a copy's arrays are new

    def __copy__(self):  # a shallow copy shares its arrays with this Leaf: neither owns them alone
        new = self._successor(self.rule, self.state)
        self._owns = False
        return new

    def __deepcopy__(self, memo):
        import copy

        new = memo[id(self)] = Leaf.__new__(Leaf)
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        # an array that another Leaf copied along with this one also holds (a State derived by
        # `adjust` from this one, copied together with it) stays shared in the copy: not its own
        holders = memo.setdefault("optimisers.Leaf arrays", {})
        parts: list = []
        flatten_state(new._state, parts)
        for part in parts:
            if getattr(part, "ndim", 0) > 0:
                first = holders.setdefault(id(part), (new, part))[0]
                if first is not new:
                    first._owns = new._owns = False
        return new


def describe(value) -> str:
    """A compact view of a state value: arrays as dtype[shape], containers recursively."""
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        dtype = str(value.dtype).replace("torch.", "")
        return f"{dtype}{list(shape)}"
    if isinstance(value, tuple):
        inner = ", ".join(describe(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in value.items()) + "}"
    return repr(value)


class State:
    """The optimiser state of a whole model, as returned by `setup` and `update`.

    Index it like the model to reach a part: `state["encoder"]`, `state[0]`. Indexing gives a
    `State` for a container and the `Leaf` itself for a parameter; assigning a `Leaf` (or `State`)
    places it, so `state["b"] = state["a"]` ties `b` to `a`.
    """

    # weakly keyed: optimisers.engine.locks.lock
    __slots__ = ("_tree", "_build", "_keys", "__weakref__")

    def __init__(self, tree: Any = None, keys: dict | None = None):
        self._tree = {} if tree is None else tree
        self._build = None  # for a State built on first use: what builds its tree
        # path -> every child key the model had there at setup, for containers that also held
        # things not trained (an update looks for new parameters only under new keys)
        self._keys = keys

    @property
    def tree(self):
        """The state tree: a dict from child key to sub-tree per container, a Leaf per parameter."""
        build = self._build
        if build is not None:  # a pytree backend's unflatten (JAX): the Leafs are made when used
            self._build = None
            self._tree = build()
        return self._tree

    @tree.setter
    def tree(self, value):
        self._build = None
        self._tree = value

    @classmethod
    def _lazy(cls, build) -> State:
        """A State whose tree `build()` makes when it is first asked for."""
        state = cls.__new__(cls)
        state._tree, state._build, state._keys = None, build, None
        return state

    def __getstate__(self):
        return (self.tree, self._keys)

    def __setstate__(self, saved):
        self.tree, self._keys = saved

    def __getitem__(self, key):
        if isinstance(self.tree, Leaf):
            raise TypeError("this State is a single Leaf; it has no children")
        try:
            child = self.tree[key]
        except KeyError:
            keys = ", ".join(repr(k) for k in self.tree) or "none"
            raise KeyError(
                f"no trainable parameters under key {key!r} in this state; its keys: {keys}"
            ) from None
        return child if isinstance(child, Leaf) else State(child)

    def __setitem__(self, key, value):
        if isinstance(value, State):
            value = value.tree
        if not isinstance(value, (Leaf, dict)):
            raise TypeError(f"a State holds Leafs and States, got {type(value).__name__}")
        for _, leaf in leaf_paths(value):
            leaf._placed = True
        self.tree[key] = value

    def __contains__(self, key) -> bool:
        return not isinstance(self.tree, Leaf) and key in self.tree

    def keys(self):
        return [] if isinstance(self.tree, Leaf) else list(self.tree)

    def leaves(self) -> list[Leaf]:
        """The distinct Leafs, depth first."""
        return [leaf for _, leaf in leaf_paths(self.tree)]

    def __repr__(self) -> str:
        lines = ["State("]
        _render(self.tree, (), lines, {}, 1)
        lines.append(")")
        return "\n".join(lines)


def leaf_paths(tree) -> list[tuple[tuple, Leaf]]:
    """`(first path, Leaf)` for each distinct Leaf of a state tree, depth first."""
    seen: set[int] = set()
    out: list = []

    def visit(node, path):
        if id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, Leaf):
            out.append((path, node))
        else:
            for k, child in node.items():
                visit(child, path + (k,))

    walked(visit, tree, ())
    return out


def _render(node, path, lines, first_seen, depth):
    pad = "  " * depth
    if isinstance(node, Leaf):
        if id(node) in first_seen:
            lines.append(f"{pad}(tied to {format_path(first_seen[id(node)])})")
        else:
            first_seen[id(node)] = path
            lines.append(f"{pad}{node!r}")
        return
    for key, child in node.items():
        label = f"{pad}{key!r}:"
        if isinstance(child, Leaf):
            sub: list[str] = []
            _render(child, path + (key,), sub, first_seen, 0)
            lines.append(f"{label} {sub[0].strip()}")
        else:
            lines.append(label)
            _render(child, path + (key,), lines, first_seen, depth + 1)


def map_leaves(fn, tree):
    """Rebuild a state tree with each distinct Leaf replaced by `fn(leaf)` (once per Leaf), keeping
    shared Leafs and shared sub-trees shared."""
    done: dict[int, Any] = {}

    def visit(node):
        key = id(node)
        if key not in done:
            if isinstance(node, Leaf):
                done[key] = fn(node)
            else:
                done[key] = {k: visit(child) for k, child in node.items()}
        return done[key]

    return walked(visit, tree)


# --- a rule state as (spec, parts) -----------------------------------------------------------


def flatten_state(state, parts: list):
    """Append the non-container parts of a rule state (arrays, numbers) to `parts`; return its
    structure (tuples, lists and NamedTuples are containers)."""
    if isinstance(state, (tuple, list)):
        specs = []
        for s in state:  # parts inline, containers by recursion: this runs per Leaf per update
            if isinstance(s, (tuple, list)):
                specs.append(flatten_state(s, parts))
            else:
                parts.append(s)
                specs.append(None)
        return (type(state), tuple(specs))
    parts.append(state)
    return None


def unflatten_state(spec, parts):
    """Inverse of `flatten_state`, consuming `parts` (an iterator)."""
    if spec is None:
        return next(parts)
    cls, specs = spec
    values = [next(parts) if s is None else unflatten_state(s, parts) for s in specs]
    if cls is tuple or cls is list:
        return cls(values)
    return cls(*values)  # NamedTuple


_SCALAR_TYPE: dict[type, bool | None] = {}  # True: a number; False: never scalar; None: ask ndim


def is_scalar(part) -> bool:
    """A number or a 0-d array in a rule state: a step counter, say, as opposed to an array shaped
    like the parameter."""
    t = type(part)
    if t not in _SCALAR_TYPE:  # the ABC check is slow, so its answer is kept per type
        array_like = hasattr(part, "ndim")
        _SCALAR_TYPE[t] = True if issubclass(t, numbers.Number) else (None if array_like else False)
    kind = _SCALAR_TYPE[t]
    return kind if kind is not None else part.ndim == 0


_PLAIN_NUMBERS = (bool, int, float, complex)


def scalar_key(part):
    """What makes two scalar state parts interchangeable: equal plain Python numbers (immutable,
    so one can stand for the other; a checkpoint restores step 1000 as a new int per Leaf), or
    else the same object (arrays, tracers: comparing their values would mean reading them)."""
    return (type(part), part) if type(part) in _PLAIN_NUMBERS else id(part)


def path_of(tree, leaf) -> tuple:
    """The first path of `leaf` in a state tree (for error messages only: a walk)."""
    return next((path for path, found in leaf_paths(tree) if found is leaf), ())
