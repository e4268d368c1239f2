"""`setup`: one Leaf per distinct trainable array, shared by every place of a tied array."""

from __future__ import annotations

from typing import Any

from optimisers import ops
from optimisers.core import dispatch
from optimisers.core.rule import Rule
from optimisers.core.state import Leaf, State
from optimisers.core.tree import format_path, is_param, kind_of, trainable_children, walked
from optimisers.engine.initial_state import initial_states


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

    `rule` may be a function `(path, x) -> Rule` that chooses a rule per parameter. It is asked
    at every place of a tied array, and every place must get an equal rule (the places share one
    Leaf); ValueError names two places that got different rules. Raises ValueError when two
    distinct writable arrays overlap in memory (e.g. `W` and `W.T`), naming both paths.
    """
    jax = dispatch.loaded("jax")  # registers State/Leaf as JAX pytrees before any jit sees them
    choose = rule_chooser(rule)
    per_place = not isinstance(rule, Rule)
    built: dict[int, Any] = {}  # id(model node) -> its state sub-tree (None: nothing trainable)
    chosen: dict[int, tuple] = {}  # id(parameter) -> (its first path, the rule chosen there)
    keys: dict[tuple, frozenset] = {}  # see State._keys
    made: list[tuple] = []  # (Leaf, rule, parameter, path), in the order of the walk

    def build(node, path):
        key = id(node)
        if key in built:
            if per_place:
                _confirm_rules(node, path, choose, chosen)
            return built[key]
        if is_param(node):
            r = choose(path, node)
            chosen[key] = (path, r)
            result = Leaf(r, None)  # its state: below, with the others (`initial_states`)
            result._shape, result._owns = tuple(node.shape), True
            made.append((result, r, node, path))
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

    tree = walked(build, model, ())
    for (leaf, *_), state in zip(made, initial_states([m[1:] for m in made])):
        leaf._state = state
    _check_overlaps([(path, x) for _, _, x, path in made])
    state = State(tree, keys)
    if made and jax is not None:
        jax.plan_flatten(state, made[0][2])
    return state


def _confirm_rules(node, path, choose, chosen):
    """Ask the rule function again at another place of a tied array (or of a tied sub-model),
    and refuse a rule that differs from the one chosen at the first place."""
    if is_param(node):
        first_path, first = chosen[id(node)]
        again = choose(path, node)
        try:
            same = again is first or bool(again == first)
        except (TypeError, ValueError):  # a hyperparameter that is an array has no single truth value
            same = False
        if not same:
            raise ValueError(
                f"the rule function chose {first!r} at {format_path(first_path)} and {again!r} at "
                f"{format_path(path)}, places of one tied array, which has one optimiser state: "
                "return the same rule at every place of a tie"
            )
        return
    kind = kind_of(node)
    if kind is not None:
        for k, child in trainable_children(node, kind):
            _confirm_rules(child, path + (k,), choose, chosen)


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
