"""Shared helpers of the NumPy checkpoint tests (not a test module): a small model with ties and
shared containers, its gradients, rebuilding it from copies, and comparisons of States."""

from __future__ import annotations

import numpy as np

import optimisers as opt
import optimisers.checkpoints.state_dict as _checkpoint
from optimisers.core.state import leaf_paths

SEED = 1234


def make_model(rng, dtype=np.float32):
    """Embedding tied to the LM head, a shared block at two places, a frozen-to-be bias."""
    W = rng.standard_normal((6, 4)).astype(dtype)
    block = {"w": rng.standard_normal((4, 4)).astype(dtype), "b": np.zeros(4, dtype)}
    return {
        "embed": W,
        "layers": [block, {"w": rng.standard_normal((4, 4)).astype(dtype)}, block],
        "head": {"weight": W, "bias": rng.standard_normal(6).astype(dtype)},
        "step_count": np.int64(0),  # not trainable: carried along
        "name": "tiny",
    }


def make_grads(rng, model):
    def grad(x):
        return rng.standard_normal(x.shape).astype(x.dtype)

    block = model["layers"][0]
    return {
        "embed": grad(model["embed"]),
        "layers": [
            {"w": grad(block["w"]), "b": grad(block["b"])},
            {"w": grad(model["layers"][1]["w"])},
            {"w": grad(block["w"]), "b": None},
        ],
        "head": {"weight": grad(model["embed"]), "bias": grad(model["head"]["bias"])},
    }


def copy_model(model):
    """A structurally identical model built from copies, ties and shared containers kept (as a
    user would rebuild it from saved weights in a new process)."""
    W = model["embed"].copy()
    old = model["layers"][0]
    block = {"w": old["w"].copy(), "b": old["b"].copy()}
    return {
        "embed": W,
        "layers": [block, {"w": model["layers"][1]["w"].copy()}, block],
        "head": {"weight": W, "bias": model["head"]["bias"].copy()},
        "step_count": model["step_count"],
        "name": model["name"],
    }


def snapshot(state):
    """Everything about a State that loading must not change: structure, Leaf identities, rules,
    flags, and copies of the state values."""
    out = []

    def visit(node, path):
        if isinstance(node, opt.Leaf):
            values = _checkpoint._state_items(node.state, "s", [])
            out.append(
                (
                    path,
                    id(node),
                    node.rule,
                    node.frozen,
                    [(k, np.array(v, copy=True)) for k, v in values],
                )
            )
            return
        out.append((path, id(node), sorted(map(str, node))))
        for k, child in node.items():
            visit(child, path + (k,))

    visit(state.tree, ())
    return out


def assert_same_snapshot(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x[:-1] == y[:-1] if len(x) == 5 else x == y
        if len(x) == 5:
            assert [k for k, _ in x[4]] == [k for k, _ in y[4]]
            for (_, u), (_, v) in zip(x[4], y[4]):
                assert u.dtype == v.dtype and np.array_equal(u, v, equal_nan=True)


def assert_states_equal(a, b):
    """Same Leafs (values, rules, flags) at the same places, and the same ties."""
    pa, pb = leaf_paths(a.tree), leaf_paths(b.tree)
    assert [p for p, _ in pa] == [p for p, _ in pb]
    for (_, la), (_, lb) in zip(pa, pb):
        assert la.rule == lb.rule
        assert la.frozen == lb.frozen
        va = _checkpoint._state_items(la.state, "s", [])
        vb = _checkpoint._state_items(lb.state, "s", [])
        assert [k for k, _ in va] == [k for k, _ in vb]
        for (_, u), (_, v) in zip(va, vb):
            if isinstance(u, (np.ndarray, np.generic)):
                # a 0-d state array may come back from NumPy arithmetic as a NumPy scalar
                u, v = np.asarray(u), np.asarray(v)
                assert u.dtype == v.dtype and u.shape == v.shape and np.array_equal(u, v)
            else:
                assert type(u) is type(v) and u == v
    assert tie_pattern(a) == tie_pattern(b)


def tie_pattern(state):
    """For each place (path) of a Leaf, the first path of that Leaf."""
    first, out = {}, {}

    def visit(node, path):
        if isinstance(node, opt.Leaf):
            out[path] = first.setdefault(id(node), path)
            return
        for k, child in node.items():
            visit(child, path + (k,))

    visit(state.tree, ())
    return out


def trained(rule=None, steps=3, seed=SEED):
    rng = np.random.default_rng(seed)
    model = make_model(rng)
    state = opt.setup(rule or opt.Adam(0.01), model)
    for _ in range(steps):
        state, model = opt.update(state, model, make_grads(rng, model))
    return state, model
