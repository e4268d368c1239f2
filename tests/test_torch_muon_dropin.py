"""`optimisers.torch.Muon` against `torch.optim.Muon`: the signature, defaults, group keys and
`state[p]` keys; 20 steps of a tiny GPT (the LM head's weight is its embedding's) with HF-style
groups of matrices, the vectors given to AdamW; `state_dict` round trips and checkpoints written
by torch.optim.Muon.

torch runs Newton–Schulz in bfloat16 and we in float32, so the runs are compared twice: with
torch.optim.Muon as it is, within 3% of the parameters' displacement (its bfloat16 rounds each
update by 1.5–3%, see tests/test_muon.py; here gradients depend on the parameters, so the
differences feed back a little), and with its bfloat16 cast taken away, to float32 rounding.
"""

from __future__ import annotations

import copy
import inspect
import io

import pytest
import torch

import optimisers
import optimisers.torch as ot
from _torch_models import batch, lm_loss, make_gpt
from test_muon import float32_torch_muon

STEPS = 20

pytestmark = pytest.mark.usefixtures("single_thread")


def muon_groups(model):
    """HF-style groups of the matrices (decay on attention, none and another lr on the MLP)."""
    named = dict(model.named_parameters())
    attention = [named[n] for n in ("embed.weight", "pos", "qkv.weight", "proj.weight")]
    mlp = [named[n] for n in ("mlp.0.weight", "mlp.2.weight")]
    return [{"params": attention, "weight_decay": 0.1}, {"params": mlp, "weight_decay": 0.0, "lr": 0.01}]


def vectors(model):
    return [p for p in model.parameters() if p.ndim < 2]


def optimizers(model, muon_cls, lr=0.02, **kw):
    muon = muon_cls(muon_groups(model), lr=lr, **kw)
    adamw = torch.optim.AdamW(vectors(model), lr=1e-2, fused=True)
    return muon, adamw


def train(model, opts, steps=STEPS, seed=1):
    inputs, targets = batch(seed=seed)
    for _ in range(steps):
        for o in opts:
            o.zero_grad()
        lm_loss(model, inputs, targets).backward()
        for o in opts:
            o.step()


def worst_difference(ours, ref, start) -> float:
    """max over the matrices of |ours − ref|_F / |ref − start|_F."""
    out = 0.0
    for (_, a), (_, b), (_, s) in zip(
        ours.named_parameters(), ref.named_parameters(), start.named_parameters()
    ):
        if a.ndim >= 2:
            out = max(out, ((a - b).norm() / (b - s).norm()).item())
    return out


def _roundtrip(d):
    buffer = io.BytesIO()
    torch.save(d, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_signature_defaults_and_keys_are_torch_optims():
    mine = inspect.signature(ot.Muon.__init__).parameters
    theirs = inspect.signature(torch.optim.Muon.__init__).parameters
    assert list(mine) == list(theirs)
    for key, p in theirs.items():
        assert mine[key].default == p.default and mine[key].kind == p.kind, key
    ours, ref = make_gpt(), make_gpt()
    opt = ot.Muon(muon_groups(ours))
    torch_opt = torch.optim.Muon(muon_groups(ref))
    assert opt.defaults == torch_opt.defaults
    assert [set(g) for g in opt.param_groups] == [set(g) for g in torch_opt.param_groups]
    train(ours, [opt], steps=1)
    train(ref, [torch_opt], steps=1)
    for group, torch_group in zip(opt.param_groups, torch_opt.param_groups):
        for p, q in zip(group["params"], torch_group["params"]):
            assert opt.state[p].keys() == torch_opt.state[q].keys() == {"momentum_buffer"}
    assert opt.state[ours.qkv.weight]["momentum_buffer"].shape == ours.qkv.weight.shape
    assert isinstance(opt._groups[0].rule, optimisers.Muon)


@pytest.mark.parametrize(
    "kw",
    [{}, {"nesterov": False, "adjust_lr_fn": "match_rms_adamw", "momentum": 0.9}],
    ids=["default", "rms"],
)
def test_trains_like_torch_optim_muon_with_hf_style_groups(kw):
    start = make_gpt()
    ours, ref, exact = copy.deepcopy(start), copy.deepcopy(start), copy.deepcopy(start)
    train(ours, optimizers(ours, ot.Muon, **kw))
    train(ref, optimizers(ref, torch.optim.Muon, **kw))
    with float32_torch_muon():
        train(exact, optimizers(exact, torch.optim.Muon, **kw))
    assert ours.head.weight is ours.embed.weight
    assert worst_difference(ours, ref, start) < 0.03
    assert worst_difference(ours, exact, start) < 1e-4
    for a, b in zip(vectors(ours), vectors(exact)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_group_values_and_state_equal_torchs_in_float32():
    start = make_gpt()
    ours, exact = copy.deepcopy(start), copy.deepcopy(start)
    opt, _ = mine = optimizers(ours, ot.Muon)
    with float32_torch_muon():
        torch_opt, _ = theirs = optimizers(exact, torch.optim.Muon)
        train(exact, theirs, steps=5)
    train(ours, mine, steps=5)
    for g, tg in zip(opt.param_groups, torch_opt.param_groups):
        assert {k: v for k, v in g.items() if k != "params"} == {k: v for k, v in tg.items() if k != "params"}
    for group, torch_group in zip(opt.param_groups, torch_opt.param_groups):
        for p, q in zip(group["params"], torch_group["params"]):
            a, b = opt.state[p]["momentum_buffer"], torch_opt.state[q]["momentum_buffer"]
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * b.abs().max().item())


def test_state_dict_round_trip_resumes_bit_for_bit():
    whole = make_gpt()
    opts = optimizers(whole, ot.Muon)
    train(whole, opts, steps=4)
    saved = _roundtrip(
        {"model": whole.state_dict(), "opt": opts[0].state_dict(), "adamw": opts[1].state_dict()}
    )
    train(whole, opts, steps=4, seed=2)

    resumed = make_gpt(seed=5)
    resumed.load_state_dict(saved["model"])
    again = optimizers(resumed, ot.Muon)
    again[0].load_state_dict(saved["opt"])
    again[1].load_state_dict(saved["adamw"])
    train(resumed, again, steps=4, seed=2)
    for a, b in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_resumes_from_a_torch_optim_muon_checkpoint_and_back():
    """torch.optim.Muon's checkpoint (its Newton–Schulz in float32, so that the runs compare to
    float32 rounding) continues in ours as in torch, and ours loads into torch.optim.Muon."""
    with float32_torch_muon():
        whole = make_gpt()
        theirs = optimizers(whole, torch.optim.Muon)
        train(whole, theirs, steps=4)
        saved = _roundtrip(
            {"model": whole.state_dict(), "opt": theirs[0].state_dict(), "adamw": theirs[1].state_dict()}
        )
        at_save = copy.deepcopy(whole)
        train(whole, theirs, steps=4, seed=2)

    resumed = make_gpt(seed=5)
    resumed.load_state_dict(saved["model"])
    mine = optimizers(resumed, ot.Muon, lr=123.0)  # the checkpoint's lr wins
    mine[0].load_state_dict(saved["opt"])
    mine[1].load_state_dict(saved["adamw"])
    assert [g["lr"] for g in mine[0].param_groups] == [0.02, 0.01]
    train(resumed, mine, steps=4, seed=2)
    assert worst_difference(resumed, whole, at_save) < 1e-4

    before, back = copy.deepcopy(resumed), copy.deepcopy(resumed)
    with float32_torch_muon():
        torch_opts = optimizers(back, torch.optim.Muon)
        torch_opts[0].load_state_dict(_roundtrip(mine[0].state_dict()))
        torch_opts[1].load_state_dict(_roundtrip(mine[1].state_dict()))
        train(back, torch_opts, steps=3, seed=3)
    train(resumed, mine, steps=3, seed=3)
    assert worst_difference(resumed, back, before) < 1e-4


def test_parameters_not_2d_are_refused_when_made():
    model = make_gpt()
    with pytest.raises(
        ValueError, match=r"group 0, parameter 2 \(norm1.weight\): Muon only supports .* AdamW"
    ):
        ot.Muon(model.named_parameters())
    with pytest.raises(ValueError, match=r"group 1, parameter 0: .*shape \(8,\)"):
        ot.Muon([{"params": [model.qkv.weight]}, {"params": [model.proj.bias]}])
    opt = ot.Muon([model.qkv.weight])
    with pytest.raises(ValueError, match=r"group 1, parameter 0: .*shape \(8,\)"):
        opt.add_param_group({"params": [model.proj.bias]})
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match=r"Muon only supports 2D parameters .*shape \(2, 3, 4\)"):
        ot.Muon([torch.nn.Parameter(torch.zeros(2, 3, 4))])  # as torch: 2-D only
    with pytest.raises(ValueError, match="Adjust learning rate function spectral is not supported"):
        ot.Muon([model.qkv.weight], adjust_lr_fn="spectral")
    with pytest.raises(ValueError, match="Invalid lr value"):
        ot.Muon([model.qkv.weight], lr=-1.0)


def test_complex_parameters_are_refused_at_the_step_changing_nothing():
    # as torch.optim.Muon: taken when made, refused at the step where one has a gradient
    w = torch.nn.Parameter(torch.randn(3, 2))
    z = torch.nn.Parameter(torch.randn(3, 3, dtype=torch.complex64))
    opt = ot.Muon([w, z], lr=1e-2)
    w.grad = torch.randn_like(w)
    opt.step()  # z has no gradient: stepped as torch steps it
    before, state = w.detach().clone(), {k: v.clone() for k, v in opt.state[w].items()}
    w.grad, z.grad = torch.randn_like(w), torch.randn_like(z)
    with pytest.raises(RuntimeError, match=r"parameter 1: Muon does not support complex parameters"):
        opt.step()
    assert torch.equal(w.detach(), before) and z not in opt.state
    assert all(torch.equal(opt.state[w][k], v) for k, v in state.items())
    z.grad = None
    opt.step()
    assert not torch.equal(w.detach(), before)
