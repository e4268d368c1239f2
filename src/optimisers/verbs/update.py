"""`update` (pure) and `update_` (in place): the engine steps, then the verb commits, writing the
parameters and rebuilding the model and state trees (the phases: docs/architecture.md)."""

from __future__ import annotations

from typing import Any

from optimisers import ops
from optimisers.core.eager import eager_under_compile
from optimisers.core.rule import NewValue
from optimisers.core.state import Leaf, State, map_leaves
from optimisers.core.tree import kind_of, rebuilt, walked
from optimisers.engine import execute
from optimisers.engine.layout import independent
from optimisers.engine.locks import lock


def _check_args(state, grads, name):
    if not isinstance(state, State):
        hint = " (arguments are (state, model, grads))" if not isinstance(state, Leaf) else ""
        raise TypeError(f"{name} expects the State returned by setup, got {type(state).__name__}{hint}")
    if len(grads) != 1:
        raise TypeError(
            f"{name}(state, model, grads) takes one gradient tree; got {len(grads)}"
            + (" (no gradients were given)" if not grads else "")
        )


@eager_under_compile
def update(state: State, model, *grads):
    """One optimisation step, pure: returns `(new_state, new_model)` and leaves the caller's state,
    model and gradients exactly as they were. Every trainable array of the result is new."""
    _check_args(state, grads, "update")
    values: dict[int, Any] = {}

    def place(leaf, x):
        key = id(leaf)
        if key not in values:
            moved = results.get(key)
            values[key] = moved[1] if moved else ops.copy(x)
        return values[key]

    with lock(state):
        _, results = execute.out_of_place(state, model, grads[0], pure=True)
        return _next_state(state, results), rebuild(state.tree, model, place)


def _next_state(state: State, results: dict) -> State:
    """A new State after a pure step: each Leaf's new state where `results` has one, else its
    own, never sharing the update engine's buffers with `state`."""

    def leaf_of(leaf):
        moved = results.get(id(leaf))
        return leaf._successor(leaf.rule, independent(leaf, moved[0] if moved else leaf.state))

    return State(map_leaves(leaf_of, state.tree), state._keys)


def stepped(state: State, model, grads: tuple, name: str):
    """The pure part of `update`: the new State and each moving Leaf's `(new_state, step)`,
    keyed by `id(leaf)` of the old State's Leafs (`optimisers.optax` turns the steps into updates)."""
    _check_args(state, grads, name)
    _, results = execute.out_of_place(state, model, grads[0])
    return _next_state(state, results), results


@eager_under_compile
def update_(state: State, model, *grads):
    """One optimisation step in place: mutates the state's Leafs and writes every writable
    parameter in place. Returns `(state, model)`; use the returned model, since immutable arrays
    (JAX) are replaced by new ones. Gives the same numbers as `update`, bit for bit."""
    _check_args(state, grads, "update_")
    written: dict[int, Any] = {}  # id(leaf) -> the first updated array, which holds the new value

    def place(leaf, x):
        if id(leaf) in in_engine:
            return x  # already stepped in place
        moved = results.get(id(leaf))
        if moved is None or moved[1] is None:
            return x
        step = moved[1]
        b = ops.backend(x)
        first = written.get(id(leaf))
        if first is not None:
            if first is x:
                return x
            if b.writable(x):
                return b.assign_(x, first)
            return first if first.dtype == x.dtype else b.replaced(x, first)
        if isinstance(step, NewValue):
            new = b.assign_(x, step.value) if b.writable(x) else b.replaced(x, step.value)
        else:
            new = b.subtract_(x, step) if b.writable(x) else b.subtract(x, step)
        written[id(leaf)] = new
        return new

    with lock(state):
        stepped_ = execute.in_place(state, model, grads[0])
        if stepped_ is None:  # every parameter stepped in place, along the last step's route
            return state, model
        found, results, in_engine = stepped_
        for key, (new_state, _) in results.items():
            found[key].leaf.state = new_state
        if all(step is None for _, step in results.values()):
            return state, model  # every parameter was stepped in place (or not at all)
        return state, rebuild(state.tree, model, place)


def rebuild(tree, model, place):
    """The model with each parameter replaced by `place(leaf, x)`, each shared container rebuilt
    once, and everything the state does not cover returned as the same object."""
    done: dict[int, Any] = {}

    def visit(snode, node):
        if isinstance(snode, Leaf):
            return place(snode, node)
        key = id(node)
        if key in done:
            return done[key]
        if not snode:
            return node
        kind = kind_of(node)
        children = dict(kind.children(node))
        pairs = [(k, children[k]) for k in snode]
        result = rebuilt(node, kind, pairs, lambda k, child: visit(snode[k], child))
        done[key] = result
        return result

    return walked(visit, tree, model)
