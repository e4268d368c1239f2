"""The Adam/AdamW kernel of `optimisers.backends.numpy_kernels`, compiled by numba (imported only
where numba is installed, at a group's first use of the kernel).

It runs on the calling thread and releases the GIL: `numpy_kernels` spreads a step over cores by
calling it from its own threads on shares of the step's memory. None of it is `parallel=True`:
numba's threading layers are process-wide, and its default one (GNU OpenMP) kills a child that a
process forks after using it (`multiprocessing`'s default on Linux)."""

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


@intrinsic
def _pointer(typingctx, address, like):  # pragma: no cover - compiled
    """`address` as a pointer to elements of the array `like`'s dtype."""
    pointer = types.CPointer(like.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer))

    return pointer(types.int64, like), codegen


@numba.njit(inline="always")
def _piece(data, i, skip, n, like, cb1, cm, cb2, cv, scale, bc2, eps, decay, decoupled):  # pragma: no cover
    """Elements skip..skip+n of block i."""
    at = skip * like.itemsize
    x, g = numba.carray(_pointer(data[0, i] + at, like), n), numba.carray(_pointer(data[1, i] + at, like), n)
    m, v = numba.carray(_pointer(data[2, i] + at, like), n), numba.carray(_pointer(data[3, i] + at, like), n)
    for j in range(n):
        _element(x, g, m, v, j, cb1, cm, cb2, cv, scale, bc2, eps, decay, decoupled)


# error_model="numpy": a division by zero gives IEEE's inf or nan, as NumPy's ufuncs do, rather
# than raising; the loops then have no branch out and LLVM vectorises them (8x faster per core)
@numba.njit(cache=True, nogil=True, error_model="numpy")
def adam_blocks(
    data, ends, lo, hi, like, cb1, cm, cb2, cv, scale, bc2, eps, decay, decoupled
):  # pragma: no cover
    """Adam or AdamW in place over blocks of memory found by their data pointers `data[:, i]`
    (parameter, gradient, first and second moments), each block's arrays laid out alike, block i
    ending at element `ends[i]` of the blocks' concatenation: its elements `lo..hi` (a thread's
    share of a step). `like`: an array of their dtype."""
    i = np.searchsorted(ends, lo, side="right")
    while i < ends.shape[0] and lo < hi:
        start = ends[i - 1] if i > 0 else 0
        stop = min(hi, ends[i])
        _piece(data, i, lo - start, stop - lo, like, cb1, cm, cb2, cv, scale, bc2, eps, decay, decoupled)
        lo = stop
        i += 1
