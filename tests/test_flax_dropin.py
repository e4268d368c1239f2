"""Flax with `optimisers.optax.transform` the ways Flax users work: changing the learning rate of
an `nnx.Optimizer` (`adjust`, `inject_hyperparams`), abstract restore targets made with
`jax.eval_shape` / `nnx.eval_shape`, and the optimiser made inside `nnx.jit`.

References: the same Flax code driven by optax's `inject_hyperparams(optax.adam)`, and the same
training run without the interruption (bit for bit).
"""

from __future__ import annotations

import contextlib
import logging
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import linen, nnx
from flax.training import train_state

import optimisers as opt
from _host_devices import run_on_host_devices
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
    return jax.tree.leaves(nnx.as_pure(nnx.state(model, nnx.Param)))


def assert_close(a, b):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def assert_bitwise(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


@contextlib.contextmanager
def xla_compiles(name):
    """The XLA compilations of jitted functions called `name` while in the block. jit compiles
    again without tracing again when only an argument's placement changed (a committed array
    where an uncommitted one was), so counting traces does not show it."""
    compiles: list = []

    class Counter(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith(f"Compiling jit({name})"):
                compiles.append(1)

    counter, logger = Counter(), logging.getLogger("jax")
    logger.addHandler(counter)
    try:
        with jax.log_compiles(True):
            yield compiles
    finally:
        logger.removeHandler(counter)


def counted_step(traces):
    @nnx.jit
    def step(model, optimizer):
        traces.append(1)
        optimizer.update(model, nnx.grad(loss)(model))

    return step


def optax_reference(rates):
    """`len(rates)` steps of optax's Adam, the rate changed in place before each step."""
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.inject_hyperparams(optax.adam)(rates[0]), wrt=nnx.Param)
    step = counted_step([])
    for rate in rates:
        optimizer.opt_state.hyperparams["learning_rate"][...] = rate
        step(model, optimizer)
    return params_of(model)


RATES = [1e-2, 1e-2, 1e-3, 1e-3, 3e-3]


@pytest.mark.parametrize("how", ["adjust_", "adjust"])
def test_adjust_on_an_nnx_optimizer_changes_the_rate_without_recompiling(how):
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, transform(opt.Adam(RATES[0])), wrt=nnx.Param)
    traces = []
    step = counted_step(traces)
    with xla_compiles("step") as compiles:
        for rate in RATES:
            if how == "adjust_":
                opt.adjust_(optimizer.opt_state, rate)
            else:
                optimizer.opt_state = opt.adjust(optimizer.opt_state, rate)
            step(model, optimizer)
    assert len(traces) == 1 and len(compiles) == 1
    assert_close(params_of(model), optax_reference(RATES))
    eta = optimizer.opt_state["l2"]["bias"].rule.eta
    assert isinstance(eta, nnx.Variable) and eta.get_value().dtype == jnp.float32
    np.testing.assert_allclose(eta.get_value(), RATES[-1])


def test_adjust_on_part_of_an_nnx_optimizer_and_a_refused_value():
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, transform(opt.Adam(1e-2)), wrt=nnx.Param)
    opt.adjust_(optimizer.opt_state["l1"], beta=(0.8, 0.99))
    state = optimizer.opt_state
    assert [float(b.get_value()) for b in state["l1"]["kernel"].rule.beta] == [
        np.float32(0.8),
        np.float32(0.99),
    ]
    assert float(state["l2"]["kernel"].rule.beta[0].get_value()) == np.float32(0.9)  # not adjusted
    counted_step([])(model, optimizer)  # the optimiser still updates

    before = state["l1"]["kernel"].rule
    with pytest.raises(TypeError, match="held by Flax NNX"):
        opt.adjust_(state, eta="fast")
    with pytest.raises(TypeError, match=r"got a Optimizer; pass its \.opt_state"):
        opt.adjust_(optimizer, 1e-3)
    assert state["l1"]["kernel"].rule is before  # nothing changed


def test_inject_hyperparams_in_an_nnx_optimizer_equals_optax():
    model = MLP(nnx.Rngs(0))
    tx = optax.inject_hyperparams(lambda learning_rate: transform(opt.Adam(learning_rate)))(RATES[0])
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    traces = []
    step = counted_step(traces)
    with xla_compiles("step") as compiles:
        for rate in RATES:
            optimizer.opt_state.hyperparams["learning_rate"][...] = rate
            step(model, optimizer)
    assert len(traces) == 1 and len(compiles) == 1
    assert_close(params_of(model), optax_reference(RATES))


def test_optimizer_made_inside_nnx_jit():
    @nnx.jit
    def create():
        model = MLP(nnx.Rngs(0))
        return model, nnx.Optimizer(model, transform(opt.Adam(1e-2)), wrt=nnx.Param)

    model, optimizer = create()
    ref_model = MLP(nnx.Rngs(0))
    ref = nnx.Optimizer(ref_model, transform(opt.Adam(1e-2)), wrt=nnx.Param)
    step = counted_step([])
    for _ in range(3):
        step(model, optimizer)
        step(ref_model, ref)
    assert_bitwise(nnx.state((model, optimizer)), nnx.state((ref_model, ref)))


# --- abstract restore targets -----------------------------------------------------------------------


def test_nnx_eval_shape_target_restores_an_optimizer(tmp_path):
    tx = transform(opt.AdamW(1e-2, lambd=1e-3))

    def create(seed):
        model = MLP(nnx.Rngs(seed))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    step = counted_step([])
    model, optimizer = create(0)
    for _ in range(3):
        step(model, optimizer)
    path = (tmp_path / "nnx").absolute()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, nnx.state((model, optimizer)))

    graphdef, target = nnx.split(nnx.eval_shape(lambda: create(1)))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(target))
    with ocp.StandardCheckpointer() as ckptr:
        restored_model, restored = nnx.merge(graphdef, ckptr.restore(path, target))
    assert isinstance(restored.opt_state, opt.State)
    for _ in range(3):
        step(model, optimizer)
        step(restored_model, restored)
    assert_bitwise(nnx.state((restored_model, restored)), nnx.state((model, optimizer)))


class LinenMLP(linen.Module):
    @linen.compact
    def __call__(self, x):
        return linen.Dense(2)(jax.nn.relu(linen.Dense(4)(x)))


def test_linen_eval_shape_target_restores_a_train_state(tmp_path):
    net = LinenMLP()

    tx = transform(opt.Adam(1e-2))  # made once: a TrainState holds it as static data (jit's key)

    def create_train_state(seed=0):
        params = net.init(jax.random.key(seed), X)
        return train_state.TrainState.create(apply_fn=net.apply, params=params, tx=tx)

    @jax.jit
    def step(ts):
        grads = jax.grad(lambda p: jnp.mean((ts.apply_fn(p, X) - Y) ** 2))(ts.params)
        return ts.apply_gradients(grads=grads)

    ts = create_train_state()
    for _ in range(3):
        ts = step(ts)
    path = (tmp_path / "linen").absolute()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, ts)

    target = jax.eval_shape(create_train_state)
    assert jax.tree.structure(target) == jax.tree.structure(ts)
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(path, target)
    assert isinstance(restored.opt_state, opt.State) and int(restored.step) == 3
    for _ in range(3):
        ts, restored = step(ts), step(restored)
    assert_bitwise(restored.params, ts.params)
    assert_bitwise(restored.opt_state, ts.opt_state)


# --- sharded initialisation ---------------------------------------------------------------------------

SHARDED_INIT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    import optimisers as opt

    mesh = jax.make_mesh((2, 4), ("data", "model"))


    class Model(nnx.Module):
        def __init__(self, rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
            self.l1 = nnx.Linear(8, 16, kernel_init=init, rngs=rngs)
            self.l2 = nnx.Linear(16, 2, rngs=rngs)

        def __call__(self, x):
            return self.l2(jnp.tanh(self.l1(x)))


    def trained(tx):
        @nnx.jit
        def create():  # Flax's sharded initialisation
            model = Model(nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
            state = nnx.state(optimizer)
            nnx.update(optimizer, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
            return model, optimizer

        @nnx.jit
        def step(model, optimizer):
            optimizer.update(model, nnx.grad(lambda m: jnp.sum(m(jnp.ones((4, 8))) ** 2))(model))

        model, optimizer = create()
        for _ in range(3):
            step(model, optimizer)
        return model, optimizer


    with jax.set_mesh(mesh):
        model, optimizer = trained(opt.optax.transform(opt.Adam(1e-2)))
        ref_model, _ = trained(optax.adam(1e-2))
    kernel = optimizer.opt_state["l1"]["kernel"]
    for moment in kernel.state[:2]:  # the optimiser state is sharded like its parameter
        assert moment.get_value().sharding.spec == model.l1.kernel.get_value().sharding.spec
        assert moment.get_value().sharding.spec == jax.sharding.PartitionSpec(None, "model")
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(ref_model))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    print("ok")
    """
)


def test_sharded_init_inside_nnx_jit_shards_the_state_like_its_parameters():
    proc = run_on_host_devices(SHARDED_INIT, 8)
    assert proc.stdout.strip().endswith("ok")


# --- state_dict of an nnx.Optimizer -------------------------------------------------------------------


def test_state_dict_of_an_nnx_optimizer_loads_into_a_fresh_one_and_continues_bit_for_bit():
    """`nnx.Optimizer` holds every array and number of the state, and the rule's numbers, in Flax
    Variables: the state dict holds their values, and loading puts them back in Variables."""
    step = counted_step([])
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, transform(opt.Adam(1e-2)), wrt=nnx.Param)
    for _ in range(3):
        step(model, optimizer)
    opt.adjust_(optimizer.opt_state, 3e-3)  # the checkpoint's rate, not the fresh optimiser's
    d = opt.state_dict(optimizer.opt_state)
    assert not any(isinstance(v, nnx.Variable) for v in d.values())
    assert d["l1.kernel/rule"].startswith(f"Adam(eta={float(np.float32(3e-3))!r},")

    restored_model = MLP(nnx.Rngs(1))
    nnx.update(restored_model, nnx.state(model, nnx.Param))
    restored = nnx.Optimizer(restored_model, transform(opt.Adam(1e-2)), wrt=nnx.Param)
    before = restored.opt_state
    restored.opt_state = opt.load_state_dict(restored.opt_state, d)
    assert isinstance(restored.opt_state["l1"]["kernel"].rule.eta, nnx.Variable)
    assert isinstance(restored.opt_state["l1"]["kernel"].state[0], nnx.Variable)
    assert float(before["l1"]["kernel"].rule.eta.get_value()) == np.float32(1e-2)  # left as it was
    restored.step.set_value(optimizer.step.get_value())  # nnx.Optimizer's own count, not the state's
    for _ in range(3):
        step(model, optimizer)
        step(restored_model, restored)
    assert_bitwise(nnx.state((restored_model, restored)), nnx.state((model, optimizer)))


def test_load_state_dict_into_an_nnx_optimizer_refuses_a_mismatch_and_changes_nothing():
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, transform(opt.Adam(1e-2)), wrt=nnx.Param)
    d = opt.state_dict(optimizer.opt_state)
    d["l1.kernel/state/0"] = np.zeros((4, 3), np.float32)
    state = optimizer.opt_state
    wrong = r"l1\.kernel/state/0: shape \(4, 3\) in the checkpoint, \(3, 4\)"
    with pytest.raises(opt.CheckpointError, match=wrong):
        opt.load_state_dict(state, d)
    assert optimizer.opt_state is state


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_save_and_load_of_an_nnx_optimizer_state_file(tmp_path, suffix):
    """The file's load budget counts the arrays an nnx.Optimizer holds in Variables: a model
    whose state is over a mebibyte still loads."""

    class Wide(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(3, 512, rngs=rngs)
            self.l2 = nnx.Linear(512, 512, rngs=rngs)  # 2 MiB of Adam state
            self.l3 = nnx.Linear(512, 2, rngs=rngs)

        def __call__(self, x):
            return self.l3(jax.nn.relu(self.l2(jax.nn.relu(self.l1(x)))))

    def create():
        model = Wide(nnx.Rngs(0))
        return model, nnx.Optimizer(model, transform(opt.Adam(1e-3)), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        optimizer.update(model, nnx.grad(lambda m: jnp.mean((m(X) - Y) ** 2))(model))

    model, optimizer = create()
    for _ in range(2):
        step(model, optimizer)
    path = tmp_path / f"opt{suffix}"
    opt.save(path, optimizer.opt_state)
    restored_model, restored = create()
    nnx.update(restored_model, nnx.state(model, nnx.Param))
    restored.opt_state = opt.load(path, restored.opt_state)
    restored.step.set_value(optimizer.step.get_value())
    for _ in range(2):
        step(model, optimizer)
        step(restored_model, restored)
    assert_bitwise(nnx.state((restored_model, restored)), nnx.state((model, optimizer)))
