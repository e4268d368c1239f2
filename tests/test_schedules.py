"""Schedules: values against torch.optim.lr_scheduler and optax, every kind of step (Python, NumPy,
PyTorch, JAX eager and traced), no recompilation under jax.jit, and use with adjust_."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import numpy as np
import pytest

import optimisers as opt
from optimisers.schedules import (
    Constant,
    Cosine,
    Exponential,
    Join,
    Linear,
    PiecewiseConstant,
    StepDecay,
)

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")

BASE = 0.1
STEPS = 40

EXAMPLES = [
    Constant(0.3),
    Linear(0.01, 0.1, 10),
    Linear(0.5, 0.0, 7, begin=5),
    Cosine(0.1, 20),
    Cosine(0.1, 20, final=0.01, warmup=5, start=0.001),
    StepDecay(0.1, 3, 0.5),
    Exponential(0.1, 0.9),
    Exponential(1.0, 0.5, steps=4, begin=3, end=0.1),
    Exponential(0.01, 1.5, end=0.2),
    PiecewiseConstant((1.0, 0.1, 0.01), (3, 7)),
    Join((Linear(0.0, 0.1, 5), Cosine(0.1, 15), Constant(0.0)), (5, 20)),
]


# --- against torch.optim.lr_scheduler ---------------------------------------------------------


def torch_lrs(make_scheduler, steps=STEPS, base=BASE):
    """The learning rate torch uses at steps 0, 1, ... (read before each `scheduler.step()`)."""
    param = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=base)
    scheduler = make_scheduler(optimizer)
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()  # (no gradient: nothing moves; torch wants it before scheduler.step)
        scheduler.step()
    return out


lr_scheduler = torch.optim.lr_scheduler


def hf_warmup_cosine(warmup, total):
    """The multiplier of transformers' get_cosine_schedule_with_warmup, written as it is there."""

    def factor(step):
        if step < warmup:
            return float(step) / float(max(1, warmup))
        progress = float(step - warmup) / float(max(1, total - warmup))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))

    return factor


@pytest.mark.parametrize(
    "ours, make, steps",
    [
        (StepDecay(BASE, 3, 0.5), lambda o: lr_scheduler.StepLR(o, 3, 0.5), STEPS),
        (Exponential(BASE, 0.9), lambda o: lr_scheduler.ExponentialLR(o, 0.9), STEPS),
        (Cosine(BASE, 25, final=1e-3), lambda o: lr_scheduler.CosineAnnealingLR(o, 25, 1e-3), 26),
        (
            Linear(0.1 * BASE, BASE, 10),
            lambda o: lr_scheduler.LinearLR(o, 0.1, 1.0, total_iters=10),
            STEPS,
        ),
        (
            Linear(BASE, 0.25 * BASE, 8),
            lambda o: lr_scheduler.LinearLR(o, 1.0, 0.25, total_iters=8),
            STEPS,
        ),
        (
            PiecewiseConstant((BASE, BASE * 0.1, BASE * 0.01), (3, 7)),
            lambda o: lr_scheduler.MultiStepLR(o, [3, 7], 0.1),
            STEPS,
        ),
        (
            Cosine(BASE, 30, warmup=6),
            lambda o: lr_scheduler.LambdaLR(o, hf_warmup_cosine(6, 30)),
            31,  # transformers' cosine rises again after the end; ours stays at `final`
        ),
        (Constant(BASE), lambda o: lr_scheduler.LambdaLR(o, lambda t: 1.0), STEPS),
    ],
    ids=[
        "StepLR",
        "ExponentialLR",
        "CosineAnnealingLR",
        "LinearLR-up",
        "LinearLR-down",
        "MultiStepLR",
        "LambdaLR-warmup-cosine",
        "constant",
    ],
)
def test_matches_torch_lr_scheduler(ours, make, steps):
    expected = torch_lrs(make, steps)
    got = [ours(t) for t in range(steps)]
    assert all(isinstance(v, float) for v in got)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-15)


# --- against optax --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (Constant(0.3), optax.constant_schedule(0.3)),
        (Linear(0.01, 0.1, 10), optax.linear_schedule(0.01, 0.1, 10)),
        (Linear(0.5, 0.0, 7, begin=5), optax.linear_schedule(0.5, 0.0, 7, 5)),
        (Cosine(0.1, 20), optax.cosine_decay_schedule(0.1, 20)),
        (Cosine(0.1, 20, final=0.02), optax.cosine_decay_schedule(0.1, 20, alpha=0.2)),
        (
            Cosine(0.1, 20, final=0.01, warmup=5, start=0.001),
            optax.warmup_cosine_decay_schedule(0.001, 0.1, 5, 20, 0.01),
        ),
        (StepDecay(0.1, 3, 0.5), optax.exponential_decay(0.1, 3, 0.5, staircase=True)),
        (Exponential(0.1, 0.9), optax.exponential_decay(0.1, 1, 0.9)),
        (
            Exponential(1.0, 0.5, steps=4, begin=3, end=0.1),
            optax.exponential_decay(1.0, 4, 0.5, transition_begin=3, end_value=0.1),
        ),
        (
            Exponential(0.01, 1.5, end=0.2),
            optax.exponential_decay(0.01, 1, 1.5, end_value=0.2),
        ),
        (
            PiecewiseConstant((1.0, 0.1, 0.05), (3, 7)),
            optax.piecewise_constant_schedule(1.0, {3: 0.1, 7: 0.5}),
        ),
        (
            Join((Linear(0.0, 0.1, 5), Cosine(0.1, 15), Constant(0.0)), (5, 20)),
            optax.join_schedules(
                [
                    optax.linear_schedule(0.0, 0.1, 5),
                    optax.cosine_decay_schedule(0.1, 15),
                    optax.constant_schedule(0.0),
                ],
                [5, 20],
            ),
        ),
    ],
    ids=lambda x: type(x).__name__ if not callable(x) or hasattr(x, "__dataclass_fields__") else "",
)
def test_matches_optax(ours, theirs):
    expected = np.array([float(theirs(t)) for t in range(STEPS)])
    python = np.array([ours(t) for t in range(STEPS)])
    traced = np.asarray(jax.jit(jax.vmap(ours))(jnp.arange(STEPS)))
    # optax computes in float32, so agreement is to float32 rounding
    np.testing.assert_allclose(python, expected, rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(traced, expected, rtol=2e-6, atol=1e-7)


# --- every kind of step --------------------------------------------------------------------------


@pytest.mark.parametrize("sched", EXAMPLES, ids=lambda s: type(s).__name__)
def test_every_kind_of_step(sched):
    python = [sched(t) for t in range(STEPS)]
    assert all(type(v) is float for v in python)
    numpy = [sched(np.int64(t)) for t in range(STEPS)]
    assert all(type(v) is np.float64 for v in numpy)
    torched = [sched(torch.tensor(t)) for t in range(STEPS)]
    assert all(v.dtype == torch.float64 and v.shape == () for v in torched)
    eager = [sched(jnp.asarray(t)) for t in range(STEPS)]
    assert all(v.dtype == jnp.float32 and v.shape == () for v in eager)
    jitted = jax.jit(sched)
    traced = [jitted(jnp.asarray(t, jnp.int32)) for t in range(STEPS)]
    np.testing.assert_array_equal(numpy, python)
    np.testing.assert_allclose([float(v) for v in torched], python, rtol=1e-15)
    np.testing.assert_allclose(np.array(eager, np.float64), python, rtol=2e-6, atol=1e-8)
    np.testing.assert_allclose(np.array(traced, np.float64), python, rtol=2e-6, atol=1e-8)
    # before the start: step 0's value
    assert sched(-3) == sched(0)


def test_traced_step_compiles_once():
    sched = Join((Linear(0.0, 1e-3, 10), Cosine(1e-3, 90, final=1e-5)), (10,))
    traces = []

    @jax.jit
    def f(step):
        traces.append(step)
        return sched(step)

    values = [float(f(jnp.asarray(t))) for t in range(0, 120, 7)]
    assert len(traces) == 1
    np.testing.assert_allclose(values, [sched(t) for t in range(0, 120, 7)], rtol=2e-6, atol=1e-9)


def test_no_jax_or_torch_import():
    code = (
        "import sys, optimisers.schedules as s; s.Cosine(1.0, 10, warmup=2)(3); "
        "s.Join((s.Constant(1.0), s.Exponential(1.0, 0.5)), (4,))(7); "
        "assert 'jax' not in sys.modules and 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- construction ---------------------------------------------------------------------------------


def test_repr_and_equality():
    assert repr(Cosine(1e-3, 1000, warmup=100)) == (
        "Cosine(peak=0.001, steps=1000, final=0.0, warmup=100, start=0.0)"
    )
    assert repr(PiecewiseConstant([1, 0.5], [10])) == (
        "PiecewiseConstant(values=(1.0, 0.5), boundaries=(10,))"
    )
    assert repr(Join([Constant(1), Constant(2)], [3])) == (
        "Join(schedules=(Constant(value=1.0), Constant(value=2.0)), boundaries=(3,))"
    )
    assert Linear(0, 1, 10) == Linear(0.0, 1.0, 10)
    assert hash(StepDecay(1.0, 2)) == hash(StepDecay(1.0, 2))
    with pytest.raises(AttributeError):
        Constant(1.0).value = 2.0


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: Constant("a"), TypeError, "value must be a real number"),
        (lambda: Constant(math.inf), ValueError, "must be finite"),
        (lambda: Linear(0, 1, 0), ValueError, "steps must be positive"),
        (lambda: Linear(0, 1, 2.5), TypeError, "steps must be an integer"),
        (lambda: Linear(0, 1, 5, begin=-1), ValueError, "begin must be non-negative"),
        (lambda: Cosine(1.0, 10, warmup=10), ValueError, "warmup (10) must be shorter than steps"),
        (lambda: StepDecay(1.0, 0), ValueError, "step_size must be positive"),
        (lambda: Exponential(1.0, 0.0), ValueError, "rate must be positive"),
        (lambda: PiecewiseConstant((1.0,), (3,)), ValueError, "one more value than boundaries"),
        (lambda: PiecewiseConstant((1.0, 2.0, 3.0), (5, 5)), ValueError, "must increase"),
        (lambda: Join((Constant(1.0),), (3,)), ValueError, "one more schedule than boundaries"),
        (lambda: Join((Constant(1.0), 0.5), (3,)), TypeError, "schedules[1] is not callable"),
    ],
)
def test_bad_arguments(make, error, message):
    with pytest.raises(error, match=re.escape(message)):
        make()


def test_bad_steps():
    sched = Cosine(1.0, 10)
    for step in (1.5, "3", None, True, np.float32(2.0), torch.tensor(2.0), jnp.asarray(2.0)):
        with pytest.raises(TypeError, match="integer step"):
            sched(step)


# --- with adjust_ on every backend ---------------------------------------------------------------


def test_adjust_every_step_numpy_and_torch():
    sched = Cosine(0.1, 10, warmup=3)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(4)
    grads = [rng.standard_normal(4) for _ in range(10)]
    state = opt.setup(opt.Descent(), {"x": x.copy()})
    model = {"x": x.copy()}
    t_model = {"x": torch.tensor(x)}
    t_state = opt.setup(opt.Descent(), t_model)
    expected = x.copy()
    for t, g in enumerate(grads):
        opt.adjust_(state, eta=sched(t))
        opt.adjust_(t_state, eta=sched(t))
        state, model = opt.update_(state, model, {"x": g})
        t_state, t_model = opt.update_(t_state, t_model, {"x": torch.tensor(g)})
        expected = expected - sched(t) * g
    np.testing.assert_array_equal(model["x"], expected)
    np.testing.assert_array_equal(t_model["x"].numpy(), expected)


def test_adjust_inside_jit_does_not_recompile():
    sched = Join((Linear(0.0, 0.05, 4), Exponential(0.05, 0.8)), (4,))
    W = jnp.arange(6.0).reshape(3, 2) / 10
    model = {"embed": W, "head": W}
    traces = []

    @jax.jit
    def train_step(state, model, step):
        traces.append(step)
        state = opt.adjust(state, eta=sched(step))
        grads = jax.grad(lambda m: jnp.sum(m["embed"] ** 2) + jnp.sum(jnp.sin(m["head"])))(model)
        return opt.update(state, model, grads)

    state = opt.setup(opt.Adam(), model)
    eager_state, eager_model = state, model
    for t in range(12):
        state, model = train_step(state, model, t)
        eager_state = opt.adjust(eager_state, eta=float(np.float32(sched(t))))
        grads = jax.grad(lambda m: jnp.sum(m["embed"] ** 2) + jnp.sum(jnp.sin(m["head"])))(eager_model)
        eager_state, eager_model = opt.update(eager_state, eager_model, grads)
    # one trace for the fresh state (Python-int counters), one for the state a jitted step returns
    assert len(traces) <= 2
    # (XLA fuses the jitted step differently from the eager one: agreement to rounding)
    np.testing.assert_allclose(
        np.asarray(model["embed"]), np.asarray(eager_model["embed"]), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_array_equal(np.asarray(model["embed"]), np.asarray(model["head"]))
    assert float(state["embed"].rule.eta) == pytest.approx(sched(11), rel=1e-6)
