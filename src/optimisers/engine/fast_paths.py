"""A backend's own kernels for some rules: the one hook through which fast paths reach the update.

A backend lists its kernels by name in `FAST_PATHS` (see `optimisers.backends.protocol`); this
module knows which rules each named kernel computes exactly, and with which arguments. A kernel
has two entry points: `apply(args, state, x, dx)` for one parameter (as `rule.apply` followed by
the subtraction, or None where it cannot take this parameter) and `step_many(args, xs, dxs, *parts,
t)` for an engine group stepped in place.

"adam": torch's fused Adam/AdamW kernels, for `Adam` and for `AdamW(couple=True)` (decay scaled
by the learning rate, as torch's AdamW), whose state is `(m, v, t)`.
"""

from __future__ import annotations

from typing import NamedTuple

from optimisers.core.rule import concrete
from optimisers.rules.adam import Adam, AdamW


class AdamArgs(NamedTuple):
    lr: float
    beta1: float
    beta2: float
    epsilon: float
    weight_decay: float
    decoupled: bool  # AdamW's decay of the parameter, not Adam's L2 term in the gradient


def _adam_args(rule) -> AdamArgs | None:
    if type(rule) is Adam:
        decay, decoupled = 0.0, False
    elif type(rule) is AdamW and rule.couple:
        decay, decoupled = rule.lambd, True
    else:
        return None
    values = [concrete(v) for v in (rule.eta, *rule.beta, rule.epsilon, decay)]
    if None in values:
        return None  # a schedule or a traced value: the rule's own apply evaluates it
    eta, beta1, beta2, epsilon, decay = values
    return AdamArgs(eta, beta1, beta2, epsilon, decay, decoupled)


_ARGUMENTS = {"adam": _adam_args}  # kernel name -> (rule -> the kernel's arguments, or None)
STATE_ARRAYS = {"adam": [True, True, False]}  # which parts of the rule's state are arrays


def find(backend, rule):
    """`(name, kernel, args)` of `backend`'s kernel that computes `rule`, or None."""
    for name, kernel in backend.FAST_PATHS.items():
        args = _ARGUMENTS[name](rule)
        if args is not None:
            return name, kernel, args
    return None
