"""A backend's own kernels for some rules: the one hook through which fast paths reach the update.

A backend lists its kernels by name in `FAST_PATHS` (see `optimisers.backends.protocol`); a rule
says which kernels compute it exactly, and with which arguments, through `Rule.kernel_args`
(`Adam` and `AdamW(couple=True)` name "adam": torch's fused Adam/AdamW). A kernel has two entry
points: `apply(args, state, x, dx)` for one parameter (as `rule.apply` followed by the
subtraction, or None where it cannot take this parameter) and `step_many(args, xs, dxs, *parts,
t)` for an engine group stepped in place.
"""

from __future__ import annotations

STATE_ARRAYS = {"adam": [True, True, False]}  # which parts of the rule's state each kernel takes as arrays


def find(backend, rule):
    """`(name, kernel, args)` of `backend`'s kernel that computes `rule`, or None."""
    for name, kernel in backend.FAST_PATHS.items():
        args = rule.kernel_args(name)
        if args is not None:
            return name, kernel, args
    return None
