"""`NarrowDtype`: a static part of a rule's state naming the parameter's low-precision dtype.

The update runs a rule's maths on float32 copies of a float16/bfloat16 parameter (so `apply`
cannot see the parameter's dtype); a rule that must round to that dtype's grid keeps this
marker, made by `init`. It holds no array: a JAX pytree without leaves (the name is static) and
no entry in a checkpoint (the state loaded into has its own).
"""

from __future__ import annotations

import dataclasses

NARROW_DTYPES = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class NarrowDtype:
    name: str  # "bfloat16" or "float16"


def narrow_dtype_of(x, allowed=NARROW_DTYPES) -> NarrowDtype | None:
    """The marker for array `x` if its dtype (any backend's) is one of `allowed`, else None."""
    name = str(getattr(x, "dtype", "")).rpartition(".")[2]
    return NarrowDtype(name) if name in allowed else None
