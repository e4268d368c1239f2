"""Every rule on JAX arrays against its optax counterpart, 100 jitted steps on a fixed gradient
sequence (gradients do not depend on the parameters, so rounding differences do not feed back).

The hyperparameter mapping is written next to each case. Where optax computes something else,
the test states exactly what relation holds instead (OAdam) or the rule is left out with the
reason (Rprop, SignDecay, MixedPrecision).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optimisers as opt

STEPS = 100
SHAPES = {"w": (7, 5), "b": (5,)}


def _x0():
    rng = np.random.default_rng(1)
    return {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in SHAPES.items()}


def _grads(steps=STEPS, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in SHAPES.items()}
        for _ in range(steps)
    ]


GRADS = _grads()

# (our rule, optax transformation). optax's sign convention is folded into apply_updates.
CASES = {
    "Descent": (opt.Descent(0.1), optax.sgd(0.1)),
    # η inside the velocity here, outside in optax: equal while η is constant
    "Momentum": (opt.Momentum(0.01, 0.9), optax.sgd(0.01, momentum=0.9)),
    "Nesterov": (opt.Nesterov(0.01, 0.9), optax.sgd(0.01, momentum=0.9, nesterov=True)),
    # optax's default puts ε inside the root
    "RMSProp": (
        opt.RMSProp(0.01, 0.9, 1e-8),
        optax.rmsprop(0.01, decay=0.9, eps=1e-8, eps_in_sqrt=False),
    ),
    "RMSProp(centred)": (
        opt.RMSProp(0.01, 0.9, 1e-8, centred=True),
        optax.rmsprop(0.01, decay=0.9, eps=1e-8, eps_in_sqrt=False, centered=True),
    ),
    "Adam": (opt.Adam(0.01, (0.9, 0.999), 1e-8), optax.adam(0.01, b1=0.9, b2=0.999, eps=1e-8)),
    # optax rectifies when ρ >= threshold (default 5); ours when ρ > 4
    "RAdam": (opt.RAdam(0.01), optax.radam(0.01, threshold=4.0)),
    # optax: ν ← max(β₂ν, |g| + ε), step ∝ m/ν; ours: w ← max(β₂w, |g|), step ∝ m/(w + ε)
    "AdaMax": (opt.AdaMax(0.01), optax.adamax(0.01, eps=1e-8)),
    # optax: accumulator starts at initial_accumulator_value, ε inside the root
    "AdaGrad": (opt.AdaGrad(0.1, 1e-8), optax.adagrad(0.1, initial_accumulator_value=1e-8, eps=0.0)),
    "AdaDelta": (opt.AdaDelta(0.9, 1e-6), optax.adadelta(1.0, rho=0.9, eps=1e-6)),
    "AMSGrad": (opt.AMSGrad(0.01), optax.amsgrad(0.01)),
    "NAdam": (opt.NAdam(0.01), optax.nadam(0.01)),
    # optax.adamw decays by lr·wd·x, like couple=True
    "AdamW": (opt.AdamW(0.01, (0.9, 0.999), 0.1), optax.adamw(0.01, weight_decay=0.1)),
    "AdaBelief": (opt.AdaBelief(0.01), optax.adabelief(0.01, eps=1e-16, eps_root=1e-16)),
    # optax.lion's defaults: b2=0.99, weight_decay=1e-3
    "Lion": (opt.Lion(0.001, (0.9, 0.99)), optax.lion(0.001, b1=0.9, b2=0.99, weight_decay=0.0)),
    "WeightDecay>Adam": (
        opt.OptimiserChain(opt.WeightDecay(0.1), opt.Adam(0.01)),
        optax.chain(optax.add_decayed_weights(0.1), optax.adam(0.01)),
    ),
    "ClipGrad>Adam": (
        opt.OptimiserChain(opt.ClipGrad(0.5), opt.Adam(0.01)),
        optax.chain(optax.clip(0.5), optax.adam(0.01)),
    ),
}


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
    rule, tx = CASES[name]
    x0 = _x0()
    ours = _run_ours(rule, x0, GRADS)
    theirs = _run_optax(tx, x0, GRADS)
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


RULES_UNDER_JIT = [
    opt.Descent(0.1),
    opt.Momentum(),
    opt.Nesterov(),
    opt.RMSProp(),
    opt.RMSProp(centred=True),
    opt.Rprop(),
    opt.Adam(),
    opt.RAdam(),
    opt.AdaMax(),
    opt.OAdam(),
    opt.AdaGrad(),
    opt.AdaDelta(),
    opt.AMSGrad(),
    opt.NAdam(),
    opt.AdamW(lambd=0.1),
    opt.AdamW(lambd=0.1, couple=False),
    opt.AdaBelief(),
    opt.Lion(),
    opt.WeightDecay(),
    opt.SignDecay(),
    opt.ClipGrad(0.5),
    opt.ClipNorm(1.0),
    opt.ClipNorm(1.0, float("inf")),
    opt.OptimiserChain(opt.ClipNorm(1.0), opt.WeightDecay(), opt.Adam()),
    opt.MixedPrecision(opt.Adam()),
]


@pytest.mark.parametrize("rule", RULES_UNDER_JIT, ids=repr)
def test_every_rule_jits_keeps_ties_and_equals_eager(rule):
    x0 = _x0()
    model = {"a": x0["w"], "b": x0["b"], "tied": x0["w"]}
    grads = [
        {"a": g["w"], "b": g["b"], "tied": 0.5 * g["w"]} for g in GRADS[:6]
    ]
    eager = _run_ours(rule, model, grads, jit=False)
    jitted = _run_ours(rule, model, grads, jit=True)
    for e, j in zip(eager, jitted):
        assert e["a"] is e["tied"]
        np.testing.assert_array_equal(j["a"], j["tied"])
        for k in model:
            # steps of Adam-like rules at small t: see test_adjust_between_jitted_calls...
            np.testing.assert_allclose(j[k], e[k], rtol=1e-5, atol=1e-6)
