"""NumPy's own kernels for the engine, compiled by numba where it is installed (optional).

A NumPy Adam step written with ufuncs makes about a dozen passes over memory (each operation
reads its inputs and writes a temporary); the loop below makes one, on every core, and so runs
at about the memory's bandwidth (`benchmarks/run.py`: 1M float32 elements in ~1 ms against
~11 ms for the ufuncs). It computes each element with the very operations, in the very order and
dtype, of the library's `Adam` and `AdamW` (`optimisers.rules.adam`), without fused multiply-adds
or reassociation (numba's default), so it gives the ufuncs' results bit for bit; the tests check
it against the per-Leaf path. float16 and bfloat16 (computed in float32 by the engine) keep the
ufunc path.

Without numba (or with `OPTIMISERS_NUMBA=0` in the environment) NumPy has no kernels and the
engine's chunks run the rules' own maths. numba compiles a kernel the first time a group uses it
(about a second, kept on disk for the next process).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import threading
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

AVAILABLE = os.environ.get("OPTIMISERS_NUMBA", "1") != "0" and importlib.util.find_spec("numba") is not None
# elements: smaller arrays step on one thread (waking numba's threads costs more than they save)
PARALLEL_FROM = 1 << 16
_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_LIKE = {dtype: np.empty(0, dtype) for dtype in _DTYPES}  # (one compiled kernel per dtype)


def _adam_step_many(args, xs, dxs, ms, vs, t) -> bool:
    """Adam or AdamW steps in place (`t` counts this step) of parameters `xs` that each fill one
    block of memory, their gradients `dxs` laid out alike and their moments `ms`, `vs` 1-D in
    that order. Each array is found by its header's data pointer (`_blocks`), so all the small
    ones step in one call and nothing is copied; a big one steps on every core. False where the
    kernel cannot take them (another dtype, an array that is not one block)."""
    dtype = xs[0].dtype
    blocks = _blocks(dtype, (xs, dxs, ms, vs)) if dtype in _DTYPES else None
    if blocks is None:
        return False
    from optimisers.backends import numpy_adam_numba as kernels

    data, sizes = blocks
    T = dtype.type
    b1, b2 = args.beta1, args.beta2
    eta, bc1, bc2 = T(args.lr), T(1 - b1**t), T(1 - b2**t)
    decay = eta * T(args.weight_decay) if args.decoupled else T(0)
    maths = (T(b1), T(1 - b1), T(b2), T(1 - b2), eta / bc1, bc2, T(args.epsilon), decay, bool(args.decoupled))
    big = sizes >= PARALLEL_FROM
    if big.any():
        # numba's default threading layer aborts the process when two threads run parallel
        # kernels at once (two States updated from two threads): one at a time
        with _PARALLEL:
            for i in np.flatnonzero(big):
                x, g, m, v = (a[i].ravel("K") for a in (xs, dxs, ms, vs))  # views, in memory order
                kernels.adam_parallel(x, g, m, v, *maths)
        if big.all():
            return True
        data, sizes = np.ascontiguousarray(data[:, ~big]), sizes[~big]  # (one compiled layout)
    if sizes.sum() < PARALLEL_FROM:
        kernels.adam_blocks_serial(data, sizes, _LIKE[dtype], *maths)
    else:
        with _PARALLEL:
            kernels.adam_blocks_parallel(data, sizes, _LIKE[dtype], *maths)
    return True


def _blocks(dtype, lists):
    """`(data pointers (4, n), sizes)` of the arrays in `lists` (parameters, gradients, first and
    second moments), read from the lists and the arrays' headers in one compiled call
    (`readers_numba.blocks` says what it checks), where each is an ndarray; else None."""
    reader = _reader()
    if reader is None or list_reader() is None:
        return None
    lists = [a if type(a) is list else list(a) for a in lists]
    n = len(lists[0])
    out = np.empty((5, n), np.int64)
    found = reader.blocks_in(np.array([id(a) for a in lists], np.int64), _NDARRAY, id(dtype),
                             np.empty((4, n), np.int64), out)
    return (out[:4], out[4]) if found else None


_NDARRAY = id(np.ndarray)


@functools.cache
def list_reader():
    """`readers_numba.same_items`, where numba compiles it and it reads lists as Python
    sees them (the same check decides whether the kernels read their arrays from lists)."""
    if _reader() is None:  # (no numba, not CPython, or NumPy's fields elsewhere)
        return None
    from optimisers.backends.readers_numba import same_items

    xs = [object(), 1.5, "x"]
    addresses = np.array(list(map(id, xs)), np.int64)
    agrees = same_items(id(xs), addresses) and not any(
        same_items(id(ys), addresses) for ys in (xs[:2], [*xs, None], xs[::-1], [])
    )
    return same_items if agrees else None


def gradients_like(gs):
    """A bulk check for later gradients (a list): is each exactly an ndarray of the dtype, shape
    and strides of the one at its place in `gs`? One compiled pass over the list and the arrays'
    headers (`readers_numba.items_alike`); None where numba does not read them."""
    reader = _reader()
    if reader is None or list_reader() is None or set(map(type, gs)) != {np.ndarray}:
        return None
    expected = np.zeros((len(gs), reader.WIDTH), np.int64)
    if not reader.headers(np.fromiter(map(id, gs), np.int64, len(gs)), expected):
        return None
    dtypes = {g.dtype for g in gs}  # (held: their addresses are compared)

    def like(ys, dtypes=dtypes):
        return type(ys) is list and reader.items_alike(id(ys), _NDARRAY, expected)

    return like


_PARALLEL = threading.Lock()


def _no_apply(args, state, x, dx):
    """One parameter on the per-Leaf path: the rule's own maths (None)."""
    return None


class _FastPath(NamedTuple):
    apply: Callable  # (args, state, x, dx) -> None: the per-Leaf path keeps the rule's maths
    step_many: Callable  # (args, xs, dxs, *state parts, t) -> whether it stepped them


FAST_PATHS = {"adam": _FastPath(_no_apply, _adam_step_many)} if AVAILABLE else {}


# --- the marks of many arrays, read in one call -------------------------------------------------


def read_headers(xs):
    """The header fields of the ndarrays `xs` (exactly of type ndarray) that the engine's
    per-step checks compare (memory, shape, strides, dtype, flags, base), as bytes, read in one
    compiled call where numba is installed: about 7 ns an array against 0.2 µs for NumPy's
    attributes. None where they cannot be read so (no numba, not CPython, an array of more than 4
    dimensions, or a NumPy whose fields `_headers_agree` found elsewhere)."""
    read = header_reader(xs)
    return None if read is None else read()


def header_reader(xs):
    """`read_headers` of the arrays `xs` (a list of ndarrays that will not change) as a function
    of no arguments, their addresses taken once; None where it would give None."""
    reader = _reader()
    if reader is None:
        return None
    xs = list(xs)  # its own list: the arrays whose addresses it reads stay alive while it does
    addresses = np.fromiter(map(id, xs), np.int64, len(xs))
    out = np.zeros((len(xs), reader.WIDTH), np.int64)
    headers, last = reader.headers, [None]

    def read(xs=xs):
        got = headers(addresses, out)
        if got != 1 or last[0] is None:  # (unchanged: the same bytes, compared by identity)
            last[0] = out.tobytes() if got else None
        return last[0]

    return read if read() is not None else None


@functools.cache
def _reader():
    if not (AVAILABLE and platform.python_implementation() == "CPython"):
        return None
    from optimisers.backends import readers_numba

    return readers_numba if _headers_agree(readers_numba) else None


def _headers_agree(reader) -> bool:
    """Does the compiled reader give NumPy's own attributes for arrays of every kind of layout?"""
    base = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    samples = [base, base[:, ::-1, ::2], base.T, np.float16(1) * np.ones(5), np.array(2.0), base[1]]
    samples[-1].flags.writeable = False
    out = np.zeros((len(samples), reader.WIDTH), np.int64)
    if not reader.headers(np.array([id(x) for x in samples], np.int64), out):
        return False
    pad = [0] * reader.MAX_DIMS
    for x, row in zip(samples, out.tolist()):
        expected = [x.__array_interface__["data"][0], x.ndim, id(x.dtype), x.flags.num,
                    0 if x.base is None else id(x.base)]
        expected += [*x.shape, *pad][: reader.MAX_DIMS] + [*x.strides, *pad][: reader.MAX_DIMS]
        if row != expected:
            return False
    return True
