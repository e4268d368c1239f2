"""A parameter frozen (`requires_grad_(False)`) between steps of a drop-in class, against
torch.optim doing the same: torch.optim steps every parameter whose `.grad` is not None, whatever
`requires_grad` says, and skips one whose `.grad` is None; so must the drop-ins, on separate
tensors and after `flatten_` (whose `zero_grad()` keeps the flat gradient views of trainable
parameters, and drops a frozen one's as torch's does with `set_to_none=True`). Every size is a
multiple of 64 elements: torch's fused Adam gives the same numbers on the flat buffer as on each
tensor."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import optimisers  # noqa: E402
import optimisers.torch as ot  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

SHAPES = [(8, 8), (64,), (2, 32), (64,), (128,)]
STEPS = 8
FROZEN = 1  # the parameter frozen at step FREEZE, thawed at step THAW
FREEZE, THAW = 3, 6

KINDS = {
    "Adam": (lambda ps: ot.Adam(ps, lr=1e-2), lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True)),
    "AdamW": (
        lambda ps: ot.AdamW(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    ),
    "Optimizer(Adam)": (
        lambda ps: ot.Optimizer(ps, optimisers.Adam(1e-2)),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    ),
}

# what the loop does before each step's backward: nothing, or the optimizer's zero_grad
ZEROING = {
    "no zero_grad": None,
    "zero_grad()": lambda o: o.zero_grad(),
    "zero_grad(set_to_none=False)": lambda o: o.zero_grad(set_to_none=False),
}


def _backward(ps, step: int) -> None:
    """What backward does: adds a gradient into each parameter that requires grad (into the
    `flatten_` view where it has one), and leaves a frozen one's `.grad` as it is."""
    g = torch.Generator().manual_seed(100 + step)
    for p in ps:
        grad = torch.randn(p.shape, generator=g)
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = grad
        else:
            p.grad.add_(grad)


@pytest.mark.parametrize("flat", [False, True], ids=["tensors", "flatten_"])
@pytest.mark.parametrize("zeroing", list(ZEROING))
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_frozen_parameter_is_stepped_while_it_has_a_gradient_as_torch_optim_does(kind, zeroing, flat):
    g = torch.Generator().manual_seed(0)
    ps = [nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    qs = [nn.Parameter(p.detach().clone()) for p in ps]
    if flat:
        ot.flatten_(ps)  # gives each a zero gradient, a view of the flat one
        for q in qs:
            q.grad = torch.zeros_like(q)
    ours, theirs = KINDS[kind]
    o, t = ours(ps), theirs(qs)
    for step in range(STEPS):
        if step in (FREEZE, THAW):
            ps[FROZEN].requires_grad_(step == THAW)
            qs[FROZEN].requires_grad_(step == THAW)
        if ZEROING[zeroing] is not None:
            ZEROING[zeroing](o)
            ZEROING[zeroing](t)
        _backward(ps, step)
        _backward(qs, step)
        assert (ps[FROZEN].grad is None) == (qs[FROZEN].grad is None)
        o.step()
        t.step()
        for k, (p, q) in enumerate(zip(ps, qs)):
            assert torch.equal(p.detach(), q.detach()), f"step {step}, parameter {k}"
            assert p.requires_grad == q.requires_grad
    assert isinstance(ps[FROZEN], nn.Parameter) and ps[FROZEN].requires_grad


def _step_both(ps, qs, o, t, step: int) -> None:
    """A gradient set by hand on every parameter, frozen or not; one step of each optimiser; the
    same numbers."""
    for x in (*ps, *qs):
        x.grad = torch.full((64,), step + 1.0)
    o.step()
    t.step()
    for p, q in zip(ps, qs):
        assert torch.equal(p.detach(), q.detach())


def test_a_parameter_frozen_before_its_first_gradient_gets_state_from_a_gradient_set_by_hand():
    ps = [nn.Parameter(torch.ones(64)), nn.Parameter(torch.ones(64))]
    qs = [nn.Parameter(torch.ones(64)), nn.Parameter(torch.ones(64))]
    ps[1].requires_grad_(False)
    qs[1].requires_grad_(False)
    o, t = ot.Adam(ps, lr=0.1), torch.optim.Adam(qs, lr=0.1, fused=True)
    for step in range(3):
        _step_both(ps, qs, o, t, step)
    assert not ps[1].requires_grad and ps[1] in o.state and qs[1] in t.state


def test_the_step_follows_update_refusing_a_frozen_parameter(monkeypatch):
    """`update_` refuses a frozen Parameter with a KeyError and changes nothing (docs/safety.md),
    on every step: the drop-in then steps it through a detached view, as torch.optim steps it."""
    import optimisers.torch.stepping as stepping

    real, calls = stepping.update_, []

    def strict(state, model, grads):
        calls.append(sum(isinstance(x, nn.Parameter) and not x.requires_grad for x in model))
        if calls[-1]:
            raise KeyError("a frozen parameter: freeze_ it instead")
        return real(state, model, grads)

    monkeypatch.setattr(stepping, "update_", strict)
    ps = [nn.Parameter(torch.randn(64)) for _ in range(3)]
    qs = [nn.Parameter(p.detach().clone()) for p in ps]
    o, t = ot.Adam(ps, lr=0.1), torch.optim.Adam(qs, lr=0.1, fused=True)
    for step in range(4):
        if step == 1:
            ps[0].requires_grad_(False)
            qs[0].requires_grad_(False)
        _step_both(ps, qs, o, t, step)
    assert calls == [0, 1, 0, 0, 0]  # refused once; later steps hand it over detached
