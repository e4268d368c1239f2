"""The maths that rules are written in: the one array API of built-in and user-written rules alike.

Each function picks NumPy, PyTorch or JAX (tracers included) from the type of its first array
argument, so a rule written with these and Python operators serves every backend:

    def init(self, x):
        return ops.zeros_like(x)

    def apply(self, v, x, dx):
        v = ops.scalar(self.rho, x) * v + dx
        return v, ops.scalar(self.eta, x) * v

`scalar(h, x)` casts a hyperparameter to `x`'s dtype (do this for every hyperparameter, so float16
parameters stay float16 and traced hyperparameters work under `jax.jit`); `epsilon(e, x)` does the
same for an epsilon, in the real dtype with a float16 floor of 1e-7. A rule that needs an array
operation not listed here adds it as one function below and one method per backend, named in
`optimisers.backends.protocol.Backend`.
"""

from __future__ import annotations

import numpy as np

from optimisers.core.dispatch import backend
from optimisers.core.quant_lookup import codebook
from optimisers.core.quantised import Quantised, checked_format
from optimisers.core.rule import concrete, is_complex

__all__ = [
    "abs", "abs2", "all_finite", "argsort", "astype", "backend", "cast", "clip", "concrete", "cond", "copy",
    "dtype_epsilon", "eigh", "epsilon", "full_like", "is_complex", "isfinite", "matmul", "matrix_transpose",
    "maximum", "mean", "minimum", "norm", "qr", "reshape", "same_values", "scalar", "sign", "sqrt", "stack",
    "sum", "take", "tensordot", "where", "zeros", "zeros_like", "GradientError", "check_gradient_dtype",
    "quantise", "dequantise", "bfloat16_rounded",
]


# --- values a rule needs -----------------------------------------------------------------------


def scalar(value, like):
    """`value` as a scalar of `like`'s dtype (a hyperparameter cast at apply time)."""
    return backend(like).scalar(value, like)


def epsilon(value, like):
    """`value` as a scalar of `like`'s real dtype; float16 gets a floor of 1e-7 unless `value == 0`,
    since 1e-8 rounds to zero there and Adam-like rules would divide by zero."""
    return backend(like).epsilon(value, like)


def zeros_like(x):
    return backend(x).zeros_like(x)


def full_like(x, value):
    return backend(x).full_like(x, value)


# --- elementwise maths -------------------------------------------------------------------------


def sqrt(x):
    return backend(x).sqrt(x)


def abs(x):  # noqa: A001 - mirrors the array-API name
    return backend(x).abs(x)


def abs2(x):
    """|x|², real even for complex `x`."""
    return backend(x).abs2(x)


def sign(x):
    return backend(x).sign(x)


def maximum(x, y):
    return backend(x).maximum(x, y)


def minimum(x, y):
    return backend(x).minimum(x, y)


def clip(x, low, high):
    return backend(x).clip(x, low, high)


def where(condition, x, y):
    return backend(x).where(condition, x, y)


def norm(x, p):
    """The vector p-norm of all entries of `x` (p = 2, 1, inf, -inf, 0 or any other real)."""
    return backend(x).norm(x, p)


def norms(xs, p):
    """The p-norm of each of `xs` (arrays of one backend and dtype, or the rows of a 2-D array)
    as a 1-D array, each exactly what `norm` gives it; computed together where the backend can
    (a segmented reduction)."""
    return backend(xs[0]).norms(xs if getattr(xs, "ndim", None) == 2 else list(xs), p)


def isfinite(x):
    """Python bool for a concrete scalar; None when the value is traced and cannot be inspected."""
    return backend(x).isfinite(x)


def same_values(x, y):
    """Whether two arrays of one shape hold the same values (NaN equal to NaN): a Python bool,
    or None when either is traced and cannot be read."""
    return backend(x).same_values(x, y)


def all_finite(x):
    """Whether every entry of `x` is finite, as a 0-d boolean of `x`'s backend (traced under
    `jit`, where `isfinite` cannot answer)."""
    return backend(x).all_finite(x)


def cond(predicate, if_true, if_false):
    """`if_true()` or `if_false()` by a scalar predicate; traced predicates use the backend's own
    conditional so both branches stay inside one compiled program."""
    return backend(predicate).cond(predicate, if_true, if_false)


def astype(x, like):
    """`x` converted to `like`'s backend, dtype and device (no copy when it already matches).
    Raises GradientError for values that are no gradient of `like` (complex for a real array,
    bool, strings, objects; PyTorch: sparse or meta tensors)."""
    return backend(like).astype(x, like)


class GradientError(TypeError):
    """A gradient that cannot be one for its parameter; the update adds where it was."""


def check_gradient_dtype(dtype, like_dtype) -> None:
    """Raise GradientError unless values of NumPy-style `dtype` can be the gradient of an array of
    `like_dtype`: any real number for a real parameter (integers are converted), and complex
    numbers only for a complex one."""
    grad, param = np.dtype(dtype), np.dtype(like_dtype)
    numeric = grad.kind in "fiu" or grad.name.startswith(("bfloat", "float"))  # ml_dtypes: kind V
    if grad.kind == "c" and param.kind != "c":
        raise GradientError(
            f"a complex gradient ({grad}) for a real parameter ({param}): was the loss complex? "
            "Take its real part, or make the parameter complex"
        )
    if not numeric and grad.kind != "c":
        raise GradientError(f"a gradient of dtype {grad}, which is not a number, for a {param} parameter")


def cast(x, dtype):
    """A copy of `x` with the given dtype (a NumPy dtype, or the backend's own)."""
    return backend(x).cast(x, dtype)


def copy(x):
    return backend(x).copy(x)


# --- maths of shaped arrays (rules that are not elementwise) ----------------------------------


def reshape(x, shape):
    return backend(x).reshape(x, tuple(shape))


def matrix_transpose(x):
    """`x` with its last two axes swapped (no conjugation)."""
    return backend(x).matrix_transpose(x)


def matmul(a, b):
    """The matrix product, batched over leading axes as NumPy's `matmul`."""
    return backend(a).matmul(a, b)


def tensordot(a, b, axes):
    """NumPy's `tensordot`: `axes` an int or a pair of axis sequences."""
    return backend(a).tensordot(a, b, axes)


def sum(x, axis=None, keepdims=False):  # noqa: A001 - mirrors the array-API name
    return backend(x).sum(x, axis, keepdims)


def mean(x, axis=None, keepdims=False):
    return backend(x).mean(x, axis, keepdims)


def eigh(x):
    """`(eigenvalues, eigenvectors)` of a symmetric matrix (or a batch): eigenvalues ascending,
    eigenvectors as columns. Compute in float32 or wider: NumPy has no float16 eigh."""
    return backend(x).eigh(x)


def qr(x):
    """The reduced QR decomposition `(q, r)`."""
    return backend(x).qr(x)


def stack(xs):
    """Arrays of one shape, backend and dtype stacked along a new leading axis."""
    return backend(xs[0]).stack(list(xs))


def dtype_epsilon(x) -> float:
    """The machine epsilon of `x`'s real dtype, as a Python float (float32: 2⁻²³)."""
    return backend(x).dtype_epsilon(x)


def zeros(shape, like):
    """Zeros of the given shape with `like`'s dtype (and device): state of another shape than
    the parameter's, such as a matrix per axis."""
    return backend(like).zeros(tuple(shape), like)


def argsort(x, descending=False):
    """The indices that sort the last axis of `x` ascending, ties in index order (a stable sort);
    `descending=True` is that order reversed (ties last index first)."""
    return backend(x).argsort(x, descending)


def take(x, indices, axis):
    """The entries of `x` at `indices` (a 1-D integer array) along `axis`."""
    return backend(x).take(x, indices, axis)


# --- low-precision state -----------------------------------------------------------------------


def quantise(x, bits=8, signed=True, block=None) -> Quantised:
    """`x` kept blockwise in low precision (`optimisers.core.quantised`): `bits` 8 (bitsandbytes'
    dynamic maps, blocks of 256), 4 (torchao's 4-bit maps, blocks of 128) or "fp8"
    (float8_e4m3fn, blocks of 256); `signed=False` for values the caller keeps non-negative (the
    unsigned maps have no negative values); `block` elements a block (None: the format's).
    Each block is scaled by its largest magnitude and each element takes the nearest value of
    the map (a tie to the larger code; FP8: the float8_e4m3fn cast, ties to even)."""
    bits, block = checked_format(bits, block)
    if not isinstance(signed, bool):
        raise TypeError(f"quantise: signed must be True or False, got {signed!r}")
    b = backend(x)
    if not (getattr(b, "is_array", None) and b.is_array(x) and b.is_param(x)) or is_complex(x):
        raise TypeError(
            "quantise: x must be a NumPy, PyTorch or JAX array of a real floating dtype, got "
            f"{type(x).__name__}{f' of dtype {x.dtype}' if hasattr(x, 'dtype') else ''}"
        )
    codes, scale = b.quantise_blocks(x, codebook(bits, signed), block)
    return Quantised(codes, scale, signed, bits, block, tuple(x.shape))


def dequantise(q: Quantised):
    """The float32 values that `q` keeps, an array of its backend and shape."""
    if not isinstance(q, Quantised):
        raise TypeError(f"dequantise: expected an optimisers.Quantised, got {type(q).__name__}")
    bits, block = checked_format(q.bits, q.block, "dequantise")
    codes, scales = _numel(q.codes), _numel(q.scale)
    want = ((q.size + 1) // 2 if bits == 4 else q.size, -(-q.size // block))
    if (codes, scales) != want:
        raise ValueError(
            f"dequantise: a Quantised of shape {q.shape} in blocks of {block} ({bits!r}) has "
            f"{want[0]} codes and {want[1]} scales; this one has {codes} and {scales}"
        )
    book = codebook(bits, q.signed)
    return backend(q.codes).dequantise_blocks(q.codes, q.scale, book, q.block, q.shape)


def bfloat16_rounded(x, seed=None, step=0):
    """`x` as float32 values on bfloat16's grid: rounded to nearest (ties to even) when `seed` is
    None, else stochastically, away from zero with probability (the part below bfloat16's last
    bit)/its ulp, from 16 random bits that (seed, step, the element's row-major index) fix: the
    same numbers on every backend, with or without `jit` (`step` may be traced)."""
    return backend(x).bfloat16_rounded(x, seed, step)


def _numel(x) -> int:
    n = 1
    for d in x.shape:
        n *= int(d)
    return n
