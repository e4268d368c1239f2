"""`optimisers.torch.Optimizer`: the adapter against torch.optim on a tiny model whose LM head
weight *is* its embedding weight, plus schedulers, checkpoints and bad input.

Equality: torch.optim's AdamW/Adam with `fused=True` run the same kernel as our Adam/AdamW on
float32 CPU tensors, so they agree bit for bit; the default (single-tensor) torch path orders its
arithmetic differently, so that comparison allows float32 rounding (see
test_torch_optim_reference.py for the tolerance's reasoning)."""

from __future__ import annotations

import copy
import dataclasses
import io
import subprocess
import sys

import pytest
import torch

import optimisers
from _torch_models import batch, lm_loss, make_gpt
from optimisers.torch import Optimizer

STEPS = 6

pytestmark = pytest.mark.usefixtures("single_thread")


def _train(model, opt, steps=STEPS, scheduler=None, seed=1):
    inputs, targets = batch(seed=seed)
    for _ in range(steps):
        opt.zero_grad()
        lm_loss(model, inputs, targets).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _assert_same(a, b, exact=True):
    for x, y in zip(_params(a), _params(b), strict=True):
        if exact:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, rtol=2e-5, atol=2e-6)


def _pair(seed=0):
    ours = make_gpt(seed=seed)
    ref = copy.deepcopy(ours)
    assert ref.head.weight is ref.embed.weight
    return ours, ref


# --- equality with torch.optim -----------------------------------------------------------------


@pytest.mark.parametrize("fused", [True, False])
def test_adamw_equals_torch_on_a_tied_model(fused):
    ours, ref = _pair()
    opt = Optimizer(ours, optimisers.AdamW(3e-2, (0.8, 0.95), 0.1, 1e-6))
    torch_opt = torch.optim.AdamW(
        ref.parameters(), lr=3e-2, betas=(0.8, 0.95), weight_decay=0.1, eps=1e-6, fused=fused
    )
    _train(ours, opt)
    _train(ref, torch_opt)
    assert ours.head.weight is ours.embed.weight
    assert not torch.equal(ours.embed.weight, make_gpt().embed.weight)  # it trained
    _assert_same(ours, ref, exact=fused)


@pytest.mark.parametrize("fused", [True, False])
def test_adam_equals_torch_with_params_and_groups(fused):
    ours, ref = _pair()
    ours_groups = [
        {"params": [ours.embed.weight, ours.pos], "lr": 2e-2},
        {"params": [p for n, p in ours.named_parameters() if n not in ("embed.weight", "pos")]},
    ]
    ref_groups = [
        {"params": [ref.embed.weight, ref.pos], "lr": 2e-2},
        {"params": [p for n, p in ref.named_parameters() if n not in ("embed.weight", "pos")]},
    ]
    opt = Optimizer(ours_groups, optimisers.Adam(5e-3))
    torch_opt = torch.optim.Adam(ref_groups, lr=5e-3, fused=fused)
    assert [g["lr"] for g in opt.param_groups] == [2e-2, 5e-3]
    _train(ours, opt)
    _train(ref, torch_opt)
    _assert_same(ours, ref, exact=fused)


def test_a_tensor_learning_rate_in_a_group_follows_a_scheduler_like_torch():
    # torch.optim's lr=torch.tensor(...): schedulers fill the tensor in place
    ours, ref = _pair()
    opt = Optimizer([{"params": ours.parameters(), "lr": torch.tensor(1e-2)}], optimisers.AdamW(lambd=0.05))
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=torch.tensor(1e-2), weight_decay=0.05, fused=True)
    sched, torch_sched = (torch.optim.lr_scheduler.LambdaLR(o, lambda i: 0.9**i) for o in (opt, torch_opt))
    _train(ours, opt, scheduler=sched)
    _train(ref, torch_opt, scheduler=torch_sched)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    assert float(opt.param_groups[0]["lr"]) == float(torch_opt.param_groups[0]["lr"]) != 1e-2
    _assert_same(ours, ref)


def test_group_keys_set_rule_fields():
    model = make_gpt()
    opt = Optimizer(
        [{"params": [model.pos], "lambd": 0.5, "betas": (0.5, 0.6)}, {"params": [model.embed.weight]}],
        optimisers.AdamW(1e-3),
    )
    first, second = opt._groups
    assert first.rule == optimisers.AdamW(1e-3, (0.5, 0.6), 0.5)
    assert second.rule == optimisers.AdamW(1e-3)
    assert opt.param_groups[0]["beta"] == opt.param_groups[0]["betas"] == (0.5, 0.6)
    assert opt.param_groups[1]["lambd"] == 0.0


def test_rule_function_on_a_module_makes_a_group_per_rule():
    model = make_gpt()

    def rule(path, x):
        return optimisers.Adam(1e-2) if x.ndim < 2 else optimisers.AdamW(1e-3, lambd=0.1)

    opt = Optimizer(model, rule)
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 1e-2]
    names = [set(g["param_names"]) for g in opt.param_groups]
    assert "embed.weight" in names[0] and "head.weight" not in names[0]  # the tie is one tensor
    assert names[1] == {n for n, p in model.named_parameters() if p.ndim < 2}
    _train(model, opt, steps=1)  # state is made at the first gradient
    # one rule object per group: the update engine keeps a group's Leafs together
    for g in opt._groups:
        assert len(g.leaves) == len(g.params) and all(leaf.rule is g.rule for leaf in g.leaves)
    assert opt.optimiser_state["head"]["weight"] is opt.optimiser_state["embed"]["weight"]


def test_closure_runs_with_gradients_and_its_loss_is_returned():
    model = make_gpt()
    opt = Optimizer(model.parameters(), optimisers.Adam())
    inputs, targets = batch()

    def closure():
        opt.zero_grad()
        loss = lm_loss(model, inputs, targets)
        loss.backward()
        return loss

    with torch.no_grad():
        loss = opt.step(closure)
    assert loss.requires_grad and torch.isfinite(loss)
    assert opt.optimiser_state.leaves()[0].state[2] == 1


def test_parameters_without_grad_are_skipped():
    model = make_gpt()
    opt = Optimizer(model, optimisers.Adam(1e-2))
    inputs, targets = batch()
    before = model.pos.detach().clone()
    for _ in range(2):
        opt.zero_grad()
        lm_loss(model, inputs, targets).backward()
        model.pos.grad = None
        opt.step()
    assert torch.equal(model.pos, before)
    # as in torch.optim, a parameter without a gradient has no state (and costs no memory)
    assert "pos" not in opt.optimiser_state and model.pos not in opt.state
    assert opt.state[model.pos] == {} and 0 not in opt.state_dict()["state"]
    assert opt.optimiser_state["embed"]["weight"].state[2] == 2


def test_a_parameter_frozen_after_construction_is_skipped_and_can_come_back():
    model = make_gpt()
    opt = Optimizer(model.parameters(), optimisers.Adam(1e-2))
    inputs, targets = batch()
    model.pos.requires_grad_(False)
    before = model.pos.detach().clone()
    opt.zero_grad()
    lm_loss(model, inputs, targets).backward()
    opt.step()
    assert torch.equal(model.pos, before)
    model.pos.requires_grad_(True)
    opt.zero_grad()
    lm_loss(model, inputs, targets).backward()
    opt.step()
    assert not torch.equal(model.pos, before)


def test_zero_grad_train_eval_and_add_param_group():
    model = make_gpt()
    opt = Optimizer([model.pos], optimisers.Adam(1e-2))
    opt.train()
    opt.eval()
    opt.add_param_group({"params": [model.embed.weight], "lr": 0.5})
    assert opt.param_groups[1]["lr"] == 0.5
    inputs, targets = batch()
    lm_loss(model, inputs, targets).backward()
    before = model.embed.weight.detach().clone()
    opt.step()
    assert not torch.equal(model.embed.weight, before)
    opt.zero_grad()
    assert model.pos.grad is None and model.embed.weight.grad is None


# --- lr schedulers ------------------------------------------------------------------------------


SCHEDULERS = {
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4, eta_min=1e-3),
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1 / (1 + step)),
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=5e-2, total_steps=STEPS + 1),
}


@pytest.mark.parametrize("name", SCHEDULERS)
def test_schedulers_equal_torch(name):
    ours, ref = _pair()
    opt = Optimizer(ours, optimisers.AdamW(1e-2, lambd=0.05))
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.05, fused=True)
    sched, torch_sched = SCHEDULERS[name](opt), SCHEDULERS[name](torch_opt)
    _train(ours, opt, scheduler=sched)
    _train(ref, torch_opt, scheduler=torch_sched)
    assert sched.get_last_lr() == torch_sched.get_last_lr()
    _assert_same(ours, ref)
    leaf = opt.optimiser_state["pos"]
    assert leaf.state[2] == STEPS  # the state was never re-initialised
    if name == "onecycle":  # OneCycleLR cycles beta1 through "betas", which reached the rule
        assert opt.param_groups[0]["betas"] == torch_opt.param_groups[0]["betas"] != (0.9, 0.999)
        assert leaf.rule.beta[0] != 0.9


def test_a_changed_entry_applies_at_the_next_step_only():
    model = make_gpt()
    opt = Optimizer(model, optimisers.AdamW(1e-2))
    _train(model, opt, steps=1)
    rule = opt._groups[0].rule
    opt.param_groups[0]["lr"] = 0.5
    opt.param_groups[0]["lambd"] = 0.1
    assert opt.optimiser_state["pos"].rule is rule
    inputs, targets = batch()
    lm_loss(model, inputs, targets).backward()
    opt.step()
    assert opt.optimiser_state["pos"].rule == optimisers.AdamW(0.5, lambd=0.1)


# --- checkpoints --------------------------------------------------------------------------------


def _roundtrip(d):
    buffer = io.BytesIO()
    torch.save(d, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_state_dict_round_trips_through_torch_save_and_resumes_bit_for_bit():
    whole, resumed = _pair()
    rule = optimisers.AdamW(1e-2, lambd=0.01)
    opt = Optimizer(whole, rule)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8)
    _train(whole, opt, steps=3, scheduler=sched)
    saved = _roundtrip({"model": whole.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()})
    for position, entries in opt.state_dict()["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, saved["opt"]["state"][position][key])
            else:
                assert value == saved["opt"]["state"][position][key]
    _train(whole, opt, steps=3, scheduler=sched)

    resumed.load_state_dict(saved["model"])
    opt2 = Optimizer(resumed, rule)
    sched2 = torch.optim.lr_scheduler.CosineAnnealingLR(opt2, T_max=8)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    assert opt2.param_groups[0]["lr"] == saved["opt"]["param_groups"][0]["lr"] != rule.eta
    _train(resumed, opt2, steps=3, scheduler=sched2)
    _assert_same(whole, resumed)
    assert resumed.head.weight is resumed.embed.weight


def test_state_dict_layout_is_torch_like():
    model = make_gpt()
    opt = Optimizer([{"params": [model.pos]}, {"params": [model.embed.weight], "lr": 0.1}], optimisers.Adam())
    assert opt.state_dict()["state"] == {}  # no gradient yet, so no state
    _train(model, opt, steps=1)
    d = opt.state_dict()
    assert set(d) == {"state", "param_groups"}
    assert [g["params"] for g in d["param_groups"]] == [[0], [1]]
    assert d["state"][1]["rule"] == "Adam(eta=0.1, beta=(0.9, 0.999), epsilon=1e-08)"
    assert d["state"][1]["state/0"] is opt.optimiser_state[1].state[0]


def test_loading_a_torch_optim_state_dict_is_refused():
    model = make_gpt()
    opt = Optimizer(model.parameters(), optimisers.Adam())
    torch_opt = torch.optim.Adam(model.parameters())
    lm_loss(model, *batch()).backward()
    torch_opt.step()
    with pytest.raises(optimisers.CheckpointError, match="torch.optim"):
        opt.load_state_dict(torch_opt.state_dict())


def test_loading_a_mismatched_state_dict_changes_nothing():
    model = make_gpt()
    opt = Optimizer(model, optimisers.Adam())
    other_model = make_gpt()
    other = Optimizer(other_model, optimisers.Lion())
    _train(model, opt, steps=1)
    _train(other_model, other, steps=1)
    d = other.state_dict()
    before = [(leaf.rule, leaf.state) for leaf in opt.optimiser_state.leaves()]
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    with pytest.raises(optimisers.CheckpointError, match="Lion"):
        opt.load_state_dict(d)
    assert [(leaf.rule, leaf.state) for leaf in opt.optimiser_state.leaves()] == before
    assert groups == [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


# --- bad input ----------------------------------------------------------------------------------


def test_a_parameter_in_two_groups_is_an_error():
    model = make_gpt()
    with pytest.raises(ValueError, match=r"group 1, parameter 1 is the same tensor as group 0, parameter 0"):
        Optimizer([{"params": [model.pos]}, {"params": [model.embed.weight, model.pos]}], optimisers.Adam())
    opt = Optimizer([model.pos], optimisers.Adam())
    with pytest.raises(ValueError, match="group 1, parameter 0 is the same tensor as group 0"):
        opt.add_param_group({"params": [model.pos]})
    assert len(opt.param_groups) == 1 and len(opt._book.params) == 1


def test_a_rule_is_required():
    model = make_gpt()
    with pytest.raises(TypeError, match="no rule"):
        Optimizer(model.parameters())
    with pytest.raises(TypeError, match="no rule"):
        Optimizer(model.parameters(), lr=1e-3)
    with pytest.raises(TypeError, match=r"AdamW\(\), not the class"):
        Optimizer(model.parameters(), optimisers.AdamW)
    with pytest.raises(TypeError, match=r"AdamW\(\), not the class"):
        Optimizer(model, optimisers.AdamW)
    with pytest.raises(TypeError, match="expected an optimisers.Rule"):
        Optimizer(model, torch.optim.AdamW)
    with pytest.raises(TypeError, match="group 1: 'rule'"):
        Optimizer(
            [{"params": [model.pos]}, {"params": [model.embed.weight], "rule": "adam"}], optimisers.Adam()
        )


def test_unknown_group_keys_are_errors_naming_group_and_key():
    model = make_gpt()
    with pytest.raises(
        ValueError, match=r"group 1: unknown key 'weight_decay' \(torch's name for 'lambd', which this rule"
    ):
        Optimizer(
            [{"params": [model.pos]}, {"params": [model.embed.weight], "weight_decay": 0.1}],
            optimisers.Adam(),
        )
    with pytest.raises(ValueError, match=r"group 0: unknown key 'momentum' \(this library's name: 'rho'\)"):
        Optimizer([model.pos], optimisers.Momentum(), momentum=0.9)
    with pytest.raises(ValueError, match="group 0: unknown key 'lambd'"):
        Optimizer([model.pos], optimisers.Adam(), lambd=0.1)
    with pytest.raises(ValueError, match="group 0: AdamW: the learning rate eta cannot be negative"):
        Optimizer([model.pos], optimisers.AdamW(), lr=-1.0)
    opt = Optimizer([model.pos], optimisers.Adam())
    with pytest.raises(ValueError, match="group 1: unknown key 'lambd'"):
        opt.add_param_group({"params": [model.embed.weight], "lambd": 0.1})
    assert len(opt.param_groups) == 1


def test_a_bad_entry_at_step_time_changes_nothing():
    model = make_gpt()
    opt = Optimizer([{"params": [model.pos]}, {"params": [model.embed.weight]}], optimisers.AdamW(1e-2))
    lm_loss(model, *batch()).backward()
    opt.step()
    before = _params(model)
    rules = [leaf.rule for leaf in opt.optimiser_state.leaves()]
    states = [
        tuple(s.clone() if isinstance(s, torch.Tensor) else s for s in leaf.state)
        for leaf in opt.optimiser_state.leaves()
    ]
    opt.param_groups[0]["lr"] = 0.5  # fine on its own, but the step as a whole fails
    opt.param_groups[1]["momentum"] = 0.1
    with pytest.raises(ValueError, match=r"param_groups\[1\] has key 'momentum'.*'rho'"):
        opt.step()
    del opt.param_groups[1]["momentum"]
    opt.param_groups[1]["lr"] = -1.0
    with pytest.raises(
        ValueError, match=r"param_groups\[1\]: AdamW: the learning rate eta cannot be negative"
    ):
        opt.step()
    opt.param_groups[1]["lr"] = 1e-2
    opt.param_groups[1]["lamda"] = 0.1  # a typo, which a step would otherwise ignore
    with pytest.raises(ValueError, match=r"param_groups\[1\] has key 'lamda', which AdamW does not take"):
        opt.step()
    del opt.param_groups[1]["lamda"]
    opt.param_groups[1]["betas"] = (0.5, 0.9)
    opt.param_groups[1]["beta"] = (0.6, 0.9)
    with pytest.raises(ValueError, match=r"param_groups\[1\]: 'betas' and 'beta' give different values"):
        opt.step()
    assert [leaf.rule for leaf in opt.optimiser_state.leaves()] == rules
    for leaf, old in zip(opt.optimiser_state.leaves(), states):
        for s, o in zip(leaf.state, old):
            assert torch.equal(s, o) if isinstance(s, torch.Tensor) else s == o
    for x, y in zip(_params(model), before):
        assert torch.equal(x, y)


@dataclasses.dataclass(frozen=True)
class _Picky(optimisers.Rule):
    """Descent that refuses large learning rates when it steps."""

    eta: float = 0.1

    def apply(self, state, x, dx):
        if self.eta > 0.4:
            raise ValueError("eta too large for this test")
        return state, self.eta * dx


def test_a_failed_update_restores_the_synced_rules():
    model = make_gpt()
    opt = Optimizer([model.pos], _Picky())
    rule = opt._groups[0].rule
    model.pos.grad = torch.ones_like(model.pos)
    opt.param_groups[0]["lr"] = 0.5
    before = model.pos.detach().clone()
    with pytest.raises(ValueError, match="too large"):
        opt.step()
    assert opt._groups[0].rule is rule and torch.equal(model.pos, before)
    assert model.pos not in opt.state  # the failed first step made no state
    opt.param_groups[0]["lr"] = 0.25
    opt.step()
    assert opt.optimiser_state[0].rule.eta == 0.25
    assert torch.equal(model.pos, before - 0.25)


def test_optimisers_torch_is_reachable_from_the_package():
    assert optimisers.torch.Optimizer is Optimizer
    assert issubclass(Optimizer, torch.optim.Optimizer)
    # in a fresh process, where nothing imported optimisers.torch yet: the attribute loads it
    code = (
        "import sys, optimisers\n"
        "assert 'torch' not in sys.modules and 'optimisers.torch' not in sys.modules\n"
        "cls = optimisers.torch.Optimizer\n"
        "import torch\n"
        "assert issubclass(cls, torch.optim.Optimizer) and 'optimisers.torch' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_state_is_a_per_parameter_view_that_loads_when_assigned():
    model = make_gpt()
    opt = Optimizer(model, optimisers.Adam(1e-2))
    lm_loss(model, *batch()).backward()
    opt.step()
    entry = opt.state[model.embed.weight]
    assert entry.keys() == opt.state_dict()["state"][0].keys()
    assert entry["state/2"] == 1 and torch.equal(
        entry["state/0"], opt.optimiser_state["embed"]["weight"].state[0]
    )
    assert len(opt.state) == len(list(model.parameters())) and model.pos in opt.state

    fresh_model = make_gpt()
    fresh = Optimizer(fresh_model, optimisers.Adam(1e-2))
    fresh.state[fresh_model.embed.weight] = {
        k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in entry.items()
    }
    leaf = fresh.optimiser_state["embed"]["weight"]
    assert leaf.state[2] == 1 and torch.equal(leaf.state[0], entry["state/0"])
    with pytest.raises(optimisers.CheckpointError, match=r"parameter 0/state/0: shape \(13, 8\) in the"):
        fresh.state[fresh_model.pos] = entry  # pos (position 0) has another shape
    assert "pos" not in fresh.optimiser_state and fresh_model.pos not in fresh.state
