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
import optimisers.engine.layout as engine_layout

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
    return model, frozen, rule, missing


def _grads(model, step, missing):
    """Gradients shaped as the model; those at positions in `missing` left out at odd steps."""
    rng = np.random.default_rng(step)
    out, k = {}, 0
    for key, xs in model.items():
        out[key] = []
        for x in xs:
            g = rng.standard_normal(x.shape).astype(x.dtype)
            out[key].append(None if (k in missing and step % 2) else g)
            k += 1
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(models())
def test_in_place_engine_equals_pure_path(drawn):
    model, frozen, rule, missing = drawn
    originals = {key: list(xs) for key, xs in model.items()}
    reference = copy.deepcopy(model)  # one copy of an array at several places: ties kept
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_layout, "CHUNK_SCALE", 1024)  # packed runs and split arrays
        state = opt.setup(RULES[rule](), model)
        ref_state = opt.setup(RULES[rule](), reference)
        for key in frozen:
            opt.freeze_(state[key])
            opt.freeze_(ref_state[key])
        for step in range(4):
            state, model = opt.update_(state, model, _grads(model, step, missing))
            ref_state, reference = opt.update(ref_state, reference, _grads(reference, step, missing))
            for key in model:
                for x, y in zip(model[key], reference[key], strict=True):
                    assert x.dtype == y.dtype
                    np.testing.assert_array_equal(x, y)
    # every place still holds the array it held (stepped in place), so the ties hold
    for key, xs in originals.items():
        assert all(model[key][i] is x for i, x in enumerate(xs))
