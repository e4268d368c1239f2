"""`flatten_`: a model's parameters, and their gradients, as views of a few flat buffers.

    buffers = optimisers.torch.flatten_(model)      # or an optimizer: a buffer set per param group
    opt = optimisers.torch.AdamW(model.parameters(), lr=1e-3)
    loss.backward(); opt.step(); opt.zero_grad()    # backward() adds into the flat gradient

The engine of `update_` finds such parameters (`optimisers.engine.span`) and steps each buffer
as one array. What torch.optim has no counterpart for (a moved parameter always has a gradient,
`zero_grad` keeps the views, which parameters are moved, bit-equality of fused Adam) is written
down in docs/torch-optimizer.md, "Flat buffers".
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

__all__ = ["FlatBuffers", "flatten_", "zero_flat_grads_"]

# the mark of a gradient view made by `flatten_` (an attribute of the tensor object: backward adds
# into the same object, and a gradient that replaced it lacks the mark)
_MARK = "_optimisers_flat_grad"
_made = [False]  # has `flatten_` made any gradient view in this process?


class FlatBuffers(NamedTuple):
    """The flat buffers of one set of parameters of one dtype and device: `params` holds their
    data back to back, `grads` their gradients (None with `gradients=False`), in `members`' order."""

    params: torch.Tensor
    grads: torch.Tensor | None
    members: list


def flatten_(params, *, gradients: bool = True) -> list[FlatBuffers]:
    """Move the data of `params` into flat buffers, one per (dtype, device) of each set, and (with
    `gradients`) give each moved parameter a `.grad` that views a flat gradient buffer, holding the
    gradient it had (or zeros). `params` is an `nn.Module` (its parameters, a tied one once), an
    iterable of tensors or of param group dicts, or a `torch.optim.Optimizer` (each param group
    is a set of its own, so that each group's rule steps whole buffers). Returns the buffers."""
    sets = [_moved(ps) for ps in _sets_of(params)]
    _check_apart([p for ps in sets for p in ps])
    out = []
    with torch.no_grad():
        for ps in sets:
            by_kind: dict = {}
            for p in ps:
                by_kind.setdefault((p.dtype, p.device), []).append(p)
            out.extend(_flatten_one(members, gradients) for members in by_kind.values())
    return out


def has_flat_grads() -> bool:
    """Has `flatten_` made gradient views in this process?"""
    return _made[0]


def zero_flat_grads_(params) -> list:
    """Zero in place the gradients of `params` that still are `flatten_`'s views (one call for
    all); returns the parameters whose gradients are not."""
    views, rest = [], []
    for p in params:
        g = p.grad
        if g is not None and getattr(g, _MARK, False):
            views.append(g)
        else:
            rest.append(p)
    if views:
        with torch.no_grad():
            torch._foreach_zero_(views)
    return rest


def _sets_of(params) -> list[list]:
    if isinstance(params, nn.Module):
        return [list(params.parameters())]
    if isinstance(params, torch.optim.Optimizer):
        return [list(g["params"]) for g in params.param_groups]
    if isinstance(params, torch.Tensor):
        return [[params]]
    items = list(params)
    if items and all(isinstance(g, dict) for g in items):
        return [list(g["params"]) for g in items]
    return [items]


def _moved(ps) -> list:
    """The parameters of one set that `flatten_` moves, each once, in order."""
    from optimisers.backends.torch import is_dtensor

    seen, out = set(), []
    for p in ps:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"flatten_ takes parameters (tensors), got a {type(p).__name__}")
        if id(p) in seen or type(p) not in (nn.Parameter, torch.Tensor) or not p.requires_grad:
            continue
        if p.layout is torch.strided and p.is_contiguous() and p.numel() > 0 and not is_dtensor(p):
            seen.add(id(p))
            out.append(p)
    return out


def _check_apart(ps) -> None:
    """Refuse parameters that share memory: moved, each would get its own copy."""
    spans: dict = {}
    for p in ps:
        start = p.data_ptr()
        spans.setdefault((p.device, p.untyped_storage().data_ptr()), []).append(
            (start, start + p.numel() * p.element_size(), p)
        )
    for found in spans.values():
        found.sort(key=lambda s: s[0])
        for (_, end, p), (start, _, q) in zip(found, found[1:]):
            if start < end:
                raise ValueError(
                    f"flatten_: a parameter of shape {tuple(q.shape)} shares memory with one of "
                    f"shape {tuple(p.shape)}; moving them into a flat buffer would part them"
                )


def _flatten_one(members, gradients: bool) -> FlatBuffers:
    p0 = members[0]
    total = sum(p.numel() for p in members)
    flat = torch.empty(total, dtype=p0.dtype, device=p0.device)
    grads = torch.zeros(total, dtype=p0.dtype, device=p0.device) if gradients else None
    at = 0
    for p in members:
        n = p.numel()
        view = flat[at : at + n].view(p.shape)
        view.copy_(p.data)
        p.data = view
        if grads is not None:
            g = grads[at : at + n].view(p.shape)
            if p.grad is not None:
                g.copy_(p.grad)
            p.grad = g
            setattr(g, _MARK, True)
            _made[0] = True
        at += n
    return FlatBuffers(flat, grads, list(members))
