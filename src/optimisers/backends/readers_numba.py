"""Readers of many objects in one call, compiled by numba (imported where numba is installed):
NumPy's array headers (`PyArrayObject_fields` at their places in NumPy's public ABI,
`ndarraytypes.h`) and CPython's lists (`listobject.h`), found by address (CPython's `id`). Every
offset read here is first checked with ctypes against Python's own answers on samples
(`numpy_kernels._offsets_agree`). None of these release the GIL: the objects they read cannot
change while they do.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

# byte offsets in PyArrayObject_fields, after PyObject_HEAD
_DATA, _ND, _DIMS, _STRIDES, _BASE, _DESCR, _FLAGS = 16, 24, 32, 40, 48, 56, 64
_INT = 0xFFFFFFFF  # nd and flags are C ints: the low half of their word


@intrinsic
def _word(typingctx, address):  # pragma: no cover - compiled
    """The 8 bytes at `address`."""

    def codegen(context, builder, signature, args):
        return builder.load(builder.inttoptr(args[0], ir.IntType(64).as_pointer()))

    return types.int64(types.int64), codegen


# byte offsets in PyListObject, after PyObject_HEAD: its length (ob_size) and its items' array;
# and in every object's PyObject_HEAD, its type
_LENGTH, _ITEMS, _TYPE = 16, 24, 8


@numba.njit(cache=True)
def same_items(address, expected) -> bool:  # pragma: no cover - compiled
    """Does the list at `address` hold exactly the objects whose addresses are `expected`?"""
    n = expected.shape[0]
    if _word(address + _LENGTH) != n:
        return False
    items = _word(address + _ITEMS)
    for i in range(n):
        if _word(items + 8 * i) != expected[i]:
            return False
    return True


# NumPy's flags (ndarraytypes.h): C or Fortran contiguous, aligned, writeable
_ONE_BLOCK, _ALIGNED, _WRITEABLE = 0x1 | 0x2, 0x100, 0x400


@numba.njit(inline="always")
def _alike(a, x, nd):  # pragma: no cover - compiled
    """Has the array at `a` the dimensions, shape and strides of the `nd`-dimensional one at `x`?"""
    if _word(a + _ND) & _INT != nd:
        return False
    dims_a, dims_x = _word(a + _DIMS), _word(x + _DIMS)
    strides_a, strides_x = _word(a + _STRIDES), _word(x + _STRIDES)
    for k in range(nd):
        if _word(dims_a + 8 * k) != _word(dims_x + 8 * k):
            return False
        if _word(strides_a + 8 * k) != _word(strides_x + 8 * k):
            return False
    return True


@numba.njit(cache=True)
def blocks(lists, ndarray, descr, addresses, out) -> bool:  # pragma: no cover - compiled
    """For the arrays held by the 4 lists at `lists` (parameters, gradients, first and second
    moments), each of `addresses.shape[1]` items: their addresses in `addresses`, their data
    pointers in `out[:4, i]` and the parameter's size in `out[4, i]`. True where each is exactly
    an ndarray (of the type at `ndarray`) of the dtype `descr` and fills one aligned block of
    memory, the gradient is laid out as the parameter, each moment too or 1-D of its size, and
    the parameter and moments are writable."""
    n = addresses.shape[1]
    for j in range(4):
        if _word(lists[j] + _LENGTH) != n:
            return False
        items = _word(lists[j] + _ITEMS)
        for i in range(n):
            a = _word(items + 8 * i)
            if _word(a + _TYPE) != ndarray:
                return False
            addresses[j, i] = a
    for i in range(n):
        x = addresses[0, i]
        nd = _word(x + _ND) & _INT
        size, dims = 1, _word(x + _DIMS)
        for k in range(nd):
            size *= _word(dims + 8 * k)
        for j in range(4):
            a = addresses[j, i]
            flags = _word(a + _FLAGS) & _INT
            need = _ALIGNED if j == 1 else _ALIGNED | _WRITEABLE
            if _word(a + _DESCR) != descr or flags & need != need or flags & _ONE_BLOCK == 0:
                return False
            flat = j > 1 and _word(a + _ND) & _INT == 1 and _word(_word(a + _DIMS)) == size
            if not (flat or _alike(a, x, nd)):
                return False
            out[j, i] = _word(a + _DATA)
        out[4, i] = size
    return True


@numba.njit(cache=True)
def layouts(address, ndarray, known, sizes, rows, shapes, reach) -> int:  # pragma: no cover - compiled
    """For the array at item i of the list at `address`: row i of `rows`, its address, data
    pointer, dimensions, descr, flags, where its dimensions and then its strides start in
    `shapes` (written where `shapes` is long enough) and its descr's place in `known`; row i of
    `reach`, its first and one past its last byte from its data pointer (0, 0 where it has no
    elements), its dtype's alignment, and whether its strides are multiples of that (1 or 0), of
    a dtype `sizes[k]` (itemsize, alignment) for descr `known[k]`. -1 where the list does not
    hold `rows.shape[0]` items, each exactly an ndarray (of the type at `ndarray`); -2 - i where
    item i's descr is not `known`; else the length `shapes` needs."""
    n = rows.shape[0]
    if _word(address + _LENGTH) != n:
        return -1
    items, at = _word(address + _ITEMS), 0
    for i in range(n):
        a = _word(items + 8 * i)
        if _word(a + _TYPE) != ndarray:
            return -1
        nd, descr = _word(a + _ND) & _INT, _word(a + _DESCR)
        kind = -1
        for k in range(known.shape[0]):
            if known[k] == descr:
                kind = k
                break
        if kind < 0:
            return -2 - i
        rows[i, 0], rows[i, 1], rows[i, 2], rows[i, 3] = a, _word(a + _DATA), nd, descr
        rows[i, 4], rows[i, 5], rows[i, 6] = _word(a + _FLAGS) & _INT, at, kind
        dims, strides, write = _word(a + _DIMS), _word(a + _STRIDES), at + 2 * nd <= shapes.shape[0]
        lo, hi, align, ok, empty = 0, sizes[kind, 0], sizes[kind, 1], 1, False
        for k in range(nd):
            size, stride = _word(dims + 8 * k), _word(strides + 8 * k)
            if write:
                shapes[at + k], shapes[at + nd + k] = size, stride
            if size > 1 and stride % align != 0:  # (as NumPy's ALIGNED flag)
                ok = 0
            if size == 0:
                empty = True
            elif stride < 0:
                lo += (size - 1) * stride
            else:
                hi += (size - 1) * stride
        if empty:
            lo, hi = 0, 0
        reach[i, 0], reach[i, 1], reach[i, 2], reach[i, 3] = lo, hi, align, ok
        at += 2 * nd
    return at


@numba.njit(inline="always")
def _laid_out(a, nd, shapes, at) -> bool:  # pragma: no cover - compiled
    """Has the `nd`-dimensional array at `a` the dimensions and strides at `shapes[at:]`?"""
    dims, strides = _word(a + _DIMS), _word(a + _STRIDES)
    for k in range(nd):
        if _word(dims + 8 * k) != shapes[at + k] or _word(strides + 8 * k) != shapes[at + nd + k]:
            return False
    return True


@numba.njit(cache=True)
def still(xs, gs, ndarray, x_rows, x_shapes, g_rows, g_shapes, reach, starts, ends):  # pragma: no cover
    """Do the lists at `xs` and `gs` hold, item by item, the arrays of `x_rows` (`layouts`' rows:
    the same objects, with the same data pointer, dimensions, descr, flags, shape and strides) and
    arrays exactly of type ndarray with the descr, shape and strides of `g_rows`, each at an
    address aligned to `reach[i, 2]` and no byte of which (from its data pointer + `reach[i, 0]`
    to + `reach[i, 1]`) is a parameter's? The parameters' bytes: `[starts[j], ends[j])` in order
    of their starts, `ends` each the greatest end so far."""
    n, m = x_rows.shape[0], g_rows.shape[0]
    if _word(xs + _LENGTH) != n or _word(gs + _LENGTH) != m:
        return False
    x_items, g_items = _word(xs + _ITEMS), _word(gs + _ITEMS)
    for i in range(n):
        a, nd = _word(x_items + 8 * i), x_rows[i, 2]
        if a != x_rows[i, 0] or _word(a + _DATA) != x_rows[i, 1] or _word(a + _ND) & _INT != nd:
            return False
        if _word(a + _DESCR) != x_rows[i, 3] or _word(a + _FLAGS) & _INT != x_rows[i, 4]:
            return False
        if not _laid_out(a, nd, x_shapes, x_rows[i, 5]):
            return False
    for i in range(m):
        a, nd = _word(g_items + 8 * i), g_rows[i, 2]
        if _word(a + _TYPE) != ndarray or _word(a + _ND) & _INT != nd or _word(a + _DESCR) != g_rows[i, 3]:
            return False
        if not _laid_out(a, nd, g_shapes, g_rows[i, 5]):
            return False
        data = _word(a + _DATA)
        if data % reach[i, 2] != 0:
            return False
        lo, hi = data + reach[i, 0], data + reach[i, 1]
        if lo < hi:  # (an empty array has no bytes)
            k = np.searchsorted(starts, hi)  # the parameters that start before it ends
            if k > 0 and ends[k - 1] > lo:
                return False
    return True
