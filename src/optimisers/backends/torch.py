"""PyTorch tensors and `torch.nn.Module`s (imported when a model first holds a torch object).

Hyperparameters are Python floats (complex for complex tensors): torch keeps the tensor's dtype
for a Python scalar, where a 0-d tensor of another dtype could promote it. In-place writes run
under `torch.no_grad()`; pure results are new leaves with the parameter's `requires_grad`.
"""

from __future__ import annotations

import builtins
import copy as _copy
import functools
import operator
import sys
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from optimisers import ops
from optimisers.backends import numpy as _numpy
from optimisers.backends import scalar as _scalar
from optimisers.backends.objects import SameObjects
from optimisers.backends.protocol import FastPath
from optimisers.backends.ranges import ByteRanges
from optimisers.backends.torch_quant import (  # noqa: F401
    bfloat16_rounded,
    dequantise_blocks,
    quantise_blocks,
)
from optimisers.core import eager
from optimisers.core.rule import NewValue
from optimisers.core.state import flatten_state
from optimisers.core.tree import NodeKind, format_path

eager.install(torch.compiler.is_compiling, torch.compiler.disable)

# float16's smallest useful epsilon (Optimisers.jl's floor): Float16(1e-7) == 2**-23
_FLOAT16_EPS = float(np.float16(1e-7))


# --- what the tree layer asks -----------------------------------------------------------------


def is_param(x) -> bool:
    # exact types first: isinstance(tensor, nn.Parameter) goes through a Python __instancecheck__,
    # and this runs for every parameter of every update
    t = type(x)
    if t is nn.Parameter:
        trainable = x.requires_grad  # a frozen nn.Parameter is carried, not trained
    elif t is torch.Tensor:
        trainable = True  # plain tensors in a tree are always trainable
    elif isinstance(x, torch.Tensor):
        trainable = x.requires_grad if isinstance(x, nn.Parameter) else True
    else:
        return False
    return trainable and x.layout is torch.strided and (x.is_floating_point() or x.is_complex())


def is_array(x) -> bool:
    return isinstance(x, torch.Tensor)


def writable(x) -> bool:
    # inference tensors refuse in-place writes outside inference mode
    return not x.is_inference()


def is_dtensor(x) -> bool:
    """A `torch.distributed.tensor.DTensor` (what FSDP2's `fully_shard` makes parameters)."""
    # a DTensor exists only once torch.distributed.tensor was imported: never import it here
    cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return cls is not None and isinstance(x, cls)


def _local(x):
    """The memory `x` owns on this process: a DTensor's local shard (a DTensor has no storage
    of its own), any other tensor itself."""
    if is_dtensor(x):
        with torch.no_grad():
            return x.to_local()
    return x


def _extent(x) -> int:
    """The bytes `x`'s elements span from its first (0 for an empty one): torch strides are never
    negative, so the last element is at sum((size - 1) * stride)."""
    if not x.numel():
        return 0
    return (builtins.sum((n - 1) * s for n, s in zip(x.shape, x.stride())) + 1) * x.element_size()


def memory_span(x):
    """(start, stop) byte addresses of the elements `x` may touch (a DTensor: its local shard)."""
    x = _local(x)
    if x.numel() == 0 or x.is_meta:  # meta tensors (shape-only models) have no memory at all
        return 0, 0
    return x.data_ptr(), x.data_ptr() + _extent(x)


def _storage_ptr(x) -> int:
    return x.untyped_storage().data_ptr()


def memory_owners(tensors) -> list:
    """What owns the memory of each tensor (its storage); two storages may be made over one
    memory (`from_blob`), so the checks that must hold whatever the storage compare byte ranges."""
    return [_storage_ptr(x if type(x) in _PLAIN_TYPES else _local(x)) for x in tensors]


def shares_memory(x, y) -> bool:
    """Same storage and overlapping element ranges (conservative for interleaved strided views);
    for DTensors, of their local shards."""
    x, y = _local(x), _local(y)
    if x.device != y.device or _storage_ptr(x) != _storage_ptr(y):
        return False
    (a0, a1), (b0, b1) = memory_span(x), memory_span(y)
    return a0 < b1 and b0 < a1


# `optimisers.engine.execute` runs every rule's `apply` inside this: the maths of a step is data, and
# optimiser state must never hold an autograd graph (it would grow with every step)
no_grad = torch.no_grad
SHARE_SCALAR_STATE = False
IN_PLACE_ENGINE = True
cond, is_traced = _scalar.cond, _scalar.is_traced  # as for Python numbers (not as JAX)


def engine_start() -> None:
    """Nothing to prepare: torch's caching allocator reuses freed temporaries."""


def raises_on_values() -> bool:
    """torch's maths never raises on infinities or NaN."""
    return False


def subtract_(x, step):
    with torch.no_grad():
        x.sub_(step)
    return x


def assign_(x, value):
    with torch.no_grad():
        x.copy_(value)
    return x


copy_into = assign_  # the engine's copy of one chunk into another


def _fresh_like(value, like):
    """`value` (a new tensor made under no_grad) as a leaf standing in for parameter `like`."""
    if isinstance(like, nn.Parameter):
        return nn.Parameter(value, requires_grad=like.requires_grad)
    if like.requires_grad:
        value.requires_grad_(True)
    return value


adopt = _fresh_like  # the engine's new array made a parameter like `like`


def replaced(x, value):
    """A new parameter like `x` (an nn.Parameter for one, same requires_grad) holding `value`."""
    with torch.no_grad():
        out = value.to(dtype=x.dtype, device=x.device, copy=True)
    return _fresh_like(out, x)


def subtract(x, step):
    with torch.no_grad():
        out = x - step
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
    return _fresh_like(out, x)


# --- what the update engine asks (see optimisers.engine.group) ---------------------------------------

ENGINE_CHUNK = 1 << 17  # torch parallelises each op itself; chunks bound temporaries (512 KiB each)
ENGINE_THREADS = False


def engine_ok(x) -> bool:
    # a DTensor takes the per-Leaf path: the engine's flat buffers would reshape it (a
    # redistribution), whereas the rule's maths on the DTensor itself runs shard-locally for
    # elementwise operations and gives global results for norms
    return (
        isinstance(x, torch.Tensor)
        and x.layout is torch.strided
        and (x.is_contiguous() or _numpy.dense(x.shape, x.stride(), 1))  # channels_last, transposed
        and x.dim() > 0
        and x.numel() > 0
        and not x.is_inference()
        and not is_dtensor(x)
    )


_PLAIN_TYPES = {torch.Tensor, nn.Parameter}  # (not a DTensor, not a subclass)


def kernel_ok(x) -> bool:
    """Can a compiled kernel read `x`'s memory (a plain strided tensor, dense or not)?"""
    return type(x) in _PLAIN_TYPES and x.layout is torch.strided
_DATA_PTR = torch.Tensor.data_ptr


def addresses(xs) -> list:
    return list(map(_DATA_PTR, xs))


def flat_span(xs):
    """A 1-D view of the memory that the tensors `xs` fill back to back in this order (each
    contiguous, all of one storage, dtype and device), or None. Addresses alone are not enough:
    two storages may lie next to each other."""
    x0 = xs[0]
    if not set(map(type, xs)) <= _PLAIN_TYPES:
        return None
    storage, item, dtype, device = _storage_ptr(x0), x0.element_size(), x0.dtype, x0.device
    at = start = x0.data_ptr()
    for x in xs:
        if x.data_ptr() != at or not x.is_contiguous() or _storage_ptr(x) != storage:
            return None
        if x.dtype != dtype or x.device != device:
            return None
        at += x.numel() * item
    with torch.no_grad():
        return x0.detach().as_strided(((at - start) // item,), (1,))


def repeat_each(values, counts):
    """A 1-D tensor of each of `values` (0-d tensors, or one 1-D tensor) repeated `counts` times
    (one value: a read-only view of it)."""
    with torch.no_grad():
        if not isinstance(values, torch.Tensor):
            values = torch.stack(values)
        if len(values) == 1:  # a view of the one value, no memory per element
            return values.expand(int(counts[0]))
        return torch.repeat_interleave(values, torch.tensor(counts, device=values.device))


class _Snapshot(NamedTuple):
    same: SameObjects  # the parameters, by identity
    guard: Callable  # type, dtype, device, layout, shape, strides, requires_grad of every tensor
    where: list  # each parameter's data pointer
    spans: ByteRanges  # the parameters' bytes
    reach: np.ndarray  # the bytes each gradient spans
    grads_at: list  # [the gradients' data pointers, as the last check read them]


def snapshot(xs, gs):
    """What a later step's kernels rely on for the parameters `xs` and gradients `gs` (as the
    engine found them fit: see `unchanged`), or None where it cannot be checked in bulk (a
    DTensor, a subclass, a gradient that requires grad, one that overlaps a parameter)."""
    if not set(map(type, xs)) | set(map(type, gs)) <= _PLAIN_TYPES:
        return None
    if not all(map(engine_ok, xs)) or any(g.requires_grad for g in gs):
        return None
    where = addresses(xs)
    spans = ByteRanges(where, np.add(where, list(map(_extent, xs))))
    token = _Snapshot(SameObjects(xs), (_tensor_guard() or _attribute_guard)([*xs, *gs]), where, spans,
                      np.fromiter(map(_extent, gs), np.int64, len(gs)), [None])
    return token if _apart(token, gs) else None


def _apart(token, gs) -> bool:
    """Does no gradient reach into a parameter's bytes? (The pointers read are kept for the
    step's span: `gradients_at`.)"""
    token.grads_at[0] = starts = np.fromiter(map(_DATA_PTR, gs), np.int64, len(gs))
    return not token.spans.reached(starts, starts + token.reach).any()


def unchanged(token, xs, gs) -> bool:
    """Can `xs` and `gs` (lists) be stepped as the ones of `snapshot` were? (docs/architecture.md:
    "What each kernel relies on": a `.data` swap, `t_()`, `.to()`, `requires_grad_(False)` or an
    inference tensor all differ.)"""
    if not (token.same(xs) and token.guard([*xs, *gs]) and addresses(xs) == token.where):
        return False
    return _apart(token, gs)


def gradients_at(token):
    """The gradients' data pointers that the last `unchanged` of `token` read."""
    return token.grads_at[0]


def fit_as_they_are(gs, xs, dtype, device) -> list:
    """For each gradient, whether `astype` and `laid_out_like` would hand it back unchanged."""
    return [
        type(g) in _PLAIN_TYPES
        and g.layout is _STRIDED
        and not g.requires_grad
        and g.dtype == dtype
        and g.device == device
        and g.stride() == x.stride()
        for g, x in zip(gs, xs)
    ]


def _attributes(ts) -> list:
    return [(type(t), t.dtype, t.device, t.layout, t.shape, t.stride(), t.requires_grad, t.is_inference())
            for t in ts]


def _attribute_guard(ts):
    expected = _attributes(ts)
    return lambda ys: _attributes(ys) == expected


@functools.cache
def _tensor_guard():
    """`tensors -> check`: torch's `TensorGuards` (one C++ call, about 50 ns a tensor), where it
    tells apart, on samples, every difference `unchanged` relies on; else None."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        def guard(ts):
            check = TensorGuards(*ts, dynamic_dims_sizes=[list(t.shape) for t in ts],
                                 dynamic_dims_strides=[list(t.stride()) for t in ts]).check
            n = len(ts)
            return lambda ys: len(ys) == n and check(*ys)

        a, b = torch.zeros(2, 3), torch.zeros(3, 2).t()
        like = guard([a, b])
        with torch.inference_mode():
            inference = torch.zeros(2, 3)
        others = [torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2, 3).requires_grad_(),
                  torch.zeros(3, 2).t(), torch.zeros(2, 4), nn.Parameter(torch.zeros(2, 3)),
                  torch.zeros(2, 3).to_sparse(), torch.zeros(2, 3, device="meta"), inference]
        if like([torch.ones(2, 3), torch.ones(3, 2).t()]) and not any(like([o, b]) for o in others):
            return guard
    except Exception:  # noqa: BLE001 - another torch: no bulk check, every step checks each tensor
        pass
    return None


def numel(x) -> int:
    return x.numel()


def memory_order(x):
    """None for a row-major `x`; else the order of its dimensions from the outermost in memory to
    the innermost, so that `x.permute(order)` is row-major (for a dense `x`: `engine_ok`)."""
    if x.is_contiguous():
        return None
    return tuple(sorted(range(x.dim()), key=lambda d: -x.stride(d)))


def flat_in(t, order):
    """`t`'s elements as one dimension, in the memory order `order` of a parameter: a view of a
    tensor laid out as that parameter (of the parameter itself), else a copy."""
    return t.reshape(-1) if order is None else t.permute(order).reshape(-1)


def shaped_in(flat, shape, order):
    """A view of the 1-D `flat` with `shape`, its elements in memory order `order`."""
    if order is None:
        return flat.reshape(shape)
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return flat.view([shape[d] for d in order]).permute(inverse)


def laid_out_like(t, x):
    """`t`, or a copy of it, with the strides of dense `x`: the fused kernels and the engine's
    chunks walk a step's tensors in memory order (docs/backends.md, "Memory layouts")."""
    if t.stride() == x.stride():
        return t
    with torch.no_grad():
        return torch.empty_like(x).copy_(t)


_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _fused_kernel(args, x):
    """torch's fused Adam or AdamW kernel for `x` (float16 and bfloat16: computed in float32, as
    every update does), or None where it has none."""
    if x.dtype not in _FUSED_DTYPES or x.device.type not in ("cpu", "cuda"):
        return None
    return torch._fused_adamw_ if args.decoupled else torch._fused_adam_


def _run_fused(kernel, args, xs, dxs, ms, vs, t):
    """One fused step on lists of tensors, in place; `t` counts steps including this one. On
    the CPU, small tensors step on one thread (`_SMALL`)."""

    def run(xs, dxs, ms, vs):
        steps = [torch.tensor(float(t), dtype=torch.float32, device=xs[0].device)] * len(xs)
        kernel(xs, dxs, ms, vs, [], steps, lr=args.lr, beta1=args.beta1, beta2=args.beta2,
               weight_decay=args.weight_decay, eps=args.epsilon,
               amsgrad=False, maximize=False, grad_scale=None, found_inf=None)

    if xs[0].device.type != "cpu" or torch.get_num_threads() == 1:
        return run(xs, dxs, ms, vs)
    sizes = list(map(torch.Tensor.numel, xs))
    if min(sizes) >= _SMALL:
        return run(xs, dxs, ms, vs)
    small = range(len(xs)) if max(sizes) < _SMALL else [i for i, n in enumerate(sizes) if n < _SMALL]
    if len(small) < len(xs):
        big = [i for i, n in enumerate(sizes) if n >= _SMALL]
        run(*([a[i] for i in big] for a in (xs, dxs, ms, vs)))
        xs, dxs, ms, vs = ([a[i] for i in small] for a in (xs, dxs, ms, vs))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(xs, dxs, ms, vs)
    finally:
        torch.set_num_threads(threads)


# torch's CPU kernel enters its thread pool for every tensor, however small, which costs more
# than the arithmetic of a small one (4000 tensors of 256 on 2 threads: 12 ms, on one: 2.4 ms).
# Its threads split a tensor at fixed places, so the numbers do not depend on their count.
_SMALL = 1 << 15  # elements (torch's grain size)


def _adam_apply(args, state, x, dx):
    """An Adam step `(m, v, t)` -> `(new state, NewValue)` through torch's fused kernel on
    copies, or None where it has none. Both the pure and the in-place update use the kernel, so
    they agree bit for bit."""
    sharded = is_dtensor(x)
    if sharded:
        _check_sharded_state(state, x)
    found = _fused_kernel(args, x)
    if found is None or getattr(dx, "is_sparse", False):
        return None
    m, v, t = state
    if not all(s.dtype == x.dtype and s.device == x.device for s in (m, v)):
        return None  # a parameter converted after setup (module.double()): the generic maths promotes
    if m.shape != x.shape or v.shape != x.shape or dx.shape != x.shape:
        return None  # the kernel would write past the state's end; the update reports the misfit
    if sharded and not _same_sharding(x, dx, m, v):
        return None  # the generic maths redistributes, or reports the mix of Tensor and DTensor
    with torch.no_grad():
        x, m, v = x.detach().clone(), m.clone(), v.clone()
        # elementwise: the kernel steps each process's shards of a DTensor
        x_, dx_, m_, v_ = (a.to_local() for a in (x, dx, m, v)) if sharded else (x, dx, m, v)
        if not _numpy.dense(x_.shape, x_.stride(), 1):
            return None  # (a clone is dense; a DTensor's local shard might not be)
        m_kernel, v_kernel = laid_out_like(m_, x_), laid_out_like(v_, x_)
        _run_fused(found, args, [x_], [laid_out_like(dx_, x_)], [m_kernel], [v_kernel], t + 1)
        for mine, used in ((m_, m_kernel), (v_, v_kernel)):
            if used is not mine:
                mine.copy_(used)
    return (m, v, t + 1), NewValue(x)


def _check_sharded_state(state, x):
    """Refuse a DTensor parameter with state of plain tensors (`setup` ran before `fully_shard`):
    DTensor maths would fail on the mix, less clearly."""
    parts: list = []
    flatten_state(state, parts)
    if any(isinstance(p, torch.Tensor) and p.dim() > 0 and not is_dtensor(p) for p in parts):
        raise ValueError(
            f"a parameter of shape {tuple(x.shape)} is a DTensor (sharded, e.g. by FSDP2's "
            "fully_shard), but its optimiser state holds plain tensors: the state was set up "
            "before the model was sharded. Call optimisers.setup after fully_shard."
        )


def _same_sharding(x, *others) -> bool:
    """Are `others` DTensors laid out exactly as DTensor `x` (mesh, placements, local shape)?"""
    return all(
        is_dtensor(o)
        and o.device_mesh == x.device_mesh
        and o.placements == x.placements
        and o.to_local().shape == x.to_local().shape
        for o in others
    )


def _adam_step_many(args, xs, dxs, ms, vs, t) -> bool:
    """Adam steps of many parameters in place with one fused call (`t` counts this step);
    False where the kernel cannot take them. `dxs` are laid out as their parameters."""
    found = _fused_kernel(args, xs[0])
    if found is None:
        return False
    with torch.no_grad():
        _run_fused(found, args, xs, dxs, ms, vs, t)
    return True


FAST_PATHS = {"adam": FastPath(_adam_apply, _adam_step_many)}


def concat(tensors):
    with torch.no_grad():
        return torch.cat(tensors)


def empty_flat(n, like):
    """An uninitialised 1-D tensor of `n` elements of `like`'s dtype, on its device."""
    return torch.empty(n, dtype=like.dtype, device=like.device)


def join_into(out, tensors, orders):
    """Every element of `tensors`, each in its memory order, joined into the 1-D `out` (one call)."""
    with torch.no_grad():
        torch.cat([t if t.dim() == 1 else flat_in(t, o) for t, o in zip(tensors, orders)], out=out)


def split_into(flat, tensors, orders):
    """Copy the consecutive pieces of the 1-D `flat` into `tensors`, each in its memory order."""
    with torch.no_grad():
        outs = [t if t.dim() == 1 else flat_in(t, o) for t, o in zip(tensors, orders)]
        torch.split_with_sizes_copy(flat, [t.numel() for t in outs], out=outs)


def sum_into(dst, tensors):
    """`dst` = the left-to-right sum of `tensors` (same dtype and device as `dst`)."""
    with torch.no_grad():
        torch.add(tensors[0], tensors[1], out=dst)
        for t in tensors[2:]:
            dst.add_(t)


def is_buffer(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


# --- what the rules ask -----------------------------------------------------------------------


def _real_dtype(dtype):
    return dtype.to_real() if dtype.is_complex else dtype


CPU_KERNELS = "numba"  # or "inductor": torch.compile's, as on other devices (tests choose)
# every size compiled: torch's eager square root is not IEEE's, and `update`, `update_` and the
# engine must compute one program to agree bit for bit
COMPILE_FROM = 1  # (an empty tensor has nothing to step)


def elementwise_kernel(program, device, aliases=(), uniform=()):
    """`run(tensors, consts)`: a traced elementwise step (`backends.traced`) compiled for 1-D
    tensors (its inputs, then its outputs but those written into inputs, `aliases`), or None
    (`optimisers.engine.compiled`). On the CPU, numba's loop over the tensors' memory (NumPy
    views of it; float16 and bfloat16 as their bits); on other devices torch.compile's kernel
    (`torch_lowering`)."""
    if device is None:
        return None
    if device.type != "cpu" or CPU_KERNELS == "inductor":
        from optimisers.backends import torch_lowering

        return torch_lowering.kernel(program, device, aliases)
    loop = _numpy.numba_lowering.kernel(program, aliases, uniform)
    if loop is None:
        return None
    own = [d for (_, d), k in zip(program.outputs, aliases or [-1] * len(program.outputs)) if k < 0]
    halves = {k for k, d in enumerate([*program.inputs, *own]) if d.itemsize == 2}

    def run(tensors, consts):
        loop(*[(t.detach().view(torch.int16) if k in halves else t.detach()).numpy()
               for k, t in enumerate(tensors)], consts)

    return run


def quantised_kernel(program, device, ins, outs, block):
    """`run(tensors, consts)`: a traced step whose state is partly blockwise quantised, on the
    CPU (numba's loop, `backends.numpy.quantised_kernel`, over NumPy views of the tensors'
    memory), or None."""
    if device is None or device.type != "cpu":
        return None
    run = _numpy.quantised_kernel(program, None, ins, outs, block)
    # (float16 and bfloat16 as their bits: NumPy has no bfloat16)
    halves = lambda t: t.detach().view(torch.int16) if t.element_size() == 2 else t.detach()  # noqa: E731
    return None if run is None else lambda tensors, consts: run([halves(t).numpy() for t in tensors], consts)


def scalar(value, like):
    if isinstance(value, torch.Tensor):
        return value.to(dtype=like.dtype, device=like.device)
    return complex(value) if like.is_complex() else float(value)


def epsilon(value, like):
    real = _real_dtype(like.dtype)
    if isinstance(value, torch.Tensor):
        value = value.to(dtype=real, device=like.device)
        if real == torch.float16:
            value = torch.where(value == 0, value, torch.clamp(value, min=_FLOAT16_EPS))
        return value
    value = float(value)
    # 1e-8 rounds to zero in float16; bfloat16 has float32's exponent range and keeps 1e-8
    if real == torch.float16 and value != 0:
        value = max(value, _FLOAT16_EPS)
    return value


def zeros_like(x):
    return torch.zeros_like(x, requires_grad=False)


def full_like(x, value):
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(x, requires_grad=False).copy_(value)
    return torch.full_like(x, value, requires_grad=False)


sqrt = torch.sqrt
abs = torch.abs  # noqa: A001


def sign(x):
    return torch.sgn(x) if x.is_complex() else torch.sign(x)


def maximum(x, y):
    return torch.maximum(x, y) if isinstance(y, torch.Tensor) else torch.clamp(x, min=y)


def minimum(x, y):
    return torch.minimum(x, y) if isinstance(y, torch.Tensor) else torch.clamp(x, max=y)


def clip(x, low, high):
    if isinstance(low, torch.Tensor) != isinstance(high, torch.Tensor):
        return torch.clamp(torch.clamp(x, min=low), max=high)
    return torch.clamp(x, low, high)


def where(condition, x, y):
    if not isinstance(condition, torch.Tensor):
        return x if condition else y
    return torch.where(condition, x, y)


def abs2(x):
    if x.is_complex():
        return torch.square(x.real) + torch.square(x.imag)
    return torch.square(x)


_NORM_CHUNK = 1 << 18  # elements: the partial norms that keep a large float32 norm accurate


def norm(x, p):
    if x.numel() == 0:
        fill = float("inf") if p == -float("inf") else 0.0
        return torch.full((), fill, dtype=_real_dtype(x.dtype), device=x.device)
    if p == 2 and _summed_as_numpy(x):
        return _row_norms_2(x.detach().reshape(1, -1))[0]  # (row-major: a strided view's copy)
    if x.numel() > _NORM_CHUNK and type(x) in _PLAIN_TYPES and p not in (0, float("inf"), -float("inf")):
        # One vector_norm over millions of float32 elements accumulates in a few long running
        # sums (relative error 1e-4 on 4M elements, NumPy's pairwise sum 1e-6): the p-norm of
        # the chunks' p-norms is the same norm, each partial sum short. Chunks of a 1-D view in
        # memory order (no copy for a dense strided tensor: channels_last, a transpose).
        flat = flat_in(x, memory_order(x)) if engine_ok(x) else x.reshape(-1)
        parts = [torch.linalg.vector_norm(c, ord=p) for c in flat.split(_NORM_CHUNK)]
        return torch.linalg.vector_norm(torch.stack(parts), ord=p)
    if type(x) in _PLAIN_TYPES and not engine_ok(x):
        # a view with gaps (`W[:, ::2]`) is summed in another order than its contiguous copy,
        # which is what `update` makes of it: the copy's bits, so that both verbs agree
        x = x.contiguous()
    return torch.linalg.vector_norm(x, ord=p)


def norms(xs, p):
    """Each tensor's `norm`, as a 1-D tensor: on the CPU one `torch._foreach_norm` call (the very
    kernel `norm` calls, so the same bits) for contiguous tensors `norm` takes whole (it sums a
    strided one in another order than `norm`); elsewhere (CUDA's foreach kernel sums in another
    order) a `norm` per tensor. `xs` may be a matrix, whose rows are the tensors."""
    if isinstance(xs, torch.Tensor):
        if p == 2 and _summed_as_numpy(xs) and xs.shape[1]:
            return _row_norms_2(xs.detach())
        if _row_by_row(xs, xs.shape[1]):
            return torch.linalg.vector_norm(xs, ord=p, dim=1)
        xs = list(xs)
    if p == 2 and all(map(_summed_as_numpy, xs)):
        shape = xs[0].shape
        if len(xs) > 1 and all(x.shape == shape for x in xs) and xs[0].numel():
            return _stacked_rows([x.detach() for x in xs], _row_norms_2)  # (row-major)
        return torch.stack([norm(x, p) for x in xs])
    if (
        p in _FOREACH_NORM_P
        and set(map(type, xs)) <= _PLAIN_TYPES
        and {(x.device.type, x.dtype) for x in xs} in ({("cpu", torch.float32)}, {("cpu", torch.float64)})
        and all(0 < n <= _NORM_CHUNK for n in map(torch.Tensor.numel, xs))
        and all(map(torch.Tensor.is_contiguous, xs))
    ):
        shape, size = xs[0].shape, xs[0].numel()
        if len(xs) > 1 and size < _ROWS_BELOW and all(x.shape == shape for x in xs):
            # one shape (thousands of small tensors): the rows of one matrix, 20x foreach's speed
            return _stacked_rows(xs, lambda m: torch.linalg.vector_norm(m, ord=p, dim=1))
        return torch.stack(torch._foreach_norm(xs, p))
    return torch.stack([norm(x, p) for x in xs])


def _stacked_rows(xs, reduce):
    """`reduce` of the rows of tensors `xs` of one shape stacked, at most `_NORM_CHUNK` elements
    at a time (so the copy stays small)."""
    size = xs[0].numel()
    per = max(1, _NORM_CHUNK // size)
    found = [reduce(torch.stack(xs[k : k + per]).view(-1, size)) for k in range(0, len(xs), per)]
    return found[0] if len(found) == 1 else torch.cat(found)


def _summed_as_numpy(x) -> bool:
    """Is `x` a CPU float32 tensor, whose 2-norm NumPy's numba loop sums (where installed)?"""
    return (_numpy.numpy_kernels.AVAILABLE and type(x) in _PLAIN_TYPES and x.dtype == torch.float32
            and x.device.type == "cpu")


def _row_norms_2(m):
    """The 2-norm of each row of the CPU float32 matrix `m` as NumPy's backend sums it (in
    float64: at memory speed without torch's threads, and as accurate as float32 allows)."""
    return torch.from_numpy(_numpy._row_norms_2(m.resolve_neg().numpy()))


# elements: a tensor below torch's grain of parallel work (`at::internal::GRAIN_SIZE`) is reduced
# on one thread by the inner loop that reduces a row of a matrix: the same bits
_ROWS_BELOW = 32768


def _row_by_row(m, size) -> bool:
    """Can `m`'s rows (of `size` elements) be reduced together, each as `norm` reduces it?"""
    return (type(m) in _PLAIN_TYPES and m.device.type == "cpu" and m.dtype in (torch.float32, torch.float64)
            and m.is_contiguous() and 0 < size < _ROWS_BELOW)


_FOREACH_NORM_P = (2.0, 1.0, float("inf"))


def isfinite(x):
    if isinstance(x, torch.Tensor):
        return bool(torch.isfinite(x).all())
    return bool(np.isfinite(x))


def same_values(x, y):
    y = astype(y, x)
    return bool(((x == y) | (x.isnan() & y.isnan())).all())


def all_finite(x):
    return torch.isfinite(x).all()


def astype(x, like):
    """`x` on `like`'s dtype and device, off the autograd graph (no copy when it already matches):
    a gradient made with `create_graph=True` must not drag its graph into the optimiser state."""
    if isinstance(x, torch.Tensor):
        if not x.requires_grad and x.dtype == like.dtype and x.device == like.device and x.layout is _STRIDED:
            return x  # the usual gradient: nothing to do, and detach() costs a microsecond
        _check_gradient_tensor(x, like)
        return x.detach().to(dtype=like.dtype, device=like.device)
    x = np.asarray(x)
    ops.check_gradient_dtype(x.dtype, np.float64 if not like.is_complex() else np.complex128)
    return torch.as_tensor(x, dtype=like.dtype, device=like.device)


_STRIDED = torch.strided


def _check_gradient_tensor(x, like) -> None:
    if x.layout is not _STRIDED and like.layout is _STRIDED:
        raise ops.GradientError(
            f"a {x.layout} gradient: rules step dense arrays, so densify it first (.to_dense()), "
            "or train this parameter with torch.optim.SparseAdam; nn.Embedding(sparse=False) "
            "gives dense gradients"
        )
    if x.is_meta and not like.is_meta:
        raise ops.GradientError("a gradient on the meta device, which holds no values")
    if x.is_complex() and not like.is_complex():
        raise ops.GradientError(
            f"a complex gradient ({x.dtype}) for a real parameter ({like.dtype}): was the loss "
            "complex? Take its real part, or make the parameter complex"
        )
    if x.dtype is torch.bool:
        raise ops.GradientError(f"a gradient of dtype {x.dtype}, which is not a number")


def _torch_dtype(dtype):
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, np.dtype(dtype).name, None)  # float32, bfloat16 (ml_dtypes), ...
    if not isinstance(found, torch.dtype):
        raise TypeError(f"no torch dtype corresponds to {dtype!r}")
    return found


def cast(x, dtype):
    # `Tensor.to` returns `self` when nothing changes; a cast here is always a new tensor
    return x.detach().to(dtype=_torch_dtype(dtype), copy=True)


def copy(x):
    return _fresh_like(x.detach().clone(), x)


# --- what destructure asks --------------------------------------------------------------------


def flatten(arrays):
    dtype = functools.reduce(torch.promote_types, (a.dtype for a in arrays))
    return torch.cat([a.reshape(-1).to(dtype) for a in arrays])


def unflatten_one(flat, start, like):
    n = like.numel()
    # clone: the rebuilt model owns its memory (as with NumPy) and stays on the autograd graph
    out = flat[start : start + n].reshape(like.shape).to(like.dtype).clone()
    if isinstance(like, nn.Parameter) and not out.requires_grad:
        return nn.Parameter(out, requires_grad=like.requires_grad)
    return out


# --- nn.Module as a tree node -----------------------------------------------------------------


def _module_children(m):
    out = [(k, p) for k, p in m._parameters.items() if p is not None and p.requires_grad]
    out.extend((k, sub) for k, sub in m._modules.items() if sub is not None)
    return out


def _as_parameter(new, old):
    """What to store in a parameter slot whose old value was `old`: a Parameter stays a Parameter,
    except for a value on the autograd graph (a differentiable `destructure` rebuild). A plain
    tensor at several tied slots becomes one Parameter, remembered on the tensor itself."""
    if isinstance(new, nn.Parameter) or not isinstance(old, nn.Parameter) or new.requires_grad:
        return new
    wrapped = getattr(new, "_optimisers_parameter", None)
    if wrapped is None:
        wrapped = nn.Parameter(new, requires_grad=old.requires_grad)
        new._optimisers_parameter = wrapped
    return wrapped


@functools.cache
def _registries() -> tuple[str, ...]:
    """The names of the dicts and sets `nn.Module` registers into (parameters, buffers, submodules,
    every kind of hook), read from a bare module so that new kinds are covered too."""
    return tuple(k for k, v in vars(nn.Module()).items() if isinstance(v, (dict, set)))


def _module_rebuild(m, changes):
    """A new module object, sharing everything with `m` but its parameter and submodule slots; the
    dicts and sets that registration writes to are copied, so registering on one of the two
    modules does not change the other."""
    new = _copy.copy(m)
    d = new.__dict__
    for name in _registries():
        if name in d:
            d[name] = _copy.copy(d[name])  # shallow, keeping OrderedDict for the hooks
    params, modules = d["_parameters"], d["_modules"]
    for k, v in changes.items():
        if k in params:
            params[k] = _as_parameter(v, params[k])
        else:  # a submodule (the tree layer only passes keys from `_module_children`)
            modules[k] = v
    return new


def _module_grad_children(m, grad, path):
    """Gradient of a module: a mapping of its children's names (nested, mirroring the module) or
    of dotted names (`dict(module.named_parameters(remove_duplicate=False))`, as `torch.func.grad`
    returns), or a mix; a tied parameter may appear under each of its names, one contribution per
    name. Names of frozen parameters and buffers are ignored."""
    if isinstance(grad, nn.Module):
        raise TypeError(
            f"gradient at {format_path(path)} is a module ({type(grad).__name__}); pass "
            "optimisers.grads(module) to read the .grad fields that backward() filled"
        )
    if not isinstance(grad, Mapping):
        return None
    children = dict(_module_children(m))
    out: dict = {}
    dotted: dict = {}
    for key, g in grad.items():
        if not isinstance(key, str):
            raise TypeError(
                f"gradient at {format_path(path)} has key {key!r}; a module's gradient is keyed "
                "by parameter and submodule names (str)"
            )
        if key in children:
            if key in dotted:
                raise ValueError(_both(path, key))
            out[key] = g
            continue
        head, dot, rest = key.partition(".")
        if dot and isinstance(m._modules.get(head), nn.Module):
            if head in out:
                raise ValueError(_both(path, head))
            dotted.setdefault(head, {})[rest] = g
            continue
        if key in m._parameters or key in m._buffers:
            continue  # a frozen parameter or a buffer: its gradient is accepted and ignored
        have = ", ".join(repr(k) for k in children) or "none"
        raise ValueError(
            f"gradient at {format_path(path)} has key {key!r}, which the "
            f"{type(m).__name__} there does not have (trainable children: {have})"
        )
    out.update(dotted)
    _check_not_counted_twice(m, grad, path)
    return out


def _named(m, dotted: str):
    """The parameter or submodule that a dotted name names below `m` (None if none)."""
    node = m
    for part in dotted.split("."):
        sub = getattr(node, "_modules", {}).get(part)
        node = sub if sub is not None else getattr(node, "_parameters", {}).get(part)
        if node is None:
            return None
    return node


def _check_not_counted_twice(m, grad, path):
    """`{n: p.grad for n, p in named_parameters(remove_duplicate=False)}` gives a tied parameter's
    `.grad`, which autograd already summed over its places, once per place: it would count twice."""
    first: dict[int, str] = {}
    for key, g in grad.items():
        if not isinstance(g, torch.Tensor):
            continue
        other = first.setdefault(id(g), key)
        if other is key:
            continue
        target = _named(m, other)
        if target is not None and target is _named(m, key):
            where = "" if not path else f" (at {format_path(path)})"
            raise ValueError(
                f"the gradient gives one tensor object for both {other!r} and {key!r}{where}, "
                "which are the same tied parameter. PyTorch's .grad already sums every place's "
                "contribution, so this would count it twice; pass optimisers.grads(model), or "
                "dict(model.named_parameters()) without remove_duplicate=False"
            )


def _both(path, key) -> str:
    return (
        f"gradient at {format_path(path)} gives {key!r} both as a nested entry and through "
        "dotted names; use one form"
    )


def why_not_param(x):
    if isinstance(x, nn.Parameter) and not x.requires_grad:
        return (
            "it has requires_grad=False now; to stop training a parameter and keep its optimiser "
            "state, use optimisers.freeze_ on its Leaf instead (or run setup again)"
        )
    return None


def _why_not_child(m, key):
    p = m._parameters.get(key)
    if p is not None and not p.requires_grad:
        return why_not_param(p)
    if key in m._buffers:
        return "it is a buffer there, which is never trained"
    return None


MODULE = NodeKind("module", _module_children, _module_rebuild, _module_grad_children, _why_not_child,
                  operator.attrgetter("_parameters", "_modules"))


def node_kind(obj):
    """The tree kind of a torch container (`nn.Module`), or None."""
    return MODULE if isinstance(obj, nn.Module) else None


# --- what schedules ask: float64 values on the step's device -----------------------------------


def is_integer(x):
    return isinstance(x, torch.Tensor) and not (
        x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool
    )


def as_integer(x):
    return x.to(torch.int64)


def as_real(x):
    return x.to(torch.float64)


def real_scalar(value, like):
    return torch.full((), float(value), dtype=torch.float64, device=like.device)


def real_where(condition, x, y):
    x, y = (v if isinstance(v, torch.Tensor) else real_scalar(v, condition) for v in (x, y))
    return torch.where(condition, x, y)


cos = torch.cos


# --- what checkpoints ask: to and from NumPy arrays on the host --------------------------------


def dtype_name(x):
    return str(x).removeprefix("torch.") if isinstance(x, torch.dtype) else None


def to_host(x):
    host, name = to_host_bits(x)
    if name is None:
        return host
    import ml_dtypes  # bfloat16, float8: NumPy holds them as ml_dtypes'

    return host.view(getattr(ml_dtypes, name))


_SIGNED_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def to_host_bits(x):
    # dtypes NumPy lacks leave as their bits, so saving them needs no ml_dtypes
    t = x.detach().cpu().contiguous()
    try:
        return t.numpy().copy(), None
    except TypeError:
        host = t.view(_SIGNED_OF_SIZE[t.element_size()]).numpy()
        return host.view(f"u{host.dtype.itemsize}").copy(), dtype_name(t.dtype)


def _from_numpy(a):
    if not (a.flags.writeable and a.flags.c_contiguous):  # torch shares the array's memory
        a = a.copy(order="C")
    try:
        return torch.from_numpy(a)
    except TypeError:  # ml_dtypes' bfloat16, float8: through their bits
        bits = torch.from_numpy(a.view(f"i{a.dtype.itemsize}"))
        return bits.view(getattr(torch, a.dtype.name))


def from_host(value, like):
    source = value.detach() if isinstance(value, torch.Tensor) else _from_numpy(np.asarray(value))
    with torch.no_grad():
        out = torch.empty_like(like, requires_grad=False)
        out.copy_(source)
    return out


# --- maths of shaped arrays (matrix rules) -----------------------------------------------------


reshape, matmul, stack = torch.reshape, torch.matmul, torch.stack


def matrix_transpose(x):
    return x.mT


def tensordot(a, b, axes):
    return torch.tensordot(a, b, dims=axes)


def sum(x, axis=None, keepdims=False):  # noqa: A001 - mirrors the array-API name
    return torch.sum(x) if axis is None else torch.sum(x, dim=axis, keepdim=keepdims)


def mean(x, axis=None, keepdims=False):
    return torch.mean(x) if axis is None else torch.mean(x, dim=axis, keepdim=keepdims)


def eigh(x):
    # LAPACK's results are column-major; row-major, as NumPy's, so that state made of them rounds
    # the same in later products as the same state loaded from a checkpoint
    return tuple(t.contiguous() for t in torch.linalg.eigh(x))


def qr(x):
    return tuple(t.contiguous() for t in torch.linalg.qr(x))


def zeros(shape, like):
    return torch.zeros(shape, dtype=like.dtype, device=like.device)


def argsort(x, descending):
    order = torch.argsort(x, dim=-1, stable=True)
    return order.flip(-1) if descending else order


def take(x, indices, axis):
    return torch.index_select(x, axis, indices)


def dtype_epsilon(x):
    return float(torch.finfo(x.dtype).eps)
