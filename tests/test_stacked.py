"""Small parameters of one matrix rule and one shape step as one stack (`optimisers.engine.stacked`):
on NumPy each must get exactly the numbers it gets stepped alone (its own State, so no stack), on
`update` and `update_`, through ties, frozen members and narrow dtypes. On PyTorch a batched matrix
product may round otherwise than a single one (torch multiplies small matrices in a batch with
its own loop, larger ones with MKL's batched gemm), so a stacked matrix agrees with it stepped
alone to float rounding, and `update` and `update_` (both stacking) agree bit for bit."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import optimisers as opt
from optimisers.core.state import flatten_state
from optimisers.engine import stacked

torch = pytest.importorskip("torch")

SHAPES = [(16, 16)] * 5 + [(8, 32)] * 3 + [(32, 8)] * 3 + [(4, 3, 3, 3)] * 2 + [(5, 7)]


@pytest.fixture
def stacks(monkeypatch):
    """The sizes of the stacks stepped during the test (not those that fell back)."""
    seen: list = []
    step_stack = stacked._step_stack

    def spy(members, **layout):
        results = step_stack(members, **layout)
        if results:
            seen.append(len(members))
        return results

    monkeypatch.setattr(stacked, "_step_stack", spy)
    return seen


def _model(to, dtype, seed=0):
    rng = np.random.default_rng(seed)
    params = [to(rng.standard_normal(s).astype(np.float32), dtype) for s in SHAPES]
    return {"ps": params, "tied": params[1]}  # the second matrix at two places


def _grads(model, to, dtype, k):
    rng = np.random.default_rng(100 + k)
    g = lambda x: to(rng.standard_normal(tuple(x.shape)).astype(np.float32), dtype)  # noqa: E731
    return {"ps": [g(x) for x in model["ps"]], "tied": g(model["tied"])}


def _numpy(a, dtype):
    return a.astype(dtype)


def _torch(a, dtype):
    return torch.from_numpy(a).to(dtype)


def _as_np(x):
    return x.float().numpy() if hasattr(x, "numpy") else np.asarray(x)


BACKENDS = {
    "numpy-float32": (_numpy, np.float32),
    "numpy-float64": (_numpy, np.float64),
    "torch-float32": (_torch, torch.float32),
    "torch-float64": (_torch, torch.float64),
    "torch-bfloat16": (_torch, torch.bfloat16),
}


def _alone(model, grads, rule, states):
    """Each distinct parameter stepped by its own State (one Leaf: never stacked)."""
    out = []
    for i, x in enumerate(model["ps"]):
        g = grads["ps"][i] + grads["tied"] if i == 1 else grads["ps"][i]
        states[i], x = opt.update(states[i], x, g)
        out.append(x)
    return {"ps": out, "tied": out[1]}


RULES = {  # every built-in rule that stacks
    "adafactor": lambda: opt.Adafactor(0.02, lambd=0.1),
    "muon": lambda: opt.Muon(0.02, lambd=0.1),
    "lamb": lambda: opt.LAMB(0.01, lambd=0.01),
    "lars": lambda: opt.LARS(0.1, lambd=0.01, trust=0.02, nesterov=True),
}


def test_the_rules_here_are_those_that_stack():
    stacking = {n for n in opt.__all__ if getattr(getattr(opt, n), "stacks", False)}
    assert stacking == {type(make()).__name__ for make in RULES.values()}


@pytest.mark.parametrize("in_place", [True, False], ids=["update_", "update"])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("rule_name", sorted(RULES))
def test_stacked_rule_equals_each_parameter_alone(rule_name, backend, in_place, stacks):
    to, dtype = BACKENDS[backend]
    rule = RULES[rule_name]()
    model, reference = _model(to, dtype), _model(to, dtype)
    state = opt.setup(rule, model)
    ref_states = [opt.setup(rule, x) for x in reference["ps"]]
    for k in range(3):
        grads = _grads(model, to, dtype, k)
        if in_place:
            state, model = opt.update_(state, model, grads)
        else:
            state, model = opt.update(state, model, grads)
        reference = _alone(reference, grads, rule, ref_states)
        for x, y in zip(model["ps"], reference["ps"], strict=True):
            _same(x, y, backend)
        assert model["tied"] is model["ps"][1]
    if rule_name in ("lamb", "lars") and (in_place or backend.startswith("torch")):
        # (the engine steps them in place; on torch, a kernel each. Adafactor's matrices keep row
        # and column factors, which the engine does not lay out: they stack)
        assert not stacks
    else:
        assert sorted(stacks[-4:]) == [2, 3, 3, 5]  # each shape of more than one parameter, once
    for i, ref in enumerate(ref_states):  # the state, read per parameter, is each one's own
        (own,) = ref.leaves()
        mine, theirs = [], []
        flatten_state(state["ps"][i].state, mine)
        flatten_state(own.state, theirs)
        for a, b in zip(mine, theirs, strict=True):
            _same(a, b, backend)


def _same(x, y, backend):
    if backend.startswith("numpy"):
        np.testing.assert_array_equal(_as_np(x), _as_np(y))
    else:  # rounding of torch's batched product (float64: 1e-16 relative; bfloat16: the same)
        rtol = {"torch-float32": 1e-5, "torch-float64": 1e-12, "torch-bfloat16": 0}[backend]
        np.testing.assert_allclose(_as_np(x), _as_np(y), rtol=rtol, atol=rtol / 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torch_stacked_update_and_update_agree_bit_for_bit(dtype, stacks):
    rule = opt.Muon(0.02, lambd=0.1)
    model, pure = _model(_torch, dtype), _model(_torch, dtype)
    state, pure_state = opt.setup(rule, model), opt.setup(rule, pure)
    for k in range(3):
        grads = _grads(model, _torch, dtype, k)
        state, model = opt.update_(state, model, grads)
        pure_state, pure = opt.update(pure_state, pure, grads)
        for x, y in zip(model["ps"], pure["ps"], strict=True):
            assert torch.equal(x, y)
    assert len(stacks) == 2 * 3 * 4


@pytest.mark.parametrize("rule_name", sorted(RULES))
def test_a_scheduled_rule_stacks_with_its_schedule_evaluated(rule_name, stacks):
    """`apply_stacked` evaluates schedules as `apply` does (the stack shares one count)."""
    from optimisers.schedules import Cosine

    rule = dataclasses.replace(RULES[rule_name](), eta=Cosine(0.05, 4, final=0.001))
    model, reference = _model(_numpy, np.float32), _model(_numpy, np.float32)
    state = opt.setup(rule, model)
    ref_states = [opt.setup(rule, x) for x in reference["ps"]]
    for k in range(3):
        grads = _grads(model, _numpy, np.float32, k)
        state, model = opt.update_(state, model, grads)
        reference = _alone(reference, grads, rule, ref_states)
        for x, y in zip(model["ps"], reference["ps"], strict=True):
            np.testing.assert_array_equal(x, y)
    assert len(stacks) == 3 * 4


def test_frozen_and_other_rules_stay_out_of_a_stack(stacks):
    rng = np.random.default_rng(0)
    model = [rng.standard_normal((6, 6)).astype(np.float32) for _ in range(6)]
    rules = [opt.Muon(0.02)] * 3 + [opt.Muon(0.05)] * 3  # two rules: two stacks
    state = opt.setup(lambda path, x: rules[path[0]], model)
    opt.freeze_(state[0])
    before = model[0].copy()
    grads = [rng.standard_normal((6, 6)).astype(np.float32) for _ in range(6)]
    opt.update_(state, model, grads)
    np.testing.assert_array_equal(model[0], before)
    assert sorted(stacks) == [2, 3]


def test_large_matrices_step_alone(stacks):
    n = int(np.sqrt(stacked.STACK_BELOW)) + 1
    model = [np.ones((n, n), np.float32) for _ in range(2)]
    state = opt.setup(opt.Muon(0.02), model)
    opt.update_(state, model, [np.ones((n, n), np.float32)] * 2)
    assert stacks == []


def test_a_bad_gradient_in_a_stack_is_reported_where_it_is():
    model = [np.ones((4, 4), np.float32) for _ in range(3)]
    state = opt.setup(opt.Muon(0.02), model)
    before = [x.copy() for x in model]
    grads = [np.ones((4, 4), np.float32), np.ones((4, 4), np.float32), np.ones((4, 4), np.complex64)]
    with pytest.raises(Exception, match=r"gradient at 2"):
        opt.update_(state, model, grads)
    for x, y in zip(model, before):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("rule_name", sorted(n for n in RULES if not RULES[n]().scaled_elementwise))
def test_torch_stacks_take_any_layout(rule_name, stacks):
    """Parameters in channels_last or transposed (not contiguous) still stack, and each is
    written in its own layout with what it gets alone (to the batched product's rounding)."""
    rng = np.random.default_rng(3)
    make = {
        "channels_last": lambda: torch.from_numpy(rng.standard_normal((4, 3, 3, 3)).astype(np.float32))
        .contiguous(memory_format=torch.channels_last),
        "transposed": lambda: torch.from_numpy(rng.standard_normal((6, 8)).astype(np.float32)).t(),
    }
    model = [make[k]() for k in ("channels_last",) * 3 + ("transposed",) * 3]
    reference = [x.clone(memory_format=torch.preserve_format) for x in model]
    rule = RULES[rule_name]()
    state, ref_states = opt.setup(rule, model), [opt.setup(rule, x) for x in reference]
    for _ in range(2):
        grads = [torch.from_numpy(rng.standard_normal(tuple(x.shape)).astype(np.float32)) for x in model]
        state, model = opt.update_(state, model, grads)
        for i, g in enumerate(grads):
            ref_states[i], reference[i] = opt.update(ref_states[i], reference[i], g)
    for x, y in zip(model, reference, strict=True):
        assert x.stride() == y.stride()
        np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=1e-5, atol=1e-6)
    assert model[0].is_contiguous(memory_format=torch.channels_last) and not model[3].is_contiguous()
    assert sorted(stacks) == [3, 3, 3, 3]
