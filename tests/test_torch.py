"""PyTorch backend: tensor trees and nn.Modules, ties, dtypes, autograd state, gradient forms."""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call

import optimisers as opt
import optimisers.ops as _ops
from _torch_models import batch, lm_loss, make_gpt
from optimisers.backends import numpy as npb
from optimisers.backends import torch as tb

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
RULES = [opt.Descent(0.1), opt.Adam(0.01)]

pytestmark = pytest.mark.usefixtures("single_thread")


def rand(*shape, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)


def snapshot(tensors):
    return [t.detach().clone() for t in tensors]


def assert_bitwise(xs, ys):
    for x, y in zip(xs, ys, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)


# --- the backend functions ----------------------------------------------------------------------


def test_backend_functions_agree_with_numpy():
    x = rand(4, 5, seed=1).double()
    y = rand(4, 5, seed=2).double()
    xn, yn = x.numpy(), y.numpy()
    unary = ["sqrt", "abs", "sign", "abs2"]
    for name in unary:
        arg, argn = (x.abs(), np.abs(xn)) if name == "sqrt" else (x, xn)
        np.testing.assert_allclose(getattr(tb, name)(arg).numpy(), getattr(npb, name)(argn))
    for name in ["maximum", "minimum"]:
        np.testing.assert_allclose(getattr(tb, name)(x, y).numpy(), getattr(npb, name)(xn, yn))
        np.testing.assert_allclose(getattr(tb, name)(x, 0.25).numpy(), getattr(npb, name)(xn, 0.25))
    np.testing.assert_allclose(tb.clip(x, -0.5, 0.5).numpy(), np.clip(xn, -0.5, 0.5))
    np.testing.assert_allclose(tb.clip(x, -y.abs(), 0.5).numpy(), np.clip(xn, -np.abs(yn), 0.5))
    np.testing.assert_allclose(tb.where(x > 0, x, 0.0).numpy(), np.where(xn > 0, xn, 0.0))
    for p in [2, 1, math.inf, -math.inf, 0, 3, -1.5, 0.5]:
        np.testing.assert_allclose(float(tb.norm(x, p)), float(npb.norm(xn, p)), rtol=1e-12)
    empty = torch.zeros(0)
    assert float(tb.norm(empty, 2)) == 0 and float(tb.norm(empty, -math.inf)) == math.inf
    assert tb.isfinite(x) is True
    assert tb.isfinite(torch.tensor([1.0, math.nan])) is False
    assert tb.cond(torch.tensor(True), lambda: 1, lambda: 2) == 1
    assert tb.cond(torch.tensor(False), lambda: 1, lambda: 2) == 2
    z = torch.zeros(2, dtype=torch.complex64)
    assert tb.abs2(torch.tensor([3 + 4j])).dtype == torch.float32
    assert tb.abs2(torch.tensor([3 + 4j], dtype=torch.complex64)).item() == 25
    assert torch.allclose(tb.sign(torch.tensor([3 + 4j])), torch.tensor([0.6 + 0.8j]))
    assert tb.full_like(z, 2.0).dtype == torch.complex64


@pytest.mark.parametrize("dtype", FLOATS + [torch.complex64])
def test_hyperparameters_are_python_scalars_and_keep_the_dtype(dtype):
    x = rand(3, dtype=dtype) if not dtype.is_complex else torch.ones(3, dtype=dtype)
    eta = _ops.scalar(0.1, x)
    eps = _ops.epsilon(1e-8, x)
    assert type(eta) is (complex if dtype.is_complex else float)
    assert type(eps) is float
    assert (eta * x).dtype == dtype and (x / (x.abs() + eps)).dtype == dtype
    expected = tb._FLOAT16_EPS if dtype == torch.float16 else 1e-8
    assert eps == expected
    assert _ops.epsilon(0.0, x) == 0.0  # an explicit zero is honoured, float16 included


def test_float16_epsilon_floor_is_representable_and_bfloat16_keeps_1e8():
    assert torch.tensor(tb._FLOAT16_EPS, dtype=torch.float16).item() == tb._FLOAT16_EPS > 0
    assert torch.tensor(1e-8, dtype=torch.float16).item() == 0  # why the floor exists
    assert torch.tensor(1e-8, dtype=torch.bfloat16).item() > 0
    assert _ops.epsilon(1e-3, torch.ones(1, dtype=torch.float16)) == 1e-3  # floor only raises


def test_cast_and_copy_always_copy_and_astype_does_not():
    x = rand(3, 4)
    for y in (tb.cast(x, torch.float32), tb.cast(x, np.float32), tb.copy(x)):
        assert y is not x and y.data_ptr() != x.data_ptr() and torch.equal(y, x)
    assert tb.cast(x, np.float64).dtype == torch.float64
    assert tb.cast(x, torch.bfloat16).dtype == torch.bfloat16
    assert tb.astype(x, x).data_ptr() == x.data_ptr()
    assert tb.astype(x, torch.zeros(1, dtype=torch.float64)).dtype == torch.float64
    assert tb.astype(np.ones(2), x).dtype == torch.float32
    p = nn.Parameter(rand(2))
    c = tb.copy(p)
    assert isinstance(c, nn.Parameter) and c.requires_grad and c is not p
    g = torch.ones(2, requires_grad=True) * 2
    assert tb.astype(g, p).grad_fn is None  # a create_graph gradient is data to the optimiser


def test_memory_span_and_shares_memory():
    w = rand(4, 6)
    assert tb.shares_memory(w, w.T) and tb.shares_memory(w, w[1:3, 2:])
    assert not tb.shares_memory(w[0], w[1]) and not tb.shares_memory(w, rand(4, 6))
    start, stop = tb.memory_span(w[1:3])
    assert (start, stop) == (w.data_ptr() + 6 * 4, w.data_ptr() + 18 * 4)
    assert tb.memory_span(w.T) == tb.memory_span(w)
    e = torch.zeros(0)
    assert tb.memory_span(e)[0] == tb.memory_span(e)[1]
    # a model built on the meta device has no memory to overlap
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    state = opt.setup(opt.Adam(), meta)
    assert state["0"]["weight"].state[0].is_meta


class _Wrapper(torch.Tensor):
    """A wrapper subclass (as DTensor and FakeTensor are): its storage has no data."""

    @staticmethod
    def __new__(cls, like):
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return NotImplemented


def _odd_tensors():
    """Tensors of every kind a model might hand in, with or without a storage or its data."""
    base, swapped, freed = rand(300), nn.Parameter(rand(4)), rand(8)
    swapped.data = base[100:104]
    freed.untyped_storage().resize_(0)  # (as FSDP frees a parameter's memory)
    emptied = rand(4)
    emptied.set_(torch.empty(0).untyped_storage())
    with torch.inference_mode():
        inference = torch.ones(3)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.ones(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (beta and prototype layouts, warned of once)
        odd = [torch.eye(3).to_sparse_csr(), torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])]
    return [base[7:], base[5:69].view(2, 2, 2, 2, 2, 2)[1], base.view(20, 15).t(), swapped, freed,
            emptied, inference, fake, _Wrapper(rand(3)), rand(9, dtype=torch.bfloat16)[2:],
            rand(2, 3, 4, 5).to(memory_format=torch.channels_last), torch.zeros(0), torch.tensor(1.5),
            torch.zeros(2, 3).to_sparse(), torch.zeros(3, device="meta"), *odd]


def test_snapshot_takes_plain_tensors_and_refuses_the_rest():
    """`snapshot` of every kind of tensor a model might hand in: plain dense tensors the engine
    steps are taken, and `unchanged` holds for them as they are; any other kind (sparse, nested,
    meta, fake, a wrapper subclass, an inference tensor, a storage without data) is refused or
    found changed, never read past its memory."""
    last = torch.channels_last
    plain = [rand(3, 4), rand(4, 3).t(), nn.Parameter(rand(5)), rand(2, 3, 4, 5).to(memory_format=last)]
    grads = [rand(3, 4), rand(4, 3).t(), rand(5), rand(2, 3, 4, 5).to(memory_format=last)]
    token = tb.snapshot(plain, grads)
    assert token is not None and tb.unchanged(token, plain, [g.clone() for g in grads[:1]] + grads[1:])
    for odd in _odd_tensors():
        if tb.engine_ok(odd) and type(odd) in (torch.Tensor, nn.Parameter):
            continue
        assert tb.snapshot([*plain, odd], grads + [grads[0]]) is None or not tb.unchanged(
            token, [*plain, odd], grads)


_CHANGES = {  # what a user may do between two steps, none of which a later step may miss
    "data swapped": lambda p, g: setattr(p, "data", p.data.clone()),
    "transposed in place": lambda p, g: p.t_(),
    "gradient transposed in place": lambda p, g: g.t_(),
    "frozen": lambda p, g: p.requires_grad_(False),
    "set_ to another storage": lambda p, g: p.set_(p.data.clone()),
    "viewed as float16 pairs": lambda p, g: setattr(p, "data", p.data.view(torch.float16)),
    "storage freed": lambda p, g: p.untyped_storage().resize_(0),
}


@pytest.mark.parametrize("change", list(_CHANGES))
def test_unchanged_sees_each_change_of_a_parameter(change):
    params = [nn.Parameter(rand(4, 4)) for _ in range(3)]
    grads = [rand(4, 4) for _ in params]
    token = tb.snapshot(params, grads)
    assert tb.unchanged(token, params, [g.clone() for g in grads])
    with torch.no_grad():
        _CHANGES[change](params[1], grads[1])
    assert not tb.unchanged(token, params, grads)


def test_unchanged_sees_a_gradient_over_a_parameters_memory():
    """A gradient that views a parameter's memory through another tensor of the same storage, or
    through a storage made apart over the same bytes, is found, whichever object owns it."""
    flat = rand(32)
    params = [nn.Parameter(flat[:16]), nn.Parameter(flat[16:])]
    grads = [rand(16), rand(16)]
    token = tb.snapshot(params, grads)
    assert tb.unchanged(token, params, grads)
    assert not tb.unchanged(token, params, [grads[0], flat[:16].detach()])
    apart = torch.from_numpy(flat.detach().numpy()[16:])  # (another storage, the same memory)
    assert not tb.unchanged(token, params, [apart, grads[1]])
    assert tb.snapshot(params, [flat[16:].detach(), grads[1]]) is None


def test_is_param():
    assert tb.is_param(torch.zeros(2)) and tb.is_param(torch.zeros(2, dtype=torch.complex64))
    assert tb.is_param(nn.Parameter(torch.zeros(2)))
    assert not tb.is_param(nn.Parameter(torch.zeros(2), requires_grad=False))
    assert not tb.is_param(torch.zeros(2, dtype=torch.int64))
    assert not tb.is_param(torch.zeros(2, dtype=torch.bool))
    assert not tb.is_param(torch.zeros(2).to_sparse())
    assert not tb.is_param(nn.Linear(2, 2)) and not tb.is_array(nn.Linear(2, 2))


# --- trees of tensors ---------------------------------------------------------------------------


@dataclasses.dataclass
class Block:
    w: torch.Tensor
    b: torch.Tensor
    name: str = "block"


def tied_tree(dtype=torch.float32, device="cpu"):
    W = rand(5, 3, dtype=dtype, device=device, seed=1)
    blk = Block(rand(3, 3, dtype=dtype, device=device, seed=2), rand(3, dtype=dtype, device=device))
    steps = torch.arange(4, device=device)  # integer: carried, never trained
    return {"embed": W, "layers": [blk, blk], "unembed": W, "steps": steps}


def tree_grads(model, seed=10):
    def g(x, k):
        return rand(*x.shape, dtype=x.dtype, device=x.device, seed=seed + k)

    blk = model["layers"][0]
    return {
        "embed": g(model["embed"], 0),
        "layers": [Block(g(blk.w, 1), g(blk.b, 2)), {"w": g(blk.w, 3)}],
        "unembed": g(model["unembed"], 4),
    }


def untied_reference(rule, model, grads):
    """The same step by torch.optim-free arithmetic: one parameter fed the summed gradient."""
    W, blk = model["embed"], model["layers"][0]
    summed = {
        "W": grads["embed"] + grads["unembed"],
        "w": grads["layers"][0].w + grads["layers"][1]["w"],
        "b": grads["layers"][0].b,
    }
    plain = {"W": W.clone(), "w": blk.w.clone(), "b": blk.b.clone()}
    _, new = opt.update(opt.setup(rule, plain), plain, summed)
    return new


@pytest.mark.parametrize("rule", RULES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("device", DEVICES)
def test_tensor_tree_ties_in_place(rule, device):
    model = tied_tree(device=device)
    W, blk, steps = model["embed"], model["layers"][0], model["steps"]
    state = opt.setup(rule, model)
    assert state["embed"] is state["unembed"] and state["layers"][0] is not None
    grads = tree_grads(model)
    before_grads = snapshot([grads["embed"], grads["unembed"]])
    expected = untied_reference(rule, model, grads)
    for _ in range(1):
        state2, new = opt.update_(state, model, grads)
    assert state2 is state and new is model
    assert new["embed"] is W and new["unembed"] is W and new["steps"] is steps
    assert new["layers"][0] is blk and new["layers"][1] is blk
    assert torch.equal(W, expected["W"]) and torch.equal(blk.w, expected["w"])
    assert torch.equal(blk.b, expected["b"])
    assert_bitwise([grads["embed"], grads["unembed"]], before_grads)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("device", DEVICES)
def test_tensor_tree_ties_pure(rule, device):
    model = tied_tree(device=device)
    W, blk = model["embed"], model["layers"][0]
    before = snapshot([W, blk.w, blk.b])
    state = opt.setup(rule, model)
    grads = tree_grads(model)
    state_before = snapshot([t for leaf in state.leaves() for t in leaf.state[:2]]) if isinstance(
        rule, opt.Adam
    ) else []
    new_state, new = opt.update(state, model, grads)
    assert new is not model and new["embed"] is new["unembed"] and new["embed"] is not W
    assert new["layers"][0] is new["layers"][1] and new["layers"][0] is not blk
    assert new["layers"][0].name == "block" and new["steps"] is model["steps"]
    assert new_state["embed"] is new_state["unembed"] and new_state["embed"] is not state["embed"]
    # the caller's model and state are exactly as they were
    assert model["embed"] is W and model["layers"][0] is blk
    assert_bitwise([W, blk.w, blk.b], before)
    if state_before:
        assert_bitwise([t for leaf in state.leaves() for t in leaf.state[:2]], state_before)
    # pure and in place agree bit for bit
    _, inplace = opt.update_(opt.setup(rule, model), model, grads)
    assert_bitwise([new["embed"], new["layers"][0].w], [inplace["embed"], inplace["layers"][0].w])


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("rule", RULES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("device", DEVICES)
def test_dtypes_and_device_are_kept(dtype, rule, device):
    model = tied_tree(dtype, device)
    state = opt.setup(rule, model)
    grads = tree_grads(model)
    _, pure = opt.update(state, model, grads)
    _, inplace = opt.update_(state, model, grads)
    for new in (pure, inplace):
        for x in (new["embed"], new["layers"][0].w, new["layers"][0].b):
            assert x.dtype == dtype and x.device.type == device and torch.isfinite(x).all()
    assert_bitwise([pure["embed"], pure["layers"][0].b], [inplace["embed"], inplace["layers"][0].b])
    # a float64 gradient does not widen a lower-precision parameter
    g64 = {"embed": grads["embed"].double()}
    _, again = opt.update_(state, model, g64)
    assert again["embed"].dtype == dtype


def test_float16_adam_zero_gradient_stays_finite():
    x = {"w": torch.ones(4, dtype=torch.float16)}
    state = opt.setup(opt.Adam(), x)
    for _ in range(3):
        state, x = opt.update_(state, x, {"w": torch.zeros(4, dtype=torch.float16)})
    assert torch.equal(x["w"], torch.ones(4, dtype=torch.float16))


def test_complex_adam_uses_the_modulus_unlike_torch_optim():
    # torch.optim.Adam treats a complex parameter as pairs of reals (view_as_real) and normalises
    # real and imaginary parts separately; we (like Optimisers.jl and optax) normalise by |g|^2.
    p = nn.Parameter(torch.complex(rand(6, seed=3), rand(6, seed=4)))
    ref = nn.Parameter(p.detach().clone())
    torch_adam = torch.optim.Adam([ref], lr=0.05)
    x = p.detach().to(torch.complex128)
    m, v = torch.zeros_like(x), torch.zeros(6, dtype=torch.float64)
    b1, b2, eps = 0.9, 0.999, 1e-8
    state = opt.setup(opt.Adam(0.05), p)
    for t in range(1, 11):
        g = torch.complex(rand(6, seed=20 + t), rand(6, seed=40 + t))
        ref.grad = g
        torch_adam.step()
        state, out = opt.update_(state, p, g)
        assert out is p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g.abs().double() ** 2
        x = x - 0.05 * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
    assert p.dtype == torch.complex64
    torch.testing.assert_close(p.detach(), x.to(torch.complex64), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(p.detach(), ref.detach(), rtol=1e-3)


def test_plain_tensors_with_requires_grad_stay_leaves():
    w = rand(3, 2).requires_grad_()
    model = {"w": w}
    state = opt.setup(opt.Descent(0.1), model)
    model["w"].sum().backward()
    _, pure = opt.update(state, model, opt.grads(model))
    assert pure["w"].is_leaf and pure["w"].requires_grad and pure["w"].grad is None
    g = w.grad
    _, same = opt.update_(state, model, opt.grads(model))
    assert same["w"] is w and w.is_leaf and w.requires_grad and w.grad is g
    assert torch.equal(pure["w"], w)


def test_inference_tensors_are_replaced_not_written():
    with torch.inference_mode():
        x = torch.ones(3)
    assert not tb.writable(x)
    state = opt.setup(opt.Descent(0.5), {"x": x})
    _, new = opt.update_(state, {"x": x}, {"x": torch.ones(3)})
    assert new["x"] is not x and torch.equal(new["x"], torch.full((3,), 0.5))
    assert torch.equal(x, torch.ones(3))


# --- nn.Module -----------------------------------------------------------------------------------


def gpt_step_grads(model, inputs, targets):
    model.zero_grad()
    lm_loss(model, inputs, targets).backward()
    return opt.grads(model)


def params_of(model):
    return list(model.parameters())


def test_module_tree_and_state_layout():
    model = make_gpt()
    state = opt.setup(opt.Adam(), model)
    assert state["head"]["weight"] is state["embed"]["weight"]
    assert "causal" not in state.keys()  # buffers are carried, not trained
    assert set(state.keys()) == {"embed", "pos", "norm1", "qkv", "proj", "norm2", "mlp", "head"}
    assert state["mlp"]["0"]["weight"].state[0].shape == (16, 8)
    assert [id(p) for p in opt.trainables(model)] == [id(p) for p in model.parameters()]
    paths = [opt_path for opt_path, _ in opt.trainables(model, path=True)]
    assert [".".join(p) for p in paths] == [name for name, _ in model.named_parameters()]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: type(r).__name__)
def test_module_update_in_place_keeps_objects_and_autograd_state(rule):
    model = make_gpt()
    inputs, targets = batch()
    params = params_of(model)
    buffer = model.causal
    state = opt.setup(rule, model)
    grads = gpt_step_grads(model, inputs, targets)
    grad_objs = [p.grad for p in params]
    grad_vals = snapshot(grad_objs)
    assert grads["embed"]["weight"] is model.embed.weight.grad and grads["head"]["weight"] is None
    before = snapshot(params)
    _, new = opt.update_(state, model, grads)
    assert new is model and model.head.weight is model.embed.weight
    assert all(a is b for a, b in zip(params_of(model), params, strict=True))
    assert model.causal is buffer
    for p, g, gv, b in zip(params, grad_objs, grad_vals, before, strict=True):
        assert p.is_leaf and p.requires_grad and isinstance(p, nn.Parameter)
        assert p.grad is g and torch.equal(p.grad, gv)
        assert not torch.equal(p, b)
    # and training goes on: autograd is happy with the written leaves
    gpt_step_grads(model, inputs, targets)
    assert model.embed.weight.grad is not None


@pytest.mark.parametrize("rule", RULES, ids=lambda r: type(r).__name__)
def test_module_update_pure_returns_new_module_and_leaves_input_alone(rule):
    model = make_gpt()
    inputs, targets = batch()
    state = opt.setup(rule, model)
    grads = gpt_step_grads(model, inputs, targets)
    params = params_of(model)
    before = snapshot(params)
    modules_before = dict(model.named_modules())
    new_state, new = opt.update(state, model, grads)
    assert new is not model and type(new) is type(model)
    assert new.head.weight is new.embed.weight and new.head is not model.head
    assert new.causal is model.causal  # buffers: the same objects
    for p_new, p_old in zip(params_of(new), params, strict=True):
        assert isinstance(p_new, nn.Parameter) and p_new.requires_grad and p_new.is_leaf
        assert p_new is not p_old and p_new.grad is None
    # the input model: same submodules, same parameter objects, same numbers
    assert dict(model.named_modules()) == modules_before
    assert all(a is b for a, b in zip(params_of(model), params, strict=True))
    assert_bitwise(params, before)
    assert model.head.weight is model.embed.weight
    # the new module trains, and agrees bit for bit with the in-place update
    gpt_step_grads(new, inputs, targets)
    _, inplace = opt.update_(opt.setup(rule, model), model, grads)
    assert_bitwise(params_of(new), params_of(inplace))
    assert new_state["head"]["weight"] is new_state["embed"]["weight"]


class SharedTwice(nn.Module):
    def __init__(self):
        super().__init__()
        block = nn.Linear(3, 3)
        self.first = block
        self.second = block
        self.out = nn.Linear(3, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.second(torch.tanh(self.first(x)))))


@pytest.mark.parametrize("pure", [False, True])
def test_same_submodule_at_two_places_matches_torch_sgd(pure):
    torch.manual_seed(0)
    model = SharedTwice()
    ref = copy.deepcopy(model)
    assert ref.first is ref.second
    sgd = torch.optim.SGD(ref.parameters(), lr=0.1)
    state = opt.setup(opt.Descent(0.1), model)
    assert state["first"]["weight"] is state["second"]["weight"]
    x = rand(5, 3)
    for _ in range(5):
        model.zero_grad()
        model(x).square().sum().backward()
        grads = opt.grads(model)
        assert grads["second"] == {"weight": None, "bias": None}
        old = model
        state, model = (opt.update if pure else opt.update_)(state, model, grads)
        assert (model is not old) == pure and model.first is model.second
        sgd.zero_grad()
        ref(x).square().sum().backward()
        sgd.step()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


class WithFrozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.bn = nn.BatchNorm1d(3)
        self.frozen = nn.Parameter(torch.ones(3), requires_grad=False)
        self.none_param = None
        self.register_parameter("absent", None)

    def forward(self, x):
        return self.bn(self.lin(x)) * self.frozen


@pytest.mark.parametrize("pure", [False, True])
def test_buffers_and_frozen_parameters_are_carried(pure):
    torch.manual_seed(0)
    model = WithFrozen()
    model(rand(4, 3)).sum().backward()
    state = opt.setup(opt.Adam(0.1), model)
    assert set(state.keys()) == {"lin", "bn"} and set(state["bn"].keys()) == {"weight", "bias"}
    frozen, mean, var = model.frozen, model.bn.running_mean, model.bn.running_var
    tracked = model.bn.num_batches_tracked
    before = snapshot([frozen, mean, var])
    _, new = (opt.update if pure else opt.update_)(state, model, opt.grads(model))
    assert new.frozen is frozen and new.bn.running_mean is mean and new.bn.running_var is var
    assert new.bn.num_batches_tracked is tracked and new.absent is None
    assert_bitwise([frozen, mean, var], before)
    assert (new.lin.weight is model.lin.weight) != pure
    # a gradient for the frozen parameter or a buffer (e.g. from torch.func) is ignored
    opt.update(state, model, {"frozen": torch.ones(3), "bn.running_mean": torch.ones(3)})


def test_pure_rebuild_does_not_leak_registrations_into_the_input():
    model = SharedTwice()
    model(rand(2, 3)).sum().backward()
    _, new = opt.update(opt.setup(opt.Descent(), model), model, opt.grads(model))
    new.register_buffer("extra", torch.zeros(1))
    new.extra_module = nn.Linear(1, 1)
    assert not hasattr(model, "extra") and not hasattr(model, "extra_module")


def test_pure_rebuild_does_not_share_hooks_with_the_input():
    model = SharedTwice()
    seen = []
    model.register_forward_hook(lambda mod, args, out: seen.append("old"))
    model(rand(2, 3)).sum().backward()
    _, new = opt.update(opt.setup(opt.Descent(), model), model, opt.grads(model))
    assert new is not model
    # hooks registered before the update stay on both; those registered after, on one only
    hooks = [
        new.register_forward_hook(lambda mod, args, out: seen.append("new")),
        new.register_forward_pre_hook(lambda mod, args: seen.append("new pre")),
        new.register_full_backward_hook(lambda mod, gi, go: seen.append("new backward")),
        new.register_state_dict_pre_hook(lambda mod, prefix, keep_vars: seen.append("new state")),
        new.register_load_state_dict_post_hook(lambda mod, keys: seen.append("new load")),
    ]
    seen.clear()
    model(rand(2, 3).requires_grad_()).sum().backward()  # (a full backward hook wants an input grad)
    model.load_state_dict(model.state_dict())
    assert seen == ["old"]
    seen.clear()
    new(rand(2, 3).requires_grad_()).sum().backward()
    new.load_state_dict(new.state_dict())
    assert seen == ["new pre", "old", "new", "new backward", "new state", "new load"]
    for h in hooks:
        h.remove()
    seen.clear()
    new(rand(2, 3))
    assert seen == ["old"]


# --- overlapping memory --------------------------------------------------------------------------


class Transposed(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(4, 3, bias=False)
        self.dec = nn.Linear(3, 4, bias=False)
        self.dec.weight = nn.Parameter(self.enc.weight.T)  # a view: distinct object, same memory


def test_overlapping_parameters_are_rejected_naming_both_paths():
    with pytest.raises(ValueError, match=r"enc\.weight.*dec\.weight"):
        opt.setup(opt.Adam(), Transposed())
    w = rand(4, 4)
    with pytest.raises(ValueError, match=r"a.*b"):
        opt.setup(opt.Descent(), {"a": w, "b": w[1:3]})
    base = torch.zeros(10)
    state = opt.setup(opt.Descent(), {"a": base[:5], "b": base[5:]})  # disjoint slices are fine
    assert state["a"] is not state["b"]


# --- gradient forms ------------------------------------------------------------------------------


def functional_grads(model, inputs, targets, remove_duplicate=False):
    params = dict(model.named_parameters(remove_duplicate=remove_duplicate))

    def loss(p):
        # all names given: untie them so each place gets its own contribution
        out = functional_call(model, p, (inputs,), tie_weights=remove_duplicate)
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))

    return torch.func.grad(loss)(params)


@pytest.mark.parametrize("remove_duplicate", [False, True])
def test_torch_func_flat_dotted_gradients_equal_the_grad_route(remove_duplicate):
    inputs, targets = batch()
    a, b = make_gpt(), make_gpt()
    flat = functional_grads(a, inputs, targets, remove_duplicate)
    assert ("head.weight" in flat) == (not remove_duplicate)
    if not remove_duplicate:  # one contribution per place, summed by update
        summed = flat["embed.weight"] + flat["head.weight"]
        torch.testing.assert_close(summed, gpt_step_grads(make_gpt(), inputs, targets)["embed"]["weight"])
    sa, sb = opt.setup(opt.Adam(0.01), a), opt.setup(opt.Adam(0.01), b)
    for _ in range(3):
        sa, a = opt.update_(sa, a, functional_grads(a, inputs, targets, remove_duplicate))
        sb, b = opt.update_(sb, b, gpt_step_grads(b, inputs, targets))
    assert a.head.weight is a.embed.weight
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7, msg=name)


def test_nested_and_mixed_gradient_mappings():
    model = make_gpt()
    inputs, targets = batch()
    nested = gpt_step_grads(model, inputs, targets)
    g = model.embed.weight.grad
    mixed = {"embed": {"weight": g}, "mlp.0.weight": model.mlp[0].weight.grad}
    dotted_below = {"mlp": {"2.bias": model.mlp[2].bias.grad}}
    for grads in (nested, mixed, dotted_below):
        opt.update(opt.setup(opt.Descent(), model), model, grads)
    s = opt.setup(opt.Descent(1.0), model)
    _, new = opt.update(s, model, {"mlp.0.weight": model.mlp[0].weight.grad})
    # pure: every parameter of the result is new; only the one with a gradient moved
    assert new.embed.weight is not model.embed.weight
    assert torch.equal(new.embed.weight, model.embed.weight)
    torch.testing.assert_close(new.mlp[0].weight, model.mlp[0].weight - model.mlp[0].weight.grad)


def test_bad_module_gradients_name_the_place():
    model = make_gpt()
    state = opt.setup(opt.Descent(), model)
    with pytest.raises(ValueError, match=r"mlp\.0.*'wieght'"):
        opt.update(state, model, {"mlp.0.wieght": torch.zeros(16, 8)})
    with pytest.raises(ValueError, match=r"'nope\.weight'"):
        opt.update(state, model, {"nope.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="both"):
        opt.update(state, model, {"embed": {}, "embed.weight": torch.zeros(13, 8)})
    with pytest.raises(TypeError, match="optimisers.grads"):
        opt.update(state, model, model)
    with pytest.raises(ValueError, match=r"embed\.weight.*shape"):
        opt.update(state, model, {"embed.weight": torch.zeros(2, 2)})
    with pytest.raises(TypeError, match="key 0"):
        opt.update(state, model, {0: None})


def test_dot_grad_of_a_tie_given_at_both_places_is_refused():
    model = make_gpt()
    state = opt.setup(opt.Descent(), model)
    gpt_step_grads(model, *batch())
    twice = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
    with pytest.raises(ValueError, match=r"'embed\.weight' and 'head\.weight'.*twice"):
        opt.update(state, model, twice)
    once = {n: p.grad for n, p in model.named_parameters()}  # deduplicated: the tie once
    _, a = opt.update(state, model, once)
    _, b = opt.update(state, model, opt.grads(model))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    # one gradient tensor reused for distinct, untied parameters is fine
    z = torch.zeros(8)
    opt.update(state, model, {"norm1.bias": z, "norm2.bias": z})


def test_grads_reads_dot_grad_once_per_tensor():
    w, b = rand(2, 2).requires_grad_(), rand(2).requires_grad_()
    unused = rand(3).requires_grad_()
    tree = {"w": w, "layers": [w, (b, unused)], "n": 3}
    (tree["w"] @ b).sum().backward()
    g = opt.grads(tree)
    assert g == {"w": w.grad, "layers": [None, (b.grad, None)], "n": None}
    assert g["w"] is w.grad
    with pytest.raises(TypeError, match="numpy"):
        opt.grads({"x": np.ones(2)})
    nonleaf = w * 2
    assert opt.grads({"y": nonleaf}) == {"y": None}  # no warning, no .grad of a non-leaf


# --- destructure ---------------------------------------------------------------------------------


def test_destructure_is_differentiable_and_sums_tied_contributions():
    model = make_gpt(torch.float64)
    inputs, targets = batch()
    flat, rebuild = opt.destructure(model)
    n = sum(p.numel() for p in model.parameters())
    assert flat.shape == (n,) and flat.dtype == torch.float64 and flat.requires_grad
    leaf = flat.detach().clone().requires_grad_()
    rebuilt = rebuild(leaf)
    assert rebuilt.head.weight is rebuilt.embed.weight and rebuilt.causal is model.causal
    lm_loss(rebuilt, inputs, targets).backward()
    lm_loss(model, inputs, targets).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(leaf.grad, expected, rtol=1e-10, atol=1e-12)
    # gradients flow through `flat` to the parameters as well
    model.zero_grad()
    (flat * leaf.grad).sum().backward()
    as_model = rebuild(leaf.grad)
    for p, q in zip(model.parameters(), as_model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.detach())
    # a detached vector gives ordinary Parameters again
    plain = rebuild(flat.detach() * 0)
    assert isinstance(plain.embed.weight, nn.Parameter) and plain.embed.weight.abs().sum() == 0
    assert plain.head.weight is plain.embed.weight


def test_plain_tensors_at_tied_parameter_slots_become_one_parameter():
    from optimisers.core.tree import map_params

    model = make_gpt()
    doubled = map_params(lambda p: p.detach() * 2, model)
    assert isinstance(doubled.embed.weight, nn.Parameter)
    assert doubled.head.weight is doubled.embed.weight
    torch.testing.assert_close(doubled.embed.weight.detach(), 2 * model.embed.weight.detach())


def test_parameter_frozen_by_requires_grad_after_setup_is_explained():
    # torch users freeze with requires_grad_(False); after setup the state still holds the
    # parameter, so the update says so, names it, points at freeze_, and changes nothing
    layer = nn.Linear(3, 2)
    state = opt.setup(opt.Adam(0.1), layer)
    layer(torch.randn(4, 3)).sum().backward()
    state, layer = opt.update_(state, layer, opt.grads(layer))
    before = (layer.weight.detach().clone(), state["weight"].state[0].clone())
    layer.bias.requires_grad_(False)
    with pytest.raises(KeyError, match=r"parameter at bias.*requires_grad=False.*freeze_"):
        opt.update_(state, layer, opt.grads(layer))
    assert torch.equal(layer.weight, before[0]) and torch.equal(state["weight"].state[0], before[1])
    layer.bias.requires_grad_(True)
    opt.freeze_(state["bias"])  # the supported way
    state, layer = opt.update_(state, layer, opt.grads(layer))
    assert not torch.equal(layer.weight, before[0])


@pytest.mark.parametrize("AdamType", [opt.Adam, opt.AdamW])
def test_small_tensors_step_on_one_thread_with_torch_optims_numbers(AdamType, monkeypatch):
    """With several intra-op threads, torch's fused CPU kernel steps small tensors on one
    (entering its thread pool per tensor costs more than their arithmetic) and big ones on all:
    the numbers are torch.optim's fused Adam's, bit for bit, either way."""
    sizes = [256] * 50 + [1 << 16, 3, 1 << 15, 100003]
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=g) for n in sizes]
    theirs = [nn.Parameter(p.clone()) for p in params]
    rule = AdamType(1e-2) if AdamType is opt.Adam else AdamType(1e-2, lambd=0.1)
    peer = (torch.optim.Adam if AdamType is opt.Adam else torch.optim.AdamW)(
        theirs, lr=1e-2, fused=True, **({} if AdamType is opt.Adam else {"weight_decay": 0.1})
    )
    state = opt.setup(rule, params)
    threads_set: list[int] = []
    set_threads = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (threads_set.append(n), set_threads(n)))
    before = torch.get_num_threads()
    set_threads(2)
    try:
        for step in range(3):
            grads = [torch.randn(n, generator=g) for n in sizes]
            for p, dx in zip(theirs, grads):
                p.grad = dx.clone()
            peer.step()
            state, params = opt.update_(state, params, grads)
            assert all(torch.equal(x, p.detach()) for x, p in zip(params, theirs)), step
    finally:
        set_threads(before)
    assert threads_set == [1, 2] * 3  # each step: the small ones on one thread, then back


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_small_tensors_on_one_thread_give_the_numbers_of_one_thread_throughout(dtype):
    """The split into small tensors (one thread) and big ones (all threads) on several intra-op
    threads gives what torch's kernel gives on one thread, for every dtype it takes."""
    sizes = [256] * 20 + [1 << 16, 5, 40000]
    g = torch.Generator().manual_seed(1)
    start = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    grads = [[torch.randn(n, generator=g).to(dtype) for n in sizes] for _ in range(3)]

    def trained(threads):
        params = [p.clone() for p in start]
        state = opt.setup(opt.AdamW(1e-2, lambd=0.1), params)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for step_grads in grads:
                state, params = opt.update_(state, params, step_grads)
        finally:
            torch.set_num_threads(before)
        return params

    assert all(torch.equal(a, b) for a, b in zip(trained(2), trained(1), strict=True))
