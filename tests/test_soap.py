"""SOAP against the independent reference formula of `rule_reference.py` (written from the paper's
algorithm and the reference implementation's choices, in float64) and against heavyball's `SOAP`:
25 steps, so two eigenbasis refreshes at the default frequency, on random and tied models, on
NumPy, PyTorch and JAX under `jit`, in a chain, through `adjust` and `freeze_`, a checkpoint
round trip, float16/bfloat16 and strided layouts.

The models have no axis longer than the product of the others plus one: there a first
preconditioner G Gᵀ has a repeated zero eigenvalue, whose eigenvectors each LAPACK chooses its own
way (each a valid SOAP step), so two implementations agree only without such axes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import optimisers as opt
import rule_reference as ref

STEPS = 25
SHAPES = {"w": (4, 5), "k": (2, 3, 4), "b": (2,), "s": ()}
HYPER = {
    "default": {},
    "often": dict(precondition_frequency=3, beta=(0.9, 0.99), shampoo_beta=0.8, epsilon=1e-6, lambd=0.1),
    "max_dim": dict(precondition_frequency=4, max_precond_dim=4),
    "1d": dict(precondition_frequency=5, precondition_1d=True, eta=0.01),
}
# float64 maths differ from the reference's by rounding only; float32 by float32 rounding,
# which the eigenbases amplify by their conditioning
TOLERANCE = {np.float64: 1e-11, np.float32: 1e-4}


def initial_model(seed=0):
    gen = np.random.default_rng(seed)
    return {k: gen.standard_normal(s) for k, s in SHAPES.items()}


def gradients(steps=STEPS, seed=1, names=SHAPES):
    gen = np.random.default_rng(seed)
    return [
        {k: gen.standard_normal(SHAPES[k]) * np.exp(gen.uniform(-1.5, 2)) for k in names}
        for _ in range(steps)
    ]


def rounded(tree, dtype):
    """The values as the library sees them in `dtype`, back in float64."""
    return {k: np.asarray(v, dtype=dtype).astype(np.float64) for k, v in tree.items()}


def reference_trajectory(hyper, x0, grads, adjust_at=None, dtype=np.float64):
    """The reference's parameters after each step, from the parameters and gradients rounded to
    `dtype`; with `adjust_at`, η halves before that step."""
    steppers = {k: ref.soap(**hyper) for k in x0}
    x = rounded(x0, dtype)
    out = []
    for t, g in enumerate(grads):
        g = rounded(g, dtype)
        for k, step in steppers.items():
            if t == adjust_at:
                step.eta = step.eta / 2
            u = step(x[k], g[k])
            x[k] = x[k] if u is None else x[k] - u
        out.append({k: v.copy() for k, v in x.items()})
    return out


def to_backend(tree, backend, dtype=np.float64):
    if backend == "torch":
        return {k: torch.tensor(np.asarray(v, dtype=dtype)) for k, v in tree.items()}
    if backend == "jax":
        return {k: jnp.asarray(np.asarray(v, dtype=dtype)) for k, v in tree.items()}
    return {k: np.asarray(v, dtype=dtype).copy() for k, v in tree.items()}


def host(x):
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).numpy().copy()
    return np.array(x, dtype=np.float64)


def our_trajectory(rule, x0, grads, backend, dtype=np.float64, adjust_at=None):
    model = to_backend(x0, backend, dtype)
    state = opt.setup(rule, model)
    update = jax.jit(opt.update) if backend == "jax" else opt.update
    out = []
    for t, g in enumerate(grads):
        if t == adjust_at:
            state = opt.adjust(state, eta=rule.eta / 2)
        g = to_backend(g, backend, dtype)
        if backend == "torch":
            opt.update_(state, model, g)
        else:
            state, model = update(state, model, g)
        out.append({k: host(v) for k, v in model.items()})
    return out


def assert_close(ours, theirs, x0, tol, keys=None):
    """Each array after each step within `tol` of the reference, relative to how far the reference
    has moved that array (the steps are ~η, much smaller than the parameters)."""
    for t, (mine, want) in enumerate(zip(ours, theirs), start=1):
        for k in keys or want:
            moved = np.max(np.abs(want[k] - np.asarray(x0[k], dtype=np.float64)), initial=0.0)
            assert np.all(np.isfinite(mine[k])), f"step {t}, {k}"
            err = np.max(np.abs(mine[k] - want[k]), initial=0.0)
            assert err <= tol * max(moved, 1e-3), f"step {t}, {k}: {err:.3g} off, moved {moved:.3g}"


def soap(name):
    return opt.SOAP(**HYPER[name])


BACKENDS = [("numpy", np.float64), ("torch", np.float64), ("torch", np.float32), ("jax", np.float32)]


@pytest.mark.parametrize("backend, dtype", BACKENDS, ids=lambda v: getattr(v, "__name__", v))
@pytest.mark.parametrize("name", list(HYPER))
def test_matches_the_reference_formula(name, backend, dtype):
    x0, grads = initial_model(), gradients()
    ours = our_trajectory(soap(name), x0, grads, backend, dtype)
    want = reference_trajectory(HYPER[name], x0, grads, dtype=dtype)
    assert_close(ours, want, rounded(x0, dtype), TOLERANCE[dtype])


@pytest.mark.parametrize("backend, dtype", BACKENDS, ids=lambda v: getattr(v, "__name__", v))
def test_a_tied_array_steps_by_the_summed_gradient(backend, dtype):
    """One array at two places: the untied reference fed the sum of the two gradients."""
    x0 = initial_model()
    w = to_backend({"w": x0["w"]}, backend, dtype)["w"]
    model = {"a": w, "k": to_backend({"k": x0["k"]}, backend, dtype)["k"], "tied": w}
    halves = gradients(seed=2, names=("w",))
    grads = [{"a": g["w"], "k": g["k"], "tied": 0.5 * h["w"]} for g, h in zip(gradients(), halves)]
    summed = [{"w": g["a"] + g["tied"], "k": g["k"]} for g in grads]
    summed = [rounded(g, dtype) for g in summed]  # each half rounded, then summed in float64
    want = reference_trajectory({}, {"w": x0["w"], "k": x0["k"]}, summed, dtype=dtype)

    state = opt.setup(opt.SOAP(), model)
    update = jax.jit(opt.update) if backend == "jax" else opt.update
    for t, g in enumerate(grads):
        g = to_backend(g, backend, dtype)
        if backend == "torch":
            opt.update_(state, model, g)
        else:
            state, model = update(state, model, g)
        np.testing.assert_array_equal(host(model["a"]), host(model["tied"]))
        mine = {"w": host(model["a"]), "k": host(model["k"])}
        assert_close([mine], [want[t]], rounded(x0, dtype), TOLERANCE[dtype])
    if backend != "jax":
        assert model["a"] is model["tied"]


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_adjusting_the_learning_rate(backend):
    x0, grads = initial_model(), gradients()
    dtype = np.float32 if backend == "jax" else np.float64
    ours = our_trajectory(soap("often"), x0, grads, backend, dtype, adjust_at=12)
    want = reference_trajectory(HYPER["often"], x0, grads, adjust_at=12, dtype=dtype)
    assert_close(ours, want, rounded(x0, dtype), TOLERANCE[dtype])


def test_in_a_chain_after_clipping():
    x0, grads = initial_model(), gradients()
    ours = our_trajectory(opt.OptimiserChain(opt.ClipGrad(1.0), opt.SOAP()), x0, grads, "numpy")
    clipped = [{k: np.clip(v, -1.0, 1.0) for k, v in g.items()} for g in grads]
    assert_close(ours, reference_trajectory({}, x0, clipped), x0, TOLERANCE[np.float64])


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_a_frozen_array_keeps_its_value_and_state_and_the_others_their_steps(backend):
    x0, grads = initial_model(), gradients()
    want = reference_trajectory({}, x0, grads)
    model = to_backend(x0, backend)
    state = opt.setup(opt.SOAP(), model)
    for t, g in enumerate(grads):
        if t == 5:
            opt.freeze_(state["k"])
            frozen = host(model["k"])
        opt.update_(state, model, to_backend(g, backend))
        assert_close([{k: host(v) for k, v in model.items()}], [want[t]], x0, 1e-9, keys=("w", "b", "s"))
    np.testing.assert_array_equal(host(model["k"]), frozen)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_a_checkpoint_round_trip_continues_bit_for_bit(backend):
    """Saved mid-run between the two refreshes, loaded into a fresh setup, the run goes on as
    if never interrupted."""
    x0, grads = initial_model(), gradients()
    full = our_trajectory(opt.SOAP(), x0, grads, backend)[-1]

    model = to_backend(x0, backend)
    state = opt.setup(opt.SOAP(), model)
    for g in grads[:14]:
        state, model = opt.update(state, model, to_backend(g, backend))
    saved = opt.state_dict(state)
    state = opt.load_state_dict(opt.setup(opt.SOAP(), model), saved)
    for g in grads[14:]:
        state, model = opt.update(state, model, to_backend(g, backend))
    for k in SHAPES:
        np.testing.assert_array_equal(host(model[k]), full[k])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_parameters_follow_the_reference_to_their_rounding(dtype):
    """The update runs SOAP on float32 copies; the parameters and state keep the half dtype.
    Each step is rounded to the parameter's precision, so the trajectories part by about half
    a unit in the last place per step."""
    x0 = {k: torch.tensor(v).to(dtype) for k, v in initial_model().items()}
    start = {k: host(v) for k, v in x0.items()}
    grads = [{k: torch.tensor(v).to(dtype) for k, v in g.items()} for g in gradients()]
    hyper = dict(eta=0.05)
    want = reference_trajectory(hyper, start, [{k: host(v) for k, v in g.items()} for g in grads])
    model = {k: v.clone() for k, v in x0.items()}
    state = opt.setup(opt.SOAP(**hyper), model)
    ulp = float(torch.finfo(dtype).eps)
    for t, g in enumerate(grads, start=1):
        opt.update_(state, model, g)
        for k, v in model.items():
            assert v.dtype == dtype
            scale = np.max(np.abs(want[t - 1][k]), initial=1.0)
            err = np.max(np.abs(host(v) - want[t - 1][k]), initial=0.0)
            assert err <= t * ulp * scale, f"step {t}, {k}: {err:.3g}"
    m, v, ls, qs, count = state["w"].state
    assert count == STEPS and {m.dtype, v.dtype, ls[0].dtype, qs[1].dtype} == {dtype}


@pytest.mark.parametrize("layout", ["channels_last", "transposed"])
def test_strided_parameters_step_like_contiguous_ones_to_rounding(layout):
    gen = np.random.default_rng(3)
    shape = (2, 3, 4, 3) if layout == "channels_last" else (5, 4)
    x0 = gen.standard_normal(shape)
    grads = [gen.standard_normal(shape) * np.exp(gen.uniform(-1, 1)) for _ in range(STEPS)]

    def strided(a):
        t = torch.tensor(a)
        if layout == "channels_last":
            return t.contiguous(memory_format=torch.channels_last)
        return torch.tensor(np.ascontiguousarray(a.T)).T

    plain, odd = torch.tensor(x0), strided(x0)
    assert not odd.is_contiguous()
    states = [opt.setup(opt.SOAP(precondition_frequency=4), {"x": x}) for x in (plain, odd)]
    for g in grads:
        opt.update_(states[0], {"x": plain}, {"x": torch.tensor(g)})
        opt.update_(states[1], {"x": odd}, {"x": strided(g)})
    assert not odd.is_contiguous()
    np.testing.assert_allclose(odd.numpy(), plain.numpy(), rtol=1e-12, atol=1e-12)


def test_the_refresh_keeps_the_bases_orthogonal_and_runs_under_jit_without_retracing():
    traces = []

    @jax.jit
    def step(state, model, grads):
        traces.append(1)
        return opt.update(state, model, grads)

    model = {"w": jnp.asarray(initial_model()["w"], jnp.float32)}
    state = opt.setup(opt.SOAP(precondition_frequency=2), model)
    for g in gradients(names=("w",)):
        state, model = step(state, model, {"w": jnp.asarray(g["w"], jnp.float32)})
    assert len(traces) == 1
    _, _, _, qs, count = state["w"].state
    assert int(count) == STEPS
    for q in qs:
        np.testing.assert_allclose(np.asarray(q.T @ q), np.eye(q.shape[0]), atol=1e-5)


def test_first_step_builds_the_bases_without_moving():
    x = np.random.default_rng(0).standard_normal((3, 4))
    state = opt.setup(opt.SOAP(), {"x": x})
    state, new = opt.update(state, {"x": x}, {"x": np.ones((3, 4))})
    np.testing.assert_array_equal(new["x"], x)
    m, v, ls, qs, count = state["x"].state
    assert count == 1 and not m.any() and not v.any()
    np.testing.assert_allclose(ls[0], 0.05 * 4 * np.ones((3, 3)))


def test_large_axes_and_vectors_get_no_basis():
    state = opt.SOAP(max_precond_dim=4).init(np.zeros((5, 3)))
    assert state[2][0] is None and state[2][1].shape == (3, 3)
    assert opt.SOAP().init(np.zeros(6))[2] == (None,)
    assert opt.SOAP(precondition_1d=True).init(np.zeros(6))[2][0].shape == (6, 6)
    assert opt.SOAP().init(np.zeros(()))[2] == ()


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(beta=(0.9, 1.0)), ValueError),
        (dict(shampoo_beta=1.0), ValueError),
        (dict(precondition_frequency=0), ValueError),
        (dict(precondition_frequency=2.5), TypeError),
        (dict(max_precond_dim=-1), ValueError),
        (dict(epsilon=-1e-8), ValueError),
        (dict(eta=-1.0), ValueError),
    ],
)
def test_invalid_hyperparameters_are_rejected(kwargs, error):
    with pytest.raises(error):
        opt.SOAP(**kwargs)


def test_complex_parameters_are_rejected():
    with pytest.raises(TypeError, match="SOAP"):
        opt.setup(opt.SOAP(), {"w": np.ones((2, 2), complex)})


@pytest.mark.parametrize("shape", [(4, 5), (2, 3, 4), (7,)])
def test_agrees_with_heavyball_through_the_first_refresh(shape, monkeypatch):
    """heavyball's SOAP at the original's settings (its defaults differ: betas (0.9, 0.95),
    frequency 2, max_precond_dim 2048, merge_dims=True), on its eager path. It differs by design
    in small ways: decay before the step (a difference of order η²λ per step), its QR lifts the
    null space by ~64·n·ε₃₂, and it refreshes when a cumulative 1/f per call crosses an integer:
    at f = 10 that is call 11 as ours (0.1 summed ten times is just under 1) but call 20 where
    ours is 21, so the runs are compared over the first 19 calls."""
    import heavyball

    monkeypatch.setattr(heavyball.utils, "compile_mode", None)
    gen = np.random.default_rng(4)
    x0 = gen.standard_normal(shape).astype(np.float32)
    scales = np.exp(gen.uniform(-1.5, 2, size=19))
    grads = [(gen.standard_normal(shape) * s).astype(np.float32) for s in scales]
    p = torch.nn.Parameter(torch.tensor(x0))
    theirs = heavyball.SOAP(
        [p],
        lr=3e-3,
        betas=(0.95, 0.95),
        shampoo_beta=0.95,
        eps=1e-8,
        weight_decay=0.01,
        precondition_frequency=10,
        max_precond_dim=10000,
        merge_dims=False,
        precondition_1d=False,
        warmup_steps=0,
    )
    state, model = opt.setup(opt.SOAP(), {"x": x0}), {"x": x0}
    for t, g in enumerate(grads, start=1):
        p.grad = torch.tensor(g)
        theirs.step()
        state, model = opt.update(state, model, {"x": g})
        moved = np.max(np.abs(model["x"] - x0))
        err = np.max(np.abs(p.detach().numpy() - model["x"]))
        assert err <= 1e-3 * max(moved, 1e-3), f"step {t}: {err:.3g} off, moved {moved:.3g}"


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("bad_call", [0, 3], ids=["first", "refresh"])
def test_a_nan_gradient_gives_nan_steps_as_in_adam_and_skip_non_finite_skips_it(backend, bad_call):
    """NumPy's and PyTorch's eigh and qr raise on NaN; SOAP gives NaN steps on every backend (the
    NaN reaches the parameter at the next move), and SkipNonFinite skips the step."""
    x0, grads = initial_model(), gradients(steps=6)
    grads[bad_call] = {k: np.full_like(v, np.nan) for k, v in grads[bad_call].items()}
    dtype = np.float32 if backend == "jax" else np.float64
    rule = opt.SOAP(precondition_frequency=2)
    last = our_trajectory(rule, x0, grads, backend, dtype)[-1]
    assert np.isnan(last["w"]).all() and np.isnan(last["k"]).all()
    skipping = our_trajectory(opt.SkipNonFinite(rule), x0, grads, backend, dtype)[-1]
    kept = [g for t, g in enumerate(grads) if t != bad_call]
    want = reference_trajectory({"precondition_frequency": 2}, x0, kept, dtype=dtype)[-1]
    assert_close([skipping], [want], rounded(x0, dtype), TOLERANCE[dtype])


def test_skip_non_finite_under_jit_keeps_none_parts_of_a_state():
    """SOAP's axes without a basis (and Descent's state) are None; SkipNonFinite under jit selects
    between the old and new state part by part, and has nothing to select for those."""
    model = {"b": jnp.ones(3), "w": jnp.ones((2, 2))}
    rule = opt.SkipNonFinite(opt.OptimiserChain(opt.Descent(0.1), opt.SOAP()))
    state = opt.setup(rule, model)
    for g in (1.0, np.nan, 1.0):
        grads = {k: jnp.full_like(v, g) for k, v in model.items()}
        state, model = jax.jit(opt.update)(state, model, grads)
    assert state["b"].state[1] == 1  # one skipped
    assert all(bool(jnp.isfinite(v).all()) for v in model.values())
