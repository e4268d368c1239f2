"""The fused way: a backend's own kernel for a rule (torch's fused Adam/AdamW, NumPy's compiled
Adam) steps one parameter, or every member of a group, in one call.

The one hook through which such kernels reach the update: a backend lists its kernels by name in
`FAST_PATHS` (see `optimisers.backends.protocol`), and a rule says which kernels compute it
exactly, with which arguments, through `Rule.kernel_args` (`Adam` and `AdamW(couple=True)` name
"adam"). A kernel has two entry points: `apply(args, state, x, dx)` for one parameter (as
`rule.apply` followed by the subtraction, or None where it cannot take this parameter) and
`step_many(args, xs, dxs, *state arrays, t)` for a group stepped in place (False where it cannot).
"""

from __future__ import annotations

from optimisers.engine import chunks

STATE_ARRAYS = {"adam": [True, True, False]}  # which parts of the rule's state each kernel takes as arrays


def find(backend, rule):
    """`(name, kernel, args)` of `backend`'s kernel that computes `rule`, or None."""
    for name, kernel in backend.FAST_PATHS.items():
        args = rule.kernel_args(name)
        if args is not None:
            return name, kernel, args
    return None


def step_leaf(found, state, x, dx):
    """One parameter with the kernel `found`: `(new_state, step)`, or None where it cannot."""
    _, kernel, args = found
    return kernel.apply(args, state, x, dx)


def step_group(group, found, xs, dxs) -> bool:
    """Every member of `group` with the kernel `found`, in place; whether it did. Kernels take
    the parameters as they are (torch's would round a joined array's last elements otherwise);
    a span steps as one array: one kernel call."""
    name, kernel, args = found
    if group.array_at != STATE_ARRAYS[name]:
        return False
    if group.span is not None:
        parts = _span_parts(group, xs, dxs)
    else:
        parts = (xs, dxs, *[group.member_parts(k) for k, a in enumerate(group.array_at) if a])
    t = group.scalars[-1] + 1
    if not kernel.step_many(args, *parts, t):
        return False
    group.scalars[:] = [None] * (len(group.scalars) - 1) + [t]
    return True


def _span_parts(group, xs, dxs):
    """`(parameters, gradients, *state arrays)` of a span as lists of 1-D arrays: its flat
    buffer, or its pieces cut around a tied member whose gradient is its own sum."""
    arrays = [k for k, a in enumerate(group.array_at) if a]
    pieces = group.span.gradient_pieces(dxs, group.own_sums(dxs), group)
    if pieces is not None:
        cuts = [slice(lo, hi) for lo, hi, _ in pieces]
        state = [[group.buffers[k][0][cut] for cut in cuts] for k in arrays]
        return [group.span.flat[cut] for cut in cuts], [g for _, _, g in pieces], *state
    with group.b.no_grad():
        chunks.stage(group, xs, dxs)
    flat_x, flat_g = group.staging_now
    return [flat_x], [flat_g], *[[group.buffers[k][0]] for k in arrays]
