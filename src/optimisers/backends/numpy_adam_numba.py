"""The Adam/AdamW kernel of `optimisers.backends.numpy_kernels`, compiled by numba (imported only
where numba is installed, at a group's first use of the kernel)."""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(inline="always")
def _element(x, g, m, v, i, cb1, cm, cb2, cv, scale, bc2, eps, decay, decoupled):  # pragma: no cover
    # the operations of `adam_moments` and `adam_direction` (+ AdamW's `decay * x`), in their order
    gi = g[i]
    mi = cb1 * m[i] + cm * gi
    vi = cb2 * v[i] + cv * (gi * gi)
    m[i] = mi
    v[i] = vi
    step = scale * mi / (np.sqrt(vi / bc2) + eps)
    if decoupled:
        step = step + decay * x[i]
    x[i] = x[i] - step


@numba.njit(cache=True, nogil=True)
def adam_serial(x, g, m, v, cb1, cm, cb2, cv, scale, bc2, eps, decay, decoupled):  # pragma: no cover
    for i in range(x.shape[0]):
        _element(x, g, m, v, i, cb1, cm, cb2, cv, scale, bc2, eps, decay, decoupled)


@numba.njit(cache=True, nogil=True, parallel=True)
def adam_parallel(x, g, m, v, cb1, cm, cb2, cv, scale, bc2, eps, decay, decoupled):  # pragma: no cover
    for i in numba.prange(x.shape[0]):
        _element(x, g, m, v, i, cb1, cm, cb2, cv, scale, bc2, eps, decay, decoupled)
