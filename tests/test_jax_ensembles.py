"""An ensemble of states stacked for `jax.vmap`: `adjust(stacked, jnp.array([...]))` gives each
member its own hyperparameter, checked per member; the ensemble trains as the members would alone."""

from __future__ import annotations

import numpy as np
import pytest

import optimisers as opt

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

MEMBERS = 4


def _member(i):
    W = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3) * (i + 1)
    return {"embed": W, "b": jnp.full(3, 0.1 * i), "head": W}


def _loss(model):
    return jnp.sum(jnp.tanh(model["embed"] + model["b"]) * model["head"])


def _stack(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _step(state, model):
    return opt.update(state, model, jax.grad(_loss)(model))


def test_one_learning_rate_per_member_trains_like_each_member_alone():
    rates = [0.01, 0.02, 0.05, 0.1]
    rule = opt.Adam(0.001)
    models = [_member(i) for i in range(MEMBERS)]
    states = [opt.setup(rule, m) for m in models]
    stacked, ensemble = _stack(states), _stack(models)
    vstep, step = jax.jit(jax.vmap(_step)), jax.jit(_step)

    stacked, ensemble = vstep(stacked, ensemble)
    stacked = opt.adjust(stacked, jnp.asarray(rates))
    assert stacked["embed"] is stacked["head"]
    for _ in range(3):
        stacked, ensemble = vstep(stacked, ensemble)

    for i in range(MEMBERS):
        state, model = step(states[i], models[i])
        state = opt.adjust(state, rates[i])
        for _ in range(3):
            state, model = step(state, model)
        for k in model:
            np.testing.assert_allclose(np.asarray(ensemble[k][i]), np.asarray(model[k]), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(ensemble["embed"]), np.asarray(ensemble["head"]))
    np.testing.assert_allclose(np.asarray(stacked["b"].rule.eta), rates, rtol=1e-7)


def test_adjust_in_place_a_tuple_entry_and_a_number_for_all():
    stacked = _stack([opt.setup(opt.Adam(0.01), _member(i)) for i in range(MEMBERS)])
    opt.adjust_(stacked, beta=(0.8, jnp.asarray([0.9, 0.99, 0.999, 0.9999])))
    rule = stacked["b"].rule
    np.testing.assert_allclose(np.asarray(rule.beta[0]), [0.8] * MEMBERS, rtol=1e-7)  # repeated
    np.testing.assert_allclose(np.asarray(rule.beta[1]), [0.9, 0.99, 0.999, 0.9999], rtol=1e-7)
    jax.jit(jax.vmap(_step))(stacked, _stack([_member(i) for i in range(MEMBERS)]))  # still maps


def test_adjust_inside_vmap_with_traced_rates():
    stacked = _stack([opt.setup(opt.Descent(0.1), _member(i)) for i in range(MEMBERS)])
    ensemble = _stack([_member(i) for i in range(MEMBERS)])

    def step(state, model, eta):
        return _step(opt.adjust(state, eta), model)

    _, moved = jax.vmap(step)(stacked, ensemble, jnp.asarray([0.0, 0.1, 0.2, 0.3]))
    np.testing.assert_array_equal(np.asarray(moved["b"][0]), np.asarray(ensemble["b"][0]))  # eta 0


@pytest.mark.parametrize(
    "hyper, message",
    [
        ({"eta": jnp.asarray([0.1, -0.2, 0.3, 0.4])}, "eta cannot be negative"),
        ({"eta": jnp.asarray([0.1, 0.2])}, r"eta has shape \(2,\) where this rule's eta has shape \(4,\)"),
        ({"beta": (0.8, jnp.asarray([0.9, 1.5, 0.9, 0.9]))}, r"beta\[1\] must be in \[0.0, 1.0\)"),
    ],
)
def test_bad_member_values_are_refused_and_change_nothing(hyper, message):
    stacked = _stack([opt.setup(opt.Adam(0.01), _member(i)) for i in range(MEMBERS)])
    before = stacked["b"].rule
    with pytest.raises(ValueError, match=message):
        opt.adjust_(stacked, **hyper)
    assert stacked["b"].rule is before


def test_an_array_for_an_unstacked_state_is_an_error():
    state = opt.setup(opt.Adam(0.01), _member(0))
    with pytest.raises(ValueError, match="for a stacked state"):
        opt.adjust(state, jnp.asarray([0.1, 0.2]))
