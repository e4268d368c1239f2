"""Every path of an update sums a tied parameter's gradients in one place, `engine/ties.py`:
the first `update_` (gather, plan, groups), the later ones (a replayed route), the pure
`update`, on every backend. Breaking the sum there breaks every step of every path."""

from __future__ import annotations

import numpy as np
import pytest

import optimisers as opt
from optimisers.engine import ties

jnp = pytest.importorskip("jax.numpy")
torch = pytest.importorskip("torch")

STEPS = 4
ETA, B1, B2, EPS = 0.01, 0.9, 0.999, 1e-8
RNG = np.random.default_rng(7)
W0 = RNG.normal(size=(6, 5)).astype(np.float32)
M0 = RNG.normal(size=(5,)).astype(np.float32)
# each step's gradient at each place: the embedding's two places, and the untied vector
SHAPES = {"a": W0.shape, "b": W0.shape, "m": M0.shape}
G = [{k: RNG.normal(size=s).astype(np.float32) for k, s in SHAPES.items()} for _ in range(STEPS)]

BACKENDS = {
    "numpy": lambda a: a.copy(),
    "torch": lambda a: torch.tensor(a),
    "jax": lambda a: jnp.asarray(a),
}


def reference():
    """W after each step by Adam's formula in float64, on the sum of its two places' gradients."""
    w, m, v, out = W0.astype(np.float64), 0.0, 0.0, []
    for t, g in enumerate(G, start=1):
        dx = g["a"].astype(np.float64) + g["b"]
        m = B1 * m + (1 - B1) * dx
        v = B2 * v + (1 - B2) * dx**2
        w = w - ETA * (m / (1 - B1**t)) / (np.sqrt(v / (1 - B2**t)) + EPS)
        out.append(w)
    return out


def steps_that_match(backend: str, update) -> list[bool]:
    """For each step of `update` on a model whose "a" and "b" are one array: does W match the
    reference, and do both places still hold one array?"""
    make = BACKENDS[backend]
    w = make(W0)
    model = {"a": w, "mid": [make(M0)], "b": w}
    state = opt.setup(opt.Adam(ETA, (B1, B2), EPS), model)
    out = []
    for g, want in zip(G, reference()):
        grads = {"a": make(g["a"]), "mid": [make(g["m"])], "b": make(g["b"])}
        state, model = update(state, model, grads)
        assert model["a"] is model["b"]
        got = np.asarray(model["a"], dtype=np.float64)
        out.append(bool(np.allclose(got, want, rtol=1e-4, atol=1e-6)))
    return out


UPDATES = {"update_": opt.update_, "update": opt.update}


@pytest.mark.parametrize("update", list(UPDATES))
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_every_step_sums_the_places(backend, update):
    assert steps_that_match(backend, UPDATES[update]) == [True] * STEPS


@pytest.mark.parametrize("update", list(UPDATES))
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_broken_sum_in_ties_breaks_every_step(backend, update, monkeypatch):
    right = ties.summed

    def counts_the_first_place_twice(grads, out=None):
        return right([grads[0], *grads], out)

    monkeypatch.setattr(ties, "summed", counts_the_first_place_twice)
    assert steps_that_match(backend, UPDATES[update]) == [False] * STEPS
