"""The blockwise quantiser of `optimisers.backends.numpy_quant` compiled by numba (imported only
where numba is installed): one pass over each block for its absmax, one for its codes, with the
operations and dtype of the ufunc path (float32 division, the same tables), so bit for bit its
results."""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True, error_model="numpy")
def quantise_flat(
    flat, block, divisor, smallest, shift, first, buckets, threshold, pairs, codes, scale
):  # pragma: no cover - compiled
    """Codes (into `codes`) and float32 scales (into `scale`) of the 1-D float32 array `flat`."""
    n = flat.shape[0]
    scaled = np.empty(block, np.float32)
    bits = scaled.view(np.int32)
    for b in range(scale.shape[0]):
        lo = b * block
        k = min(n, lo + block) - lo
        top = np.float32(0)
        nan = False
        for i in range(k):  # (branch-free, so that LLVM vectorises it)
            a = abs(flat[lo + i])
            top = max(top, a)
            nan |= a != a
        if nan:  # NumPy's max keeps a NaN
            top = np.float32(np.nan)
        s = top if not top < smallest else smallest
        if divisor != 1:
            s = s / divisor
        scale[b] = s
        for i in range(k):
            scaled[i] = flat[lo + i] / s
        for i in range(k):
            word = bits[i]
            magnitude = word & 0x7FFFFFFF
            j = (magnitude >> shift) - (first - 1)
            j = min(max(j, 0), buckets - 1) + ((word >> 31) & buckets)  # (no branches: see `pairs`)
            codes[lo + i] = np.uint8(pairs[j] >> (np.int32(magnitude >= threshold[j]) << 3))
