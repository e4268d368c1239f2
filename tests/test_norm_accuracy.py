"""`ops.norm` of a large float32 array is accurate on every backend: a p-norm over millions of
elements summed in a few long running float32 sums is off by about 1e-4 (torch's own
`vector_norm` on 4M elements), which LAMB's and LARS's trust ratios and ClipNorm would inherit."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from optimisers import ops

RNG = np.random.default_rng(0)
BIG = (RNG.standard_normal((2048, 2048)) * 0.02 + 0.01).astype(np.float32)

LAYOUTS = {
    "contiguous": lambda a: torch.tensor(a),
    "transposed": lambda a: torch.tensor(a.T.copy()).t(),
    "channels_last": lambda a: torch.tensor(a.reshape(64, 64, 32, 32)).to(memory_format=torch.channels_last),
}


def relative_error(value, p):
    exact = np.linalg.norm(BIG.astype(np.float64).ravel(), p)
    return abs(float(value) - exact) / exact


@pytest.mark.parametrize("p", [2, 1])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_torch_norm_of_a_large_float32_array_is_accurate(layout, p):
    x = LAYOUTS[layout](BIG)
    assert relative_error(ops.norm(x, p), p) < 1e-5


@pytest.mark.parametrize("to", [np.asarray, jnp.asarray], ids=["numpy", "jax"])
def test_numpy_and_jax_norms_are_accurate_too(to):
    assert relative_error(ops.norm(to(BIG), 2), 2) < 1e-5


@pytest.mark.parametrize("p", [np.inf, -np.inf, 0, 3.0])
def test_torch_norm_other_orders_match_numpy(p):
    x = torch.tensor(BIG)
    exact = np.linalg.norm(BIG.astype(np.float64).ravel(), p)
    np.testing.assert_allclose(float(ops.norm(x, p)), exact, rtol=1e-4)
