"""Sharded JAX parameters on 8 CPU devices (in a subprocess, since XLA reads the device count at
start-up): the optimiser state follows each parameter's sharding, and a jitted update keeps every
sharding, for data parallelism (replicated parameters, sharded batch) and a 2-D model-parallel mesh
(sharded parameters), with a tied array in the model.
"""

from __future__ import annotations

import textwrap

import pytest

from _host_devices import run_on_host_devices

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import optimisers as opt

    assert len(jax.devices()) == 8, jax.devices()
    rng = np.random.default_rng(0)

    def arr(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    def loss(m, xb):
        h = jnp.tanh(xb @ m["embed"].T)               # (batch, 32)
        h = jnp.tanh(h @ m["mlp"]["w"] + m["mlp"]["b"])
        return jnp.mean((h @ m["unembed"]) ** 2)       # unembed is embed: tied

    def shardings(tree):
        return [x.sharding for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)]

    def check_state_follows(state, model, where):
        for path, x in opt.trainables(model, path=True):
            leaf = state
            for k in path:
                leaf = leaf[k]
            for s in jax.tree_util.tree_leaves(leaf.state):
                if isinstance(s, jax.Array) and s.shape == x.shape:
                    assert s.sharding.is_equivalent_to(x.sharding, x.ndim), (where, path)

    def train(model, xb, rule, steps, where):
        state = opt.setup(rule, model)
        check_state_follows(state, model, "setup")
        specs = [x.sharding for x in jax.tree_util.tree_leaves(model)]

        traces = []

        @jax.jit
        def step(state, model, xb):
            traces.append(1)
            return opt.update(state, model, jax.grad(loss)(model, xb))

        for i in range(steps):
            state = opt.adjust(state, 0.01 * 0.9**i)  # a schedule, from a Python float
            state, model = step(state, model, xb)
        # one trace: numbers from setup and adjust go where jit returns them (replicated)
        assert len(traces) == 1, (len(traces), where)
        after = [x.sharding for x in jax.tree_util.tree_leaves(model)]
        for a, b, x in zip(specs, after, jax.tree_util.tree_leaves(model)):
            assert b.is_equivalent_to(a, x.ndim), (a, b)
        check_state_follows(state, model, "update")
        np.testing.assert_array_equal(model["embed"], model["unembed"])
        return state, model

    E = arr(32, 16)
    host = {"embed": E, "mlp": {"w": arr(32, 32), "b": arr(32)}, "unembed": E}
    xb_host = arr(64, 16)
    _, reference = train(host, xb_host, opt.Adam(0.01), 5, "one device")

    # data parallel: parameters replicated, batch split over 8 devices
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rep = NamedSharding(mesh, P())
    W = jax.device_put(E, rep)
    model = {"embed": W, "mlp": {"w": jax.device_put(host["mlp"]["w"], rep),
                                 "b": jax.device_put(host["mlp"]["b"], rep)}, "unembed": W}
    xb = jax.device_put(xb_host, NamedSharding(mesh, P("data", None)))
    _, dp = train(model, xb, opt.Adam(0.01), 5, "data parallel")
    for k in ("embed", "unembed"):
        np.testing.assert_allclose(dp[k], reference[k], rtol=1e-5, atol=1e-6)

    # model parallel on a 2 x 4 mesh: parameters sharded along both axes
    mesh2 = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    W = jax.device_put(E, NamedSharding(mesh2, P("model", "data")))
    model = {
        "embed": W,
        "mlp": {"w": jax.device_put(host["mlp"]["w"], NamedSharding(mesh2, P("data", "model"))),
                "b": jax.device_put(host["mlp"]["b"], NamedSharding(mesh2, P("model")))},
        "unembed": W,
    }
    xb = jax.device_put(xb_host, NamedSharding(mesh2, P("data", None)))
    state, mp = train(model, xb, opt.Adam(0.01), 5, "model parallel")
    assert state["embed"].state[0].sharding.spec == P("model", "data")
    assert mp["mlp"]["w"].sharding.spec == P("data", "model")
    for a, b in zip(jax.tree_util.tree_leaves(mp), jax.tree_util.tree_leaves(reference)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    # eager updates keep shardings too, and a donated jitted step works with distinct buffers
    state = opt.setup(opt.Adam(0.01), model)
    s_e, m_e = opt.update(state, model, jax.grad(loss)(model, xb))
    assert m_e["embed"].sharding.is_equivalent_to(W.sharding, 2)
    assert s_e["mlp"]["w"].state[1].sharding.spec == P("data", "model")
    donated = jax.jit(lambda s, m, xb: opt.update(s, m, jax.grad(loss)(m, xb)),
                      donate_argnums=(0, 1))
    s_d, m_d = donated(state, opt.distinct_buffers(model), xb)
    assert m_d["embed"].sharding.spec == P("model", "data")
    np.testing.assert_allclose(m_d["embed"], m_e["embed"], rtol=1e-6, atol=1e-7)
    print("ok")
    """
)


def test_sharded_parameters_keep_their_sharding():
    proc = run_on_host_devices(SCRIPT, 8)
    assert proc.stdout.strip().endswith("ok")
