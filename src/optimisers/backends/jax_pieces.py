"""A quantised elementwise step under `jit` on one CPU device, run piece by piece.

A blockwise-quantised state needs each block's new absmax before any of its codes, so XLA keeps
the whole new moments in temporary buffers between the two. On the CPU those are allocated
afresh on every call, and the first touch of their pages costs as much as the step itself (a 4M
array's 8-bit AdamW step: about 27 ms, of which 13 are page faults; optax.adamw takes 4).
Stepping the array in pieces of whole blocks (`lax.map`; what is left over after the last whole
piece, in one more step) keeps the temporaries a piece long, in cache and reused. The maths per
element is the whole step's (XLA may round a multiply-add differently in the two programs).
Elsewhere (several devices, where a piece would cut across shards; GPUs, where XLA fuses the
whole step) the step runs whole.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from optimisers.core.quantised import Quantised
from optimisers.core.state import flatten_state, unflatten_state

PIECE = 1 << 18  # elements a piece at most: its float32 temporaries stay in the cache


def step_in_pieces(step, state, x, dx):
    """`step(state, x, dx)` (an elementwise rule's, whose state is partly `Quantised`) piece by
    piece, or None where it runs whole."""
    if not isinstance(x, jax.core.Tracer) or jax.default_backend() != "cpu" or jax.device_count() != 1:
        return None
    parts: list = []
    spec = flatten_state(state, parts)
    n = math.prod(x.shape)
    quantised = [p for p in parts if isinstance(p, Quantised)]
    if n <= PIECE or not quantised or any(q.shape != tuple(x.shape) for q in quantised):
        return None
    unit = math.lcm(*(q.block * (2 if q.bits == 4 else 1) for q in quantised))  # (4 bits: whole bytes)
    length = PIECE // unit * unit
    if length == 0:
        return None
    k = n // length
    cut = k * length  # the pieces' elements; the rest (whole blocks but a short last one) after
    mapped = [i for i, p in enumerate(parts) if _sized(p, x.shape)]
    heads = [_head(parts[i], cut, k) for i in mapped]

    def part_of(arrays, size):
        given = dict(zip(mapped, arrays))
        inner = [_rebuilt(parts[i], given[i], size) if i in given else parts[i] for i in range(len(parts))]
        return unflatten_state(spec, iter(inner))

    def one(piece):
        xs, dxs, arrays = piece
        new_state, out = step(part_of(arrays, length), xs, dxs)
        new_parts: list = []
        flatten_state(new_state, new_parts)  # (of `spec`'s structure: `step` checks it)
        return new_parts, out

    new_heads, out = jax.lax.map(one, (_rows(x, cut, k), _rows(dx, cut, k), heads))
    if cut < n:  # (what is left: fewer elements than a piece)
        tails = [_tail(parts[i], cut) for i in mapped]
        tail_state, tail_out = step(part_of(tails, n - cut), x.reshape(-1)[cut:], dx.reshape(-1)[cut:])
        new_tails: list = []
        flatten_state(tail_state, new_tails)
    else:
        tail_out, new_tails = None, None
    whole = [
        _joined(new_heads[i], None if new_tails is None else new_tails[i], parts[i], x.shape, i in mapped)
        for i in range(len(parts))
    ]
    joined_out = jax.tree_util.tree_map(
        lambda head, *tail: _flat_join(head, *tail).reshape(x.shape),
        out,
        *([] if tail_out is None else [tail_out]),
    )
    return unflatten_state(spec, iter(whole)), joined_out


def _sized(part, shape) -> bool:
    """Is `part` one of the state's per-element parts (an array of the parameter's shape, or
    kept quantised), cut into pieces with it? Others (a step count) are stepped whole."""
    if isinstance(part, Quantised):
        return True
    return getattr(part, "shape", None) is not None and tuple(part.shape) == tuple(shape)


def _head(part, cut, k):
    """The first `cut` elements' share of `part`, in `k` rows."""
    if isinstance(part, Quantised):
        codes = cut // 2 if part.bits == 4 else cut
        return (_rows(part.codes, codes, k), _rows(part.scale, cut // part.block, k))
    return _rows(part, cut, k)


def _rows(a, first, k):
    """The first `first` elements of `a` (row-major) in `k` rows: no slice where that is all."""
    flat = a.reshape(-1)
    return (flat if first == flat.shape[0] else flat[:first]).reshape(k, -1)


def _tail(part, cut):
    """The share of `part` of the elements from `cut` on."""
    if isinstance(part, Quantised):
        codes = cut // 2 if part.bits == 4 else cut
        return (part.codes.reshape(-1)[codes:], part.scale[cut // part.block :])
    return part.reshape(-1)[cut:]


def _rebuilt(part, arrays, size):
    """`part` for a piece of `size` elements, from its share `arrays`."""
    if isinstance(part, Quantised):
        codes, scale = arrays
        return Quantised(codes, scale, part.signed, part.bits, part.block, (size,))
    return arrays


def _joined(head, tail, old, shape, sized):
    """A new state part from the pieces' (stacked along a leading axis) and the rest's, in the
    old part's layout; a part stepped whole is the same in every piece."""
    if not sized:
        return head[0] if isinstance(head, jax.Array) else head
    if isinstance(old, Quantised):
        rest = (None, None) if tail is None else (tail.codes, tail.scale)
        return Quantised(
            _flat_join(head.codes, rest[0]).reshape(old.codes.shape),
            _flat_join(head.scale, rest[1]).reshape(old.scale.shape),
            old.signed,
            old.bits,
            old.block,
            old.shape,
        )
    return _flat_join(head, tail).reshape(shape)


def _flat_join(head, tail=None):
    """The pieces' rows (and the rest's 1-D array) as one 1-D array: no copy without a rest."""
    return head.reshape(-1) if tail is None else jnp.concatenate([head.reshape(-1), tail])
