"""`LowBit` under `jit` on one CPU device steps a large array piece by piece
(`optimisers.backends.jax_pieces`): the same bits as the whole-array step, and NumPy's step as
that one follows it, every format, with a step counter, a schedule, and shapes that leave a rest
after the last whole piece (a short last block too)."""

from __future__ import annotations

import numpy as np
import pytest

import optimisers as opt

jax = pytest.importorskip("jax")
jnp = jax.numpy
from optimisers.backends import jax as jax_backend  # noqa: E402
from optimisers.backends import jax_pieces  # noqa: E402

SHAPE = (1024, 640)  # 655,360 elements: two pieces of 262,144 and a rest of 131,072
UNEVEN = (1031, 257)  # 264,967 elements: one piece, then a rest whose last block is short


def data(shape, steps, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    scales = np.exp(rng.uniform(-6, 1, steps))
    grads = [(rng.standard_normal(shape) * s).astype(np.float32) for s in scales]
    return x, grads


def jitted_run(rule, x0, grads):
    x = jnp.asarray(x0)
    state = opt.setup(rule, x)
    step = jax.jit(lambda s, x, g: opt.update(s, x, g))  # a new function: a new compile
    for g in grads:
        state, x = step(state, x, jnp.asarray(g))
    return state, x


def leaves(state, x):
    return [np.asarray(a) for a in jax.tree_util.tree_leaves((state, x))]


def pieces_taken(monkeypatch):
    taken = []
    original = jax_pieces.step_in_pieces

    def spy(*args):
        found = original(*args)
        taken.append(found is not None)
        return found

    monkeypatch.setattr(jax_backend, "step_in_pieces", spy)
    return taken


RULES = [
    opt.AdamW(1e-2, lambd=0.01),
    opt.Lion(1e-3),
    opt.Momentum(0.01, 0.9),
    opt.Adam(opt.schedules.Cosine(1e-2, 10)),
]


@pytest.mark.parametrize("shape", [SHAPE, UNEVEN], ids=["even", "uneven"])
@pytest.mark.parametrize("bits", [8, 4, "fp8"])
@pytest.mark.parametrize("inner", RULES, ids=lambda r: type(r).__name__)
def test_pieces_give_the_whole_steps_numbers(monkeypatch, bits, inner, shape):
    """The same maths per element. XLA may contract a multiply and an add into one rounding in
    one program and not in the other (seen on the uneven shape: scales a unit in the last place
    apart), so values agree to float32 rounding and codes but for the rare one that moves; on
    the even shape they have been equal bit for bit."""
    rule = opt.LowBit(inner, bits=bits)
    x0, grads = data(shape, 3)
    taken = pieces_taken(monkeypatch)
    in_pieces = leaves(*jitted_run(rule, x0, grads))
    assert taken and all(taken)
    monkeypatch.setattr(jax_pieces, "PIECE", 1 << 30)  # one piece: the whole-array step
    taken.clear()
    whole = leaves(*jitted_run(rule, x0, grads))
    assert taken and not any(taken)
    assert len(in_pieces) == len(whole)
    for a, b in zip(in_pieces, whole):
        assert a.shape == b.shape and a.dtype == b.dtype
        if a.dtype == np.uint8:  # codes
            assert np.mean(a == b) > 0.999
        else:  # (a code that moved moves its element's next steps a little)
            assert np.mean(np.isclose(a, b, rtol=1e-6, atol=0)) > 0.999
            assert np.abs(a - b).max() <= 1e-3 * np.abs(b).max()


@pytest.mark.parametrize("bits", [8, "fp8"])
def test_pieces_follow_numpys_step(monkeypatch, bits):
    """As the whole-array JAX step does (tests/test_low_bit.py): XLA rounds some operations
    differently from NumPy, which moves a few codes by one."""
    rule = opt.LowBit(opt.AdamW(1e-2, lambd=0.01), bits=bits)
    x0, grads = data(SHAPE, 3, seed=1)
    taken = pieces_taken(monkeypatch)
    state, x = jitted_run(rule, x0, grads)
    assert all(taken)
    expected = x0.copy()
    theirs = opt.setup(rule, expected)
    for g in grads:
        theirs, expected = opt.update(theirs, expected, g)
    moved = np.abs(expected - x0).max()
    apart = np.abs(np.asarray(x) - expected)
    assert np.mean(apart <= 1e-5 * moved) > 0.9999 and apart.max() <= 1e-2 * moved  # (a code moved)
    for ours, numpys in zip(state.tree.state[:2], theirs.tree.state[:2]):
        assert np.mean(np.asarray(ours.codes) == numpys.codes) > 0.9999
        np.testing.assert_allclose(np.asarray(ours.scale), numpys.scale, rtol=1e-4)


def test_arrays_of_a_piece_or_less_step_whole(monkeypatch):
    taken = pieces_taken(monkeypatch)
    x0, grads = data((512, 512), 1)  # 262,144 elements: one piece's worth
    jitted_run(opt.LowBit(opt.AdamW(), bits=8), x0, grads)
    assert taken == [False]


def test_a_model_of_several_arrays_sharing_a_step_count(monkeypatch):
    """Leafs of one rule share their step scalars within an update; those computed inside a
    piece's loop must not leak to the next Leaf (it raised JAX's UnexpectedTracerError)."""
    rule = opt.LowBit(opt.AdamW(1e-2, lambd=0.01), bits=8)
    rng = np.random.default_rng(3)
    shapes = {"a": SHAPE, "b": UNEVEN, "c": (64,), "d": SHAPE}
    model = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}
    grads = [{k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()} for _ in "ab"]

    def run():
        state, params = opt.setup(rule, model), model
        step = jax.jit(lambda s, p, g: opt.update(s, p, g))
        for g in grads:
            state, params = step(state, params, g)
        return params

    taken = pieces_taken(monkeypatch)
    in_pieces = run()
    assert sum(taken) == 3
    monkeypatch.setattr(jax_pieces, "PIECE", 1 << 30)
    whole = run()
    for k in shapes:
        a, b = np.asarray(in_pieces[k]), np.asarray(whole[k])
        assert np.mean(np.isclose(a, b, rtol=1e-6, atol=0)) > 0.999


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_parameters_step_in_pieces_as_whole(monkeypatch, dtype):
    rule = opt.LowBit(opt.AdamW(1e-2, lambd=0.01), bits=8)
    x0, grads = data(SHAPE, 2, seed=4)

    def run():
        x = jnp.asarray(x0, dtype)
        state = opt.setup(rule, x)
        step = jax.jit(lambda s, x, g: opt.update(s, x, g))
        for g in grads:
            state, x = step(state, x, jnp.asarray(g, dtype))
        return state, x

    taken = pieces_taken(monkeypatch)
    state, x = run()
    assert all(taken) and x.dtype == jnp.dtype(dtype)
    monkeypatch.setattr(jax_pieces, "PIECE", 1 << 30)
    whole_state, whole = run()
    a, b = np.asarray(x, np.float32), np.asarray(whole, np.float32)
    assert np.mean(a == b) > 0.999  # (a code that moved can move a half-precision rounding)
    for ours, theirs in zip(state.tree.state[:2], whole_state.tree.state[:2]):
        assert np.mean(np.asarray(ours.codes) == np.asarray(theirs.codes)) > 0.999
