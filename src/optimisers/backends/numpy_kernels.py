"""NumPy's own Adam/AdamW kernel for the engine, compiled by numba where it is installed.

One pass over memory instead of a ufunc step's dozen, computing each element with the very
operations, order and dtype of `optimisers.rules.adam` (no fused multiply-adds), so bit for bit
the ufuncs' results (docs/backends.md, "Speed"). Without numba, or with `OPTIMISERS_NUMBA=0`,
NumPy has no kernels; float16 and bfloat16 keep the ufunc path.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import itertools
import os
import platform
import queue
import threading

import numpy as np

from optimisers.backends.protocol import FastPath
from optimisers.backends.ranges import ByteRanges

AVAILABLE = os.environ.get("OPTIMISERS_NUMBA", "1") != "0" and importlib.util.find_spec("numba") is not None
# elements: a step of fewer runs on the calling thread alone (handing work to other threads costs
# more than they save); a bigger one is cut into shares of at least half this, one per thread
PARALLEL_FROM = 1 << 16
_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_LIKE = {dtype: np.empty(0, dtype) for dtype in _DTYPES}  # (one compiled kernel per dtype)


def _adam_step_many(args, xs, dxs, ms, vs, t) -> bool:
    """Adam or AdamW steps in place (`t` counts this step) of parameters `xs`, gradients `dxs` and
    moments `ms`, `vs`, each array found by its header's data pointer (`_blocks`) and the step's
    elements cut into equal shares, one per thread (`_run`). False where the kernel cannot take
    them (another dtype, an array that is not one block)."""
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
    ends = np.cumsum(sizes)
    total = int(ends[-1]) if len(ends) else 0
    n = max(1, min(_threads(), 2 * total // PARALLEL_FROM))
    cuts = [total * k // n for k in range(n + 1)]  # each thread steps an equal share
    shares = [(data, ends, lo, hi) for lo, hi in zip(cuts, cuts[1:])]
    _run(kernels.adam_blocks, shares, (_LIKE[dtype], *maths))
    return True


# --- threads of our own for the kernels --------------------------------------------------------
# numba's `parallel=True` runs on a threading layer chosen once per process; its default (GNU
# OpenMP) kills a child that a process forks after using it, and a `multiprocessing` Pool then
# waits forever. The kernels instead release the GIL and run on these threads, which a forked
# child (that has only the thread that forked) starts anew at its first step.

_WORKERS: list = []  # [tasks queue, threads]: made at first use, forgotten in a forked child
_STARTING = threading.Lock()


@functools.cache
def _threads() -> int:
    """How many threads a step may use: numba's own count (`NUMBA_NUM_THREADS`, else the cores
    this process may run on), read without starting numba's threads."""
    import numba

    return max(1, int(numba.config.NUMBA_NUM_THREADS))


def _run(kernel, shares, common) -> None:
    """`kernel(*share, *common)` for every share: this thread and the workers take shares in
    turn until none is left (a worker that wakes late finds none: this thread never waits for
    a worker that took nothing), and it returns when every share is done, raising what one
    raised."""
    if len(shares) == 1:
        kernel(*shares[0], *common)
        return
    job = (kernel, shares, common, itertools.count(), queue.SimpleQueue())
    tasks = _tasks(len(shares) - 1)
    for _ in shares[1:]:
        tasks.put(job)
    ran, error = _take(job, worker=False)
    # (the workers write the arrays: wait for each share they took)
    errors = [e for e in [job[4].get() for _ in range(len(shares) - ran)] if e is not None]
    if error is not None or errors:
        raise error or errors[0]


def _take(job, worker: bool):
    """Run the job's shares that are left, one at a time: `(how many, what one raised)`; a
    worker reports each share it ran to the job's caller instead (None, or what it raised)."""
    kernel, shares, common, taken, done = job
    ran, error = 0, None
    for i in taken:
        if i >= len(shares):
            break
        ran += 1
        try:
            kernel(*shares[i], *common)
        except BaseException as e:  # noqa: BLE001 - handed to the caller, which raises it
            error = e
        if worker:
            done.put(error)
            error = None
    return ran, error


def _tasks(n):
    """The workers' queue of jobs, with at least `n` workers taking from it."""
    with _STARTING:
        if not _WORKERS:
            _WORKERS[:] = [queue.SimpleQueue(), []]
        tasks, threads = _WORKERS
        while len(threads) < n:
            threads.append(threading.Thread(target=_work, args=(tasks,), daemon=True,
                                            name=f"optimisers-kernels-{len(threads)}"))
            threads[-1].start()
    return tasks


def _work(tasks) -> None:
    while True:
        _take(tasks.get(), worker=True)


def _forget_workers() -> None:
    """In a forked child: the parent's workers are not there (nor is its lock's holder)."""
    global _STARTING
    _WORKERS.clear()
    _STARTING = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_workers)


def _blocks(dtype, lists):
    """`(data pointers (4, n), sizes)` of the arrays in `lists` (parameters, gradients, first and
    second moments), read from the lists and the arrays' headers in one compiled call
    (`readers_numba.blocks` says what it checks), where each is an ndarray; else None."""
    reader = _reader()
    if reader is None:
        return None
    lists = [a if type(a) is list else list(a) for a in lists]
    n = len(lists[0])
    out = np.empty((5, n), np.int64)
    found = reader.blocks(np.array([id(a) for a in lists], np.int64), _NDARRAY, id(dtype),
                          np.empty((4, n), np.int64), out)
    return (out[:4], out[4]) if found else None


_NDARRAY = id(np.ndarray)


def list_reader():
    """`readers_numba.same_items`, where `_reader` gives one; else None."""
    reader = _reader()
    return None if reader is None else reader.same_items


# (one parameter on the per-Leaf path keeps the rule's own maths: no `apply`)
FAST_PATHS = {"adam": FastPath(lambda args, state, x, dx: None, _adam_step_many)} if AVAILABLE else {}


@functools.cache
def _reader():
    """`readers_numba`, where numba is installed and the offsets it reads hold what it expects
    (`_offsets_agree`, before anything compiled reads an object); else None."""
    if not (AVAILABLE and platform.python_implementation() == "CPython"
            and ctypes.sizeof(ctypes.c_void_p) == 8):
        return None
    from optimisers.backends import readers_numba

    return readers_numba if _offsets_agree(readers_numba) else None


def _word(address) -> int:
    return ctypes.c_int64.from_address(address).value


def _offsets_agree(at) -> bool:
    """Do CPython's objects and NumPy's arrays hold, at the byte offsets `readers_numba` (`at`)
    reads, what their public attributes say, for samples of every kind of layout? Read with
    ctypes, never following a pointer not checked first: the fields within each object's
    `__basicsize__`, then, only where all agree, the pointers to a list's items and an array's
    shape and strides (where each looks like one), and what they point at."""
    array_fields = (at._DATA, at._ND, at._DIMS, at._STRIDES, at._BASE, at._DESCR, at._FLAGS, at._TYPE)
    list_fields = (at._LENGTH, at._ITEMS, at._TYPE)
    if max(array_fields) + 8 > np.ndarray.__basicsize__ or max(list_fields) + 8 > list.__basicsize__:
        return False
    base = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    arrays = [base, base[:, ::-1, ::2], base.T, np.ones(5, np.float16), np.array(2.0), base[1],
              np.zeros((3, 0, 2)), np.asfortranarray(base[:, :, 1]), np.ones((1, 2, 1, 2, 1, 3), np.int8)]
    arrays[5].flags.writeable = False
    lists = [arrays, arrays[:1], [None, 1.5, "x"]]
    if any(_word(id(x) + at._TYPE) != id(type(x)) for x in [*arrays, *lists]):
        return False
    if any(_word(id(xs) + at._LENGTH) != len(xs) for xs in lists):
        return False
    for x in arrays:
        a = id(x)
        found = [_word(a + at._DATA), _word(a + at._ND) & at._INT, _word(a + at._DESCR),
                 _word(a + at._FLAGS) & at._INT, _word(a + at._BASE)]
        if found != [x.__array_interface__["data"][0], x.ndim, id(x.dtype), x.flags.num,
                     0 if x.base is None else id(x.base)]:
            return False
    # the fields public attributes give are where NumPy's and CPython's headers put them: the
    # pointers beside them, where those headers put them too, are followed now
    shaped = [x for x in arrays if x.ndim]
    dims = [_word(id(x) + at._DIMS) for x in shaped]
    if [_word(id(x) + at._STRIDES) - 8 * x.ndim for x in shaped] != dims:
        return False
    if not all(p > 4096 and p % 8 == 0 for p in [*dims, *(_word(id(xs) + at._ITEMS) for xs in lists)]):
        return False
    for xs in lists:
        items = _word(id(xs) + at._ITEMS)
        if [_word(items + 8 * i) for i in range(len(xs))] != list(map(id, xs)):
            return False
    for x in arrays:
        dims, strides = _word(id(x) + at._DIMS), _word(id(x) + at._STRIDES)
        if [_word(dims + 8 * k) for k in range(x.ndim)] != list(x.shape):
            return False
        if [_word(strides + 8 * k) for k in range(x.ndim)] != list(x.strides):
            return False
    return True


# --- one check of a step's arrays (`optimisers.backends.numpy.snapshot` and `unchanged`) ---------


class Snapshot:
    """`numpy.snapshot`'s token where numba reads the arrays' headers: the parameters (kept, so
    that their addresses and their dtypes' stay theirs), their header fields and shapes, and what
    the gradients' must be (`readers_numba.still` says what `unchanged` compares)."""

    __slots__ = ("xs", "dtypes", "_still", "_args")

    def __init__(self, xs, dtypes, args):
        self.xs, self.dtypes, self._still, self._args = xs, dtypes, _reader().still, (_NDARRAY, *args)

    def still(self, xs, gs) -> bool:
        if type(xs) is not list:
            xs = list(xs)
        if type(gs) is not list:
            gs = list(gs)
        return self._still(id(xs), id(gs), *self._args)


def reads_headers() -> bool:
    """Does numba read NumPy's array headers here (`snapshot`, `spans`)?"""
    return _reader() is not None


def snapshot(xs, gs):
    """`numpy.snapshot`, read in compiled passes; None also where numba does not read them."""
    reader = _reader()
    if reader is None:
        return None
    x = _layouts(reader, xs, shapes=True)
    g = None if x is None else _layouts(reader, gs, shapes=True)
    if g is None:
        return None
    (x_rows, x_shapes, x_reach, x_dtypes), (g_rows, g_shapes, g_reach, g_dtypes) = x, g
    if not (x_rows[:, 4] & reader._WRITEABLE).all() or (g_reach[:, 3] == 0).any():
        return None
    params = ByteRanges(x_rows[:, 1] + x_reach[:, 0], x_rows[:, 1] + x_reach[:, 1])
    if params.overlap_one_another():
        return None
    reach = np.ascontiguousarray(g_reach[:, :3])
    args = (x_rows, x_shapes, g_rows, g_shapes, reach, params.starts, params.ends)
    return Snapshot(list(xs), (x_dtypes, g_dtypes), args)


# the dtypes whose descr `readers_numba.layouts` knows (kept: their addresses stay theirs), with
# their addresses and (itemsize, alignment); found anew past a few hundred
_KNOWN: tuple = ([], np.zeros(0, np.int64), np.zeros((0, 2), np.int64))


def data_pointers(arrays):
    """Where each of the `arrays` (a list) starts, read in one compiled pass; None where numba
    does not read them or an item is not exactly an ndarray."""
    reader = _reader()
    found = None if reader is None else _layouts(reader, arrays, shapes=False)
    return None if found is None else found[0][:, 1].tolist()


def _layouts(reader, arrays, shapes: bool):
    """`(rows, shapes, reach, dtypes)` of the list `arrays` (`readers_numba.layouts`; `shapes`
    only where asked for), and the dtypes they hold; None where an item is not exactly an
    ndarray."""
    global _KNOWN
    arrays = arrays if type(arrays) is list else list(arrays)
    n = len(arrays)
    rows, reach = np.empty((n, 7), np.int64), np.empty((n, 4), np.int64)
    found = np.empty(4 * n if shapes else 0, np.int64)
    while True:
        known = _KNOWN
        need = reader.layouts(id(arrays), _NDARRAY, known[1], known[2], rows, found, reach)
        if need == -1:
            return None
        if need < -1:  # a dtype not known yet: one attribute read
            dtype = arrays[-2 - need].dtype
            dtypes = [dtype] if len(known[0]) >= 256 else [*known[0], dtype]
            _KNOWN = (dtypes, np.array(list(map(id, dtypes)), np.int64),
                      np.array([(d.itemsize, d.alignment) for d in dtypes], np.int64).reshape(-1, 2))
        elif shapes and need > len(found):
            found = np.empty(need, np.int64)
        else:
            dtypes = [known[0][k] for k in np.unique(rows[:, 6])] if shapes else None
            return rows, found[:need] if shapes else found, reach, dtypes
