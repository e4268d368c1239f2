"""Gradients that share memory with parameters, found by address ranges whatever owns the memory:
NumPy arrays made by separate `np.frombuffer` calls over one buffer (or from a raw pointer) have
no `.base` in common, yet `update_` must give `update`'s numbers on copies, bit for bit."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import optimisers as opt
import optimisers.backends.numpy as numpy_backend
from optimisers.backends import numpy_kernels
from optimisers.backends.ranges import ByteRanges

try:  # NumPy >= 2
    from numpy.lib.array_utils import byte_bounds
except ImportError:  # pragma: no cover - NumPy 1.x
    byte_bounds = np.byte_bounds


def _overlapping(xs, gs) -> list:
    """The gradients `gs` whose bytes meet a parameter's, as a step finds them (byte ranges)."""
    if not gs:
        return []
    found = ByteRanges(*numpy_backend._spans(xs)).reached(*numpy_backend._spans(gs))
    return np.flatnonzero(found).tolist()


@pytest.fixture(params=["compiled", "public"])
def reading(request, monkeypatch):
    """Address ranges read in compiled passes over the headers (numba), and from NumPy's public
    attributes."""
    if request.param == "compiled" and not numpy_kernels.reads_headers():
        pytest.skip("numba does not read NumPy's headers here")
    if request.param == "public":
        monkeypatch.setattr(numpy_kernels, "_reader", lambda: None)
    return request.param


RULES = {"adam": lambda: opt.Adam(0.1), "adamw": lambda: opt.AdamW(0.1, lambd=0.1),
         "momentum": lambda: opt.Momentum(0.1), "descent": lambda: opt.Descent(0.1)}


def _crossed(n, dtype=np.float32):
    """Parameters `a`, `b` over one bytearray, and their gradients as the gradient of a·b: the
    other's memory, each a separate `np.frombuffer` of the same buffer."""
    size = np.dtype(dtype).itemsize
    memory = bytearray(2 * n * size)
    a = np.frombuffer(memory, dtype, n, 0)
    b = np.frombuffer(memory, dtype, n, n * size)
    rng = np.random.default_rng(0)
    a[:], b[:] = rng.standard_normal(n), rng.standard_normal(n)

    def grads():
        return {"a": np.frombuffer(memory, dtype, n, n * size), "b": np.frombuffer(memory, dtype, n, 0)}

    return {"a": a, "b": b}, grads


SIZES = {"packed": 8, "small": 1000, "kernel-sized": 4 * numpy_kernels.PARALLEL_FROM}


@pytest.mark.parametrize("n", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("rule", list(RULES))
def test_crossed_frombuffer_views_step_as_copies(rule, n):
    model, grads = _crossed(n)
    reference = {k: v.copy() for k, v in model.items()}
    state, ref_state = opt.setup(RULES[rule](), model), opt.setup(RULES[rule](), reference)
    for _ in range(4):  # (the first step, then replays of its route)
        given = grads()
        state, model = opt.update_(state, model, given)
        ref_state, reference = opt.update(ref_state, reference, {"a": reference["b"].copy(),
                                                                 "b": reference["a"].copy()})
        for k in "ab":
            np.testing.assert_array_equal(model[k], reference[k])
    # stepped in place, in the bytearray
    assert np.shares_memory(model["a"], model["b"]) is False and model["a"].base is not None


def _raw(address, n, dtype=np.float32):
    """An array over `n` elements at `address`: no object links it to whatever owns that memory."""
    pointer = ctypes.cast(address, ctypes.POINTER(np.ctypeslib.as_ctypes_type(dtype)))
    return np.ctypeslib.as_array(pointer, (n,))


def test_overlapping_finds_shared_bytes_through_any_buffer(reading):
    memory = bytearray(400)
    x = np.frombuffer(memory, np.float32, 20, 0)  # bytes 0..80
    y = np.frombuffer(memory, np.float32, 20, 200)  # bytes 200..280
    held = np.zeros(10)
    candidates = [
        np.frombuffer(memory, np.float32, 20, 40),  # 0: half in x
        np.frombuffer(memory, np.float32, 10, 80),  # bytes 80..120: right after x
        np.frombuffer(memory, np.float32, 30, 160),  # 2: into y from below
        np.frombuffer(memory, np.float32, 100, 0)[::-1][20:40],  # 3: reversed, ends at x's last bytes
        _raw(x.ctypes.data + 76, 1),  # 4: x's last element, from a raw pointer
        _raw(held.ctypes.data, 10, np.float64),  # another array's memory: not a parameter's
        np.frombuffer(memory, np.float32, 0, 40),  # no elements, inside x
        np.frombuffer(memory, np.float32, 30, 280),  # from y's end on
        np.frombuffer(memory, np.uint8, 1, 279),  # 8: y's last byte
        np.frombuffer(memory, np.float32, 5, 100)[::2],  # between them
    ]
    assert _overlapping([x, y, held[:0]], candidates) == [0, 2, 3, 4, 8]
    assert _overlapping([], candidates) == []
    assert _overlapping([x, y], []) == []


def test_overlapping_is_byte_ranges_intersecting(reading):
    """Random views of one buffer (offsets, shapes, strides of either sign, dtypes): a gradient
    overlaps exactly where its byte range meets some parameter's."""
    rng = np.random.default_rng(5)
    memory = bytearray(4096)

    def view():
        dtype = np.dtype(rng.choice(["f4", "f8", "u1", "f2"]))
        flat = np.frombuffer(memory, dtype, count=4096 // dtype.itemsize)
        start = int(rng.integers(0, len(flat) - 64))
        step = int(rng.choice([1, 2, 3, -1, -2]))
        count = int(rng.integers(0, 20))
        if step < 0:
            start += 63
        v = flat[start : start + step * count : step] if count else flat[start:start]
        return v.reshape(-1, 1) if count % 2 else v

    def hits(g, xs):
        if g.size == 0:
            return False
        g0, g1 = byte_bounds(g)
        return any(x.size and byte_bounds(x)[0] < g1 and g0 < byte_bounds(x)[1] for x in xs)

    for _ in range(200):
        xs = [view() for _ in range(int(rng.integers(1, 6)))]
        gs = [view() for _ in range(int(rng.integers(1, 6)))]
        assert _overlapping(xs, gs) == [i for i, g in enumerate(gs) if hits(g, xs)]


def test_subclasses_are_read_by_numpys_attributes():
    memory = bytearray(80)

    class Sub(np.ndarray):
        pass

    x = np.frombuffer(memory, np.float32, 10, 0)
    g = np.frombuffer(memory, np.float32, 5, 20).view(Sub)
    assert _overlapping([x], [g, np.zeros(3)]) == [0]
