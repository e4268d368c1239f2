"""Hyperparameters and step counters reachable by name in the State's pytree, as optax's
name-based tools (`optax.tree_utils.tree_get`, `tree_set`) expect: a rule's numbers under their
field names, the shared counters under "count"."""

from __future__ import annotations

import numpy as np
import pytest

import optimisers as opt
from optimisers.schedules import Cosine

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")
import optimisers.optax  # noqa: E402

tree_get, tree_set = optax.tree_utils.tree_get, optax.tree_utils.tree_set


def _model():
    W = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
    return {"embed": W, "mlp": {"w": jnp.ones((3, 3)), "b": jnp.zeros(3)}, "head": W}


def _grads(model, t=0):
    return jax.tree.map(lambda x: jnp.sin(x + t), model)


def _paths(tree):
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def test_key_paths_name_hyperparameters_and_counters():
    state = opt.setup(opt.Adam(0.01), _model())
    paths = _paths(state)
    assert paths[:5] == [
        "['rules'][0]['beta'][0]",
        "['rules'][0]['beta'][1]",
        "['rules'][0]['epsilon']",
        "['rules'][0]['eta']",
        "['scalars'][0]['count']",
    ]


@pytest.mark.parametrize("wrapped", [False, True], ids=["State", "transform-in-chain"])
def test_tree_get_reads_eta_and_count(wrapped):
    model = _model()
    if wrapped:
        tx = optax.chain(optax.clip(1.0), optimisers.optax.transform(opt.Adam(0.01)))
        state = tx.init(model)
        step = jax.jit(lambda s, m, g: tx.update(g, s, m))
    else:
        state = opt.setup(opt.Adam(0.01), model)
        step = jax.jit(lambda s, m, g: opt.update(s, m, g)[::-1])
    assert float(tree_get(state, "eta")) == pytest.approx(0.01)
    assert tree_get(state, "beta") == pytest.approx((0.9, 0.999))
    assert int(tree_get(state, "count")) == 0
    for t in range(3):
        _, state = step(state, model, _grads(model, t))
    assert int(tree_get(state, "count")) == 3


def test_tree_set_changes_eta_as_adjust_does_and_keeps_ties():
    model = _model()
    state = opt.setup(opt.Adam(0.01), model)
    state, model = opt.update(state, model, _grads(model))
    by_name = tree_set(state, eta=jnp.asarray(0.05))
    by_adjust = opt.adjust(state, jnp.asarray(0.05))
    assert by_name["embed"] is by_name["head"]  # the tie is the State's: kept
    assert float(by_name["mlp"]["w"].rule.eta) == pytest.approx(0.05)
    grads = _grads(model, 1)
    s1, m1 = jax.jit(opt.update)(by_name, model, grads)
    s2, m2 = jax.jit(opt.update)(by_adjust, model, grads)
    for a, b in zip(jax.tree.leaves(m1), jax.tree.leaves(m2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(m1["embed"]), np.asarray(m1["head"]))


def test_tree_set_count_through_a_transform():
    tx = optimisers.optax.transform(opt.Adam(0.01))
    state = tx.init(_model())
    state = tree_set(state, count=jnp.asarray(7))
    assert int(tree_get(state, "count")) == 7
    assert state["mlp"]["w"].state[2] == 7  # Adam's step counter t


def test_several_counters_are_all_found_and_all_set():
    """As in an optax chain of two Adams: tree_get refuses to pick one, tree_set sets each."""
    rule = opt.OptimiserChain(opt.ClipNorm(1.0), opt.Adam(0.01))  # not elementwise: a count per Leaf
    state = opt.setup(rule, _model())
    found = optax.tree_utils.tree_get_all_with_path(state, "count")
    assert len(found) == len(state.leaves()) == 3
    with pytest.raises(KeyError, match="multiple"):
        tree_get(state, "count")
    state = tree_set(state, count=jnp.asarray(4))
    assert all(int(leaf.state[1][2]) == 4 for leaf in state.leaves())


def test_a_scheduled_rule_has_its_schedule_count():
    state = opt.setup(opt.Adam(Cosine(0.1, 10)), {"w": jnp.ones(3)})
    found = optax.tree_utils.tree_get_all_with_path(state, "count")
    # the schedule's count (Scheduled.count) and Adam's own step counter
    assert len(found) == 2
    assert tree_get(state, "eta") is None  # a schedule is not a number: static, not a leaf


def test_names_of_nested_rules():
    rule = opt.MixedPrecision(opt.OptimiserChain(opt.WeightDecay(1e-4), opt.Momentum(0.1, 0.8)))
    state = opt.setup(rule, {"w": jnp.ones(3, jnp.float16)})
    paths = _paths(state)
    assert "['rules'][0]['rule']['rules'][0]['lambd']" in paths
    assert "['rules'][0]['rule']['rules'][1]['eta']" in paths
    assert float(tree_get(state, "rho")) == pytest.approx(0.8)


def test_one_kind_of_key_per_level():
    """orbax rebuilds nested dicts from key paths joined by dots: under each node one kind of key."""
    model = {"rules": jnp.ones(2), "scalars": [jnp.ones(2)], "a.b": jnp.ones(2), "a": {"b": jnp.ones(2)}}
    rule = opt.OptimiserChain(opt.ClipGrad(1.0), opt.Adam(Cosine(0.1, 10), beta=(0.9, 0.99)))
    state = opt.setup(rule, model)
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    kinds: dict = {}
    for p, _ in flat:
        for depth in range(len(p)):
            kinds.setdefault(jax.tree_util.keystr(p[:depth]), set()).add(type(p[depth]))
    assert all(len(k) == 1 for k in kinds.values()), kinds
    dotted = [".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p) for p, _ in flat]
    assert len(set(dotted)) == len(dotted)
