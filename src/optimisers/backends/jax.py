"""JAX arrays, including tracers under `jax.jit` / `jax.grad`, and JAX pytrees as model containers.
Importing this module makes `State` and `Leaf` JAX pytrees (`optimisers.backends.jax_state`)."""

from __future__ import annotations

import contextlib
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from optimisers import ops
from optimisers.backends import jax_state
from optimisers.backends import numpy as _numpy_backend
from optimisers.backends.jax_pieces import step_in_pieces  # noqa: F401
from optimisers.backends.jax_quant import (  # noqa: F401
    bfloat16_rounded,
    dequantise_blocks,
    quantise_blocks,
)
from optimisers.core.tree import NodeKind

# --- how the update treats JAX (see optimisers.backends.protocol) -----------------------------

no_grad = contextlib.nullcontext  # gradients are functions' results, never recorded on arrays
SHARE_SCALAR_STATE = True  # one step count per group: fewer traced values under jit
IN_PLACE_ENGINE = False  # arrays are immutable: updates are pure, traced and fused by XLA
FAST_PATHS: dict = {}

_Tracer = jax.core.Tracer
_FLOAT16 = np.dtype(np.float16)
_FLOAT16_EPS_FLOOR = float(np.float16(1e-7))

jax_state.register()
plan_flatten = jax_state.plan_flatten  # setup's hook: a State of JAX arrays flattened once, at setup


# --- what the tree layer asks -----------------------------------------------------------------


def is_param(x) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.inexact)


def is_array(x) -> bool:
    return isinstance(x, jax.Array)


def is_traced(x) -> bool:
    return isinstance(x, _Tracer)


def writable(x) -> bool:  # immutable: `update_` replaces them and returns the new ones
    return False


def memory_span(x):
    return (0, 0)


def shares_memory(x, y) -> bool:
    return x is y


def replaced(x, value):  # a new parameter like `x` holding `value`
    return jnp.asarray(value, dtype=x.dtype)


def subtract(x, step):
    out = x - step
    return out if out.dtype == x.dtype else out.astype(x.dtype)


subtract_ = subtract  # immutable: "in place" is a new array


def assign_(x, value):
    return astype(value, x)


# --- what the rules ask -----------------------------------------------------------------------


def scalar(value, like):
    # works for Python numbers, concrete 0-d arrays and traced hyperparameters alike
    return jnp.asarray(value, dtype=like.dtype)


def epsilon(value, like):
    real = np.dtype(like.dtype)
    if real.kind == "c":
        real = np.finfo(real).dtype
    if real == _FLOAT16:
        if is_traced(value):
            v = jnp.asarray(value, dtype=jnp.float32)
            floored = jnp.where(v == 0, v, jnp.maximum(v, _FLOAT16_EPS_FLOOR))
            return floored.astype(real)
        value = float(value)
        if value != 0:
            value = max(value, _FLOAT16_EPS_FLOOR)
    return jnp.asarray(value, dtype=real)


def zeros_like(x):
    if not isinstance(x, jax.Array) or is_traced(x) or x.weak_type or not _numeric(x.dtype):
        return jnp.zeros_like(x)  # tracers, weak types, bools and keys: the general path
    sharding = x.sharding if x._committed else None
    return _zeros_maker(x.shape, x.dtype, sharding)()


@functools.cache
def _numeric(dtype) -> bool:  # (jnp.issubdtype takes microseconds: setup asks per array)
    return jnp.issubdtype(dtype, np.number)


@functools.lru_cache(maxsize=1024)
def _zeros_maker(shape, dtype, sharding):
    """A compiled maker of zeros on the parameter's sharding (if committed): `setup` makes state for
    thousands of arrays of a few shapes, at a fraction of an eager `jnp.zeros_like` each."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


sqrt = jnp.sqrt
abs = jnp.abs  # noqa: A001
sign = jnp.sign
maximum = jnp.maximum
minimum = jnp.minimum
where = jnp.where
clip = jnp.clip
full_like = jnp.full_like


def abs2(x):
    if jnp.iscomplexobj(x):
        return jnp.square(x.real) + jnp.square(x.imag)
    return jnp.square(x)


def _norm_fixed(a, p):
    if p == 2:
        return jnp.sqrt(jnp.sum(jnp.square(a)))
    if p == 1:
        return jnp.sum(a)
    if p == np.inf:
        return jnp.max(a)
    if p == -np.inf:
        return jnp.min(a)
    if p == 0:
        return jnp.count_nonzero(a).astype(a.dtype)
    return jnp.sum(a ** jnp.asarray(p, a.dtype)) ** jnp.asarray(1 / p, a.dtype)


def norms(xs, p):
    return jnp.stack([norm(x, p) for x in xs])


def norm(x, p):
    a = jnp.abs(jnp.ravel(x))
    if a.size == 0:
        if is_traced(p):
            return jnp.where(p == -jnp.inf, jnp.inf, 0).astype(a.dtype)
        return jnp.asarray(np.inf if p == -np.inf else 0, a.dtype)
    if not is_traced(p):
        return _norm_fixed(a, float(p))
    # A traced p cannot choose a branch in Python; pick among the special cases in the program.
    p = jnp.asarray(p, a.dtype)
    safe_p = jnp.where((p == 0) | jnp.isinf(p), 2, p)
    special = (2, 1, np.inf, -np.inf, 0)
    return jnp.select(
        [p == q for q in special], [_norm_fixed(a, q) for q in special], jnp.sum(a**safe_p) ** (1 / safe_p)
    )


def isfinite(x):
    try:
        return bool(jnp.all(jnp.isfinite(x)))
    except jax.errors.ConcretizationTypeError:
        return None


def same_values(x, y):
    if is_traced(x) or is_traced(y):
        return None
    return bool(jnp.array_equal(x, y, equal_nan=True))


def all_finite(x):
    return jnp.all(jnp.isfinite(x))


def cond(predicate, if_true, if_false):
    if is_traced(predicate):
        return jax.lax.cond(predicate, if_true, if_false)
    return if_true() if predicate else if_false()


def astype(x, like):
    if isinstance(x, jax.Array):
        if x.dtype == like.dtype:
            return x
        ops.check_gradient_dtype(x.dtype, like.dtype)
        return x.astype(like.dtype)
    x = np.asarray(x)
    ops.check_gradient_dtype(x.dtype, like.dtype)
    if not is_traced(like) and isinstance(like, jax.Array):
        # put host data where the parameter lives, so sharded parameters get sharded gradients
        return jax.device_put(np.asarray(x, dtype=like.dtype), like.sharding)
    return jnp.asarray(x, dtype=like.dtype)


def cast(x, dtype):
    # a real copy even for an unchanged dtype: a MixedPrecision master copy must not share a
    # buffer with its parameter, or donating both would donate one buffer twice
    return jnp.array(x, dtype=dtype, copy=True)


def copy(x):
    return jnp.array(x, copy=True)


# --- what destructure asks --------------------------------------------------------------------


def flatten(arrays):
    dtype = jnp.result_type(*arrays)
    return jnp.concatenate([jnp.ravel(a).astype(dtype) for a in arrays])


def unflatten_one(flat, start, like):
    size = int(np.prod(like.shape, dtype=np.int64))
    return flat[start : start + size].reshape(like.shape).astype(like.dtype)


# --- JAX pytree nodes as model containers ------------------------------------------------------


# what each kind of JAX key path entry holds: an attribute name, a dict key, a position
_KEY_FIELDS = {
    jax.tree_util.GetAttrKey: "name",
    jax.tree_util.DictKey: "key",
    jax.tree_util.SequenceKey: "idx",
    jax.tree_util.FlattenedIndexKey: "key",
}


def _key_of(entry):
    field = _KEY_FIELDS.get(type(entry))
    return entry if field is None else getattr(entry, field)


def _one_level(node):
    return jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)


def _pytree_children(node):
    flat, _ = _one_level(node)
    return [(_key_of(path[0]), child) for path, child in flat]


def _pytree_rebuild(node, changes):
    flat, treedef = _one_level(node)
    values = [changes.get(_key_of(path[0]), child) for path, child in flat]
    return jax.tree_util.tree_unflatten(treedef, values)


def node_kind(obj) -> NodeKind | None:
    """A container kind for what JAX treats as a pytree node (registered classes, Flax structs...),
    its children keyed by their JAX key paths: attribute names, dict keys, sequence positions."""
    if obj is None or isinstance(obj, (str, bytes, numbers.Number, np.ndarray, np.generic)):
        return None
    try:
        flat, _ = _one_level(obj)
    except Exception:  # a registered flatten that fails on this object: treat it as a leaf
        return None
    if len(flat) == 1 and flat[0][0] == ():
        return None  # JAX sees a leaf
    return NodeKind(type(obj).__name__, _pytree_children, _pytree_rebuild)


# --- what schedules ask: values of the default float dtype (float32; float64 under x64) -------


def is_integer(x):
    return bool(jnp.issubdtype(jnp.asarray(x).dtype, jnp.integer))


def as_integer(x):
    return jnp.asarray(x)


def as_real(x):
    return jnp.asarray(x, dtype=jnp.result_type(float))


def real_scalar(value, like):
    return jnp.full((), value, dtype=jnp.result_type(float))


def real_where(condition, x, y):
    return jnp.where(condition, x, y).astype(jnp.result_type(float))


cos = jnp.cos


# --- what checkpoints ask: NumPy reads JAX arrays (dtypes NumPy lacks as ml_dtypes') -----------


to_host, to_host_bits = _numpy_backend.to_host, _numpy_backend.to_host_bits


def dtype_name(x):
    if isinstance(x, type) and isinstance(getattr(x, "dtype", None), np.dtype):  # jnp.float32
        return x.dtype.name
    return _numpy_backend.dtype_name(x)


def from_host(value, like):
    if getattr(like, "weak_type", False) and tuple(like.shape) == ():
        # a Python number keeps the array weakly typed, as jit found it
        out = jax.device_put(np.asarray(value).item(), like.sharding)
        return out if out.dtype == like.dtype else out.astype(like.dtype)
    host = np.array(value, copy=True).astype(like.dtype, copy=False)
    return jax.device_put(host, like.sharding)


# --- maths of shaped arrays (matrix rules) -----------------------------------------------------

# the library's own functions, where they take what `ops` passes
reshape, matmul, tensordot, take, stack = jnp.reshape, jnp.matmul, jnp.tensordot, jnp.take, jnp.stack


def matrix_transpose(x):
    return jnp.swapaxes(x, -1, -2)


def sum(x, axis=None, keepdims=False):  # noqa: A001 - mirrors the array-API name
    return jnp.sum(x, axis=axis, keepdims=keepdims)


def mean(x, axis=None, keepdims=False):
    return jnp.mean(x, axis=axis, keepdims=keepdims)


def eigh(x):
    return tuple(jnp.linalg.eigh(x))


def qr(x):
    return tuple(jnp.linalg.qr(x))


def zeros(shape, like):
    return jnp.zeros(shape, like.dtype)


def argsort(x, descending):
    order = jnp.argsort(x, axis=-1, stable=True)
    return order[..., ::-1] if descending else order


def dtype_epsilon(x):
    return float(jnp.finfo(x.dtype).eps)
