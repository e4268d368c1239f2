"""NumPy's one check of a step's arrays (`snapshot`, `unchanged`): everything the kernels rely on
in the parameters and their gradients, each change caught, read in compiled passes over NumPy's
headers (numba, its byte offsets checked with ctypes first) and from NumPy's public attributes."""

from __future__ import annotations

import types

import numpy as np
import pytest

import optimisers.backends.numpy as numpy_backend
from optimisers.backends import numpy_kernels

snapshot, unchanged = numpy_backend.snapshot, numpy_backend.unchanged


@pytest.fixture(params=["compiled", "public"])
def reading(request, monkeypatch):
    if request.param == "compiled" and not numpy_kernels.reads_headers():
        pytest.skip("numba does not read NumPy's headers here")
    if request.param == "public":
        monkeypatch.setattr(numpy_kernels, "reads_headers", lambda: False)
    return request.param


def _token_kind(token):
    return "compiled" if isinstance(token, numpy_kernels.Snapshot) else "public"


def _model():
    """Parameters of every kind of layout the engine steps, each its own memory, or views of one
    buffer; gradients laid out as their parameters."""
    flat = np.arange(64, dtype=np.float32)
    xs = [
        np.ones((4, 6), np.float32),
        np.asfortranarray(np.ones((5, 3), np.float32)),
        flat[:16],
        flat[16:40].reshape(4, 6),
        np.ones((1, 2, 1, 2, 3, 2), np.float32),  # more dimensions than a header row of `read_headers`
        np.zeros(7, np.float64),
    ]
    return xs, flat


def _grads(xs):
    return [np.full_like(x, 0.5) for x in xs]  # (empty_like keeps a Fortran order)


def test_the_same_arrays_and_new_gradients_laid_out_alike_are_unchanged(reading):
    xs, _ = _model()
    gs = _grads(xs)
    token = snapshot(xs, gs)
    assert _token_kind(token) == reading
    assert unchanged(token, xs, gs)
    assert unchanged(token, list(xs), _grads(xs))  # new lists, new gradients: the usual step
    assert unchanged(token, tuple(xs), tuple(_grads(xs)))
    # a gradient whose bytes end where a parameter's begin (views of one buffer) shares none
    memory = np.zeros(64, np.float32)
    x, g = memory[16:32], memory[:16]
    assert unchanged(snapshot([x], [g]), [x], [g])


def _change(kind, xs, gs, flat):
    """Make one change of `kind` to the model: the lists a later step passes."""
    xs, gs = list(xs), list(gs)
    if kind == "parameter replaced by an equal copy":
        xs[0] = xs[0].copy()
    elif kind == "parameter's memory replaced (__setstate__)":
        xs[2].__setstate__(xs[2].__reduce__()[2])  # a view of `flat`: now its own new memory
    elif kind == "parameter reshaped in place":
        xs[0].shape = (6, 4)
    elif kind == "parameter's dtype set in place":
        xs[0].dtype = np.int32
    elif kind == "parameter made read-only":
        xs[3].flags.writeable = False
    elif kind == "transposed view swapped in":
        xs[0] = xs[0].T
    elif kind == "reshaped view swapped in":
        xs[2] = xs[2].reshape(4, 4)
    elif kind == "gradient overlapping a parameter (frombuffer)":
        memory = bytearray(256)
        first = np.frombuffer(memory, np.float32, 16, 0)
        xs[2] = first
        gs[2] = np.frombuffer(memory, np.float32, 16, 60)  # from first's last element on
        return xs, gs, [xs[2]]
    elif kind == "gradient is a parameter":
        gs[5] = xs[5]
    elif kind == "gradient is a view of a parameter":
        gs[2] = flat[20:36]  # inside xs[3]'s bytes
    elif kind == "gradient of another dtype":
        gs[5] = gs[5].astype(np.float32)
    elif kind == "gradient byte-swapped":
        gs[0] = gs[0].astype(gs[0].dtype.newbyteorder())
    elif kind == "gradient of other strides":
        gs[1] = np.ascontiguousarray(gs[1])  # C order where its parameter is Fortran
    elif kind == "gradient transposed":
        gs[0] = np.ones((6, 4), np.float32).T
    elif kind == "gradient of another shape":
        gs[2] = np.ones((4, 4), np.float32)
    elif kind == "gradient strided":
        gs[2] = np.ones(32, np.float32)[::2]
    elif kind == "gradient not aligned":
        gs[2] = np.frombuffer(bytearray(80), np.float32, 16, 2)
    elif kind == "gradient of a subclass":
        gs[2] = gs[2].view(np.memmap)
    elif kind == "gradient missing":
        gs[2] = None
    elif kind == "one gradient fewer":
        gs.pop()
    elif kind == "one parameter more":
        xs.append(np.ones(3, np.float32))
    else:
        raise AssertionError(kind)
    return xs, gs, None


CHANGES = [
    "parameter replaced by an equal copy", "parameter's memory replaced (__setstate__)",
    "parameter reshaped in place", "parameter's dtype set in place", "parameter made read-only",
    "transposed view swapped in", "reshaped view swapped in",
    "gradient overlapping a parameter (frombuffer)", "gradient is a parameter",
    "gradient is a view of a parameter", "gradient of another dtype", "gradient byte-swapped",
    "gradient of other strides", "gradient transposed", "gradient of another shape", "gradient strided",
    "gradient not aligned", "gradient of a subclass", "gradient missing", "one gradient fewer",
    "one parameter more",
]


@pytest.mark.parametrize("kind", CHANGES)
def test_each_change_the_kernels_would_see_is_caught(kind, reading):
    xs, flat = _model()
    gs = _grads(xs)
    token = snapshot(xs, gs)
    assert unchanged(token, xs, gs)
    new_xs, new_gs, swapped = _change(kind, xs, gs, flat)
    if swapped is not None:  # a parameter of a frombuffer buffer: snapshot it as it is
        base_gs = _grads(new_xs)
        token = snapshot(new_xs, base_gs)
        assert unchanged(token, new_xs, base_gs)
    assert not unchanged(token, new_xs, new_gs)


def test_a_change_undone_is_unchanged_again(reading):
    xs, _ = _model()
    gs = _grads(xs)
    token = snapshot(xs, gs)
    xs[3].flags.writeable = False
    assert not unchanged(token, xs, gs)
    xs[3].flags.writeable = True
    xs[0].shape = (24,)
    assert not unchanged(token, xs, gs)
    xs[0].shape = (4, 6)
    assert unchanged(token, xs, gs)


def test_a_snapshot_keeps_its_parameters(reading):
    """Identity is compared by address: the token keeps the parameters alive, so that a new
    array cannot take an old one's address."""
    xs, _ = _model()
    token = snapshot(xs, _grads(xs))
    ids = list(map(id, xs))
    del xs
    others = [np.ones(3) for _ in range(200)]
    assert not any(id(o) in ids for o in others)
    assert not unchanged(token, others[: len(ids)], _grads(others[: len(ids)]))


@pytest.mark.parametrize("kind", ["parameters overlap", "read-only parameter", "not an ndarray",
                                  "gradient strides not aligned"])
def test_no_snapshot_of_what_cannot_be_stepped_in_place(kind, reading):
    xs, flat = _model()
    gs = _grads(xs)
    if kind == "parameters overlap":
        xs[3] = flat[10:34].reshape(4, 6)  # shares bytes with xs[2] (flat[:16])
    elif kind == "read-only parameter":
        xs[0].flags.writeable = False
    elif kind == "not an ndarray":
        gs[1] = [0.5] * 15
    else:
        gs[2] = np.lib.stride_tricks.as_strided(np.zeros(64, np.float32), (16,), (2,))  # 2 bytes apart
    assert snapshot(xs, gs) is None
    assert not unchanged(None, xs, gs)


def test_both_ways_of_reading_agree(monkeypatch):
    """The compiled and public tokens give the same answer on random changes."""
    if not numpy_kernels.reads_headers():
        pytest.skip("numba does not read NumPy's headers here")
    for kind in CHANGES:
        answers = []
        for public in (False, True):
            with monkeypatch.context() as m:
                if public:
                    m.setattr(numpy_kernels, "reads_headers", lambda: False)
                xs, flat = _model()
                gs = _grads(xs)
                token = snapshot(xs, gs)
                new_xs, new_gs, swapped = _change(kind, xs, gs, flat)
                if swapped is not None:
                    token = snapshot(new_xs, _grads(new_xs))
                answers.append(unchanged(token, new_xs, new_gs))
        assert answers == [False, False], kind


def test_offsets_are_checked_with_ctypes_before_any_compiled_read():
    """`_offsets_agree` reads the objects with ctypes only (the module it is given has no
    compiled readers), and a field at another place than NumPy's struct has it is refused."""
    if not numpy_kernels.AVAILABLE:
        pytest.skip("numba is not installed")
    from optimisers.backends import readers_numba

    names = ["_DATA", "_ND", "_DIMS", "_STRIDES", "_BASE", "_DESCR", "_FLAGS", "_LENGTH", "_ITEMS", "_TYPE"]
    offsets = {name: getattr(readers_numba, name) for name in [*names, "_INT"]}
    assert numpy_kernels._offsets_agree(types.SimpleNamespace(**offsets))
    for name in names:
        for wrong in range(0, 96, 8):
            if wrong != offsets[name]:
                fields = types.SimpleNamespace(**{**offsets, name: wrong})
                assert not numpy_kernels._offsets_agree(fields), (name, wrong)
