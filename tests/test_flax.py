"""Flax through `optimisers.optax.transform`: `nnx.Optimizer` (NNX) and linen `TrainState`.

References: the same Flax code driven by optax's own rules, and `optimisers.update` on the
parameters as plain arrays (bit for bit).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx
from flax.training import train_state

import optimisers as opt
from optimisers.optax import transform

pytestmark = pytest.mark.slow

X = jax.random.normal(jax.random.key(1), (6, 3))
Y = jax.random.normal(jax.random.key(2), (6, 2))


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(3, 4, rngs=rngs)
        self.l2 = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def loss(model):
    return jnp.mean((model(X) - Y) ** 2)


def params_of(model):
    return nnx.as_pure(nnx.state(model, nnx.Param))


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def train(model, tx, steps=5, jit=True):
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    def step(model, optimizer):
        optimizer.update(model, nnx.grad(loss)(model))

    step = nnx.jit(step) if jit else step
    for _ in range(steps):
        step(model, optimizer)
    return optimizer


def test_nnx_optimizer_trains_like_optax_adam():
    ours, theirs = MLP(nnx.Rngs(0)), MLP(nnx.Rngs(0))
    train(ours, transform(opt.Adam(1e-2)))
    train(theirs, optax.adam(1e-2))
    for a, b in zip(leaves(params_of(ours)), leaves(params_of(theirs))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert not np.allclose(leaves(params_of(ours))[0], leaves(params_of(MLP(nnx.Rngs(0))))[0])


def test_nnx_optimizer_step_equals_update_bit_for_bit():
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, transform(opt.AdamW(1e-2, lambd=0.1)), wrt=nnx.Param)
    params = params_of(model)
    # the State as nnx.Optimizer holds it: its pytree leaves (numbers as 0-d float32 arrays)
    state = jax.tree.map(lambda v: v, opt.setup(opt.AdamW(1e-2, lambd=0.1), params))
    for _ in range(3):
        grads = nnx.grad(loss)(model)
        state, params = opt.update(state, params, nnx.as_pure(nnx.state(grads, nnx.Param)))
        optimizer.update(model, grads)
        assert [a.tobytes() for a in leaves(params_of(model))] == [a.tobytes() for a in leaves(params)]


class Shared(nnx.Module):
    """One layer at two places: NNX keeps one Variable per parameter, shared by both."""

    def __init__(self, rngs):
        self.first = nnx.Linear(3, 3, rngs=rngs)
        self.second = self.first
        self.out = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.second(jnp.tanh(self.first(x)))))


class Reused(nnx.Module):
    """The same model written with one layer applied twice."""

    def __init__(self, rngs):
        self.first = nnx.Linear(3, 3, rngs=rngs)
        self.out = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.first(jnp.tanh(self.first(x)))))


def test_a_layer_shared_at_two_places_is_trained_as_one():
    shared, reused, by_optax = Shared(nnx.Rngs(0)), Reused(nnx.Rngs(0)), Shared(nnx.Rngs(0))
    o_shared = train(shared, transform(opt.Adam(1e-2)))
    train(reused, transform(opt.Adam(1e-2)))
    train(by_optax, optax.adam(1e-2))
    assert shared.first is shared.second
    assert shared.first.kernel is shared.second.kernel
    # NNX lists the shared Variable once, so the optimiser state has one Leaf for it ...
    assert sorted(o_shared.opt_state.keys()) == ["first", "out"]
    # ... the gradient of both places is summed: the same numbers as the explicit reuse ...
    for a, b in zip(leaves(params_of(shared)), leaves(params_of(reused))):
        assert a.tobytes() == b.tobytes()
    # ... and as optax's Adam, which NNX hands one summed gradient as well
    for a, b in zip(leaves(params_of(shared)), leaves(params_of(by_optax))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_split_state_through_jax_jit_keeps_nnx_sharing_and_jit_on_the_module_does_not():
    # docs/flax.md's caution: the route through jax.jit is nnx.split, whose state lists a shared
    # layer once; a module handed to jax.jit as a pytree comes back with the layer copied
    def grads_of(params, graphdef):
        return jax.grad(lambda p: loss(nnx.merge(graphdef, p)))(params)

    shared, reused = Shared(nnx.Rngs(0)), Reused(nnx.Rngs(0))
    for model in (shared, reused):
        graphdef, params = nnx.split(model, nnx.Param)
        state = opt.setup(opt.Adam(1e-2), params)
        step = jax.jit(lambda s, p, g=graphdef: opt.update(s, p, grads_of(p, g)))
        for _ in range(3):
            state, params = step(state, params)
        nnx.update(model, params)
    assert shared.first is shared.second  # NNX's own sharing, kept
    for a, b in zip(leaves(params_of(shared)), leaves(params_of(reused))):
        assert a.tobytes() == b.tobytes()  # both places' gradients summed, as in the reuse

    module = Shared(nnx.Rngs(0))
    state = opt.setup(opt.Adam(1e-2), module)
    _, out = jax.jit(opt.update)(state, module, nnx.grad(loss)(module))
    assert out.first is not out.second  # the caution: jax.jit's pytree copies the shared layer


def test_hyperparameters_held_by_nnx_change_in_place_without_recompiling():
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, transform(opt.Adam(1e-2)), wrt=nnx.Param)
    ref_model = MLP(nnx.Rngs(0))
    ref = nnx.Optimizer(ref_model, optax.inject_hyperparams(optax.adam)(1e-2), wrt=nnx.Param)
    traces = []

    @nnx.jit
    def step(model, optimizer):
        traces.append(1)
        optimizer.update(model, nnx.grad(loss)(model))

    for i in range(5):
        if i == 2:
            for leaf in optimizer.opt_state.leaves():
                leaf.rule.eta[...] = 1e-3
            ref.opt_state.hyperparams["learning_rate"][...] = 1e-3
        step(model, optimizer)
        step(ref_model, ref)
    assert len(traces) == 2  # one per optimizer
    for a, b in zip(leaves(params_of(model)), leaves(params_of(ref_model))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_update_on_an_nnx_state_leaves_the_callers_state_alone():
    model = MLP(nnx.Rngs(0))
    params = params_of(model)
    before = [a.tobytes() for a in leaves(params)]
    state = opt.setup(opt.Descent(0.1), params)
    grads = jax.tree.map(jnp.ones_like, params)
    _, new = opt.update(state, params, grads)
    assert type(new) is type(params)
    assert [a.tobytes() for a in leaves(params)] == before
    for a, b in zip(leaves(new), leaves(params)):
        np.testing.assert_array_equal(a, b - np.float32(0.1))


class LinenMLP(linen.Module):
    @linen.compact
    def __call__(self, x):
        return linen.Dense(2)(jax.nn.relu(linen.Dense(4)(x)))


def test_linen_train_state_apply_gradients_like_optax_adam():
    net = LinenMLP()
    params = net.init(jax.random.key(0), X)

    def run(tx):
        ts = train_state.TrainState.create(apply_fn=net.apply, params=params, tx=tx)

        @jax.jit
        def step(ts):
            grads = jax.grad(lambda p: jnp.mean((ts.apply_fn(p, X) - Y) ** 2))(ts.params)
            return ts.apply_gradients(grads=grads)

        for _ in range(5):
            ts = step(ts)
        return ts

    ours, theirs = run(transform(opt.Adam(1e-2))), run(optax.adam(1e-2))
    assert isinstance(ours.opt_state, opt.State) and int(ours.step) == 5
    for a, b in zip(leaves(ours.params), leaves(theirs.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_bare_rule_handed_to_flax_fails_at_once():
    with pytest.raises(TypeError, match=r"optimisers\.optax\.transform"):
        nnx.Optimizer(MLP(nnx.Rngs(0)), opt.Adam(1e-3), wrt=nnx.Param)
    params = LinenMLP().init(jax.random.key(0), X)
    with pytest.raises(TypeError, match=r"optimisers\.optax\.transform"):
        train_state.TrainState.create(apply_fn=None, params=params, tx=opt.Adam())
