"""The flat-chunks way: an elementwise rule's own `apply` over cache-sized chunks of flat buffers.

A group's big members are cut into chunks that are views of each parameter; its small members
are packed: joined into staging buffers (one call each for parameters and gradients), stepped in
runs of whole chunks, and copied back with one call; a span's chunks are ranges of the span
itself. NumPy chunks run on a thread pool (ufuncs release the GIL). `pure_step` is the same
for `update`: one large parameter, chunk by chunk, into new arrays.
"""

from __future__ import annotations

import contextvars
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from optimisers import ops
from optimisers.core.rule import NewValue
from optimisers.core.state import flatten_state, unflatten_state
from optimisers.engine import checks, precision

CHUNK_SCALE = 1  # tests shrink chunks to exercise packing and splitting on small models
MIN_CHUNK = 1 << 14  # elements: below this, the Python cost per chunk outweighs its work
# A group is cut into at least this many chunks per worker, so that the temporaries of the chunks
# in flight (one per worker, a handful of chunk-sized arrays each) stay under a quarter of the
# group's parameter bytes (benchmarks/memory.py --first: 0.3x at 16, 0.15-0.2x at 32)
CHUNKS_PER_WORKER = 32
WORKERS = os.cpu_count() or 1  # (asked once: each call reads the system, ~20 µs)
# Groups smaller than this (elements) step on one thread: two threads taking turns at the GIL for
# the Python of small chunks were no faster, and one worker has half the temporaries in flight
THREADS_FROM = 1 << 21
_POOL: ThreadPoolExecutor | None = None


def scaled(rule) -> bool:
    """Is `rule` a chain whose first member scales the whole gradient by one factor, followed by
    elementwise rules (`OptimiserChain(ClipNorm(), Adam())`)?"""
    return not rule.elementwise and rule.scaled_elementwise


# --- planning: how a group is cut --------------------------------------------------------------


def chunk_size(b, total: int, threads: bool) -> int:
    """The backend's chunk, smaller for a small group: the chunks in flight (a handful of
    temporaries each) must stay a small fraction of the group's own size (`benchmarks/memory.py`
    measures the peak; smaller chunks cost more Python per step)."""
    workers = WORKERS if threads else 1
    largest = max(4, b.ENGINE_CHUNK // CHUNK_SCALE)
    smallest = max(4, MIN_CHUNK // CHUNK_SCALE)
    return max(smallest, min(largest, total // (CHUNKS_PER_WORKER * workers)))


def member_runs(offsets, chunk, first=0):
    """Members `first`.. in runs of about a chunk's elements: ("run", i, j, bounds), members
    i..j-1 packed, member i+k at elements bounds[k] of the packed chunk."""
    runs, i, n = [], first, len(offsets) - 1
    for j in range(first + 1, n + 1):
        if j == n or offsets[j] - offsets[i] >= chunk:
            bounds = [(offsets[k] - offsets[i], offsets[k + 1] - offsets[i]) for k in range(i, j)]
            runs.append(("run", i, j, bounds))
            i = j
    return runs


def plan(sizes, offsets, chunk, span: bool):
    """("big", i, a, b): elements a..b of member i; the small members (the last: see
    `layout.GroupLayout`) packed in `member_runs`; or for a span, ("flat", 0, a, b): elements
    a..b of the span (every member, back to back) and of the packed buffers."""
    if span:
        return [("flat", 0, a, b) for a, b in _cut(offsets[-1], chunk)]
    # smaller members are packed (in a scaled group each with its factor)
    small = next((i for i, n in enumerate(sizes) if n < chunk // 4), len(sizes))
    big = [("big", i, a, b) for i in range(small) for a, b in _cut(sizes[i], chunk)]
    return big + member_runs(offsets, chunk, small)


def _cut(n, chunk):
    pieces = max(1, round(n / chunk))
    bounds = [n * k // pieces for k in range(pieces + 1)]
    return list(zip(bounds, bounds[1:]))


# --- the staging buffers of one step: the packed members joined ---------------------------


def stage(group, xs, dxs) -> None:
    """Join the packed members' parameters and gradients into the staging buffers (once per
    step: a rehearsal does it before the step). A span is its own staging buffer for the
    parameters, and so are the gradients where they are views of one flat buffer too."""
    staged = group.staged
    if staged is not None and staged[0] is xs and staged[1] is dxs:
        return
    if group.span is not None:
        group.staging_now = group.span.flat, group.span.gradient(dxs, group)
    elif group.has_runs:
        p0 = group.packed_from
        group.staging_now = flat_x, flat_g = group.staging(xs[p0])
        orders = group.orders[p0:]
        group.b.join_into(flat_x, xs[p0:], orders)
        group.b.join_into(flat_g, dxs[p0:], orders)
    group.staged = xs, dxs

def unpack(group, xs) -> None:
    """Copy the stepped packed parameters from the staging buffer back into `xs`."""
    p0 = group.packed_from
    group.b.split_into(group.staging_now[0], xs[p0:], group.orders[p0:])

def unstage(group) -> None:
    """Let go of what `stage` made and refers to (after a step, or a failed rehearsal)."""
    group.staged = group.staging_now = group.runs_apart = None


# --- stepping a group --------------------------------------------------------------------------


def _forget_pool() -> None:
    global _POOL
    _POOL = None  # (a forked child has none of the parent's threads: its first step starts its own)


if hasattr(os, "register_at_fork"):  # (not on Windows, which has no fork)
    os.register_at_fork(after_in_child=_forget_pool)


def _on_a_worker() -> bool:
    """Is this one of our workers (whose own `_map` runs in turn: waiting on the pool from it
    could wait for ever)?"""
    return threading.current_thread().name.startswith(_PREFIX)


_PREFIX = "optimisers-worker"


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix=_PREFIX)
    return _POOL


def _map(fn, chunks, threads: bool) -> list:
    """`[fn(c) for c in chunks]`, on the pool if `threads`: each worker takes one contiguous
    share of the chunks as one task, so that a step pays one hand-over per worker rather than
    one per chunk (chunks can then be small, and their temporaries few, at little cost). Each
    share runs in a copy of the caller's context, taken on the caller's thread: the update's
    traces (a rule traced once per step, not once per array) and NumPy's error handling."""
    workers = WORKERS
    if not threads or len(chunks) < 2 or workers < 2 or _on_a_worker():
        return [fn(c) for c in chunks]
    n = len(chunks)
    shares = [s for s in (chunks[k * n // workers : (k + 1) * n // workers] for k in range(workers)) if s]
    contexts = [contextvars.copy_context() for _ in shares]  # (a context is entered by one thread)
    done = _pool().map(lambda share, context: context.run(_each, fn, share), shares, contexts)
    return [result for results in done for result in results]


def _each(fn, share) -> list:
    return [fn(c) for c in share]


def step(group, xs, dxs, factors=None) -> None:
    """Update every member of `group` in place, chunk by chunk: big chunks are views of one
    parameter, written where they are computed; packed members are stepped in the staging
    buffers and copied back at the end."""
    with group.b.no_grad():  # PyTorch: the step is data, not a graph
        done = _each_chunk(group, xs, dxs, factors, write=True)
        if group.has_runs:  # (a span's chunks wrote the parameters themselves)
            unpack(group, xs)
    unstage(group)
    group.scalars[:] = done[0]  # (in place: what the group's members see, see `layout._Held`)


def rehearse(group, xs, dxs, factors=None) -> None:
    """Run the rule on every chunk without writing anything, checking what it returns: a rule
    that raises (or returns arrays that do not fit) on some chunk does so here, before `step`
    has written any chunk, so that a failed `update_` changes nothing."""
    with group.b.no_grad():
        _each_chunk(group, xs, dxs, factors, write=False)


def _each_chunk(group, xs, dxs, factors, write: bool) -> list:
    if group.runs_apart is not None:
        group.runs_apart.fill()  # (the packed members' factors, which the compiled way left)
    stage(group, xs, dxs)
    rule = group.leaves[0].rule
    one = functools.partial(_chunk, group, rule, xs=xs, dxs=dxs, factors=factors, write=write)
    return _map(one, group.chunks, group.threads)


def _views(group, chunk, xs, dxs):
    """`(i, start, stop, x, dx)`: the chunk's parameter and gradient views, and its range of
    the buffers of member (or run) `i`."""
    b, kind = group.b, chunk[0]
    if kind == "big":
        _, i, start, stop = chunk
        order = group.orders[i]
        return i, start, stop, b.flat_in(xs[i], order)[start:stop], b.flat_in(dxs[i], order)[start:stop]
    flat_x, flat_g = group.staging_now
    if kind == "flat":  # a range of the span and of the packed buffers
        _, i, start, stop = chunk
        return i, start, stop, flat_x[start:stop], flat_g[start:stop]
    _, i, j, _ = chunk  # a run: its range of the staging buffers, and its buffer slices, whole
    stop = group.offsets[j] - group.offsets[i]
    lo = group.offsets[i] - group.offsets[group.packed_from]
    return i, 0, stop, flat_x[lo : lo + stop], flat_g[lo : lo + stop]


def _chunk(group, rule, chunk, *, xs, dxs, factors, write):
    """Compute and write one chunk: the new scalars. With `write=False` only compute and check."""
    b = group.b
    i, start, stop, x, dx = _views(group, chunk, xs, dxs)
    held = zip(group.array_at, group.buffers, group.scalars)
    parts = [buf[i][start:stop] if a else s for a, buf, s in held]
    state = unflatten_state(group.spec, iter(parts))
    if factors is None:
        new_state, dx_step = precision.run(rule.apply, state, x, dx)
    else:  # a scaled group: the member's factor, or each packed member's over its elements
        factor = factors[i] if chunk[0] == "big" else _run_factors(b, factors, chunk)
        new_state, dx_step = precision.run(rule.apply_scaled, state, x, dx, factor)
    new_parts: list = []
    flatten_state(new_state, new_parts)
    if not write:
        _check_chunk(rule, x, parts, new_parts, dx_step)
        return None
    for a, old, new in zip(group.array_at, parts, new_parts):
        if a and new is not old:
            b.copy_into(old, new)
    _write(b, x, dx_step)
    return [None if a else p for a, p in zip(group.array_at, new_parts)]


def _write(b, x, step) -> None:
    """Apply `step` (a `NewValue`, or None for no change) to `x` in place."""
    if isinstance(step, NewValue):
        b.assign_(x, step.value)
    elif step is not None:
        b.subtract_(x, step)


def _run_factors(b, factors, chunk):
    """A packed run's factors, one per element (each member's over its elements): the products
    `factor · dx` are those of each member's own factor, element by element."""
    _, i, j, bounds = chunk
    return b.repeat_each(factors[i:j], [hi - lo for lo, hi in bounds])


def _check_chunk(rule, x, parts, new_parts, step) -> None:
    """What a rehearsed chunk returned must fit where `step` would write it."""
    name = type(rule).__name__
    if len(new_parts) != len(parts):
        raise ValueError(f"{name}.apply returned a state of another structure than it was given")
    for old, new in zip(parts, new_parts):
        shape = getattr(old, "shape", None)
        if shape is not None and len(shape) > 0 and getattr(new, "shape", None) != shape:
            raise ValueError(
                f"{name}.apply returned a state array of shape {tuple(getattr(new, 'shape', ()))} "
                f"for a state array of shape {tuple(shape)}"
            )
    checks.check_step_shape(rule, step, x)


# --- the pure step of one large parameter ------------------------------------------------------


def pure_step(rule, state, x, dx, factor=None):
    """The pure update of one parameter, chunk by chunk: `(new_state, new_x)`, or None where
    that does not apply (a rule that is not elementwise, a backend without the engine, a
    parameter of at most one chunk, state arrays not shaped like it). The new state and parameter
    are allocated once and filled chunk by chunk, so the step and the rule's temporaries never
    exist at full size; the numbers are those of `rule.apply` on the whole arrays."""
    is_scaled = scaled(rule)
    b = ops.backend(x)
    if not ((rule.elementwise or is_scaled) and b.IN_PLACE_ENGINE and b.engine_ok(x)):
        return None
    n, chunk = b.numel(x), max(4, b.ENGINE_CHUNK // CHUNK_SCALE)
    parts: list = []
    spec = flatten_state(state, parts)
    array_at = [b.is_buffer(p) for p in parts]
    if n <= chunk or not all(p.shape == x.shape and b.engine_ok(p) for p, a in zip(parts, array_at) if a):
        return None
    factor = factor() if is_scaled else None  # (`engine.scaled`)
    order = b.memory_order(x)  # every array is read in the parameter's memory order
    flat_x, flat_dx = b.flat_in(x, order), b.flat_in(dx, order)
    flat_parts = [b.flat_in(p, order) if a else p for p, a in zip(parts, array_at)]
    new_x = ops.copy(x)
    if b.memory_order(new_x) != order:
        return None  # a copy in another layout: its flat view would not be a view
    flat_new_x = b.flat_in(new_x, order)
    outs = [ops.zeros_like(p) if a else None for p, a in zip(flat_parts, array_at)]
    scalars = None
    method, extra = (rule.apply, ()) if factor is None else (rule.apply_scaled, (factor,))
    for lo, hi in ((lo, min(n, lo + chunk)) for lo in range(0, n, chunk)):
        sub = [p[lo:hi] if a else p for p, a in zip(flat_parts, array_at)]
        chunk_state = unflatten_state(spec, iter(sub))
        new_state, dx_step = precision.run(method, chunk_state, flat_x[lo:hi], flat_dx[lo:hi], *extra)
        new_parts: list = []
        if flatten_state(new_state, new_parts) != spec:
            return None  # (before anything is returned: the caller takes the whole-array path)
        if any(a and new.dtype != out.dtype for a, new, out in zip(array_at, new_parts, outs)):
            return None  # the rule changes the state's dtype: whole arrays, as it wants
        for k, a in enumerate(array_at):
            if a:
                b.copy_into(outs[k][lo:hi], new_parts[k])
        if scalars is None:
            scalars = [None if a else p for a, p in zip(array_at, new_parts)]
        value = dx_step.value if isinstance(dx_step, NewValue) else dx_step
        if value is not None and ops.is_complex(value) and not ops.is_complex(x):
            return None  # a step that cannot be written: the whole-array path reports it
        _write(b, flat_new_x[lo:hi], dx_step)
    merged = [b.shaped_in(o, x.shape, order) if a else s for a, o, s in zip(array_at, outs, scalars)]
    return unflatten_state(spec, iter(merged)), new_x
