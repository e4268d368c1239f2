"""The compiled way (`optimisers.engine.compiled`): every elementwise rule's step, traced once into
a program and run by numba's loop, against the eager maths it replaces (the same rule with the
compiled way switched off): on every dtype, layout, tie and flat buffer the engine takes, through
`update_`, `update` and a lone parameter."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

import optimisers as opt
import optimisers.engine.compiled as compiled
import optimisers.engine.fused as fused
from optimisers import ops
from optimisers.backends import numba_lowering
from rules_registry import COMPOSITES, RULES

pytest.importorskip("numba")
ml_dtypes = pytest.importorskip("ml_dtypes")

# every elementwise rule of the registry at its toy hyperparameters, and the elementwise chains
CASES = {
    info.case_id(h): (lambda i=info, h=h: i.make(h)) for info in RULES if info.elementwise for h in info.toy
}
# (and the rules that step elementwise given one factor per array: LAMB, LARS)
CASES |= {
    info.case_id(h): (lambda i=info, h=h: i.make(h))
    for info in RULES if not info.elementwise for h in info.toy if info.make(h).scaled_elementwise
}
# (and the chains that scale the whole gradient by one factor first: ClipNorm>...)
CASES |= {
    c.name: c.make
    for c in COMPOSITES
    if (c.make().elementwise or c.make().scaled_elementwise) and c.families & {"toy", "layouts"}
}
NUMPY_DTYPES = {
    "float32": np.float32, "float64": np.float64, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16
}


@pytest.fixture
def runs(monkeypatch):
    """`runs()` -> how many steps a kernel took since the fixture began: the compiled way's, or
    the backend's own Adam (`fused`, which the compiled way leaves Adam to where it applies)."""
    calls = []
    real_run, real_group, real_leaf = compiled._run, fused.step_group, fused.step_leaf

    def group(*a):
        done = real_group(*a)
        calls.extend([1] * done)
        return done

    def leaf(*a):
        done = real_leaf(*a)
        calls.extend([1] * (done is not None))
        return done

    monkeypatch.setattr(compiled, "_run", lambda *a: (calls.append(1), real_run(*a))[1])
    monkeypatch.setattr(fused, "step_group", group)
    monkeypatch.setattr(fused, "step_leaf", leaf)
    return lambda: len(calls)


def _model(dtype, rng):
    """A big parameter (its own kernel call, split among the threads), small packed ones, a
    tie, a transposed (Fortran-order) one and a long vector (Adafactor's compiled arrays)."""
    big = rng.standard_normal((520, 300)).astype(dtype)
    w = rng.standard_normal((3, 4)).astype(dtype)
    return {"big": big, "w": w, "tied": w, "b": rng.standard_normal(5).astype(dtype),
            "t": np.asfortranarray(rng.standard_normal((6, 7))).astype(dtype),
            "v": rng.standard_normal(17000).astype(dtype)}


def _grads(model, rng):
    out = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in model.items()}
    out["tied"] = out["w"] * 0.5  # (a second gradient for the tie: summed)
    return out


def _train(make, dtype, verb, enabled, monkeypatch, steps=4):
    rng = np.random.default_rng(0)
    model = _model(dtype, rng)
    state = opt.setup(make(), model)
    with monkeypatch.context() as m:
        m.setattr(compiled, "ENABLED", enabled)
        for _ in range(steps):
            state, model = getattr(opt, verb)(state, model, _grads(model, rng))
    return state, model


@pytest.mark.parametrize("dtype", list(NUMPY_DTYPES))
@pytest.mark.parametrize("name", list(CASES))
def test_numpy_steps_equal_the_eager_maths_bit_for_bit(name, dtype, monkeypatch, runs):
    # NumPy's float maths rounds as the loop's (IEEE in each op's dtype; the half dtypes
    # converted exactly), so every path agrees with the eager chunks exactly
    dt = NUMPY_DTYPES[dtype]
    _, eager = _train(CASES[name], dt, "update_", False, monkeypatch)
    before = runs()  # (Adam's own kernel runs without the compiled way)
    state, fast = _train(CASES[name], dt, "update_", True, monkeypatch)
    assert runs() > before, "no kernel took the step"
    _, pure = _train(CASES[name], dt, "update", True, monkeypatch)
    for k in ("big", "w", "b", "t", "v"):
        assert fast[k].dtype == eager[k].dtype == dt
        np.testing.assert_array_equal(fast[k], eager[k], err_msg=k)
        np.testing.assert_array_equal(pure[k], eager[k], err_msg=k)
    assert fast["w"] is fast["tied"] and pure["w"] is pure["tied"]
    assert fast["t"].flags.f_contiguous  # (stepped where it is)


TORCH_DTYPES = ["float32", "bfloat16", "float16"]


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_torch_steps_agree_with_the_eager_maths_on_every_layout(name, dtype, monkeypatch, runs):
    torch = pytest.importorskip("torch")
    dt = getattr(torch, dtype)

    def train(enabled, verb, flat=False):
        torch.manual_seed(0)  # (the layers' initial weights)
        gen = torch.Generator().manual_seed(0)
        model = torch.nn.ModuleDict({
            "conv": torch.nn.Conv2d(4, 8, 3).to(memory_format=torch.channels_last),
            "lin": torch.nn.Linear(300, 400),
        }).to(dt)
        model.lin.weight.data = model.lin.weight.data.t().contiguous().t()  # a transposed layout
        model.head = model.lin  # a tie
        if flat:
            import optimisers.torch as opt_torch
            opt_torch.flatten_(model)
        state = opt.setup(CASES[name](), model)
        with monkeypatch.context() as m:
            m.setattr(compiled, "ENABLED", enabled)
            for _ in range(3):
                grads = {n: torch.randn(p.shape, generator=gen).to(dt) for n, p in model.named_parameters()}
                for n, p in model.named_parameters():
                    p.grad = grads[n]
                state, model = getattr(opt, verb)(state, model, opt.grads(model))
        return [p.detach().float() for p in model.parameters()], model

    eager, _ = train(False, "update_")
    fast, model = train(True, "update_")
    assert runs() > 0, "the compiled way was not taken"
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)
    pure, _ = train(True, "update")
    flat, _ = train(True, "update_", flat=True)
    # torch's own square root is not IEEE's on every CPU (AVX-512: a few in a million elements
    # one ulp apart), so compiled and eager agree to a rounding; compiled paths agree exactly
    tol = {"float32": (1e-5, 1e-6), "bfloat16": (2e-2, 1e-2), "float16": (2e-3, 1e-3)}[dtype]
    for a, b, c, d in zip(fast, eager, pure, flat, strict=True):
        torch.testing.assert_close(a, b, rtol=tol[0], atol=tol[1])
        assert torch.equal(a, c)
        torch.testing.assert_close(a, d, rtol=tol[0], atol=tol[1])


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("name", ["Momentum", "ClipNorm>Adam", "LAMB", "Adafactor"])
def test_a_group_of_small_parameters_only_steps_run_by_run_compiled(name, backend, monkeypatch, runs):
    """Every member packed (no big one: each run joined, stepped and copied back on its own),
    matrices and vectors, a transposed one: the compiled way takes it, with the eager numbers."""
    make = {"Momentum": lambda: opt.Momentum(0.01, 0.9), "LAMB": lambda: opt.LAMB(0.01),
            "ClipNorm>Adam": lambda: opt.OptimiserChain(opt.ClipNorm(1.0), opt.Adam(0.01)),
            "Adafactor": lambda: opt.Adafactor()}[name]
    shapes = ([] if name == "Adafactor" else [(8, 16)] * 50 + [(16, 8)] * 30) + [(256,)] * 100

    def train(enabled):
        rng = np.random.default_rng(0)
        model = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        if name != "Adafactor":
            model[79] = np.asfortranarray(model[79])
        if backend == "torch":
            torch = pytest.importorskip("torch")
            model = [torch.from_numpy(np.ascontiguousarray(x)) for x in model]
            if name != "Adafactor":
                model[79] = model[79].t().contiguous().t()
        state = opt.setup(make(), model)
        with monkeypatch.context() as m:
            m.setattr(compiled, "ENABLED", enabled)
            for _ in range(3):
                gs = [rng.standard_normal(tuple(x.shape)).astype(np.float32) for x in model]
                gs = gs if backend == "numpy" else [torch.from_numpy(g) for g in gs]
                state, model = opt.update_(state, model, gs)
        return [np.asarray(x) for x in model]

    eager = train(False)
    before = runs()
    fast = train(True)
    assert runs() > before, "the compiled way was not taken"
    assert not compiled._UNTRACEABLE, compiled._UNTRACEABLE
    for a, b in zip(fast, eager, strict=True):
        if backend == "numpy":
            np.testing.assert_array_equal(a, b)
        else:  # (torch's own square root: see the test above)
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_adjusting_and_schedules_reuse_the_kernel(monkeypatch, runs):
    # hyperparameters and step counts are the kernel's arguments, not its code
    rng = np.random.default_rng(1)
    model = {"w": rng.standard_normal(20000).astype(np.float32)}
    state = opt.setup(opt.Momentum(0.01, 0.9), model)
    state, model = opt.update_(state, model, {"w": np.ones(20000, np.float32)})
    known = len(numba_lowering._KERNELS)
    for eta in (0.02, 0.03, 0.5):
        state = opt.adjust(state, eta=eta, rho=0.8)
        before = model["w"].copy(), np.asarray(state["w"].state).copy()
        state, model = opt.update_(state, model, {"w": np.ones(20000, np.float32)})
        v = np.float32(0.8) * before[1] + np.float32(eta) * np.float32(1.0)
        np.testing.assert_array_equal(model["w"], before[0] - v)
    scheduled = opt.setup(opt.Adam(eta=lambda t: 0.01 / (1 + t)), {"w": np.ones(20000, np.float32)})
    for _ in range(3):
        ones = {"w": np.ones(20000, np.float32)}
        scheduled, _ = opt.update_(scheduled, ones, dict(ones))
    assert len(numba_lowering._KERNELS) <= known + 1  # (Adam's first program; never one per step)
    assert runs() >= 4


@dataclasses.dataclass(frozen=True)
class Signum(opt.Rule):
    """A user's own elementwise rule: momentum of the gradient, stepping by its sign."""

    eta: float = 0.01
    beta: float = 0.9
    elementwise = True
    never_raises = True

    def init(self, x):
        return ops.zeros_like(x)

    def apply(self, m, x, dx):
        m = ops.scalar(self.beta, x) * m + ops.scalar(1 - self.beta, x) * dx
        return m, ops.scalar(self.eta, x) * ops.sign(m)


@dataclasses.dataclass(frozen=True)
class Normalised(opt.Rule):
    """Claims to be elementwise but divides by the whole gradient's norm: it cannot be traced."""

    eta: float = 0.1
    elementwise = True

    def apply(self, state, x, dx):
        return state, ops.scalar(self.eta, x) * dx / ops.norm(dx, 2)


def test_a_users_own_rule_is_compiled_and_an_untraceable_one_runs_eagerly(monkeypatch, runs):
    rng = np.random.default_rng(2)
    x = rng.standard_normal(20000).astype(np.float32)  # (NumPy compiles from 16K elements)
    g = rng.standard_normal(20000).astype(np.float32)
    state, model = opt.update_(opt.setup(Signum(), {"w": x.copy()}), {"w": x.copy()}, {"w": g})
    m = np.float32(0.1) * g
    np.testing.assert_array_equal(model["w"], x - np.float32(0.01) * np.sign(m))
    assert runs() == 1
    state, model = opt.update_(opt.setup(Normalised(), {"w": x.copy()}), {"w": x.copy()}, {"w": g})
    assert runs() == 1 and (Normalised,) in compiled._UNTRACEABLE
    np.testing.assert_allclose(model["w"], x - np.float32(0.1) * g / np.linalg.norm(g), rtol=1e-6, atol=1e-7)
    assert opt.compiles(Signum()) and not opt.compiles(Normalised())  # (known now, after its step)


def test_compiles_says_which_rules_take_the_compiled_way(monkeypatch):
    clipped = opt.OptimiserChain(opt.ClipNorm(1.0), opt.Adam())
    scaled = (opt.LAMB(), opt.LARS(), opt.Adafactor())  # (Adafactor: its vectors and scalars)
    for rule in (opt.Adam(), opt.Momentum(), clipped, *scaled, opt.LowBit(opt.AdamW())):
        assert opt.compiles(rule), rule
    # (LowBit's quantised pass takes elementwise rules; a ClipNorm chain in it runs eagerly; a
    # scheduled LAMB's factors would need the schedule's value outside its `apply`)
    scheduled = opt.LAMB(eta=lambda t: 1e-3 / (1 + t))
    for rule in (scheduled, opt.Muon(), opt.LowBit(opt.LAMB()), opt.LowBit(clipped)):
        assert not opt.compiles(rule), rule
    x = np.ones(20000, np.float32)
    opt.update_(opt.setup(opt.LowBit(clipped), x), x, x)  # (eager: says nothing of the chain itself)
    assert opt.compiles(clipped)
    monkeypatch.setattr(compiled, "ENABLED", False)
    assert not opt.compiles(opt.Adam())


def test_without_numba_the_eager_maths_runs(monkeypatch, runs):
    monkeypatch.setattr(numba_lowering, "available", lambda: False)
    monkeypatch.setattr(numba_lowering, "_KERNELS", {})
    _, without = _train(CASES["RMSProp"], np.float32, "update_", True, monkeypatch)
    _, eager = _train(CASES["RMSProp"], np.float32, "update_", False, monkeypatch)
    assert runs() == 0
    for k in ("big", "w", "b", "t", "v"):
        np.testing.assert_array_equal(without[k], eager[k])


def test_kernels_are_kept_on_disk_for_the_next_process(tmp_path):
    script = (
        "import numpy as np, optimisers as opt\n"
        "m = {'w': np.ones(20000, np.float32)}\n"
        "s = opt.setup(opt.Lion(0.01), m)\n"
        "s, m = opt.update_(s, m, {'w': np.ones(20000, np.float32)})\n"
        "print(float(m['w'][0]))\n"
    )
    env = dict(os.environ, OPTIMISERS_CACHE=str(tmp_path))
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                             check=True)
        assert float(out.stdout) == pytest.approx(1 - 0.01)
    kernels = tmp_path / "kernels"
    assert len(list(kernels.glob("optimisers_kernel_*.py"))) == 1
    assert list(kernels.glob("__pycache__/optimisers_kernel_*.nbi"))  # numba's index of the compiled code


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_compile_kernels_equal_numbas_and_adjusting_does_not_recompile(dtype, monkeypatch):
    # the kernels of devices numba cannot reach (CUDA) are torch.compile's: tried here on the CPU
    torch = pytest.importorskip("torch")
    from torch._dynamo.utils import counters

    from optimisers.backends import torch as torch_backend

    def train(kind):
        monkeypatch.setattr(torch_backend, "CPU_KERNELS", kind)
        torch.manual_seed(0)
        model = torch.nn.Linear(300, 200).to(getattr(torch, dtype))
        state = opt.setup(opt.OptimiserChain(opt.WeightDecay(0.01), opt.RMSProp(0.01)), model)
        captured = []  # what dynamo has traced after each step: more means it compiled again
        for k in range(4):
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            state = opt.adjust(state, eta=0.01 * (k + 1))
            state, model = opt.update_(state, model, opt.grads(model))
            captured.append(counters["stats"]["calls_captured"])
        return [p.detach().clone() for p in model.parameters()], captured

    (weight, bias), captured = train("inductor")
    assert captured[0] > 0 and captured == captured[:1] * 4  # compiled at the first step only
    (weight_, bias_), _ = train("numba")
    # inductor may fuse a multiply and an add into one rounding (FMA): equal to a rounding (in
    # bfloat16, where a float32 rounding can tip the stored value, torch's own tolerance)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == "float32" else {}
    torch.testing.assert_close(weight, weight_, **tol)
    torch.testing.assert_close(bias, bias_, **tol)


@dataclasses.dataclass(frozen=True)
class PowerStep(opt.Rule):
    """Steps by `eta · 2^dx`: a number raised to an array (`__rpow__`)."""

    eta: float = 0.01
    elementwise = True
    never_raises = True

    def apply(self, state, x, dx):
        return state, ops.scalar(self.eta, x) * (ops.scalar(2.0, x) ** dx)


def test_a_number_raised_to_an_array_is_compiled(runs):
    rng = np.random.default_rng(3)
    x = rng.standard_normal(20000).astype(np.float32)
    g = rng.standard_normal(20000).astype(np.float32)
    _, model = opt.update_(opt.setup(PowerStep(), {"w": x.copy()}), {"w": x.copy()}, {"w": g})
    assert runs() == 1
    np.testing.assert_allclose(model["w"], x - np.float32(0.01) * np.float32(2.0) ** g, rtol=1e-6, atol=1e-7)


def test_a_clipping_factor_is_read_once_for_a_big_member(runs):
    """ClipNorm's factor of a big member is one element the loop reads once (a stride-0 view of
    it kept LLVM from vectorising: ClipNorm>Adam took 3x Adam's time); the packed members'
    factors stay one an element. Both agree with the eager maths (the cases above)."""
    rng = np.random.default_rng(4)
    model = {"big": rng.standard_normal(40000).astype(np.float32), "small": np.ones(7, np.float32)}
    grads = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in model.items()}
    rule = opt.OptimiserChain(opt.ClipNorm(1.0), opt.Adam())
    numba_lowering._KERNELS.clear()
    state = opt.setup(rule, model)
    before = model["big"].copy()
    state, model = opt.update_(state, model, grads)
    assert runs() > 0
    uniform = {key[2] for key in numba_lowering._KERNELS}
    assert () in uniform and any(uniform - {()})
    # the big member's step, written out: the clipped gradient, then Adam's first step
    g = grads["big"] * np.float32(1.0 / max(np.linalg.norm(grads["big"].astype(np.float64)), 1.0))
    np.testing.assert_allclose(model["big"], before - 0.001 * g / (np.abs(g) + 1e-8), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("rule", [opt.LARS(), opt.LAMB(), opt.Momentum()], ids=lambda r: type(r).__name__)
def test_a_step_traces_its_rule_once_not_once_per_array(rule, monkeypatch):
    """A group's big arrays each step on a worker; they share the update's traces (a trace costs
    about as much as stepping 100K elements), so a step of many big arrays traces each of its
    rule's methods once (it traced once per array: LARS, 50 traces a step on S2's layout). A
    state whose scalars are numbers keeps its trace for later updates."""
    from optimisers.backends import traced

    rng = np.random.default_rng(0)
    model = [rng.standard_normal(n).astype(np.float32) for n in [70000, 90000, 80000, 100000] * 3]
    grads = [rng.standard_normal(x.shape).astype(np.float32) for x in model]
    made = []
    original = traced.Recorder

    def counted(*args, **kwargs):
        made.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(traced, "Recorder", counted)
    state = opt.setup(rule, model)
    opt.update_(state, model, grads)
    assert 1 <= len(made) <= 2  # (a scaled rule: its direction, then its step)
    made.clear()
    opt.update_(state, model, grads)
    if isinstance(rule, opt.LAMB):  # (it counts steps: a new count, another trace)
        assert 1 <= len(made) <= 2
    else:
        assert made == []
