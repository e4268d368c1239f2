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
parameter's dtype): its update is `new - x`, and `x + (new - x) == new` holds whenever `new` lies
within a factor of two of `x` (Sterbenz's lemma), which any step smaller than the parameter
satisfies; otherwise it is `new` to within a rounding of the update.

The optax state is the `State` that `setup` returns: it carries the ties and the hyperparameters
as pytree leaves, so it can go through `jax.jit`, and `optimisers.adjust(state, eta)` changes the
learning rate without recompiling. Importing this module imports jax and optax; `import
optimisers` does not import it (it is reached as `optimisers.optax` on first use).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import optax as _optax

from . import _interface
from ._rule import NewValue
from ._state import State

__all__ = ["transform"]


def transform(rule) -> _optax.GradientTransformationExtraArgs:
    """An optax `GradientTransformationExtraArgs` that runs `rule` (an `optimisers.Rule`, or a
    function `(path, x) -> Rule` as `setup` takes) with tied weights handled.

    * `init(params)` is `optimisers.setup(rule, params)`: tied arrays (the same object at several
      places) share one optimiser state. Call it outside `jax.jit`, where arrays still have their
      identity. NNX `Variable`s (an `nnx.State`, as `nnx.Optimizer` hands it) are read as their
      values. The State's numbers (step counters, hyperparameters) stay as `setup` makes them,
      so that an eager `update` computes exactly what an eager `optimisers.update` does; JAX
      sees them as 0-d arrays (leaves), so Flax stores and updates them and `jit` traces them.
    * `update(updates, state, params)` returns `(updates, new_state)` such that
      `optax.apply_updates(params, updates)` is the model `optimisers.update(state, params,
      updates)` returns, bit for bit (see the module docstring for `MixedPrecision`). `params` is
      required. Under `jax.jit` the state says what is tied: tied places get the summed gradient
      and the same update. Extra keyword arguments (from `optax.chain`) are ignored.

    The state is an `optimisers.State`, so `optimisers.adjust(state, 1e-4)` changes the learning
    rate (inside `optax.chain`, adjust the chain's entry for this transformation).
    """
    _interface._rule_chooser(rule)  # a State, an optax transformation, a class: fail now

    def init_fn(params):
        params = _values_of(params)
        for x in jax.tree.leaves(params):
            if isinstance(x, jax.core.Tracer):
                raise TypeError(
                    "optimisers.optax.transform(...).init was called under a JAX transformation "
                    "(jit, eval_shape, ...): traced arrays have lost their identity, so tied weights "
                    "cannot be found. Call init eagerly, outside jit, and pass its state in."
                )
        return _interface.setup(rule, params)

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
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
        new_state, results = _interface._stepped(state, params, (grads,), "transform(...).update")
        made: dict = {}

        def place(leaf, x):
            key = id(leaf)
            if key not in made:
                moved = results.get(key)
                step = moved[1] if moved else None
                if step is None:
                    made[key] = _no_move(x)
                elif isinstance(step, NewValue):
                    made[key] = jnp.asarray(step.value, dtype=x.dtype) - x
                else:  # a rule may step by a scalar: optax expects updates shaped like params
                    made[key] = jnp.broadcast_to(jnp.negative(step), x.shape)
            return made[key]

        rebuilt = _interface._rebuild(state.tree, params, place)
        # a place the state does not cover (an integer array, say) came back as itself: it gets
        # an update that leaves it as it is
        out = jax.tree.map(lambda u, p: _no_move(p) if u is p else u, rebuilt, params)
        return out, new_state

    return _optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _no_move(x):
    """An update that leaves `x` exactly as it is under `x + u`: -0.0 keeps a negative zero."""
    zeros = jnp.zeros_like(x)
    return jnp.negative(zeros) if jnp.issubdtype(zeros.dtype, jnp.inexact) else zeros


def _values_of(tree):
    """`tree` with each Flax NNX `Variable` replaced by its value (what `nnx.as_pure` does)."""
    nnx_module = sys.modules.get("flax.nnx")
    variable = getattr(nnx_module, "Variable", None) if nnx_module is not None else None
    if variable is None:
        return tree

    def is_variable(x):
        return isinstance(x, variable)

    if not any(map(is_variable, jax.tree.leaves(tree, is_leaf=is_variable))):
        return tree
    return jax.tree.map(lambda v: v.get_value() if is_variable(v) else v, tree, is_leaf=is_variable)
