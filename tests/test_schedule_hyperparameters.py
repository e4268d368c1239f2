"""A schedule as a hyperparameter (`Adam(schedule)`, as optax's `learning_rate=schedule`): the
library's schedules, optax's and plain lambdas, evaluated at the Leaf's own step count, on every
backend, under jax.jit, through adjust and checkpoints."""

from __future__ import annotations

import numpy as np
import pytest

import optimisers as opt
from optimisers.schedules import Constant, Cosine, Join, Linear

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")
import optimisers.optax  # noqa: E402

STEPS = 12
WARMUP_COSINE = Cosine(0.1, 10, final=0.01, warmup=3, start=0.0)
OPTAX_WARMUP_COSINE = optax.warmup_cosine_decay_schedule(0.0, 0.1, 3, 10, 0.01)


def grads_at(model, t):
    """A gradient for step `t` that differs from step to step and element to element."""
    return {
        k: np.sin(np.arange(v.size, dtype=np.float64) + t).reshape(v.shape).astype(v.dtype)
        for k, v in model.items()
    }


def numpy_model():
    rng = np.random.default_rng(0)
    # one large array (the in-place engine chunks it) and small ones it packs together
    return {
        "big": rng.standard_normal(300_000),
        "b": rng.standard_normal(7),
        "c": rng.standard_normal((3, 4)),
    }


def run(rule, model, steps=STEPS, *, in_place=True, per_step_eta=None):
    """Train `model` for `steps` steps; with `per_step_eta`, the rule's learning rate is set by
    `adjust_` before each step instead (the way schedules were used before they were accepted)."""
    state = opt.setup(rule, model)
    step = opt.update_ if in_place else opt.update
    for t in range(steps):
        if per_step_eta is not None:
            opt.adjust_(state, per_step_eta(t))
        state, model = step(state, model, grads_at(model, t))
    return state, model


# --- the numbers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("in_place", [True, False], ids=["update_", "update"])
@pytest.mark.parametrize(
    "rule, fixed, sched",
    [
        (opt.Adam(WARMUP_COSINE), opt.Adam(), WARMUP_COSINE),
        (opt.Descent(lambda t: 0.5 / (t + 1)), opt.Descent(), lambda t: 0.5 / (t + 1)),
        (opt.Momentum(Linear(0.0, 0.1, 5)), opt.Momentum(), Linear(0.0, 0.1, 5)),
        (opt.Rprop(Constant(0.01)), opt.Rprop(0.01), None),
    ],
    ids=["Adam-Cosine", "Descent-lambda", "Momentum-Linear", "Rprop-Constant"],
)
def test_numpy_equals_adjust_every_step(rule, fixed, sched, in_place):
    """The schedule at the Leaf's count is exactly the learning rate `adjust_` would set."""
    _, ours = run(rule, numpy_model(), in_place=in_place)
    _, theirs = run(fixed, numpy_model(), in_place=in_place, per_step_eta=sched)
    for k in ours:
        np.testing.assert_array_equal(ours[k], theirs[k])


def test_state_counts_steps_and_ties_share_one_count():
    W = np.ones((3, 2))
    model = {"embed": W, "head": W, "b": np.zeros(2)}
    state, model = run(opt.Adam(WARMUP_COSINE), model, steps=5)
    assert state["embed"] is state["head"]
    assert model["embed"] is model["head"]
    assert state["embed"].state.count == 5
    assert state["b"].state.count == 5


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (opt.Adam(WARMUP_COSINE), optax.adam(OPTAX_WARMUP_COSINE)),
        (opt.Adam(OPTAX_WARMUP_COSINE), optax.adam(OPTAX_WARMUP_COSINE)),
        (opt.Descent(lambda t: 0.5 / (t + 1)), optax.sgd(lambda t: 0.5 / (t + 1))),
        (
            opt.Lion(optax.linear_schedule(0.0, 0.01, 6)),
            optax.lion(optax.linear_schedule(0.0, 0.01, 6), b2=0.999, weight_decay=0.0),
        ),
    ],
    ids=["ours-in-Adam", "optax-in-Adam", "lambda-in-Descent", "optax-in-Lion"],
)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_jax_matches_optax(ours, theirs, jit):
    """optimisers.update (eager and jitted) against optax's own optimiser with the schedule."""
    model = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.arange(3.0)}
    params = model
    state, opt_state = opt.setup(ours, model), theirs.init(params)
    step = jax.jit(opt.update) if jit else opt.update
    for t in range(STEPS):
        grads = jax.tree.map(jnp.asarray, grads_at({k: np.asarray(v) for k, v in model.items()}, t))
        state, model = step(state, model, grads)
        updates, opt_state = theirs.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    for k in model:
        # optax's Adam puts ε and the bias corrections in other places: agreement to rounding
        np.testing.assert_allclose(np.asarray(model[k]), np.asarray(params[k]), rtol=1e-5, atol=1e-5)


def test_jit_compiles_once_for_every_step():
    """The count is traced: all steps share one compilation (plus one for a fresh State, whose
    counters are still Python ints, as without a schedule)."""
    model = {"w": jnp.ones((3, 4))}
    traces = {}
    for name, rule in [("fixed", opt.Adam(0.1)), ("scheduled", opt.Adam(WARMUP_COSINE))]:
        traces[name] = []

        def step(state, model, grads, name=name):
            traces[name].append(1)
            return opt.update(state, model, grads)

        jitted = jax.jit(step)
        state = opt.setup(rule, model)
        m = model
        for t in range(STEPS):
            state, m = jitted(state, m, {"w": jnp.full((3, 4), float(t))})
    assert len(traces["scheduled"]) == len(traces["fixed"])


def test_jit_equals_adjust_inside_jit():
    """Under jit the schedule at the traced count is what `adjust` to the schedule at a traced
    step gives: bit for bit."""
    model = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)}
    grads = [{"w": jnp.sin(jnp.arange(12.0).reshape(3, 4) + t)} for t in range(STEPS)]

    @jax.jit
    def scheduled(state, model, grads):
        return opt.update(state, model, grads)

    @jax.jit
    def adjusted(state, model, grads, t):
        return opt.update(opt.adjust(state, WARMUP_COSINE(t)), model, grads)

    s1, m1 = opt.setup(opt.Adam(WARMUP_COSINE), model), model
    s2, m2 = opt.setup(opt.Adam(), model), model
    for t in range(STEPS):
        s1, m1 = scheduled(s1, m1, grads[t])
        s2, m2 = adjusted(s2, m2, grads[t], jnp.asarray(t, jnp.int32))
    np.testing.assert_array_equal(np.asarray(m1["w"]), np.asarray(m2["w"]))


def test_optax_transform_takes_a_schedule():
    tx = optimisers.optax.transform(opt.Adam(OPTAX_WARMUP_COSINE))
    ref = optax.adam(OPTAX_WARMUP_COSINE)
    params = {"w": jnp.linspace(-1.0, 1.0, 6)}
    p1, p2 = params, params
    s1, s2 = tx.init(params), ref.init(params)
    update = jax.jit(tx.update)
    for t in range(STEPS):
        g = {"w": jnp.cos(jnp.arange(6.0) * (t + 1))}
        u1, s1 = update(g, s1, p1)
        u2, s2 = ref.update(g, s2, p2)
        p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
    np.testing.assert_allclose(np.asarray(p1["w"]), np.asarray(p2["w"]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torch_matches_torch_optim_with_lambda_lr(dtype):
    """PyTorch parameters against torch.optim.Adam driven by LambdaLR with the same schedule."""
    sched = WARMUP_COSINE
    torch.manual_seed(0)
    data = {"w": torch.randn(50, 40, dtype=dtype), "b": torch.randn(40, dtype=dtype)}
    model = {k: v.clone() for k, v in data.items()}
    params = [torch.nn.Parameter(v.clone()) for v in data.values()]
    reference = torch.optim.Adam(params, lr=1.0, foreach=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(reference, lambda t: sched(t))
    state = opt.setup(opt.Adam(sched), model)
    for t in range(STEPS):
        grads = {
            k: torch.sin(torch.arange(v.numel(), dtype=dtype) + t).reshape(v.shape) for k, v in data.items()
        }
        state, model = opt.update_(state, model, grads)
        for p, g in zip(params, grads.values()):
            p.grad = g.clone()
        reference.step()
        scheduler.step()
    tol = 2e-6 if dtype == torch.float32 else 1e-12
    for ours, theirs in zip(model.values(), params):
        torch.testing.assert_close(ours, theirs.detach(), rtol=tol, atol=tol)


def test_torch_and_numpy_agree():
    """The same scheduled rule on float64 PyTorch and NumPy parameters."""
    _, np_model = run(opt.Adam(WARMUP_COSINE), numpy_model())
    t_model = {k: torch.from_numpy(v.copy()) for k, v in numpy_model().items()}
    state = opt.setup(opt.Adam(WARMUP_COSINE), t_model)
    for t in range(STEPS):
        g = {k: torch.from_numpy(v) for k, v in grads_at(np_model, t).items()}
        state, t_model = opt.update_(state, t_model, g)
    for k in np_model:
        np.testing.assert_allclose(t_model[k].numpy(), np_model[k], rtol=1e-12, atol=1e-14)


# --- more than a learning rate; chains; adjust --------------------------------------------------


def test_a_schedule_in_a_tuple_field_and_in_a_chain():
    beta1 = Linear(0.5, 0.9, 5)
    chain = opt.OptimiserChain(opt.ClipNorm(Linear(1.0, 0.1, 8)), opt.Adam(0.01, (beta1, 0.999)))
    _, ours = run(chain, numpy_model())

    state = opt.setup(opt.OptimiserChain(opt.ClipNorm(1.0), opt.Adam(0.01, (0.5, 0.999))), numpy_model())
    model = numpy_model()
    for t in range(STEPS):
        rules = state["big"].rule.rules
        new = opt.OptimiserChain(
            rules[0].adjust(omega=Linear(1.0, 0.1, 8)(t)), rules[1].adjust(beta=(beta1(t), 0.999))
        )
        for leaf in state.leaves():
            leaf.rule = new
        state, model = opt.update_(state, model, grads_at(model, t))
    for k in ours:
        np.testing.assert_array_equal(ours[k], model[k])


@pytest.mark.parametrize("in_place", [True, False], ids=["adjust_", "adjust"])
def test_adjust_to_a_schedule_counts_from_then(in_place):
    """A schedule set by adjust after some steps starts at its step 0 then; adjusting back to a
    number keeps the count (its state keeps its shape)."""
    sched = Linear(0.01, 0.1, 4)
    model = numpy_model()
    state = opt.setup(opt.Adam(0.05), model)
    ref_state, ref = opt.setup(opt.Adam(0.05), numpy_model()), numpy_model()
    for t in range(STEPS):
        if t == 3:
            state = opt.adjust_(state, sched) if in_place else opt.adjust(state, sched)
        if t == 9:
            state = opt.adjust_(state, 0.02) if in_place else opt.adjust(state, 0.02)
        state, model = opt.update_(state, model, grads_at(model, t))
        if 3 <= t < 9:
            opt.adjust_(ref_state, sched(t - 3))
        if t == 9:
            opt.adjust_(ref_state, 0.02)
        ref_state, ref = opt.update_(ref_state, ref, grads_at(ref, t))
        if t >= 3:
            assert state["b"].state.count == t - 2
    for k in model:
        np.testing.assert_array_equal(model[k], ref[k])


def test_adjust_a_chain_member_to_a_schedule_under_update_():
    model = numpy_model()
    state = opt.setup(opt.OptimiserChain(opt.ClipGrad(1.0), opt.Adam(0.1)), model)
    state, model = opt.update_(state, model, grads_at(model, 0))
    opt.adjust_(state, WARMUP_COSINE)
    for t in range(1, 4):
        state, model = opt.update_(state, model, grads_at(model, t))
    assert state["big"].state[1].count == 3


def test_bad_schedule_arguments():
    with pytest.raises(TypeError, match="eta must be a real number or a schedule"):
        opt.Adam(Cosine)  # the class, not a schedule
    with pytest.raises(TypeError, match="eta must be a real number or a schedule"):
        opt.Adam("0.1")


# --- checkpoints ---------------------------------------------------------------------------------


def test_checkpoint_keeps_a_library_schedule_and_resumes_exactly():
    sched = Join((Linear(0.0, 0.1, 3), Cosine(0.1, 20)), (3,))
    state, model = run(opt.Adam(sched), numpy_model(), steps=5)
    d = opt.state_dict(state)
    assert d["big/rule"].startswith("Adam(eta=Join(schedules=(Linear(")
    # a fresh setup with another schedule: the checkpoint's comes back (hyperparameters="checkpoint")
    restored = opt.load_state_dict(opt.setup(opt.Adam(Cosine(0.5, 7)), numpy_model()), d)
    assert restored["big"].rule == opt.Adam(sched)
    assert restored["big"].state.count == 5
    kept = opt.load_state_dict(opt.setup(opt.Adam(Cosine(0.5, 7)), numpy_model()), d, hyperparameters="state")
    assert kept["big"].rule == opt.Adam(Cosine(0.5, 7))
    with pytest.raises(opt.CheckpointError, match="Adam.eta is 'Join"):
        opt.load_state_dict(opt.setup(opt.Adam(Cosine(0.5, 7)), numpy_model()), d, hyperparameters="check")

    resumed_model = {k: v.copy() for k, v in model.items()}
    for t in range(5, STEPS):
        state, model = opt.update_(state, model, grads_at(model, t))
        restored, resumed_model = opt.update_(restored, resumed_model, grads_at(resumed_model, t))
    for k in model:
        np.testing.assert_array_equal(model[k], resumed_model[k])


def test_checkpoint_file_round_trip(tmp_path):
    state, _ = run(opt.Adam(WARMUP_COSINE), numpy_model(), steps=3)
    opt.save(tmp_path / "ckpt", state)
    loaded = opt.load(tmp_path / "ckpt", opt.setup(opt.Adam(Constant(0.5)), numpy_model()))
    assert loaded["b"].rule == opt.Adam(WARMUP_COSINE)
    assert loaded["b"].state.count == 3


@pytest.mark.parametrize(
    "eta", [lambda t: 0.1, OPTAX_WARMUP_COSINE], ids=["lambda", "optax-schedule"]
)
def test_checkpoint_refuses_a_callable_it_cannot_store(eta):
    state, _ = run(opt.OptimiserChain(opt.ClipGrad(1.0), opt.Adam(eta)), numpy_model(), steps=1)
    with pytest.raises(TypeError, match=r"big: OptimiserChain.rules\[1\].eta is .* cannot store"):
        opt.state_dict(state)


def test_a_schedule_that_is_not_a_number_is_a_kind_difference():
    state, _ = run(opt.Adam(WARMUP_COSINE), numpy_model(), steps=1)
    with pytest.raises(opt.CheckpointError, match="differ at Adam.eta"):
        opt.load_state_dict(opt.setup(opt.Adam(0.1), numpy_model()), opt.state_dict(state))
