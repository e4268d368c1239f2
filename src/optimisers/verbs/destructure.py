"""destructure / trainables: the model's trainable values as one flat vector, and back."""

from __future__ import annotations

import math

import numpy as np

from optimisers import ops
from optimisers.core.tree import map_params, params


def trainables(model, path: bool = False) -> list:
    """The distinct trainable arrays of `model`, depth first, tied arrays once.

    With `path=True`, a list of `(path, array)` pairs, each array at its first path.
    """
    return params(model, with_paths=path)


def destructure(model):
    """`(flat, rebuild)`: every trainable value of `model` in one 1-D array of the model's backend
    (tied arrays counted once, dtype the promotion of the parameters' dtypes), and a function
    `rebuild(flat)` giving a model of the same structure with those values, ties kept.

    Differentiable with JAX and PyTorch: gradients through `rebuild` sum over tied places.
    """
    arrays = params(model)
    flat = ops.backend(arrays[0]).flatten(arrays) if arrays else np.zeros(0, np.float32)
    offsets = {}
    total = 0
    for x in arrays:
        offsets[id(x)] = total
        total += math.prod(int(d) for d in x.shape)

    def rebuild(new_flat):
        shape = getattr(new_flat, "shape", None)
        if shape is None or len(shape) != 1:
            raise ValueError(f"rebuild expects a 1-D vector, got {type(new_flat).__name__} of shape {shape}")
        length = int(shape[0])
        if length != total:
            raise ValueError(
                f"rebuild expects a flat vector of length {total} (the model's trainable values), "
                f"got length {length}"
            )
        return map_params(lambda x: ops.backend(new_flat).unflatten_one(new_flat, offsets[id(x)], x), model)

    rebuild.__doc__ = f"Rebuild the model from a flat vector of length {total}."
    return flat, rebuild
