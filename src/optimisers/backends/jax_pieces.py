"""A quantised elementwise step under `jit` on one CPU device, run piece by piece.

A blockwise-quantised state needs each block's new absmax before any of its codes, so XLA keeps
the whole new moments in temporary buffers between the two. On the CPU those are allocated
afresh on every call, and the first touch of their pages costs as much as the step itself (a 4M
array's 8-bit AdamW step: about 27 ms, of which 13 are page faults; optax.adamw takes 4).
Stepping the array in pieces of whole blocks (`lax.map`) keeps the temporaries a piece long, in
cache and reused. The maths is the same per element, so the bits are too. Elsewhere (several
devices, where a piece would cut across shards; GPUs, where XLA fuses the whole step) the step
runs whole.
"""

from __future__ import annotations

import math

import jax
import numpy as np

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
    if not quantised or any(q.shape != tuple(x.shape) for q in quantised):
        return None
    k = _pieces(n, math.lcm(*(q.block * (2 if q.bits == 4 else 1) for q in quantised)))
    if k is None:
        return None
    split = [_split(p, x.shape, k) for p in parts]
    mapped = [i for i, s in enumerate(split) if s is not None]

    def one(pieces):
        xs, dxs, arrays = pieces
        given = dict(zip(mapped, arrays))
        inner = [_piece_of(parts[i], given[i]) if i in given else parts[i] for i in range(len(parts))]
        new_state, out = step(unflatten_state(spec, iter(inner)), xs, dxs)
        new_parts: list = []
        flatten_state(new_state, new_parts)  # (of `spec`'s structure: `step` checks it)
        return new_parts, out

    flat = (x.reshape(k, -1), dx.reshape(k, -1), [split[i] for i in mapped])
    new_parts, out = jax.lax.map(one, flat)
    whole = [_joined(p, parts[i], x.shape) for i, p in enumerate(new_parts)]
    return unflatten_state(spec, iter(whole)), jax.tree_util.tree_map(lambda a: a.reshape(x.shape), out)


def _pieces(n: int, unit: int):
    """How many pieces of whole units (`unit` elements) and at most about `PIECE` elements `n`
    splits into, or None (one piece, or no even split near that length)."""
    if n % unit or n <= PIECE:
        return None
    units = n // unit
    for k in range(-(-n // PIECE), min(units, 4 * -(-n // PIECE)) + 1):
        if units % k == 0:
            return k
    return None


def _split(part, shape, k):
    """The arrays of a state part cut into `k` pieces along a new leading axis (a `Quantised`:
    its codes and scales), or None for a part stepped whole (a step count)."""
    if isinstance(part, Quantised):
        return (part.codes.reshape(k, -1), part.scale.reshape(k, -1))
    if getattr(part, "shape", None) is not None and tuple(part.shape) == tuple(shape):
        return part.reshape(k, -1)
    return None


def _piece_of(part, arrays):
    if isinstance(part, Quantised):
        codes, scale = arrays
        size = scale.shape[0] * part.block
        return Quantised(codes, scale, part.signed, part.bits, part.block, (size,))
    return arrays


def _joined(new, old, shape):
    """A new state part from its pieces (stacked along the leading axis): arrays and Quantised
    back in the parameter's layout; parts stepped whole are the same in every piece."""
    if isinstance(old, Quantised):
        return Quantised(
            new.codes.reshape(old.codes.shape),
            new.scale.reshape(old.scale.shape),
            old.signed,
            old.bits,
            old.block,
            old.shape,
        )
    if getattr(old, "shape", None) is not None and tuple(old.shape) == tuple(shape):
        return new.reshape(shape)
    return new[0] if isinstance(new, (jax.Array, np.ndarray)) else new
