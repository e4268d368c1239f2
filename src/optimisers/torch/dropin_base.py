"""`DropIn`: what the classes with torch.optim's names share. A class gives torch's signature and
maps a group's torch hyperparameters to one rule (`_rule`); this base checks the values as torch
does, builds the groups, and applies to the gradient what torch does before its formula."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from optimisers.torch.hyperparameters import NOT_HYPERPARAMETERS, SCHEDULER_KEYS, check_switches
from optimisers.torch.optimizer import Optimizer
from optimisers.torch.param_groups import ParamGroup, check_group_dict, group_tensors, setup_leaves
from optimisers.torch.torch_format import TorchStateFormat


def as_number(h: Mapping, key: str) -> float:
    """Hyperparameter `key` as a Python number (torch allows a tensor learning rate and more)."""
    v = h[key]
    return float(v) if isinstance(v, torch.Tensor) else v


class DropIn(TorchStateFormat, Optimizer):
    """What the drop-in classes share; each subclass gives torch's signature and `_rule`."""

    _l2: ClassVar[bool] = True  # "weight_decay" is added to the gradient (unless decoupled)

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
        check_switches(h, where)
        for key in ("lr", "eps", "weight_decay", "momentum", "lr_decay", "momentum_decay"):
            if key in h and not (isinstance(h[key], (int, float, torch.Tensor)) and as_number(h, key) >= 0):
                raise ValueError(f"{where}: invalid {key} value: {h[key]!r} (expected a number >= 0)")
        if "betas" in h:
            betas = h["betas"]
            if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
                raise ValueError(f"{where}: betas must be a pair of numbers, got {betas!r}")
            for i, b in enumerate(betas):
                if not 0.0 <= float(b) < 1.0:
                    raise ValueError(f"{where}: invalid beta parameter at index {i}: {b!r}")

    def _built(self, h: dict, where: str):
        self._check(h, where)
        try:
            return self._rule(h)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{where}: {e}") from None

    def _decoupled(self, h: Mapping) -> bool:
        return bool(h.get("decoupled_weight_decay", False))

    def _is_group_key(self, key) -> bool:
        """A key a group of this class may hold: torch's hyperparameters and what is carried."""
        return key in self._hyper or key in NOT_HYPERPARAMETERS or key in SCHEDULER_KEYS

    # --- Optimizer's hooks ---------------------------------------------------------------------------

    def _defaults(self, groups) -> dict:
        return dict(self._hyper)

    def _make_group(self, group, where: str) -> ParamGroup:
        check_group_dict(group, where)
        for key in group:
            if key == "rule" or not self._is_group_key(key):  # the class makes the rule itself
                raise ValueError(self._unknown_message(where, key))
        h = {k: group.get(k, v) for k, v in self._hyper.items()}
        rule = self._built(h, where)
        params, names = group_tensors(group["params"], where)
        leaves = setup_leaves(rule, [self._engine_view(p) for p in params])
        carried = {k: v for k, v in group.items() if k in SCHEDULER_KEYS}
        entries = {"params": params, **h, **carried}
        if names is not None:
            entries["param_names"] = names
        return ParamGroup(entries, params, leaves, rule, dict(h), any(p.is_complex() for p in params))

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

    def _gradients(self, grads: dict) -> dict:
        """What torch does to a gradient before its formula, in its order: `maximize` negates it,
        non-decoupled `weight_decay` adds `weight_decay·p`, a complex one is viewed as reals."""
        start = 0
        for g in self._groups:
            h = g.seen
            maximize = h.get("maximize", False)
            decay = h.get("weight_decay", 0) if self._l2 and not self._decoupled(h) else 0
            if maximize or isinstance(decay, torch.Tensor) or decay != 0 or g.has_complex:
                self._prepare(grads, g, start, maximize, decay)
            # else the gradients as they are (AdamW's usual case): no pass over them
            start += len(g.params)
        return grads

    @staticmethod
    def _prepare(grads: dict, g: ParamGroup, start: int, maximize, decay) -> None:
        for j, p in enumerate(g.params):
            grad = grads.get(start + j)
            if grad is None:
                continue
            if maximize:
                grad = -grad
            if isinstance(decay, torch.Tensor) or decay != 0:
                grad = grad.add(p.detach(), alpha=decay)
            if grad.is_complex():
                grad = torch.view_as_real(grad)
            grads[start + j] = grad
