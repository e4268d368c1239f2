"""The engine's per-step checks compare parameters with what the last full check saw: a parameter
swapped, converted or relaid after several steps (when that check is cached) must still step as
torch.optim does, and gradients that do not fit as they are must still be converted."""

import pytest
import torch

import optimisers
import optimisers.torch as ot


def _pair(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(s, generator=gen) for s in shapes]
    ours = [torch.nn.Parameter(v.clone()) for v in values]
    theirs = [torch.nn.Parameter(v.clone()) for v in values]
    return ours, theirs


def _grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) for p in params]


def _steps(ours, theirs, opt, ref, n, start, relay=None):
    for k in range(start, start + n):
        for a, b, g in zip(ours, theirs, _grads(ours, k)):
            a.grad = relay(g) if relay is not None else g.clone()
            b.grad = g.clone()
        opt.step()
        ref.step()


def _close(ours, theirs):
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


def _make(kind, params):
    if kind == "drop-in":
        return ot.AdamW(params, lr=1e-2, weight_decay=0.1)
    return ot.Optimizer(params, optimisers.AdamW(1e-2, lambd=0.1))


@pytest.mark.parametrize("kind", ["drop-in", "adapter"])
def _transposed(t):
    return t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() >= 2 else None


def _channels_last(t):
    return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else None


@pytest.mark.parametrize("kind", ["drop-in", "adapter"])
@pytest.mark.parametrize(
    "swap",
    [_transposed, torch.clone, lambda t: t.double(), _channels_last],
    ids=["transposed", "moved", "double", "channels_last"],
)
def test_a_parameter_swapped_after_cached_steps(kind, swap):
    ours, theirs = _pair([(2, 3, 4, 5), (6, 7), (7,), (3, 3, 2, 2)])
    opt = _make(kind, ours)
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1)
    _steps(ours, theirs, opt, ref, 3, 0)  # the group's checks are cached by now
    for a, b in zip(ours, theirs):
        new = swap(a.data)
        if new is not None:
            a.data, b.data = new, swap(b.data)
            for k in ("exp_avg", "exp_avg_sq"):  # torch.optim needs its moments converted too
                ref.state[b][k] = ref.state[b][k].to(new.dtype)
    _steps(ours, theirs, opt, ref, 3, 3)
    _close(ours, theirs)
    for a, b in zip(ours, theirs):
        assert a.stride() == b.stride()


@pytest.mark.parametrize("kind", ["drop-in", "adapter"])
@pytest.mark.parametrize(
    "relay",
    [
        lambda g: _channels_last(g) if g.dim() == 4 else _transposed(g) if g.dim() == 2 else g.clone(),
        lambda g: g.clone().requires_grad_(),
    ],
    ids=["relaid", "with-graph"],
)
def test_gradients_that_do_not_fit_as_they_are_after_cached_steps(kind, relay):
    ours, theirs = _pair([(2, 3, 4, 5), (6, 7), (7,)])
    opt = _make(kind, ours)
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1)
    _steps(ours, theirs, opt, ref, 3, 0)
    _steps(ours, theirs, opt, ref, 3, 3, relay=relay)
    _close(ours, theirs)


@pytest.mark.parametrize("kind", ["drop-in", "adapter"])
def test_a_gradient_that_is_a_view_of_a_parameter_after_cached_steps(kind):
    ours, theirs = _pair([(8,), (8,)])
    opt = _make(kind, ours)
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1)
    _steps(ours, theirs, opt, ref, 3, 0)
    for _ in range(2):
        ours[0].grad = ours[1].data.flip(0)  # reads the memory that the step writes
        theirs[0].grad = theirs[1].data.flip(0).clone()
        ours[1].grad = ours[0].data
        theirs[1].grad = theirs[0].data.clone()
        opt.step()
        ref.step()
    _close(ours, theirs)
