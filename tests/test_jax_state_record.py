"""A State fresh from `setup` keeps what its first flatten gave, so `jit`'s second flatten (with
keys, for argument names) and later calls with the same State skip the walk over every Leaf.
Whatever is changed in it afterwards is seen by the next flatten: each result here is compared
with flattening a copy, which keeps nothing and walks the tree again. Also: the zeros a JAX
state starts from are `jnp.zeros_like`'s (dtype, weak type, placement)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import optimisers as opt

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


def _model():
    W = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
    return {"embed": W, "b": jnp.zeros(3), "head": W, "c": jnp.ones(2)}


def _flat(state):
    return jax.tree_util.tree_flatten_with_path(state)


def _seen(state):
    """What flattening `state` gives, as plain values."""
    keyed, treedef = _flat(state)
    return str(treedef), [(jax.tree_util.keystr(p), np.asarray(v).tolist()) for p, v in keyed]


def _same_as_walked(state):
    """Flattening `state` (perhaps from what it kept) equals flattening a copy (a fresh walk)."""
    (got, got_def), (want, want_def) = _flat(state), _flat(copy.deepcopy(state))
    assert got_def == want_def
    assert [p for p, _ in got] == [p for p, _ in want]
    for (_, a), (_, b) in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    leaves, treedef = jax.tree_util.tree_flatten(state)
    assert treedef == want_def and len(leaves) == len(want)


def test_second_flatten_gives_back_the_first():
    state = opt.setup(opt.Adam(0.01), _model())
    leaves, treedef = jax.tree_util.tree_flatten(state)
    again, again_def = jax.tree_util.tree_flatten(state)
    assert again_def == treedef and all(a is b for a, b in zip(again, leaves))
    keyed = _flat(state)[0]  # keys after a flatten without: names of parameters, not None
    assert any("embed" in jax.tree_util.keystr(p) for p, _ in keyed)
    _same_as_walked(state)


@pytest.mark.parametrize(
    "change",
    [
        lambda s: opt.adjust_(s, 0.5),
        lambda s: opt.adjust_(s["c"], beta=(0.5, 0.6)),
        lambda s: opt.freeze_(s["b"]),
        lambda s: s.__setitem__("c", s["embed"]),  # a new tie
        lambda s: setattr(s["b"], "state", jax.tree.map(lambda p: p + 7, s["b"].state)),
        lambda s: s.tree.pop("c"),  # a dict changed in place
    ],
)
def test_changes_after_a_flatten_are_seen(change):
    state = opt.setup(opt.Adam(0.01), _model())
    before = _seen(state)
    change(state)
    _same_as_walked(state)
    assert _seen(state) != before


def test_a_jitted_step_from_a_state_flattened_before_matches_one_never_flattened():
    model = _model()
    grads = jax.tree.map(jnp.ones_like, model)
    state = opt.setup(opt.Adam(0.01), model)
    jax.tree_util.tree_flatten(state)
    step = jax.jit(opt.update)
    (a, ma), (b, mb) = step(state, model, grads), step(opt.setup(opt.Adam(0.01), model), model, grads)
    for x, y in zip(jax.tree.leaves((a, ma)), jax.tree.leaves((b, mb))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert a["embed"] is a["head"]


@pytest.mark.parametrize(
    "x",
    [
        jnp.ones((2, 3)),
        jnp.ones(4, jnp.bfloat16),
        jnp.ones(4, jnp.float16),
        jnp.ones(4, jnp.int32),
        jnp.ones(4, jnp.complex64),
        jnp.asarray(1.0),  # weak type
        jnp.ones((4, 2)).T,
        jnp.ones((0, 3)),
        jax.device_put(jnp.ones(3), jax.devices()[0]),  # committed
    ],
)
def test_state_zeros_are_zeros_like(x):
    from optimisers.backends import jax as _jax

    got, want = _jax.zeros_like(x), jnp.zeros_like(x)
    assert (got.dtype, got.shape, got.weak_type) == (want.dtype, want.shape, want.weak_type)
    assert got.sharding == want.sharding and got.committed == want.committed
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
