"""The Adam/AdamW kernel of `optimisers.backends.numpy_kernels`, compiled by numba (imported only
where numba is installed, at a group's first use of the kernel)."""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic


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


@numba.njit(cache=True, nogil=True, parallel=True)
def adam_parallel(x, g, m, v, cb1, cm, cb2, cv, scale, bc2, eps, decay, decoupled):  # pragma: no cover
    for i in numba.prange(x.shape[0]):
        _element(x, g, m, v, i, cb1, cm, cb2, cv, scale, bc2, eps, decay, decoupled)


@intrinsic
def _pointer(typingctx, address, like):  # pragma: no cover - compiled
    """`address` as a pointer to elements of the array `like`'s dtype."""
    pointer = types.CPointer(like.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer))

    return pointer(types.int64, like), codegen


@numba.njit(inline="always")
def _block(data, sizes, i, like, cb1, cm, cb2, cv, scale, bc2, eps, decay, decoupled):  # pragma: no cover
    n = sizes[i]
    x, g = numba.carray(_pointer(data[0, i], like), n), numba.carray(_pointer(data[1, i], like), n)
    m, v = numba.carray(_pointer(data[2, i], like), n), numba.carray(_pointer(data[3, i], like), n)
    for j in range(n):
        _element(x, g, m, v, j, cb1, cm, cb2, cv, scale, bc2, eps, decay, decoupled)


@numba.njit(cache=True, nogil=True)
def adam_blocks_serial(
    data, sizes, like, cb1, cm, cb2, cv, scale, bc2, eps, decay, decoupled
):  # pragma: no cover
    """`adam_parallel`'s loop, on one thread, over many arrays, found by the data pointers
    `data[:, i]` (parameter, gradient, first and second moments) of `sizes[i]` elements each, one
    block of memory laid out alike; `like`: an array of their dtype."""
    for i in range(sizes.shape[0]):
        _block(data, sizes, i, like, cb1, cm, cb2, cv, scale, bc2, eps, decay, decoupled)


@numba.njit(cache=True, nogil=True, parallel=True)
def adam_blocks_parallel(
    data, sizes, like, cb1, cm, cb2, cv, scale, bc2, eps, decay, decoupled
):  # pragma: no cover
    for i in numba.prange(sizes.shape[0]):
        _block(data, sizes, i, like, cb1, cm, cb2, cv, scale, bc2, eps, decay, decoupled)
