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


def _arrays_of_repeated_sizes(dtype, seed):
    """Many arrays in a few sizes (arrays of one size are reduced together), in mixed order, one
    not contiguous, one of more than one of `norm`'s chunks, and zeros."""
    rng = np.random.default_rng(seed)
    shapes = [(16, 16), (256,), (3,), (7, 5), (300_000,), (1,)] * 3 + [(16, 16)] * 20
    rng.shuffle(shapes)
    out = [(rng.standard_normal(s) * rng.uniform(0.01, 100)).astype(dtype) for s in shapes]
    out[3] = np.zeros_like(out[3])
    out.append(rng.standard_normal((12, 8)).astype(dtype)[:, ::2])  # (12, 4), strided
    return out


@pytest.mark.parametrize("p", [2, 1, np.inf, -np.inf, 0, 3.0])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("to", [np.asarray, torch.from_numpy, jnp.asarray], ids=["numpy", "torch", "jax"])
def test_norms_of_many_arrays_are_each_arrays_norm_bit_for_bit(to, dtype, p):
    """`ops.norms` (segmented, for ClipNorm's factors over an engine group) gives each array
    exactly `ops.norm`'s value, so `update_` and `update` clip by the same factors."""
    xs = [to(a) for a in _arrays_of_repeated_sizes(dtype, seed=1)]
    got = np.asarray(ops.norms(xs, p))
    want = np.array([np.asarray(ops.norm(x, p)) for x in xs])
    assert got.shape == (len(xs),) and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("size", [1, 7, 256, 4099, 32767, 32768, 300_000])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("to", [np.asarray, torch.from_numpy], ids=["numpy", "torch"])
def test_norms_of_arrays_of_one_size_and_of_a_matrix_s_rows_are_each_norm(to, dtype, size):
    """Arrays of one size (thousands of small parameters), and the rows of a matrix (LAMB's
    packed parameters and directions), are reduced together: each still gets `ops.norm`'s bits,
    below torch's grain of parallel work and above it."""
    rng = np.random.default_rng(size)
    m = (rng.standard_normal((5, size)) * rng.uniform(0.01, 100, (5, 1))).astype(dtype)
    m[2] = 0
    rows = to(m)
    for p in (2, 1, np.inf):
        want = np.array([np.asarray(ops.norm(to(m[i].copy()), p)) for i in range(len(m))])
        np.testing.assert_array_equal(np.asarray(ops.norms(rows, p)), want)
        np.testing.assert_array_equal(np.asarray(ops.norms([to(r.copy()) for r in m], p)), want)
        if size % 7 == 0:  # (one size, shapes apart)
            shaped = [to(r.copy().reshape((7, -1) if i % 2 else (-1, 7))) for i, r in enumerate(m)]
            np.testing.assert_array_equal(np.asarray(ops.norms(shaped, p)), want)
