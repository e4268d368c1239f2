"""Each rule against its torch.optim / optax counterpart over many steps (float64), with the
hyperparameter mapping that its docstring gives. Rules whose counterpart differs by design (NAdam
vs torch's momentum schedule, RAdam vs torch's threshold, OAdam's first step) are compared where
they agree, or not at all; the docstrings say how they differ."""

from __future__ import annotations

import numpy as np
import pytest

import optimisers as opt
from optimisers import (
    AdaBelief,
    AdaDelta,
    AdaGrad,
    Adam,
    AdaMax,
    AdamW,
    AMSGrad,
    ClipGrad,
    ClipNorm,
    Descent,
    Lion,
    Momentum,
    NAdam,
    Nesterov,
    OAdam,
    OptimiserChain,
    RAdam,
    RMSProp,
    Rprop,
    WeightDecay,
)

STEPS = 25


def gradients(seed=0, shape=(4, 3)):
    """Gradients of varying scale and sign, no exact zeros (AdaMax with ε = 0 divides by |g|)."""
    gen = np.random.default_rng(seed)
    return [gen.standard_normal(shape) * np.exp(gen.uniform(-1, 1.5)) for _ in range(STEPS)]


def our_trajectory(rule, x0, grads):
    model = {"w": x0.copy()}
    state = opt.setup(rule, model)
    out = []
    for g in grads:
        state, model = opt.update(state, model, {"w": g})
        out.append(model["w"])
    return out


# --- torch.optim ---------------------------------------------------------------------------------

TORCH = [
    (Descent(0.1), "SGD", dict(lr=0.1)),
    (Momentum(0.01, 0.9), "SGD", dict(lr=0.01, momentum=0.9)),
    (Nesterov(0.01, 0.9), "SGD", dict(lr=0.01, momentum=0.9, nesterov=True)),
    (RMSProp(0.01, 0.9, 1e-8), "RMSprop", dict(lr=0.01, alpha=0.9, eps=1e-8)),
    (RMSProp(0.01, 0.9, 1e-8, centred=True), "RMSprop", dict(lr=0.01, alpha=0.9, eps=1e-8, centered=True)),
    (Rprop(0.01, (0.5, 1.2), (1e-6, 50.0)), "Rprop", dict(lr=0.01, etas=(0.5, 1.2), step_sizes=(1e-6, 50))),
    (Adam(0.01, (0.9, 0.999), 1e-8), "Adam", dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8)),
    (AdamW(0.01, (0.9, 0.999), 0.1), "AdamW", dict(lr=0.01, betas=(0.9, 0.999), weight_decay=0.1)),
    (AdaMax(0.01, epsilon=0.0), "Adamax", dict(lr=0.01, eps=0.0)),  # torch adds ε inside the max
    (AdaGrad(0.1, 1e-8), "Adagrad", dict(lr=0.1, initial_accumulator_value=1e-8, eps=1e-8)),
    (AdaDelta(0.9, 1e-6), "Adadelta", dict(lr=1.0, rho=0.9, eps=1e-6)),
]


@pytest.mark.parametrize("rule, name, kwargs", TORCH, ids=[f"{n}-{type(r).__name__}" for r, n, _ in TORCH])
def test_matches_torch_optim(rule, name, kwargs):
    torch = pytest.importorskip("torch")
    x0 = np.random.default_rng(1).standard_normal((4, 3))
    grads = gradients(2)
    param = torch.tensor(x0.copy(), dtype=torch.float64, requires_grad=True)
    optimiser = getattr(torch.optim, name)([param], **kwargs)
    ours = our_trajectory(rule, x0, grads)
    for t, (g, mine) in enumerate(zip(grads, ours), start=1):
        param.grad = torch.tensor(g)
        optimiser.step()
        np.testing.assert_allclose(mine, param.detach().numpy(), rtol=1e-11, atol=1e-13, err_msg=f"step {t}")


# --- optax -----------------------------------------------------------------------------------------


def _optax_cases(optax):
    descend = optax.scale(-1.0)
    return [
        (Adam(0.01), optax.adam(0.01)),
        (AdamW(0.01, lambd=0.1), optax.adamw(0.01, weight_decay=0.1)),
        (RAdam(0.01), optax.radam(0.01, threshold=4.0)),
        (AdaMax(0.01), optax.adamax(0.01)),
        (AMSGrad(0.01), optax.amsgrad(0.01)),
        (NAdam(0.01), optax.nadam(0.01)),
        (AdaBelief(0.01), optax.adabelief(0.01, eps=1e-16, eps_root=1e-16)),
        (Lion(0.01), optax.lion(0.01, b1=0.9, b2=0.999, weight_decay=0.0)),
        (RMSProp(0.01), optax.rmsprop(0.01, decay=0.9, eps=1e-8, eps_in_sqrt=False)),
        (
            RMSProp(0.01, centred=True),
            optax.rmsprop(0.01, decay=0.9, eps=1e-8, eps_in_sqrt=False, centered=True),
        ),
        (AdaDelta(0.9, 1e-6), optax.adadelta(1.0, rho=0.9, eps=1e-6)),
        (Momentum(0.01, 0.9), optax.sgd(0.01, momentum=0.9)),
        (Nesterov(0.01, 0.9), optax.sgd(0.01, momentum=0.9, nesterov=True)),
        # optax's gradient transformations give updates to add; ours alone subtract them
        (ClipGrad(0.5), optax.chain(optax.clip(0.5), descend)),
        (ClipNorm(2.0), optax.chain(optax.clip_by_global_norm(2.0), descend)),  # one array
        (WeightDecay(0.1), optax.chain(optax.add_decayed_weights(0.1), descend)),
        (OptimiserChain(ClipGrad(0.5), Adam(0.01)), optax.chain(optax.clip(0.5), optax.adam(0.01))),
    ]


OPTAX_IDS = [
    "adam", "adamw", "radam", "adamax", "amsgrad", "nadam", "adabelief", "lion", "rmsprop",
    "rmsprop_centred", "adadelta", "momentum", "nesterov", "clip", "clip_by_global_norm",
    "add_decayed_weights", "chain",
]  # fmt: skip


@pytest.mark.parametrize("index", range(len(OPTAX_IDS)), ids=OPTAX_IDS)
def test_matches_optax(index):
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    x0 = np.random.default_rng(3).standard_normal((4, 3))
    grads = gradients(4)
    with jax.enable_x64(True):
        rule, transform = _optax_cases(optax)[index]
        ours = our_trajectory(rule, x0, grads)
        params = jax.numpy.asarray(x0)
        state = transform.init(params)
        for t, (g, mine) in enumerate(zip(grads, ours), start=1):
            updates, state = transform.update(jax.numpy.asarray(g), state, params)
            params = optax.apply_updates(params, updates)
            np.testing.assert_allclose(mine, np.asarray(params), rtol=1e-11, atol=1e-13, err_msg=f"step {t}")


def test_oadam_matches_optax_after_its_first_step():
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    grads = gradients(5)
    with jax.enable_x64(True):
        transform = optax.optimistic_adam_v2(
            0.01, alpha=1.0, beta=1.0, b1=0.5, b2=0.9, eps=1e-8, nesterov=False
        )
        params = jax.numpy.zeros((4, 3))
        state = transform.init(params)
        theirs = []
        for g in grads:
            updates, state = transform.update(jax.numpy.asarray(g), state, params)
            theirs.append(-np.asarray(updates))
    rule = OAdam(0.01)
    x = np.zeros((4, 3))
    s = rule.init(x)
    for t, (g, their_step) in enumerate(zip(grads, theirs), start=1):
        s, step = rule.apply(s, x, g)
        want = 2 * their_step if t == 1 else their_step
        np.testing.assert_allclose(step, want, rtol=1e-11, atol=1e-14, err_msg=f"step {t}")


# --- JAX tracing of value-dependent branches -----------------------------------------------------


def test_radam_branch_is_traceable_under_jit():
    jax = pytest.importorskip("jax")
    rule = RAdam(0.01)
    apply = jax.jit(rule.apply)
    x_np = np.ones(3, np.float32)
    x_jax = jax.numpy.asarray(x_np)
    s_np, s_jax = rule.init(x_np), rule.init(x_jax)
    for t, g in enumerate(gradients(6, shape=(3,))[:12], start=1):
        g = g.astype(np.float32)
        s_np, step_np = rule.apply(s_np, x_np, g)
        s_jax, step_jax = apply(s_jax, x_jax, jax.numpy.asarray(g))
        momentum = 0.01 * s_np[0] / (1 - 0.9**t)
        if t <= 4:  # ρ ≤ 4: momentum alone
            np.testing.assert_allclose(step_np, momentum, rtol=1e-6)
            np.testing.assert_allclose(np.asarray(step_jax), step_np, rtol=1e-5)
        else:
            # Traced, ρ = ρ∞ − 2tβ₂ᵗ/(1−β₂ᵗ) is a float32 difference of two numbers near 2000,
            # so √(ρ−4) is a percent or so off at t = 5 (as in optax); eager uses Python floats.
            assert np.all(np.abs(step_np) < 0.1 * np.abs(momentum))  # r ≈ 0.017 at t = 5
            np.testing.assert_allclose(np.asarray(step_jax), step_np, rtol=3e-2)
