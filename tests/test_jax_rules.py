"""Every rule on JAX arrays against its optax counterpart, 100 jitted steps on a fixed gradient
sequence (gradients do not depend on the parameters, so rounding differences do not feed back).

The rules, their optax counterparts and the hyperparameter mapping are those of
`rules_registry.py` (family `optax32`), with the reasons written there. Where optax computes
something else, the test states exactly what relation holds instead (OAdam, ClipNorm, AccumGrad).
Every rule of the registry's `jit` family also runs under `jax.jit` with ties, as eagerly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optimisers as opt
from rules_registry import ambiguous_basis, jit_rules, optax_cases, shaped_like

STEPS = 100
SHAPES = {"w": (7, 5), "b": (5,)}
# for rules whose steps on a (7, 5) array depend on an arbitrary eigenbasis (see rules_registry)
SQUARE_SHAPES = {"w": (5, 5), "b": (5,)}


def _x0(shapes=SHAPES):
    rng = np.random.default_rng(1)
    return {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}


def _grads(steps=STEPS, seed=0, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    return [
        {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}
        for _ in range(steps)
    ]


GRADS = _grads()

# our rule and its optax counterpart, with the hyperparameter mapping written in rules_registry.py;
# optax's sign convention is folded into apply_updates
CASES = {case.name: case for case in optax_cases("optax32")}


def _run_optax(tx, x0, grads):
    state = tx.init(x0)
    step = jax.jit(tx.update)
    params, out = x0, []
    for g in grads:
        updates, state = step(g, state, params)
        params = optax.apply_updates(params, updates)
        out.append(params)
    return out


def _run_ours(rule, x0, grads, jit=True):
    state = opt.setup(rule, x0)
    step = jax.jit(opt.update) if jit else opt.update
    model, out = x0, []
    for g in grads:
        state, model = step(state, model, g)
        out.append(model)
    return out


def _rel(a, b):
    """max |a - b| / max |b| over both parameters."""
    return max(float(jnp.max(jnp.abs(a[k] - b[k])) / jnp.max(jnp.abs(b[k]))) for k in a)


@pytest.mark.parametrize("name", list(CASES))
def test_rule_matches_optax_over_100_steps(name):
    rule, tx = CASES[name].ours(), CASES[name].theirs(optax)
    x0, grads = shaped_like(rule, _x0()), shaped_like(rule, GRADS)
    ours = _run_ours(rule, x0, grads)
    theirs = _run_optax(tx, x0, grads)
    # float32 rounding, with float32 bias corrections (1 - β₂ᵗ) as the worst-conditioned part
    assert max(_rel(a, b) for a, b in zip(ours, theirs)) < 2e-5
    final_move = max(float(jnp.max(jnp.abs(theirs[-1][k] - x0[k]))) for k in x0)
    final_diff = max(float(jnp.max(jnp.abs(ours[-1][k] - theirs[-1][k]))) for k in x0)
    # RAdam's ρ = ρ∞ − 2tβ₂ᵗ/(1−β₂ᵗ) ≈ 5 is a difference of numbers near 2000 in float32, so its
    # rectification factor, and the few steps right after rectification starts, agree to ~1e-4
    assert final_diff < (1e-3 if name == "RAdam" else 1e-4) * final_move


def test_clipnorm_matches_optax_global_norm_on_one_array():
    # per-array norm here, global norm in optax: equal for a model with a single array
    x0 = {"w": _x0()["w"]}
    grads = [{"w": 3 * g["w"]} for g in GRADS]
    ours = _run_ours(opt.OptimiserChain(opt.ClipNorm(1.0), opt.Descent(0.1)), x0, grads)
    theirs = _run_optax(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)), x0, grads)
    assert max(_rel(a, b) for a, b in zip(ours, theirs)) < 2e-5


def test_oadam_matches_optax_from_the_second_step():
    # optax.optimistic_adam_v2 (nesterov=False, alpha=beta=1) takes the same steps from the
    # second step on; its first step is the Adam step q₁ where ours is 2q₁ − 0. So the two
    # trajectories differ by a constant offset, q₁.
    x0 = _x0()
    ours = _run_ours(opt.OAdam(0.01, (0.5, 0.9), 1e-8), x0, GRADS)
    tx = optax.optimistic_adam_v2(
        0.01, alpha=1.0, beta=1.0, b1=0.5, b2=0.9, eps=1e-8, nesterov=False
    )
    theirs = _run_optax(tx, x0, GRADS)
    offset = {k: ours[0][k] - theirs[0][k] for k in x0}
    for a, b in zip(ours, theirs):
        for k in x0:
            np.testing.assert_allclose(a[k] - b[k], offset[k], rtol=1e-3, atol=2e-5)


def test_accumgrad_matches_optax_multisteps_eagerly():
    # AccumGrad decides in Python whether to step, so it runs eagerly (not under jit)
    x0 = _x0()
    grads = GRADS[:24]
    ours = _run_ours(opt.OptimiserChain(opt.AccumGrad(4), opt.Adam(0.01)), x0, grads, jit=False)
    theirs = _run_optax(optax.MultiSteps(optax.adam(0.01), every_k_schedule=4), x0, grads)
    assert max(_rel(a, b) for a, b in zip(ours, theirs)) < 2e-5
    # moves on every 4th call only
    np.testing.assert_array_equal(ours[2]["w"], x0["w"])
    assert float(jnp.max(jnp.abs(ours[3]["w"] - x0["w"]))) > 1e-3


RULES_UNDER_JIT = jit_rules()


@pytest.mark.parametrize("rule", RULES_UNDER_JIT, ids=repr)
def test_every_rule_jits_keeps_ties_and_equals_eager(rule):
    shapes = SQUARE_SHAPES if ambiguous_basis(rule) else SHAPES
    x0 = shaped_like(rule, _x0(shapes))
    model = {"a": x0["w"], "b": x0["b"], "tied": x0["w"]}
    grads = [
        {"a": g["w"], "b": g["b"], "tied": 0.5 * g["w"]} for g in shaped_like(rule, _grads(6, shapes=shapes))
    ]
    eager = _run_ours(rule, model, grads, jit=False)
    jitted = _run_ours(rule, model, grads, jit=True)
    for e, j in zip(eager, jitted):
        assert e["a"] is e["tied"]
        np.testing.assert_array_equal(j["a"], j["tied"])
        for k in model:
            # steps of Adam-like rules at small t: see test_adjust_between_jitted_calls...
            np.testing.assert_allclose(j[k], e[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rule", RULES_UNDER_JIT, ids=repr)
def test_every_rules_state_can_be_donated(rule):
    """`jax.jit(update, donate_argnums=0)` donates every buffer of the state: a rule whose `init`
    or `apply` puts one array at two places of its state would make XLA refuse the call."""
    shapes = SQUARE_SHAPES if ambiguous_basis(rule) else SHAPES
    model = shaped_like(rule, _x0(shapes))
    step = jax.jit(opt.update, donate_argnums=0)
    state = opt.setup(rule, model)
    for g in shaped_like(rule, _grads(3, shapes=shapes)):
        state, model = step(state, model, g)
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(model))
