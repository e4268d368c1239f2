"""The Adam/AdamW kernel of `optimisers.backends.numpy_kernels`, compiled by numba (imported only
where numba is installed, at a group's first use of the kernel).

It runs on the calling thread and releases the GIL: `numpy_kernels` spreads a step over cores by
calling it from its own threads on shares of the step's memory. None of it is `parallel=True`:
numba's threading layers are process-wide, and its default one (GNU OpenMP) kills a child that a
process forks after using it (`multiprocessing`'s default on Linux)."""

from __future__ import annotations

import numba
import numpy as np
from numba import carray, types
from numba.extending import intrinsic


@intrinsic
def _pointer(typingctx, address, like):  # pragma: no cover - compiled
    """`address` as a pointer to elements of the array `like`'s dtype."""
    pointer = types.CPointer(like.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer))

    return pointer(types.int64, like), codegen


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
        at, n = (lo - start) * like.itemsize, stop - lo  # the block's elements lo..stop
        x, g = carray(_pointer(data[0, i] + at, like), n), carray(_pointer(data[1, i] + at, like), n)
        m, v = carray(_pointer(data[2, i] + at, like), n), carray(_pointer(data[3, i] + at, like), n)
        for j in range(n):
            # the operations of `adam_moments` and `adam_direction` (+ AdamW's `decay * x`), in order
            gj = g[j]
            mj = cb1 * m[j] + cm * gj
            vj = cb2 * v[j] + cv * (gj * gj)
            m[j] = mj
            v[j] = vj
            step = scale * mj / (np.sqrt(vj / bc2) + eps)
            if decoupled:
                step = step + decay * x[j]
            x[j] = x[j] - step
        lo = stop
        i += 1
