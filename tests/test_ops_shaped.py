"""The maths of shaped arrays in `optimisers.ops` (what matrix rules use) give NumPy's answers on
every backend, eager and under jax.jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from optimisers import ops

RNG = np.random.default_rng(0)
A = RNG.standard_normal((3, 4, 5)).astype(np.float32)
S = (lambda m: m @ m.T)(RNG.standard_normal((4, 4))).astype(np.float32)  # symmetric

CASES = {
    "reshape": (lambda x: ops.reshape(x, (3, -1)), lambda a: a.reshape(3, -1)),
    "matrix_transpose": (ops.matrix_transpose, lambda a: np.swapaxes(a, -1, -2)),
    "matmul": (lambda x: ops.matmul(x, ops.matrix_transpose(x)), lambda a: a @ np.swapaxes(a, -1, -2)),
    "tensordot": (
        lambda x: ops.tensordot(x, x, ([0, 1], [0, 1])),
        lambda a: np.tensordot(a, a, ([0, 1], [0, 1])),
    ),
    "sum_all": (ops.sum, np.sum),
    "sum_axis": (lambda x: ops.sum(x, axis=-1, keepdims=True), lambda a: a.sum(-1, keepdims=True)),
    "mean_axes": (lambda x: ops.mean(x, axis=(0, 2)), lambda a: a.mean((0, 2))),
    "stack": (lambda x: ops.stack([x, 2 * x]), lambda a: np.stack([a, 2 * a])),
    "take": (lambda x: ops.take(x, ops.argsort(x[0, 0]), 2), lambda a: a[:, :, np.argsort(a[0, 0])]),
    "zeros": (lambda x: ops.zeros((2, 3), x) + x[0, 0, 0], lambda a: np.full((2, 3), a[0, 0, 0])),
    # a reconstruction is unique where the factors are not (signs of eigenvectors, of q's columns)
    "qr": (lambda x: (lambda q, r: ops.matmul(q, r))(*ops.qr(x[0])), lambda a: a[0]),
}
BACKENDS = {
    "numpy": (lambda a: a, lambda f: f),
    "torch": (torch.tensor, lambda f: f),
    "jax": (jnp.asarray, lambda f: f),
    "jax-jit": (jnp.asarray, jax.jit),
}


def host(x):
    return np.asarray(x.numpy() if isinstance(x, torch.Tensor) else x)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_shaped_maths_match_numpy(case, backend):
    f, reference = CASES[case]
    to, wrap = BACKENDS[backend]
    out = wrap(f)(to(A))
    np.testing.assert_allclose(host(out), reference(A), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_eigh_reconstructs_and_sorts(backend):
    to, wrap = BACKENDS[backend]
    w, v = wrap(ops.eigh)(to(S))
    w, v = host(w), host(v)
    assert np.all(np.diff(w) >= 0)
    np.testing.assert_allclose((v * w) @ v.T, S, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_dtype_epsilon_is_the_dtypes(backend):
    to, _ = BACKENDS[backend]
    assert ops.dtype_epsilon(to(A)) == float(np.finfo(np.float32).eps)
    assert ops.dtype_epsilon(to(A.astype(np.float16))) == float(np.finfo(np.float16).eps)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_argsort_is_stable_and_descending_reverses_it(backend):
    to, wrap = BACKENDS[backend]
    x = to(np.array([2.0, 1.0, 2.0, 0.0, 1.0], np.float32))
    assert host(wrap(ops.argsort)(x)).tolist() == [3, 1, 4, 0, 2]
    assert host(wrap(lambda v: ops.argsort(v, descending=True))(x)).tolist() == [2, 0, 4, 1, 3]


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_zeros_have_the_dtype_of_like(backend):
    to, _ = BACKENDS[backend]
    z = ops.zeros((2, 3), to(A.astype(np.float16)))
    assert tuple(z.shape) == (2, 3) and str(z.dtype).endswith("float16") and not host(z).any()
