"""Property: the in-place engine (flat group buffers, packed small arrays, the replayed route)
gives the numbers of the pure per-Leaf path bit for bit, on random trees with random ties, frozen
parts, missing gradients and mixed dtypes."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import optimisers as opt
import optimisers.engine.chunks as engine_chunks

RULES = [
    lambda: opt.Adam(1e-2),
    lambda: opt.AdamW(1e-2, lambd=0.1),
    lambda: opt.Momentum(1e-2, 0.9),
    lambda: opt.Descent(0.1),
    lambda: opt.OptimiserChain(opt.ClipNorm(1.0), opt.Adam(1e-2)),
    lambda: opt.Lion(1e-3),
]
DTYPES = [np.float32, np.float64, np.float16]
SHAPES = [(1,), (3,), (17,), (4, 5), (2, 3, 4), (300,), (40, 30)]


@st.composite
def models(draw):
    """`(model, frozen paths, rule index, steps)`: a dict of lists of arrays; some places hold an
    array that also sits at an earlier place (tied)."""
    n = draw(st.integers(2, 24))
    arrays: list = []
    places = []
    for _ in range(n):
        if arrays and draw(st.integers(0, 5)) == 0:
            places.append(draw(st.sampled_from(arrays)))  # a tie
            continue
        shape = draw(st.sampled_from(SHAPES))
        dtype = draw(st.sampled_from(DTYPES))
        seed = draw(st.integers(0, 2**16))
        x = np.random.default_rng(seed).standard_normal(shape).astype(dtype)
        if len(shape) == 2 and draw(st.booleans()):
            x = np.asfortranarray(x)
        arrays.append(x)
        places.append(x)
    width = draw(st.integers(1, 4))
    model = {f"part{k}": places[k::width] for k in range(width)}
    model = {k: v for k, v in model.items() if v}
    frozen = [k for k in model if draw(st.integers(0, 4)) == 0]
    rule = draw(st.integers(0, len(RULES) - 1))
    missing = draw(st.lists(st.integers(0, n - 1), max_size=3))
    if draw(st.booleans()):  # the row-major arrays as views of one flat buffer per dtype (spans)
        _into_flat_buffers(arrays, model)
    return model, frozen, rule, missing


def _into_flat_buffers(arrays, model):
    """Replace each C-contiguous array of `model` by a view of a flat buffer of its dtype, back to
    back in the order of `arrays` (ties stay ties)."""
    moved = [x for x in arrays if x.flags.c_contiguous]
    bases = {dt: np.empty(sum(x.size for x in moved if x.dtype == dt), dt) for dt in {x.dtype for x in moved}}
    at = dict.fromkeys(bases, 0)
    view_of = {}
    for x in moved:
        start = at[x.dtype]
        view = bases[x.dtype][start : start + x.size].reshape(x.shape)
        view[...] = x
        view_of[id(x)] = view
        at[x.dtype] = start + x.size
    for key, xs in model.items():
        model[key] = [view_of.get(id(x), x) for x in xs]


def _grads(model, step, missing, flat=None):
    """Gradients shaped as the model; those at positions in `missing` left out at odd steps.
    With `flat` (a dict kept between steps), each array's first gradient is a view of a flat
    buffer laid out as the parameters' (the same views every step, values written in place)."""
    rng = np.random.default_rng(step)
    out, k = {}, 0
    for key, xs in model.items():
        out[key] = []
        for x in xs:
            g = rng.standard_normal(x.shape).astype(x.dtype)
            if flat is not None and id(x) not in flat.setdefault("seen", set()):
                flat["seen"].add(id(x))
                view = flat.setdefault(id(x), _grad_view(x, flat))
                view[...] = g
                g = view
            out[key].append(None if (k in missing and step % 2) else g)
            k += 1
    flat is not None and flat.pop("seen")
    return out


def _grad_view(x, flat):
    """A view of the flat gradient buffer at `x`'s place in its flat parameter buffer, if it is
    a view of one; else a new array."""
    base = x.base if x.base is not None and x.flags.c_contiguous else None
    if base is None or base.ndim != 1:
        return np.empty_like(x)
    grads = flat.setdefault(("base", id(base)), (base, np.empty_like(base)))[1]
    start = (x.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // x.itemsize
    return grads[start : start + x.size].reshape(x.shape)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(models())
def test_in_place_engine_equals_pure_path(drawn):
    model, frozen, rule, missing = drawn
    originals = {key: list(xs) for key, xs in model.items()}
    reference = copy.deepcopy(model)  # one copy of an array at several places: ties kept
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_chunks, "CHUNK_SCALE", 1024)  # packed runs and split arrays
        state = opt.setup(RULES[rule](), model)
        ref_state = opt.setup(RULES[rule](), reference)
        for key in frozen:
            opt.freeze_(state[key])
            opt.freeze_(ref_state[key])
        flat_grads: dict = {}
        for step in range(4):
            state, model = opt.update_(state, model, _grads(model, step, missing, flat_grads))
            ref_state, reference = opt.update(ref_state, reference, _grads(reference, step, missing))
            for key in model:
                for x, y in zip(model[key], reference[key], strict=True):
                    assert x.dtype == y.dtype
                    np.testing.assert_array_equal(x, y)
    # every place still holds the array it held (stepped in place), so the ties hold
    for key, xs in originals.items():
        assert all(model[key][i] is x for i, x in enumerate(xs))
