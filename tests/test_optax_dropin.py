"""`optimisers.optax.transform` where optax users put transformations: `inject_hyperparams`,
`init` under `jit`, `eval_shape` and `vmap`, Equinox modules.

References: optax's own transformations under the same wrappers, the explicit SGD formula, and
`transform` used eagerly one ensemble member at a time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optimisers as opt
from optimisers.optax import transform


def rand(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def loss(p):
    return jnp.sum(jnp.sin(p["w"] @ p["v"])) + jnp.sum(p["b"] ** 2)


def model(seed=0):
    return {"w": rand(3, 4, seed=seed), "v": rand(4, seed=seed + 1), "b": rand(2, seed=seed + 2)}


def trained(tx, params, steps, jit=True):
    """`steps` optax steps of `tx` on `loss`, and how often the step was traced."""
    traces = []

    def step(p, s):
        traces.append(1)
        updates, s = tx.update(jax.grad(loss)(p), s, p)
        return optax.apply_updates(p, updates), s

    step = jax.jit(step) if jit else step
    state = tx.init(params)
    for _ in range(steps):
        params, state = step(params, state)
    return params, state, len(traces)


def assert_close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


# --- inject_hyperparams ---------------------------------------------------------------------------

SCHEDULE = optax.linear_schedule(0.1, 0.01, 10)


@pytest.mark.parametrize("jit", [True, False])
def test_inject_hyperparams_applies_the_schedule_like_optax(jit):
    ours = optax.inject_hyperparams(lambda learning_rate: transform(opt.Adam(learning_rate)))(
        learning_rate=SCHEDULE
    )
    theirs = optax.inject_hyperparams(optax.adam)(learning_rate=SCHEDULE)
    p_ours, s_ours, traces = trained(ours, model(), 10, jit)
    p_theirs, _, _ = trained(theirs, model(), 10, jit)
    assert_close(p_ours, p_theirs)
    if jit:
        assert traces == 1  # the rate is a traced value: no step compiles again
    # the state reports the rate it applied, in inject_hyperparams' state and in the State
    np.testing.assert_allclose(s_ours.hyperparams["learning_rate"], SCHEDULE(9), rtol=1e-6)
    np.testing.assert_allclose(s_ours.inner_state["w"].rule.eta, SCHEDULE(9), rtol=1e-6)
    # and it is not constant-rate Adam, which the state's own rate would have given
    constant, _, _ = trained(transform(opt.Adam(0.1)), model(), 10, jit)
    assert not np.allclose(constant["w"], p_ours["w"], rtol=1e-3)


def test_inject_hyperparams_reaches_a_rule_inside_a_chain_and_keeps_ties():
    def factory(learning_rate, weight_decay):
        return transform(opt.OptimiserChain(opt.WeightDecay(weight_decay), opt.Descent(learning_rate)))

    ours = optax.inject_hyperparams(factory)(learning_rate=SCHEDULE, weight_decay=0.01)
    theirs = optax.inject_hyperparams(lambda learning_rate, weight_decay: optax.chain(
        optax.add_decayed_weights(weight_decay), optax.sgd(learning_rate)
    ))(learning_rate=SCHEDULE, weight_decay=0.01)
    p_ours, state, _ = trained(ours, model(), 6)
    p_theirs, _, _ = trained(theirs, model(), 6)
    assert_close(p_ours, p_theirs)

    # a weight decay changed by hand in inject_hyperparams' state is applied too, and a tied
    # array gets one update at both places
    tied_params = tied_params_inside(0)
    state = ours.init(tied_params)
    state.hyperparams["weight_decay"] = jnp.asarray(0.5)

    @jax.jit
    def step(p, s):
        updates, s = ours.update(jax.grad(tied_loss)(p), s, p)
        return optax.apply_updates(p, updates), s

    p = tied_params
    for _ in range(3):
        p, state = step(p, state)
    np.testing.assert_array_equal(p["v"], p["u"])
    np.testing.assert_allclose(state.inner_state["v"].rule.rules[0].lambd, 0.5)
    assert state.inner_state["v"] is state.inner_state["u"]


def test_inject_hyperparams_with_a_rule_function():
    # each parameter's rule is chosen again at every step with the current rate: SGD written out
    def factory(learning_rate):
        return transform(lambda path, x: opt.Descent(learning_rate * (2.0 if x.ndim == 1 else 1.0)))

    tx = optax.inject_hyperparams(factory)(learning_rate=SCHEDULE)
    params, state, traces = trained(tx, model(), 5)
    ref = model()
    for t in range(5):
        g = jax.grad(loss)(ref)
        lr = jnp.float32(SCHEDULE(t))
        ref = {k: x - (lr * 2 if x.ndim == 1 else lr) * g[k] for k, x in ref.items()}
    assert_close(params, ref)
    assert traces == 1


def test_a_rule_with_python_numbers_keeps_adjust():
    # hyperparameters given as Python numbers live in the State: adjust changes them
    tx = transform(opt.Descent(0.1))
    params = model()
    state = opt.adjust(tx.init(params), 0.5)
    updates, _ = tx.update(jax.grad(loss)(params), state, params)
    g = jax.grad(loss)(params)
    np.testing.assert_allclose(updates["w"], -jnp.float32(0.5) * g["w"], rtol=1e-7)


@pytest.mark.parametrize("jit", [True, False])
def test_adjust_changes_a_rate_given_as_an_array_to_a_transformation_kept_for_the_run(jit):
    # a transformation that made the state with its own init holds starting values: its array
    # rate must not undo adjust at every update (inject_hyperparams builds a new one each step)
    ours = transform(opt.Adam(jnp.asarray(0.1)))
    theirs = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)

    def step(tx, p, s):
        updates, s = tx.update(jax.grad(loss)(p), s, p)
        return optax.apply_updates(p, updates), s

    step = jax.jit(step, static_argnums=0) if jit else step
    p_ours, p_theirs = model(), model()
    s_ours, s_theirs = ours.init(p_ours), theirs.init(p_theirs)
    for i in range(6):
        if i == 3:
            s_ours = opt.adjust(s_ours, 0.01)
            s_theirs.hyperparams["learning_rate"] = jnp.asarray(0.01)
        p_ours, s_ours = step(ours, p_ours, s_ours)
        p_theirs, s_theirs = step(theirs, p_theirs, s_theirs)
    assert_close(p_ours, p_theirs)
    np.testing.assert_allclose(s_ours["w"].rule.eta, 0.01)


def test_adjust_on_the_wrapper_of_a_state_says_where_the_state_is():
    params = model()
    injected = optax.inject_hyperparams(lambda learning_rate: transform(opt.Adam(learning_rate)))
    state = injected(learning_rate=0.1).init(params)
    with pytest.raises(TypeError, match=r"inject_hyperparams' state: its \.inner_state"):
        opt.adjust(state, 0.01)
    chained = optax.chain(optax.clip(1.0), transform(opt.Adam(0.1))).init(params)
    with pytest.raises(TypeError, match="optax.chain state is a tuple"):
        opt.adjust_(chained, 0.01)
    assert chained[1]["w"].rule.eta == 0.1  # nothing changed


# --- init under jit, eval_shape, vmap ---------------------------------------------------------------


def tied_params_inside(seed):
    W = rand(4, seed=seed)
    return {"w": rand(3, 4, seed=seed + 1), "v": W, "b": rand(2, seed=seed + 2), "u": W}


def tied_loss(p):
    return loss(p) + jnp.sum(jnp.cos(p["u"]))


def test_init_under_jit_finds_ties_made_inside_the_function():
    tx = transform(opt.Adam(0.05))

    @jax.jit
    def create():
        params = tied_params_inside(0)  # one array object at "v" and "u"
        return params, tx.init(params)

    params, state = create()
    assert state["v"] is state["u"]
    eager_params = tied_params_inside(0)
    eager_state = tx.init(eager_params)
    assert jax.tree.structure(state) == jax.tree.structure(eager_state)

    @jax.jit
    def step(p, s):
        updates, s = tx.update(jax.grad(tied_loss)(p), s, p)
        return optax.apply_updates(p, updates), s

    for _ in range(3):
        params, state = step(params, state)
        eager_params, eager_state = step(eager_params, eager_state)
    np.testing.assert_array_equal(params["v"], params["u"])
    for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((eager_params, eager_state))):
        np.testing.assert_array_equal(a, b)


def test_init_under_eval_shape_gives_the_eager_structure():
    tx = optax.chain(optax.clip_by_global_norm(1.0), transform(opt.AdamW(1e-3)))
    abstract = jax.eval_shape(lambda: tx.init(tied_params_inside(0)))
    concrete = tx.init(tied_params_inside(0))
    assert jax.tree.structure(abstract) == jax.tree.structure(concrete)
    assert abstract[1]["v"] is abstract[1]["u"]
    for a, c in zip(jax.tree.leaves(abstract), jax.tree.leaves(concrete)):
        assert isinstance(a, jax.ShapeDtypeStruct)
        assert (a.shape, a.dtype) == (c.shape, c.dtype)


def test_a_tie_between_arguments_is_not_seen_under_jit_and_an_eager_update_says_so():
    # jit hands each argument leaf its own tracer, so the tie is not in the state; an eager
    # update with the tied model refuses that state instead of training the places apart
    tx = transform(opt.Adam(0.05))
    params = tied_params_inside(0)
    state = jax.jit(tx.init)(params)
    assert state["v"] is not state["u"]
    with pytest.raises(ValueError, match="one array at"):
        tx.update(jax.grad(tied_loss)(params), state, params)
    # closed over instead of passed, the arrays keep their identity: the tie is found
    state = jax.jit(lambda: tx.init(params))()
    assert state["v"] is state["u"]


@pytest.mark.parametrize(
    "rule", [opt.Adam(0.05), opt.OptimiserChain(opt.ClipNorm(1.0), opt.Nesterov(0.05))], ids=repr
)
def test_vmap_init_and_update_equal_each_member_alone(rule):
    tx = transform(rule)
    members = [model(seed) for seed in (0, 10, 20)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *members)
    state = jax.vmap(tx.init)(stacked)

    def step(p, s):
        updates, s = tx.update(jax.grad(loss)(p), s, p)
        return optax.apply_updates(p, updates), s

    ensemble_step = jax.jit(jax.vmap(step))
    for _ in range(4):
        stacked, state = ensemble_step(stacked, state)
    for i, member in enumerate(members):
        s = tx.init(member)
        for _ in range(4):
            member, s = step(member, s)  # eagerly, one member at a time
        assert_close(jax.tree.map(lambda x, i=i: x[i], stacked), member)
        mine = jax.tree.map(lambda x, i=i: x[i], state)
        for k in member:  # the states' keys may come in another order (jax sorts dict keys)
            assert_close(mine[k].state, s[k].state)


# --- Equinox ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_an_unfiltered_equinox_module_fails_at_init_and_a_filtered_one_trains():
    eqx = pytest.importorskip("equinox")
    net = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))  # holds its activation functions
    tx = transform(opt.Adam(1e-2))
    with pytest.raises(TypeError, match=r"at \.activation.*eqx\.filter\(model, eqx\.is_array\)"):
        tx.init(net)
    with pytest.raises(TypeError):
        optax.adam(1e-2).init(net)  # optax refuses it at init too
    # the state of the filtered module with the unfiltered one at update: the same message
    state = tx.init(eqx.filter(net, eqx.is_array))
    grads = jax.tree.map(jnp.ones_like, eqx.filter(net, eqx.is_array))
    with pytest.raises(TypeError, match=r"update: params holds a .* at \.activation.*eqx\.filter"):
        tx.update(grads, state, net)

    x = jnp.ones((5, 3))

    def net_loss(net):
        return jnp.sum(jax.vmap(net)(x) ** 2)

    def run(tx, net):
        state = tx.init(eqx.filter(net, eqx.is_array))

        @eqx.filter_jit
        def step(net, state):
            grads = eqx.filter_grad(net_loss)(net)
            updates, state = tx.update(grads, state, eqx.filter(net, eqx.is_array))
            return eqx.apply_updates(net, updates), state

        for _ in range(3):
            net, state = step(net, state)
        return net

    ours, theirs = run(tx, net), run(optax.adam(1e-2), net)
    assert_close(eqx.filter(ours, eqx.is_array), eqx.filter(theirs, eqx.is_array))
