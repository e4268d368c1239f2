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
    """Every member of `group` with the kernel `found`, in place; whether it did. A span steps
    as one array: one kernel call."""
    name, kernel, args = found
    if group.array_at != STATE_ARRAYS[name]:
        return False
    joined = group.span is not None or kernel.joined
    if joined:
        parts = _joined_parts(group, xs, dxs)
    else:
        parts = (xs, dxs, *[group.member_parts(k) for k, a in enumerate(group.array_at) if a])
    t = group.scalars[-1] + 1
    if not kernel.step_many(args, *parts, t):
        return False
    if joined and group.has_runs:
        group.unpack(xs)
    group.scalars[:] = [None] * (len(group.scalars) - 1) + [t]
    return True


def _joined_parts(group, xs, dxs):
    """`(parameters, gradients, *state arrays)` as lists of 1-D arrays for a kernel that takes
    them joined: one entry per big member (views of it), one for the packed members (the
    staging buffers and the packed state), or one for a span (cut around a tied member whose
    gradient is its own sum)."""
    b, arrays = group.b, [k for k, a in enumerate(group.array_at) if a]
    if group.span is not None:
        pieces = group.span.gradient_pieces(dxs, group.own_sums(dxs), group)
        if pieces is not None:
            cuts = [slice(lo, hi) for lo, hi, _ in pieces]
            state = [[group.buffers[k][0][cut] for cut in cuts] for k in arrays]
            return [group.span.flat[cut] for cut in cuts], [g for _, _, g in pieces], *state
    with b.no_grad():
        group.stage(xs, dxs)
    if group.span is not None:
        flat_x, flat_g = group.staging_now
        return [flat_x], [flat_g], *[[group.buffers[k][0]] for k in arrays]
    p0, orders = group.packed_from, group.orders
    flat_xs = [b.flat_in(xs[i], orders[i]) for i in range(p0)]
    flat_dxs = [b.flat_in(dxs[i], orders[i]) for i in range(p0)]
    state = [[group.buffers[k][i] for i in range(p0)] for k in arrays]
    if group.has_runs:
        flat_xs.append(group.staging_now[0])
        flat_dxs.append(group.staging_now[1])
        for k, parts in zip(arrays, state):
            parts.append(group.packed[k])
    return flat_xs, flat_dxs, *state
