"""The tree walk: every container kind, __trainable__, registration, non-parameters untouched."""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
import pytest

import optimisers as opt

Pair = namedtuple("Pair", ["left", "right"])


@dataclass(frozen=True)
class Frozen:
    w: object
    b: object
    name: str = "layer"


@dataclass
class WithHidden:
    w: object
    cache: list = field(default_factory=list)

    def __post_init__(self):
        self.calls = 0  # not a field: must survive rebuilding


class Registered:
    def __init__(self, w, scale):
        self.w = w
        self.scale = scale


opt.register(Registered, ("w",))


class Partial:
    __trainable__ = ("w",)

    def __init__(self, w, fixed):
        self.w = w
        self.fixed = fixed


opt.register(Partial, ("w", "fixed"))


def arr(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


@pytest.mark.parametrize("inplace", [False, True])
def test_every_container_kind_round_trips(inplace):
    model = {
        "ordered": OrderedDict([("z", arr(2)), ("a", arr(3))]),
        "proxy": MappingProxyType({"p": arr(2)}),
        "tuple": (arr(2), 5),
        "pair": Pair(arr(2), arr(1)),
        "frozen": Frozen(arr(2, 2), arr(2)),
        "hidden": WithHidden(arr(3)),
        "reg": Registered(arr(2), 3.0),
        "ints": np.arange(4),
        "none": None,
        "fn": len,
    }
    grads = {
        "ordered": {"z": np.ones(2), "a": np.ones(3)},
        "proxy": {"p": np.ones(2)},
        "tuple": (np.ones(2), None),
        "pair": Pair(np.ones(2), np.ones(1)),
        "frozen": {"w": np.ones((2, 2)), "b": np.ones(2)},
        "hidden": WithHidden(np.ones(3)),
        "reg": {"w": np.ones(2)},
    }
    originals = [x.copy() for x in opt.trainables(model)]
    state = opt.setup(opt.Descent(0.5), model)
    step = opt.update_ if inplace else opt.update
    _, new = step(state, model, grads)
    assert list(new["ordered"]) == ["z", "a"] and type(new["ordered"]) is OrderedDict
    assert type(new["proxy"]) is MappingProxyType
    assert type(new["pair"]) is Pair and type(new["frozen"]) is Frozen
    assert new["frozen"].name == "layer" and new["tuple"][1] == 5
    assert new["hidden"].calls == 0 and new["hidden"].cache is model["hidden"].cache
    assert new["reg"].scale == 3.0 and isinstance(new["reg"], Registered)
    for k in ("ints", "none", "fn"):
        assert new[k] is model[k]
    for before, after in zip(originals, opt.trainables(new)):
        np.testing.assert_allclose(after, before - 0.5)
    if not inplace:
        for before, now in zip(originals, opt.trainables(model)):
            np.testing.assert_array_equal(before, now)


def test_trainable_restricts_children():
    model = Partial(arr(3), arr(3, seed=1))
    state = opt.setup(opt.Descent(1.0), model)
    assert state.keys() == ["w"]
    assert len(opt.trainables(model)) == 1
    _, new = opt.update(state, model, {"w": np.ones(3), "fixed": np.ones(3)})
    assert new.fixed is model.fixed
    np.testing.assert_allclose(new.w, model.w - 1)


def test_non_float_arrays_and_scalars_are_not_parameters():
    model = {"i": np.arange(3), "b": np.array([True]), "x": 1.5, "f": np.float32(2.0), "s": "a"}
    state = opt.setup(opt.Adam(), model)
    assert state.keys() == []
    _, new = opt.update(state, model, {"i": None})
    assert all(new[k] is model[k] for k in model)


def test_trainables_paths_depth_first_ties_once():
    W = arr(2)
    model = {"a": [W, arr(1)], "b": {"c": W, "d": arr(3)}}
    found = opt.trainables(model, path=True)
    assert [p for p, _ in found] == [("a", 0), ("a", 1), ("b", "d")]
    assert found[0][1] is W


def test_destructure_round_trip_keeps_ties_and_dtypes():
    W = arr(2, 3).astype(np.float32)
    model = {"a": W, "b": {"w": W, "v": arr(4)}, "n": 7}
    flat, rebuild = opt.destructure(model)
    assert flat.shape == (10,) and flat.dtype == np.float64
    np.testing.assert_array_equal(flat[:6], W.ravel())
    new = rebuild(flat * 2)
    assert new["a"] is new["b"]["w"] and new["a"].dtype == np.float32
    np.testing.assert_allclose(new["b"]["v"], model["b"]["v"] * 2)
    assert new["n"] == 7
    with pytest.raises(ValueError, match="length 10"):
        rebuild(flat[:-1])


def test_state_navigation_and_repr():
    W = arr(3, 3)
    model = {"encoder": [W, arr(3)], "decoder": W}
    state = opt.setup(opt.Adam(), model)
    assert isinstance(state["encoder"], opt.State)
    assert isinstance(state["encoder"][0], opt.Leaf)
    text = repr(state)
    assert "tied to encoder.0" in text and "float64[3, 3]" in text
    with pytest.raises(KeyError, match="encoder"):
        state["missing"]


def test_register_rejects_bad_arguments():
    with pytest.raises(TypeError):
        opt.register(Registered(np.ones(1), 1.0))  # an instance, not a class
    with pytest.raises(TypeError):
        opt.register(Registered)
