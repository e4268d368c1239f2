"""orbax-checkpoint: a `State` saved with `StandardCheckpointer` and restored against
`jax.tree.map(ocp.utils.to_shape_dtype_struct, state)` resumes bit for bit, ties, frozen flags and
shardings kept, without a new trace; a state dict goes as its numbers plus a JSON part."""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import optimisers as opt
from _host_devices import run_on_host_devices

pytestmark = pytest.mark.slow


def make_model(seed=0):
    rng = np.random.default_rng(seed)

    def arr(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    E = arr(12, 4)
    return {"embed": E, "mlp": {"w": arr(4, 4), "b": arr(4)}, "unembed": E}  # E tied


def rule(path, x):
    if path[0] == "mlp":
        return opt.AdamW(1e-2, lambd=1e-2)
    return opt.OptimiserChain(opt.ClipNorm(1.0), opt.Adam(1e-2))


def setup(model):
    state = opt.setup(rule, model)
    opt.freeze_(state["mlp"]["b"])
    return state


def loss(m, x):
    h = jnp.tanh(m["embed"][x] @ m["mlp"]["w"] + m["mlp"]["b"])
    return jnp.mean((h @ m["unembed"].T) ** 2)


TOKENS = np.random.default_rng(1).integers(0, 12, (10, 6))


def make_step():
    traces = []

    @jax.jit
    def step(state, model, x):
        traces.append(1)
        return opt.update(state, model, jax.grad(loss)(model, x))

    return step, traces


def run(step, state, model, start, stop):
    for i in range(start, stop):
        state, model = step(state, model, TOKENS[i])
    return state, model


def abstract(tree):
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def assert_bitwise_equal(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and np.array_equal(x, y)


def test_state_restores_and_resumes_bit_for_bit(tmp_path):
    step, traces = make_step()
    model = make_model()
    state, model = run(step, setup(model), model, 0, 4)
    with ocp.StandardCheckpointer() as ck:
        ck.save(tmp_path / "ckpt", {"state": state, "params": model})
    ref_state, ref_model = run(step, state, model, 4, 10)
    n_traces = len(traces)

    new_model = make_model(seed=7)  # the next job: other numbers, same structure
    targets = {
        "the trained state": abstract({"state": state, "params": model}),
        "a fresh setup": abstract({"state": setup(new_model), "params": new_model}),
    }
    for where, target in targets.items():
        with ocp.StandardCheckpointer() as ck:
            restored = ck.restore(tmp_path / "ckpt", target)
        r_state, r_model = restored["state"], restored["params"]
        assert isinstance(r_state, opt.State), where
        assert_bitwise_equal(r_state, state)
        assert r_state["embed"] is r_state["unembed"], where
        assert opt.state_dict(r_state)["unembed/tied_to"] == "embed"
        assert r_state["mlp"]["b"].frozen and not r_state["mlp"]["w"].frozen
        assert r_state["mlp"]["w"].rule == state["mlp"]["w"].rule

        r_state, r_model = run(step, r_state, r_model, 4, 10)
        assert_bitwise_equal(r_state, ref_state)
        assert_bitwise_equal(r_model, ref_model)
        assert len(traces) == n_traces, where  # the restored State is the trained one's form
    # the test means something: the last 6 steps moved the parameters, the frozen one stayed
    assert not np.array_equal(ref_model["mlp"]["w"], model["mlp"]["w"])
    assert np.array_equal(ref_model["mlp"]["b"], model["mlp"]["b"])


def test_hyperparameters_come_from_the_checkpoint_frozen_flags_from_the_target(tmp_path):
    model = make_model()
    state = opt.adjust(setup(model), 3e-3)  # numbers are leaves: saved and restored
    with ocp.StandardCheckpointer() as ck:
        ck.save(tmp_path / "ckpt", state)
        restored = ck.restore(tmp_path / "ckpt", abstract(opt.setup(rule, model)))
    assert float(restored["embed"].rule.rules[1].eta) == pytest.approx(3e-3)
    # flags, rule classes and ties are the tree's structure, which the target brings
    assert not restored["mlp"]["b"].frozen


def test_a_model_key_that_reads_like_the_states_own_entries(tmp_path):
    # orbax names arrays by their keys joined with dots: a Leaf "rules.0" must not be stored
    # where rule 0's hyperparameters are ("rules.0.0")
    model = {"rules": [jnp.arange(1.0, 4.0)], "scalars": jnp.ones(2), "rules.1": jnp.ones(())}
    state = opt.setup(opt.Adam(), model)
    grads = jax.tree.map(jnp.ones_like, model)
    for _ in range(2):
        state, model = jax.jit(opt.update)(state, model, grads)
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    names = [".".join(str(getattr(k, "key", getattr(k, "idx", None))) for k in p) for p in paths]
    assert len(set(names)) == len(names), names
    with ocp.StandardCheckpointer() as ck:
        ck.save(tmp_path / "ckpt", state)
        restored = ck.restore(tmp_path / "ckpt", abstract(state))
    assert_bitwise_equal(restored, state)


def test_a_flax_train_state_restores_whole(tmp_path):
    from flax import linen
    from flax.training import train_state

    net = linen.Dense(2)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((8, 3)), jnp.float32)

    def make():
        params = net.init(jax.random.key(0), x)
        return train_state.TrainState.create(
            apply_fn=net.apply, params=params, tx=opt.optax.transform(opt.Adam(1e-2))
        )

    @jax.jit
    def step(ts):
        return ts.apply_gradients(grads=jax.grad(lambda p: jnp.mean(ts.apply_fn(p, x) ** 2))(ts.params))

    ts = make()
    for _ in range(3):
        ts = step(ts)
    with ocp.StandardCheckpointer() as ck:
        ck.save(tmp_path / "ckpt", ts)
        restored = ck.restore(tmp_path / "ckpt", abstract(make()))
    assert isinstance(restored.opt_state, opt.State) and int(restored.step) == 3
    a, b = ts, restored
    for _ in range(3):
        a, b = step(a), step(b)
    # leaves only: `tx` is static, and each `make()` builds a new one
    assert_bitwise_equal(jax.tree.leaves(b), jax.tree.leaves(a))


def split(d):
    """A state dict as orbax takes it: numbers (arrays, counters) and text (rules, flags, ties)."""
    text = {k: v for k, v in d.items() if isinstance(v, (str, bool))}
    return {k: v for k, v in d.items() if k not in text}, text


def save_state_dict(path, state):
    numbers, text = split(opt.state_dict(state))
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ck:
        ck.save(
            path,
            ocp.args.Composite(numbers=ocp.args.StandardSave(numbers), text=ocp.args.JsonSave(text)),
        )


def load_state_dict(path, fresh):
    # no target: orbax gives the arrays on their saved shardings, then load_state_dict checks
    # everything against `fresh` (with its own messages) and moves them onto its shardings
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ck:
        parts = ck.restore(
            path, ocp.args.Composite(numbers=ocp.args.StandardRestore(), text=ocp.args.JsonRestore())
        )
    return opt.load_state_dict(fresh, {**parts["numbers"], **parts["text"]})


def test_state_dict_as_numbers_and_json(tmp_path):
    step, traces = make_step()
    model = make_model()
    state, model = run(step, setup(model), model, 0, 4)
    save_state_dict(tmp_path / "sd", state)
    ref_state, ref_model = run(step, state, model, 4, 10)

    # the state dict carries the frozen flags and rules: a plain setup is enough to load into
    restored = load_state_dict(tmp_path / "sd", opt.setup(rule, make_model(seed=7)))
    assert restored["embed"] is restored["unembed"] and restored["mlp"]["b"].frozen
    for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert np.array_equal(x, y)
    r_state, r_model = run(step, restored, model, 4, 10)
    assert_bitwise_equal(r_state, ref_state)
    assert_bitwise_equal(r_model, ref_model)

    untied = make_model(seed=7)
    untied["unembed"] = untied["unembed"] + 0
    with pytest.raises(opt.CheckpointError, match="ties it to embed"):
        load_state_dict(tmp_path / "sd", opt.setup(rule, untied))


def test_restoring_into_another_models_target_fails(tmp_path):
    model = make_model()
    state = setup(model)
    with ocp.StandardCheckpointer() as ck:
        ck.save(tmp_path / "ckpt", state)
    # orbax's own error: the saved tree has other key paths (a tie less: one more Leaf)
    untied = make_model()
    untied["unembed"] = untied["unembed"] + 0
    with ocp.StandardCheckpointer() as ck, pytest.raises(ValueError, match="match"):
        ck.restore(tmp_path / "ckpt", abstract(setup(untied)))


SHARDED = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import optimisers as opt

    assert len(jax.devices()) == 8, jax.devices()
    path = sys.argv[1]
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    specs = {"embed": P("model", "data"), "w": P("data", "model"), "b": P("model")}

    def make_model(seed, mesh, specs):
        rng = np.random.default_rng(seed)
        def put(name, *shape):
            x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
            return jax.device_put(x, NamedSharding(mesh, specs[name]))
        E = put("embed", 32, 16)
        return {"embed": E, "mlp": {"w": put("w", 32, 32), "b": put("b", 32)}, "unembed": E}

    def loss(m, xb):
        h = jnp.tanh(jnp.tanh(xb @ m["embed"].T) @ m["mlp"]["w"] + m["mlp"]["b"])
        return jnp.mean((h @ m["unembed"]) ** 2)

    x_host = np.random.default_rng(9).standard_normal((10, 64, 16)).astype(np.float32)
    xs = [jax.device_put(x, NamedSharding(mesh, P("data", None))) for x in x_host]
    rule = opt.OptimiserChain(opt.ClipNorm(1.0), opt.Adam(1e-2))
    traces = []

    @jax.jit
    def step(state, model, xb):
        traces.append(1)
        return opt.update(state, model, jax.grad(loss)(model, xb))

    def run(state, model, start, stop):
        for i in range(start, stop):
            state, model = step(state, model, xs[i])
        return state, model

    def abstract(tree):
        return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)

    def same(a, b, where):
        assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b), where
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            assert x.sharding.is_equivalent_to(y.sharding, x.ndim), (where, x.sharding, y.sharding)
            assert np.array_equal(x, y), where

    model = make_model(0, mesh, specs)
    state, model = run(opt.setup(rule, model), model, 0, 4)
    assert state["embed"].state[1][0].sharding.spec == P("model", "data")
    with ocp.StandardCheckpointer() as ck:
        ck.save(path, {"state": state, "params": model})
    ref = run(state, model, 4, 10)
    n_traces = len(traces)

    # the next job, on the same mesh: every array comes back with its sharding
    new = make_model(7, mesh, specs)
    with ocp.StandardCheckpointer() as ck:
        r = ck.restore(path, abstract({"state": opt.setup(rule, new), "params": new}))
    same((r["state"], r["params"]), (state, model), "restored")
    assert r["state"]["embed"] is r["state"]["unembed"]
    same(run(r["state"], r["params"], 4, 10), ref, "resumed")
    assert len(traces) == n_traces, len(traces)

    # onto another layout: the arrays go where the target says, with the saved numbers
    mesh8 = Mesh(np.array(jax.devices()), ("model",))
    other = make_model(7, mesh8, {"embed": P(None, "model"), "w": P("model"), "b": P()})
    target = abstract({"state": opt.setup(rule, other), "params": other})
    with ocp.StandardCheckpointer() as ck:
        r = ck.restore(path, target)
    assert r["state"]["embed"].state[1][0].sharding.spec == P(None, "model")
    assert r["params"]["mlp"]["w"].sharding.spec == P("model")
    for x, y in zip(jax.tree.leaves(r), jax.tree.leaves({"state": state, "params": model})):
        assert np.array_equal(x, y)
    print("ok")
    """
)


def test_sharded_state_keeps_its_shardings(tmp_path):
    proc = run_on_host_devices(SHARDED, 8, str(tmp_path / "ckpt"))
    assert proc.stdout.strip().endswith("ok")
