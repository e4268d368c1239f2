"""`adjust` / `adjust_` (hyperparameters) and `freeze_` / `thaw_` (which Leafs move)."""

from __future__ import annotations

from optimisers.core.eager import eager_under_compile
from optimisers.core.rule import Rule, has_schedules
from optimisers.core.state import Leaf, State, leaf_paths, map_leaves
from optimisers.engine.layout import independent


def _leaves_of(tree, name):
    if isinstance(tree, Leaf):
        return [tree]
    if isinstance(tree, State):
        return [leaf for _, leaf in leaf_paths(tree.tree)]
    raise TypeError(
        f"{name} expects optimiser state (a State from setup, a part of one such as "
        f"state['encoder'], or a Leaf), got a {type(tree).__name__}; {_state_hint(tree)}"
    )


def _state_hint(tree) -> str:
    """Where the State is, for the containers optax and Flax users hold it in."""
    if hasattr(tree, "opt_state"):  # nnx.Optimizer, flax's TrainState
        return "pass its .opt_state"
    if hasattr(tree, "hyperparams") and hasattr(tree, "inner_state"):
        return (
            "this is optax.inject_hyperparams' state: its .inner_state is the State, and a "
            "hyperparameter it injects is changed in its .hyperparams (it rebuilds the rule "
            "from those at every step)"
        )
    if isinstance(tree, tuple) and any(isinstance(x, State) for x in tree):
        return "an optax.chain state is a tuple: adjust its entry that is a State"
    return "did you pass the model?"


def _adjusted_rules(tree, eta, hyper, name) -> tuple[list, dict[int, Rule]]:
    leaves = _leaves_of(tree, name)
    if eta is not None:
        hyper = {"eta": eta, **hyper}
    if not hyper:
        raise TypeError(f"{name} needs something to change: a learning rate or hyperparameter=value")
    rules = {}
    used: set[str] = set()
    for leaf in leaves:
        if id(leaf.rule) not in rules:
            rules[id(leaf.rule)] = leaf.rule.adjust(**hyper)
            used.update(k for k in hyper if k in leaf.rule.hyperparameters())
    unknown = [k for k in hyper if k not in used]
    if unknown:
        valid = sorted({n for leaf in leaves for n in leaf.rule.hyperparameters()})
        raise ValueError(
            f"{name}: no rule in this state has a hyperparameter {unknown[0]!r}; "
            f"valid names here: {', '.join(valid) or 'none'}"
        )
    return leaves, rules


@eager_under_compile
def adjust(tree, eta=None, **hyper):
    """A copy of the state (or part of it, or a Leaf) with hyperparameters changed and optimiser
    state kept: `adjust(state, 0.01)` sets the learning rate, `adjust(state, beta=(0.8, 0.99))`
    any named hyperparameter. A name that no rule in the tree has is an error."""
    _, rules = _adjusted_rules(tree, eta, hyper, "adjust")

    def fresh(leaf):
        rule = rules[id(leaf.rule)]
        state = independent(leaf, leaf.state)
        return leaf._successor(rule, rule.with_counters(state) if has_schedules(rule) else state)

    if isinstance(tree, Leaf):
        return fresh(tree)
    return State(map_leaves(fresh, tree.tree), tree._keys)


@eager_under_compile
def adjust_(tree, eta=None, **hyper):
    """Like `adjust`, but changes the Leafs in place; returns `tree`."""
    leaves, rules = _adjusted_rules(tree, eta, hyper, "adjust_")
    for leaf in leaves:
        leaf.rule = rule = rules[id(leaf.rule)]
        if has_schedules(rule):  # a schedule needs a step count in the state
            state = leaf.state
            counted = rule.with_counters(state)
            if counted is not state:
                leaf.state = counted
    return tree


def freeze_(tree):
    """Mark every Leaf of a state (or part of one) frozen: updates skip it, its state is kept."""
    for leaf in _leaves_of(tree, "freeze_"):
        leaf.frozen = True
    return tree


def thaw_(tree):
    """Undo `freeze_`: the Leafs are updated again, from the state they had when frozen."""
    for leaf in _leaves_of(tree, "thaw_"):
        leaf.frozen = False
    return tree
