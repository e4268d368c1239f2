"""Every rule through the public API: convergence on toy losses, dtypes, purity, pure vs in-place
agreement, and multi-step agreement with the independent NumPy formulas in `rule_reference.py`,
for every rule and composite of `rules_registry.py`; then the documented defaults, examples,
validation, `adjust` forwarding and each rule's edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

import optimisers as opt
import rule_reference as ref
from optimisers import (
    AccumGrad,
    AdaDelta,
    Adam,
    AdaMax,
    AdamW,
    ClipGrad,
    ClipNorm,
    Descent,
    Lion,
    MixedPrecision,
    Momentum,
    NAdam,
    Nesterov,
    OptimiserChain,
    RAdam,
    RMSProp,
    Rprop,
    SignDecay,
    WeightDecay,
)
from rules_registry import RULES as REGISTRY
from rules_registry import shaped, shaped_like, supports_complex, toy_cases

RULES = toy_cases()
IDS = [repr(c.rule).replace(" ", "") for c in RULES]


def case_params(select=lambda c: True):
    return [pytest.param(c, id=i) for c, i in zip(RULES, IDS) if select(c)]


# --- helpers -----------------------------------------------------------------------------------


def rng(seed):
    return np.random.default_rng(seed)


def random_like(model, gen, scale=1.0):
    """A gradient tree for `model` with random entries, in each array's dtype."""
    out = {}
    for k, x in model.items():
        g = gen.standard_normal(x.shape) * scale
        if np.iscomplexobj(x):
            g = g + 1j * gen.standard_normal(x.shape) * scale
        out[k] = g.astype(x.dtype)
    return out


def state_parts(state):
    """Every value in every Leaf's rule state, depth first (a Quantised's codes and scales)."""
    out = []

    def walk(s):
        if isinstance(s, (tuple, list)):
            for v in s:
                walk(v)
        elif isinstance(s, opt.Quantised):
            out.extend((s.codes, s.scale))
        elif s is not None:
            out.append(s)

    for leaf in state.leaves():
        walk(leaf.state)
    return out


def same_bits(a, b) -> bool:
    if isinstance(a, (int, float)) or isinstance(b, (int, float)):
        return type(a) is type(b) and a == b
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# --- convergence on three toy losses ------------------------------------------------------------
# The model is {"w": (5,), "b": (1,)} (shaped as each rule needs, see `rules_registry.shaped`);
# each loss returns (value, gradient tree) in float64.

_G = rng(1234)
_TARGET = _G.standard_normal(6)
_Q, _ = np.linalg.qr(_G.standard_normal((6, 6)))
_HESSIAN = _Q @ np.diag(np.logspace(-1, 1, 6)) @ _Q.T  # rotated, condition number 100
_X = _G.standard_normal((128, 5))
_LABELS = np.sign(_X @ (2 * _G.standard_normal(5)) + 0.5 + 0.5 * _G.standard_normal(128))


def _flat(model):
    return np.concatenate([model["w"].astype(np.float64).ravel(), model["b"].astype(np.float64).ravel()])


def _split(z):
    return {"w": z[:5], "b": z[5:]}


def quadratic(model):
    d = _flat(model) - _TARGET
    return 0.5 * d @ d, _split(d)


def ill_conditioned(model):
    d = _flat(model) - _TARGET
    hd = _HESSIAN @ d
    return 0.5 * d @ hd, _split(hd)


def logistic(model):
    # 4 × the mean log-loss, so that its curvature is about 1 like the quadratics'
    z = _flat(model)
    margin = _LABELS * (_X @ z[:5] + z[5])
    loss = 4 * np.mean(np.logaddexp(0, -margin))
    weight = -4 * _LABELS / (1 + np.exp(margin)) / len(_LABELS)
    return loss, {"w": _X.T @ weight, "b": np.array([weight.sum()])}


def _logistic_minimum():
    z = np.zeros(6)
    A = np.hstack([_X, np.ones((len(_X), 1))])
    for _ in range(50):  # Newton's method
        p = 1 / (1 + np.exp(-_LABELS * (A @ z)))
        grad = A.T @ (-(1 - p) * _LABELS) / len(A)
        hess = (A.T * (p * (1 - p))) @ A / len(A)
        z = z - np.linalg.solve(hess, grad)
    return logistic(_split(z))[0]


LOSSES = {"quadratic": (quadratic, 0.0), "ill_conditioned": (ill_conditioned, 0.0)}
LOSSES["logistic"] = (logistic, _logistic_minimum())
REDUCTION = 0.1  # every rule must shrink the gap to the minimum tenfold on every problem


@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("case", case_params(lambda c: c.steps > 0))
def test_converges(case, loss_name):
    loss_fn, minimum = LOSSES[loss_name]
    model = {k: np.zeros(shaped(case.rule, (n,)), case.dtype) for k, n in (("w", 5), ("b", 1))}
    state = opt.setup(case.rule, model)
    start = loss_fn(model)[0] - minimum
    for _ in range(case.steps):
        _, grads = loss_fn(model)
        grads = shaped_like(case.rule, {k: g.astype(case.dtype) for k, g in grads.items()})
        state, model = opt.update_(state, model, grads)
    gap = loss_fn(model)[0] - minimum
    assert model["w"].dtype == case.dtype
    assert gap <= REDUCTION * start, f"loss gap {start:.4g} -> {gap:.4g}"


# --- generic properties of every rule -----------------------------------------------------------

DTYPES = [np.float16, np.float32, np.float64, np.complex64]


def small_model(dtype, seed=0, rule=None):
    """{"w": (3, 4), "b": (4,)} of random numbers, shaped as `rule` needs."""
    gen = rng(seed)
    model = {"w": gen.standard_normal((3, 4)), "b": gen.standard_normal(4)}
    if np.dtype(dtype).kind == "c":
        model = {k: v + 1j * gen.standard_normal(v.shape) for k, v in model.items()}
    model = {k: v.astype(dtype) for k, v in model.items()}
    return model if rule is None else shaped_like(rule, model)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("case", case_params())
def test_dtype_is_preserved(case, dtype):
    model = small_model(dtype, rule=case.rule)
    if np.dtype(dtype).kind == "c" and not supports_complex(case.rule):
        with pytest.raises(TypeError, match="complex"):
            opt.setup(case.rule, model)
        return
    state = opt.setup(case.rule, model)
    gen = rng(1)
    for _ in range(4):
        state, model = opt.update(state, model, random_like(model, gen, scale=0.5))
    real = np.finfo(dtype).dtype
    allowed = {np.dtype(dtype), real}
    if isinstance(case.rule, MixedPrecision):
        allowed.add(np.dtype(case.rule.dtype))
    if isinstance(case.rule, opt.LowBit):
        allowed |= {np.dtype(np.uint8), np.dtype(np.float32)}  # codes and scales
    for x in model.values():
        assert x.dtype == dtype and x.shape in ((3, 4), shaped(case.rule, (4,)))
        assert np.all(np.isfinite(x))
    for part in state_parts(state):
        if isinstance(part, (int, float)):
            continue
        assert part.dtype in allowed, f"state array of dtype {part.dtype}"


@pytest.mark.parametrize("case", case_params())
def test_update_and_update_in_place_agree_bitwise(case):
    dtype = case.dtype if case.dtype != np.float64 else np.float32
    models = [small_model(dtype, rule=case.rule), small_model(dtype, rule=case.rule)]
    states = [opt.setup(case.rule, m) for m in models]
    gen = rng(2)
    for _ in range(5):
        grads = random_like(models[0], gen)
        states[0], models[0] = opt.update(states[0], models[0], grads)
        states[1], models[1] = opt.update_(states[1], models[1], grads)
        for k in models[0]:
            assert same_bits(models[0][k], models[1][k])
        pure, inplace = state_parts(states[0]), state_parts(states[1])
        assert len(pure) == len(inplace)
        assert all(same_bits(a, b) for a, b in zip(pure, inplace))


@pytest.mark.parametrize("case", case_params())
def test_update_leaves_its_inputs_alone(case):
    model = small_model(case.dtype if case.dtype != np.float64 else np.float32, rule=case.rule)
    state = opt.setup(case.rule, model)
    gen = rng(3)
    state, _ = opt.update(state, model, random_like(model, gen))  # state arrays now non-trivial
    grads = random_like(model, gen)
    arrays = [*model.values(), *grads.values(), *(p for p in state_parts(state) if hasattr(p, "shape"))]
    before = [(a, a.copy()) for a in arrays]
    leaf_states = [leaf.state for leaf in state.leaves()]
    model_items = dict(model)
    new_state, new_model = opt.update(state, model, grads)
    assert all(same_bits(a, copy) for a, copy in before)
    assert dict(model) == model_items and all(model[k] is model_items[k] for k in model)
    assert [leaf.state for leaf in state.leaves()] == leaf_states
    assert all(new_model[k] is not model[k] for k in model)


def reference_trajectory(case, model, grads_list):
    """The model after each step, by the independent formulas, one reference per array."""
    steppers = {k: case.ref() for k in model}
    x = {k: v.copy() for k, v in model.items()}
    out = []
    for grads in grads_list:
        for k, step in steppers.items():
            u = step(x[k], grads[k])
            if u is not None:
                x[k] = x[k] - u
        out.append({k: v.copy() for k, v in x.items()})
    return out


def reference_gradients(model, steps, seed):
    """Random gradients of varying scale with a few exact zeros (Rprop's third branch)."""
    gen = rng(seed)
    grads = []
    for _ in range(steps):
        g = random_like(model, gen, scale=float(np.exp(gen.uniform(-1.5, 2))))
        for v in g.values():
            v[gen.random(v.shape) < 0.1] = 0
        grads.append(g)
    return grads


REFERENCE_PARAMS = [
    pytest.param(case, dtype, id=f"{case_id}-{np.dtype(dtype).name}")
    for case, case_id in zip(RULES, IDS)
    if case.ref is not None
    for dtype in (np.float64, np.complex128)
    if dtype == np.float64 or supports_complex(case.rule)
]


@pytest.mark.parametrize("case, dtype", REFERENCE_PARAMS)
def test_matches_reference_formulas(case, dtype):
    model = small_model(dtype, seed=4, rule=case.rule)
    grads_list = reference_gradients(model, 20, seed=5)
    expected = reference_trajectory(case, model, grads_list)
    state = opt.setup(case.rule, model)
    for t, (grads, want) in enumerate(zip(grads_list, expected), start=1):
        state, model = opt.update(state, model, grads)
        for k in model:
            np.testing.assert_allclose(model[k], want[k], rtol=1e-12, atol=1e-13, err_msg=f"step {t}, {k}")


# --- constructors: defaults, positional order, validation, equality ------------------------------

DEFAULTS = [(info.cls, info.defaults) for info in REGISTRY if info.defaults is not None]


@pytest.mark.parametrize("cls, expected", DEFAULTS, ids=[cls.__name__ for cls, _ in DEFAULTS])
def test_defaults_and_hyperparameter_names(cls, expected):
    rule = cls()
    assert {name: getattr(rule, name) for name in rule.hyperparameters()} == expected


def test_positional_order_and_int_conversion():
    assert AdamW(0.1, (0.8, 0.9), 0.01, 1e-6) == AdamW(eta=0.1, beta=(0.8, 0.9), lambd=0.01, epsilon=1e-6)
    assert RMSProp(0.1, 0.5, 1e-3).rho == 0.5
    assert Rprop(0.1, (0.4, 1.5), (1e-5, 10.0)).ell == (0.4, 1.5)
    assert ClipNorm(5, 1) == ClipNorm(omega=5.0, p=1.0)
    rule = ClipGrad(2)  # ints become floats, as in Optimisers.jl
    assert rule.delta == 2.0 and isinstance(rule.delta, float)
    assert Adam(1, (0, 0)).beta == (0.0, 0.0)
    with pytest.raises(TypeError):
        RMSProp(0.1, 0.9, 1e-8, True)  # centred is keyword only
    with pytest.raises(TypeError):
        AdamW(0.1, (0.9, 0.99), 0.0, 1e-8, False)  # so is couple


INVALID = [
    (lambda: Descent(-0.1), ValueError, "learning rate"),
    (lambda: Adam(-1e-3), ValueError, "learning rate"),
    (lambda: Adam("0.1"), TypeError, "eta"),
    (lambda: Adam(epsilon=1j), TypeError, "epsilon"),
    (lambda: Adam(beta=(0.9, 0.99j)), TypeError, r"beta\[1\]"),
    (lambda: Adam(beta=(0.9,)), TypeError, "tuple of 2"),
    (lambda: Adam(beta=0.9), TypeError, "tuple of 2"),
    (lambda: Adam(beta=(0.9, 1.0)), ValueError, r"Adam: beta\[1\]"),
    (lambda: NAdam(beta=(-0.1, 0.9)), ValueError, r"beta\[0\]"),
    (lambda: Adam(epsilon=-1e-8), ValueError, "epsilon"),
    (lambda: Momentum(rho=1.5), ValueError, "rho"),
    (lambda: RMSProp(rho=-0.5), ValueError, "rho"),
    (lambda: RMSProp(centred=1), TypeError, "centred"),
    (lambda: AdaDelta(rho=2.0), ValueError, "rho"),
    (lambda: Rprop(ell=(1.5, 1.2)), ValueError, "ell"),
    (lambda: Rprop(ell=(0.5, 0.9)), ValueError, "ell"),
    (lambda: Rprop(gamma=(1.0, 0.1)), ValueError, "gamma"),
    (lambda: Lion(beta=(1.5, 0.9)), ValueError, "beta"),
    (lambda: AdamW(lambd=-0.1), ValueError, "lambd"),
    (lambda: AdamW(couple="yes"), TypeError, "couple"),
    (lambda: WeightDecay(-1.0), ValueError, "lambd"),
    (lambda: SignDecay(None), TypeError, "lambd"),
    (lambda: ClipGrad(-1.0), ValueError, "delta"),
    (lambda: ClipNorm(0.0), ValueError, "omega"),
    (lambda: ClipNorm("10"), TypeError, "omega"),
    (lambda: ClipNorm(p=float("nan")), ValueError, "p"),
    (lambda: ClipNorm(throw=None), TypeError, "throw"),
    (lambda: AccumGrad(0), ValueError, "positive integer"),
    (lambda: AccumGrad(2.0), TypeError, "positive integer"),
    (lambda: AccumGrad(True), TypeError, "positive integer"),
    (lambda: OptimiserChain(Adam(), "sgd"), TypeError, "member 1"),
    (lambda: OptimiserChain(Adam), TypeError, "instance"),
    (lambda: OptimiserChain(ClipGrad(), MixedPrecision(Adam())), TypeError, "wrap the chain"),
    (lambda: MixedPrecision("adam"), TypeError, "Rule"),
    (lambda: MixedPrecision(Adam(), np.int32), ValueError, "floating"),
    (lambda: MixedPrecision(Adam(), np.complex64), ValueError, "floating"),
    (lambda: MixedPrecision(Adam(), "not a dtype"), TypeError, "floating"),
]


@pytest.mark.parametrize("make, error, match", INVALID)
def test_invalid_hyperparameters_are_rejected(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_rules_compare_by_value_and_print_readably():
    assert Adam() == Adam(0.001, (0.9, 0.999), 1e-8) and hash(Adam()) == hash(Adam(0.001))
    assert Adam(0.1) != Adam(0.2) and Adam() != AdaMax()
    chain = OptimiserChain(ClipGrad(1.0), Adam())
    assert chain == OptimiserChain(ClipGrad(1.0), Adam()) != OptimiserChain(Adam(), ClipGrad(1.0))
    assert hash(chain) == hash(OptimiserChain(ClipGrad(1.0), Adam()))
    assert repr(chain) == (
        "OptimiserChain(ClipGrad(delta=1.0), Adam(eta=0.001, beta=(0.9, 0.999), epsilon=1e-08))"
    )
    assert repr(OptimiserChain()) == "OptimiserChain()"
    assert repr(MixedPrecision(Descent(0.5), np.float64)) == "MixedPrecision(Descent(eta=0.5), dtype=float64)"
    assert MixedPrecision(Adam()) == MixedPrecision(Adam(), np.dtype("float32"))
    assert chain.rules == (ClipGrad(1.0), Adam())


def test_elementwise_flags():
    assert Adam.elementwise and Rprop.elementwise and AccumGrad.elementwise
    assert not ClipNorm().elementwise  # the norm couples all elements of an array
    assert OptimiserChain(ClipGrad(), Adam()).elementwise
    assert not OptimiserChain(ClipNorm(), Adam()).elementwise
    assert MixedPrecision(Adam()).elementwise and not MixedPrecision(ClipNorm()).elementwise


# --- adjust ----------------------------------------------------------------------------------------


def test_adjust_forwards_through_chains():
    chain = OptimiserChain(ClipGrad(1.0), WeightDecay(), Adam(0.1))
    assert chain.hyperparameters() == ("delta", "lambd", "eta", "beta", "epsilon")
    model = {"w": np.ones(3)}
    state = opt.setup(chain, model)
    state, model = opt.update(state, model, {"w": np.full(3, 2.0)})
    before = state_parts(state)

    new = opt.adjust(state, 0.01)
    assert new["w"].rule == OptimiserChain(ClipGrad(1.0), WeightDecay(), Adam(0.01))
    assert all(a is b for a, b in zip(state_parts(new), before))  # optimiser state kept
    assert state["w"].rule == chain  # pure

    new = opt.adjust(state, delta=0.5, beta=(0.8, 0.9), lambd=0.0)
    assert new["w"].rule == OptimiserChain(ClipGrad(0.5), WeightDecay(0.0), Adam(0.1, (0.8, 0.9)))
    with pytest.raises(ValueError, match="rho"):
        opt.adjust(state, rho=0.5)
    with pytest.raises(ValueError, match="learning rate"):
        opt.adjust(state, -1.0)
    opt.adjust_(state, 0.02)
    assert state["w"].rule.rules[2] == Adam(0.02)


def test_adjust_changes_every_member_with_the_name():
    chain = OptimiserChain(Descent(0.1), OptimiserChain(Momentum(0.2)), ClipGrad())
    assert chain.adjust(eta=0.3) == OptimiserChain(Descent(0.3), OptimiserChain(Momentum(0.3)), ClipGrad())
    assert chain.adjust(omega=1.0) is chain  # nothing to change
    assert Adam().adjust(rho=0.5) == Adam()


def test_adjust_forwards_through_mixed_precision():
    rule = MixedPrecision(OptimiserChain(ClipGrad(), Adam(0.1)), np.float64)
    assert rule.hyperparameters() == ("delta", "eta", "beta", "epsilon")
    assert rule.adjust(eta=0.2) == MixedPrecision(OptimiserChain(ClipGrad(), Adam(0.2)), np.float64)
    model = {"w": np.ones(3, np.float32)}
    state = opt.setup(rule, model)
    state, model = opt.update(state, model, {"w": np.ones(3, np.float32)})
    master = state["w"].state[0]
    new = opt.adjust(state, 0.05, delta=2.0)
    assert new["w"].rule == MixedPrecision(OptimiserChain(ClipGrad(2.0), Adam(0.05)), np.float64)
    assert new["w"].state[0] is master
    with pytest.raises(ValueError, match="dtype"):
        opt.adjust(state, dtype=np.float32)  # the master copy's dtype is fixed at setup


def test_rmsprop_centred_cannot_be_adjusted():
    assert RMSProp(centred=True).adjust(eta=0.1) == RMSProp(0.1, centred=True)
    with pytest.raises(ValueError, match="centred"):
        RMSProp().adjust(centred=True)
    state = opt.setup(OptimiserChain(ClipGrad(), RMSProp()), {"w": np.ones(2)})
    with pytest.raises(ValueError, match="centred"):
        opt.adjust(state, centred=True)
    assert isinstance(opt.setup(RMSProp(centred=True), {"w": np.ones(2)})["w"].state, tuple)


def test_adadelta_has_no_learning_rate():
    state = opt.setup(AdaDelta(), {"w": np.ones(2)})
    with pytest.raises(ValueError, match="eta"):
        opt.adjust(state, 0.1)
    assert opt.adjust(state, rho=0.5)["w"].rule == AdaDelta(0.5)


# --- the documented examples ---------------------------------------------------------------------


def test_adam_docs_example():
    state = opt.setup(Adam(0.1), {"w": np.zeros(2)})
    state, _ = opt.update(state, {"w": np.zeros(2)}, {"w": np.ones(2)})
    m, v, t = state["w"].state
    # Optimisers.jl stores (β1ᵗ⁺¹, β2ᵗ⁺¹) = (0.81, 0.998001) where we store the step count
    np.testing.assert_allclose(m, [0.1, 0.1], rtol=1e-15)
    np.testing.assert_allclose(v, [0.001, 0.001], rtol=1e-15)
    assert t == 1
    state, _ = opt.update(state, {"w": np.zeros(2)}, {"w": np.zeros(2)})
    m, v, t = state["w"].state
    np.testing.assert_allclose(m, [0.09, 0.09], rtol=1e-15)
    np.testing.assert_allclose(v, [0.000999, 0.000999], rtol=1e-15)
    assert t == 2


def test_nesterov_docs_example():
    state = opt.setup(Nesterov(), {"w": np.zeros(2)})
    state, _ = opt.update(state, {"w": np.zeros(2)}, {"w": np.array([16.0, 88.0])})
    np.testing.assert_allclose(state["w"].state, [-0.016, -0.088], rtol=1e-15)


def test_chain_order_docs_example():
    rule = OptimiserChain(ClipGrad(1.0), Descent(0.1))
    _, model = opt.update(
        opt.setup(rule, {"w": np.zeros(3)}), {"w": np.zeros(3)}, {"w": np.array([0.3, 1, 7])}
    )
    np.testing.assert_allclose(model["w"], [-0.03, -0.1, -0.1], rtol=1e-15)
    reverse = OptimiserChain(Descent(0.1), ClipGrad(1.0))
    _, model = opt.update(
        opt.setup(reverse, {"w": np.zeros(3)}), {"w": np.zeros(3)}, {"w": np.array([0.3, 1, 7])}
    )
    np.testing.assert_allclose(model["w"], [-0.03, -0.1, -0.7], rtol=1e-15)


@pytest.mark.parametrize("inplace", [False, True])
def test_accum_grad_docs_example(inplace):
    update = opt.update_ if inplace else opt.update
    model = {"x": np.array([1.0], np.float32), "y": np.array([2.0], np.float32)}
    state = opt.setup(OptimiserChain(AccumGrad(2), WeightDecay(0.01), Descent(0.1)), model)
    state, model = update(state, model, {"x": np.array([33.0], np.float32), "y": np.array([0.0], np.float32)})
    assert model["x"][0] == 1 and model["y"][0] == 2
    state, model = update(
        state, model, {"x": np.array([0.0], np.float32), "y": np.array([444.0], np.float32)}
    )
    assert model["x"].dtype == np.float32
    assert model["x"][0] == np.float32(-0.651) and model["y"][0] == np.float32(-20.202002)


def test_sign_decay_and_weight_decay_add_penalties_to_the_loss():
    # OptimiserChain(SignDecay(0.012), WeightDecay(0.034), Adam()) is Adam on the loss plus
    # 0.012‖x‖₁ + 0.017‖x‖², whose gradient is g + 0.012·sign(x) + 0.034·x
    x0 = np.array([-2.0, 0.0, 0.5, 3.0])
    gen = rng(6)
    chain_model, adam_model = {"w": x0.copy()}, {"w": x0.copy()}
    chain_state = opt.setup(OptimiserChain(SignDecay(0.012), WeightDecay(0.034), Adam()), chain_model)
    adam_state = opt.setup(Adam(), adam_model)
    for _ in range(5):
        g = gen.standard_normal(4)
        penalised = g + 0.012 * np.sign(adam_model["w"]) + 0.034 * adam_model["w"]
        chain_state, chain_model = opt.update(chain_state, chain_model, {"w": g})
        adam_state, adam_model = opt.update(adam_state, adam_model, {"w": penalised})
        np.testing.assert_allclose(chain_model["w"], adam_model["w"], rtol=1e-14)

    # alone, each subtracts the modified gradient (like Descent(1))
    _, model = opt.update(opt.setup(WeightDecay(0.1), {"w": x0}), {"w": x0}, {"w": np.full(4, 0.5)})
    np.testing.assert_allclose(model["w"], x0 - (0.5 + 0.1 * x0), rtol=1e-15)
    _, model = opt.update(opt.setup(SignDecay(), {"w": x0}), {"w": x0}, {"w": np.zeros(4)})
    np.testing.assert_allclose(model["w"], [-1.999, 0.0, 0.499, 2.999], rtol=1e-15)


# --- chains and accumulation ---------------------------------------------------------------------


def test_chain_stops_at_a_skipped_step_and_later_members_keep_their_state():
    model = {"w": np.ones(3)}
    state = opt.setup(OptimiserChain(AccumGrad(2), Adam(0.1)), model)
    state, model = opt.update(state, model, {"w": np.full(3, 2.0)})
    (acc, k), (m, v, t) = state["w"].state
    np.testing.assert_array_equal(model["w"], np.ones(3))
    np.testing.assert_array_equal(acc, np.full(3, 1.0))
    assert k == 1 and t == 0 and not m.any() and not v.any()
    state, model = opt.update(state, model, {"w": np.full(3, 4.0)})
    (acc, k), (m, v, t) = state["w"].state
    assert k == 0 and t == 1
    np.testing.assert_allclose(m, np.full(3, 0.3))  # (1 - β1)·mean(2, 4)
    np.testing.assert_allclose(model["w"], np.full(3, 0.9))  # Adam's first step is η·sign(g)


def test_empty_chain_subtracts_the_gradient():
    _, model = opt.update(
        opt.setup(OptimiserChain(), {"w": np.ones(2)}), {"w": np.ones(2)}, {"w": np.array([0.25, -1])}
    )
    np.testing.assert_array_equal(model["w"], [0.75, 2.0])


def test_accum_grad_steps_every_n_calls_by_the_mean():
    model = {"w": np.zeros(2)}
    state = opt.setup(AccumGrad(3), model)
    moved = []
    for i in range(7):
        before = model["w"].copy()
        state, model = opt.update(state, model, {"w": np.array([i, 2.0 * i])})
        moved.append(not np.array_equal(before, model["w"]))
    assert moved == [False, False, True, False, False, True, False]
    np.testing.assert_allclose(model["w"], -np.array([1 + 4, 2 + 8]))  # means of 0..2 and 3..5


# --- ClipNorm --------------------------------------------------------------------------------------

NORMS = [2.0, 1.0, math.inf, -math.inf, 0.0, 3.0, 0.5, -1.0]


@pytest.mark.parametrize("p", NORMS)
def test_clip_norm_p_norms(p):
    g = rng(7).uniform(0.5, 2.0, (3, 4)) * rng(8).choice([-1, 1], (3, 4))
    n = np.linalg.norm(g.ravel(), ord=p)
    x = np.zeros((3, 4))
    _, clipped = opt.update(opt.setup(ClipNorm(n / 2, p), {"w": x}), {"w": x}, {"w": g})
    np.testing.assert_allclose(clipped["w"], -g / 2, rtol=1e-13)
    _, kept = opt.update(opt.setup(ClipNorm(2 * n, p), {"w": x}), {"w": x}, {"w": g})
    np.testing.assert_allclose(kept["w"], -g, rtol=1e-15)


def test_clip_norm_of_a_zero_gradient_and_of_complex_gradients():
    _, model = opt.update(opt.setup(ClipNorm(), {"w": np.ones(3)}), {"w": np.ones(3)}, {"w": np.zeros(3)})
    np.testing.assert_array_equal(model["w"], np.ones(3))
    g = np.array([3 + 4j, 0j])  # |g| = 5
    x = np.zeros(2, np.complex128)
    _, model = opt.update(opt.setup(ClipNorm(1.0), {"w": x}), {"w": x}, {"w": g})
    np.testing.assert_allclose(model["w"], -g / 5, rtol=1e-15)


@pytest.mark.parametrize("bad, shown", [(np.inf, "inf"), (np.nan, "nan")])
def test_clip_norm_throws_on_a_non_finite_norm(bad, shown):
    model = {"w": np.ones(3)}
    state = opt.setup(OptimiserChain(ClipNorm(), Adam()), model)
    with pytest.raises(ValueError, match=f"2.0-norm of the gradient is {shown}"):
        opt.update_(state, model, {"w": np.array([1.0, bad, 0.0])})
    np.testing.assert_array_equal(model["w"], np.ones(3))
    assert state["w"].state[1][2] == 0  # the failed call changed nothing

    model = {"w": np.ones(3)}
    state = opt.setup(ClipNorm(throw=False), model)
    with np.errstate(invalid="ignore"):  # 0·inf
        _, new = opt.update(state, model, {"w": np.array([1.0, bad, 0.0])})
    if bad == np.inf:  # the factor is 0: finite entries stay, the infinite one becomes NaN
        np.testing.assert_array_equal(new["w"], [1.0, np.nan, 1.0])
    else:
        assert np.isnan(new["w"]).all()


# --- precision -------------------------------------------------------------------------------------


def test_float16_epsilon_floor_keeps_adam_finite():
    """The floor matters where a rule's maths meets float16 arrays: `apply` called directly
    (updates run it in float32, see test_half_precision.py)."""
    assert np.float16(1e-8) == 0  # without the floor, √v + ε would be 0 below
    g = np.full(3, 1e-4, np.float16)
    assert not np.any(g.astype(np.float16) ** 2)  # |g|² underflows, so v = 0
    x = np.zeros(3, np.float16)
    _, step = Adam().apply(Adam().init(x), x, g)
    assert step.dtype == np.float16 and np.all(np.isfinite(step))
    # step = η·m̂/(0 + ε₁₆) with ε₁₆ = float16(1e-7) ≈ 1.19e-7: about 0.84, give or take the
    # coarse rounding of η·m̂ ≈ 1e-7, a float16 subnormal
    assert np.all((0.5 < step) & (step < 1.5))
    # an explicit zero epsilon is kept (and then divides by zero, as asked)
    with np.errstate(divide="ignore", invalid="ignore"):
        _, step = Adam(epsilon=0.0).apply(Adam().init(x), x, g)
    assert not np.all(np.isfinite(step))
    # an update computes in float32, where v does not underflow: Adam's first step is
    # η·g/(|g| + ε), just under η
    model = {"w": x}
    _, model = opt.update(opt.setup(Adam(), model), model, {"w": g})
    gv = float(g[0])
    np.testing.assert_array_equal(model["w"], np.full(3, -1e-3 * gv / (gv + 1e-8), np.float16))


def test_radam_in_float16_over_the_rectified_steps():
    model = {"w": np.ones(4, np.float16)}
    state = opt.setup(RAdam(0.01), model)
    gen = rng(9)
    for _ in range(12):  # ρ > 4 from the fifth step; ρ∞ ≈ 2047 in float16
        state, model = opt.update(state, model, random_like(model, gen))
    assert model["w"].dtype == np.float16 and np.all(np.isfinite(model["w"]))


def test_rprop_does_not_widen_the_state_with_float64_gradients():
    rule = Rprop()
    model = {"w": np.ones(4, np.float32)}
    state = opt.setup(rule, model)
    for g in ([1.0, -1.0, 0.0, 2.0], [1.0, 1.0, 1.0, -2.0]):
        state, model = opt.update(state, model, {"w": np.array(g)})
        assert model["w"].dtype == np.float32
        assert all(s.dtype == np.float32 for s in state["w"].state)
    x = np.ones(4, np.float32)  # called directly, too
    new, step = rule.apply(rule.init(x), x, np.ones(4))
    assert step.dtype == np.float32 and all(s.dtype == np.float32 for s in new)


# --- MixedPrecision ------------------------------------------------------------------------------


@pytest.mark.parametrize("inplace", [False, True])
def test_mixed_precision_trains_a_float32_master_copy(inplace):
    update = opt.update_ if inplace else opt.update
    x0 = rng(10).standard_normal(6).astype(np.float16)
    model = {"w": x0.copy()}
    state = opt.setup(MixedPrecision(Adam(0.01)), model)
    reference = ref.adam(0.01)
    master_ref = x0.astype(np.float64)
    gen = rng(11)
    for _ in range(10):
        g = gen.standard_normal(6).astype(np.float16)
        state, model = update(state, model, {"w": g})
        master, (m, v, t) = state["w"].state
        master_ref = master_ref - reference(master_ref, g.astype(np.float64))
        assert master.dtype == np.float32 and m.dtype == np.float32
        assert model["w"].dtype == np.float16
        np.testing.assert_array_equal(model["w"], master.astype(np.float16))
        np.testing.assert_allclose(master, master_ref, rtol=1e-5, atol=1e-6)


def test_mixed_precision_accumulates_steps_too_small_for_float16():
    # float16 spacing at 1.0 is ~1e-3: a 1e-4 step is lost on the parameter but kept on the master
    model = {"w": np.ones(1, np.float16)}
    plain = opt.setup(Descent(1e-4), model)
    mixed = opt.setup(MixedPrecision(Descent(1e-4)), model)
    plain_model, mixed_model = model, model
    for _ in range(10):
        plain, plain_model = opt.update(plain, plain_model, {"w": np.ones(1, np.float16)})
        mixed, mixed_model = opt.update(mixed, mixed_model, {"w": np.ones(1, np.float16)})
    assert plain_model["w"][0] == 1
    np.testing.assert_allclose(mixed_model["w"], [0.999], rtol=1e-3)
    np.testing.assert_allclose(mixed["w"].state[0], [0.999], rtol=1e-6)


def test_mixed_precision_with_a_skipped_step_and_a_float64_master():
    model = {"w": np.ones(2, np.float32)}
    state = opt.setup(MixedPrecision(OptimiserChain(AccumGrad(2), Descent(0.1)), np.float64), model)
    assert state["w"].state[0].dtype == np.float64
    state, model = opt.update(state, model, {"w": np.ones(2, np.float32)})
    np.testing.assert_array_equal(model["w"], np.ones(2))
    state, model = opt.update(state, model, {"w": np.full(2, 3.0, np.float32)})
    assert model["w"].dtype == np.float32
    np.testing.assert_allclose(state["w"].state[0], [0.8, 0.8], rtol=1e-15)
    np.testing.assert_array_equal(model["w"], np.float32(0.8))


def test_clipnorm_float16_gradient_with_a_large_norm_is_clipped_not_rejected():
    # 1000 entries of 10: norm 316, representable in float16, but a float16 sum of squares overflows
    x = np.zeros(1000, np.float16)
    state = opt.setup(opt.ClipNorm(1.0), {"x": x})
    _, new = opt.update(state, {"x": x}, {"x": np.full(1000, 10, np.float16)})
    assert new["x"].dtype == np.float16
    np.testing.assert_allclose(np.linalg.norm(new["x"].astype(np.float64)), 1.0, rtol=1e-3)
