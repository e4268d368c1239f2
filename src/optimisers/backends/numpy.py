"""NumPy arrays (and NumPy scalars, which appear as cast hyperparameters)."""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import operator
import os
import platform

import numpy as np

from optimisers import ops
from optimisers.backends import numba_lowering, numpy_kernels
from optimisers.backends import scalar as _scalar
from optimisers.backends.numpy_quant import (  # noqa: F401
    bfloat16_rounded,
    dequantise_blocks,
    quantise_blocks,
)
from optimisers.backends.ranges import ByteRanges

# --- how the update treats NumPy (see optimisers.backends.protocol) ---------------------------

no_grad = contextlib.nullcontext  # no autograd
SHARE_SCALAR_STATE = False
IN_PLACE_ENGINE = True
cond, is_traced = _scalar.cond, _scalar.is_traced  # as for Python numbers (not as JAX)
# Adam/AdamW compiled by numba where it is installed; else none
FAST_PATHS = numpy_kernels.FAST_PATHS


def fit_as_they_are(gs, xs, dtype, device):
    """For each gradient, whether `astype` and `laid_out_like` would hand it back unchanged."""
    ndarray = np.ndarray
    return [type(g) is ndarray and g.dtype is dtype and g.strides == x.strides for g, x in zip(gs, xs)]


def addresses(xs) -> list:
    found = numpy_kernels.data_pointers(xs) if type(xs) is list else None
    return found if found is not None else list(map(_pointer, xs))


def flat_span(xs):
    """A 1-D view of the memory that the arrays `xs` fill back to back in this order (each C
    contiguous and writable, all of one owner and dtype), or None. Addresses alone are not
    enough: two allocations may lie next to each other."""
    x0 = xs[0]
    if any(type(x) is not np.ndarray for x in xs):
        return None
    owner, dtype = memory_owners([x0])[0], x0.dtype
    at = start = addresses([x0])[0]
    for x in xs:
        flags = x.flags
        if not (flags.c_contiguous and flags.writeable) or x.dtype != dtype:
            return None
        if addresses([x])[0] != at or memory_owners([x])[0] != owner:
            return None
        at += x.nbytes
    return np.lib.stride_tricks.as_strided(x0.reshape(-1), ((at - start) // x0.itemsize,), (x0.itemsize,))


def repeat_each(values, counts):
    """A 1-D array of each of the scalars `values` repeated `counts` times, in their dtype (one
    value: a read-only view of it, no memory per element)."""
    values = np.asarray(values)
    if len(values) == 1:
        return np.broadcast_to(values, (int(counts[0]),))
    return np.repeat(values, counts)


# --- one check of a step's arrays: everything the kernels rely on, complete -------------------


def snapshot(xs, gs):
    """What a later step's kernels rely on in the parameters `xs` and their gradients `gs` (`gs[i]`
    the gradient of `xs[i]`; any further ones, a tied parameter's others), for `unchanged`; None
    where they cannot be stepped in place as they are: an item that is not exactly an ndarray, a
    parameter that is not writable or shares a byte with another, a gradient whose strides are
    not aligned. Read by numba from the arrays' headers where it can, else from NumPy's
    attributes."""
    xs, gs = list(xs), list(gs)
    if numpy_kernels.reads_headers():
        return numpy_kernels.snapshot(xs, gs)
    return _Snapshot.of(xs, gs)


def unchanged(token, xs, gs) -> bool:
    """Can `xs` and `gs` of a later step be stepped exactly as those of `snapshot` (`token`)? The
    same parameter objects with the same data pointer, shape, strides, dtype and flags; gradients
    exactly ndarrays (new ones are fine) of the snapshot's dtype, shape and strides, aligned, with
    no byte a parameter's (address ranges: whatever owns the memory)."""
    return token is not None and token.still(xs, gs)


def _spans(arrays):
    """`(first, end)`: each array's first byte and one past its last, from NumPy's attributes."""
    bounds = [(0, 0) if a.size == 0 else _byte_bounds(a) for a in arrays]
    found = np.array(bounds, np.int64).reshape(len(arrays), 2)
    return found[:, 0], found[:, 1]


def _pointer(a) -> int:
    return a.__array_interface__["data"][0]


def _gradient(g):
    return (g.dtype, g.shape, g.strides) if type(g) is np.ndarray else None


class _Snapshot:
    """`snapshot`'s token from NumPy's public attributes (without numba)."""

    __slots__ = ("xs", "layouts", "grads", "reach", "alignment", "params")

    @classmethod
    def of(cls, xs, gs):
        if not all(type(a) is np.ndarray for a in (*xs, *gs)) or not all(x.flags.writeable for x in xs):
            return None
        if not all(n <= 1 or s % g.dtype.alignment == 0 for g in gs for n, s in zip(g.shape, g.strides)):
            return None  # (a gradient's strides not aligned, as NumPy's ALIGNED flag says)
        params = ByteRanges(*_spans(xs))
        if params.overlap_one_another():
            return None
        self = cls()
        self.xs, self.params = xs, params
        self.layouts = list(map(_param, xs))
        self.grads = list(map(_gradient, gs))
        first, end = _spans(gs)
        data = np.fromiter(map(_pointer, gs), np.int64, len(gs))
        self.reach = (first - data, end - data)
        self.alignment = np.array([g.dtype.alignment for g in gs], np.int64)
        return self

    def still(self, xs, gs) -> bool:
        n = len(self.xs)
        if len(xs) != n or len(gs) != len(self.grads) or not all(map(operator.is_, xs, self.xs)):
            return False
        if list(map(_param, xs)) != self.layouts or list(map(_gradient, gs)) != self.grads:
            return False
        data = np.fromiter(map(_pointer, gs), np.int64, len(gs))
        if (data % self.alignment).any():
            return False
        first, end = data + self.reach[0], data + self.reach[1]
        return not self.params.reached(first, end).any()


def _param(x):
    return _pointer(x), x.shape, x.strides, x.dtype, x.flags  # (flags compare by value)


try:  # NumPy >= 2
    from numpy.lib.array_utils import byte_bounds as _byte_bounds
except ImportError:  # pragma: no cover - NumPy 1.x
    _byte_bounds = np.byte_bounds
memory_span = _byte_bounds  # (start, stop) byte addresses of the memory an array may touch

_FLOAT16 = np.dtype(np.float16)


# --- what the tree layer asks -----------------------------------------------------------------


def is_param(x) -> bool:
    if not isinstance(x, np.ndarray):
        return False
    # ml_dtypes' bfloat16 and float8 types are kind "V", so ask their names too
    return x.dtype.kind in "fc" or x.dtype.name.startswith(("bfloat", "float"))


def is_array(x) -> bool:
    return isinstance(x, (np.ndarray, np.generic))


def writable(x) -> bool:
    return bool(x.flags.writeable)


def memory_owners(arrays) -> list:
    """What owns the memory of each array (the object at the end of its `.base` chain, by
    identity): arrays with different owners never overlap. Runs for every parameter and gradient
    of an in-place step, so the usual array, which owns its memory, costs one attribute read."""
    return [id(x) if x.base is None else _owner(x) for x in arrays]


def _owner(x):
    base = x.base
    while base is not None:
        x, base = base, getattr(base, "base", None)
    return id(x)


def shares_memory(x, y) -> bool:
    return bool(np.shares_memory(x, y))


def subtract_(x, step):
    np.subtract(x, step, out=x, casting="unsafe")
    return x


def assign_(x, value):
    np.copyto(x, value, casting="unsafe")
    return x


copy_into = assign_  # the engine's copy of one chunk into another


def adopt(value, like):
    """The engine's new array `value` as a parameter like `like` (for NumPy, as it is)."""
    return value


def replaced(x, value):
    """A new parameter like `x` holding `value`."""
    return np.array(value, dtype=x.dtype, copy=True)


def subtract(x, step):
    # same ufunc call as subtract_, so pure and in-place updates agree bit for bit (and 0-d
    # parameters stay arrays instead of decaying to NumPy scalars)
    return np.subtract(x, step, out=np.empty_like(x), casting="unsafe")


# --- what the update engine asks (see optimisers.engine.group) ---------------------------------------

ENGINE_CHUNK = 1 << 18  # 1 MiB of float32: big enough to amortise Python, small enough for cache
ENGINE_THREADS = True  # ufuncs release the GIL, so chunks run on all cores


# (docs/backends.md, "NumPy and malloc"; a lower mmap threshold would hurt: allocations above it
# are page-faulted on every use)
_allocator_tuned = False


def engine_start() -> None:
    """Once per process, before the first engine step: raise glibc's mmap and trim thresholds so
    that freed temporaries are reused. `OPTIMISERS_MALLOC=default` leaves malloc alone."""
    global _allocator_tuned
    if _allocator_tuned:
        return
    _allocator_tuned = True
    if os.environ.get("OPTIMISERS_MALLOC") == "default" or platform.libc_ver()[0] != "glibc":
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # pragma: no cover - a glibc without mallopt
        return
    mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
    mallopt(-1, 64 << 20)  # M_TRIM_THRESHOLD


def raises_on_values() -> bool:
    """Would NumPy raise on overflow or division by zero here (`np.seterr(all="raise")`)? Then
    even plain arithmetic can fail part way through a step."""
    return "raise" in np.geterr().values()


def kernel_ok(x) -> bool:
    """Can a compiled kernel read `x`'s memory (an ndarray, dense or not)?"""
    return type(x) is np.ndarray


def engine_ok(x) -> bool:
    return (
        type(x) is np.ndarray
        and x.flags.writeable
        and (x.flags.c_contiguous or dense(x.shape, x.strides, x.itemsize))  # Fortran order, transposed
        and x.ndim > 0
        and x.size > 0
    )


def dense(shape, strides, itemsize) -> bool:
    """Do the elements of an array of `shape` and `strides` (NumPy's in bytes; torch's count
    elements: `itemsize` 1) fill its memory without gaps or overlaps, at positive strides, in some
    order of its dimensions? Size-1 dimensions do not count."""
    expected = itemsize
    for size, stride in sorted(zip(shape, strides), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def memory_order(x):
    """None for a row-major `x`; else the order of its dimensions from the outermost in memory to
    the innermost, so that `x.transpose(order)` is row-major (for a dense `x`: `engine_ok`)."""
    if x.flags.c_contiguous:
        return None
    return tuple(sorted(range(x.ndim), key=lambda d: -x.strides[d]))


def flat_in(a, order):
    """`a`'s elements as one dimension, in the memory order `order` of a parameter: a view of an
    array laid out as that parameter (of the parameter itself), else a copy."""
    return a.reshape(-1) if order is None else a.transpose(order).reshape(-1)


def shaped_in(flat, shape, order):
    """A view of the 1-D `flat` with `shape`, its elements in memory order `order`."""
    if order is None:
        return flat.reshape(shape)
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return flat.reshape([shape[d] for d in order]).transpose(inverse)


def laid_out_like(a, x):
    """`a`, or a copy of it, with the strides of dense `x` (the engine reads both in memory order)."""
    if isinstance(a, np.ndarray) and a.strides == x.strides:
        return a
    return from_host(a, x)  # a new array laid out as `x`


def numel(x) -> int:
    return x.size


concat = np.concatenate


def empty_flat(n, like):
    """An uninitialised 1-D array of `n` elements of `like`'s dtype."""
    return np.empty(n, like.dtype)


def join_into(out, arrays, orders):
    """Every element of `arrays`, each in its memory order, joined into the 1-D `out`."""
    if orders.count(None) != len(orders):
        arrays = [a if o is None else flat_in(a, o) for a, o in zip(arrays, orders)]
    np.concatenate(arrays, axis=None, out=out)


def split_into(flat, arrays, orders):
    """Copy the consecutive pieces of the 1-D `flat` into `arrays`, each in its memory order."""
    copyto, lo = np.copyto, 0
    for a, o in zip(arrays, orders):
        hi = lo + a.size
        copyto(a if a.ndim == 1 else flat_in(a, o), flat[lo:hi])
        lo = hi


def sum_into(dst, arrays):
    """`dst` = the left-to-right sum of `arrays` (same dtype as `dst`)."""
    np.add(arrays[0], arrays[1], out=dst)
    for a in arrays[2:]:
        np.add(dst, a, out=dst)


def is_buffer(value) -> bool:
    return isinstance(value, np.ndarray) and value.ndim > 0


# Fewer elements than this step eagerly: tracing a step costs tens of microseconds, more than a
# compiled pass saves on a small model, and NumPy's eager numbers are the compiled ones anyway
COMPILE_FROM = 1 << 14


def elementwise_kernel(program, device, aliases=(), uniform=()):
    """`run(arrays, consts)`: a traced elementwise step (`backends.traced`) compiled for 1-D
    arrays (its inputs, then its outputs but those written into inputs, `aliases`; the inputs
    `uniform` one element long, shared by all), or None (`optimisers.engine.compiled`)."""
    loop = numba_lowering.kernel(program, aliases, uniform)
    if loop is None:
        return None
    own = [d for (_, d), k in zip(program.outputs, aliases or [-1] * len(program.outputs)) if k < 0]
    halves = [k for k, d in enumerate([*program.inputs, *own]) if d.itemsize == 2]
    if not halves:
        return lambda arrays, consts: loop(*arrays, consts)

    def run(arrays, consts):
        arrays = list(arrays)
        for k in halves:  # (the loop reads float16 and bfloat16 as their bits)
            arrays[k] = arrays[k].view(np.uint16)
        loop(*arrays, consts)

    return run


def quantised_kernel(program, device, ins, outs, block):
    """`run(arrays, consts)`: a traced step whose state is partly blockwise quantised
    (`numba_lowering.quantised_kernel`; a quantised input or output is two arrays, its codes
    and its scales), or None."""
    loop = numba_lowering.quantised_kernel(program, ins, outs, block)
    if loop is None:
        return None
    tables = numba_lowering.quantised_tables(ins, outs)
    return lambda arrays, consts: loop(*map(_as_bits, arrays), consts, *tables)


def _as_bits(a):
    """float16 and bfloat16 arrays as their bits (the loops convert them)."""
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a


# --- what the rules ask -----------------------------------------------------------------------


def scalar(value, like):
    return np.dtype(like.dtype).type(value)


def epsilon(value, like):
    real = np.dtype(like.dtype)
    if real.kind == "c":
        real = np.finfo(real).dtype
    if real == _FLOAT16 and value != 0:
        value = max(float(value), float(np.float16(1e-7)))
    return real.type(value)


zeros_like, full_like = np.zeros_like, np.full_like
sqrt = np.sqrt
abs = np.abs  # noqa: A001
sign = np.sign
maximum = np.maximum
minimum = np.minimum
clip = np.clip
where = np.where


def abs2(x):
    if np.iscomplexobj(x):
        return np.square(x.real) + np.square(x.imag)
    return np.square(x)


_NORM_CHUNK = 1 << 18  # elements: a norm's temporaries stay this small however large the array


def _magnitudes(x):
    """|x|, in float32 for narrower floats (float16/bfloat16 sums overflow: a norm over 256 of
    entries of 10)."""
    a = np.abs(x)
    return a.astype(np.float32) if a.dtype.itemsize < 4 else a


def _for_norm(a, p):
    """`_magnitudes(a)`, but a float32 or float64 array as it is for p = 2: its squares are
    |a|'s, and a pass over memory fewer."""
    return a if p == 2 and a.dtype.kind == "f" and a.dtype.itemsize >= 4 else _magnitudes(a)


def _row_norms_2(m):
    """The 2-norm of each row of the float32 matrix `m`, where numba is installed (else None):
    summed in float64 at memory speed (`numpy_norm_numba`), one loop for a row alone or many."""
    if not numpy_kernels.AVAILABLE:
        return None
    from optimisers.backends.numpy_norm_numba import row_squares

    out = np.empty(m.shape[0], np.float64)
    row_squares(np.ascontiguousarray(m), out)
    return np.sqrt(out).astype(np.float32)


def norm(x, p):
    """The p-norm of all entries, over chunks of `_NORM_CHUNK` elements so that its temporaries
    stay small: one reduction over the chunks' partial results (one chunk: NumPy's own bits).
    A float32 2-norm is summed in float64 where numba is installed (`_row_norms_2`)."""
    flat = np.ravel(x)  # a view for a contiguous array
    if p == 2 and flat.dtype == np.float32 and flat.size:
        found = _row_norms_2(flat.reshape(1, -1))
        if found is not None:
            return found[0]
    if flat.size == 0:
        a = _magnitudes(flat)
        return a.dtype.type(0) if p != -np.inf else a.dtype.type(np.inf)
    parts = []
    for lo in range(0, flat.size, _NORM_CHUNK):
        a = _for_norm(flat[lo : lo + _NORM_CHUNK], p)
        dtype = a.dtype.type
        if p == 2:
            parts.append(np.sum(np.square(a)))
        elif p in (1, 0):
            parts.append(np.sum(a) if p == 1 else np.count_nonzero(a))
        elif p == np.inf:
            parts.append(np.max(a))
        elif p == -np.inf:
            parts.append(np.min(a))
        else:
            with np.errstate(divide="ignore"):  # negative p on a zero entry is a legitimate infinity
                parts.append(np.sum(a ** dtype(p)))
    if p == 0:
        return dtype(builtins.sum(parts))
    parts = np.array(parts)
    if p == 2:
        return np.sqrt(np.sum(parts))
    if p == 1:
        return np.sum(parts)
    if p == np.inf:
        return np.max(parts)
    if p == -np.inf:
        return np.min(parts)
    return np.sum(parts) ** dtype(1 / p)


# p -> the reduction of `norm` along each row of |x| (a row is summed as `norm` sums one array:
# the same inner loop over the same contiguous elements, so the same bits)
_ROW_NORMS = {
    2: lambda a: np.sqrt(np.sum(np.square(a), axis=1)),
    1: lambda a: np.sum(a, axis=1),
    np.inf: lambda a: np.max(a, axis=1),
    -np.inf: lambda a: np.min(a, axis=1),
}
_SIZE_AND_DTYPE = operator.attrgetter("size", "dtype")


def _rows(m, p):
    """`norm` of each row of matrix `m` (of at most one of `norm`'s chunks): the same bits."""
    found = _row_norms_2(m) if p == 2 and m.dtype == np.float32 else None
    return _ROW_NORMS[p](_for_norm(m, p)) if found is None else found


def _joined_rows(arrays, size, p):
    """`_rows` of `arrays` of `size` elements each, joined a matrix of at most `_NORM_CHUNK`
    elements at a time (so the copy stays small)."""
    per = max(1, _NORM_CHUNK // size)
    found = [_rows(np.concatenate(arrays[k : k + per], axis=None).reshape(-1, size), p)
             for k in range(0, len(arrays), per)]
    return found[0] if len(found) == 1 else np.concatenate(found)


def norms(xs, p):
    """Each array's `norm`, as a 1-D array. Arrays of one size and dtype (and of at most one of
    `norm`'s chunks) are joined as the rows of one matrix and reduced row by row: one NumPy
    call per size instead of a dozen per array (4000 arrays of 256: 7 ms instead of 40)."""
    rows = _ROW_NORMS.get(p)
    if type(xs) is np.ndarray:  # the rows of a matrix
        return _rows(xs, p) if rows is not None and 0 < xs.shape[1] <= _NORM_CHUNK else norms(list(xs), p)
    if rows is None or set(map(type, xs)) != {np.ndarray}:
        return np.array([norm(x, p) for x in xs])
    by_kind: dict = {}
    for i, kind in enumerate(map(_SIZE_AND_DTYPE, xs)):
        by_kind.setdefault(kind, []).append(i)
    out = [None] * len(xs)
    for (size, _), idx in by_kind.items():
        if not 0 < size <= _NORM_CHUNK:
            continue
        found = _joined_rows([xs[i] for i in idx], size, p)
        if len(idx) == len(xs):  # one kind, the usual case: the rows are in order
            return found
        for i, n in zip(idx, found):
            out[i] = n
    return np.array([norm(x, p) if n is None else n for x, n in zip(xs, out)])


def isfinite(x):
    return bool(np.all(np.isfinite(x)))


def same_values(x, y):
    return bool(np.array_equal(x, np.asarray(y), equal_nan=True))


def all_finite(x):
    return np.all(np.isfinite(x))


def astype(x, like):
    dtype = getattr(x, "dtype", None)
    if dtype is not like.dtype:
        if dtype is None or not isinstance(dtype, np.dtype):
            x = np.asarray(x)
        ops.check_gradient_dtype(x.dtype, like.dtype)
    return np.asarray(x, dtype=like.dtype)


def cast(x, dtype):
    return np.array(x, dtype=dtype, copy=True)


def copy(x):
    return np.array(x, copy=True)


to_host = copy  # the host's arrays are NumPy's


# --- what destructure asks --------------------------------------------------------------------


def flatten(arrays):
    dtype = np.result_type(*arrays)
    return np.concatenate([np.ravel(a).astype(dtype, copy=False) for a in arrays])


def unflatten_one(flat, start, like):
    size = like.size
    return flat[start : start + size].reshape(like.shape).astype(like.dtype, copy=True)


def node_kind(obj):
    """NumPy has no containers of its own."""
    return None


# --- what schedules ask -----------------------------------------------------------------------


def is_integer(x):
    return bool(np.issubdtype(np.asarray(x).dtype, np.integer))


as_integer, as_real = np.int64, np.float64


def real_scalar(value, like):
    return np.float64(value)


def real_where(condition, x, y):
    return np.float64(np.where(condition, x, y))


cos = np.cos


# --- what checkpoints ask: the host's arrays are NumPy's ---------------------------------------


def dtype_name(x):
    if isinstance(x, np.dtype):
        return x.name
    if isinstance(x, type) and issubclass(x, np.generic):  # np.float32, ml_dtypes.bfloat16
        return np.dtype(x).name
    return None


def to_host_bits(x):
    host = np.array(x, copy=True, order="C")
    if host.dtype.kind == "V" or host.dtype.type.__module__ != "numpy":  # ml_dtypes' bfloat16...
        return host.view(f"u{host.dtype.itemsize}"), host.dtype.name
    return host, None


def from_host(value, like):
    if isinstance(like, np.generic):
        return like.dtype.type(np.asarray(value)[()])
    out = np.empty_like(like)
    np.copyto(out, value, casting="unsafe")
    return out


# --- maths of shaped arrays (matrix rules) -----------------------------------------------------

# the library's own functions, where they take what `ops` passes
reshape, matmul, tensordot, take, stack = np.reshape, np.matmul, np.tensordot, np.take, np.stack
eigh, qr = np.linalg.eigh, np.linalg.qr


def matrix_transpose(x):
    return np.swapaxes(x, -1, -2)


def sum(x, axis=None, keepdims=False):  # noqa: A001 - mirrors the array-API name
    return np.sum(x, axis=axis, keepdims=keepdims)


def mean(x, axis=None, keepdims=False):
    return np.mean(x, axis=axis, keepdims=keepdims)


def zeros(shape, like):
    return np.zeros(shape, like.dtype)


def argsort(x, descending):
    order = np.argsort(x, axis=-1, kind="stable")
    return order[..., ::-1] if descending else order


def dtype_epsilon(x):
    return float(np.finfo(x.dtype).eps)
