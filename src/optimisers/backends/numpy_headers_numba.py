"""The ndarray header reader of `optimisers.backends.numpy_kernels.read_headers`, compiled by numba
(imported only where numba is installed, at the first read).

It reads the fields of NumPy's `PyArrayObject_fields` at their places in NumPy's public ABI (the
header `ndarraytypes.h`; compiled extensions read them with `PyArray_DATA`, `PyArray_DIMS` & co.),
given each array's address, which CPython's `id` is. `read_headers` checks every field against
NumPy's own attributes on sample arrays before it trusts this.
"""

from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

MAX_DIMS = 4  # arrays of more dimensions are read by NumPy's attributes
WIDTH = 5 + 2 * MAX_DIMS
# byte offsets in PyArrayObject_fields, after PyObject_HEAD
_DATA, _ND, _DIMS, _STRIDES, _BASE, _DESCR, _FLAGS = 16, 24, 32, 40, 48, 56, 64
_INT = 0xFFFFFFFF  # nd and flags are C ints: the low half of their word


@intrinsic
def _word(typingctx, address):  # pragma: no cover - compiled
    """The 8 bytes at `address`."""

    def codegen(context, builder, signature, args):
        return builder.load(builder.inttoptr(args[0], ir.IntType(64).as_pointer()))

    return types.int64(types.int64), codegen


@numba.njit(cache=True, nogil=True)
def headers(addresses, out) -> bool:  # pragma: no cover - compiled
    """Row i of `out`: data pointer, dimensions, descr, flags and base of the array at
    `addresses[i]`, then its shape and strides (zero beyond its dimensions). False where an array
    has more than MAX_DIMS dimensions."""
    for i in range(addresses.shape[0]):
        a = addresses[i]
        nd = _word(a + _ND) & _INT
        if nd > MAX_DIMS:
            return False
        out[i, 0] = _word(a + _DATA)
        out[i, 1] = nd
        out[i, 2] = _word(a + _DESCR)
        out[i, 3] = _word(a + _FLAGS) & _INT
        out[i, 4] = _word(a + _BASE)
        dims, strides = _word(a + _DIMS), _word(a + _STRIDES)
        for k in range(MAX_DIMS):
            out[i, 5 + k] = _word(dims + 8 * k) if k < nd else 0
            out[i, 5 + MAX_DIMS + k] = _word(strides + 8 * k) if k < nd else 0
    return True
