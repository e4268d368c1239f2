"""A State that JAX unflattens (every jitted step's output) builds its Leafs only when something
asks for them; until then flattening it hands back what it was made from. Whatever is changed
after it is built is seen by the next flatten."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import optimisers as opt

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


def _model():
    W = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
    return {"embed": W, "b": jnp.zeros(3), "head": W}


def _stepped():
    model = _model()
    grads = jax.tree.map(jnp.ones_like, model)
    return jax.jit(opt.update)(opt.setup(opt.Adam(0.01), model), model, grads)


def test_flatten_before_use_gives_back_the_same_leaves():
    state, _ = _stepped()
    leaves, treedef = jax.tree_util.tree_flatten(state)
    made = jax.tree_util.tree_unflatten(treedef, leaves)
    again = jax.tree_util.tree_leaves(made)
    assert all(a is b for a, b in zip(again[5:], leaves[5:]))  # the arrays themselves
    assert made["embed"] is made["head"]  # built on use: the tie is there


def test_changes_after_use_are_seen():
    state, model = _stepped()
    opt.adjust_(state, 0.5)
    opt.freeze_(state["b"])
    rebuilt = jax.tree_util.tree_unflatten(*reversed(jax.tree_util.tree_flatten(state)))
    assert float(rebuilt["embed"].rule.eta) == 0.5
    assert rebuilt["b"].frozen and not rebuilt["embed"].frozen
    state["b"].state = tuple(jnp.full(3, 7.0) if getattr(p, "ndim", 0) else p for p in state["b"].state)
    rebuilt = jax.tree_util.tree_unflatten(*reversed(jax.tree_util.tree_flatten(state)))
    np.testing.assert_array_equal(np.asarray(rebuilt["b"].state[0]), np.full(3, 7.0))


def test_pickle_copy_and_repr_of_an_unbuilt_state():
    state, _ = _stepped()
    for copied in (pickle.loads(pickle.dumps(state)), copy.deepcopy(state)):
        assert copied["embed"] is copied["head"]
        np.testing.assert_array_equal(np.asarray(copied["b"].state[0]), np.asarray(state["b"].state[0]))
    assert "tied to embed" in repr(state)
