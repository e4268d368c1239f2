"""Property tests: random nested trees with random ties and random missing gradients, for every
rule of `rules_registry.py`."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import optimisers as opt
from rules_registry import RULES, shaped

N_ARRAYS = 4
SHAPES = [(2,), (3,), (2, 2), ()]

# A tree of "slots": an int picks one of N_ARRAYS shared arrays (same int = the same object, a tie),
# a string stands for a non-trainable leaf.
slots = st.recursive(
    st.integers(0, N_ARRAYS - 1) | st.sampled_from(["tag", "other"]),
    lambda children: st.lists(children, min_size=1, max_size=3)
    | st.dictionaries(st.sampled_from("abcd"), children, min_size=1, max_size=3)
    | st.tuples(children, children),
    max_leaves=10,
)


def materialise(tree, arrays, memo):
    """Build the model; a slot sub-tree reached twice becomes one shared container."""
    if isinstance(tree, int):
        return arrays[tree]
    if isinstance(tree, str):
        return tree
    if id(tree) not in memo:
        if isinstance(tree, dict):
            memo[id(tree)] = {k: materialise(v, arrays, memo) for k, v in tree.items()}
        elif isinstance(tree, tuple):
            memo[id(tree)] = tuple(materialise(v, arrays, memo) for v in tree)
        else:
            memo[id(tree)] = [materialise(v, arrays, memo) for v in tree]
    return memo[id(tree)]


def places(tree, path=()):
    """(path, array index) for every trainable place."""
    if isinstance(tree, int):
        return [(path, tree)]
    if isinstance(tree, str):
        return []
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    return [p for k, v in items for p in places(v, path + (k,))]


def get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def make_grads(tree, path, chosen):
    if isinstance(tree, int):
        return chosen.get(path)
    if isinstance(tree, str):
        return None
    if isinstance(tree, dict):
        return {k: make_grads(v, path + (k,), chosen) for k, v in tree.items()}
    return [make_grads(v, path + (i,), chosen) for i, v in enumerate(tree)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tree=slots,
    seed=st.integers(0, 2**16),
    inplace=st.booleans(),
    share=st.booleans(),
    rule=st.sampled_from([opt.Descent(0.1), opt.Adam(0.05)]),
    data=st.data(),
)
def test_tied_tree_equals_untied_reference(tree, seed, inplace, share, rule, data):
    check_tied_tree(tree, seed, inplace, share, rule, data)


# every registered rule (its first hyperparameters of the `toy` family), fewer examples each
@pytest.mark.slow
@pytest.mark.parametrize("rule", [info.make(info.toy[0]) for info in RULES if info.toy], ids=repr)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=slots, seed=st.integers(0, 2**16), inplace=st.booleans(), share=st.booleans(), data=st.data())
def test_every_registered_rule_on_a_tied_tree(rule, tree, seed, inplace, share, data):
    check_tied_tree(tree, seed, inplace, share, rule, data)


def check_tied_tree(tree, seed, inplace, share, rule, data):
    """Two steps of `rule` on a random tree with ties and missing gradients equal two steps on
    one array per distinct parameter with the summed gradients; identity of tied places kept."""
    if share:  # the same container at two places, each place with its own gradient
        tree = {"x": tree, "y": tree}
    rng = np.random.default_rng(seed)
    shapes = [shaped(rule, s) for s in SHAPES]  # as many axes as the rule needs
    arrays = [rng.standard_normal(s) if s else np.array(rng.standard_normal()) for s in shapes]
    model = materialise(tree, arrays, {})
    where = places(tree)
    reference = {i: arrays[i].copy() for _, i in where}
    ref_state = opt.setup(rule, reference)
    state = opt.setup(rule, model)
    originals = [a.copy() for a in arrays]

    for _ in range(2):
        has_grad = data.draw(st.lists(st.booleans(), min_size=len(where), max_size=len(where)))
        chosen = {p: rng.standard_normal(arrays[i].shape) for (p, i), g in zip(where, has_grad) if g}
        grads = make_grads(tree, (), chosen)
        grad_copies = {p: g.copy() for p, g in chosen.items()}
        summed = {}
        for p, i in where:
            if p in chosen:
                summed[i] = summed[i] + chosen[p] if i in summed else chosen[p]
        ref_state, reference = opt.update(ref_state, reference, summed)

        before = [get(model, p) for p, _ in where]
        step = opt.update_ if inplace else opt.update
        state, new = step(state, model, grads)

        for p, g in chosen.items():  # gradients are never written to
            np.testing.assert_array_equal(g, grad_copies[p])
        for (p, i), old in zip(where, before):
            value = get(new, p)
            np.testing.assert_allclose(value, reference[i], rtol=1e-12, atol=1e-12)
            assert (value is old) == inplace
            for q, j in where:  # tied places hold one object, untied ones never do
                assert (get(new, q) is value) == (j == i)
        if not inplace:  # the pure update left the previous model alone
            for (p, _), old in zip(where, before):
                assert get(model, p) is old
        if share and not isinstance(tree["x"], (int, str)):
            assert new["x"] is new["y"]
        model = new

    if not inplace:
        for a, o in zip(arrays, originals):
            np.testing.assert_array_equal(a, o)
