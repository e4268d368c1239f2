"""Checkpoints move arrays through the host as NumPy arrays, by each backend's `to_host`,
`to_host_bits` and `from_host`: values, dtypes NumPy lacks (bfloat16) and step counters survive
every crossing between backends, in memory and through files."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import optimisers as opt
from optimisers.core import dispatch

VALUES = np.array([[1.5, -2.25, 0.375], [7.0, 0.0, -96.0]], np.float32)  # exact in (b)float16


def made(library, dtype_name):
    """VALUES as an array of `library` in the dtype named `dtype_name`."""
    if library == "numpy":
        return VALUES.astype(getattr(ml_dtypes, dtype_name, None) or np.dtype(dtype_name))
    if library == "torch":
        return torch.from_numpy(VALUES).to(getattr(torch, dtype_name))
    return jnp.asarray(VALUES, dtype=dtype_name)


def as_float32(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.float().numpy()
    return np.asarray(x).astype(np.float32)


LIBRARIES = ["numpy", "torch", "jax"]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("target", LIBRARIES)
@pytest.mark.parametrize("source", LIBRARIES)
def test_from_host_of_to_host_crosses_backends(source, target, dtype):
    x, like = made(source, dtype), made(target, dtype)
    host = dispatch.backend(x).to_host(x)
    assert isinstance(host, np.ndarray) and host.dtype.name == dtype
    out = dispatch.backend(like).from_host(host, like)
    assert type(out) is type(like) and str(out.dtype).removeprefix("torch.") == dtype
    np.testing.assert_array_equal(as_float32(out), VALUES)


@pytest.mark.parametrize("source", LIBRARIES)
def test_to_host_bits_are_the_same_bits_on_every_backend(source):
    x = made(source, "bfloat16")
    bits, name = dispatch.backend(x).to_host_bits(x)
    assert name == "bfloat16" and bits.dtype == np.uint16 and bits.flags.c_contiguous
    # bfloat16 is the top half of float32: its bits computed here independently
    expected = (VALUES.view(np.uint32) >> 16).astype(np.uint16)
    np.testing.assert_array_equal(bits, expected)
    plain, none = dispatch.backend(x).to_host_bits(made(source, "float32"))
    assert none is None and plain.dtype == np.float32
    np.testing.assert_array_equal(plain, VALUES)


def test_from_host_copies_a_read_only_or_reversed_array_into_torch():
    host = VALUES[:, ::-1]
    host.flags.writeable = False
    like = torch.zeros(2, 3)
    out = dispatch.backend(like).from_host(host, like)
    np.testing.assert_array_equal(out.numpy(), VALUES[:, ::-1])


def test_from_host_keeps_a_jax_scalars_weak_type():
    like = jnp.asarray(3)  # weakly typed, as a Python int becomes under jit
    assert like.weak_type
    out = dispatch.backend(like).from_host(np.array(7), like)
    assert out.weak_type and out.dtype == like.dtype and int(out) == 7


def momentum_state(library):
    model = {"w": made(library, "bfloat16")}
    grads = {"w": made(library, "bfloat16")}
    state = opt.setup(opt.Momentum(0.5), model)
    state, model = opt.update(state, model, grads)
    return state, model


@pytest.mark.parametrize("through_file", [False, True], ids=["state_dict", "file"])
@pytest.mark.parametrize("target", LIBRARIES)
@pytest.mark.parametrize("source", ["torch", "jax"])
def test_bfloat16_state_moves_between_backends(source, target, through_file, tmp_path):
    state, _ = momentum_state(source)
    fresh, _ = momentum_state(target)
    if through_file:
        opt.save(tmp_path / "opt.npz", state)
        loaded = opt.load(tmp_path / "opt.npz", fresh)
    else:
        loaded = opt.load_state_dict(fresh, opt.state_dict(state))
    got, want = loaded["w"].state, state["w"].state
    assert type(got) is type(fresh["w"].state)
    assert str(got.dtype).removeprefix("torch.") == "bfloat16"
    np.testing.assert_array_equal(as_float32(got), as_float32(want))


def test_a_python_float_counter_loads_into_a_float64_tensor_exactly():
    # a 0-d float64 tensor of the state takes a Python float without a float32 round trip
    from optimisers.checkpoints.state_dict import _convert

    like = torch.zeros((), dtype=torch.float64)
    assert _convert(0.1, like).item() == 0.1


def test_a_traced_state_cannot_be_saved():
    state, model = momentum_state("jax")

    @jax.jit
    def inside(state):
        opt.state_dict(state)
        return 0

    with pytest.raises(TypeError, match="outside jax.jit"):
        inside(state)


@pytest.mark.parametrize(
    "library, dtype, other",
    [
        ("jax", jnp.float32, jnp.float16),
        ("torch", torch.float32, torch.float16),
        ("numpy", np.float32, np.float16),
    ],
)
def test_a_rule_holding_a_dtype_of_any_backend_round_trips(library, dtype, other):
    model = {"w": made(library, "bfloat16" if library != "numpy" else "float16")}
    state = opt.setup(opt.MixedPrecision(opt.Adam(0.01), dtype=dtype), model)
    d = opt.state_dict(state)
    assert d["w/rule"].endswith("dtype='float32')")
    loaded = opt.load_state_dict(opt.setup(opt.MixedPrecision(opt.Adam(0.01), dtype=dtype), model), d)
    assert loaded["w"].rule.dtype is dtype
    with pytest.raises(opt.CheckpointError, match="they differ at MixedPrecision.dtype"):
        opt.load_state_dict(opt.setup(opt.MixedPrecision(opt.Adam(0.01), dtype=other), model), d)
