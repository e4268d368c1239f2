"""Any rule as an optax `GradientTransformation`, for optax chains, Flax NNX and linen.

    tx = optimisers.optax.transform(optimisers.Adam(1e-3))
    state = tx.init(params)                        # optimisers.setup: ties found by identity
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)  # == optimisers.update(...)'s model, bit for bit

optax adds updates to parameters, so the update handed back is `-step` for a rule's step
`x_new = x - step`: IEEE arithmetic defines `x - s` as `x + (-s)`, so `apply_updates` gives
exactly the parameter `optimisers.update` gives. A parameter that does not move gets `-0.0`,
which keeps every value, negative zero included. The one inexact case is a rule that sets the
parameter to a new value (`MixedPrecision`, whose step is its master copy rounded to the
parameter's dtype; `Lookahead` at its synchronisations): its update is `new - x`, and
`x + (new - x) == new` holds whenever `new` lies within a factor of two of `x` (Sterbenz's
lemma), which any step smaller than the parameter satisfies; otherwise it is `new` to within a
rounding of the update.

The optax state is the `State` that `setup` returns: it carries the ties and the hyperparameters
as pytree leaves, so it can go through `jax.jit`, and `optimisers.adjust(state, eta)` changes the
learning rate without recompiling. Importing this module imports jax and optax; `import
optimisers` does not import it (it is reached as `optimisers.optax` on first use).
"""

from __future__ import annotations

import dataclasses
import numbers
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax as _optax

from optimisers.core import rule as _rule
from optimisers.core.rule import NewValue, Rule
from optimisers.core.state import Leaf, State, flatten_state, map_leaves, unflatten_state
from optimisers.core.tree import kind_of, walked
from optimisers.verbs.setup import rule_chooser, setup
from optimisers.verbs.update import rebuild, stepped

__all__ = ["transform"]


def transform(rule) -> _optax.GradientTransformationExtraArgs:
    """An optax `GradientTransformationExtraArgs` that runs `rule` (an `optimisers.Rule`, or a
    function `(path, x) -> Rule` as `setup` takes) with tied weights handled.

    * `init(params)` is `optimisers.setup(rule, params)`: tied arrays (the same object at several
      places) share one optimiser state. It works under `jax.jit`, `jax.eval_shape` and
      `jax.vmap` as eagerly, ties found by identity among the arrays the traced function holds:
      a model built inside the function keeps its ties, but JAX hands each argument leaf its own
      tracer, so a tie between arguments is not seen: an eager update with that model refuses
      the state, a jitted one trains the places apart. Close over the model instead
      (`jax.jit(lambda: tx.init(params))()`): closed-over arrays keep their identity. NNX
      `Variable`s (an `nnx.State`, as `nnx.Optimizer` hands it) are read as their values. A
      leaf that is not an array (an Equinox module's function) is a `TypeError`. The State's
      numbers (step counters, hyperparameters) stay as `setup` makes them, so that an eager
      `update` computes exactly what an eager `optimisers.update` does; JAX sees them as 0-d
      arrays (leaves), so Flax stores and updates them and `jit` traces them.
    * `update(updates, state, params)` returns `(updates, new_state)` such that
      `optax.apply_updates(params, updates)` is the model `optimisers.update(state, params,
      updates)` returns, bit for bit (see the module docstring for `MixedPrecision`). `params` is
      required. Under `jax.jit` the state says what is tied: tied places get the summed gradient
      and the same update. Extra keyword arguments (from `optax.chain`) are ignored.

    The state is an `optimisers.State`, so `optimisers.adjust(state, 1e-4)` changes the learning
    rate (inside `optax.chain`, adjust the chain's entry for this transformation). A
    transformation built for an update without having made a state with its own `init` applies
    the hyperparameters that `rule` holds as JAX arrays instead of the State's: that is how
    `optax.inject_hyperparams(lambda learning_rate:
    transform(Adam(learning_rate)))(learning_rate=schedule)` hands over each step's value, with a
    new transformation at every step (traced under `jit`, so nothing compiles again). Change such
    a value where it comes from (inject_hyperparams' `state.hyperparams`), not with `adjust`. A
    transformation kept for the whole run (`nnx.Optimizer`'s, a `TrainState`'s) hands its values
    to the states its `init` makes, as starting values that `adjust` changes.
    """
    rule_chooser(rule)  # a State, an optax transformation, a class: fail now
    live = _LiveHyperparameters(rule)

    def init_fn(params):
        variables, params = params, _values_of(params)
        _check_leaves(params, "init")
        state = setup(rule, params)  # under jit as eagerly: see the docstring
        live.made_states = True
        if variables is not params:
            _annotate_sharded(state, variables, params)
        return state

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        return _update(live, updates, state, params)

    return _optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _update(live, updates, state, params):
    """`transform`'s `update`: `(updates, new_state)`, each update the rule's step negated."""
    if params is None:
        raise TypeError(
            "optimisers.optax.transform(...).update(updates, state, params) needs the current "
            "params: optimisers' rules read the parameters and its state is keyed by them"
        )
    if not isinstance(state, State):
        raise TypeError(
            "optimisers.optax.transform(...).update expects the state its init returned (an "
            f"optimisers.State), got a {type(state).__name__}; arguments are "
            "(updates, state, params)"
        )
    params, grads = _values_of(params), _values_of(updates)
    state = live.applied(state, params)
    new_state, results = stepped(state, params, (grads,), "transform(...).update")
    made: dict = {}

    def place(leaf, x):
        key = id(leaf)
        if key not in made:
            moved = results.get(key)
            made[key] = _optax_update(moved[1] if moved else None, x)
        return made[key]

    rebuilt = rebuild(state.tree, params, place)

    def unmoved(u, p):
        # a place the state does not cover (an integer array, say) came back as itself: it
        # gets an update that leaves it as it is
        if u is not p:
            return u
        if not _is_array(p):
            _check_leaves(params, "update")  # an unfiltered Equinox module: say where
        return _no_move(p)

    return jax.tree.map(unmoved, rebuilt, params), new_state


def _optax_update(step, x):
    """The update optax adds to `x` for a rule's `step` (`x_new = x - step`)."""
    if step is None:
        return _no_move(x)
    if isinstance(step, NewValue):
        return jnp.asarray(step.value, dtype=x.dtype) - x
    # a rule may step by a scalar: optax expects updates shaped like params
    return jnp.broadcast_to(jnp.negative(step), x.shape)


def _no_move(x):
    """An update that leaves `x` exactly as it is under `x + u`: -0.0 keeps a negative zero."""
    zeros = jnp.zeros_like(x)
    return jnp.negative(zeros) if jnp.issubdtype(zeros.dtype, jnp.inexact) else zeros


def _nnx_variable_type():
    # Flax is not a dependency: only seen once imported
    return getattr(sys.modules.get("flax.nnx"), "Variable", None)


def _is_nnx_variable(x) -> bool:
    variable = _nnx_variable_type()
    return variable is not None and isinstance(x, variable)


def _nnx_variable_like(variable, value):
    """A new NNX `Variable` like `variable` (its kind, metadata, dtype and placement) holding
    `value`: what `adjust` puts where `nnx.Optimizer` holds a hyperparameter, so the optimiser's
    next update writes into it as into the old one, and a jitted step does not compile again."""
    if isinstance(value, (bool, str)) or not (
        isinstance(value, numbers.Number) or getattr(value, "shape", None) == ()
    ):
        raise TypeError(
            f"adjust: this hyperparameter is held by Flax NNX (nnx.Optimizer) as a "
            f"{type(variable).__name__} of a number; it takes a number, got {value!r}"
        )
    old = variable.get_value()
    new = jnp.asarray(value, dtype=old.dtype)
    # placed as the old value was: committed to its devices when it was, and left uncommitted
    # otherwise (jit compiles again for a committed argument where it had an uncommitted one,
    # and once more for the outputs, which that argument commits)
    if isinstance(old, jax.Array) and not isinstance(old, jax.core.Tracer) and old.committed:
        new = jax.device_put(new, old.sharding)
    return variable.copy(new)


# `adjust(optimizer.opt_state, 1e-3)` on an nnx.Optimizer's state keeps Variables where they were
_rule.HELD_VALUES.append((_is_nnx_variable, _nnx_variable_like))


def _annotate_sharded(state: State, variables, params) -> None:
    """Hold each state array shaped like its parameter in a copy of the parameter's NNX
    `Variable` when that declares a sharding, as in optax's states (its tree maps keep
    `Variable`s): `nnx.Optimizer` then gives the array the parameter's sharding annotation,
    which Flax's sharded initialisation reads (`nnx.get_partition_spec`)."""
    variable = _nnx_variable_type()
    sharded = {
        id(v.get_value()): v
        for v in jax.tree.leaves(variables, is_leaf=lambda x: isinstance(x, variable))
        if isinstance(v, variable) and v.get_metadata().get("out_sharding") is not None
    }
    places = _first_places(state.tree, params) if sharded else None
    for leaf in state.leaves() if places else ():
        v = sharded.get(id(places[id(leaf)][1]))
        if v is not None:
            parts: list = []
            spec = flatten_state(leaf.state, parts)
            held = [v.copy(p) if getattr(p, "shape", None) == v.shape else p for p in parts]
            leaf.state = unflatten_state(spec, iter(held))


def _values_of(tree):
    """`tree` with each Flax NNX `Variable` replaced by its value (what `nnx.as_pure` does)."""
    variable = _nnx_variable_type()
    if variable is None:
        return tree

    def is_variable(x):
        return isinstance(x, variable)

    if not any(map(is_variable, jax.tree.leaves(tree, is_leaf=is_variable))):
        return tree
    return jax.tree.map(lambda v: v.get_value() if is_variable(v) else v, tree, is_leaf=is_variable)


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, numbers.Number))


def _check_leaves(params, call: str) -> None:
    """optax transformations take a tree of arrays: anything else (an Equinox module's activation
    function, a string) is refused at `init`, as optax's own `init` refuses it, and not at the
    first update."""
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not _is_array(x):
            raise TypeError(
                f"optimisers.optax.transform(...).{call}: params holds a {type(x).__name__} at "
                f"{jax.tree_util.keystr(path) or 'the root'}, not an array; optax transformations "
                "take a tree of arrays. With Equinox, filter the model first: "
                "init(eqx.filter(model, eqx.is_array)), and update(grads, state, "
                "eqx.filter(model, eqx.is_array))"
            )


# --- hyperparameters held as JAX arrays ----------------------------------------------------------


class _LiveHyperparameters:
    """The hyperparameters that `transform`'s rule holds as JAX arrays, which `update` applies in
    place of the State's: `optax.inject_hyperparams` builds the transformation again at every step
    with its current values (traced under `jit`) and calls only that one's `update`, so these are
    the values it means. Hyperparameters given as Python numbers live in the State, where
    `adjust` changes them; so do arrays of a transformation that made states with its own `init`
    (one kept for the whole run): they were those states' starting values, and applying them at
    every update would silently undo `adjust`."""

    def __init__(self, rule):
        self.rule = rule
        self.made_states = False  # set by init
        # None: not known yet (a rule function is asked at each Leaf's place, at the first update)
        self.any = _holds_arrays(rule) if isinstance(rule, Rule) else None

    def applied(self, state: State, params) -> State:
        """`state` with each Leaf's rule holding the live values; `state` itself when none."""
        if self.any is False or self.made_states:
            return state
        if isinstance(self.rule, Rule):
            chosen = None
        else:
            places = _first_places(state.tree, params)
            if places is None:
                return state  # not the state of this model: the update says what is wrong
            choose = rule_chooser(self.rule)
            chosen = {key: choose(path, x) for key, (path, x) in places.items()}
            if self.any is None:
                self.any = any(map(_holds_arrays, chosen.values()))
                if not self.any:
                    return state
        rules: dict = {}

        def with_live(leaf):
            fresh = self.rule if chosen is None else chosen[id(leaf)]
            key = (id(leaf.rule), id(fresh))
            if key not in rules:
                rules[key] = _merged(leaf.rule, fresh)
            rule = rules[key]
            return leaf if rule is leaf.rule else leaf._successor(rule, leaf.state)

        return State(map_leaves(with_live, state.tree), state._keys)


def _holds_arrays(value) -> bool:
    if isinstance(value, Rule):
        return dataclasses.is_dataclass(value) and any(
            _holds_arrays(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if not f.metadata.get("static", False)
        )
    if isinstance(value, (tuple, list)):
        return any(map(_holds_arrays, value))
    return isinstance(value, jax.Array)  # tracers included


def _merged(held, fresh):
    """`held` (a rule in the State) with each hyperparameter that `fresh` holds as a JAX array
    taken from `fresh`; `held` itself when there is none."""
    if type(held) is not type(fresh):
        raise TypeError(
            f"optimisers.optax.transform(...).update: the state holds {held!r} where this "
            f"transformation applies {type(fresh).__name__}; was the state made by another one?"
        )
    changes = {}
    for f in dataclasses.fields(fresh):
        if f.metadata.get("static", False):
            continue
        old = getattr(held, f.name)
        new = _merged_value(old, getattr(fresh, f.name))
        if new is not old:
            changes[f.name] = new
    if not changes:
        return held
    # built as unflattening builds rules: the values come from a rule that was validated
    return _rule._unchecked(held, changes)


def _merged_value(old, new):
    if isinstance(new, Rule):
        return _merged(old, new)
    if isinstance(new, (tuple, list)) and isinstance(old, (tuple, list)) and len(old) == len(new):
        items = [_merged_value(o, n) for o, n in zip(old, new)]
        if all(a is b for a, b in zip(items, old)):
            return old
        return type(old)(items) if type(old) in (tuple, list) else type(old)(*items)
    return new if isinstance(new, jax.Array) else old


def _first_places(tree, model):
    """`{id(leaf): (path, parameter)}` at each Leaf's first place; None when `model` does not
    have the state's structure."""
    places: dict = {}

    def visit(snode, node, path) -> bool:
        if isinstance(snode, Leaf):
            places.setdefault(id(snode), (path, node))
            return True
        kind = kind_of(node)
        if kind is None:
            return False
        children = dict(kind.children(node))
        return all(k in children and visit(sub, children[k], path + (k,)) for k, sub in snode.items())

    return places if walked(visit, tree, model, ()) else None
