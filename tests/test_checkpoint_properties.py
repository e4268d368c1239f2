"""Property test: random nested NumPy models with random ties, shared containers, frozen parts and
rules survive a checkpoint exactly, and training continues bit for bit after it."""

from __future__ import annotations

import copy
import os
import tempfile

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import optimisers as opt
from _checkpoint_helpers import assert_states_equal, tie_pattern

N_ARRAYS = 5
SHAPES = [(3,), (2, 2), (), (1, 4)]
RULES = [
    opt.Descent(0.1),
    opt.Adam(0.01),
    opt.Momentum(0.02),
    opt.OptimiserChain(opt.ClipGrad(0.5), opt.Nesterov(0.01)),
    opt.AccumGrad(2),
    opt.MixedPrecision(opt.RMSProp(0.01), np.float64),
]

# an int picks one of N_ARRAYS arrays (the same int twice is a tie), a string is not trainable
slots = st.recursive(
    st.integers(0, N_ARRAYS - 1) | st.sampled_from(["tag", "other"]),
    lambda children: (
        st.lists(children, min_size=1, max_size=3)
        | st.dictionaries(st.sampled_from("abcd"), children, min_size=1, max_size=3)
        | st.tuples(children, children)
    ),
    max_leaves=12,
)


def materialise(tree, arrays):
    if isinstance(tree, int):
        return arrays[tree]
    if isinstance(tree, str):
        return tree
    if isinstance(tree, dict):
        return {k: materialise(v, arrays) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(materialise(v, arrays) for v in tree)
    return [materialise(v, arrays) for v in tree]


def containers(node, out):
    if isinstance(node, (dict, list, tuple)):
        out.append(node)
        for child in node.values() if isinstance(node, dict) else node:
            containers(child, out)
    return out


def grads_for(model, rng, p_none):
    """A gradient for every trainable place (a tied array gets one per place), some None."""
    if isinstance(model, np.ndarray):
        return None if rng.random() < p_none else rng.standard_normal(model.shape).astype(model.dtype)
    if isinstance(model, dict):
        return {k: grads_for(v, rng, p_none) for k, v in model.items()}
    if isinstance(model, (list, tuple)):
        return type(model)(grads_for(v, rng, p_none) for v in model)
    return None


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,  # seeds fixed: the same examples every run
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    tree=slots,
    data=st.data(),
    seed=st.integers(0, 2**16),
    steps=st.integers(0, 3),
    through_file=st.booleans(),
)
def test_checkpoint_round_trip(tree, data, seed, steps, through_file):
    rng = np.random.default_rng(seed)
    dtypes = [np.float32, np.float64]
    arrays = [
        rng.standard_normal(SHAPES[i % len(SHAPES)]).astype(dtypes[rng.integers(2)]) for i in range(N_ARRAYS)
    ]
    arrays = [a if a.shape else np.asarray(a) for a in arrays]
    main = materialise(tree, arrays)
    inner = containers(main, [])
    # sometimes the same container object also appears a second time (a shared submodule)
    again = data.draw(st.sampled_from([None] + inner[1:]), label="shared container")
    model = {"main": main, "again": again}
    rules = data.draw(st.lists(st.sampled_from(RULES), min_size=1, max_size=2), label="rules")

    def choose():
        """Rules by the array's order of first appearance: every place of a tie gets the same."""
        order: dict[int, int] = {}
        return lambda path, x: rules[order.setdefault(id(x), len(order)) % len(rules)]

    state = opt.setup(choose(), model)
    for _ in range(steps):
        state, model = opt.update_(state, model, grads_for(model, rng, p_none=0.3))
    leaves = state.leaves()
    for leaf in leaves:
        if rng.random() < 0.3:
            opt.freeze_(leaf)
        if rng.random() < 0.2 and "eta" in leaf.rule.hyperparameters():
            opt.adjust_(leaf, rng.uniform(0.001, 0.1))

    resumed_model = copy.deepcopy(model)  # keeps ties and shared containers, as a reload would
    fresh = opt.setup(choose(), resumed_model)
    if through_file:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "state.npz")
            opt.save(path, state)
            resumed = opt.load(path, fresh)
    else:
        resumed = opt.load_state_dict(fresh, opt.state_dict(state))

    assert_states_equal(resumed, state)
    assert tie_pattern(resumed) == tie_pattern(fresh)
    assert [leaf.frozen for leaf in resumed.leaves()] == [leaf.frozen for leaf in leaves]
    assert not any(leaf.frozen for leaf in fresh.leaves())  # the argument is untouched

    grads = grads_for(model, rng, p_none=0.2)
    state, model = opt.update_(state, model, grads)
    resumed, resumed_model = opt.update_(resumed, resumed_model, grads)
    for a, b in zip(opt.trainables(model), opt.trainables(resumed_model)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert_states_equal(resumed, state)
