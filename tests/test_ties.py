"""Tied weights on NumPy: numbers and identity, pure and in place. A parameter reached at several
places is one parameter: its gradients are summed, it takes one step, and every place keeps holding
the same object (in place) or the same new object (pure)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

import optimisers as opt


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@dataclass
class MutTwo:
    x: object
    y: object


def adam_reference(x, grads, eta=0.01, b1=0.9, b2=0.999, eps=1e-8):
    """Adam written out in float64 on a single array, fed a list of gradients."""
    x = x.astype(np.float64)
    m = np.zeros_like(x)
    v = np.zeros_like(x)
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        x = x - eta * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    return x


@pytest.mark.parametrize("inplace", [False, True])
def test_tied_array_moves_once_by_summed_gradient(inplace):
    W = rand(5, 3)
    W0 = W.copy()
    model = {"embed": W, "mlp": [rand(3, 3, seed=1)], "unembed": W}
    state = opt.setup(opt.Adam(0.01), model)
    assert state["embed"] is state["unembed"]
    step = opt.update_ if inplace else opt.update
    g_in, g_out = [], []
    for i in range(5):
        gi, go = rand(5, 3, seed=10 + i), rand(5, 3, seed=20 + i)
        g_in.append(gi)
        g_out.append(go)
        grads = {"embed": gi, "mlp": [None], "unembed": go}
        state, model = step(state, model, grads)
        assert model["embed"] is model["unembed"]
        assert (model["embed"] is W) == inplace
    expected = adam_reference(W0, [a.astype(np.float64) + b for a, b in zip(g_in, g_out)])
    np.testing.assert_allclose(model["embed"], expected, rtol=1e-5, atol=1e-6)
    assert state["embed"].state[2] == 5  # one step per update, not one per place


def test_tied_equals_one_array_used_twice_in_the_loss():
    # loss(W, V) = sum((A @ W) * B) + sum(W @ V): W is used twice; dL/dW = A.T @ B + 1 @ V.T
    A, B, V = rand(4, 5, seed=1), rand(4, 3, seed=2), rand(3, 2, seed=3)
    W = rand(5, 3, seed=4)
    tied = {"first": W, "second": W, "V": V}
    state = opt.setup(opt.Adam(0.05), tied)
    single = {"W": W.copy(), "V": V.copy()}
    state1 = opt.setup(opt.Adam(0.05), single)
    for _ in range(20):
        w = tied["first"]
        g_first = A.T @ B
        g_second = np.ones((5, 2), np.float32) @ tied["V"].T
        g_V = w.T @ np.ones((5, 2), np.float32)
        state, tied = opt.update(state, tied, {"first": g_first, "second": g_second, "V": g_V})
        w1 = single["W"]
        g_W = A.T @ B + np.ones((5, 2), np.float32) @ single["V"].T
        g_V1 = w1.T @ np.ones((5, 2), np.float32)
        state1, single = opt.update(state1, single, {"W": g_W, "V": g_V1})
    assert tied["first"] is tied["second"]
    np.testing.assert_allclose(tied["first"], single["W"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(tied["V"], single["V"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("inplace", [False, True])
def test_evil_case_shared_container_versus_equal_container(inplace):
    tmp = MutTwo(np.array([1.0]), np.array([2.0]))
    model = {"a": tmp, "b": tmp, "c": MutTwo(tmp.x, tmp.y)}
    state = opt.setup(opt.Descent(0.1), model)
    assert state["a"]["x"] is state["c"]["x"]
    grads = {
        "a": MutTwo(np.array([1.0]), None),
        "b": {"x": np.array([2.0]), "y": np.array([3.0])},
        "c": None,
    }
    step = opt.update_ if inplace else opt.update
    _, new = step(state, model, grads)
    assert new["a"] is new["b"]
    assert new["a"] is not new["c"]
    assert new["a"].x is new["c"].x and new["a"].y is new["c"].y
    np.testing.assert_allclose(new["a"].x, [1.0 - 0.1 * 3.0])
    np.testing.assert_allclose(new["a"].y, [2.0 - 0.1 * 3.0])
    if inplace:
        assert new["a"] is tmp and new["a"].x is tmp.x
    else:
        assert new["a"] is not tmp and tmp.x[0] == 1.0 and tmp.y[0] == 2.0


@pytest.mark.parametrize("inplace", [False, True])
def test_none_gradient_at_one_tied_place(inplace):
    W = rand(3, 3)
    model = [W, W]
    state = opt.setup(opt.Descent(0.5), model)
    g = rand(3, 3, seed=5)
    step = opt.update_ if inplace else opt.update
    _, new = step(state, model, [None, g])
    assert new[0] is new[1]
    np.testing.assert_allclose(new[0], rand(3, 3) - 0.5 * g, rtol=1e-6)


def test_leaf_receiving_no_gradient_is_skipped_not_zeroed():
    model = {"a": rand(3), "b": rand(3, seed=1)}
    state = opt.setup(opt.Adam(), model)
    state, model2 = opt.update(state, model, {"a": rand(3, seed=2), "b": None})
    assert state["a"].state[2] == 1
    assert state["b"].state[2] == 0  # state not advanced
    np.testing.assert_array_equal(model2["b"], model["b"])
    assert model2["b"] is not model["b"]  # pure update: every trainable array is new


@pytest.mark.parametrize("inplace", [False, True])
def test_artificial_tie_by_placing_one_leaf_twice(inplace):
    model = {"a": rand(4), "b": rand(4, seed=1)}
    state = opt.setup(opt.Descent(0.1), model)
    state["b"] = state["a"]
    ga, gb = rand(4, seed=2), rand(4, seed=3)
    step = opt.update_ if inplace else opt.update
    a0 = model["a"].copy()
    state2, new = step(state, model, {"a": ga, "b": gb})
    # both places get the value computed once from the first place and the summed gradient
    np.testing.assert_allclose(new["a"], a0 - 0.1 * (ga + gb), rtol=1e-6)
    np.testing.assert_array_equal(new["a"], new["b"])
    assert state2["a"] is state2["b"]
    if not inplace:
        assert new["a"] is new["b"]


def test_a_tie_made_by_hand_survives_adjust_before_its_first_update():
    model = {"a": rand(4), "b": rand(4, seed=1)}  # different values: the tie makes them equal
    state = opt.setup(opt.Descent(0.1), model)
    state["b"] = state["a"]
    state = opt.adjust(state, 0.5)
    _, new = opt.update(state, model, {"a": rand(4, seed=2)})
    assert new["a"] is new["b"]


def test_equal_copies_at_tied_places_are_updated_as_one():
    # after setup the State says what is tied, so equal copies at tied places all get the new value
    W = rand(3)
    state = opt.setup(opt.Descent(0.1), {"a": W, "b": W})
    copies = {"a": W.copy(), "b": W.copy()}
    g = rand(3, seed=1)
    _, new = opt.update_(state, copies, {"a": g, "b": g})
    np.testing.assert_allclose(new["a"], W - 0.2 * g, rtol=1e-6)
    np.testing.assert_array_equal(new["a"], new["b"])
    assert new["a"] is copies["a"] and new["b"] is copies["b"]


def test_overlapping_views_rejected_with_both_paths():
    W = rand(4, 3)
    with pytest.raises(ValueError, match=r"enc\.w.*dec\.w|dec\.w.*enc\.w"):
        opt.setup(opt.Adam(), {"enc": {"w": W}, "dec": {"w": W.T}})
    with pytest.raises(ValueError, match="same memory"):
        opt.setup(opt.Adam(), [W, W[1:]])


def test_disjoint_views_and_readonly_views_are_fine():
    W = rand(4, 3)
    opt.setup(opt.Adam(), [W[:2], W[2:]])  # same buffer, no overlap
    ro = W.T.view()
    ro.flags.writeable = False
    opt.setup(opt.Adam(), [W, ro])  # never written in place, so no danger


def test_rule_function_chooses_per_parameter_and_is_asked_at_every_place_of_a_tie():
    W = rand(3, 3)
    b = rand(3, seed=1)
    model = {"layer": {"w": W, "b": b}, "head": W}
    seen = []

    def choose(path, x):
        seen.append(path)
        return opt.Descent(0.0) if x.ndim == 1 else opt.Descent(0.1)

    state = opt.setup(choose, model)
    assert seen == [("layer", "w"), ("layer", "b"), ("head",)]
    assert state["layer"]["b"].rule == opt.Descent(0.0)
    assert state["head"] is state["layer"]["w"]


def test_pure_update_leaves_inputs_bitwise_unchanged_and_inplace_matches():
    W = rand(4, 4)
    model = {"a": W, "b": [W, rand(2, seed=1)], "n": 3, "s": "text", "i": np.arange(3)}
    state = opt.setup(opt.Adam(0.1), model)
    grads = {"a": rand(4, 4, seed=2), "b": [rand(4, 4, seed=3), rand(2, seed=4)]}
    snapshot = [x.copy() for x in (W, model["b"][1], *grads["a"], *grads["b"])]
    state_before = repr(state)
    s1, m1 = opt.update(state, model, grads)
    assert repr(state) == state_before
    assert state["a"].state[2] == 0
    for before, now in zip(snapshot, (W, model["b"][1], *grads["a"], *grads["b"])):
        np.testing.assert_array_equal(before, now)
    assert m1["n"] == 3 and m1["s"] is model["s"] and m1["i"] is model["i"]
    s2, m2 = opt.update_(state, model, grads)
    assert m2["a"] is W and m2["b"][0] is W
    np.testing.assert_array_equal(m1["a"], m2["a"])
    np.testing.assert_array_equal(m1["b"][1], m2["b"][1])
    for k in (0, 1):
        np.testing.assert_array_equal(s1["a"].state[k], s2["a"].state[k])
