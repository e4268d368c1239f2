"""The sum of squares of float32 arrays compiled by numba (imported only where numba is
installed), for `optimisers.backends.numpy.norm` and `norms`: each row of a matrix summed in
float64, where each square is exact, in eight running sums combined in one fixed order. A row
reduced alone and a row of a matrix are the same loop, so `norms` gives each array `norm`'s
bits; the result is as accurate as float64 allows (NumPy's pairwise float32 sum loses about
1e-6), and at memory speed (NumPy's square-then-sum ran at 8 GB/s here)."""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True, error_model="numpy")
def row_squares(m, out):  # pragma: no cover - compiled
    """`out[r]` = the sum of the squares of row `r` of the C-contiguous float32 matrix `m`."""
    rows, n = m.shape
    whole = n - n % 8
    for r in range(rows):
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float64(0)
        for i in range(0, whole, 8):
            v0, v1 = np.float64(m[r, i]), np.float64(m[r, i + 1])
            v2, v3 = np.float64(m[r, i + 2]), np.float64(m[r, i + 3])
            v4, v5 = np.float64(m[r, i + 4]), np.float64(m[r, i + 5])
            v6, v7 = np.float64(m[r, i + 6]), np.float64(m[r, i + 7])
            s0 += v0 * v0
            s1 += v1 * v1
            s2 += v2 * v2
            s3 += v3 * v3
            s4 += v4 * v4
            s5 += v5 * v5
            s6 += v6 * v6
            s7 += v7 * v7
        for i in range(whole, n):
            v = np.float64(m[r, i])
            s0 += v * v
        out[r] = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
