"""Each rule against its torch.optim / optax counterpart over many steps (float64), with the
hyperparameter mapping of `rules_registry.py` (families `torch64` and `optax64`), which follows
the rules' docstrings. Rules whose counterpart differs by design (NAdam vs torch's momentum
schedule, RAdam vs torch's threshold, OAdam's first step) are compared where they agree, or not
at all; the docstrings and the registry say how they differ."""

from __future__ import annotations

import numpy as np
import pytest

import optimisers as opt
from optimisers import OAdam, RAdam
from rules_registry import optax_cases, torch_cases

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

TORCH = torch_cases("torch64")


@pytest.mark.parametrize("case", TORCH, ids=[f"{c.peer.name}-{c.name}" for c in TORCH])
def test_matches_torch_optim(case):
    torch = pytest.importorskip("torch")
    x0 = np.random.default_rng(1).standard_normal((4, 3))
    grads = gradients(2)
    param = torch.tensor(x0.copy(), dtype=torch.float64, requires_grad=True)
    optimiser = case.theirs([param])
    ours = our_trajectory(case.ours(), x0, grads)
    for t, (g, mine) in enumerate(zip(grads, ours), start=1):
        param.grad = torch.tensor(g)
        optimiser.step()
        np.testing.assert_allclose(mine, param.detach().numpy(), rtol=1e-11, atol=1e-13, err_msg=f"step {t}")


# --- optax -----------------------------------------------------------------------------------------

OPTAX = optax_cases("optax64")


@pytest.mark.slow
@pytest.mark.parametrize("case", OPTAX, ids=[c.name for c in OPTAX])
def test_matches_optax(case):
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    x0 = np.random.default_rng(3).standard_normal((4, 3))
    grads = gradients(4)
    with jax.enable_x64(True):
        transform = case.theirs(optax)
        ours = our_trajectory(case.ours(), x0, grads)
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
