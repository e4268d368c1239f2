"""Every rule and composite of `rules_registry.py` (the cases of test_rules.py) on the PyTorch
backend: the same numbers as the NumPy backend, every float dtype kept, pure and in-place updates
bit for bit equal, inputs untouched, ties kept, and no autograd graph in the optimiser state."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import optimisers as opt
from rules_registry import shaped, supports_complex, toy_cases

STEPS = 4
CASES = [pytest.param(c, id=repr(c.rule).replace(" ", "")) for c in toy_cases()]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]

pytestmark = pytest.mark.usefixtures("single_thread")


class Tied(nn.Module):
    """Two linear maps sharing one weight (a Parameter at two places) and a bias each; the biases
    shaped as `rule` needs (see `rules_registry.shaped`)."""

    def __init__(self, dtype, rule=None):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        w = torch.randn(4, 3, generator=g, dtype=torch.float64).to(dtype)
        self.enc = nn.Linear(3, 4, dtype=dtype)
        self.dec = nn.Linear(3, 4, dtype=dtype)
        with torch.no_grad():
            self.enc.bias.copy_(torch.randn(4, generator=g, dtype=torch.float64).to(dtype))
            self.dec.bias.copy_(torch.randn(4, generator=g, dtype=torch.float64).to(dtype))
        self.enc.weight = self.dec.weight = nn.Parameter(w)
        if rule is not None and shaped(rule, (4,)) != (4,):
            for layer in (self.enc, self.dec):
                layer.bias = nn.Parameter(layer.bias.detach().reshape(shaped(rule, (4,))))


def gradients(model, step):
    """Each place's own contribution, as nested dicts mirroring the module."""
    g = torch.Generator().manual_seed(100 + step)

    def like(p):
        return torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)

    return {
        "enc": {"weight": like(model.enc.weight), "bias": like(model.enc.bias)},
        "dec": {"weight": like(model.dec.weight), "bias": like(model.dec.bias)},
    }


def values(model):
    return [model.enc.weight, model.enc.bias, model.dec.bias]


def state_tensors(state):
    out = []

    def walk(s):
        if isinstance(s, torch.Tensor):
            out.append(s)
        elif isinstance(s, (tuple, list)):
            for v in s:
                walk(v)

    for leaf in state.leaves():
        walk(leaf.state)
    return out


@pytest.mark.parametrize("case", CASES)
def test_same_numbers_as_numpy(case):
    model = Tied(torch.float64, case.rule)
    w, eb, db = (p.detach().numpy().copy() for p in values(model))
    as_numpy = {"enc": {"weight": w, "bias": eb}, "dec": {"weight": w, "bias": db}}
    st, snp = opt.setup(case.rule, model), opt.setup(case.rule, as_numpy)
    for k in range(STEPS):
        g = gradients(model, k)
        gnp = {m: {n: t.numpy() for n, t in d.items()} for m, d in g.items()}
        st, model = opt.update_(st, model, g)
        snp, as_numpy = opt.update_(snp, as_numpy, gnp)
    assert model.enc.weight is model.dec.weight and w is as_numpy["dec"]["weight"]
    # MixedPrecision trains a float32 master copy: the backends round its arithmetic differently
    # (steps of 0.05 on values of order 1: a float32 ulp is ~1e-7 absolute)
    tol = 1e-6 if "MixedPrecision" in repr(case.rule) else 1e-12
    for t, a in zip(values(model), [w, eb, db]):
        np.testing.assert_allclose(t.detach().numpy(), a, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_dtypes_pure_and_in_place(case, dtype):
    if dtype.is_complex and not supports_complex(case.rule):
        with pytest.raises(TypeError, match="complex"):
            opt.setup(case.rule, Tied(dtype, case.rule))
        return
    a, b = Tied(dtype, case.rule), Tied(dtype, case.rule)
    sa, sb = opt.setup(case.rule, a), opt.setup(case.rule, b)
    for k in range(STEPS):
        g = gradients(a, k)
        frozen_g = [t.clone() for d in g.values() for t in d.values()]
        before, objs = [p.detach().clone() for p in values(a)], values(a)
        state_before = [t.clone() for t in state_tensors(sa)]
        new_sa, new_a = opt.update(sa, a, g)
        # pure: the inputs are exactly as they were
        assert all(p is q for p, q in zip(values(a), objs)) and a.enc.weight is a.dec.weight
        assert all(torch.equal(p, q) for p, q in zip(values(a), before))
        assert all(torch.equal(s, t) for s, t in zip(state_tensors(sa), state_before))
        assert all(torch.equal(s, t) for s, t in zip([t for d in g.values() for t in d.values()], frozen_g))
        assert new_a.enc.weight is new_a.dec.weight and new_a.enc.weight is not a.enc.weight
        sa, a = new_sa, new_a
        sb, out = opt.update_(sb, b, g)
        assert out is b and b.enc.weight is b.dec.weight
        for p, q in zip(values(a), values(b)):
            assert isinstance(p, nn.Parameter) and p.requires_grad and p.is_leaf
            assert p.dtype == q.dtype == dtype
            assert torch.equal(p, q), f"step {k}: pure and in-place differ"
    # optimiser state is data: no autograd graph even for rules that use the parameter
    assert all(t.grad_fn is None and not t.requires_grad for t in state_tensors(sb))
