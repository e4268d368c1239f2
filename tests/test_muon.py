"""Muon against its oracles, 20 steps each:

- the independent formula of `rule_reference.py` (Newton–Schulz written on the singular values):
  float64 to 1e-12, float32 on NumPy, PyTorch and JAX under `jit` to float32 rounding;
- `torch.optim.Muon`, which runs Newton–Schulz in bfloat16: each update within 5% (Frobenius) of
  torch's, the parameters after 20 steps within 2% of their displacement (bfloat16 keeps 8
  significant bits, a relative rounding of 2⁻⁹ ≈ 0.2% per product; the fifteen matrix products
  of five iterations compound it to 1.5–3% of an update on these small matrices, and the errors
  of successive steps partly cancel: 0.5–0.6% after 20). With its bfloat16 cast taken away it is
  our formula to float32 rounding (1e-4), which shows that bfloat16 is the whole difference;
- `optax.contrib.muon` under `jax.jit` where the formulas coincide (`nesterov=False`, dimension
  numbers (1, 0), see the registry's entry), ties included.

Also: tied weights, a chain, `adjust_`, `freeze_`, a checkpoint round trip, float16/bfloat16,
3-D and 4-D parameters as (dim0, rest) matrices, zero gradients, and the refusal of vectors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optimisers as opt
import rule_reference as ref
from optimisers.tools.bench.peers import OPTAX

torch = pytest.importorskip("torch")

STEPS = 20
SHAPES = {"wide": (8, 12), "tall": (24, 6), "square": (16, 16)}
SETTINGS = {
    "default": dict(eta=0.02),
    "plain": dict(eta=0.02, lambd=0.0, nesterov=False),
    "rms": dict(eta=0.02, beta=0.9, lambd=0.05, scale="match_rms_adamw"),
}
TORCH_NAMES = dict(
    eta="lr", beta="momentum", lambd="weight_decay", nesterov="nesterov", epsilon="eps", scale="adjust_lr_fn"
)

# float32 against float64: a float32 rounding (6e-8) of the iterate, amplified by the quintic's
# slope at 0 (a⁵ ≈ 490) for the smallest singular values, is ~3e-5 of a step at most
FLOAT32 = 1e-4


def initial(shapes=SHAPES, seed=0):
    gen = np.random.default_rng(seed)
    return {k: gen.standard_normal(s) for k, s in shapes.items()}


def gradients(shapes=SHAPES, steps=STEPS, seed=1):
    gen = np.random.default_rng(seed)
    return [
        {k: gen.standard_normal(s) * np.exp(gen.uniform(-1, 1)) for k, s in shapes.items()}
        for _ in range(steps)
    ]


def reference_run(x0, grads, **hyper):
    """The parameters after each step, by rule_reference.muon, one stepper per array (float64)."""
    steppers = {k: ref.muon(**hyper) for k in x0}
    x = {k: v.astype(np.float64) for k, v in x0.items()}
    out = []
    for g in grads:
        x = {k: x[k] - steppers[k](x[k], g[k].astype(np.float64)) for k in x}
        out.append(x)
    return out


def as_numpy(a):
    if isinstance(a, torch.Tensor):
        return a.detach().double().numpy()
    return np.array(a, dtype=np.float64)  # a copy: update_ writes NumPy arrays in place


def to(backend, a, dtype=np.float32):
    if backend == "numpy":
        return a.astype(dtype)
    if backend == "torch":
        return torch.tensor(a.astype(dtype))
    return jnp.asarray(a, dtype)


def our_run(rule, x0, grads, backend="numpy", dtype=np.float32, jit=False):
    model = {k: to(backend, v, dtype) for k, v in x0.items()}
    state = opt.setup(rule, model)
    step = jax.jit(opt.update) if jit else opt.update_
    out = []
    for g in grads:
        state, model = step(state, model, {k: to(backend, v, dtype) for k, v in g.items()})
        out.append({k: as_numpy(v) for k, v in model.items()})
    return out


def assert_near(got, want, x0, rtol, what=""):
    """Every array within `rtol` of its total displacement from `x0`, at every step."""
    for t, (a, b) in enumerate(zip(got, want), start=1):
        for k in b:
            moved = np.abs(b[k] - x0[k]).max()
            err = np.abs(a[k] - b[k]).max()
            assert err <= rtol * moved, f"{what} step {t}, {k}: {err:.3g} of a move of {moved:.3g}"


# --- the reference formula ------------------------------------------------------------------------


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_float64_equals_the_reference_formula(setting):
    x0, grads = initial(), gradients()
    got = our_run(opt.Muon(**SETTINGS[setting]), x0, grads, dtype=np.float64)
    for a, b in zip(got, reference_run(x0, grads, **SETTINGS[setting])):
        for k in b:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_float32_equals_the_reference_formula(setting, backend):
    x0, grads = initial(), gradients()
    got = our_run(opt.Muon(**SETTINGS[setting]), x0, grads, backend, jit=backend == "jax")
    assert_near(got, reference_run(x0, grads, **SETTINGS[setting]), x0, FLOAT32)


def test_conv_filters_and_stacked_heads_are_dim0_by_rest_matrices():
    """A (8, 4, 3, 3) filter steps as the (8, 36) matrix, a (4, 6, 5) stack as (4, 30):
    torch.optim.Muon (2-D only, its bfloat16 cast taken away below) on the flattened copies."""
    shapes = {"conv": (8, 4, 3, 3), "heads": (4, 6, 5)}
    x0, grads = initial(shapes), gradients(shapes)
    got = our_run(opt.Muon(0.02), x0, grads, "torch")
    flat = {k: v.reshape(v.shape[0], -1) for k, v in x0.items()}
    flat_grads = [{k: v.reshape(v.shape[0], -1) for k, v in g.items()} for g in grads]
    with float32_torch_muon():
        theirs = torch_muon_run(flat, flat_grads, dict(eta=0.02))
    want = [{k: v.reshape(shapes[k]) for k, v in x.items()} for x in theirs]
    assert_near(got, want, x0, FLOAT32)


# --- torch.optim.Muon -----------------------------------------------------------------------------


def torch_muon_run(x0, grads, hyper, dtype=torch.float32):
    params = {k: torch.tensor(v).to(dtype).requires_grad_() for k, v in x0.items()}
    kwargs = {TORCH_NAMES[k]: v for k, v in hyper.items()}
    optimizer = torch.optim.Muon(list(params.values()), **kwargs)
    out = []
    for g in grads:
        for k, p in params.items():
            p.grad = torch.tensor(g[k]).to(dtype)
        optimizer.step()
        out.append({k: as_numpy(p) for k, p in params.items()})
    return out


class float32_torch_muon:
    """torch.optim.Muon with its Newton–Schulz in float32: `Tensor.bfloat16`, which it calls on
    the direction, made a copy in the tensor's own dtype."""

    def __enter__(self):
        self.saved = torch.Tensor.bfloat16
        torch.Tensor.bfloat16 = lambda t: t.clone()

    def __exit__(self, *exc):
        torch.Tensor.bfloat16 = self.saved


def step_errors(got, want, x0):
    """For each step, |our update − theirs|_F / |their update|_F, worst over the arrays (each
    update taken from its own run's previous parameters)."""
    errors = []
    ours_before, theirs_before = x0, x0
    for a, b in zip(got, want):
        errors.append(
            max(
                np.linalg.norm((a[k] - ours_before[k]) - (b[k] - theirs_before[k]))
                / np.linalg.norm(b[k] - theirs_before[k])
                for k in b
            )
        )
        ours_before, theirs_before = a, b
    return errors


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_matches_torch_optim_muon_within_its_bfloat16_rounding(setting):
    x0, grads = initial(), gradients()
    got = our_run(opt.Muon(**SETTINGS[setting]), x0, grads, "torch")
    theirs = torch_muon_run(x0, grads, SETTINGS[setting])
    assert max(step_errors(got, theirs, x0)) < 0.05  # each update (measured: up to 3.1%)
    final = max(
        np.linalg.norm(got[-1][k] - theirs[-1][k]) / np.linalg.norm(theirs[-1][k] - x0[k]) for k in x0
    )
    assert final < 0.02  # the rounding errors of 20 steps partly cancel (measured: 0.5–0.6%)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_is_torch_optim_muons_formula_in_float32(setting):
    x0, grads = initial(), gradients()
    got = our_run(opt.Muon(**SETTINGS[setting]), x0, grads, "torch")
    with float32_torch_muon():
        theirs = torch_muon_run(x0, grads, SETTINGS[setting])
    assert max(step_errors(got, theirs, x0)) < FLOAT32


# --- optax.contrib.muon ---------------------------------------------------------------------------


@pytest.mark.parametrize("setting", ["plain", "rms-plain"])
def test_tied_model_under_jit_matches_optax_fed_the_summed_gradient(setting):
    hyper = dict(eta=0.02, nesterov=False)
    if setting == "rms-plain":
        hyper |= dict(beta=0.9, lambd=0.05, scale="match_rms_adamw")
    rule = opt.Muon(**hyper)
    x0, grads = initial(), gradients()
    W = jnp.asarray(x0["wide"], jnp.float32)
    model = {"enc": W, "dec": W, "tall": jnp.asarray(x0["tall"], jnp.float32)}
    state = opt.setup(rule, model)
    tx = OPTAX[opt.Muon](optax, rule)  # the table of peers' mapping
    params = {"w": W, "tall": model["tall"]}
    theirs_state = tx.init(params)

    @jax.jit
    def theirs_step(s, p, g):
        u, s = tx.update(g, s, p)
        return s, optax.apply_updates(p, u)

    update = jax.jit(opt.update)
    gen = np.random.default_rng(2)
    for g in grads:
        other = jnp.asarray(gen.standard_normal(W.shape), jnp.float32)  # the second place's part
        tall = jnp.asarray(g["tall"], jnp.float32)
        enc = jnp.asarray(g["wide"], jnp.float32)
        state, model = update(state, model, {"enc": enc, "dec": other, "tall": tall})
        theirs_state, params = theirs_step(theirs_state, params, {"w": enc + other, "tall": tall})
        np.testing.assert_array_equal(model["enc"], model["dec"])
        for ours, k in (("enc", "w"), ("tall", "tall")):
            moved = float(jnp.max(jnp.abs(params[k] - (W if k == "w" else jnp.asarray(x0["tall"])))))
            assert float(jnp.max(jnp.abs(model[ours] - params[k]))) <= 2e-5 * max(moved, 1e-3)


# --- ties, chains, adjust, freeze, checkpoints ----------------------------------------------------


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("inplace", [True, False], ids=["update_", "update"])
def test_tied_weight_is_stepped_once_on_the_summed_gradient(backend, inplace):
    x0, grads = initial(), gradients()
    W = to(backend, x0["wide"], np.float64)
    model = {"enc": W, "mid": to(backend, x0["square"], np.float64), "dec": W}
    state = opt.setup(opt.Muon(0.02), model)
    # the untied model fed the sum of both places' contributions, g + 0.5·g
    summed = [{"w": 1.5 * g["wide"], "mid": g["square"]} for g in grads]
    want = reference_run({"w": x0["wide"], "mid": x0["square"]}, summed, eta=0.02)
    step = opt.update_ if inplace else opt.update
    for g, expected in zip(grads, want):
        parts = {"enc": g["wide"], "dec": 0.5 * g["wide"], "mid": g["square"]}
        state, new = step(state, model, {k: to(backend, v, np.float64) for k, v in parts.items()})
        assert new["enc"] is new["dec"] and (new["enc"] is W) == inplace
        model = new
        np.testing.assert_allclose(as_numpy(model["enc"]), expected["w"], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(as_numpy(model["mid"]), expected["mid"], rtol=1e-12, atol=1e-12)


def test_in_a_chain_after_clipping():
    x0, grads = initial(), gradients()
    rule = opt.OptimiserChain(opt.ClipGrad(0.5), opt.Muon(0.02, nesterov=False))
    got = our_run(rule, x0, grads, dtype=np.float64)
    steppers = {k: ref.chain(ref.clip_grad(0.5), ref.muon(eta=0.02, nesterov=False)) for k in x0}
    x = dict(x0)
    for g, a in zip(grads, got):
        x = {k: x[k] - steppers[k](x[k], g[k]) for k in x}
        for k in x:
            np.testing.assert_allclose(a[k], x[k], rtol=1e-12, atol=1e-12)


def test_adjust_and_freeze():
    """`adjust_` changes η and λ from the next step on, keeping the momentum; a frozen array
    neither moves nor advances its momentum until it is thawed."""
    x0, grads = initial(), gradients()
    model = {k: v.copy() for k, v in x0.items()}  # update_ writes it
    state = opt.setup(opt.Muon(0.02), model)
    directions = {k: ref.muon(eta=1.0, lambd=0.0) for k in x0}  # s·O: independent of x
    x = dict(x0)
    eta, lambd = 0.02, 0.1
    for t, g in enumerate(grads):
        if t == 5:
            opt.adjust_(state, eta=0.01, lambd=0.3)
            eta, lambd = 0.01, 0.3
        if t == 8:
            opt.freeze_(state["tall"])
        if t == 12:
            opt.thaw_(state["tall"])
        state, model = opt.update_(state, model, g)
        for k in x:
            if k == "tall" and 8 <= t < 12:
                continue
            x[k] = x[k] - eta * directions[k](x[k], g[k]) - eta * lambd * x[k]
        for k in x:
            np.testing.assert_allclose(model[k], x[k], rtol=1e-12, atol=1e-12, err_msg=f"step {t + 1}, {k}")


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_state_dict_round_trip_resumes_bit_for_bit(backend):
    x0, grads = initial(), gradients(steps=8)

    def fresh():
        return {k: to(backend, v) for k, v in x0.items()}

    def run(state, model, gs):
        for g in gs:
            state, model = opt.update(state, model, {k: to(backend, v) for k, v in g.items()})
        return state, model

    rule = opt.Muon(0.02)
    full_state, full = run(opt.setup(rule, fresh()), fresh(), grads)
    state, model = run(opt.setup(rule, fresh()), fresh(), grads[:4])
    saved = opt.state_dict(state)
    resumed = opt.load_state_dict(opt.setup(rule, model), saved)
    _, resumed_model = run(resumed, model, grads[4:])
    for k in x0:
        np.testing.assert_array_equal(as_numpy(resumed_model[k]), as_numpy(full[k]))


# --- half precision ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_keeps_its_dtype_and_is_no_worse_than_torch(dtype):
    """State in the parameter's dtype; the iteration in float32, so no further from the float64
    run than torch.optim.Muon (bfloat16 iteration, two roundings of the parameter per step)."""
    x0, grads = initial(), gradients()
    hyper = dict(eta=0.02)
    exact = reference_run(x0, grads, **hyper)[-1]
    model = {k: torch.tensor(v).to(dtype) for k, v in x0.items()}
    state = opt.setup(opt.Muon(**hyper), model)
    for g in grads:
        state, model = opt.update_(state, model, {k: torch.tensor(v).to(dtype) for k, v in g.items()})
    assert all(x.dtype == dtype for x in model.values())
    assert all(leaf.state.dtype == dtype for leaf in state.leaves())
    theirs = torch_muon_run(x0, grads, hyper, dtype)[-1]
    for k in x0:
        mine, bar = np.abs(as_numpy(model[k]) - exact[k]).max(), np.abs(theirs[k] - exact[k]).max()
        assert np.isfinite(mine) and mine <= 1.01 * bar, f"{k}: {mine:.3g} against torch's {bar:.3g}"


# --- edge cases ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_zero_gradient_leaves_only_the_weight_decay(backend):
    x = to(backend, initial()["wide"])
    model = {"w": x, "zero": to(backend, np.zeros((3, 5)))}
    state = opt.setup(opt.Muon(0.02, lambd=0.1), model)
    zeros = {k: to(backend, np.zeros(tuple(v.shape))) for k, v in model.items()}
    state, new = opt.update(state, model, zeros)
    np.testing.assert_allclose(as_numpy(new["w"]), as_numpy(x) * (1 - 0.02 * 0.1), rtol=1e-6)
    np.testing.assert_array_equal(as_numpy(new["zero"]), np.zeros((3, 5)))


def test_tall_matrix_steps_as_the_transpose_of_the_wide_one():
    x0, grads = initial({"w": (6, 10)}), gradients({"w": (6, 10)})
    wide = our_run(opt.Muon(0.02, scale="match_rms_adamw"), x0, grads, dtype=np.float64)
    tall = our_run(
        opt.Muon(0.02, scale="match_rms_adamw"),
        {"w": x0["w"].T},
        [{"w": g["w"].T} for g in grads],
        dtype=np.float64,
    )
    for a, b in zip(wide, tall):
        np.testing.assert_allclose(a["w"], b["w"].T, rtol=1e-12, atol=1e-12)


def test_vectors_are_refused_at_setup_naming_their_path():
    model = {"layers": [{"w": np.ones((4, 4)), "b": np.zeros(4)}], "scale": np.array(1.0)}
    with pytest.raises(ValueError, match=r"the parameter at layers\.0\.b: .*1-D.*AdamW"):
        opt.setup(opt.Muon(), model)
    with pytest.raises(ValueError, match=r"the parameter at scale: .*0-D"):
        opt.setup(opt.Muon(), {"scale": np.array(1.0)})
    layer = torch.nn.Linear(3, 4)
    with pytest.raises(ValueError, match=r"the parameter at bias: "):
        opt.setup(opt.Muon(), layer)
    # what the message says to do
    state = opt.setup(lambda path, x: opt.Muon() if x.ndim >= 2 else opt.AdamW(), model)
    assert isinstance(state["layers"][0]["w"].rule, opt.Muon)
    assert isinstance(state["layers"][0]["b"].rule, opt.AdamW)
    with pytest.raises(TypeError, match=r"the parameter at w: Muon is not defined for complex"):
        opt.setup(opt.Muon(), {"w": np.ones((2, 2), np.complex64)})


def test_hyperparameters_are_checked():
    for bad, match in [
        (dict(scale="spectral"), "scale must be one of"),
        (dict(ns_steps=-1), "ns_steps"),
        (dict(beta=1.5), "beta"),
        (dict(lambd=-0.1), "lambd"),
        (dict(ns_coefficients=(1.0, 2.0)), "ns_coefficients"),
    ]:
        with pytest.raises((ValueError, TypeError), match=match):
            opt.Muon(**bad)
    with pytest.raises(TypeError):
        opt.Muon(0.1, 0.9, 0.0, False)  # nesterov and the rest are keyword only


def test_generic_torch_optimizer_refuses_a_vector_at_its_first_step_changing_nothing():
    import optimisers.torch as ot

    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 4)
    before = [p.detach().clone() for p in layer.parameters()]
    optimizer = ot.Optimizer(layer, opt.Muon())  # state is made lazily, at the first gradient
    layer(torch.randn(2, 3)).sum().backward()
    with pytest.raises(ValueError, match=r"parameter 1: Muon orthogonalises matrices"):
        optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(layer.parameters(), before))
    assert optimizer.state_dict()["state"] == {}
    # routed per parameter, as the message says
    optimizer = ot.Optimizer(layer, lambda path, x: opt.Muon() if x.ndim >= 2 else opt.AdamW())
    optimizer.step()
    assert not torch.equal(layer.weight, before[0]) and not torch.equal(layer.bias, before[1])
