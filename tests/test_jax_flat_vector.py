"""JAX's path for many small arrays (docs/backends.md, "one flat vector"): the parameters kept as
`destructure`'s flat vector, the gradient taken through `rebuild`. The steps equal those of the
per-array pytree path (ties summed, kept), and the jitted step is one array however many the model
has."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import optimisers as opt  # noqa: E402


def _model():
    key = jax.random.key(0)
    E = jax.random.normal(key, (12, 4)) * 0.5
    blocks = [jax.random.normal(jax.random.key(k), (4, 4)) * 0.5 for k in range(1, 30)]
    return {"embed": E, "blocks": blocks, "bias": jnp.linspace(-1, 1, 4), "unembed": E}


def _loss(params, ids):
    h = params["embed"][ids]
    for w in params["blocks"]:
        h = jnp.tanh(h @ w + params["bias"])
    return jnp.mean((h @ params["unembed"].T) ** 2)


@pytest.mark.parametrize(
    "make", [lambda: opt.Adam(1e-2), lambda: opt.AdamW(1e-2, lambd=0.1), lambda: opt.Momentum(1e-2, 0.9)]
)
def test_flat_vector_steps_as_the_pytree(make):
    model = _model()
    flat, rebuild = opt.destructure(model)
    ids = jnp.arange(12) % 12

    @jax.jit
    def flat_step(state, flat):
        grad = jax.grad(lambda f: _loss(rebuild(f), ids))(flat)
        return opt.update(state, flat, grad)

    @jax.jit
    def tree_step(state, params):
        return opt.update(state, params, jax.grad(_loss)(params, ids))

    flat_state, tree_state, params = opt.setup(make(), flat), opt.setup(make(), model), model
    for _ in range(4):
        flat_state, flat = flat_step(flat_state, flat)
        tree_state, params = tree_step(tree_state, params)
    rebuilt = rebuild(flat)
    assert jnp.array_equal(rebuilt["embed"], rebuilt["unembed"])  # the tie, one segment
    for a, b in zip(jax.tree_util.tree_leaves(rebuilt), jax.tree_util.tree_leaves(params), strict=True):
        # the same maths, compiled as one loop or one per array: XLA may round a few ulps apart
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert len(jax.tree_util.tree_leaves(flat_state)) < 10 < len(jax.tree_util.tree_leaves(tree_state))
