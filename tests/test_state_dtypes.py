"""Explicit state dtypes on the rules: `Adam(mu_dtype=...)`, `AdamW(mu_dtype=...)`,
`Momentum(accumulator_dtype=...)`, `Nesterov(accumulator_dtype=...)` (optax's `mu_dtype` and
`accumulator_dtype`). Reference: the same rule without the option, whose first moment is rounded
to the dtype by hand after each step."""

from __future__ import annotations

import numpy as np
import pytest

import optimisers as opt

torch = pytest.importorskip("torch")
jnp = pytest.importorskip("jax.numpy")

CASES = [
    (lambda **kw: opt.Adam(0.1, **kw), "mu_dtype", 0),
    (lambda **kw: opt.AdamW(0.1, lambd=0.1, **kw), "mu_dtype", 0),
    (lambda **kw: opt.Momentum(0.1, **kw), "accumulator_dtype", None),
    (lambda **kw: opt.Nesterov(0.1, **kw), "accumulator_dtype", None),
]
IDS = ["Adam", "AdamW", "Momentum", "Nesterov"]


def _part(state, index):
    return state if index is None else state[index]


def _with(state, index, value):
    if index is None:
        return value
    return tuple(value if i == index else s for i, s in enumerate(state))


def _numpy(a):
    if isinstance(a, torch.Tensor):
        return a.detach().to(torch.float64).numpy()
    return np.asarray(a, np.float64)


_KINDS = {  # (parameters' dtype, the state dtype)
    "numpy": (lambda a: np.asarray(a, np.float32), np.float16),
    "jax": (lambda a: jnp.asarray(a, jnp.float32), jnp.bfloat16),
    "torch": (lambda a: torch.as_tensor(np.asarray(a, np.float32)), torch.bfloat16),
}


def _rounded(a, dtype, like):
    """`a` rounded to `dtype` and back to `like`'s dtype."""
    if isinstance(a, torch.Tensor):
        return a.to(dtype).to(like.dtype)
    if isinstance(like, np.ndarray):
        return np.asarray(np.asarray(a, dtype), like.dtype)
    return jnp.asarray(jnp.asarray(a, dtype), like.dtype)


@pytest.mark.parametrize(("make", "field", "index"), CASES, ids=IDS)
@pytest.mark.parametrize("kind", list(_KINDS))
def test_the_state_array_is_made_and_kept_in_its_dtype(make, field, index, kind):
    as_x, dtype = _KINDS[kind]
    rng = np.random.default_rng(0)
    x = as_x(rng.standard_normal(6))
    rule, plain = make(**{field: dtype}), make()
    state, ref = rule.init(x), plain.init(x)
    assert _part(state, index).dtype == dtype
    for _ in range(3):
        g = as_x(rng.standard_normal(6))
        state, step = rule.apply(state, x, g)
        assert _part(state, index).dtype == dtype
        # the plain rule, its moment rounded to the state dtype after each step: the maths runs
        # in the promoted dtype (torch computes a bfloat16 tensor times a number in bfloat16)
        ref, ref_step = plain.apply(ref, x, g)
        ref = _with(ref, index, _rounded(_part(ref, index), dtype, x))
        tol = {"rtol": 2e-2, "atol": 1e-3} if kind == "torch" else {"rtol": 0, "atol": 0}
        np.testing.assert_allclose(_numpy(step), _numpy(ref_step), **tol)
        np.testing.assert_allclose(_numpy(_part(state, index)), _numpy(_part(ref, index)), **tol)


@pytest.mark.parametrize(("make", "field", "index"), CASES, ids=IDS)
def test_the_option_is_not_a_hyperparameter_and_shows_only_when_given(make, field, index):
    plain, given = make(), make(**{field: "bfloat16"})
    assert field not in plain.hyperparameters()
    assert field not in repr(plain) and f"{field}='bfloat16'" in repr(given)
    assert plain != given
    assert opt.adjust(opt.setup(given, {"w": np.zeros(2, np.float32)}), 0.5)["w"].rule == make(
        **{field: "bfloat16"}
    ).adjust(eta=0.5)
    with pytest.raises(TypeError, match=f"{field} must be None"):
        make(**{field: np.int32})


def test_checkpoints_write_the_option_only_when_given():
    model = {"w": np.ones(3, np.float32)}
    plain = opt.state_dict(opt.setup(opt.Adam(0.1), model))
    assert plain["w/rule"] == "Adam(eta=0.1, beta=(0.9, 0.999), epsilon=1e-08)"  # as before
    state = opt.setup(opt.Adam(0.1, mu_dtype=np.float16), model)
    state, _ = opt.update(state, model, {"w": np.ones(3, np.float32)})
    d = opt.state_dict(state)
    assert d["w/rule"] == "Adam(eta=0.1, beta=(0.9, 0.999), epsilon=1e-08, mu_dtype='float16')"
    back = opt.load_state_dict(opt.setup(opt.Adam(0.1, mu_dtype=np.float16), model), d)
    assert back["w"].state[0].dtype == np.float16
    np.testing.assert_array_equal(back["w"].state[0], state["w"].state[0])
    with pytest.raises(opt.CheckpointError):  # another kind of rule: its state has other dtypes
        opt.load_state_dict(opt.setup(opt.Adam(0.1), model), d)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("which", ["Adam", "Momentum"])
def test_update_and_update_agree_with_a_state_dtype(kind, which):
    as_x, dtype = _KINDS[kind]
    rule = opt.Adam(0.1, mu_dtype=dtype) if which == "Adam" else opt.Momentum(0.1, accumulator_dtype=dtype)
    rng = np.random.default_rng(1)
    model = {"a": as_x(rng.standard_normal((4, 3))), "b": as_x(rng.standard_normal(5))}
    copy = {k: v.clone() if kind == "torch" else v.copy() for k, v in model.items()}
    pure, in_place = opt.setup(rule, model), opt.setup(rule, copy)
    for _ in range(2):
        grads = {k: as_x(rng.standard_normal(v.shape)) for k, v in model.items()}
        pure, model = opt.update(pure, model, grads)
        in_place, copy = opt.update_(in_place, copy, grads)
    for k in model:
        np.testing.assert_array_equal(_numpy(model[k]), _numpy(copy[k]))
        index = 0 if which == "Adam" else None
        assert _part(pure[k].state, index).dtype == dtype
        assert _part(in_place[k].state, index).dtype == dtype
