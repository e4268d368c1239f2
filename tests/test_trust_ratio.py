"""LAMB and LARS against optax where the generic tests of `rules_registry.py` do not reach: arrays
whose norm is zero (a zero-initialised bias, a parameter that never gets a gradient, a step with
a zero gradient), the trust ratio taken per array in a model of several, on NumPy, PyTorch and
JAX under `jit`, in a chain, through `adjust_` and `freeze_` (float64, 1e-11)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import optimisers as opt

torch = pytest.importorskip("torch")

STEPS = 8
SHAPES = {"w": (4, 3), "b": (3,), "c": (2,)}


def initial_model():
    gen = np.random.default_rng(0)
    # b starts at zero (‖x‖ = 0); c never gets a gradient (with λ = 0, ‖u‖ = 0 at every step)
    return {"w": gen.standard_normal((4, 3)), "b": np.zeros(3), "c": gen.standard_normal(2)}


def gradients():
    gen = np.random.default_rng(1)
    out = []
    for t in range(STEPS):
        w = np.zeros((4, 3)) if t == 2 else gen.standard_normal((4, 3)) * np.exp(gen.uniform(-1, 1))
        out.append({"w": w, "b": gen.standard_normal(3), "c": np.zeros(2)})
    return out


RULES = {
    "LAMB": (lambda: opt.LAMB(0.01), lambda learning_rate: optax.lamb(learning_rate)),
    "LAMB(lambd)": (
        lambda: opt.LAMB(0.01, beta=(0.8, 0.99), lambd=0.1),
        lambda learning_rate: optax.lamb(learning_rate, b1=0.8, b2=0.99, weight_decay=0.1),
    ),
    "LARS": (
        lambda: opt.LARS(1.0, trust=0.01),
        lambda learning_rate: optax.lars(learning_rate, trust_coefficient=0.01),
    ),
    "LARS(nesterov)": (
        lambda: opt.LARS(1.0, beta=0.8, lambd=0.1, trust=0.02, epsilon=1e-3, nesterov=True),
        lambda learning_rate: optax.lars(
            learning_rate, weight_decay=0.1, trust_coefficient=0.02, eps=1e-3, momentum=0.8, nesterov=True
        ),
    ),
}
ETA = {"LAMB": 0.01, "LAMB(lambd)": 0.01, "LARS": 1.0, "LARS(nesterov)": 1.0}


def optax_trajectory(name, grads, adjust_at=None, chain=None):
    """optax's parameters after each step; with `adjust_at`, the learning rate halves before that
    step (optax applies it after the trust ratio, and LARS before its momentum, as ours)."""
    with jax.enable_x64(True):
        tx = optax.inject_hyperparams(RULES[name][1])(learning_rate=ETA[name])
        if chain is not None:
            tx = optax.chain(chain, tx)
        params = {k: jax.numpy.asarray(v) for k, v in initial_model().items()}
        state = tx.init(params)
        out = []
        for t, g in enumerate(grads):
            if t == adjust_at:
                inner = state[1] if chain is not None else state
                inner.hyperparams["learning_rate"] = jax.numpy.asarray(ETA[name] / 2)
            updates, state = tx.update({k: jax.numpy.asarray(v) for k, v in g.items()}, state, params)
            params = optax.apply_updates(params, updates)
            out.append({k: np.asarray(v) for k, v in params.items()})
        return out


def to_backend(tree, backend):
    if backend == "torch":
        return {k: torch.tensor(v) for k, v in tree.items()}
    if backend == "jax":
        return {k: jax.numpy.asarray(v) for k, v in tree.items()}
    return {k: v.copy() for k, v in tree.items()}


def host(x):
    """A NumPy copy (torch's update_ writes the tensors in place afterwards)."""
    return x.detach().numpy().copy() if isinstance(x, torch.Tensor) else np.array(x)


def our_trajectory(rule, grads, backend, adjust_at=None, eta=None):
    """Our parameters after each step; with `adjust_at`, `adjust` sets η/2 before that step."""
    with jax.enable_x64(True):
        model = to_backend(initial_model(), backend)
        state = opt.setup(rule, model)
        update = jax.jit(opt.update) if backend == "jax" else opt.update
        out = []
        for t, g in enumerate(grads):
            if t == adjust_at:
                state = opt.adjust(state, eta=eta / 2)
            if backend == "torch":
                opt.update_(state, model, to_backend(g, backend))
            else:
                state, model = update(state, model, to_backend(g, backend))
            out.append({k: host(v) for k, v in model.items()})
        return out


def assert_close(ours, theirs):
    for t, (mine, want) in enumerate(zip(ours, theirs), start=1):
        for k in SHAPES:
            assert np.all(np.isfinite(mine[k])), f"step {t}, {k}"
            np.testing.assert_allclose(mine[k], want[k], rtol=1e-11, atol=1e-13, err_msg=f"step {t}, {k}")


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("name", list(RULES))
def test_zero_norms_and_per_array_ratios_match_optax(name, backend):
    grads = gradients()
    assert_close(our_trajectory(RULES[name][0](), grads, backend), optax_trajectory(name, grads))


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("name", list(RULES))
def test_adjusting_the_learning_rate_matches_optax(name, backend):
    grads = gradients()
    ours = our_trajectory(RULES[name][0](), grads, backend, adjust_at=4, eta=ETA[name])
    assert_close(ours, optax_trajectory(name, grads, adjust_at=4))


@pytest.mark.parametrize("name", list(RULES))
def test_in_a_chain_after_clipping_matches_optax(name):
    grads = gradients()
    rule = opt.OptimiserChain(opt.ClipGrad(0.5), RULES[name][0]())
    assert_close(our_trajectory(rule, grads, "numpy"), optax_trajectory(name, grads, chain=optax.clip(0.5)))


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("name", list(RULES))
def test_a_frozen_array_keeps_its_value_and_the_others_their_steps(name, backend):
    """Each array's step depends on that array alone, so freezing b leaves w's steps as optax's."""
    grads = gradients()
    model = to_backend(initial_model(), backend)
    state = opt.setup(RULES[name][0](), model)
    theirs = optax_trajectory(name, grads)
    for t, g in enumerate(grads):
        if t == 3:
            opt.freeze_(state["b"])
            frozen_b = host(model["b"]).copy()
        opt.update_(state, model, to_backend(g, backend))
        np.testing.assert_allclose(host(model["w"]), theirs[t]["w"], rtol=1e-11, atol=1e-13)
    np.testing.assert_array_equal(host(model["b"]), frozen_b)
