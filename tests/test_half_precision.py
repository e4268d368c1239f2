"""float16 and bfloat16 parameters: every update runs the rule in float32 and stores the parameter
and its optimiser state in the parameter's dtype, as torch's fused kernels do, on every backend.

The measure is the error against a float64 run of the same maths from the same (half-rounded)
starting point and gradients. Storing in half precision costs accuracy whoever does it; the bar is
torch: no worse than `torch.optim.*(fused=True)` where torch has a fused CPU kernel (it computes
in float32 and stores in the parameter's dtype), and no worse than torch's for-loop
implementation elsewhere.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import optimisers as opt
import optimisers.torch as opt_torch
from optimisers.core.state import flatten_state, leaf_paths
from rules_registry import RULES as REGISTRY
from rules_registry import shaped, torch_cases

jnp = pytest.importorskip("jax.numpy")
ml_dtypes = pytest.importorskip("ml_dtypes")  # NumPy's bfloat16 (a dependency of JAX)

pytestmark = pytest.mark.usefixtures("single_thread")

STEPS = 30
SIZE = 4096
DTYPES = {"float16": (np.float16, torch.float16), "bfloat16": (ml_dtypes.bfloat16, torch.bfloat16)}

# the rules of rules_registry.py's family `half` with their torch.optim counterparts, by name
CASES = {case.name: case for case in torch_cases("half")}
# torch's fused SGD with nesterov=True lands further from the float64 run in float16 than its
# for-loop implementation does: the stricter bar is kept
FOR_LOOP_BAR = {"Nesterov"}

# The fused comparison is of the same float32 arithmetic in another order: where an element's
# float32 value lies within a float32 rounding of a half-precision rounding boundary, the two
# store neighbouring half values, one half-ulp apart. 1% above torch's error allows a few such
# elements; a blow-up (the float16 second moment underflowing) is orders of magnitude.
FACTOR = 1.01


def _inputs(dtype):
    """Parameters of scale 0.05 and gradients of scale 1e-4 (|g|²·(1−β₂) is far below float16's
    smallest number), rounded to `dtype`, as float64 arrays."""
    rng = np.random.default_rng(0)
    x = (0.05 * rng.standard_normal(SIZE)).astype(dtype).astype(np.float64)
    gs = [(1e-4 * rng.standard_normal(SIZE)).astype(dtype).astype(np.float64) for _ in range(STEPS)]
    return x, gs


def _to(backend, a, name):
    np_dtype, torch_dtype = DTYPES[name]
    if backend == "numpy":
        return a.astype(np_dtype)
    if backend == "torch":
        return torch.tensor(a).to(torch_dtype)
    return jnp.asarray(a.astype(np.float32), dtype=np_dtype)


def _as_float64(a):
    if isinstance(a, torch.Tensor):
        return a.detach().double().numpy()
    return np.asarray(a).astype(np.float64)


def train_ours(rule, backend, name, path="update"):
    x, gs = _inputs(DTYPES[name][0])
    shape = shaped(rule, x.shape)  # as many axes as the rule needs
    model = {"w": _to(backend, x.reshape(shape), name)}
    state = opt.setup(rule, model)
    for g in gs:
        state, model = getattr(opt, path)(state, model, {"w": _to(backend, g.reshape(shape), name)})
    return state, model


def train_float64(rule, name):
    x, gs = _inputs(DTYPES[name][0])
    shape = shaped(rule, x.shape)
    model = {"w": x.reshape(shape)}
    state = opt.setup(rule, model)
    for g in gs:
        state, model = opt.update(state, model, {"w": g.reshape(shape)})
    return model["w"].reshape(x.shape)


def train_torch(make, name, **implementation):
    x, gs = _inputs(DTYPES[name][0])
    p = torch.nn.Parameter(_to("torch", x, name))
    optimizer = make([p], **implementation)
    for g in gs:
        p.grad = _to("torch", g, name)
        optimizer.step()
    return p.detach()


def error(result, reference) -> float:
    e = np.abs(_as_float64(result) - reference).max()
    return float(e) if np.isfinite(e) else np.inf  # NaN: as bad as it gets


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("rule", list(CASES))
def test_no_worse_than_torch(rule, name, backend):
    case = CASES[rule]
    reference = train_float64(case.ours(), name)
    fused = case.fused and rule not in FOR_LOOP_BAR
    implementation = {"fused": True} if fused else {"foreach": False}
    bar = error(train_torch(case.theirs, name, **implementation), reference)
    _, model = train_ours(case.ours(), backend, name)
    assert model["w"].dtype == _to(backend, np.zeros(1), name).dtype
    mine = error(model["w"], reference)
    assert np.isfinite(mine)
    assert mine <= FACTOR * bar, f"{rule} {name} {backend}: error {mine:.3g}, torch's {bar:.3g}"


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("name", list(DTYPES))
def test_adam_first_step_is_at_most_the_learning_rate(backend, name):
    """Adam's first step is η·g/(|g| + ε) per element: never more than η, however small g is.
    Computed in half precision, |g|² underflows and elements moved by tens."""
    x, gs = _inputs(DTYPES[name][0])
    model = {"w": _to(backend, x, name)}
    _, new = opt.update(opt.setup(opt.Adam(1e-3), model), model, {"w": _to(backend, gs[0], name)})
    moved = np.abs(_as_float64(new["w"]) - x).max()
    bits = {"float16": 10, "bfloat16": 7}[name]  # stored fraction bits
    rounding = 2.0 ** (np.floor(np.log2(np.abs(x).max())) - bits)  # one unit in the last place
    assert 5e-4 < moved <= 1e-3 + rounding  # η, give or take the rounding of the parameter


# every registered rule, at its `half` hyperparameters where it has them, else its first `toy` ones
ALL_RULES = {
    info.case_id(h): (lambda i=info, h=h: i.make(h))
    for info in REGISTRY
    for h in (info.half or info.toy)[:1]
}


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("rule", list(ALL_RULES))
def test_state_stays_in_the_parameters_dtype_and_both_paths_agree(rule, name, backend, tiny_chunks):
    """Pure and in place, through the engine's chunks (several per parameter here) and the
    per-Leaf path alike: the same numbers bit for bit, state in the parameter's dtype."""
    make = ALL_RULES[rule]
    pure_state, pure = train_ours(make(), backend, name, "update")
    state, model = train_ours(make(), backend, name, "update_")
    np.testing.assert_array_equal(_as_float64(model["w"]), _as_float64(pure["w"]))
    dtype = model["w"].dtype
    arrays = [_state_arrays(s) for s in (state, pure_state)]
    has_state = bool(_state_arrays(opt.setup(make(), {"w": np.zeros(shaped(make(), (4,)))})))
    assert bool(arrays[0]) == has_state and all(p.dtype == dtype for parts in arrays for p in parts)
    for a, b in zip(*arrays, strict=True):
        np.testing.assert_array_equal(_as_float64(a), _as_float64(b))


def _state_arrays(state) -> list:
    parts: list = []
    for leaf in (leaf for _, leaf in leaf_paths(state.tree)):
        opt_parts: list = []
        flatten_state(leaf.state, opt_parts)
        parts.extend(p for p in opt_parts if getattr(p, "shape", ()) != ())
    return parts


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("name", list(DTYPES))
def test_checkpoint_resumes_bit_for_bit(backend, name):
    x, gs = _inputs(DTYPES[name][0])
    model = {"w": _to(backend, x, name)}
    state = opt.setup(opt.Adam(1e-3), model)
    for g in gs[:10]:
        state, model = opt.update_(state, model, {"w": _to(backend, g, name)})
    saved = opt.state_dict(state)
    resumed = opt.load_state_dict(opt.setup(opt.Adam(1e-3), model), saved)
    copy = {"w": _to(backend, _as_float64(model["w"]), name)}
    for g in gs[10:]:
        state, model = opt.update_(state, model, {"w": _to(backend, g, name)})
        resumed, copy = opt.update_(resumed, copy, {"w": _to(backend, g, name)})
    np.testing.assert_array_equal(_as_float64(copy["w"]), _as_float64(model["w"]))


@pytest.mark.parametrize("name", list(DTYPES))
def test_jax_jit_matches_eager(name):
    import jax

    x, gs = _inputs(DTYPES[name][0])
    model = {"w": _to("jax", x, name)}
    state = opt.setup(opt.Adam(1e-3), model)
    step = jax.jit(opt.update)
    eager_state, eager = state, model
    # gradients of 1e-2: above float16's subnormals, which XLA's compiled code may flush to zero
    for g in gs[:5]:
        g = {"w": _to("jax", 100 * g, name)}
        state, model = step(state, model, g)
        eager_state, eager = opt.update(eager_state, eager, g)
    # XLA fuses and reorders the float32 arithmetic, so an element may land on the neighbouring
    # half-precision value: at most one unit in the last place apart
    bits = {"float16": 10, "bfloat16": 7}[name]
    ulp = 2.0 ** (np.floor(np.log2(np.abs(x).max() * 1.1)) - bits)
    difference = np.abs(_as_float64(model["w"]) - _as_float64(eager["w"]))
    assert difference.max() <= ulp and np.mean(difference > 0) < 0.05
    assert model["w"].dtype == eager["w"].dtype == DTYPES[name][0]


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("rule", ["Adam", "AdamW"])
def test_torch_adapter_takes_torch_fused_steps(rule, name):
    """Through `optimisers.torch.Optimizer`, Adam and AdamW on half-precision parameters run
    torch's own fused kernel: torch.optim's fused numbers exactly, moments in the parameter's
    dtype as torch keeps them."""
    ours, theirs = CASES[rule].ours, CASES[rule].theirs
    expected = train_torch(theirs, name, fused=True)
    x, gs = _inputs(DTYPES[name][0])
    p = torch.nn.Parameter(_to("torch", x, name))
    optimizer = opt_torch.Optimizer([p], ours())
    for g in gs:
        p.grad = _to("torch", g, name)
        optimizer.step()
    assert torch.equal(p.detach(), expected)
    moments = [v for v in optimizer.state[p].values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    assert moments and all(m.dtype == p.dtype for m in moments)
