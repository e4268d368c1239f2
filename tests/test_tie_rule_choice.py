"""A rule function given to `setup` is asked at every place of a tied array; all places must get
equal rules (they share one Leaf), and different rules are an error naming both places."""

import numpy as np
import pytest
import torch

import optimisers as opt


def tied_model():
    E = np.random.default_rng(0).normal(size=(6, 3))
    return {"embed": E, "body": {"w": np.ones((3, 3))}, "unembed": E}


def test_every_place_of_a_tie_is_asked():
    model = tied_model()
    asked = []
    state = opt.setup(lambda path, x: asked.append(path) or opt.Adam(1e-3), model)
    assert asked == [("embed",), ("body", "w"), ("unembed",)]
    assert state["unembed"] is state["embed"]


def test_equal_rules_from_separate_calls_share_one_leaf():
    model = tied_model()
    state = opt.setup(lambda path, x: opt.OptimiserChain(opt.ClipNorm(1.0), opt.Adam(1e-3)), model)
    assert state["unembed"] is state["embed"]


def test_different_rules_at_places_of_a_tie_name_both_places():
    model = tied_model()
    with pytest.raises(ValueError, match=r"at embed and .* at unembed, places of one tied array"):
        opt.setup(lambda path, x: opt.Adam() if path[0] == "embed" else opt.Momentum(), model)


def test_differing_hyperparameters_are_different_rules():
    with pytest.raises(ValueError, match="unembed"):
        opt.setup(lambda path, x: opt.Adam(1e-3 if path == ("embed",) else 1e-2), tied_model())


def test_a_tied_sub_model_is_asked_at_each_of_its_places():
    block = {"w": np.ones((2, 2)), "b": np.zeros(2)}
    model = {"first": block, "second": block}
    asked = []
    opt.setup(lambda path, x: asked.append(path) or opt.Adam(), model)
    assert asked == [("first", "w"), ("first", "b"), ("second", "w"), ("second", "b")]
    with pytest.raises(ValueError, match=r"first\.w and .* at second\.w"):
        opt.setup(lambda path, x: opt.Adam() if path[0] == "first" else opt.Descent(), model)


def test_a_torch_module_with_a_tied_head():
    emb = torch.nn.Embedding(5, 3)
    head = torch.nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    state = opt.setup(lambda path, x: opt.AdamW() if x.ndim >= 2 else opt.Adam(), model)
    assert state["head"]["weight"] is state["emb"]["weight"]
    with pytest.raises(ValueError, match=r"emb\.weight and .* at head\.weight"):
        opt.setup(lambda path, x: opt.Momentum() if path[0] == "head" else opt.AdamW(), model)


def test_rules_with_array_scalar_hyperparameters_compare_by_value():
    model = tied_model()
    state = opt.setup(lambda path, x: opt.Descent(np.float32(0.1)), model)
    assert state["unembed"] is state["embed"]
    with pytest.raises(ValueError, match="unembed"):
        opt.setup(lambda path, x: opt.Descent(np.float32(0.1 if path == ("embed",) else 0.2)), model)


def test_a_rule_refusing_a_parameter_names_its_path():
    model = {"a": {"b": np.ones(3, complex)}}
    with pytest.raises(TypeError, match=r"^the parameter at a\.b: Lion is not defined for complex"):
        opt.setup(opt.Lion(), model)
