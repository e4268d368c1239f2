"""Large NumPy parameters that step one by one (outside the engine's groups and stacks) step two
at a time on the workers (`engine.execute._ahead`): the same numbers as in turn, the first
error in the model's order raised with its path, and nothing written when one fails."""

from __future__ import annotations

import numpy as np
import pytest

import optimisers as opt
from optimisers.engine import chunks, execute


def _model(rng):
    return {"a": rng.standard_normal((300, 400)).astype(np.float32),
            "b": rng.standard_normal((400, 300)).astype(np.float32),
            "c": rng.standard_normal((256, 512)).astype(np.float32),
            "v": rng.standard_normal(70000).astype(np.float32)}


@pytest.fixture
def ahead(monkeypatch):
    """How many parameters stepped on the workers."""
    seen = []
    real = execute._ahead

    def spy(*a):
        found = real(*a)
        seen.append(len(found))
        return found

    monkeypatch.setattr(execute, "_ahead", spy)
    return seen


RULES = {"Adafactor": lambda: opt.Adafactor(), "Muon": lambda: opt.Muon(0.02),
         "Momentum": lambda: opt.Momentum(0.01, 0.9), "AdamW": lambda: opt.AdamW(1e-3)}


@pytest.mark.parametrize("verb", ["update_", "update"])
@pytest.mark.parametrize("name", list(RULES))
def test_steps_on_the_workers_equal_steps_in_turn(name, verb, monkeypatch, ahead):
    if chunks.WORKERS < 2:
        pytest.skip("one core: nothing steps ahead")
    runs = {}
    for on in (True, False):
        rng = np.random.default_rng(0)
        model = _model(rng)
        if name == "Muon":
            del model["v"]  # (matrices only)
        state = opt.setup(RULES[name](), model)
        with monkeypatch.context() as m:
            if not on:
                m.setattr(execute, "AHEAD_FROM", 1 << 40)
            for _ in range(3):
                grads = {k: rng.standard_normal(x.shape).astype(np.float32) for k, x in model.items()}
                state, model = getattr(opt, verb)(state, model, grads)
        runs[on] = model
    for k in runs[True]:
        np.testing.assert_array_equal(runs[True][k], runs[False][k], err_msg=k)
    # (rules the engine groups step in place with `update_`; the pure `update` steps each alone)
    assert max(ahead) >= (2 if verb == "update" or name in ("Adafactor", "Muon") else 0)


def test_the_first_error_in_order_is_raised_and_nothing_changes(ahead):
    if chunks.WORKERS < 2:
        pytest.skip("one core: nothing steps ahead")
    rng = np.random.default_rng(0)
    model = _model(rng)
    state = opt.setup(opt.Adafactor(), model)
    before = {k: x.copy() for k, x in model.items()}
    grads = {k: rng.standard_normal(x.shape).astype(np.float32) for k, x in model.items()}
    for k in ("b", "c"):  # complex gradients for real parameters, found as each steps
        grads[k] = grads[k].astype(np.complex64)
    with pytest.raises(Exception) as raised:
        opt.update_(state, model, grads)
    said = " ".join([str(raised.value), *getattr(raised.value, "__notes__", [])])
    assert "at b:" in said and "at c" not in said, said
    assert max(ahead) >= 2
    for k in model:
        np.testing.assert_array_equal(model[k], before[k])


def test_the_workers_keep_numpys_error_handling(ahead):
    """`np.errstate(all="raise")` around `update_` reaches the steps on the workers (they run in
    copies of the caller's context): an infinite gradient raises there, and nothing changes."""
    if chunks.WORKERS < 2:
        pytest.skip("one core: nothing steps ahead")
    model = {"a": np.ones((300, 400), np.float32), "b": np.ones((400, 300), np.float32)}
    state = opt.setup(opt.Muon(0.02), model)
    grads = {k: np.zeros(x.shape, np.float32) for k, x in model.items()}
    grads["b"][0, 0] = np.inf  # (its normalisation divides infinity by infinity)
    with np.errstate(all="raise"), pytest.raises(FloatingPointError):
        opt.update_(state, model, grads)
    assert max(ahead) >= 2
    assert all((x == 1).all() for x in model.values())
