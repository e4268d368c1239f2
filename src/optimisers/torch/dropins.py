"""torch.optim's classes, with their names, signatures, defaults, group keys and `state[p]` keys,
trained by this library's engine (so tied weights, flat buffers and the rest come with them).

    from optimisers.torch import AdamW      # instead of: from torch.optim import AdamW

Each class maps a param group's torch hyperparameters to one rule: the library's `Adam`/`AdamW`
where torch's formula is theirs (so they run torch's own fused kernel and agree with
`torch.optim.AdamW(fused=True)` bit for bit), else a rule of `_torch_rules` that writes out torch's
formula. What torch does to the gradient before its formula (`maximize` negates it, non-decoupled
`weight_decay` adds `weight_decay·p`) is done here in the same order, and a complex parameter is
trained as its real view, as torch does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from optimisers.checkpoints.state_dict import CheckpointError
from optimisers.rules.adam import Adam as _Adam
from optimisers.rules.adam import AdamW as _AdamW
from optimisers.rules.sgd import Descent
from optimisers.rules.torch_named import (
    TorchAdadelta,
    TorchAdagrad,
    TorchAdamax,
    TorchAMSGrad,
    TorchNAdam,
    TorchRAdam,
    TorchRMSprop,
    TorchRprop,
    TorchSGD,
)
from optimisers.torch.optimizer import (
    _CARRIED,
    _SCHEDULER_KEYS,
    Optimizer,
    _check_switches,
    _Group,
    _setup_list,
    _tensors,
)

__all__ = ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "Rprop"]

_STEP = "step"  # torch keeps the step count as a float32 scalar tensor
_FIRST = ""  # SGD's momentum: the state counts steps only to know the first one; torch shows none
_SCALARS = ("mu_product",)  # float state kept as a float32 scalar tensor by torch


def _number(h: Mapping, key: str) -> float:
    v = h[key]
    return float(v) if isinstance(v, torch.Tensor) else v


class _DropIn(Optimizer):
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

    # --- torch's hyperparameters -> a rule ----------------------------------------------------------

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
        _check_switches(h, where)
        for key in ("lr", "eps", "weight_decay", "momentum", "lr_decay", "momentum_decay"):
            if key in h and not (isinstance(h[key], (int, float, torch.Tensor)) and _number(h, key) >= 0):
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

    # --- the adapter's hooks -------------------------------------------------------------------------

    def _defaults(self, groups) -> dict:
        return dict(self._hyper)

    def _make_group(self, group, where: str) -> _Group:
        if not isinstance(group, Mapping):
            raise TypeError(f"{where}: expected a dict with a 'params' entry, got a {type(group).__name__}")
        if "params" not in group:
            raise ValueError(f"{where}: has no 'params' entry")
        for key in group:
            if key not in self._hyper and key not in _CARRIED and key not in _SCHEDULER_KEYS or key == "rule":
                raise ValueError(self._unknown_message(where, key))
        h = {k: group.get(k, v) for k, v in self._hyper.items()}
        rule = self._built(h, where)
        params, names = _tensors(group["params"], where)
        if not params:
            raise ValueError(f"{where}: its params are empty")
        leaves = _setup_list(rule, [self._engine_view(p) for p in params])
        carried = {k: v for k, v in group.items() if k in _SCHEDULER_KEYS}
        entries = {"params": params, **h, **carried}
        if names is not None:
            entries["param_names"] = names
        return _Group(entries, params, leaves, rule, dict(h), any(p.is_complex() for p in params))

    def _unknown_message(self, where: str, key) -> str:
        return f"{where}: unknown key {key!r}; torch.optim.{type(self).__name__} takes " + ", ".join(
            repr(k) for k in self._hyper
        )

    def _unknown_key(self, g: _Group, key: str, i: int) -> Exception:
        return ValueError(self._unknown_message(f"param_groups[{i}]", key))

    def _resync(self, g: _Group, changed: dict, where: str):
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
        start = 0
        for g in self._groups:
            h = g.seen
            maximize = h.get("maximize", False)
            decay = h.get("weight_decay", 0) if self._l2 and not self._decoupled(h) else 0
            if not (maximize or isinstance(decay, torch.Tensor) or decay != 0 or g.has_complex):
                start += len(g.params)
                continue  # the gradients as they are (AdamW's usual case): no pass over them
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
            start += len(g.params)
        return grads

    # --- torch's state_dict ----------------------------------------------------------------------------

    def _group_of(self, position: int) -> _Group:
        start = 0
        for g in self._groups:
            if position < start + len(g.params):
                return g
            start += len(g.params)
        raise KeyError(position)

    def _entry(self, position: int, leaf) -> dict:
        """`state[p]` with torch's keys: the rule's state arrays (complex again for a complex
        parameter) and "step" as torch keeps it."""
        parts = leaf.state if isinstance(leaf.state, tuple) else ()
        complex_ = self._model[position].is_complex()
        out: dict = {}
        for name, part in zip(self._layout(self._group_of(position).seen), parts):
            if name == _FIRST:
                continue
            if name == _STEP or name in _SCALARS:
                out[name] = torch.tensor(float(part), dtype=torch.float32)
            else:
                out[name] = torch.view_as_complex(part) if complex_ else part
        return out

    def _decode(self, position: int, h: dict, entry, problems: list) -> Any:
        """The rule's state for parameter `position` from torch's `entry` (under group
        hyperparameters `h`); what does not fit goes to `problems`."""
        p = self._model[position]
        layout = self._layout(h)
        expected = {name for name in layout if name != _FIRST}
        where = f"parameter {position}"
        if not isinstance(entry, Mapping):
            problems.append(f"{where}: expected a dict of state, got a {type(entry).__name__}")
            return None
        if set(entry) != expected:
            missing, extra = sorted(expected - set(entry)), sorted(set(entry) - expected)
            detail = "; ".join(
                part
                for part in (
                    f"missing {', '.join(map(repr, missing))}" if missing else "",
                    f"unexpected {', '.join(map(repr, extra))}" if extra else "",
                )
                if part
            )
            problems.append(
                f"{where}: torch.optim.{type(self).__name__} with these settings keeps "
                f"{', '.join(map(repr, sorted(expected))) or 'no state'}; the checkpoint has "
                f"{detail} (was it written by another optimizer class, or other settings such as "
                "amsgrad, momentum or centered?)"
            )
            return None
        parts = []
        for name in layout:
            if name == _FIRST:
                parts.append(1)
                continue
            value = entry[name]
            if name == _STEP or name in _SCALARS:
                number = float(value) if isinstance(value, (torch.Tensor, int, float)) else math.nan
                if not math.isfinite(number) or (name == _STEP and number < 0):
                    problems.append(f"{where}: {name!r} must be a finite number, got {value!r}")
                    return None
                parts.append(int(round(number)) if name == _STEP else number)
                continue
            if not isinstance(value, torch.Tensor) or value.shape != p.shape:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                problems.append(f"{where}: {name!r} has shape {got}, the parameter {tuple(p.shape)}")
                return None
            if value.is_complex() != p.is_complex():
                problems.append(f"{where}: {name!r} is {value.dtype}, the parameter {p.dtype}")
                return None
            value = value.detach().to(dtype=p.dtype, device=p.device, copy=True)
            parts.append(torch.view_as_real(value) if value.is_complex() else value)
        return tuple(parts) if parts else None

    def _load_entry(self, position: int, entry: Mapping) -> None:
        problems: list[str] = []
        state = self._decode(position, self._group_of(position).seen, entry, problems)
        if problems:
            raise CheckpointError("; ".join(problems))
        leaf = self._leaf_at[position]
        leaf.state, leaf._owns = state, True  # decoded copies: the engine keeps them, no copy
        if position not in self._flat.tree:
            self._ready([position])
        else:
            self._changed()

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Restore a state dict written by this class or by the torch.optim class of the same
        name: checked in full first (a `CheckpointError` lists every mismatch: groups, keys,
        shapes), then loaded, hyperparameters included, as torch.optim does. A run resumed from
        it continues as the saved one would have."""
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
            raise CheckpointError("expected an optimizer state dict, with 'state' and 'param_groups'")
        saved_groups = state_dict["param_groups"]
        self._check_groups(saved_groups)
        problems: list[str] = []
        hypers, rules = [], []
        for i, (saved, g) in enumerate(zip(saved_groups, self._groups)):
            unknown = [
                k for k in saved if k not in self._hyper and k not in _CARRIED and k not in _SCHEDULER_KEYS
            ]
            if unknown:
                problems.append(
                    f"group {i}: the checkpoint has {', '.join(map(repr, unknown))}, which "
                    f"torch.optim.{type(self).__name__} does not take (another optimizer class?)"
                )
                hypers.append(None)
                rules.append(None)
                continue
            h = {k: saved.get(k, v) for k, v in g.seen.items()}
            try:
                rules.append(self._built(h, f"group {i} of the checkpoint"))
            except (TypeError, ValueError) as e:
                problems.append(str(e))
                rules.append(None)
            hypers.append(h)
        positions = self._checkpoint_positions(state_dict["state"])
        states = {}
        for position in positions:
            h = hypers[self._groups.index(self._group_of(position))]
            if h is not None:
                states[position] = self._decode(position, h, state_dict["state"][position], problems)
        if problems:
            raise CheckpointError("the checkpoint does not fit this optimizer:\n  " + "\n  ".join(problems))
        # everything checked: load
        self._forget([p for p in self._flat.tree if p not in states])
        new_groups = []
        for saved, g, h, rule in zip(saved_groups, self._groups, hypers, rules):
            entries = {"params": g.params, **h, **{k: v for k, v in saved.items() if k in _SCHEDULER_KEYS}}
            if "param_names" in g.entries:
                entries["param_names"] = g.entries["param_names"]
            g.entries, g.seen, g.rule = entries, dict(h), rule
            for leaf in g.leaves:
                if leaf is not None:
                    leaf.rule = rule
            new_groups.append(entries)
        for position, state in states.items():
            leaf = self._leaf_at[position]
            leaf.state, leaf._owns = state, True  # decoded copies: the engine keeps them, no copy
        self._ready([p for p in states if p not in self._flat.tree])
        self.param_groups[:] = new_groups
        self._changed()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)


# --- the classes ---------------------------------------------------------------------------------


class SGD(_DropIn):
    """torch.optim.SGD, trained by this library (same signature, defaults, group and state keys).
    Without momentum the library's `Descent`; with momentum torch's formula (the first step
    copies the gradient into `momentum_buffer`; `dampening`, `nesterov`)."""

    def __init__(
        self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, *,
        maximize=False, foreach=None, differentiable=False, fused=None,
    ):  # fmt: skip
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
            maximize=maximize, foreach=foreach, differentiable=differentiable, fused=fused,
        ))  # fmt: skip

    def _structure(self, h):
        return (_number(h, "momentum") > 0,)

    def _rule(self, h):
        if _number(h, "momentum") > 0:
            return TorchSGD(h["lr"], h["momentum"], h["dampening"], h["nesterov"])
        if h["nesterov"]:
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        return Descent(h["lr"])

    def _layout(self, h):
        return ("momentum_buffer", _FIRST) if _number(h, "momentum") > 0 else ()


class Adam(_DropIn):
    """torch.optim.Adam, trained by this library. Without amsgrad it is the library's `Adam`
    (`AdamW` with `decoupled_weight_decay=True`), which runs torch's fused kernel on float32/float64
    tensors: bit for bit `torch.optim.Adam(fused=True)`."""

    def __init__(
        self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, *,
        foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
        decoupled_weight_decay=False,
    ):  # fmt: skip
        super().__init__(params, dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
            foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused,
            decoupled_weight_decay=decoupled_weight_decay,
        ))  # fmt: skip

    def _structure(self, h):
        return (bool(h["amsgrad"]),)

    def _rule(self, h):
        decay = h["weight_decay"] if self._decoupled(h) else 0.0
        if h["amsgrad"]:
            return TorchAMSGrad(h["lr"], tuple(h["betas"]), h["eps"], decay)
        if self._decoupled(h):
            return _AdamW(h["lr"], tuple(h["betas"]), decay, h["eps"])
        return _Adam(h["lr"], tuple(h["betas"]), h["eps"])

    def _layout(self, h):
        if h["amsgrad"]:
            return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", _STEP)
        return ("exp_avg", "exp_avg_sq", _STEP)


class AdamW(Adam):
    """torch.optim.AdamW, trained by this library: the library's `AdamW` (decay `lr·λ·p`), which
    runs torch's fused kernel on float32/float64 tensors: bit for bit
    `torch.optim.AdamW(fused=True)`."""

    def __init__(
        self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
        maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
    ):  # fmt: skip
        _DropIn.__init__(self, params, dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
            foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused,
            decoupled_weight_decay=True,
        ))  # fmt: skip


class RMSprop(_DropIn):
    """torch.optim.RMSprop, trained by this library with torch's formula (`alpha`, `centered`,
    `momentum`)."""

    def __init__(
        self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0, centered=False,
        capturable=False, foreach=None, maximize=False, differentiable=False,
    ):  # fmt: skip
        super().__init__(params, dict(
            lr=lr, momentum=momentum, alpha=alpha, eps=eps, centered=centered, weight_decay=weight_decay,
            capturable=capturable, foreach=foreach, maximize=maximize, differentiable=differentiable,
        ))  # fmt: skip

    def _structure(self, h):
        return (bool(h["centered"]), _number(h, "momentum") > 0)

    def _rule(self, h):
        return TorchRMSprop(h["lr"], h["alpha"], h["eps"], h["momentum"], h["centered"])

    def _layout(self, h):
        centred = ("grad_avg",) if h["centered"] else ()
        momentum = ("momentum_buffer",) if _number(h, "momentum") > 0 else ()
        return ("square_avg", *centred, *momentum, _STEP)


class Adagrad(_DropIn):
    """torch.optim.Adagrad, trained by this library with torch's formula (`lr_decay`,
    `initial_accumulator_value`). Unlike torch, the state is made at the first gradient."""

    def __init__(
        self, params, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0, eps=1e-10,
        foreach=None, *, maximize=False, differentiable=False, fused=None,
    ):  # fmt: skip
        super().__init__(params, dict(
            lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value, foreach=foreach, maximize=maximize,
            differentiable=differentiable, fused=fused,
        ))  # fmt: skip

    def _structure(self, h):
        return (h["initial_accumulator_value"],)  # the state starts there: a change would not apply

    def _rule(self, h):
        return TorchAdagrad(h["lr"], h["lr_decay"], h["eps"], h["initial_accumulator_value"])

    def _layout(self, h):
        return ("sum", _STEP)


class Adadelta(_DropIn):
    """torch.optim.Adadelta, trained by this library with torch's formula (with `lr`)."""

    def __init__(
        self, params, lr=1.0, rho=0.9, eps=1e-6, weight_decay=0, foreach=None, *, capturable=False,
        maximize=False, differentiable=False,
    ):  # fmt: skip
        super().__init__(params, dict(
            lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, maximize=maximize, capturable=capturable,
            foreach=foreach, differentiable=differentiable,
        ))  # fmt: skip

    def _rule(self, h):
        return TorchAdadelta(h["lr"], h["rho"], h["eps"])

    def _layout(self, h):
        return ("square_avg", "acc_delta", _STEP)


class Adamax(_DropIn):
    """torch.optim.Adamax, trained by this library with torch's formula (ε inside the maximum)."""

    def __init__(
        self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, foreach=None, *,
        maximize=False, differentiable=False, capturable=False,
    ):  # fmt: skip
        super().__init__(params, dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach, maximize=maximize,
            differentiable=differentiable, capturable=capturable,
        ))  # fmt: skip

    def _rule(self, h):
        return TorchAdamax(h["lr"], tuple(h["betas"]), h["eps"])

    def _layout(self, h):
        return ("exp_avg", "exp_inf", _STEP)


class NAdam(_DropIn):
    """torch.optim.NAdam, trained by this library with torch's formula (momentum schedule
    `momentum_decay`, `decoupled_weight_decay`)."""

    def __init__(
        self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, momentum_decay=4e-3,
        decoupled_weight_decay=False, *, foreach=None, maximize=False, capturable=False,
        differentiable=False,
    ):  # fmt: skip
        super().__init__(params, dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, momentum_decay=momentum_decay,
            decoupled_weight_decay=decoupled_weight_decay, maximize=maximize, foreach=foreach,
            capturable=capturable, differentiable=differentiable,
        ))  # fmt: skip

    def _rule(self, h):
        decay = h["weight_decay"] if self._decoupled(h) else 0.0
        return TorchNAdam(h["lr"], tuple(h["betas"]), h["eps"], h["momentum_decay"], decay)

    def _layout(self, h):
        return ("exp_avg", "exp_avg_sq", "mu_product", _STEP)


class RAdam(_DropIn):
    """torch.optim.RAdam, trained by this library with torch's formula (rectified from ρ > 5,
    `decoupled_weight_decay`)."""

    def __init__(
        self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, decoupled_weight_decay=False,
        *, foreach=None, maximize=False, capturable=False, differentiable=False,
    ):  # fmt: skip
        super().__init__(params, dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize, foreach=foreach,
            capturable=capturable, decoupled_weight_decay=decoupled_weight_decay,
            differentiable=differentiable,
        ))  # fmt: skip

    def _rule(self, h):
        decay = h["weight_decay"] if self._decoupled(h) else 0.0
        return TorchRAdam(h["lr"], tuple(h["betas"]), h["eps"], decay)

    def _layout(self, h):
        return ("exp_avg", "exp_avg_sq", _STEP)


class Rprop(_DropIn):
    """torch.optim.Rprop, trained by this library with torch's formula (step sizes start at
    `lr`, clamped to `step_sizes`)."""

    _l2 = False  # torch's Rprop has no weight decay

    def __init__(
        self, params, lr=1e-2, etas=(0.5, 1.2), step_sizes=(1e-6, 50), *, capturable=False, foreach=None,
        maximize=False, differentiable=False,
    ):  # fmt: skip
        super().__init__(params, dict(
            lr=lr, etas=etas, step_sizes=step_sizes, foreach=foreach, maximize=maximize,
            differentiable=differentiable, capturable=capturable,
        ))  # fmt: skip

    def _check(self, h, where):
        super()._check(h, where)
        minus, plus = h["etas"]
        if not 0.0 < minus < 1.0 < plus:
            raise ValueError(f"{where}: invalid eta values: {minus}, {plus}")

    def _rule(self, h):
        return TorchRprop(h["lr"], tuple(h["etas"]), tuple(float(s) for s in h["step_sizes"]))

    def _layout(self, h):
        return ("prev", "step_size", _STEP)
