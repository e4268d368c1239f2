"""optax's own tests of its optimisers, run on `optimisers.optax.transform` of this library's rules.

The tests are `optax/_src/alias_test.py` and `optax/contrib/_common_test.py`, which the installed
optax wheel ships (nothing is copied or fetched), unmodified. Each is loaded as a module of its
own whose `alias` and `contrib` are stand-ins: an optax factory that has a counterpart among this
library's rules (`optax.adam(lr, b1, b2, eps)` and `Adam(lr, (b1, b2), eps)`) is
`transform(<the rule>)` there, built by the factories below with optax's signatures (so that
`inject_hyperparams` and the tests' `inspect.signature` see what they see in optax's); every other
name is optax's own, so that optax's wrappers (`MultiSteps`, `inject_hyperparams`, `mechanize`,
`reduce_on_plateau`) wrap the rules.

Only the tests that build a swapped factory are collected: a test of a factory without a
counterpart (`optax.adan`, `optax.contrib.sophia`) would test optax, and is left out, as are the
tests of one optax algorithm (`LBFGSTest`, ...); each collected test checks that it built one of
this library's rules. Which factories have counterparts, and where the formulas differ, is in
docs/optax.md; no test here compares numbers with optax's own factories (they compare a
transformation with itself, under `inject_hyperparams`, `MultiSteps`, `lax.cond`, or check
convergence), so every test that passes on optax's factories must pass here.
`OPTIMISERS_PEER_REFERENCE=1` runs the same tests on optax's own factories instead.

alias_test imports scikit-learn for its L-BFGS tests, which are not run here: when it is not
installed, empty stand-ins are imported in its place while the file loads.
"""

import functools
import importlib.util
import inspect
import os
import sys
import types
import unittest

import pytest

pytest.importorskip("optax")
pytest.importorskip("absl.testing.parameterized")
jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from optax import contrib as _optax_contrib  # noqa: E402
from optax._src import alias as _optax_alias  # noqa: E402
from optax._src import base as _base  # noqa: E402

import optimisers as opt  # noqa: E402
import optimisers.optax as opt_optax  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    # optax's tests of its deprecated optimistic_adam expect the warning; they are not run here,
    # but their module warns on import on some versions
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

# --- the counterparts: optax factories that build `transform(<a rule>)` ---------------------------

# every transformation a counterpart factory built while a test ran (see `_swapped_only`)
_BUILT: list = []


def _built(rule):
    tx = opt_optax.transform(rule)
    _BUILT.append(rule)
    return tx


def _no_counterpart(what: str):
    raise unittest.SkipTest(f"{what} has no counterpart among optimisers' rules")


def _state_dtype_kwargs(name, dtype):
    return {} if dtype is None else {name: dtype}


Lr = _base.ScalarOrSchedule


def adabelief(learning_rate: Lr, b1=0.9, b2=0.999, eps=1e-16, eps_root=1e-16, *, nesterov=False):
    if nesterov or not _is_zero(_difference(eps_root, eps)):
        _no_counterpart("adabelief with nesterov or eps_root != eps")
    return _built(opt.AdaBelief(learning_rate, (b1, b2), eps))


def adadelta(learning_rate: Lr | None = None, rho=0.9, eps=1e-6, weight_decay=0.0, weight_decay_mask=None):
    if weight_decay_mask is not None or not _is_zero(weight_decay):
        _no_counterpart("adadelta with weight decay")
    rule = opt.AdaDelta(rho, eps)
    return _built(rule if learning_rate is None else opt.OptimiserChain(rule, opt.Descent(learning_rate)))


def adafactor(
    learning_rate: Lr | None = None,
    min_dim_size_to_factor: int = 128,
    decay_rate=0.8,
    decay_offset=0,
    multiply_by_parameter_scale: bool = True,
    clipping_threshold=1.0,
    momentum=None,
    dtype_momentum=jnp.float32,
    weight_decay_rate: Lr | None = None,
    eps=1e-30,
    factored: bool = True,
    weight_decay_mask=None,
):
    del min_dim_size_to_factor, dtype_momentum, eps  # differences listed in docs/optax.md
    if (
        learning_rate is None
        or not _is_zero(decay_offset)
        or not multiply_by_parameter_scale
        or momentum is not None
        or weight_decay_rate is not None
        or not factored
        or clipping_threshold is None
    ):
        _no_counterpart("adafactor without a learning rate, or with optax's other options")
    return _built(opt.Adafactor(learning_rate, -decay_rate, d=clipping_threshold))


def adagrad(learning_rate: Lr, initial_accumulator_value=0.1, eps=1e-7):
    del initial_accumulator_value  # listed in docs/optax.md
    return _built(opt.AdaGrad(learning_rate, eps))


def adam(learning_rate: Lr, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None, *, nesterov=False):
    if nesterov or not _is_zero(eps_root):
        _no_counterpart("adam with nesterov or eps_root")
    return _built(opt.Adam(learning_rate, (b1, b2), eps, **_state_dtype_kwargs("mu_dtype", mu_dtype)))


def adamax(learning_rate: Lr, b1=0.9, b2=0.999, eps=1e-8):
    return _built(opt.AdaMax(learning_rate, (b1, b2), eps))


def adamw(
    learning_rate: Lr,
    b1=0.9,
    b2=0.999,
    eps=1e-8,
    eps_root=0.0,
    mu_dtype=None,
    weight_decay: Lr = 1e-4,
    mask=None,
    *,
    nesterov=False,
):
    if nesterov or not _is_zero(eps_root) or mask is not None or callable(weight_decay):
        _no_counterpart("adamw with nesterov, eps_root, a mask or a weight decay schedule")
    kwargs = _state_dtype_kwargs("mu_dtype", mu_dtype)
    return _built(opt.AdamW(learning_rate, (b1, b2), weight_decay, eps, **kwargs))


def amsgrad(learning_rate: Lr, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None):
    if not _is_zero(eps_root) or mu_dtype is not None:
        _no_counterpart("amsgrad with eps_root or mu_dtype")
    return _built(opt.AMSGrad(learning_rate, (b1, b2), eps))


def lamb(learning_rate: Lr, b1=0.9, b2=0.999, eps=1e-6, eps_root=0.0, weight_decay: Lr = 0.0, mask=None):
    if not _is_zero(eps_root) or mask is not None or callable(weight_decay):
        _no_counterpart("lamb with eps_root, a mask or a weight decay schedule")
    return _built(opt.LAMB(learning_rate, (b1, b2), eps, weight_decay))


def lars(
    learning_rate: Lr,
    weight_decay: Lr = 0.0,
    weight_decay_mask=True,
    trust_coefficient=0.001,
    eps=0.0,
    trust_ratio_mask=True,
    momentum=0.9,
    nesterov: bool = False,
):
    if weight_decay_mask is not True or trust_ratio_mask is not True or callable(weight_decay):
        _no_counterpart("lars with masks or a weight decay schedule")
    return _built(opt.LARS(learning_rate, momentum, weight_decay, trust_coefficient, eps, nesterov=nesterov))


def lion(learning_rate: Lr, b1=0.9, b2=0.99, mu_dtype=None, weight_decay: Lr = 1e-3, mask=None):
    if mu_dtype is not None or mask is not None:
        _no_counterpart("lion with mu_dtype or a mask")
    rule = opt.Lion(learning_rate, (b1, b2))
    if _is_zero(weight_decay) and not _is_traced(weight_decay):
        return _built(rule)
    # optax scales the decay by the learning rate, `lr·(sign(...) + λ·x)`: here the decay
    # `lr·λ` follows Lion in a chain (a schedule of the step count where either is one)
    if callable(learning_rate) or callable(weight_decay):
        lr, wd = (v if callable(v) else (lambda _, v=v: v) for v in (learning_rate, weight_decay))
        decay = _Product(lr, wd)
    else:
        decay = learning_rate * weight_decay
    return _built(opt.OptimiserChain(rule, opt.WeightDecay(decay)))


class _Product:
    """The schedule `a(count) · b(count)`."""

    def __init__(self, a, b):
        self.a, self.b = a, b

    def __call__(self, count):
        return self.a(count) * self.b(count)


def _is_traced(value) -> bool:
    return isinstance(value, jax.core.Tracer)


def nadam(learning_rate: Lr, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None, *, nesterov=True):
    if not nesterov or not _is_zero(eps_root) or mu_dtype is not None:
        _no_counterpart("nadam with eps_root or mu_dtype")
    return _built(opt.NAdam(learning_rate, (b1, b2), eps))


def optimistic_adam_v2(
    learning_rate: Lr,
    *,
    alpha=1.0,
    beta=1.0,
    b1=0.9,
    b2=0.999,
    eps=1e-8,
    eps_root=0.0,
    mu_dtype=None,
    nesterov: bool = True,
):
    others = (_difference(alpha, 1.0), _difference(beta, 1.0), eps_root)
    if not all(map(_is_zero, others)):
        _no_counterpart("optimistic_adam_v2 with other alpha, beta or eps_root")
    if mu_dtype is not None:
        _no_counterpart("optimistic_adam_v2 with mu_dtype")
    return _built(opt.OAdam(learning_rate, (b1, b2), eps))


def radam(learning_rate: Lr, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, threshold=5.0, *, nesterov=False):
    del threshold  # RAdam's is 4 (listed in docs/optax.md)
    if nesterov or not _is_zero(eps_root):
        _no_counterpart("radam with nesterov or eps_root")
    return _built(opt.RAdam(learning_rate, (b1, b2), eps))


def rmsprop(
    learning_rate: Lr,
    decay=0.9,
    eps=1e-8,
    initial_scale=0.0,
    eps_in_sqrt: bool = True,
    centered: bool = False,
    momentum=None,
    nesterov: bool = False,
    bias_correction: bool = False,
):
    del eps_in_sqrt  # RMSProp's ε is outside the root (listed in docs/optax.md)
    if not _is_zero(initial_scale) or nesterov or bias_correction:
        _no_counterpart("rmsprop with initial_scale, nesterov or bias_correction")
    rule = opt.RMSProp(learning_rate, decay, eps, centred=centered)
    if momentum is None:
        return _built(rule)
    return _built(opt.OptimiserChain(rule, opt.Momentum(1.0, momentum)))


def rprop(learning_rate, eta_minus=0.5, eta_plus=1.2, min_step_size=1e-6, max_step_size=50.0):
    return _built(opt.Rprop(learning_rate, (eta_minus, eta_plus), (min_step_size, max_step_size)))


def sgd(learning_rate: Lr, momentum=None, nesterov: bool = False, accumulator_dtype=None):
    if momentum is None:
        if accumulator_dtype is not None:
            _no_counterpart("sgd without momentum with an accumulator_dtype")
        return _built(opt.Descent(learning_rate))
    kwargs = _state_dtype_kwargs("accumulator_dtype", accumulator_dtype)
    cls = opt.Nesterov if nesterov else opt.Momentum
    return _built(cls(learning_rate, momentum, **kwargs))


def ademamix(
    learning_rate: Lr,
    b1=0.9,
    b2=0.999,
    b3: Lr = 0.9999,
    alpha: Lr = 5.0,
    eps=1e-8,
    eps_root=0.0,
    mu_dtype=None,
    weight_decay=0.0,
    mask=None,
):
    if callable(b3) or callable(alpha) or not _is_zero(eps_root) or mu_dtype is not None or mask is not None:
        _no_counterpart("ademamix with schedules for b3 or alpha, eps_root, mu_dtype or a mask")
    return _built(opt.AdEMAMix(learning_rate, (b1, b2, b3), alpha, eps, weight_decay))


def adopt(
    learning_rate: Lr,
    b1=0.9,
    b2=0.9999,
    eps=1e-6,
    mu_dtype=None,
    *,
    nesterov: bool = False,
    use_clipping: bool = True,
    clip_value_fn=_optax_contrib.adopt.__kwdefaults__["clip_value_fn"],
):
    if nesterov or not use_clipping or mu_dtype is not None:
        _no_counterpart("adopt with nesterov, without clipping or with mu_dtype")
    if clip_value_fn is not _optax_contrib.adopt.__kwdefaults__["clip_value_fn"]:
        _no_counterpart("adopt with another clip_value_fn")
    return _built(opt.ADOPT(learning_rate, (b1, b2), eps))


def schedule_free_sgd(
    learning_rate=1.0, warmup_steps: int | None = None, b1=0.9, weight_decay=None, weight_lr_power=2.0,
    state_dtype=None,
):
    if state_dtype is not None:
        _no_counterpart("schedule_free_sgd with a state_dtype")
    return _built(
        opt.ScheduleFreeSGD(
            learning_rate, b1, weight_decay or 0.0, warmup_steps or 0, weight_lr_power=weight_lr_power
        )
    )


def schedule_free_adamw(
    learning_rate=0.0025, warmup_steps: int | None = None, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0,
    weight_lr_power=2.0, state_dtype=None,
):
    if state_dtype is not None:
        _no_counterpart("schedule_free_adamw with a state_dtype")
    return _built(
        opt.ScheduleFreeAdamW(
            learning_rate, (b1, b2), eps, weight_decay, warmup_steps or 0, weight_lr_power=weight_lr_power
        )
    )


def schedule_free_eval_params(state, params):
    """optax's, or for a state of `transform` `optimisers.eval_params`: the point to evaluate."""
    inner = state if isinstance(state, opt.State) else getattr(state, "inner_state", None)
    if isinstance(inner, opt.State):
        return opt.eval_params(inner, params)
    return _optax_contrib.schedule_free_eval_params(state, params)


def _difference(a, b):
    try:
        return float(a) - float(b)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return a  # traced: see _is_zero


def _is_zero(value) -> bool:
    """Is `value` zero, as far as can be known: `inject_hyperparams` hands the factories its
    numbers as traced arrays (at the values the test gave, the defaults here)."""
    if callable(value):
        return False
    try:
        return float(value) == 0
    except (TypeError, jax.errors.ConcretizationTypeError):
        return True  # traced: the test's own value, which was checked when it was a number


_ALIAS_COUNTERPARTS = {
    f.__name__: f
    for f in (
        adabelief, adadelta, adafactor, adagrad, adam, adamax, adamw, amsgrad, lamb, lars, lion,
        nadam, optimistic_adam_v2, radam, rmsprop, rprop, sgd,
    )
}
_CONTRIB_COUNTERPARTS = {
    f.__name__: f
    for f in (ademamix, adopt, schedule_free_sgd, schedule_free_adamw, schedule_free_eval_params)
}


class _Swapped(types.ModuleType):
    """A module whose names are `module`'s, but for the counterparts."""

    def __init__(self, module, counterparts):
        super().__init__(module.__name__)
        self.__dict__.update(counterparts)
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)


def _has_counterpart(params: dict) -> bool:
    name = params.get("opt_name")
    if name in ("sgd_mom",):  # test_explicit_dtype's sgd(momentum=...)
        return True
    if name in _CONTRIB_COUNTERPARTS:
        factory = _CONTRIB_COUNTERPARTS[name]
    elif name in _ALIAS_COUNTERPARTS and not hasattr(_optax_contrib, name):
        factory = _ALIAS_COUNTERPARTS[name]
    else:
        return False
    if "opt_kwargs" not in params:  # test_explicit_dtype: adam and adamw with its own arguments
        return True
    try:
        factory(**params.get("opt_kwargs", {}))
    except unittest.SkipTest:
        return False
    finally:
        _BUILT.clear()
    return True


# --- loading optax's test files ------------------------------------------------------------------


def _load(module_name: str, swaps: dict):
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None:
        pytest.skip(f"this optax wheel ships no {module_name}", allow_module_level=True)
    stand_ins = {}
    for name in ("sklearn", "sklearn.datasets", "sklearn.linear_model"):
        if importlib.util.find_spec(name.partition(".")[0]) is None:
            stand_ins[name] = types.ModuleType(name)
    if "sklearn" in stand_ins:
        stand_ins["sklearn"].datasets = stand_ins["sklearn.datasets"]
        stand_ins["sklearn"].linear_model = stand_ins["sklearn.linear_model"]
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        # a module of its own, so that its swapped names leave optax's own test module alone
        spec = importlib.util.spec_from_file_location("_peer_" + module_name.replace(".", "_"), spec.origin)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    for name, swapped in swaps.items():
        setattr(module, name, swapped)
    return module


def _params_of(method) -> dict | None:
    """The parameters absl's `parameterized` bound into a generated test method, or None."""
    code, closure = getattr(method, "__code__", None), getattr(method, "__closure__", None)
    if code is None or not closure or "testcase_params" not in code.co_freevars:
        return None
    params = closure[code.co_freevars.index("testcase_params")].cell_contents
    return dict(params) if isinstance(params, dict) else None


def _swapped_only(cls):
    """`cls` with only its tests that build a counterpart, each checking that one was built."""
    for name in [n for n in dir(cls) if n.startswith("test")]:
        method = getattr(cls, name)
        params = _params_of(method)
        # (parameters that cannot be read, from another absl: run, and fail unless it builds one)
        if params is not None and not _has_counterpart(params):
            setattr(cls, name, None)  # not collected: it would test optax alone
            continue
        setattr(cls, name, _checked(method))
    return cls


def _checked(method):
    @functools.wraps(method)
    def run(self):
        _BUILT.clear()
        try:
            method(self)
        finally:
            built = list(_BUILT)
            _BUILT.clear()
        assert built or _REFERENCE, "the test built none of optimisers' rules: it tested optax's own factory"

    return run


# OPTIMISERS_PEER_REFERENCE=1 runs the same tests on optax's own factories (the reference that
# docs/optax.md compares with); CI runs them on the counterparts
_REFERENCE = os.environ.get("OPTIMISERS_PEER_REFERENCE") == "1"
_alias = _optax_alias if _REFERENCE else _Swapped(_optax_alias, _ALIAS_COUNTERPARTS)
_contrib = _optax_contrib if _REFERENCE else _Swapped(_optax_contrib, _CONTRIB_COUNTERPARTS)
_alias_tests = _load("optax._src.alias_test", {"alias": _alias})
_contrib_tests = _load("optax.contrib._common_test", {"alias": _alias, "contrib": _contrib})


class TestAlias(_swapped_only(_alias_tests.AliasTest)):
    """optax/_src/alias_test.py's AliasTest, on the counterparts."""


class TestContrib(_swapped_only(_contrib_tests.ContribTest)):
    """optax/contrib/_common_test.py's ContribTest, on the counterparts."""




@pytest.mark.skipif(_REFERENCE, reason="the reference run uses optax's own factories")
def test_the_counterparts_are_the_rules():
    assert _alias_tests.alias.adam is adam
    assert _contrib_tests.contrib.adopt is adopt
    assert _contrib_tests.contrib.mechanize is _optax_contrib.mechanize  # optax's wrappers stay
    tx = _alias_tests.alias.sgd(0.1, momentum=0.9)
    assert isinstance(tx.init({"w": jnp.zeros(2)}), opt.State)
    assert inspect.signature(adam).parameters["learning_rate"].annotation is Lr
