"""flax.serialization of the optimiser state: msgpack `to_bytes` / `from_bytes` of a linen
`TrainState` whose `tx` is `optimisers.optax.transform(...)`, ties kept, resuming bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

import optimisers as opt
from optimisers.schedules import Cosine

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
pytest.importorskip("flax")
from flax import serialization  # noqa: E402
from flax.training import train_state  # noqa: E402

import optimisers.optax  # noqa: E402

pytestmark = pytest.mark.slow


def _params():
    W = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    return {"embed": W, "mlp": [{"w": jnp.ones((3, 3)), "b": jnp.zeros(3)}], "unembed": W}


def _loss(params, t):
    h = jnp.tanh(params["embed"] @ params["mlp"][0]["w"] + params["mlp"][0]["b"])
    return jnp.sum((h @ params["unembed"].T) ** 2) * (1 + 0.1 * t)


@jax.jit
def _train_step(state, t):
    return state.apply_gradients(grads=jax.grad(_loss)(state.params, t))


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize(
    "rule",
    [
        opt.Adam(1e-2),
        opt.OptimiserChain(opt.ClipNorm(1.0), opt.AdamW(1e-2, lambd=0.1)),
        opt.Adam(Cosine(1e-2, 20, warmup=2)),
    ],
    ids=["Adam", "chain", "Adam-schedule"],
)
def test_train_state_round_trips_through_msgpack(rule):
    tx = optimisers.optax.transform(rule)
    state = train_state.TrainState.create(apply_fn=None, params=_params(), tx=tx)
    for t in range(3):
        state = _train_step(state, t)
    data = serialization.to_bytes(state)

    target = train_state.TrainState.create(apply_fn=None, params=_params(), tx=tx)
    restored = serialization.from_bytes(target, data)
    assert restored.step == state.step
    assert restored.opt_state["embed"] is restored.opt_state["unembed"]  # the tie, from the target
    assert _bits(restored.opt_state) == _bits(state.opt_state)
    assert _bits(restored.params) == _bits(state.params)
    for t in range(3, 6):  # resumes exactly as the uninterrupted run
        state, restored = _train_step(state, t), _train_step(restored, t)
    assert _bits(restored.params) == _bits(state.params)
    np.testing.assert_array_equal(restored.params["embed"], restored.params["unembed"])


def test_state_dict_is_keyed_by_names():
    params = _params()
    state = opt.setup(opt.Adam(1e-2), params)
    d = serialization.to_state_dict(state)
    assert set(d) == {"rules", "scalars", "embed", "mlp.0.w", "mlp.0.b"}  # a tie stored once
    assert set(d["rules"]["0"]) == {"eta", "beta", "epsilon"}
    assert set(d["scalars"]["0"]) == {"count"}
    restored = serialization.from_state_dict(opt.setup(opt.Adam(5e-3), params), d)
    assert float(restored["mlp"][0]["w"].rule.eta) == pytest.approx(1e-2)  # the saved number
    assert restored["embed"] is restored["unembed"]


def test_a_leaf_round_trips():
    leaf = opt.setup(opt.Momentum(0.1), {"w": jnp.ones(3)})["w"]
    leaf = opt.adjust(leaf, 0.2)
    target = opt.setup(opt.Momentum(0.1), {"w": jnp.ones(3)})["w"]
    back = serialization.from_bytes(target, serialization.to_bytes(leaf))
    assert float(back.rule.eta) == pytest.approx(0.2)
    np.testing.assert_array_equal(np.asarray(back.state), np.zeros(3))


def test_another_model_is_a_clear_error():
    data = serialization.to_bytes(opt.setup(opt.Adam(), _params()))
    other = opt.setup(opt.Adam(), {"w": jnp.ones(2)})
    with pytest.raises(ValueError, match=r"does not match the target .*missing: \['w'\]"):
        serialization.from_bytes(other, data)
