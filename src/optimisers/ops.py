"""Backend-neutral maths for writing rules.

Each function picks NumPy, PyTorch or JAX (tracers included) from the type of its first array
argument, so a rule written with these and Python operators serves every backend:

    def init(self, x):
        return ops.zeros_like(x)

    def apply(self, v, x, dx):
        v = ops.scalar(self.rho, x) * v + dx
        return v, ops.scalar(self.eta, x) * v

`scalar(h, x)` casts a hyperparameter to `x`'s dtype (do this for every hyperparameter, so float16
parameters stay float16 and traced hyperparameters work under `jax.jit`); `epsilon(e, x)` does the
same for an epsilon, in the real dtype with a float16 floor of 1e-7.
"""

from ._ops import (
    abs,
    abs2,
    astype,
    cast,
    clip,
    cond,
    copy,
    epsilon,
    full_like,
    is_complex,
    isfinite,
    maximum,
    minimum,
    norm,
    scalar,
    sign,
    sqrt,
    where,
    zeros_like,
)

__all__ = [
    "abs",
    "abs2",
    "astype",
    "cast",
    "clip",
    "cond",
    "copy",
    "epsilon",
    "full_like",
    "is_complex",
    "isfinite",
    "maximum",
    "minimum",
    "norm",
    "scalar",
    "sign",
    "sqrt",
    "where",
    "zeros_like",
]
