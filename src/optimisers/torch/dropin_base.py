"""`DropIn`: what the classes with torch.optim's names share. A class gives torch's signature and
maps a group's torch hyperparameters to one rule (`_rule`); this base checks the values as torch
does, builds the groups, and applies to the gradient what torch does before its formula."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from optimisers.torch.hyperparameters import (
    ALIASES,
    NOT_HYPERPARAMETERS,
    SCHEDULER_KEYS,
    check_switches,
)
from optimisers.torch.optimizer import Optimizer
from optimisers.torch.param_groups import ParamGroup, check_group_dict, group_tensors
from optimisers.torch.torch_format import TorchStateDict

# the library's names of hyperparameters, and "rule": in a drop-in's group they would set nothing
LIBRARY_NAMES = ("rule", "eta", *ALIASES)


def as_number(h: Mapping, key: str) -> float:
    """Hyperparameter `key` as a Python number (torch allows a tensor learning rate and more)."""
    v = h[key]
    return float(v) if isinstance(v, torch.Tensor) else v


def _scalar(v):
    """A one-element tensor (torch takes `lr=torch.tensor([1e-3])`) as a 0-d view of it: the
    rule reads the value the tensor holds, also after a scheduler changes it in place."""
    return v.view(()) if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == 1 else v


def check_torch_switches(h: Mapping, where: str) -> None:
    """torch.optim's checks of its implementation switches and of a tensor `lr`, in its words,
    then this library's refusal of `capturable` and `differentiable`."""
    if h.get("fused") and h.get("foreach"):
        raise RuntimeError(f"{where}: `fused` and `foreach` cannot be `True` together.")
    if h.get("fused") and h.get("differentiable"):
        raise RuntimeError(f"{where}: `fused` does not support `differentiable`")
    lr = h.get("lr")
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"{where}: Tensor lr must be 1-element, got one of shape {tuple(lr.shape)}")
    check_switches(h, where)


def _check_fused(g: ParamGroup, grads: list) -> None:
    """torch.optim's check of the parameters of a `fused=True` group, at the step."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    devices = _get_fused_kernels_supported_devices()
    for position, p in zip(g.positions, g.params):
        if grads[position] is not None and not (p.is_floating_point() and p.device.type in devices):
            raise RuntimeError(
                "`fused=True` requires all the params to be floating point Tensors of supported "
                f"devices: {devices} but {p.dtype} and {p.device.type}"
            )


class DropIn(TorchStateDict, Optimizer):
    """What the drop-in classes share; each subclass gives torch's signature and `_rule`."""

    _l2: ClassVar[bool] = True  # "weight_decay" is added to the gradient (unless decoupled)
    _sparse: ClassVar[bool] = False  # takes sparse gradients (densified), as torch's class does
    _takes_complex: ClassVar[bool] = True  # else complex parameters are refused at the step

    def __init__(self, params, hyper: dict):
        if isinstance(params, torch.nn.Module):
            raise TypeError(
                f"{type(self).__name__} takes params as torch.optim does: pass model.parameters() "
                "(or param groups); a tied weight is one Parameter there, so ties are kept"
            )
        self._hyper = hyper
        self._check(hyper, type(self).__name__)
        super().__init__(params)

    # --- torch's hyperparameters -> a rule: what each class gives ----------------------------------

    def _rule(self, h: dict):
        raise NotImplementedError

    def _structure(self, h: dict) -> tuple:
        """What decides the state's layout: a change after construction is refused."""
        return ()

    def _layout(self, h: dict) -> tuple[str, ...]:
        """torch's name for each part of the rule's state, in the rule's order."""
        raise NotImplementedError

    def _check(self, h: Mapping, where: str) -> None:
        """torch.optim's own checks of the values, in its words."""
        check_torch_switches(h, where)
        for key in ("lr", "eps", "weight_decay", "momentum", "lr_decay", "momentum_decay"):
            if key in h and not (isinstance(h[key], (int, float, torch.Tensor)) and as_number(h, key) >= 0):
                raise ValueError(f"{where}: Invalid {key} value: {h[key]!r} (expected a number >= 0)")
        if "betas" in h:
            betas = h["betas"]
            if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
                raise ValueError(f"{where}: betas must be a pair of numbers, got {betas!r}")
            if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
                raise ValueError(f"{where}: betas must be either both floats or both Tensors")
            for i, b in enumerate(betas):
                if not 0.0 <= float(b) < 1.0:
                    raise ValueError(f"{where}: Invalid beta parameter at index {i}: {b!r}")
        if "rho" in h and not 0.0 <= as_number(h, "rho") <= 1.0:
            raise ValueError(f"{where}: Invalid rho value: {h['rho']!r}")

    def _built(self, h: dict, where: str):
        self._check(h, where)
        try:
            return self._rule({k: _scalar(v) for k, v in h.items()})
        except (TypeError, ValueError) as e:
            raise type(e)(f"{where}: {e}") from None

    def _decoupled(self, h: Mapping) -> bool:
        return bool(h.get("decoupled_weight_decay", False))

    def _is_group_key(self, key) -> bool:
        """A key a group of this class always may hold: torch's hyperparameters, the names and
        the lr schedulers' keys."""
        return key in self._hyper or key in NOT_HYPERPARAMETERS or key in SCHEDULER_KEYS

    # --- Optimizer's hooks ---------------------------------------------------------------------------

    def _defaults(self, groups) -> dict:
        return dict(self._hyper)

    def _make_group(self, group, where: str) -> ParamGroup:
        check_group_dict(group, where)
        for key in group:
            if self._refused(key):
                raise ValueError(self._unknown_message(where, key))
        h = {k: group.get(k, v) for k, v in self._hyper.items()}
        rule = self._built(h, where)
        params, names = group_tensors(group["params"], where)
        self._check_params(params, names, where)
        # any other key is carried, as torch.optim carries it (a scheduler's, a user's note)
        carried = {k: v for k, v in group.items() if k not in h and k not in NOT_HYPERPARAMETERS}
        entries = {"params": params, **h, **carried}
        if names is not None:
            entries["param_names"] = names
        return ParamGroup(entries, params, rule, dict(h))

    def _check_params(self, params: list, names, where: str) -> None:
        """The class's own refusals of a group's tensors (Muon: vectors)."""

    def _listed(self, params, where: str) -> list:
        params = group_tensors(params, where)[0]
        self._check_params(params, None, where)
        return params

    def _refused(self, key) -> bool:
        """A key that sets nothing here although it looks as if it would: the library's own
        names of hyperparameters ("lambd", "eta", ...) and "rule" (the class makes the rule)."""
        return key in LIBRARY_NAMES and key not in self._hyper

    def _refused_keys(self, g: ParamGroup) -> list:
        return [k for k in g.entries if self._refused(k)]

    def _unknown_message(self, where: str, key) -> str:
        return f"{where}: unknown key {key!r}; torch.optim.{type(self).__name__} takes " + ", ".join(
            repr(k) for k in self._hyper
        )

    def _unknown_key(self, g: ParamGroup, key: str, i: int) -> Exception:
        return ValueError(self._unknown_message(f"param_groups[{i}]", key))

    def _resync(self, g: ParamGroup, changed: dict, where: str):
        h = {**g.seen, **changed}
        if self._structure(h) != self._structure(g.seen):
            keys = ", ".join(repr(k) for k in changed)
            raise ValueError(
                f"{where}: changing {keys} after the optimizer was made changes what state "
                f"{type(self).__name__} keeps; make a new optimizer (or load a checkpoint) instead"
            )
        return self._built(h, where)

    def _engine_view(self, p):
        # torch trains a complex parameter as pairs of reals (view_as_real), and so does this class
        return torch.view_as_real(p.detach()) if p.is_complex() else p

    def _step(self):
        found_inf = getattr(self, "found_inf", None)  # set by GradScaler (or by hand), as torch reads it
        if found_inf is not None and bool(found_inf):
            return  # an inf or nan in the scaled gradients: no step
        if not self._takes_complex:
            self._refuse_complex()
        super()._step()

    def _refuse_complex(self) -> None:
        """torch's refusal, at the step, of a complex parameter with a gradient (in the groups as
        they are now, as torch reads them), before anything changes."""
        for i, group in enumerate(self.param_groups):
            params = group.get("params", ())
            names = group.get("param_names") or [None] * len(params)
            for k, (p, name) in enumerate(zip(params, names)):
                if isinstance(p, torch.Tensor) and p.is_complex() and p.grad is not None:
                    what = f"param_groups[{i}], parameter {k}" + (f" ({name})" if name else "")
                    raise RuntimeError(
                        f"{what}: {type(self).__name__} does not support complex parameters "
                        f"(this one is {p.dtype}); give it to another optimizer, or train its real "
                        "view (torch.view_as_real)"
                    )

    def _gradients(self, grads: list) -> list:
        """What torch does to a gradient before its formula, in its order: `maximize` negates it,
        non-decoupled `weight_decay` adds `weight_decay·p`, a complex one is viewed as reals
        (a sparse one, where the class takes it, made dense; `grad_scale`, where set, divided out).
        The list handed in is left as it is."""
        if self._sparse:
            grads = [g if g is None or g.layout is torch.strided else g.to_dense() for g in grads]
        scale = getattr(self, "grad_scale", None)
        if scale is not None:
            grads = [None if grad is None else grad / scale for grad in grads]
        for g in self._groups:
            h = g.seen
            if h.get("fused"):
                _check_fused(g, grads)
            maximize = h.get("maximize", False)
            decay = h.get("weight_decay", 0) if self._l2 and not self._decoupled(h) else 0
            if maximize or isinstance(decay, torch.Tensor) or decay != 0 or g.has_complex:
                grads = _prepared(grads, g, maximize, decay)
            # else the gradients as they are (AdamW's usual case): no pass over them
        return grads


def _prepared(grads: list, g: ParamGroup, maximize, decay) -> list:
    """`grads` with group `g`'s gradients as torch prepares them (a new list)."""
    grads = list(grads)
    for position, p in zip(g.positions, g.params):
        grad = grads[position]
        if grad is None:
            continue
        if maximize:
            grad = -grad
        if isinstance(decay, torch.Tensor) or decay != 0:
            grad = grad.add(p.detach(), alpha=decay)
        if grad.is_complex():
            grad = torch.view_as_real(grad)
        grads[position] = grad
    return grads
