"""`optimisers.optax.transform`: any rule as an optax GradientTransformation.

References: `optimisers.update` (bit for bit: optax adds `-step`, and IEEE defines `x - s` as
`x + (-s)`), optax's own transformations, and `jax.grad` of a function that reuses one array.
"""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optimisers as opt
from optimisers.optax import transform
from rules_registry import jit_rules, routed, sets_values


def rand(*shape, seed=0, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype=dtype)


def bits(tree):
    """Leaves as bytes, so -0.0 and 0.0 (and NaN payloads) count as different. A transform's
    state is compared as the plain State it holds (its pytree is laid out as optax's)."""
    if isinstance(tree, opt.State):
        tree = opt.State(tree.tree)
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


X = rand(5, seed=100)


def tied_loss(model):
    h = jnp.tanh(model["embed"] @ X)
    h2 = jnp.tanh(model["mlp"][0] @ h) + model["mlp"][1]
    return jnp.sum(jnp.sin(model["unembed"].T @ h2)) + 0.5 * jnp.sum(h**2)


def tied_model(seed=0):
    W = rand(4, 5, seed=seed)
    # a negative zero that must stay negative, and an integer leaf that is carried along
    b = rand(4, seed=seed + 2).at[0].set(-0.0)
    return {"embed": W, "mlp": [rand(4, 4, seed=seed + 1), b], "unembed": W, "count": jnp.arange(3)}


def grads_of(model):
    g = jax.grad(tied_loss, allow_int=True)(model)
    return {**g, "count": None}


RULES = [
    opt.Adam(0.05),
    opt.OptimiserChain(opt.ClipNorm(1.0), opt.AdamW(0.02, lambd=0.1)),
    opt.Lion(0.01),
    opt.Nesterov(0.05),
    opt.OptimiserChain(opt.WeightDecay(0.1), opt.Descent(0.1)),
    opt.Rprop(0.01),
]


# and every rule of rules_registry.py that runs under jit, as rule instances of its `jit` family
def _ids(rules):
    """Class names, numbered where a class comes more than once."""
    names = [type(r).__name__ for r in rules]
    return [f"{n}{names[:i].count(n)}" if names.count(n) > 1 else n for i, n in enumerate(names)]


PARAMS = [pytest.param(rule, id=i) for rule, i in zip(RULES, _ids(RULES))]
PARAMS += [pytest.param(rule, id=repr(rule).replace(" ", "")) for rule in jit_rules() if rule not in RULES]


@pytest.mark.slow
@pytest.mark.parametrize("rule", PARAMS)
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_apply_updates_equals_update_bit_for_bit(rule, jitted):
    chosen = routed(rule)  # the bias to AdamW where the rule takes matrices only (Muon)
    tx = transform(chosen)
    model = tied_model()
    # init is setup: eager and jitted, the transform computes what update computes
    state, ref_state = tx.init(model), opt.setup(chosen, model)
    assert state["embed"] is state["unembed"]
    assert bits(state) == bits(ref_state)

    def ours(state, model, grads):
        updates, state = tx.update(grads, state, model)
        return state, optax.apply_updates(model, updates)

    ref = opt.update
    if jitted:
        ours, ref = jax.jit(ours), jax.jit(ref)
    mine = model
    for _ in range(4):
        grads = grads_of(mine)
        state, mine = ours(state, mine, grads)
        ref_state, model = ref(ref_state, model, grads)
        _assert_same(mine, model, rule)
    assert np.signbit(mine["mlp"][1][0]) == np.signbit(model["mlp"][1][0])
    np.testing.assert_array_equal(mine["embed"], mine["unembed"])
    _assert_same(state, ref_state, rule)


def _assert_same(ours, expected, rule):
    """Bit for bit, except for a rule that sets parameters far from where they were (Lookahead
    at its synchronisations, the schedule-free rules): optax's `x + (new - x)` is `new` to within
    a rounding there (see `optimisers.optax`), and the runs go on from there."""
    if not sets_values(rule):
        assert bits(ours) == bits(expected)
        return
    if isinstance(ours, opt.State):
        ours, expected = opt.State(ours.tree), opt.State(expected.tree)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_frozen_and_gradient_free_places_keep_every_bit():
    model = {"w": jnp.asarray([-0.0, 0.0, 1.5]), "v": jnp.asarray([-0.0, 2.0]), "n": jnp.arange(2)}
    tx = transform(opt.Adam(0.1))
    state = tx.init(model)
    opt.freeze_(state["w"])
    grads = {"w": jnp.ones(3), "v": None, "n": None}
    updates, state = tx.update(grads, state, model)
    new = optax.apply_updates(model, updates)
    assert bits(new) == bits(model)
    assert new["n"].dtype == model["n"].dtype


def test_ties_under_jit_equal_the_untied_model_trained_by_optax():
    # Reference: optax.adam on one array W, with jax.grad of the loss that uses W at both places.
    model = tied_model()
    model.pop("count")
    tx = transform(opt.Adam(0.05))
    state = tx.init(model)

    @jax.jit
    def step(state, model):
        updates, state = tx.update(jax.grad(tied_loss)(model), state, model)
        return state, optax.apply_updates(model, updates)

    ref_tx = optax.adam(0.05)
    params = {"W": model["embed"], "mlp": model["mlp"]}
    ref_state = ref_tx.init(params)

    def untied_loss(p):
        return tied_loss({"embed": p["W"], "mlp": p["mlp"], "unembed": p["W"]})

    for _ in range(5):
        state, model = step(state, model)
        u, ref_state = ref_tx.update(jax.grad(untied_loss)(params), ref_state, params)
        params = optax.apply_updates(params, u)
    np.testing.assert_array_equal(model["embed"], model["unembed"])
    np.testing.assert_allclose(model["embed"], params["W"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(model["mlp"][0], params["mlp"][0], rtol=1e-5, atol=1e-5)
    assert state["embed"] is state["unembed"]


def test_inside_optax_chain_equals_clipping_then_the_rule():
    model = tied_model()
    model.pop("count")
    tx = optax.chain(optax.clip_by_global_norm(1.0), transform(opt.Adam(0.05)))
    state = tx.init(model)
    ref_state = opt.setup(opt.Adam(0.05), model)
    ref = model
    for _ in range(4):
        grads = jax.tree.map(lambda g: 10 * g, jax.grad(tied_loss)(model))
        updates, state = tx.update(grads, state, model)
        model = optax.apply_updates(model, updates)
        # clipping by hand: the global norm over every place's gradient, as optax counts it
        norm = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads)))
        assert norm > 1.0
        clipped = jax.tree.map(lambda g, n=norm: g / n, grads)
        ref_grads = jax.grad(tied_loss)(ref)
        ref_grads = jax.tree.map(lambda g: 10 * g, ref_grads)
        # the same numbers as optax's clipping fed to our rule, bit for bit ...
        by_optax, _ = optax.clip_by_global_norm(1.0).update(ref_grads, optax.EmptyState())
        ref_state, ref = opt.update(ref_state, ref, by_optax)
        assert bits(model) == bits(ref)
        # ... and optax's clipping is the formula
        for a, b in zip(jax.tree.leaves(by_optax), jax.tree.leaves(clipped)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert isinstance(state[1], opt.State) and state[1]["embed"] is state[1]["unembed"]


def test_adjust_and_a_schedule_do_not_recompile():
    model = tied_model()
    model.pop("count")
    rule = opt.OptimiserChain(opt.ClipNorm(1.0), opt.AdamW(0.05))
    tx = optax.chain(optax.scale(1.0), transform(rule))
    state = tx.init(model)
    ref_state = jax.tree.map(jnp.asarray, opt.setup(rule, model))
    ref = model
    traces = []

    @jax.jit
    def step(state, model, grads):
        traces.append(1)
        updates, state = tx.update(grads, state, model)
        return state, optax.apply_updates(model, updates)

    sched = opt.schedules.Cosine(0.05, 6, warmup=2)
    for i in range(6):
        grads = jax.grad(tied_loss)(model)
        state = (state[0], opt.adjust(state[1], sched(i)))
        state, model = step(state, model, grads)
        ref_state = opt.adjust(ref_state, sched(i))
        ref_state, ref = jax.jit(opt.update)(ref_state, ref, grads)
        assert bits(model) == bits(ref)
    assert len(traces) == 1
    assert state[1]["embed"].rule.rules[1].eta == np.float32(sched(5))


def test_mixed_precision_new_values_are_exact_for_steps_smaller_than_the_parameter():
    # MixedPrecision sets the parameter to its rounded master copy: the update is `new - x`, and
    # `x + (new - x) == new` when new is within a factor of two of x (Sterbenz), as here.
    rng = np.random.default_rng(3)
    model = {"w": jnp.asarray(rng.uniform(1, 2, (3, 4)), jnp.bfloat16)}
    rule = opt.MixedPrecision(opt.Adam(1e-2))
    tx = transform(rule)
    state, ref_state, ref = tx.init(model), opt.setup(rule, model), model
    for _ in range(5):
        grads = {"w": jnp.asarray(rng.standard_normal((3, 4)), jnp.bfloat16)}
        updates, state = tx.update(grads, state, model)
        model = optax.apply_updates(model, updates)
        ref_state, ref = opt.update(ref_state, ref, grads)
        assert model["w"].dtype == jnp.bfloat16
        assert bits(model) == bits(ref)
    assert bits(state) == bits(ref_state)


def test_rule_function_and_extra_args():
    model = {"w": rand(3, seed=1), "b": rand(2, seed=2)}
    tx = transform(lambda path, x: opt.Descent(0.5) if path == ("b",) else opt.Descent(0.1))
    state = tx.init(model)
    grads = {"w": jnp.ones(3), "b": jnp.ones(2)}
    updates, state = tx.update(grads, state, model, value=1.0)  # extra args are ignored
    new = optax.apply_updates(model, updates)
    np.testing.assert_array_equal(new["w"], model["w"] - jnp.float32(0.1))
    np.testing.assert_array_equal(new["b"], model["b"] - jnp.float32(0.5))


# --- misuse -------------------------------------------------------------------------------------


def test_update_needs_params_and_its_own_state():
    model = {"w": rand(3)}
    tx = transform(opt.Adam())
    state = tx.init(model)
    with pytest.raises(TypeError, match="needs the current params"):
        tx.update({"w": jnp.ones(3)}, state)
    with pytest.raises(TypeError, match="expects the state its init returned"):
        tx.update({"w": jnp.ones(3)}, optax.adam(1e-3).init(model), model)


def test_a_bare_rule_where_optax_expects_a_transformation_fails_at_once():
    model = {"w": rand(3), "b": [rand(2)]}
    with pytest.raises(TypeError, match=r"optimisers\.optax\.transform"):
        optax.chain(optax.clip(1.0), opt.Adam()).init(model)
    with pytest.raises(TypeError, match=r"Adam\.init\(x\) takes one parameter array, got a dict"):
        opt.Adam().init(model)
    with pytest.raises(TypeError, match=r"OptimiserChain.*optimisers\.optax\.transform"):
        opt.OptimiserChain(opt.ClipNorm(), opt.Adam()).init([rand(2)])
    # a single array is a valid optax params tree: then the update is what fails, with the hint
    tx = optax.chain(opt.Adam())
    state = tx.init(rand(3))
    with pytest.raises(TypeError, match=r"optimisers\.optax\.transform"):
        tx.update(rand(3), state, rand(3))


def test_a_state_where_a_rule_is_expected_fails_at_once():
    model = {"w": rand(3)}
    state = opt.setup(opt.Adam(), model)
    with pytest.raises(TypeError, match=r"got a State.*update\(state, model, grads\)"):
        opt.setup(state, model)
    with pytest.raises(TypeError, match="got a State"):
        transform(state)
    with pytest.raises(TypeError, match="got a Leaf"):
        transform(state["w"])
    with pytest.raises(TypeError, match="rule instance"):
        transform(opt.Adam)
    with pytest.raises(TypeError, match="expects an optimisers.Rule"):
        transform(optax.adam(1e-3))


def test_a_custom_rule_gets_the_check_too():
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Sign(opt.Rule):
        eta: float = 0.1

        def init(self, x):
            return 0

        def apply(self, state, x, dx):
            return state + 1, self.eta * jnp.sign(dx)

    assert Sign().init(rand(2)) == 0
    with pytest.raises(TypeError, match=r"optimisers\.optax\.transform"):
        Sign().init({"w": rand(2)})


def test_optax_module_is_lazy():
    code = (
        "import sys, optimisers\n"
        "assert not any(m.partition('.')[0] in ('jax', 'optax') for m in sys.modules)\n"
        "t = optimisers.optax.transform\n"
        "import optimisers.optax as m\n"
        "assert m.transform is t and 'optax' in sys.modules\n"
        "try:\n    optimisers.nothing_here\nexcept AttributeError as e:\n    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "has no attribute 'nothing_here'" in done.stdout


# --- optax's layout of the state: params-shaped trees, dtypes -----------------------------------


def test_the_state_shows_each_state_array_shaped_like_the_params():
    model = tied_model()
    tx = transform(opt.Adam(0.05))
    state = tx.init(model)
    assert isinstance(state, opt.optax.TransformState) and isinstance(state, opt.State)
    mu = optax.tree.get(state, "mu")
    assert jax.tree.structure(mu, is_leaf=lambda x: isinstance(x, optax.MaskedNode)) == jax.tree.structure(
        jax.tree.map(lambda _: 0, model)
    )
    assert mu["embed"] is mu["unembed"]  # the tie: one array at both places
    assert isinstance(mu["count"], optax.MaskedNode)  # an integer array has no state
    assert mu["mlp"][0].shape == (4, 4) and optax.tree.get(state, "nu")["mlp"][1].shape == (4,)
    assert optax.tree.get(transform(opt.Nesterov(0.1)).init(model), "trace")["embed"].shape == (4, 5)


def test_tree_map_params_maps_the_params_shaped_trees_and_keeps_a_working_state():
    model = tied_model()
    model.pop("count")
    tx = transform(opt.AdamW(0.05, lambd=0.1))
    state = tx.init(model)
    same = optax.tree_utils.tree_map_params(tx, lambda v: v, state)
    assert bits(same) == bits(state) and jax.tree.structure(same) == jax.tree.structure(state)
    # the sharding recipe: one spec per parameter, mapped onto the optimiser state
    specs = jax.tree.map(lambda x: f"spec{x.ndim}", model)
    state_specs = optax.tree_utils.tree_map_params(
        tx, lambda _, spec: spec, state, specs, transform_non_params=lambda _: "replicated"
    )
    assert state_specs._views["mu"] == specs and state_specs._views["nu"] == specs
    assert state_specs._core == "replicated"
    # the identity-mapped state trains as the original
    grads = jax.grad(tied_loss)(model)
    u1, _ = tx.update(grads, same, model)
    u2, _ = tx.update(grads, state, model)
    assert bits(u1) == bits(u2)


def test_tree_map_params_with_a_rule_function_and_a_stateless_rule():
    model = {"w": rand(3, seed=1), "b": rand(2, seed=2)}
    for tx in (transform(lambda path, x: opt.Adam(0.1)), transform(opt.Descent(0.1))):
        state = tx.init(model)
        mapped = optax.tree_utils.tree_map_params(tx, lambda v: v, state)
        assert bits(mapped) == bits(state)
    assert optax.tree.get(transform(lambda path, x: opt.Adam(0.1)).init(model), "mu") is None


def test_ties_show_the_same_moments_at_each_place_under_jit():
    model = tied_model()
    model.pop("count")
    tx = transform(opt.Adam(0.05))

    @jax.jit
    def step(state, model):
        updates, state = tx.update(jax.grad(tied_loss)(model), state, model)
        return state, optax.apply_updates(model, updates)

    state = tx.init(model)
    for _ in range(3):
        state, model = step(state, model)
    for name in ("mu", "nu"):
        view = optax.tree.get(state, name)
        np.testing.assert_array_equal(view["embed"], view["unembed"])
    assert state["embed"] is state["unembed"]  # one Leaf inside
    np.testing.assert_array_equal(state["embed"].state[0], optax.tree.get(state, "mu")["embed"])
    assert state["embed"].state[2] == 3


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize(
    "rule", [opt.Adam(0.05), opt.Momentum(0.05), opt.Lion(0.01), opt.MixedPrecision(opt.Adam(0.05))],
    ids=["Adam", "Momentum", "Lion", "MixedPrecision"],
)
def test_updates_in_the_params_dtype_and_state_dtypes_stable_under_cond_and_scan(rule, dtype):
    model = {"w": rand(3, 4, seed=4, dtype=dtype), "b": rand(4, seed=5, dtype=dtype)}
    tx = transform(rule)
    state = tx.init(model)
    grads = jax.tree.map(lambda x: (x * 0.1).astype(x.dtype), model)
    updates, new_state = jax.jit(tx.update)(grads, state, model)
    assert all(u.dtype == dtype for u in jax.tree.leaves(updates))

    def kinds(tree):
        return [(x.shape, x.dtype, getattr(x, "weak_type", False)) for x in jax.tree.leaves(tree)]

    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    assert kinds(new_state) == kinds(state)

    @jax.jit
    def scanned(model, state):
        def body(carry, _):
            model, state = carry
            updates, new = tx.update(grads, state, model)
            keep = jnp.asarray(True)
            updates, state = jax.lax.cond(keep, lambda: (updates, new), lambda: (model, state))
            return (optax.apply_updates(model, updates), state), None

        return jax.lax.scan(body, (model, state), length=3)[0]

    model2, state2 = scanned(model, state)
    assert kinds(state2) == kinds(state) and kinds(model2) == kinds(model)


def test_narrow_params_get_what_update_gives():
    # a float16/bfloat16 parameter's step is float32: its update is `new - x` in the parameter's
    # dtype, exact while the step is smaller than the parameter (see the module docstring)
    rng = np.random.default_rng(7)
    model = {"w": jnp.asarray(rng.uniform(1, 2, (3, 4)), jnp.bfloat16)}
    tx = transform(opt.Adam(1e-2))
    state, ref_state, ref = tx.init(model), opt.setup(opt.Adam(1e-2), model), model
    for _ in range(4):
        grads = {"w": jnp.asarray(rng.standard_normal((3, 4)), jnp.bfloat16)}
        updates, state = tx.update(grads, state, model)
        assert updates["w"].dtype == jnp.bfloat16
        model = optax.apply_updates(model, updates)
        ref_state, ref = opt.update(ref_state, ref, grads)
        assert bits(model) == bits(ref)
    assert bits(state) == bits(ref_state)


@pytest.mark.parametrize("params_dtype", [jnp.bfloat16, jnp.float32])
def test_explicit_state_dtypes_on_the_rule_and_on_transform(params_dtype):
    model = {"w": rand(3, 4, seed=8, dtype=params_dtype)}
    grads = jax.tree.map(lambda x: (x * 0.5).astype(x.dtype), model)
    for tx, name in (
        (transform(opt.Adam(0.05, mu_dtype=jnp.bfloat16)), "mu"),
        (transform(opt.AdamW(0.05, mu_dtype="bfloat16")), "mu"),
        (transform(opt.Adam(0.05), state_dtypes={"mu": jnp.bfloat16}), "mu"),
        (transform(opt.Momentum(0.05, accumulator_dtype=jnp.bfloat16)), "trace"),
        (transform(opt.Nesterov(0.05), state_dtypes={"trace": "bfloat16"}), "trace"),
    ):
        state = tx.init(model)
        assert optax.tree.get(state, name)["w"].dtype == jnp.bfloat16
        updates, new = jax.jit(tx.update)(grads, state, model)
        assert optax.tree.get(new, name)["w"].dtype == jnp.bfloat16
        assert updates["w"].dtype == params_dtype
        if name == "mu":
            assert optax.tree.get(new, "nu")["w"].dtype == params_dtype


def test_state_dtypes_names_what_the_rule_keeps():
    with pytest.raises(ValueError, match=r"'trace'.*state arrays by name: 'mu', 'nu'"):
        transform(opt.Adam(), state_dtypes={"trace": jnp.bfloat16})
    with pytest.raises(TypeError, match="not a dtype"):
        transform(opt.Adam(), state_dtypes={"mu": "no such dtype"})


def test_adjust_gives_a_state_that_updates_as_before():
    # adjust makes a plain State; update hands back the kind of state it was given
    model = {"w": rand(3, seed=1)}
    tx = transform(opt.Adam(0.1))
    state = tx.init(model)
    adjusted = opt.adjust(state, 0.01)
    assert type(adjusted) is opt.State
    _, new = tx.update({"w": jnp.ones(3)}, adjusted, model)
    assert type(new) is opt.State
    _, new = tx.update({"w": jnp.ones(3)}, state, model)
    assert isinstance(new, opt.optax.TransformState)
    opt.freeze_(new["w"])  # changes the built tree: what JAX sees follows
    updates, _ = jax.jit(tx.update)({"w": jnp.ones(3)}, new, model)
    assert bits(updates) == bits(jax.tree.map(lambda x: -jnp.zeros_like(x), model))
