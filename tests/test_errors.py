"""Bad input: clear errors naming the path in the model and what was expected; a failed call
changes nothing."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

import optimisers as opt


def model_and_state():
    model = {"enc": {"w": np.ones((2, 3)), "b": np.zeros(3)}, "layers": [np.ones(2), np.ones(4)]}
    return model, opt.setup(opt.Adam(0.1), model)


def snapshot(state, model):
    states = [leaf.state if isinstance(leaf.state, tuple) else () for leaf in state.leaves()]
    return (
        repr(state),
        [x.copy() for x in opt.trainables(model)],
        [[a.copy() if hasattr(a, "copy") else a for a in s] for s in states],
    )


def assert_unchanged(before, state, model):
    text, arrays, states = before
    assert repr(state) == text
    for a, b in zip(arrays, opt.trainables(model)):
        np.testing.assert_array_equal(a, b)
    for saved, leaf in zip(states, state.leaves()):
        for a, b in zip(saved, leaf.state or ()):
            np.testing.assert_array_equal(a, b)


GOOD = {"enc": {"w": np.ones((2, 3)), "b": np.ones(3)}, "layers": [np.ones(2), np.ones(4)]}

BAD_GRADS = [
    ({"enc": {"w": np.ones((2, 3)), "bias": np.ones(3)}}, ValueError, r"enc.*'bias'"),
    ({"layers": [np.ones(2)]}, ValueError, r"layers.*length 1.*2 entries"),
    ({"enc": np.ones(3)}, TypeError, r"at enc.*ndarray.*dict"),
    ({"layers": [np.ones(2), {"x": np.ones(4)}]}, TypeError, r"layers\.1.*dict.*shape \(4,\)"),
    ({"layers": [np.ones(2), np.ones(5)]}, ValueError, r"layers\.1 has shape \(5,\).*\(4,\)"),
    ({"enc": {"w": np.ones((3, 2))}}, ValueError, r"enc\.w has shape \(3, 2\)"),
    ("oops", TypeError, r"<model>"),
]


@pytest.mark.parametrize("grads, error, message", BAD_GRADS)
@pytest.mark.parametrize("inplace", [False, True])
def test_bad_gradient_names_path_and_changes_nothing(grads, error, message, inplace):
    model, state = model_and_state()
    # put a good gradient first so a half-applied update would show
    grads = {**GOOD, **grads} if isinstance(grads, dict) else grads
    before = snapshot(state, model)
    step = opt.update_ if inplace else opt.update
    with pytest.raises(error, match=message):
        step(state, model, grads)
    assert_unchanged(before, state, model)


def test_failing_rule_changes_nothing():
    model = {"a": np.ones(3), "b": np.ones(3)}
    state = opt.setup(lambda path, x: opt.Adam() if path == ("a",) else Exploding(), model)
    before = snapshot(state, model)
    with pytest.raises(RuntimeError, match="boom"):
        opt.update_(state, model, {"a": np.ones(3), "b": np.ones(3)})
    assert_unchanged(before, state, model)


@dataclass(frozen=True)
class Exploding(opt.Rule):
    def apply(self, state, x, dx):
        raise RuntimeError("boom")


def test_update_without_gradients():
    model, state = model_and_state()
    with pytest.raises(TypeError, match="no gradients"):
        opt.update(state, model)
    with pytest.raises(TypeError, match="no gradients"):
        opt.update_(state, model)


def test_arguments_in_wrong_order():
    model, state = model_and_state()
    with pytest.raises(TypeError, match="State returned by setup"):
        opt.update(model, state, GOOD)


def test_state_for_another_model():
    model, state = model_and_state()
    with pytest.raises(KeyError, match="'enc'.*another model"):
        opt.update(state, {"layers": model["layers"]}, None)
    with pytest.raises(TypeError, match=r"enc\.w.*another model"):
        opt.update(state, {**model, "enc": {"w": 3, "b": np.ones(3)}}, None)


@pytest.mark.parametrize("bad", [None, 3, "adam", opt.Adam])
def test_setup_needs_a_rule(bad):
    with pytest.raises(TypeError, match="Adam\\(\\)|Rule"):
        opt.setup(bad, {"w": np.ones(2)})


def test_rule_function_returning_non_rule_names_path():
    with pytest.raises(TypeError, match=r"enc\.w"):
        opt.setup(lambda path, x: "adam", {"enc": {"w": np.ones(2)}})


def test_freeze_on_a_model_is_an_error():
    model, state = model_and_state()
    for fn in (opt.freeze_, opt.thaw_):
        with pytest.raises(TypeError, match="did you pass the model"):
            fn(model)


def test_adjust_unknown_name_lists_valid_ones():
    model, state = model_and_state()
    with pytest.raises(ValueError, match="'lr'.*beta, epsilon, eta"):
        opt.adjust(state, lr=0.1)
    with pytest.raises(ValueError):
        opt.adjust_(state, lr=0.1)
    assert state["enc"]["w"].rule.eta == 0.1
    with pytest.raises(TypeError, match="something to change"):
        opt.adjust(state)


def test_rule_validation():
    with pytest.raises(ValueError, match="negative"):
        opt.Adam(-1.0)
    with pytest.raises(TypeError, match="real number"):
        opt.Adam("fast")
    with pytest.raises(TypeError, match="real number"):
        opt.Adam(1j)
    with pytest.raises(TypeError, match="tuple of 2"):
        opt.Adam(0.1, (0.9,))
    with pytest.raises(ValueError, match=r"beta\[1\]"):
        opt.Adam(0.1, (0.9, 1.5))
    assert opt.Adam(1).eta == 1.0 and isinstance(opt.Adam(1).eta, float)
