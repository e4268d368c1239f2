"""`Lookahead` against `optax.lookahead`, the independent oracle: a model with a tied weight
trained by our rule must equal optax's untied parameters fed the summed gradient (optax trains
`LookaheadParams(fast, slow)`: our model is its `fast`, `eval_params` its `slow`), on NumPy,
torch and JAX, pure and in place, and in float32 under `jax.jit`. The generic tests run it too
(`rules_registry.py`'s COMPOSITES: toy problems against `rule_reference.lookahead`, jit, ties,
checkpoints, layouts)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import optimisers as opt
from optimisers import ops

STEPS = 24


def random_model(seed=0, dtype=np.float64):
    """embed and unembed are one array (a tie); mlp is a list of a matrix and a vector."""
    gen = np.random.default_rng(seed)
    w = gen.standard_normal((5, 4)).astype(dtype)
    return {
        "embed": w,
        "mlp": [gen.standard_normal((4, 4)).astype(dtype), gen.standard_normal(4).astype(dtype)],
        "unembed": w,
    }


def random_gradients(model, steps, seed=1):
    """One gradient per place (the tie's two places get different ones), of varying scale."""
    gen = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        scale = float(np.exp(gen.uniform(-1, 1)))
        out.append(
            {
                "embed": scale * gen.standard_normal(model["embed"].shape),
                "mlp": [scale * gen.standard_normal(a.shape) for a in model["mlp"]],
                "unembed": scale * gen.standard_normal(model["unembed"].shape),
            }
        )
    return out


def untied(tree):
    """optax's view: the tied weight once, with the summed gradient where `tree` is gradients."""
    return {"embed": tree["embed"] + tree["unembed"], "mlp": list(tree["mlp"])}


def optax_trajectory(transformation, model, grads_list, dtype=np.float64):
    """optax.lookahead's (fast, slow) parameters after each step, as NumPy untied trees."""
    with jax.enable_x64(dtype == np.float64):
        params = {"embed": jnp.asarray(model["embed"]), "mlp": [jnp.asarray(a) for a in model["mlp"]]}
        params = optax.LookaheadParams.init_synced(params)
        state = transformation.init(params)
        out = []
        for grads in grads_list:
            g = jax.tree.map(jnp.asarray, untied(grads))
            updates, state = transformation.update(g, state, params)
            params = optax.apply_updates(params, updates)
            out.append(jax.tree.map(np.asarray, (params.fast, params.slow)))
    return out


def to_backend(tree, backend):
    """`tree` with every array converted to `backend`, the tie kept (one converted object)."""
    convert = {"numpy": np.array, "torch": torch.tensor, "jax": jnp.asarray}[backend]
    done = {}

    def one(x):
        if id(x) not in done:
            done[id(x)] = convert(x)
        return done[id(x)]

    return {
        "embed": one(tree["embed"]),
        "mlp": [one(a) for a in tree["mlp"]],
        "unembed": one(tree["unembed"]),
    }


def as_numpy(tree):
    return {"embed": np.asarray(tree["embed"]), "mlp": [np.asarray(a) for a in tree["mlp"]]}


def deviation(ours, theirs):
    """The largest absolute difference between our tied model and optax's untied parameters."""
    ours = as_numpy(ours)
    return max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)))


CASES = {
    "Descent,k=3": (
        lambda: opt.Lookahead(opt.Descent(0.1), k=3),
        lambda: optax.lookahead(optax.sgd(0.1), 3, 0.5),
    ),
    "Adam,defaults": (
        lambda: opt.Lookahead(opt.Adam(0.01)),
        lambda: optax.lookahead(optax.adam(0.01), 6, 0.5),
    ),
    # our Momentum keeps η inside the velocity, optax outside: the same for a constant η
    "Momentum,k=1": (
        lambda: opt.Lookahead(opt.Momentum(0.02, 0.9), k=1, alpha=0.8),
        lambda: optax.lookahead(optax.sgd(0.02, momentum=0.9), 1, 0.8),
    ),
}


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("verb", ["update", "update_"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_optax_lookahead_with_a_tied_weight(case, verb, backend):
    ours, theirs = CASES[case]
    model = random_model()
    grads_list = random_gradients(model, STEPS)
    with jax.enable_x64(True):
        expected = optax_trajectory(theirs(), model, grads_list)
        state = opt.setup(ours(), to_backend(model, backend))
        m = to_backend(model, backend)
        first_embed = m["embed"]
        step = getattr(opt, verb)
        worst = 0.0
        for t, (grads, (fast, slow)) in enumerate(zip(grads_list, expected), start=1):
            state, m = step(state, m, to_backend(grads, backend))
            evaluated = opt.eval_params(state, m)
            assert m["embed"] is m["unembed"] and evaluated["embed"] is evaluated["unembed"]
            worst = max(worst, deviation(m, fast), deviation(evaluated, slow))
            assert worst < 1e-12, f"step {t}: {worst}"
        if verb == "update_" and backend != "jax":
            assert m["embed"] is first_embed  # stepped in place, synchronisations included


def test_float32_under_jit_matches_optax_and_traces_once():
    model = random_model(dtype=np.float32)
    grads_list = random_gradients(model, 30)
    grads_list = [jax.tree.map(lambda g: np.asarray(g, np.float32), g) for g in grads_list]
    expected = optax_trajectory(optax.lookahead(optax.adam(0.01), 5, 0.5), model, grads_list, np.float32)
    m = to_backend(model, "jax")
    state = opt.setup(opt.Lookahead(opt.Adam(0.01), k=5), m)
    traces = []

    @jax.jit
    def step(state, model, grads):
        traces.append(1)  # runs only while tracing
        state, model = opt.update(state, model, grads)
        return state, model, opt.eval_params(state, model)

    for t, (grads, (fast, slow)) in enumerate(zip(grads_list, expected), start=1):
        state, m, evaluated = step(state, m, to_backend(grads, "jax"))
        assert m["embed"].dtype == jnp.float32
        for ours, theirs in ((m, fast), (evaluated, slow)):
            for a, b in zip(jax.tree.leaves(as_numpy(ours)), jax.tree.leaves(theirs)):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"step {t}")
        np.testing.assert_array_equal(m["embed"], m["unembed"])
        np.testing.assert_array_equal(evaluated["embed"], evaluated["unembed"])
    assert len(traces) == 1  # the synchronisation is selected inside the one program


def test_a_schedule_inside_matches_optax():
    sched = optax.linear_schedule(0.05, 0.005, 20)
    model = random_model()
    grads_list = random_gradients(model, STEPS)
    with jax.enable_x64(True):
        expected = optax_trajectory(optax.lookahead(optax.adam(sched), 4, 0.6), model, grads_list)
        state, m = opt.setup(opt.Lookahead(opt.Adam(sched), k=4, alpha=0.6), model), model
        for grads, (fast, slow) in zip(grads_list, expected):
            state, m = opt.update(state, m, grads)
            # optax evaluates the schedule at its int32 count in float32 (we at a Python int, in
            # float64): learning rates a float32 rounding apart
            assert deviation(m, fast) < 1e-8 and deviation(opt.eval_params(state, m), slow) < 1e-8


def test_adjust_reaches_the_inner_rule_and_k_alpha_stay():
    rule = opt.Lookahead(opt.Adam(0.01), k=4, alpha=0.6)
    assert rule.hyperparameters() == opt.Adam().hyperparameters()
    assert rule.adjust(eta=0.1) == opt.Lookahead(opt.Adam(0.1), k=4, alpha=0.6)
    assert rule.adjust(k=2) is rule  # not its hyperparameter: k and alpha stay
    model = random_model()
    grads_list = random_gradients(model, STEPS)
    with jax.enable_x64(True):
        inner = optax.inject_hyperparams(optax.adam)(learning_rate=0.01)
        tx = optax.lookahead(inner, 4, 0.6)
        params = optax.LookaheadParams.init_synced(jax.tree.map(jnp.asarray, as_numpy(model)))
        ostate = tx.init(params)
        state, m = opt.setup(rule, model), model
        for t, grads in enumerate(grads_list):
            if t == 10:  # mid-cycle (10 = 2·4 + 2): the slow weights and Adam's moments are kept
                state = opt.adjust(state, 0.05)
                ostate.fast_state.hyperparams["learning_rate"] = jnp.asarray(0.05)
            updates, ostate = tx.update(jax.tree.map(jnp.asarray, untied(grads)), ostate, params)
            params = optax.apply_updates(params, updates)
            state, m = opt.update(state, m, grads)
            fast, slow = jax.tree.map(np.asarray, (params.fast, params.slow))
            assert deviation(m, fast) < 1e-12 and deviation(opt.eval_params(state, m), slow) < 1e-12
        with pytest.raises(ValueError, match="no rule in this state has a hyperparameter 'k'"):
            opt.adjust(state, k=2)


def test_frozen_parts_stay_and_the_rest_matches_optax():
    model = random_model()
    grads_list = random_gradients(model, STEPS)
    state = opt.setup(opt.Lookahead(opt.Descent(0.1), k=3), model)
    opt.freeze_(state["mlp"])
    with jax.enable_x64(True):
        expected = optax_trajectory(optax.lookahead(optax.sgd(0.1), 3, 0.5), model, grads_list)
    m = model
    for t, (grads, (fast, slow)) in enumerate(zip(grads_list, expected), start=1):
        state, m = opt.update(state, m, grads)
        evaluated = opt.eval_params(state, m)
        for a, b in zip(m["mlp"] + evaluated["mlp"], model["mlp"] * 2):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(m["embed"], fast["embed"], rtol=1e-12, atol=1e-12, err_msg=f"step {t}")
        np.testing.assert_allclose(
            evaluated["embed"], slow["embed"], rtol=1e-12, atol=1e-12, err_msg=f"step {t}"
        )


def test_steps_of_an_accumulating_rule_count_towards_k():
    # AccumGrad(2) moves on every second call: with k=2 the synchronisation is on call 4
    model = {"w": np.array([1.0, -2.0])}
    state = opt.setup(
        opt.Lookahead(opt.OptimiserChain(opt.AccumGrad(2), opt.Descent(1.0)), k=2, alpha=0.5), model
    )
    g = {"w": np.array([1.0, 1.0])}
    values = []
    for _ in range(4):
        state, model = opt.update(state, model, g)
        values.append(model["w"].copy())
    # fast: x0 - 1 after call 2, x0 - 2 after call 4, then halfway back to x0 (the slow weights)
    np.testing.assert_array_equal(values, [[1.0, -2.0], [0.0, -3.0], [0.0, -3.0], [0.0, -3.0]])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(k=0), ValueError, "k"),
        (dict(k=2.0), TypeError, "k must be an integer"),
        (dict(alpha=1.5), ValueError, r"alpha must be in \[0.0, 1.0\]"),
        (dict(alpha=-0.1), ValueError, "alpha"),
        (dict(alpha=lambda t: 0.5), TypeError, "not a schedule"),
    ],
)
def test_invalid_hyperparameters(kwargs, error, match):
    with pytest.raises(error, match=match):
        opt.Lookahead(opt.Adam(), **kwargs)


def test_rule_must_be_a_rule_and_not_mixed_precision():
    with pytest.raises(TypeError, match="must be an optimisers.Rule"):
        opt.Lookahead(optax.adam(0.1))
    with pytest.raises(TypeError, match=r"MixedPrecision\(Lookahead"):
        opt.Lookahead(opt.MixedPrecision(opt.Adam()))
    assert repr(opt.Lookahead(opt.Descent(0.1))) == "Lookahead(Descent(eta=0.1), k=6, alpha=0.5)"


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_in_place_engine_in_small_chunks_equals_pure_bit_for_bit(backend, tiny_chunks):
    # parameters packed into chunks and split across them: the synchronisation of each chunk
    # sets its part of the parameter and of the slow weights
    gen = np.random.default_rng(7)
    w = gen.standard_normal((40, 30))
    model = {"embed": w, "mlp": [gen.standard_normal((30, 30)), gen.standard_normal(30)], "unembed": w}
    grads_list = random_gradients(model, 12)
    rule = opt.Lookahead(opt.Adam(0.01), k=3)
    pure_state, pure = opt.setup(rule, to_backend(model, backend)), to_backend(model, backend)
    state, m = opt.setup(rule, to_backend(model, backend)), to_backend(model, backend)
    for grads in grads_list:
        pure_state, pure = opt.update(pure_state, pure, to_backend(grads, backend))
        state, m = opt.update_(state, m, to_backend(grads, backend))
        for a, b in zip(jax.tree.leaves(as_numpy(m)), jax.tree.leaves(as_numpy(pure))):
            assert a.tobytes() == b.tobytes()
        evaluated, pure_evaluated = opt.eval_params(state, m), opt.eval_params(pure_state, pure)
        for a, b in zip(jax.tree.leaves(as_numpy(evaluated)), jax.tree.leaves(as_numpy(pure_evaluated))):
            assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_slow_weights_in_the_parameters_dtype_pure_equals_in_place(dtype):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 7, generator=gen).to(dtype)
    model = {"embed": w, "unembed": w, "bias": torch.randn(5, generator=gen).to(dtype)}
    copy = {"embed": w.clone(), "bias": model["bias"].clone()}
    copy["unembed"] = copy["embed"]
    rule = opt.Lookahead(opt.Adam(0.01), k=3)
    state, pure_state, pure = opt.setup(rule, model), opt.setup(rule, copy), copy
    for _ in range(8):
        grads = {k: torch.randn(v.shape, generator=gen).to(dtype) for k, v in model.items()}
        state, model = opt.update_(state, model, grads)
        pure_state, pure = opt.update(pure_state, pure, grads)
        assert all(torch.equal(model[k].view(torch.int16), pure[k].view(torch.int16)) for k in model)
    assert state["embed"].state[0].dtype == dtype  # the slow weights, as the parameter
    evaluated = opt.eval_params(state, model)
    assert evaluated["embed"] is evaluated["unembed"] and evaluated["embed"].dtype == dtype
    assert torch.equal(evaluated["embed"], state["embed"].state[0])


def test_torch_optimizer_groups_show_the_inner_rules_hyperparameters():
    # Lookahead's own alpha is not a hyperparameter that adjust reaches: a param group's "alpha"
    # is the inner rule's, as adjust(alpha=...) would change it
    @dataclasses.dataclass(frozen=True)
    class Scaled(opt.Rule):
        alpha: float = 0.1

        def apply(self, state, x, dx):
            return state, ops.scalar(self.alpha, x) * dx

    from optimisers.torch import Optimizer

    layer = torch.nn.Linear(3, 2)
    optimizer = Optimizer(layer.parameters(), opt.Lookahead(Scaled(0.1), k=2, alpha=0.5))
    assert optimizer.param_groups[0]["alpha"] == 0.1
    optimizer.param_groups[0]["alpha"] = 0.2
    before = layer.bias.detach().clone()
    layer(torch.ones(1, 3)).sum().backward()  # the bias's gradient is 1
    optimizer.step()
    torch.testing.assert_close(layer.bias.detach(), before - 0.2)
