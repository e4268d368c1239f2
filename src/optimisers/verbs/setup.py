"""`setup`: one Leaf per distinct trainable array, shared by every place of a tied array."""

from __future__ import annotations

from typing import Any

from optimisers import ops
from optimisers.core import dispatch
from optimisers.core.rule import Rule
from optimisers.core.state import (
    Leaf,
    State,
)
from optimisers.core.tree import format_path, is_param, kind_of, trainable_children


def rule_chooser(rule):
    if isinstance(rule, Rule):
        return lambda path, x: rule
    if isinstance(rule, (State, Leaf)):
        raise TypeError(
            f"expected a rule (e.g. optimisers.Adam()), got a {type(rule).__name__}: optimiser state "
            "from setup. To continue training use update(state, model, grads); to change "
            "hyperparameters, adjust(state, eta); a State is already set up, so it goes to neither "
            "setup nor optimisers.optax.transform"
        )
    if isinstance(rule, type) and issubclass(rule, Rule):
        raise TypeError(f"setup expects a rule instance, e.g. {rule.__name__}(), not the class")
    if callable(rule):

        def choose(path, x):
            chosen = rule(path, x)
            if not isinstance(chosen, Rule):
                raise TypeError(
                    f"the rule function returned {chosen!r} for {format_path(path)}; "
                    "expected an optimisers.Rule"
                )
            return chosen

        return choose
    raise TypeError(
        f"setup expects an optimisers.Rule (e.g. Adam()) or a function (path, x) -> Rule, got {rule!r}"
    )


def setup(rule, model) -> State:
    """Initialise the optimiser state of `model`: one `Leaf(rule, rule.init(x))` per distinct
    trainable array, shared by every place that array appears (tied weights).

    `rule` may be a function `(path, x) -> Rule` that chooses a rule per parameter; a tied array
    gets the rule chosen at its first path. Raises ValueError when two distinct writable arrays
    overlap in memory (e.g. `W` and `W.T`), naming both paths.
    """
    jax = dispatch.loaded("jax")  # registers State/Leaf as JAX pytrees before any jit sees them
    choose = rule_chooser(rule)
    built: dict[int, Any] = {}  # id(model node) -> its state sub-tree (None: nothing trainable)
    arrays: list[tuple[tuple, Any]] = []
    keys: dict[tuple, frozenset] = {}  # see State._keys

    def build(node, path):
        key = id(node)
        if key in built:
            return built[key]
        if is_param(node):
            r = choose(path, node)
            result = Leaf(r, _init(r, node, path))
            result._shape, result._owns = tuple(node.shape), True
            arrays.append((path, node))
        else:
            kind = kind_of(node)
            result = None
            if kind is not None:
                sub = {}
                for k, child in trainable_children(node, kind):
                    s = build(child, path + (k,))
                    if s is not None:
                        sub[k] = s
                result = sub or None
                everything = kind.children(node)
                if result and len(everything) != len(sub):
                    keys[path] = frozenset(k for k, _ in everything)
        built[key] = result
        return result

    tree = build(model, ())
    _check_overlaps(arrays)
    state = State(tree, keys)
    if arrays and jax is not None:
        jax.plan_flatten(state, arrays[0][1])
    return state


def _init(rule, x, path):
    """`rule.init(x)`; a parameter the rule refuses (a complex one for Lion, a vector for Muon) is
    reported with its path."""
    try:
        return rule.init(x)
    except (TypeError, ValueError) as e:
        if type(e) not in (TypeError, ValueError):
            raise  # a subclass may not take a message alone
        raise type(e)(f"the parameter at {format_path(path)}: {e}") from None


def _check_overlaps(arrays):
    """Distinct writable arrays sharing memory would be written twice by an in-place update."""
    spans = []
    for path, x in arrays:
        b = ops.backend(x)
        if b.writable(x):
            start, stop = b.memory_span(x)
            if stop > start:
                spans.append((start, stop, path, x))
    spans.sort(key=lambda s: s[0])
    open_spans: list = []
    for start, stop, path, x in spans:
        open_spans = [s for s in open_spans if s[1] > start]
        for _, _, other_path, other in open_spans:
            if ops.backend(x).shares_memory(x, other):
                raise ValueError(
                    f"parameters at {format_path(other_path)} and {format_path(path)} are distinct "
                    "arrays over the same memory (a view such as W.T?); an in-place update would "
                    "write it twice. Use one array at both places to tie them, or copy one."
                )
        open_spans.append((start, stop, path, x))
