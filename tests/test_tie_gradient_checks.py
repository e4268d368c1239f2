"""Each place of a tie gets its gradient checked as an untied parameter's gradient is, before the
places' gradients are summed, and the error names that place. `update` and `update_` agree, and a
refused call changes nothing."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import optimisers as opt
from optimisers.core.tree import format_path
from optimisers.ops import GradientError

W = np.arange(6, dtype=np.float32).reshape(3, 2) / 10
GOOD = np.ones((3, 2), np.float32)

# gradients that no float32 parameter may take, each refused for an untied parameter
BAD = {
    "bool": lambda: np.ones((3, 2), bool),
    "str": lambda: np.full((3, 2), "a"),
    "complex": lambda: np.ones((3, 2), np.complex64),
    "object": lambda: np.full((3, 2), None, dtype=object),
}


def tied_model():
    w = W.copy()
    return {"a": w, "mid": [np.zeros(2, np.float32)], "b": w, "c": {"d": w}}


def untied_error(gradient) -> str:
    """The message an untied parameter's update gives for `gradient`, with its path as `<here>`."""
    model = {"here": W.copy()}
    with pytest.raises(GradientError) as e:
        opt.update(opt.setup(opt.Adam(), model), model, {"here": gradient})
    return str(e.value)


def snapshot(state, model):
    return copy.deepcopy(opt.state_dict(state)), {k: copy.deepcopy(v) for k, v in model.items()}


def assert_unchanged(before, state, model):
    saved, values = before
    for k, v in opt.state_dict(state).items():
        if isinstance(v, np.ndarray):
            np.testing.assert_array_equal(v, saved[k])
        else:
            assert v == saved[k]
    np.testing.assert_array_equal(model["a"], values["a"])
    assert model["a"] is model["b"] is model["c"]["d"]


@pytest.mark.parametrize("update", [opt.update, opt.update_], ids=["update", "update_"])
@pytest.mark.parametrize("place", [("a",), ("b",), ("c", "d")], ids=lambda p: ".".join(p))
@pytest.mark.parametrize("bad", list(BAD))
def test_a_bad_gradient_at_any_place_is_refused_naming_that_place(bad, place, update):
    model = tied_model()
    state = opt.setup(opt.Adam(), model)
    grads = {"a": GOOD, "mid": [None], "b": GOOD, "c": {"d": GOOD}}
    if len(place) == 1:
        grads[place[0]] = BAD[bad]()
    else:
        grads["c"] = {"d": BAD[bad]()}
    before = snapshot(state, model)
    with pytest.raises(GradientError) as e:
        update(state, model, grads)
    # the message an untied parameter gets, word for word, with this place's path
    assert str(e.value) == untied_error(BAD[bad]()).replace("at here:", f"at {format_path(place)}:", 1)
    assert_unchanged(before, state, model)


def test_path_of_the_place_is_the_one_reported():
    """The message names the place that holds the bad gradient, not the tie's first place."""
    model = tied_model()
    state = opt.setup(opt.Adam(), model)
    for update in (opt.update, opt.update_):
        with pytest.raises(GradientError, match=r"^gradient at b: a gradient of dtype bool"):
            update(state, model, {"a": GOOD, "b": np.ones((3, 2), bool)})
        with pytest.raises(GradientError, match=r"^gradient at a: a gradient of dtype bool"):
            update(state, model, {"a": np.ones((3, 2), bool), "b": GOOD})
        # the only gradient of the tie, at its second place
        with pytest.raises(GradientError, match=r"^gradient at b: a gradient of dtype <U1"):
            update(state, model, {"b": np.full((3, 2), "x")})


def test_a_shared_container_reports_its_second_place():
    inner = {"w": W.copy()}
    model = {"first": inner, "second": inner}
    state = opt.setup(opt.Descent(), model)
    second = format_path(("second", "w"))
    for update in (opt.update, opt.update_):
        with pytest.raises(GradientError, match=rf"^gradient at {second}: a gradient of dtype bool"):
            update(state, model, {"first": {"w": GOOD}, "second": {"w": np.ones((3, 2), bool)}})


@pytest.mark.parametrize("update", [opt.update, opt.update_], ids=["update", "update_"])
def test_a_torch_gradient_for_a_tied_numpy_parameter_counts_as_it_would_alone(update):
    """An untied NumPy parameter takes a (CPU) torch gradient, converting it; so does each place
    of a tie, and the step is that of the summed gradient."""
    g2 = torch.linspace(-1, 1, 6).reshape(3, 2)
    model = tied_model()
    state = opt.setup(opt.Adam(0.1), model)
    _, new = update(state, model, {"a": GOOD, "b": g2})
    single = {"w": W.copy()}
    _, expected = opt.update(opt.setup(opt.Adam(0.1), single), single, {"w": GOOD + g2.numpy()})
    np.testing.assert_array_equal(new["a"], expected["w"])
    assert new["a"] is new["b"] is new["c"]["d"]


@pytest.mark.parametrize("update", [opt.update, opt.update_], ids=["update", "update_"])
def test_torch_tie_checks_each_place(update):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 2))
    model = {"a": w, "b": w}
    state = opt.setup(opt.Adam(), model)
    before = w.detach().clone()
    bad = {
        "bool": (torch.ones(3, 2, dtype=torch.bool), "a gradient of dtype torch.bool"),
        "complex": (torch.ones(3, 2, dtype=torch.complex64), "a complex gradient"),
        "sparse": (torch.ones(3, 2).to_sparse(), "torch.sparse_coo gradient"),
        "numpy str": (np.full((3, 2), "a"), "which is not a number"),
    }
    for gradient, message in bad.values():
        with pytest.raises(GradientError, match=rf"^gradient at b: .*{message}"):
            update(state, model, {"a": torch.ones(3, 2), "b": gradient})
    assert torch.equal(w.detach(), before)
    # a NumPy gradient at one place is converted, as for an untied tensor
    _, new = update(state, model, {"a": torch.ones(3, 2), "b": np.full((3, 2), 2.0, np.float32)})
    single = {"w": torch.nn.Parameter(before.clone())}
    _, expected = opt.update(opt.setup(opt.Adam(), single), single, {"w": torch.full((3, 2), 3.0)})
    assert torch.equal(new["a"].detach(), expected["w"].detach())


def test_jax_tie_checks_each_place():
    jnp = pytest.importorskip("jax.numpy")
    import jax

    w = jnp.asarray(W)
    model = {"a": w, "b": w}
    state = opt.setup(opt.Adam(), model)
    grads = {"a": jnp.ones((3, 2)), "b": jnp.ones((3, 2), bool)}
    for update in (opt.update, opt.update_, jax.jit(opt.update)):
        with pytest.raises(GradientError, match=r"^gradient at b: a gradient of dtype bool"):
            update(state, model, grads)


def test_good_ties_still_sum_as_before():
    """Gradients of another precision than the parameter are summed as given and converted once
    (what an untied parameter fed the float64 sum gets), bit for bit."""
    rng = np.random.default_rng(0)
    g1, g2 = rng.standard_normal((3, 2)), rng.standard_normal((3, 2))  # float64
    for update in (opt.update, opt.update_):
        model = tied_model()
        _, new = update(opt.setup(opt.Adam(0.1), model), model, {"a": g1, "b": g2})
        single = {"w": W.copy()}
        _, expected = opt.update(opt.setup(opt.Adam(0.1), single), single, {"w": g1 + g2})
        np.testing.assert_array_equal(new["a"], expected["w"])
