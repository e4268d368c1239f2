"""The compiled way: an elementwise rule's step as one pass over memory, for any rule.

A step traces the rule once (`optimisers.backends.traced`): its `apply`, with the engine's
float32 maths for float16/bfloat16 (`precision.run`), runs on stand-ins for the arrays and
records a program; its scalars (hyperparameters, step counts, bias corrections) are computed as
the eager step computes them and become the kernel's arguments. The backend compiles each
distinct program once (`elementwise_kernel`: numba for NumPy and torch's CPU tensors), and the
kernel reads the parameter, its gradient and the state arrays and writes the new ones: each
element once, no temporaries. An engine group steps each big member, the packed members'
staging buffers or a span whole and in place; a lone parameter (`update`, or one the engine
does not take) gets new arrays. Every path of a backend computes one program, so `update`,
`update_` and the engine agree bit for bit. A chain that scales the gradient first (ClipNorm)
gets each element's factor as one more input. A rule whose step cannot be traced (it reads an
array's values, or needs a whole array: a norm), a backend without a compiler, and steps smaller
than the backend's `COMPILE_FROM` run eagerly, as before.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from typing import NamedTuple

import numpy as np

from optimisers import ops
from optimisers.backends import traced
from optimisers.core.quantised import Quantised
from optimisers.core.rule import NewValue
from optimisers.core.state import flatten_state, unflatten_state
from optimisers.engine import chunks, precision

ENABLED = os.environ.get("OPTIMISERS_COMPILE", "1") != "0"  # tests compare with the eager maths
_SHARE = 1 << 16  # elements: steps at least twice this long are split among the threads
_LINE = 64  # elements: where the threads' shares meet (whole cache lines of every dtype)
_WORKERS = chunks.WORKERS
_FLOAT32_EPS = float(np.finfo(np.float32).eps)
_SAMPLES: dict = {}  # (backend, dtype, device) -> a one-element array of ones
_UNTRACEABLE: set = set()  # the kinds of rule (`_kind`) whose step could not be traced
# within one update (`one_update`): a trace per rule and scalars
_TRACES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("traces", default=None)
_KEPT: dict = {}  # traces whose scalars are numbers, across updates (`trace`)
_KEEP = 256


class Step(NamedTuple):
    """A traced step: its program, the values of its constant slots, the new scalar parts of
    the state, what each output of the program is (a state part's number, or "x") and a
    one-element array of its dtype, and whether "x" is a new value rather than a step."""

    program: traced.Program
    consts: np.ndarray
    scalars: list
    writes: tuple
    samples: tuple
    new_value: bool


@contextlib.contextmanager
def one_update():
    """Leafs of one rule and step count share one trace within an update."""
    token = _TRACES.set({})
    try:
        yield
    finally:
        _TRACES.reset(token)


def trace(rule, spec, array_at, scalars, samples, mode: str, method: str = "apply") -> Step:
    """Trace one step of `rule` on a state of structure `spec` (`array_at`: which parts are
    arrays; `scalars`: the others' values) for inputs of the dtypes of `samples` (the parameter,
    its gradient, the state arrays; for `method` "apply_scaled", then each element's factor from
    `rule.step_factors`). `mode` "in place": each new state array is stored in the dtype the old
    one had, and the last output is the new parameter; "new": the state in the dtypes the rule
    gives it, as for "step", whose last output is the step itself (which the caller subtracts).
    `method` "direction": the one output is `rule.direction`'s array. Raises
    `traced.Untraceable`."""
    dtypes = tuple(s.dtype for s in samples)
    key = (id(rule), tuple(map(_number_or_id, scalars)), dtypes, mode, method)
    # (a state whose scalars are all numbers is traced once for good, not once per update: a
    # 0-d array scalar may change in place between updates, so it is keyed within one only)
    traces = _KEPT if all(k[0] != "id" for k in key[1]) else _TRACES.get()
    kept = None if traces is None else traces.get(key)
    if kept is not None and kept[0] is rule:
        return kept[1]
    rec = traced.Recorder(1)
    inputs = iter([rec.input(k, s) for k, s in enumerate(samples)])
    x, dx = next(inputs), next(inputs)
    parts = [next(inputs) if a else s for a, s in zip(array_at, scalars)]
    state = unflatten_state(spec, iter(parts))
    if method == "apply_scaled":
        new_state, step = precision.run(rule.apply_scaled, state, x, dx, next(inputs))
    elif method == "direction":
        new_state, step = state, precision.direction(rule, state, x, dx)
    else:
        new_state, step = precision.run(rule.apply, state, x, dx)
    new_parts: list = []
    if flatten_state(new_state, new_parts) != spec:
        raise traced.Untraceable("a state of another structure")
    outputs, writes = [], []  # (value, stored as this one's dtype), what it is
    for k, (a, old, new) in enumerate(zip(array_at, parts, new_parts)):
        if a != isinstance(new, traced.Traced):
            raise traced.Untraceable("a state array made a number, or a number made an array")
        if a and new is not old:  # (an array the step leaves as it was is not written)
            outputs.append((new, old if mode == "in place" else new))  # (the engine's buffer's dtype)
            writes.append(k)
    new_value = isinstance(step, NewValue)
    if new_value:
        outputs.append((_array(step.value), x))
    elif step is not None:
        value = _array(step) if mode == "step" else x - _array(step)
        outputs.append((value, value if mode == "step" else x))
    writes += ["x"] * (step is not None)
    program = rec.program([(rec.operand(v), like.dtype) for v, like in outputs])
    scalars = [None if a else p for a, p in zip(array_at, new_parts)]
    found = Step(program, np.array(rec.consts, dtype=np.float64), scalars, tuple(writes),
                 tuple(like.sample for _, like in outputs), new_value)
    if traces is not None:
        if traces is _KEPT and len(_KEPT) >= _KEEP:
            _KEPT.clear()  # (rules adjusted step after step: each a new rule)
        traces[key] = (rule, found, scalars)  # (holding them: the ids in the key stay theirs)
    return found


def _number_or_id(value):
    """A scalar part of a state as a key: a Python number by its value, anything else (a 0-d
    array, whose repr rounds) by its identity."""
    return (type(value), value) if isinstance(value, (int, float, type(None))) else ("id", id(value))


def _array(value):
    if not isinstance(value, traced.Traced):
        raise traced.Untraceable("a step that is a number, not an array")
    return value


def _wanted(b, rule, n) -> bool:
    """Is a step of `rule` on `n` elements of backend `b` worth tracing (before any work)?"""
    return ENABLED and n >= getattr(b, "COMPILE_FROM", n + 1) and _kind(rule) not in _UNTRACEABLE


def _kernel(b, rule, spec, array_at, scalars, samples, device, mode="in place", method="apply",
            uniform=False):
    """`(step, kernel)` for this step of `rule` (`trace`'s `mode` and `method`), or None (it runs
    eagerly). In place, each output is written into the input it replaces (the kernel takes no
    array twice). With `uniform`, a scaled step's factor is one element for the whole array."""
    step = _traced(rule, spec, array_at, scalars, samples, mode, method)
    if step is None:
        return None
    if mode == "in place":
        position = {k: 2 + n for n, k in enumerate(k for k, a in enumerate(array_at) if a)}
        aliases = tuple(0 if w == "x" else position[w] for w in step.writes)
    else:
        aliases = (-1,) * len(step.writes)
    kernel = b.elementwise_kernel(step.program, device, aliases, (len(samples) - 1,) if uniform else ())
    return None if kernel is None else (step, kernel)


def _traced(rule, spec, array_at, scalars, samples, mode, method="apply") -> Step | None:
    """`trace`'s step, or None where it runs eagerly."""
    if any(map(ops.is_complex, samples)):
        return None  # (complex numbers: the loops compute real ones)
    try:
        return trace(rule, spec, array_at, scalars, samples, mode, method)
    except traced.Untraceable:
        _UNTRACEABLE.add(_kind(rule))  # (asked once: eager from now on)
    except Exception:  # (anything else the stand-ins meet: the eager step runs, and says it)
        pass
    return None


def takes(b, rule, n) -> bool:
    """Would a step of `rule` on `n` elements of backend `b` take the compiled way (as far as
    is known before it is traced)?"""
    return b.IN_PLACE_ENGINE and (rule.elementwise or chunks.scaled(rule)) and _wanted(b, rule, n)


def _kind(rule):
    """A rule's class and those of the rules it holds: what decides whether it can be traced."""
    held = [getattr(rule, f.name) for f in dataclasses.fields(rule)] if dataclasses.is_dataclass(rule) else []
    inner = [v for h in held for v in (h if isinstance(h, tuple) else (h,)) if hasattr(v, "apply")]
    return (type(rule), *map(_kind, inner))


# --- an engine group, in place ----------------------------------------------------------------


def step_group(group, xs, dxs, factors=None) -> bool:
    """Step every member of `group` in place with its rule's compiled kernel (a scaled group:
    with each member's `factors`); whether it did (nothing is written where it did not). Packed
    members step run by run (`_packed_runs`), unless a rehearsal staged them all already."""
    b, rule = group.b, group.leaves[0].rule
    if not _wanted(b, rule, group.offsets[-1]):
        return False
    # (on the CPU, where a run's buffers stay in cache; a GPU takes the packed members in one go)
    apart = group.has_runs and group.staging_now is None and _on_cpu(group.device)
    deferred = group.runs_apart  # (a scaled group whose packed factors come run by run)
    with b.no_grad():
        if not apart:
            chunks.stage(group, xs, dxs)  # (a span; or packed members a rehearsal staged)
        pieces = group_pieces(group, xs, dxs, factors)
        if pieces:
            like = pieces[0]
        else:  # (every member packed: the arrays a run's kernel takes)
            p0, held = group.packed_from, [k for k, a in enumerate(group.array_at) if a]
            x = b.flat_in(xs[p0], group.orders[p0])
            like = [x, x, *[group.packed[k] for k in held]] + ([] if factors is None else [factors])
        samples = [_sample(b, a, group.device) for a in like]
        kernels = {}  # (a scaled group: each big member's factor is one element, uniform)
        method = "apply" if factors is None else "apply_scaled"
        for uniform in {_uniform(p, factors) for p in pieces} | ({False} if apart else set()):
            kernels[uniform] = _kernel(b, rule, group.spec, group.array_at, group.scalars, samples,
                                       group.device, method=method, uniform=uniform)
        if deferred is not None:  # (and the directions' kernel, found once for every run)
            kernels["direction"] = direction_kernel(b, rule, group.spec, group.array_at, group.scalars,
                                                    like[:-1], group.device)
        if None in kernels.values():
            return False
        step = kernels[False if apart else _uniform(pieces[0], factors)][0]
        _run([(kernels[_uniform(p, factors)][1], p) for p in pieces], step.consts, group.device)
        if apart:
            of_run = None if deferred is None else (kernels["direction"], deferred.of_run)
            _packed_runs(group, xs, dxs, kernels[False][1], step.consts, factors, of_run)
        elif group.has_runs:
            chunks.unpack(group, xs)
    chunks.unstage(group)
    group.scalars[:] = step.scalars
    return True


def _on_cpu(device) -> bool:
    return getattr(device, "type", "cpu") == "cpu"


def runs_apart(group) -> bool:
    """Would the compiled way step `group`'s packed members run by run (`_packed_runs`)?"""
    rule, n = group.leaves[0].rule, group.offsets[-1]
    return group.has_runs and _on_cpu(group.device) and _wanted(group.b, rule, n)


def _packed_runs(group, xs, dxs, kernel, consts, factors, of_run=None) -> None:
    """Step a group's packed members run by run (`chunks.plan`'s runs): a run's parameters and
    gradients joined into buffers of its own, stepped (a scaled group's with each member's
    factor) and copied back while in cache, so no buffer holds every packed member at once; the
    runs a share per worker on the CPU. `of_run`: `(direction's kernel, factors of a run's
    members from their directions)` where a scaled group's packed factors were left to the runs."""
    b, p0 = group.b, group.packed_from
    base, held = group.offsets[p0], [k for k, a in enumerate(group.array_at) if a]

    def one(run):
        _, i, j, _ = run
        lo, hi = group.offsets[i] - base, group.offsets[j] - base
        orders = group.orders[i:j]
        x, dx = b.empty_flat(hi - lo, xs[p0]), b.empty_flat(hi - lo, xs[p0])  # (as `stage`'s)
        b.join_into(x, xs[i:j], orders)
        b.join_into(dx, dxs[i:j], orders)
        piece = [x, dx, *[group.packed[k][lo:hi] for k in held]]
        if of_run is not None:
            u = direction(b, None, None, None, None, piece, group.device, False, of_run[0])
            piece.append(b.repeat_each(of_run[1](i, j, piece, u), group.sizes[i:j]))
        elif factors is not None:
            piece.append(b.repeat_each(factors[i:j], group.sizes[i:j]))
        kernel(piece, consts)
        b.split_into(x, xs[i:j], orders)

    runs = [c for c in group.chunks if c[0] == "run"]
    n = group.offsets[-1] - base
    chunks._map(one, runs, n >= 2 * _SHARE and _WORKERS > 1)


def group_pieces(group, xs, dxs, factors=None) -> list:
    """`[x, dx, *state arrays]` as 1-D arrays (and each element's factor, for a scaled group):
    each big member's, then the staging buffers of the packed members (or of a span) with the
    packed state buffers (staged: `chunks.stage`)."""
    b, arrays = group.b, [k for k, a in enumerate(group.array_at) if a]
    pieces = []
    for i in range(group.packed_from):
        order = group.orders[i]
        state = [group.buffers[k][i] for k in arrays]
        pieces.append([b.flat_in(xs[i], order), b.flat_in(dxs[i], order), *state])
        if factors is not None:
            pieces[-1].append(factors[i : i + 1])  # (one element: `_uniform`)
    if group.staging_now is not None:
        pieces.append([*group.staging_now, *[group.packed[k] for k in arrays]])
        if factors is not None:
            p0 = group.packed_from
            pieces[-1].append(b.repeat_each(factors[p0:], group.sizes[p0:]))
    return pieces


def direction(b, rule, spec, array_at, scalars, piece, device, threads=True, found=None):
    """`rule.direction` over `piece` (`[x, dx, *state arrays]`, 1-D) into a new 1-D array, in
    one pass (`_run`'s `threads`; `found`: `direction_kernel`'s, found already); None where it
    runs eagerly."""
    n = len(piece[0])
    if found is None:
        if not _wanted(b, rule, n):
            return None
        found = direction_kernel(b, rule, spec, array_at, scalars, piece, device)
        if found is None:
            return None
    step, kernel = found
    out = b.empty_flat(n, step.samples[-1])
    _run([(kernel, [*piece, out])], step.consts, device, threads)
    return out


def direction_kernel(b, rule, spec, array_at, scalars, piece, device):
    """`(step, kernel)` of `rule.direction` for pieces like `piece`, or None (eagerly)."""
    samples = [_sample(b, a, device) for a in piece]
    return _kernel(b, rule, spec, array_at, scalars, samples, device, "step", "direction")


def _uniform(piece, factors) -> bool:
    """Is `piece`'s factor (a scaled group's last input) one element for all of it?"""
    return factors is not None and len(piece[-1]) == 1


def _run(runs, consts, device, threads=True) -> None:
    """Each `(kernel, piece)` of `runs`: the kernel over the piece (its inputs, then its
    outputs: 1-D arrays of one length, but a uniform input's one element), on the CPU in one
    contiguous share of all the elements per worker on our threads (the kernels release the
    GIL), unless `threads` is False (a caller on those threads already)."""
    n, workers = sum(len(p[0]) for _, p in runs), _WORKERS
    threads = threads and n >= 2 * _SHARE and workers > 1 and getattr(device, "type", "cpu") == "cpu"
    parts = workers if threads else 1
    # (shares equal in elements, whatever the sizes of the pieces; cut at whole cache lines)
    cuts = [n * k // parts // _LINE * _LINE for k in range(parts)] + [n]
    shares: list = [[] for _ in range(parts)]
    start = 0
    for kernel, piece in runs:
        m = len(piece[0])
        for share, first, last in zip(shares, cuts, cuts[1:]):
            lo, hi = max(first - start, 0), min(last - start, m)
            if lo < hi:
                share.append((kernel, [a[lo:hi] if len(a) == m else a for a in piece]))
        start += m
    chunks._map(lambda share: [kernel(piece, consts) for kernel, piece in share], shares, threads)


def _sample(b, array, device):
    key = (b, array.dtype, device)
    found = _SAMPLES.get(key)
    if found is None:
        found = _SAMPLES[key] = b.full_like(array[:1], 1)
    return found


# --- one parameter, into new arrays -------------------------------------------------------------


def step_leaf(rule, state, x, dx, pure: bool, factor=None):
    """One parameter's step with the compiled kernel, into new arrays: `(new_state, new_x)`
    with `pure`, else `(new_state, step)`; None where it runs eagerly. A scaled step's `factor()`
    gives its factor (`engine.scaled`)."""
    inner = rule.dequantised_rule()
    if inner is not None:
        return _step_quantised(inner, state, x, dx, pure)
    b = ops.backend(x)
    is_scaled = chunks.scaled(rule)
    # (a DTensor runs eagerly, shard by shard; a strided view is read through a copy)
    takes = rule.elementwise or (is_scaled and factor is not None)  # (LowBit's inner one: no factor)
    if not (takes and b.IN_PLACE_ENGINE and b.kernel_ok(x)):
        return None
    n = b.numel(x)
    if not _wanted(b, rule, n):
        return None
    parts: list = []
    spec = flatten_state(state, parts)
    array_at = [b.is_buffer(p) for p in parts]
    arrays = [dx, *[p for p, a in zip(parts, array_at) if a]]
    if not all(b.is_buffer(a) and a.shape == x.shape and b.kernel_ok(a) for a in arrays):
        return None
    order = b.memory_order(x)
    ins = [b.flat_in(a, order) for a in (x, dx, *[p for p, a in zip(parts, array_at) if a])]
    device = getattr(x, "device", None)
    scalars = [None if a else p for a, p in zip(array_at, parts)]
    if is_scaled:  # the array's factor, one element for all
        ins.append(b.repeat_each([factor()], [1]))
    samples = [_sample(b, a, device) for a in ins]
    found = _kernel(b, rule, spec, array_at, scalars, samples, device, "new" if pure else "step",
                    "apply_scaled" if is_scaled else "apply", is_scaled)
    if found is None:
        return None
    step, kernel = found
    outs = [b.empty_flat(n, like) for like in step.samples]
    _run([(kernel, [*ins, *outs])], step.consts, device)
    new_parts = [
        step.scalars[k] if not a else b.shaped_in(outs[step.writes.index(k)], x.shape, order)
        if k in step.writes else p
        for k, (a, p) in enumerate(zip(array_at, parts))
    ]
    return _result(b, step, unflatten_state(spec, iter(new_parts)), outs[-1], x, order, pure)


def _result(b, step, new_state, last, x, order, pure):
    """`step_leaf`'s `(new_state, new_x or step)` from the kernel's last output `last` (1-D)."""
    if "x" not in step.writes:
        return new_state, None
    value = b.shaped_in(last, x.shape, order)
    if pure:
        return new_state, b.adopt(value, x)
    return new_state, NewValue(value) if step.new_value else value


# --- one parameter whose state is kept quantised (LowBit) ----------------------------------------


def _step_quantised(inner, state, x, dx, pure):
    """`step_leaf` for a rule that steps as `inner` on its state dequantised (`LowBit`): one
    pass that reads the codes and scales, steps, and writes new codes and scales, a block at a
    time, in row-major order as the quantiser takes the array; None where it runs eagerly."""
    parts: list = []
    spec = flatten_state(state, parts)
    quantised = [p if isinstance(p, Quantised) else None for p in parts]
    if not any(quantised):
        return step_leaf(inner, state, x, dx, pure)  # (LowBit's step is then its rule's)
    if not inner.elementwise:
        return None  # (a chain that scales the gradient first needs its norm: eager)
    b = ops.backend(x)
    if not (b.IN_PLACE_ENGINE and hasattr(b, "quantised_kernel") and b.kernel_ok(x)):
        return None
    n = b.numel(x)
    if not _wanted(b, inner, n):
        return None
    if ops.dtype_epsilon(x) < _FLOAT32_EPS:
        return None  # (a float64 parameter's state is dequantised to float64)
    array_at = [q is not None or b.is_buffer(p) for q, p in zip(quantised, parts)]
    plain = [dx, *[p for q, p, a in zip(quantised, parts, array_at) if a and q is None]]
    blocks = {q.block for q in quantised if q is not None}
    if len(blocks) > 1 or not all(b.is_buffer(a) and a.shape == x.shape and b.kernel_ok(a) for a in plain):
        return None
    if not all(q.shape == tuple(x.shape) and b.kernel_ok(q.codes) and b.kernel_ok(q.scale)
               for q in quantised if q is not None):
        return None
    device = getattr(x, "device", None)
    ins = [b.flat_in(x, None), b.flat_in(dx, None)]  # (row-major: the blocks' order)
    samples = [_sample(b, a, device) for a in ins]
    formats = [None, None]
    for q, p, a in zip(quantised, parts, array_at):
        if a:
            ins.append(b.flat_in(p, None) if q is None else _codes_and_scale(b, q))
            samples.append(_sample(b, p if q is None else q.scale, device))  # (float32 values)
            formats.append(None if q is None else (q.bits, q.signed))
    scalars = [None if a else p for a, p in zip(array_at, parts)]
    step = _traced(inner, spec, array_at, scalars, samples, "new" if pure else "step")
    if step is None or not all(k in step.writes for k, q in enumerate(quantised) if q is not None):
        return None  # (a quantised array the step leaves alone is quantised again, eagerly)
    outs = [None if w == "x" or quantised[w] is None else quantised[w] for w in step.writes]
    block = blocks.pop()
    kernel = b.quantised_kernel(step.program, device, tuple(formats),
                                tuple(None if q is None else (q.bits, q.signed) for q in outs), block)
    if kernel is None:
        return None
    new = [b.empty_flat(n, like) if q is None else _codes_and_scale(b, q, b.empty_flat)
           for q, like in zip(outs, step.samples)]
    _run_blocks(kernel, [*ins, *new], step.consts, n, block, device)
    new_parts = list(step.scalars)
    for k, (a, p) in enumerate(zip(array_at, parts)):
        if a:
            out = new[step.writes.index(k)] if k in step.writes else p
            if quantised[k] is not None:
                codes = out[0] if quantised[k].bits == 4 else b.shaped_in(out[0], x.shape, None)
                out = dataclasses.replace(quantised[k], codes=codes, scale=out[1])
            elif k in step.writes:
                out = b.shaped_in(out, x.shape, None)
            new_parts[k] = out
    return _result(b, step, unflatten_state(spec, iter(new_parts)), new[-1], x, None, pure)


def _codes_and_scale(b, q, made=None) -> tuple:
    """`(codes, scales, elements a byte)` of Quantised `q` as 1-D arrays (`made`: new ones)."""
    codes = b.flat_in(q.codes, None)
    if made is not None:
        codes, scale = made(len(codes), codes), made(len(q.scale), q.scale)
    return codes, q.scale if made is None else scale, 2 if q.bits == 4 else 1


def _run_blocks(kernel, arrays, consts, n, block, device) -> None:
    """The kernel over whole blocks, on the CPU a share of them per worker: `arrays` holds
    arrays of `n` elements and `_codes_and_scale`'s triples."""
    blocks = -(-n // block)
    threads = n >= 2 * _SHARE and _WORKERS > 1 and getattr(device, "type", "cpu") == "cpu"
    parts = min(_WORKERS, blocks) if threads else 1
    bounds = [blocks * k // parts for k in range(parts + 1)]
    shares = []
    for first, last in zip(bounds, bounds[1:]):
        lo, hi = first * block, min(n, last * block)
        share = []
        for a in arrays:
            if type(a) is not tuple:
                share.append(a[lo:hi])
                continue
            codes, scale, per_byte = a  # (4-bit codes: two a byte, from an even `lo`)
            share += [codes[lo // per_byte : -(-hi // per_byte)], scale[first:last]]
        shares.append(share)
    chunks._map(lambda share: kernel(share, consts), shares, threads)


def traceable(rule) -> bool:
    """Whether `rule`'s steps can take the compiled way (on a backend with a compiler, for steps of
    `COMPILE_FROM` elements or more): False for a rule that is neither elementwise nor scaled
    elementwise (a factor per array first: `Rule.scaled_elementwise`), for one
    whose step was found untraceable (known after its first step), and with compiling turned off;
    such a rule's steps run eagerly. A rule that steps as another on its state dequantised
    (`LowBit`) can where that one can."""
    inner = rule.dequantised_rule()
    if inner is not None:
        return bool(inner.elementwise) and traceable(inner)
    if not ENABLED or _kind(rule) in _UNTRACEABLE:
        return False
    return bool(rule.elementwise or chunks.scaled(rule))
