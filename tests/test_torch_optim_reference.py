"""Equivalence with torch.optim: a tiny GPT-like model whose LM head weight *is* its embedding
weight, trained 50 steps on fixed data by a torch.optim optimiser and by the matching optimisers
rule (`update_`, and `update` for the pure path).

Each case states the hyperparameter mapping. Tolerances, as max |ours − torch| / max(|ours|, |torch|)
over each parameter tensor after 50 steps (normwise: biases that start at zero have no scale):
- float64: 1e-9. The formulas are the same; what is left is rounding of differently ordered
  arithmetic (torch uses lerp/addcdiv, we write the textbook expression), amplified a little by
  50 steps of a nonlinear model. Observed ≤ 1e-13.
- float32: 2e-5. The same reordering at float32 rounding (2**-24 ≈ 6e-8 per operation; torch's
  fused `add_(g, alpha=-lr)` rounds once where `x - lr*g` rounds twice), amplified ~100x by 50
  steps through the model. Observed ≤ 8e-6. Rprop decides on signs and agrees exactly.
AdaMax and RAdam place ε differently from torch and RAdam rectifies from a different step; their
entries in rules_registry.py say how the comparison avoids that: the hyperparameters there, and
for RAdam torch's parameters copied into ours after the step that differs (the moments m, v do
not depend on the step taken), so that the rectified steps after it are compared.
"""

from __future__ import annotations

import pytest
import torch

import optimisers as opt
from _torch_models import batch, lm_loss, make_gpt
from rules_registry import TorchCase, torch_cases

STEPS = 50
TOL = {torch.float32: 2e-5, torch.float64: 1e-9}

pytestmark = pytest.mark.usefixtures("single_thread")


# the rules that torch.optim also has, with the hyperparameter mapping and the reasons for the
# values chosen written in rules_registry.py (family `train`), and chains that torch.optim
# expresses with its own options (weight_decay) or with gradient surgery before step()
CASES = torch_cases("train", composites=True)


def max_relative_difference(ours, theirs) -> float:
    worst = 0.0
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        scale = max(a.detach().abs().max().item(), b.detach().abs().max().item())
        worst = max(worst, (a.detach() - b.detach()).abs().max().item() / scale)
    return worst


def train_torch(case: TorchCase, dtype):
    """50 torch.optim steps; also the parameters after the step that differs by design, if any."""
    inputs, targets = batch()
    model = make_gpt(dtype)
    assert model.head.weight is model.embed.weight
    optimizer = case.theirs(list(model.parameters()))
    synced = None
    for step in range(1, STEPS + 1):
        optimizer.zero_grad()
        lm_loss(model, inputs, targets).backward()
        if case.before_step is not None:
            case.before_step(list(model.parameters()))
        optimizer.step()
        if step == case.peer.differs_at_step:
            synced = [p.detach().clone() for p in model.parameters()]
    return model, synced


def train_ours(case: TorchCase, dtype, pure: bool = False, synced=None):
    inputs, targets = batch()
    model = make_gpt(dtype)
    state = opt.setup(case.ours(), model)
    for step in range(1, STEPS + 1):
        model.zero_grad()
        lm_loss(model, inputs, targets).backward()
        state, new = (opt.update if pure else opt.update_)(state, model, opt.grads(model))
        assert (new is model) != pure
        model = new
        if synced is not None and step == case.peer.differs_at_step:
            with torch.no_grad():
                for p, q in zip(model.parameters(), synced, strict=True):
                    p.copy_(q)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_agrees_with_torch_optim(case, dtype):
    theirs, synced = train_torch(case, dtype)
    ours = train_ours(case, dtype, synced=synced)
    assert ours.head.weight is ours.embed.weight  # the tie survived 50 in-place steps
    moved = max_relative_difference(theirs, make_gpt(dtype))
    assert moved > 1e-2, f"{case.name} barely trained ({moved:.1e}); the comparison says little"
    diff = max_relative_difference(ours, theirs)
    assert diff <= TOL[dtype], f"{case.name} {dtype}: max relative difference {diff:.2e}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_pure_update_takes_the_same_steps_bit_for_bit(case):
    inplace = train_ours(case, torch.float32)
    pure = train_ours(case, torch.float32, pure=True)
    assert pure.head.weight is pure.embed.weight
    for a, b in zip(pure.parameters(), inplace.parameters(), strict=True):
        assert torch.equal(a, b)


def test_radam_threshold_difference_is_real():
    """Without the resynchronisation the trajectories part at step 5 (see the RAdam case)."""
    case = next(c for c in CASES if c.name == "RAdam")
    theirs, _ = train_torch(case, torch.float64)
    ours = train_ours(case, torch.float64)
    assert max_relative_difference(ours, theirs) > 1e-6
