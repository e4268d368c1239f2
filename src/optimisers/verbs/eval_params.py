"""`eval_params`: the model at its evaluation point (`Lookahead`'s slow weights), for evaluating
and saving, without changing the model or the state."""

from __future__ import annotations

from typing import Any

from optimisers import ops
from optimisers.core.eager import eager_under_compile
from optimisers.core.state import Leaf, State, path_of
from optimisers.core.tree import format_path
from optimisers.engine.gather import Contribution, gather
from optimisers.engine.locks import lock
from optimisers.verbs.update import rebuild


@eager_under_compile
def eval_params(state: State, model):
    """The model with each parameter at its rule's evaluation point: `Lookahead`'s slow weights,
    and the parameter itself for rules without one (`Rule.eval_value`), through chains and
    wrappers. Ties are kept: every place of a tied parameter gets the same new array. Pure: the
    model and the state are not changed; parameters that move are new arrays (never the state's
    own), the others and every container without such a parameter are the model's own objects
    (so for a model without such rules the result is `model` itself). Frozen parameters are at
    their rule's evaluation point too (their state is kept while they are frozen)."""
    if not isinstance(state, State):
        hint = " (arguments are (state, model))" if not isinstance(state, Leaf) else ""
        raise TypeError(f"eval_params expects the State returned by setup, got {type(state).__name__}{hint}")
    with lock(state):
        found = gather(state.tree, model, None, state._keys)  # checks the model fits the state
        values: dict[int, Any] = {key: _evaluation_point(c, state.tree) for key, c in found.items()}
    return rebuild(state.tree, model, lambda leaf, x: values[id(leaf)])


def _evaluation_point(c: Contribution, tree):
    """The parameter of Contribution `c` at its rule's evaluation point, as a new parameter like
    it (or the parameter itself, where the rule says it is its own evaluation point)."""
    x = c.x
    value = c.leaf.rule.eval_value(c.leaf.state, x)
    if value is x:
        return x
    shape = getattr(value, "shape", None)
    if shape is None or tuple(shape) != tuple(x.shape):
        raise ValueError(
            f"{type(c.leaf.rule).__name__}.eval_value gave a value of shape "
            f"{None if shape is None else tuple(shape)} for the parameter at "
            f"{format_path(path_of(tree, c.leaf))} of shape {tuple(x.shape)}"
        )
    b = ops.backend(x)
    with b.no_grad():
        return b.replaced(x, value)
