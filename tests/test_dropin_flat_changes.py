"""The drop-in classes on parameters moved into flat buffers by `flatten_`, against torch.optim's
fused Adam on separate tensors, when a training loop changes gradients or state between steps:
a step reads each parameter's `.grad` (public attributes only), so every change steps as
torch.optim steps it. Sizes are multiples of 64 elements (torch's fused kernel then gives the same
numbers on the buffer as on each tensor), in float32 and bfloat16."""

from __future__ import annotations

import collections

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import optimisers.torch as ot  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")


def _drop_grad(p):
    p.grad = None


def _swap(a, b, name):
    x, y = getattr(a, name), getattr(b, name)
    setattr(a, name, None)
    setattr(b, name, x)
    setattr(a, name, y)


def _reset_state(o):
    o.state = collections.defaultdict(dict)  # (as torch's own code resets it)


CHANGES = {  # what a training loop can do to flattened parameters between steps
    "a gradient dropped": lambda ps, o: _drop_grad(ps[1]),
    "a gradient replaced": lambda ps, o: setattr(ps[2], "grad", ps[2].grad.clone() * 3),
    "gradients swapped": lambda ps, o: _swap(ps[1], ps[2], "grad"),
    "a gradient's data swapped": lambda ps, o: setattr(ps[3].grad, "data", ps[3].grad.data.clone() * 2),
    "a gradient transposed in place": lambda ps, o: ps[0].grad.t_(),
    "a parameter frozen": lambda ps, o: ps[4].requires_grad_(False),
    "every gradient dropped (zero_grad)": lambda ps, o: [_drop_grad(p) for p in ps],
    "the state reset": lambda ps, o: _reset_state(o),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("change", list(CHANGES))
def test_each_change_of_the_gradients_steps_as_torch_optim_steps_it(change, dtype):
    torch.manual_seed(0)
    ours = [nn.Parameter(torch.randn(s).to(dtype)) for s in [(8, 8), (64,), (64,), (2, 32), (64,), (128,)]]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    ot.flatten_(ours)
    o = ot.Adam(ours, lr=1e-2)
    # torch's fused kernel pairs a gradient laid out apart from its parameter with it element by
    # element in memory, not by index: a transposed gradient is compared with its for-loop Adam
    fused = change != "a gradient transposed in place"
    t = torch.optim.Adam(theirs, lr=1e-2, fused=fused, foreach=False if not fused else None)
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        for p, q in zip(ours, theirs):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            q.grad = torch.randn(p.shape, generator=g).to(dtype)
            p.grad.copy_(q.grad)
        if step == 3:
            CHANGES[change](ours, o)
            CHANGES[change](theirs, t)
        o.step()
        t.step()
        for p, q in zip(ours, theirs, strict=True):
            if fused:
                assert torch.equal(p, q)
            else:
                tight = dtype == torch.float32  # (bfloat16: torch rounds each operation, we once)
                torch.testing.assert_close(p, q, rtol=1e-6 if tight else 1e-2, atol=1e-6 if tight else 1e-3)


@pytest.mark.parametrize(
    "options", [{"maximize": True}, {"weight_decay": 0.1}, {"maximize": True, "weight_decay": 1.0}]
)
def test_gradients_are_prepared_anew_each_step(options):
    """`maximize` and L2 `weight_decay` make new gradients from the ones a step finds, leaving
    the views in place: each step negates and decays the gradients once, as torch.optim does."""
    torch.manual_seed(0)
    ours = [nn.Parameter(torch.randn(s)) for s in [(8, 8), (64,), (2, 32)]]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    ot.flatten_(ours)
    o, t = ot.Adam(ours, lr=1e-2, **options), torch.optim.Adam(theirs, lr=1e-2, fused=True, **options)
    for step in range(6):
        g = torch.Generator().manual_seed(step)
        for p, q in zip(ours, theirs):
            q.grad = torch.randn(p.shape, generator=g)
            p.grad.copy_(q.grad)
        o.step()
        t.step()
        for p, q in zip(ours, theirs, strict=True):
            assert torch.equal(p, q)
