"""Equinox modules as models: ties across submodules, jax.jit and eqx.filter_jit.

Runs where Equinox is installed (it is not a dependency of the library).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optimisers as opt

eqx = pytest.importorskip("equinox")


class Block(eqx.Module):
    w: jax.Array
    b: jax.Array
    act: str = eqx.field(static=True, default="tanh")


class Net(eqx.Module):
    enc: Block
    dec: Block

    def __call__(self, x):
        h = jnp.tanh(self.enc.w @ x + self.enc.b)
        return jnp.tanh(self.dec.w.T @ h + self.dec.b)


def make_net():
    rng = np.random.default_rng(0)
    W = jnp.asarray(rng.standard_normal((4, 4)), jnp.float32)
    return Net(Block(W, jnp.zeros(4)), Block(W, jnp.ones(4)))


def loss(net, x):
    return jnp.sum(net(x) ** 2)


X = jnp.arange(4.0)


def test_tied_equinox_module_eager_and_jitted():
    net = make_net()
    state = opt.setup(opt.Adam(0.05), net)
    assert state["enc"]["w"] is state["dec"]["w"]
    eager, jitted = net, net
    s_e, s_j = state, state
    step = jax.jit(opt.update)
    for _ in range(5):
        s_e, eager = opt.update(s_e, eager, jax.grad(loss)(eager, X))
        s_j, jitted = step(s_j, jitted, jax.grad(loss)(jitted, X))
    assert type(eager) is Net and eager.enc.act == "tanh"
    assert eager.enc.w is eager.dec.w
    np.testing.assert_array_equal(jitted.enc.w, jitted.dec.w)
    np.testing.assert_allclose(jitted.enc.w, eager.enc.w, rtol=1e-5, atol=1e-6)


def test_filter_jit_compiles_once_when_state_numbers_are_arrays():
    # eqx.filter_jit treats every non-array leaf as static: Python numbers in the state (step
    # counters, hyperparameters) would recompile on each change. Making them arrays once fixes it.
    net = make_net()
    state = jax.tree_util.tree_map(jnp.asarray, opt.setup(opt.Adam(0.05), net))
    traces = []

    @eqx.filter_jit
    def step(state, net, x):
        traces.append(1)
        return opt.update(state, net, jax.grad(loss)(net, x))

    for _ in range(4):
        state, net = step(state, net, X)
    state, net = step(opt.adjust(state, jnp.asarray(0.01)), net, X)
    assert len(traces) == 1
    np.testing.assert_array_equal(net.enc.w, net.dec.w)
    assert int(state["enc"]["w"].state[2]) == 5
