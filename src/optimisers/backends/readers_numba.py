"""Readers of many objects in one call, compiled by numba (imported only where numba is installed,
at the first read): NumPy's array headers (`optimisers.backends.numpy_kernels.read_headers`),
and Python lists (`optimisers.backends.objects`).

It reads the fields of NumPy's `PyArrayObject_fields` at their places in NumPy's public ABI (the
header `ndarraytypes.h`; compiled extensions read them with `PyArray_DATA`, `PyArray_DIMS` & co.),
given each array's address, which CPython's `id` is, a list's length and item pointers where
CPython's `PyListObject` has them (`listobject.h`). Each caller checks the fields against
Python's own answers on samples before it trusts this. None of these release the GIL: the
objects they read cannot change while they do.
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


@numba.njit(inline="always")
def _put(out, i, j, value) -> bool:  # pragma: no cover - compiled
    """Write `value` at `out[i, j]`: did it change?"""
    if out[i, j] == value:
        return False
    out[i, j] = value
    return True


@numba.njit(cache=True)
def headers(addresses, out) -> int:  # pragma: no cover - compiled
    """Row i of `out`: data pointer, dimensions, descr, flags and base of the array at
    `addresses[i]`, then its shape and strides (zero beyond its dimensions). 0 where an array
    has more than MAX_DIMS dimensions; else 1 where `out` held these very fields already, 2
    where some changed."""
    changed = False
    for i in range(addresses.shape[0]):
        a = addresses[i]
        nd = _word(a + _ND) & _INT
        if nd > MAX_DIMS:
            return 0
        changed |= _put(out, i, 0, _word(a + _DATA))
        changed |= _put(out, i, 1, nd)
        changed |= _put(out, i, 2, _word(a + _DESCR))
        changed |= _put(out, i, 3, _word(a + _FLAGS) & _INT)
        changed |= _put(out, i, 4, _word(a + _BASE))
        dims, strides = _word(a + _DIMS), _word(a + _STRIDES)
        for k in range(MAX_DIMS):
            changed |= _put(out, i, 5 + k, _word(dims + 8 * k) if k < nd else 0)
            changed |= _put(out, i, 5 + MAX_DIMS + k, _word(strides + 8 * k) if k < nd else 0)
    return 2 if changed else 1


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
def blocks(addresses, descr, out) -> bool:  # pragma: no cover - compiled
    """For the arrays at `addresses[:, i]` (a parameter, its gradient, its two moments): their data
    pointers in `out[:4, i]` and the parameter's size in `out[4, i]`. True where each is of the
    dtype `descr`, fills one aligned block of memory, the gradient is laid out as the parameter,
    each moment too or 1-D of its size, and the parameter and moments are writable."""
    for i in range(addresses.shape[1]):
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
def blocks_in(lists, ndarray, descr, addresses, out) -> bool:  # pragma: no cover - compiled
    """`blocks` of the arrays held by the 4 lists at `lists`, each of `addresses.shape[1]` items,
    each exactly an ndarray (of the type at `ndarray`); their addresses go to `addresses`."""
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
    return blocks(addresses, descr, out)


@numba.njit(cache=True)
def items_alike(address, ndarray, expected) -> bool:  # pragma: no cover - compiled
    """Does the list at `address` hold one array per row of `expected` (`headers`' rows), each
    exactly an ndarray (of the type at `ndarray`) with its row's dimensions, descr, shape and
    strides?"""
    n = expected.shape[0]
    if _word(address + _LENGTH) != n:
        return False
    items = _word(address + _ITEMS)
    for i in range(n):
        a = _word(items + 8 * i)
        if _word(a + _TYPE) != ndarray:
            return False
        nd = _word(a + _ND) & _INT
        if nd != expected[i, 1] or _word(a + _DESCR) != expected[i, 2]:
            return False
        dims, strides = _word(a + _DIMS), _word(a + _STRIDES)
        for k in range(nd):
            if _word(dims + 8 * k) != expected[i, 5 + k]:
                return False
            if _word(strides + 8 * k) != expected[i, 5 + MAX_DIMS + k]:
                return False
    return True
