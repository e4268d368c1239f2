"""`eval_params(state, model)`: the model at its evaluation point. For `Lookahead` the slow
weights, which are checked here against the explicit formula of the paper (Zhang et al. 2019:
after every k-th fast step, slow ← slow + α(fast − slow)) computed alongside; for any other rule
the model's own parameters. Ties kept, pure, through chains, wrappers and per-parameter rules.
`test_lookahead.py` checks the slow weights against optax.lookahead."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import optimisers as opt
from optimisers import ops


def tied_model(seed=0, dtype=np.float64):
    gen = np.random.default_rng(seed)
    w = gen.standard_normal((3, 4)).astype(dtype)
    return {
        "embed": w,
        "head": {"w": gen.standard_normal((4, 4)).astype(dtype), "b": np.zeros(4, dtype)},
        "unembed": w,
    }


def gradients(model, seed):
    gen = np.random.default_rng(seed)
    return {
        "embed": gen.standard_normal(model["embed"].shape),
        "head": {k: gen.standard_normal(v.shape) for k, v in model["head"].items()},
        "unembed": gen.standard_normal(model["unembed"].shape),
    }


def arrays(tree):
    return [tree["embed"], tree["head"]["w"], tree["head"]["b"], tree["unembed"]]


def snapshot(state, model):
    """Every array of the model and the state, as bytes (to check that nothing changed)."""
    parts: list = []
    for leaf in state.leaves():
        flat: list = []
        opt.core.state.flatten_state(leaf.state, flat)
        parts += [np.asarray(p).tobytes() for p in flat]
    return [np.asarray(a).tobytes() for a in arrays(model)], parts


class LookaheadDescent:
    """The paper's algorithm for one array, with plain gradient descent as the inner optimiser:
    fast ← fast − η·g; after every k-th step slow ← slow + α(fast − slow) and fast ← slow."""

    def __init__(self, x, eta, k, alpha):
        self.fast = self.slow = np.array(x, dtype=np.float64)
        self.eta, self.k, self.alpha, self.n = eta, k, alpha, 0

    def step(self, g):
        self.fast = self.fast - self.eta * np.asarray(g, np.float64)
        self.n += 1
        if self.n == self.k:
            self.n = 0
            self.slow = self.fast = self.slow + self.alpha * (self.fast - self.slow)


def tied_gradient(grads):
    return grads["embed"] + grads["unembed"]


def test_other_rules_give_the_model_itself():
    model = tied_model()
    state = opt.setup(opt.OptimiserChain(opt.ClipGrad(1.0), opt.Adam(0.1)), model)
    state, model = opt.update(state, model, gradients(model, 1))
    assert opt.eval_params(state, model) is model


def check_against(reference, ours, name, rtol=1e-14, atol=1e-14):
    np.testing.assert_allclose(ours, reference, rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.parametrize("verb", ["update", "update_"])
def test_lookahead_gives_the_slow_weights_ties_kept_and_pure(verb):
    model = tied_model()
    k, alpha = 3, 0.4
    state = opt.setup(opt.Lookahead(opt.Descent(0.1), k=k, alpha=alpha), model)
    embed = LookaheadDescent(model["embed"], 0.1, k, alpha)
    head = LookaheadDescent(model["head"]["w"], 0.1, k, alpha)

    def step(verb, state, model, seed):
        grads = gradients(model, seed)
        embed.step(tied_gradient(grads)), head.step(grads["head"]["w"])
        return getattr(opt, verb)(state, model, grads)

    for t in range(1, 11):
        state, model = step(verb, state, model, t)
        check_against(embed.fast, model["embed"], "fast")
        before, containers = snapshot(state, model), (model, model["head"])
        evaluated = opt.eval_params(state, model)
        assert snapshot(state, model) == before  # pure: model and state unchanged
        assert model is containers[0] and model["head"] is containers[1]
        assert evaluated["embed"] is evaluated["unembed"]  # one array for the tie
        check_against(embed.slow, evaluated["embed"], "slow")
        check_against(head.slow, evaluated["head"]["w"], "slow")
        assert evaluated["head"]["b"] is not model["head"]["b"]  # every Lookahead parameter is new
        # new arrays, never the state's own: training on does not change them
        assert all(not np.shares_memory(e, x) for e, x in zip(arrays(evaluated), arrays(model)))
        kept = [a.copy() for a in arrays(evaluated)]
        state, model = step("update_", state, model, 100 + t)
        state, model = step("update", state, model, 200 + t)
        assert all(np.array_equal(a, b) for a, b in zip(kept, arrays(evaluated)))


def test_chains_wrappers_and_per_parameter_rules():
    model = tied_model()
    lookahead = opt.Lookahead(opt.Descent(0.1), k=2, alpha=0.5)

    def choose(path, x):
        if path[0] == "head":
            return opt.OptimiserChain(opt.ClipGrad(1.0), opt.Adam(0.05))  # no evaluation point
        return opt.SkipNonFinite(opt.OptimiserChain(opt.ClipGrad(1.0), lookahead))

    state = opt.setup(choose, model)
    embed = LookaheadDescent(model["embed"], 0.1, 2, 0.5)
    for t in range(1, 6):
        grads = gradients(model, t)
        embed.step(np.clip(tied_gradient(grads), -1.0, 1.0))
        state, model = opt.update(state, model, grads)
        evaluated = opt.eval_params(state, model)
        assert evaluated["head"] is model["head"]  # not one of its arrays changed
        assert evaluated["embed"] is evaluated["unembed"]
        check_against(embed.fast, model["embed"], "fast")
        check_against(embed.slow, evaluated["embed"], "slow")
        if t % 2:
            assert not np.array_equal(evaluated["embed"], model["embed"])


def test_mixed_precision_outside_gives_the_slow_weights_in_the_parameters_dtype():
    model = {"w": np.random.default_rng(0).standard_normal(6).astype(np.float16)}
    state = opt.setup(opt.MixedPrecision(opt.Lookahead(opt.Adam(0.05), k=4)), model)
    for t in range(3):
        state, model = opt.update(state, model, {"w": np.full(6, 1.0 + t, np.float16)})
    evaluated = opt.eval_params(state, model)
    slow = state["w"].state[1][0]  # MixedPrecision's (master, inner): Lookahead's slow weights
    assert slow.dtype == np.float32 and evaluated["w"].dtype == np.float16
    np.testing.assert_array_equal(evaluated["w"], slow.astype(np.float16))
    assert not np.array_equal(evaluated["w"], model["w"])


def test_frozen_parts_are_at_their_evaluation_point_too():
    model = tied_model()
    start = model["embed"].copy()
    state = opt.setup(opt.Lookahead(opt.Descent(0.1), k=4), model)
    state, model = opt.update(state, model, gradients(model, 1))
    opt.freeze_(state)
    # one fast step since the slow weights were taken: they are where training started
    evaluated = opt.eval_params(state, model)
    np.testing.assert_array_equal(evaluated["embed"], start)
    assert not np.array_equal(evaluated["embed"], model["embed"])


def test_torch_module_with_a_tied_weight():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5))
    module[1].weight = module[0].weight
    state = opt.setup(opt.Lookahead(opt.Descent(0.1), k=3), module)
    weight = LookaheadDescent(module[0].weight.detach().numpy(), 0.1, 3, 0.5)
    for _ in range(4):
        for p in module.parameters():
            p.grad = torch.randn_like(p)
        grads = opt.grads(module)
        weight.step(grads["0"]["weight"].numpy())  # torch: one .grad for the tied Parameter
        state, module = opt.update_(state, module, grads)
    before = [p.detach().clone() for p in module.parameters()]
    evaluated = opt.eval_params(state, module)
    assert evaluated is not module and evaluated[0].weight is evaluated[1].weight
    assert isinstance(evaluated[0].weight, torch.nn.Parameter) and evaluated[0].weight.requires_grad
    check_against(weight.slow, evaluated[0].weight.detach().numpy(), "slow", rtol=1e-6, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))  # the module is unchanged


def test_jax_under_jit_ties_kept():
    model = jax.tree.map(jnp.asarray, tied_model(dtype=np.float32))
    model["unembed"] = model["embed"]
    state = opt.setup(opt.Lookahead(opt.Descent(0.1), k=2), model)
    embed = LookaheadDescent(model["embed"], 0.1, 2, 0.5)
    step, evaluate = jax.jit(opt.update), jax.jit(opt.eval_params)
    for t in range(1, 6):
        grads = gradients(model, t)
        embed.step(tied_gradient(grads))
        state, model = step(state, model, jax.tree.map(lambda g: jnp.asarray(g, jnp.float32), grads))
        evaluated = evaluate(state, model)
        np.testing.assert_array_equal(evaluated["embed"], evaluated["unembed"])
        check_against(embed.slow, evaluated["embed"], "slow", rtol=1e-5, atol=1e-6)


@dataclasses.dataclass(frozen=True)
class RunningMean(opt.Rule):
    """Descent whose evaluation point is the running mean of its iterates (for the tests)."""

    eta: float = 0.1

    def init(self, x):
        return ops.cast(x, x.dtype), 0

    def apply(self, state, x, dx):
        mean, n = state
        new = x - ops.scalar(self.eta, x) * dx
        return (mean + (new - mean) / ops.scalar(n + 2, x), n + 1), opt.NewValue(new)

    def eval_value(self, state, x):
        return state[0]


def test_a_rule_of_ones_own_with_a_schedule_sees_its_own_state():
    # a schedule wraps the state with its step count; eval_value sees the state apply sees
    model = {"w": np.array([1.0, 2.0])}
    state = opt.setup(RunningMean(lambda t: 0.1 / (t + 1)), model)
    iterates = [model["w"]]
    for _ in range(3):
        state, model = opt.update(state, model, {"w": np.array([1.0, -1.0])})
        iterates.append(model["w"])
    np.testing.assert_allclose(opt.eval_params(state, model)["w"], np.mean(iterates, axis=0), rtol=1e-15)


def test_errors_say_what_is_wrong():
    model = tied_model()
    state = opt.setup(opt.Lookahead(opt.Adam()), model)
    with pytest.raises(TypeError, match="expects the State returned by setup"):
        opt.eval_params(model, state)
    with pytest.raises(KeyError, match="the state has key 'head' at <model>, which the model lacks"):
        opt.eval_params(state, {"embed": model["embed"], "unembed": model["embed"]})
    with pytest.raises(ValueError, match=r"parameter at head.w has shape \(2, 2\), but its optimiser state"):
        opt.eval_params(state, dict(model, head={"w": np.zeros((2, 2)), "b": model["head"]["b"]}))

    @dataclasses.dataclass(frozen=True)
    class Wrong(opt.Rule):
        def apply(self, state, x, dx):
            return state, dx

        def eval_value(self, state, x):
            return np.zeros(7)

    with pytest.raises(
        ValueError, match=r"Wrong.eval_value gave a value of shape \(7,\) for the parameter at"
    ):
        opt.eval_params(opt.setup(Wrong(), model), model)


def test_a_single_array_as_the_model():
    x = np.ones(3)
    state = opt.setup(opt.Lookahead(opt.Descent(0.1), k=2), x)
    state, x = opt.update(state, x, np.ones(3))
    np.testing.assert_array_equal(x, np.full(3, 0.9))
    np.testing.assert_array_equal(opt.eval_params(state, x), np.ones(3))  # before the first sync
    assert opt.eval_params(opt.setup(opt.Adam(), x), x) is x
