"""`optimisers.torch.Adafactor` against `torch.optim.Adafactor`: the same signature, defaults,
group keys and `state[p]` keys ("step", and "row_var"/"col_var" shaped as torch's for parameters of
two or more dimensions, "variance" for the others), the same numbers over 20 steps on a tiny GPT
whose LM head weight is its embedding weight (with HF-style decay / no-decay groups) and on a
convolution (4-D weights), checkpoints both ways, and torch's refusals.

The drop-in runs the library's `Adafactor` rule, whose float32 arithmetic is grouped a little
differently from torch's for-loop (a division where torch multiplies by `rsqrt`, `β·r + (1−β)·m`
where torch calls `lerp`): compared to a few float32 roundings per step."""

from __future__ import annotations

import copy
import inspect
import io

import pytest
import torch

import optimisers
import optimisers.torch as ot
from _torch_models import batch, lm_loss, make_gpt

STEPS = 20
DECAY = dict(lr=2e-2, weight_decay=0.1, d=1.5, beta2_decay=-0.6, eps=(1e-20, 1e-2))

pytestmark = pytest.mark.usefixtures("single_thread")


def hf_groups(model, decay=0.1):
    """HF Trainer's grouping: weight decay on matrices, none on biases and LayerNorm weights."""
    named = list(model.named_parameters())
    return [
        {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": decay},
        {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0, "lr": 5e-3},
    ]


def train(model, optimizer, steps=STEPS, seed=1):
    inputs, targets = batch(seed=seed)
    for _ in range(steps):
        optimizer.zero_grad()
        lm_loss(model, inputs, targets).backward()
        optimizer.step()


def assert_close(a: torch.nn.Module, b: torch.nn.Module):
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=2e-5, atol=2e-6, msg=name)


def assert_same_state(ours, theirs, mine_params, their_params):
    for p, q in zip(mine_params, their_params, strict=True):
        mine, torchs = ours.state[p], theirs.state[q]
        assert mine.keys() == torchs.keys()
        for key, value in torchs.items():
            assert mine[key].shape == value.shape and mine[key].dtype == value.dtype, key
            if key == "step":
                assert torch.equal(mine[key], value)
            else:
                torch.testing.assert_close(mine[key], value, rtol=1e-4, atol=1e-6 * value.abs().max().item())


def roundtrip(d):
    buffer = io.BytesIO()
    torch.save(d, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_signature_defaults_and_group_keys_are_torch_optims():
    mine = inspect.signature(ot.Adafactor.__init__).parameters
    theirs = inspect.signature(torch.optim.Adafactor.__init__).parameters
    assert list(mine) == list(theirs)
    for key, p in theirs.items():
        assert (mine[key].default, mine[key].kind) == (p.default, p.kind), key
    model = make_gpt()
    ours, torchs = ot.Adafactor(model.parameters()), torch.optim.Adafactor(model.parameters())
    assert ours.defaults == torchs.defaults
    assert ours.param_groups[0].keys() == torchs.param_groups[0].keys()
    assert ours._groups[0].rule == optimisers.Adafactor()


@pytest.mark.parametrize("kw", [{}, DECAY, dict(maximize=True)], ids=["defaults", "decay", "maximize"])
def test_trains_a_tied_gpt_with_hf_groups_like_torch_optim(kw):
    ours, ref = make_gpt(), make_gpt()
    optimizer = ot.Adafactor(hf_groups(ours), **kw)
    torch_opt = torch.optim.Adafactor(hf_groups(ref), **kw)
    train(ours, optimizer)
    train(ref, torch_opt)
    assert ours.head.weight is ours.embed.weight
    assert not torch.equal(ours.embed.weight, make_gpt().embed.weight)  # it trained
    assert_close(ours, ref)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [kw.get("weight_decay", 0.1), 0.0]
    for g, tg in zip(optimizer.param_groups, torch_opt.param_groups, strict=True):
        assert {k: v for k, v in g.items() if k != "params"} == {k: v for k, v in tg.items() if k != "params"}
    assert_same_state(optimizer, torch_opt, list(ours.parameters()), list(ref.parameters()))


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 4, 3)  # a 4-D weight: factored over its last two dims
        self.head = torch.nn.Linear(4, 2)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))  # 0-D

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x)).mean(dim=(2, 3))) * self.scale


def test_a_4d_weight_and_a_scalar_like_torch_optim():
    ours, ref = ConvNet(), ConvNet()
    optimizer, torch_opt = (
        ot.Adafactor(ours.parameters(), **DECAY),
        torch.optim.Adafactor(ref.parameters(), **DECAY),
    )
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(3))
    for _ in range(STEPS):
        for model, o in ((ours, optimizer), (ref, torch_opt)):
            o.zero_grad()
            model(x).pow(2).sum().backward()
            o.step()
    assert_close(ours, ref)
    assert_same_state(optimizer, torch_opt, list(ours.parameters()), list(ref.parameters()))
    assert optimizer.state[ours.conv.weight]["row_var"].shape == (4, 3, 3, 1)
    assert optimizer.state[ours.conv.weight]["col_var"].shape == (4, 3, 1, 3)
    assert optimizer.state[ours.scale]["variance"].shape == ()


def test_frozen_parameters_get_no_state_until_their_first_gradient():
    ours, ref = make_gpt(), make_gpt()
    for model in (ours, ref):
        for n, p in model.named_parameters():
            p.requires_grad_(n.startswith(("mlp", "norm")))
    optimizer, torch_opt = ot.Adafactor(ours.parameters()), torch.optim.Adafactor(ref.parameters())
    train(ours, optimizer, steps=2)
    train(ref, torch_opt, steps=2)
    with_state = {k for k, v in torch_opt.state_dict()["state"].items() if v}
    assert set(optimizer.state_dict()["state"]) == with_state
    for model in (ours, ref):
        model.embed.weight.requires_grad_(True)
    train(ours, optimizer, steps=3)
    train(ref, torch_opt, steps=3)
    assert_close(ours, ref)
    assert optimizer.state[ours.embed.weight]["step"] == torch_opt.state[ref.embed.weight]["step"] == 3


# --- checkpoints -----------------------------------------------------------------------------------


def test_state_dict_round_trip_resumes_bit_for_bit():
    whole, part = make_gpt(), make_gpt()
    optimizer = ot.Adafactor(hf_groups(whole), **DECAY)
    train(whole, optimizer, steps=5)
    saved = roundtrip({"model": whole.state_dict(), "opt": optimizer.state_dict()})
    train(whole, optimizer, steps=5, seed=2)

    part.load_state_dict(saved["model"])
    resumed = ot.Adafactor(hf_groups(part), lr=123.0)  # the checkpoint's hyperparameters win
    resumed.load_state_dict(saved["opt"])
    assert [g["lr"] for g in resumed.param_groups] == [2e-2, 5e-3]
    train(part, resumed, steps=5, seed=2)
    for a, b in zip(whole.parameters(), part.parameters(), strict=True):
        assert torch.equal(a, b)
    assert part.head.weight is part.embed.weight


def test_resuming_from_a_torch_optim_adafactor_checkpoint_continues_its_run():
    whole = make_gpt()
    torch_opt = torch.optim.Adafactor(hf_groups(whole), **DECAY)
    train(whole, torch_opt, steps=5)
    saved = roundtrip({"model": whole.state_dict(), "opt": torch_opt.state_dict()})
    train(whole, torch_opt, steps=5, seed=2)

    resumed = make_gpt(seed=5)
    resumed.load_state_dict(saved["model"])
    optimizer = ot.Adafactor(hf_groups(resumed))
    optimizer.load_state_dict(saved["opt"])
    assert optimizer.param_groups[0]["eps"] == (1e-20, 1e-2)
    train(resumed, optimizer, steps=5, seed=2)
    assert_close(resumed, whole)


def test_our_checkpoint_loads_into_torch_optim_adafactor():
    ours, ref = make_gpt(), make_gpt()
    optimizer = ot.Adafactor(hf_groups(ours), **DECAY)
    train(ours, optimizer, steps=5)
    ref.load_state_dict(ours.state_dict())
    torch_opt = torch.optim.Adafactor(hf_groups(ref))
    torch_opt.load_state_dict(roundtrip(optimizer.state_dict()))
    assert_same_state(optimizer, torch_opt, list(ours.parameters()), list(ref.parameters()))
    train(ours, optimizer, steps=5, seed=2)
    train(ref, torch_opt, steps=5, seed=2)
    assert_close(ours, ref)


def test_a_checkpoint_with_misshapen_factors_is_refused_and_changes_nothing():
    model = make_gpt()
    torch_opt = torch.optim.Adafactor(model.parameters())
    train(model, torch_opt, steps=1)
    saved = copy.deepcopy(torch_opt.state_dict())
    position = next(i for i, p in enumerate(model.parameters()) if p.ndim >= 2)
    saved["state"][position]["row_var"] = saved["state"][position]["row_var"].mT  # (1, m) for (m, 1)
    optimizer = ot.Adafactor(model.parameters())
    train(model, optimizer, steps=1)
    before = copy.deepcopy(optimizer.state_dict())
    with pytest.raises(optimisers.CheckpointError, match=f"parameter {position}: 'row_var' has shape"):
        optimizer.load_state_dict(saved)
    after = optimizer.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert all(torch.equal(after["state"][i][k], v) for i, s in before["state"].items() for k, v in s.items())


# --- torch's refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(lr=-1.0), "Learning rate"),
        (dict(beta2_decay=0.1), "beta2_decay"),
        (dict(eps=(-1.0, 1e-3)), "epsilon1"),
        (dict(eps=(None, -1.0)), "epsilon2"),
        (dict(d=0.5), "Clipping threshold"),
        (dict(weight_decay=-0.1), "weight_decay"),
    ],
)
def test_bad_hyperparameters_are_refused_as_torch_refuses_them(kw, message):
    with pytest.raises(ValueError, match=message):
        torch.optim.Adafactor(make_gpt().parameters(), **kw)
    with pytest.raises(ValueError, match=message):
        ot.Adafactor(make_gpt().parameters(), **kw)


def test_complex_parameters_are_refused_at_the_step_changing_nothing():
    # as torch.optim.Adafactor: taken when made, refused at the step where one has a gradient
    w = torch.nn.Parameter(torch.randn(3, 2))
    z = torch.nn.Parameter(torch.randn(3, 2, dtype=torch.complex64))
    opt = ot.Adafactor([{"params": [w]}, {"params": [z]}])
    w.grad, z.grad = torch.randn_like(w), torch.randn_like(z)
    before = w.detach().clone()
    refused = r"param_groups\[1\], parameter 0: Adafactor does not support complex"
    with pytest.raises(RuntimeError, match=refused):
        opt.step()
    assert torch.equal(w.detach(), before) and not opt.state
    z.grad = None
    opt.step()
    assert not torch.equal(w.detach(), before) and z not in opt.state
