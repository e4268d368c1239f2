"""Adafactor against torch.optim.Adafactor (its maths) and optax.adafactor (at the settings where
the two coincide, see the rule's docstring) where the generic tests of `rules_registry.py` do not
reach: matrices, 3-D and 4-D arrays (factored over their last two dimensions), vectors and scalars
(a full second moment) in one model; a tied weight; NumPy, PyTorch and JAX under `jit`; in a
chain, through `adjust` and `freeze_`, across a checkpoint; float16/bfloat16; the state's size; sharded
JAX matrices (the factors sharded as the rows and columns).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optimisers as opt
from optimisers import ops
from optimisers.engine import compiled

torch = pytest.importorskip("torch")

STEPS = 25
# a matrix, 3-D and 4-D arrays (factored over the last two axes), a vector and a scalar (not)
SHAPES = {"w": (5, 7), "t": (3, 4, 6), "k": (2, 3, 4, 5), "b": (7,), "s": ()}
CUSTOM = dict(eta=0.05, beta2_decay=-0.6, epsilon=(1e-20, 1e-2), d=1.5, lambd=0.1)
HYPER = {"defaults": {}, "custom": CUSTOM}


def torch_kwargs(eta=1e-2, beta2_decay=-0.8, epsilon=(None, 1e-3), d=1.0, lambd=0.0):
    return dict(lr=eta, beta2_decay=beta2_decay, eps=epsilon, d=d, weight_decay=lambd)


def initial_model(shapes=SHAPES, seed=0):
    gen = np.random.default_rng(seed)
    return {k: gen.standard_normal(s) for k, s in shapes.items()}


def gradients(shapes=SHAPES, steps=STEPS, seed=1):
    """Gradients of varying scale, no exact zeros (ε's placement differs from optax's at 0)."""
    gen = np.random.default_rng(seed)
    return [
        {k: gen.standard_normal(s) * np.exp(gen.uniform(-1.5, 1.5)) for k, s in shapes.items()}
        for _ in range(steps)
    ]


def torch_trajectory(x0, grads, dtype=np.float64, before_step=None, **hyper):
    """torch.optim.Adafactor's parameters after each step (a None gradient: no gradient there);
    `before_step(t, optimizer, params)` may change the optimizer or the gradients first."""
    tdtype = {np.float64: torch.float64, np.float32: torch.float32}[dtype]
    params = {k: torch.nn.Parameter(torch.tensor(v, dtype=tdtype)) for k, v in x0.items()}
    optimizer = torch.optim.Adafactor(list(params.values()), **torch_kwargs(**hyper))
    out = []
    for t, g in enumerate(grads):
        for k, p in params.items():
            p.grad = None if g.get(k) is None else torch.tensor(g[k], dtype=tdtype)
        if before_step is not None:
            before_step(t, optimizer, params)
        optimizer.step()
        out.append({k: p.detach().numpy().copy() for k, p in params.items()})
    return out


def to_backend(tree, backend, dtype):
    if backend == "torch":
        tdtype = {np.float64: torch.float64, np.float32: torch.float32}[dtype]
        return {k: torch.tensor(np.asarray(v), dtype=tdtype) for k, v in tree.items()}
    if backend == "jax":
        return {k: jnp.asarray(np.asarray(v), dtype=dtype) for k, v in tree.items()}
    return {k: np.asarray(v, dtype=dtype) for k, v in tree.items()}


def to_numpy(tree):
    return {
        k: v.detach().double().numpy() if isinstance(v, torch.Tensor) else np.asarray(v, np.float64)
        for k, v in tree.items()
    }


def our_trajectory(rule, x0, grads, backend="numpy", dtype=np.float64, path="update"):
    model = to_backend(x0, backend, dtype)
    state = opt.setup(rule, model)
    step = jax.jit(opt.update) if backend == "jax" else getattr(opt, path)
    out = []
    for g in grads:
        state, model = step(state, model, to_backend(g, backend, dtype))
        out.append(to_numpy(model))
    return out


def worst(ours, theirs) -> float:
    """The largest difference over steps and arrays, relative to each array's largest entry."""
    return max(
        float(np.max(np.abs(a[k] - b[k])) / np.max(np.abs(b[k])))
        for a, b in zip(ours, theirs, strict=True)
        for k in b
    )


# float64: the same formula in a different order (torch's lerp, rsqrt and fused add), observed
# ≤ 2e-15; float32: that reordering at float32 rounding over 25 steps, observed ≤ 5e-7
TOL = {np.float64: 1e-12, np.float32: 4e-6}
BACKENDS = ["numpy", "torch", "jax"]


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("hyper", list(HYPER))
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_torch_optim_on_matrices_3d_4d_vectors_and_scalars(backend, dtype, hyper):
    x0, grads = initial_model(), gradients()
    theirs = torch_trajectory(x0, grads, dtype, **HYPER[hyper])
    ours = our_trajectory(opt.Adafactor(**HYPER[hyper]), x0, grads, backend, dtype)
    assert worst(theirs, [x0] * STEPS) > 1e-2  # it moved
    assert worst(ours, theirs) < TOL[dtype]


@pytest.mark.parametrize("path", ["update", "update_"])
def test_torch_in_place_and_pure_paths_agree_bit_for_bit(path):
    x0, grads = initial_model(), gradients(steps=5)
    pure = our_trajectory(opt.Adafactor(**CUSTOM), x0, grads, "torch", np.float32, "update")
    got = our_trajectory(opt.Adafactor(**CUSTOM), x0, grads, "torch", np.float32, path)
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(got, pure) for k in a)


# --- stacks: small parameters of one shape stepped together ---------------------------------------

# several vectors (a full second moment) and matrices (factors) of one shape each: they stack
STACKED = {**{f"v{i}": (16,) for i in range(4)}, **{f"m{i}": (3, 5) for i in range(3)}, "k": (2, 3, 4)}
HALF = {"float16": (np.float16, torch.float16), "bfloat16": (None, torch.bfloat16)}


@pytest.fixture
def stack_sizes(monkeypatch):
    """The sizes of the stacks stepped during the test."""
    from optimisers.engine import stacked

    seen: list = []
    step_stack = stacked._step_stack

    def spy(members, **layout):
        results = step_stack(members, **layout)
        seen.extend([len(members)] if results else [])
        return results

    monkeypatch.setattr(stacked, "_step_stack", spy)
    return seen


def bits(a):
    """The values of an array of any backend and dtype, exactly (float64 holds each)."""
    return to_numpy({"a": a})["a"].tobytes()


def cast_to(tree, backend, dtype):
    if backend == "torch":
        return {k: torch.tensor(np.asarray(v, np.float32)).to(HALF[dtype][1]) for k, v in tree.items()}
    return {k: np.asarray(v).astype(HALF[dtype][0]) for k, v in tree.items()}


@pytest.mark.parametrize("path", ["update", "update_"])
@pytest.mark.parametrize(
    "backend, dtype", [("numpy", "float16"), ("torch", "float16"), ("torch", "bfloat16")]
)
def test_stacked_vectors_and_matrices_step_as_each_alone_bit_for_bit(backend, dtype, path, stack_sizes):
    """Stacked (float32 maths for half-precision parameters), each parameter gets the numbers and
    the state it gets stepped by a State of its own, with a tied vector (its gradients summed)
    and a frozen matrix in the model."""
    x0, grads = initial_model(STACKED), gradients(STACKED, steps=6)
    rule = opt.Adafactor(**CUSTOM)
    model = cast_to(x0, backend, dtype)
    model["tied"] = model["v1"]
    alone = cast_to(x0, backend, dtype)
    state = opt.setup(rule, model)
    own = {k: opt.setup(rule, x) for k, x in alone.items()}
    opt.freeze_(state["m2"])
    for t, g in enumerate(grads):
        g = cast_to({**g, "tied": g["v2"]}, backend, dtype)
        state, model = getattr(opt, path)(state, model, g)
        assert model["tied"] is model["v1"]
        for k in alone:
            if k != "m2":
                dx = g["v1"] + g["tied"] if k == "v1" else g[k]
                own[k], alone[k] = opt.update(own[k], alone[k], dx)
        for k in alone:
            assert bits(model[k]) == bits(alone[k]), (t, k)
            mine, theirs = state[k].state[:-1], own[k].leaves()[0].state[:-1]
            assert list(map(bits, mine)) == list(map(bits, theirs)), (t, k)
    assert bits(model["m2"]) == bits(cast_to(x0, backend, dtype)["m2"])
    # the matrices but the frozen one stack; the vectors (one tied) too, unless the engine's group
    # steps them in place or the compiled way takes each alone
    v = model["v0"]
    alone = compiled.takes(ops.backend(v), rule, ops.backend(v).numel(v))
    vectors_stack = path == "update" and not alone
    assert sorted(stack_sizes[-2:]) == ([2, 4] if vectors_stack else [2, 2])


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_stacked_vectors_and_matrices_match_torch_optim(backend, stack_sizes):
    x0, grads = initial_model(STACKED), gradients(STACKED)
    theirs = torch_trajectory(x0, grads, **CUSTOM)
    rule = opt.Adafactor(**CUSTOM)
    ours = our_trajectory(rule, x0, grads, backend)
    assert worst(ours, theirs) < TOL[np.float64]
    # the matrices stack; the vectors too, unless the compiled way takes each alone
    v = to_backend(x0, backend, np.float64)["v0"]
    vectors_stack = not compiled.takes(ops.backend(v), rule, ops.backend(v).numel(v))
    assert sorted(stack_sizes[-2:]) == ([3, 4] if vectors_stack else [3, 3])


# --- the state: factors of the last two dimensions, a full moment for vectors and scalars ------


def test_state_is_row_and_column_factors_of_the_last_two_dimensions():
    x0 = initial_model()
    state = opt.setup(opt.Adafactor(), x0)
    shapes = {k: tuple(np.shape(part) for part in state[k].state[:-1]) for k in x0}
    assert shapes == {
        "w": ((5, 1), (1, 7)),
        "t": ((3, 4, 1), (3, 1, 6)),
        "k": ((2, 3, 4, 1), (2, 3, 1, 5)),
        "b": ((7,),),
        "s": ((),),
    }
    assert all(state[k].state[-1] == 0 for k in x0)  # the step count


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_factors_equal_torch_optims_row_var_and_col_var(backend):
    """After 20 steps the factors are torch's `row_var`/`col_var` (3-D and 4-D: per slice), the
    vector's and the scalar's second moment torch's `variance`."""
    x0, grads = initial_model(), gradients(steps=20)
    params = [torch.nn.Parameter(torch.tensor(v)) for v in x0.values()]
    optimizer = torch.optim.Adafactor(params)
    model = to_backend(x0, backend, np.float64)
    state = opt.setup(opt.Adafactor(), model)
    for g in grads:
        for p, v in zip(params, g.values()):
            p.grad = torch.tensor(v)
        optimizer.step()
        state, model = opt.update(state, model, to_backend(g, backend, np.float64))
    for k, p in zip(x0, params):
        theirs = optimizer.state[p]
        names = ("row_var", "col_var") if p.dim() >= 2 else ("variance",)
        assert set(theirs) == {"step", *names}
        *moments, t = state[k].state
        assert t == 20 == theirs["step"].item()
        for name, ours in zip(names, moments, strict=True):
            np.testing.assert_allclose(
                np.asarray(ours), theirs[name].numpy(), rtol=1e-12, err_msg=f"{k} {name}"
            )


def test_state_is_about_one_over_the_dimension_of_adams():
    model = {"w": np.zeros((512, 1024), np.float32), "b": np.zeros(1024, np.float32)}

    def numbers(rule):
        state = opt.setup(rule, model)
        return sum(int(np.size(p)) for k in model for p in state[k].state if np.ndim(p) > 0)

    assert numbers(opt.Adafactor()) == 512 + 1024 + 1024
    assert numbers(opt.Adam()) == 2 * (512 * 1024 + 1024)


# --- ties, chains, adjust, freeze, checkpoints -----------------------------------------------------


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_tied_weight_steps_as_torch_fed_the_summed_gradient(backend, dtype):
    gen = np.random.default_rng(2)
    W, b = gen.standard_normal((6, 4)), gen.standard_normal(4)
    grads = [
        {
            "embed": gen.standard_normal((6, 4)),
            "head": gen.standard_normal((6, 4)) * 3,
            "b": gen.standard_normal(4),
        }
        for _ in range(STEPS)
    ]
    summed = [{"W": g["embed"] + g["head"], "b": g["b"]} for g in grads]
    theirs = torch_trajectory({"W": W, "b": b}, summed, dtype, **CUSTOM)

    tied = to_backend({"W": W, "b": b}, backend, dtype)
    model = {"embed": tied["W"], "head": tied["W"], "b": tied["b"]}
    state = opt.setup(opt.Adafactor(**CUSTOM), model)
    step = jax.jit(opt.update) if backend == "jax" else opt.update
    ours = []
    for g in grads:
        state, model = step(state, model, to_backend(g, backend, dtype))
        if backend != "jax":
            assert model["embed"] is model["head"]
        ours.append(to_numpy({"W": model["embed"], "head": model["head"], "b": model["b"]}))
    for o in ours:
        np.testing.assert_array_equal(o["W"], o["head"])
    assert worst([{k: o[k] for k in ("W", "b")} for o in ours], theirs) < TOL[dtype]


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_in_a_chain_after_clipgrad_as_torch_after_clip_grad_value(backend):
    x0, grads = initial_model(), gradients()

    def clip(t, optimizer, params):
        torch.nn.utils.clip_grad_value_(list(params.values()), 0.5)

    theirs = torch_trajectory(x0, grads, before_step=clip, **CUSTOM)
    rule = opt.OptimiserChain(opt.ClipGrad(0.5), opt.Adafactor(**CUSTOM))
    assert worst(our_trajectory(rule, x0, grads, backend), theirs) < TOL[np.float64]


def test_adjust_changes_the_learning_rate_and_decay_keeping_the_factors():
    x0, grads = initial_model(), gradients()

    def adjust(t, optimizer, params):
        if t == 10:
            optimizer.param_groups[0].update(lr=0.003, weight_decay=0.2)

    theirs = torch_trajectory(x0, grads, before_step=adjust, **CUSTOM)
    model, state, ours = x0, opt.setup(opt.Adafactor(**CUSTOM), x0), []
    for t, g in enumerate(grads):
        if t == 10:
            state = opt.adjust(state, 0.003, lambd=0.2)
        state, model = opt.update(state, model, g)
        ours.append(model)
    assert worst(ours, theirs) < TOL[np.float64]


def test_frozen_part_keeps_its_state_and_resumes_like_torch_without_its_gradient():
    x0, grads = initial_model(), gradients()
    frozen_steps = range(5, 12)

    def drop(t, optimizer, params):
        if t in frozen_steps:
            params["k"].grad = None  # torch skips it: no step, its count not advanced

    theirs = torch_trajectory(x0, grads, before_step=drop, **CUSTOM)
    model, state, ours = x0, opt.setup(opt.Adafactor(**CUSTOM), x0), []
    for t, g in enumerate(grads):
        if t == frozen_steps[0]:
            opt.freeze_(state["k"])
            kept = state["k"].state
        if t == frozen_steps[-1] + 1:
            assert state["k"].state is kept
            opt.thaw_(state["k"])
        state, model = opt.update(state, model, g)
        ours.append(model)
    assert worst(ours, theirs) < TOL[np.float64]


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_checkpoint_round_trip_resumes_bit_for_bit(backend):
    x0, grads = initial_model(), gradients(steps=16)
    rule = opt.Adafactor(**CUSTOM)
    model = to_backend(x0, backend, np.float32)
    state = opt.setup(rule, model)
    for g in grads[:8]:
        state, model = opt.update(state, model, to_backend(g, backend, np.float32))
    saved = opt.state_dict(state)
    resumed_model = {k: v.clone() if backend == "torch" else v.copy() for k, v in model.items()}
    resumed = opt.load_state_dict(opt.setup(rule, resumed_model), saved)
    for g in grads[8:]:
        state, model = opt.update(state, model, to_backend(g, backend, np.float32))
        resumed, resumed_model = opt.update(resumed, resumed_model, to_backend(g, backend, np.float32))
    a, b = to_numpy(model), to_numpy(resumed_model)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_checkpoint_epsilon_one_none_is_a_setting_numbers_come_from_the_checkpoint():
    x0, grads = initial_model(), gradients(steps=2)
    state = opt.setup(opt.Adafactor(epsilon=(None, 1e-3)), x0)
    for g in grads:
        state, _ = opt.update(state, x0, g)
    saved = opt.state_dict(state)
    with pytest.raises(opt.CheckpointError, match=r"epsilon\[0\]"):
        opt.load_state_dict(opt.setup(opt.Adafactor(epsilon=(1e-20, 1e-3)), x0), saved)
    numbered = opt.setup(opt.Adafactor(epsilon=(1e-20, 1e-3)), x0)
    numbered, _ = opt.update(numbered, x0, grads[0])
    loaded = opt.load_state_dict(
        opt.setup(opt.Adafactor(0.3, epsilon=(1e-9, 1e-2)), x0), opt.state_dict(numbered)
    )
    assert loaded["w"].rule == opt.Adafactor(epsilon=(1e-20, 1e-3))


# --- float16 / bfloat16 ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_half_precision_state_in_the_parameters_dtype_and_near_float64(dtype):
    """The maths runs in float32 (ε₁ = None is float32's epsilon there) and the factors are
    stored in the parameter's dtype; the trajectory stays as close to float64's as torch's own
    half-precision run does."""
    x0, grads = initial_model(), gradients(steps=20)
    exact = torch_trajectory(x0, grads)[-1]
    model = {k: torch.tensor(v, dtype=dtype) for k, v in x0.items()}
    state = opt.setup(opt.Adafactor(), model)
    params = [torch.nn.Parameter(torch.tensor(v, dtype=dtype)) for v in x0.values()]
    optimizer = torch.optim.Adafactor(params)
    for g in grads:
        state, model = opt.update_(state, model, {k: torch.tensor(v, dtype=dtype) for k, v in g.items()})
        for p, v in zip(params, g.values()):
            p.grad = torch.tensor(v, dtype=dtype)
        optimizer.step()
    assert all(p.dtype == dtype for k in x0 for p in state[k].state[:-1])
    ours = worst([to_numpy(model)], [exact])
    theirs = worst([{k: p.detach().double().numpy() for k, p in zip(x0, params)}], [exact])
    assert ours <= 1.2 * theirs, (ours, theirs)  # observed: float16 1.07x, bfloat16 1.0x


# --- optax --------------------------------------------------------------------------------------


def optax_adafactor(eta=1e-2, beta2_decay=-0.8, epsilon=(None, 1e-3), d=1.0, lambd=0.0):
    """optax.adafactor at the settings where it computes our steps (the rule's docstring)."""
    assert epsilon[1] == 1e-3  # optax fixes its parameter-scale floor there
    return optax.adafactor(
        learning_rate=lambda count: jnp.minimum(eta, 1 / jnp.sqrt(count + 1.0)),
        min_dim_size_to_factor=1,
        decay_rate=-beta2_decay,
        multiply_by_parameter_scale=True,
        clipping_threshold=d,
        momentum=None,
        weight_decay_rate=eta * lambd,
    )


def optax_parts(eta=1e-2, beta2_decay=-0.8, epsilon=(None, 1e-3), d=1.0, lambd=0.0):
    """optax.adafactor's own chain of transformations, with β₂ₜ computed in the parameters'
    precision where optax.adafactor computes it in float32, and any ε₂."""
    return optax.chain(
        optax.scale_by_factored_rms(
            decay_rate=-beta2_decay,
            min_dim_size_to_factor=1,
            epsilon=1e-30,
            decay_rate_fn=lambda step, rate: 1.0 - (step + 1.0) ** (-rate),
        ),
        optax.clip_by_block_rms(d),
        optax.scale_by_learning_rate(
            lambda count: jnp.minimum(eta, 1 / jnp.sqrt(count + 1.0)), flip_sign=False
        ),
        optax.scale_by_param_block_rms(epsilon[1]),
        optax.add_decayed_weights(eta * lambd),
        optax.scale(-1.0),
    )


# optax factors the two largest dimensions: for these, the last two, as torch and ours
OPTAX_SHAPES = {"w": (5, 7), "t": (2, 5, 6), "k": (2, 3, 6, 7), "b": (7,)}


def optax_trajectory(tx, x0, grads, dtype):
    params = {k: jnp.asarray(v, dtype) for k, v in x0.items()}
    state, out = tx.init(params), []
    update = jax.jit(tx.update)
    for g in grads:
        updates, state = update({k: jnp.asarray(v, dtype) for k, v in g.items()}, state, params)
        params = optax.apply_updates(params, updates)
        out.append(to_numpy(params))
    return out, state


OPTAX_HYPER = {"defaults": {}, "custom": dict(CUSTOM, epsilon=(None, 1e-3))}


@pytest.mark.parametrize("hyper", list(OPTAX_HYPER))
def test_matches_optax_adafactor_in_float32_over_100_jitted_steps(hyper):
    x0, grads = initial_model(OPTAX_SHAPES), gradients(OPTAX_SHAPES, steps=100)
    theirs, _ = optax_trajectory(optax_adafactor(**OPTAX_HYPER[hyper]), x0, grads, jnp.float32)
    ours = our_trajectory(opt.Adafactor(**OPTAX_HYPER[hyper]), x0, grads, "jax", np.float32)
    assert worst(ours, theirs) < 2e-6  # float32 rounding, observed ≤ 3e-7


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("hyper", list(HYPER))
def test_matches_optax_in_float64(hyper):
    """optax.adafactor rounds β₂ₜ = 1 − t^τ to float32 (relative error ~1e-7 in each step's
    second moment), so float64 runs agree to that; its own chain with β₂ₜ in float64 (and ε₂ other
    than 1e-3, which optax.adafactor fixes) agrees to float64 rounding."""
    x0, grads = initial_model(OPTAX_SHAPES), gradients(OPTAX_SHAPES)
    ours = our_trajectory(opt.Adafactor(**HYPER[hyper]), x0, grads, "jax", np.float64)
    theirs, _ = optax_trajectory(optax_parts(**HYPER[hyper]), x0, grads, jnp.float64)
    assert worst(ours, theirs) < 1e-12  # observed 3e-16
    if HYPER[hyper].get("epsilon", (None, 1e-3))[1] == 1e-3:
        theirs, _ = optax_trajectory(optax_adafactor(**HYPER[hyper]), x0, grads, jnp.float64)
        assert 1e-11 < worst(ours, theirs) < 1e-7  # observed 1e-9


@pytest.mark.usefixtures("x64")
def test_factored_second_moment_equals_optaxs():
    """optax keeps `v_row` (the mean over the largest axis) and `v_col` (over the second
    largest): for a matrix with more rows than columns those are our column and row factors."""
    shapes = {"w": (7, 5), "t": (2, 7, 5)}
    x0, grads = initial_model(shapes), gradients(shapes, steps=20)
    _, optax_state = optax_trajectory(optax_adafactor(), x0, grads, jnp.float64)
    factored = optax_state[0]
    state = opt.setup(opt.Adafactor(), x0)
    for g in grads:
        state, _ = opt.update(state, x0, g)  # the factors do not depend on the parameter
    for k in shapes:
        row, col, _ = state[k].state
        np.testing.assert_allclose(np.squeeze(col, -2), factored.v_row[k], rtol=1e-6)
        np.testing.assert_allclose(np.squeeze(row, -1), factored.v_col[k], rtol=1e-6)


def test_through_optimisers_optax_transform_jitted():
    x0, grads = initial_model(OPTAX_SHAPES), gradients(OPTAX_SHAPES, steps=30)
    theirs, _ = optax_trajectory(optax_adafactor(), x0, grads, jnp.float32)
    ours, _ = optax_trajectory(opt.optax.transform(opt.Adafactor()), x0, grads, jnp.float32)
    assert worst(ours, theirs) < 2e-6  # float32 rounding, observed ≤ 3e-7


# --- hyperparameters and edge cases --------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(eta=-1.0), ValueError),
        (dict(beta2_decay=0.5), ValueError),
        (dict(d=0.5), ValueError),
        (dict(lambd=-0.1), ValueError),
        (dict(epsilon=(-1e-3, 1e-3)), ValueError),
        (dict(epsilon=(None, -1e-3)), ValueError),
        (dict(epsilon=("small", 1e-3)), TypeError),
        (dict(epsilon=1e-3), TypeError),
        (dict(epsilon=(None, math.nan)), ValueError),
    ],
)
def test_bad_hyperparameters_are_refused(kwargs, error):
    with pytest.raises(error, match="Adafactor"):
        opt.Adafactor(**kwargs)


def test_epsilon_one_takes_an_int_and_none_is_the_dtypes_epsilon():
    assert opt.Adafactor(epsilon=(0, 1e-3)).epsilon == (0.0, 1e-3)
    # a zero gradient: V̂ = 0, floored at ε₁² (float32's epsilon squared is still a float32), so
    # U = 0 and nothing moves; torch the same
    for dtype, eps1 in [(np.float32, None), (np.float64, None), (np.float64, 1e-30)]:
        x0, grads = (
            {"w": np.ones((3, 2), dtype), "b": np.ones(2, dtype)},
            [{"w": np.zeros((3, 2)), "b": np.zeros(2)}],
        )
        (after,) = our_trajectory(opt.Adafactor(epsilon=(eps1, 1e-3)), x0, grads, dtype=dtype)
        (theirs,) = torch_trajectory(x0, grads, dtype, epsilon=(eps1, 1e-3))
        for k in x0:
            np.testing.assert_array_equal(after[k], x0[k])
            np.testing.assert_array_equal(theirs[k], x0[k])


def test_empty_parameters_step_without_warnings():
    model = {"e": np.zeros((0, 3)), "v": np.zeros(0), "w": np.ones((2, 2))}
    state = opt.setup(opt.Adafactor(), model)
    state, new = opt.update(state, model, {k: np.ones_like(v) for k, v in model.items()})
    assert new["e"].shape == (0, 3) and new["v"].shape == (0,)
    assert state["e"].state[-1] == 1


SHARDED = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import optimisers as opt
from optimisers import ops
from optimisers.engine import compiled

mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
rng = np.random.default_rng(0)
w = jax.device_put(jnp.asarray(rng.standard_normal((8, 16)), jnp.float32), NamedSharding(mesh, P("a", "b")))
b = jax.device_put(jnp.asarray(rng.standard_normal(16), jnp.float32), NamedSharding(mesh, P("b")))
model = {"w": w, "b": b, "head": w}  # head is w: tied
grads = {k: jnp.asarray(rng.standard_normal(v.shape), jnp.float32) for k, v in model.items()}
grads = {k: jax.device_put(g, model[k].sharding) for k, g in grads.items()}

state = opt.setup(opt.Adafactor(), model)
row, col, _ = state["w"].state
# the row factor is split as the rows are, the column factor as the columns
assert row.sharding.spec == P("a"), row.sharding
assert col.sharding.spec == P(None, "b"), col.sharding
eager_state, eager = opt.update(state, model, grads)
state, new = jax.jit(opt.update)(state, model, grads)
assert new["w"].sharding.is_equivalent_to(w.sharding, 2) and new["b"].sharding.is_equivalent_to(b.sharding, 1)
assert state["w"].state[0].sharding.spec == P("a") and state["w"].state[1].sharding.spec == P(None, "b")
np.testing.assert_allclose(np.asarray(new["w"]), np.asarray(eager["w"]), rtol=1e-6)
np.testing.assert_array_equal(np.asarray(new["w"]), np.asarray(new["head"]))
"""


@pytest.mark.slow
def test_sharded_factors_follow_the_rows_and_columns_of_a_sharded_matrix():
    from _host_devices import run_on_host_devices

    run_on_host_devices(SHARDED, 8)
