"""The table of rules in `rules_registry.py` is complete and says what the library says: every
public rule is registered, its flags are the library's, and its reference formula has the
documented defaults."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import optimisers as opt
from rules_registry import RULE_INFO, RULES

# rules built from other rules: the registry lists them as composites
COMBINATORS = {
    opt.OptimiserChain, opt.MixedPrecision, opt.SkipNonFinite, opt.Lookahead,
    opt.LowBit, opt.StochasticRounding, opt.KahanSummation,
}
PUBLIC_RULES = [
    obj
    for name in opt.__all__
    if isinstance(obj := getattr(opt, name), type) and issubclass(obj, opt.Rule) and obj is not opt.Rule
]


@pytest.mark.parametrize("cls", [c for c in PUBLIC_RULES if c not in COMBINATORS], ids=lambda c: c.__name__)
def test_every_public_rule_is_registered(cls):
    assert cls in RULE_INFO, f"add {cls.__name__} to RULES in tests/rules_registry.py"


@pytest.mark.parametrize("info", RULES, ids=lambda i: i.name)
def test_flags_are_the_librarys(info):
    rules = [info.make(h) for h in info.toy]
    assert all(r.elementwise == info.elementwise for r in rules)
    assert info.cls.elementwise == info.elementwise


@pytest.mark.parametrize("info", [i for i in RULES if i.reference and i.defaults], ids=lambda i: i.name)
def test_reference_formula_has_the_documented_defaults(info):
    parameters = inspect.signature(info.reference).parameters
    for name, value in info.defaults.items():
        if name in parameters:  # e.g. ClipNorm's `throw` does not change the numbers
            assert parameters[name].default == value, f"{info.reference.__name__}({name}=...)"
    assert set(parameters) <= set(info.defaults)


@pytest.mark.parametrize("info", RULES, ids=lambda i: i.name)
def test_min_ndim_is_the_librarys(info):
    """A rule takes arrays of `min_ndim` axes; one axis fewer is refused at setup, naming the path."""
    rule = info.make(info.toy[0])
    k = info.min_ndim
    opt.setup(rule, {"x": np.ones((2,) * k)})
    if k > 0:
        with pytest.raises(ValueError, match=r"the parameter at x: "):
            opt.setup(rule, {"x": np.ones((2,) * (k - 1))})
