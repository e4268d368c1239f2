"""`DropIn`: what the classes with torch.optim's names share. Its `TorchPolicy` checks the values
as torch does, builds the groups, and does to the gradient what torch does before its formula;
its `TorchFormat` (`checkpointing`) reads and writes torch's state format."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from optimisers.torch.checkpointing import TorchFormat
from optimisers.torch.optimizer import Optimizer
from optimisers.torch.param_groups import (
    ALIASES,
    NOT_HYPERPARAMETERS,
    ParamGroup,
    check_group_dict,
    check_switches,
    group_dict,
    group_tensors,
)

# the library's names of hyperparameters, and "rule": in a drop-in's group they would set nothing
LIBRARY_NAMES = ("rule", "eta", *ALIASES)


def as_number(h: Mapping, key: str) -> float:
    """Hyperparameter `key` as a Python number (torch allows a tensor learning rate and more)."""
    v = h[key]
    return float(v) if isinstance(v, torch.Tensor) else v


def torch_args(args: dict, order: str = "", **extra) -> dict:
    """A drop-in's `__init__` arguments (`locals()`) as group keys, in torch's `order`, then `extra`."""
    args = {**args, **extra}
    keys = order.split() or [k for k in args if k not in ("self", "params", "__class__")]
    return {k: args[k] for k in [*keys, *(k for k in extra if k not in keys)]}


def decoupled(h: Mapping) -> bool:
    return bool(h.get("decoupled_weight_decay", False))


def check_torch_switches(h: Mapping, where: str) -> None:
    """torch.optim's checks of its switches and of a tensor `lr`, in its words, then this library's."""
    if h.get("fused") and h.get("foreach"):
        raise RuntimeError(f"{where}: `fused` and `foreach` cannot be `True` together.")
    if h.get("fused") and h.get("differentiable"):
        raise RuntimeError(f"{where}: `fused` does not support `differentiable`")
    lr = h.get("lr")
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"{where}: Tensor lr must be 1-element, got one of shape {tuple(lr.shape)}")
    check_switches(h, where)


def check_values(h: Mapping, where: str, foreach_scalars: bool = False) -> None:
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
    if foreach_scalars:
        refuse_foreach_tensors(h, where, ValueError)


def refuse_foreach_tensors(h, where, error, keys=("lr", "betas")) -> None:
    """torch.optim.Adam's refusal, with `foreach=True` (and capturable off: always, here), of a
    tensor `lr` or tensor `betas`: its foreach kernels take neither."""
    if not h.get("foreach"):
        return
    named = [("lr", h.get("lr"))] if "lr" in keys else []
    if "betas" in keys and isinstance(h.get("betas"), (tuple, list)):
        named += [(f"betas[{i}]", b) for i, b in enumerate(h["betas"])]
    for name, v in named:
        if isinstance(v, torch.Tensor):
            raise error(
                f"{where}: {name} as a Tensor is not supported for capturable=False and foreach=True "
                f"(got {name}={v!r}); give it as a float, or leave foreach unset"
            )


def described(where: str, k: int, name) -> str:
    """A group's parameter `k` (named `name`, if it has a name) as an error names it."""
    return f"{where}, parameter {k}" + (f" ({name})" if name else "")


class TorchPolicy:
    """How a drop-in class makes a group from torch's group dict (checked, and mapped to one rule
    by the class's `_rule`), syncs changed entries into its rule, and prepares the gradients."""

    rule = None  # (the class makes each group's rule)

    def __init__(self, optimizer):  # (made when used: see Optimizer._policy)
        self.opt, self.name, self.hyper = optimizer, type(optimizer).__name__, optimizer._hyper

    def built(self, h: dict, where: str):
        """The rule of group hyperparameters `h`, checked first as torch checks them."""
        self.opt._check(h, where)
        # a one-element tensor (`lr=torch.tensor([1e-3])`) as a 0-d view: the rule reads its value
        # also after a scheduler changes it in place
        one = {
            k: v.view(()) for k, v in h.items() if isinstance(v, torch.Tensor) and v.dim() and v.numel() == 1
        }
        try:
            return self.opt._rule({**h, **one})
        except (TypeError, ValueError) as e:
            raise type(e)(f"{where}: {e}") from None

    def defaults(self, groups) -> dict:
        return dict(self.hyper)

    def make(self, group, where: str) -> ParamGroup:
        check_group_dict(group, where)
        for key in group:
            self._refuse(key, where)
        h = {k: group.get(k, v) for k, v in self.hyper.items()}
        rule = self.built(h, where)
        params, names = group_tensors(group["params"], where)
        self.opt._check_params(params, names, where)
        # any other key is carried, as torch.optim carries it (a scheduler's, a user's note)
        carried = {k: v for k, v in group.items() if k not in h and k not in NOT_HYPERPARAMETERS}
        return ParamGroup(group_dict(params, names, h, carried), params, rule, dict(h))

    def listed(self, params, where: str) -> list:
        params = group_tensors(params, where)[0]
        self.opt._check_params(params, None, where)
        return params

    def _refuse(self, key, where: str) -> None:
        """Refuse a key that sets nothing here although it looks as if it would: the library's
        own names of hyperparameters ("lambd", "eta", ...) and "rule" (the class makes the rule)."""
        if key in LIBRARY_NAMES and key not in self.hyper:
            raise ValueError(
                f"{where}: unknown key {key!r}; torch.optim.{self.name} takes "
                + ", ".join(repr(k) for k in self.hyper)
            )

    def check_keys(self, g: ParamGroup, i: int) -> None:
        for key in g.entries:
            self._refuse(key, f"param_groups[{i}]")

    def resync(self, g: ParamGroup, changed: dict, where: str):
        h = {**g.seen, **changed}
        if self.opt._foreach_scalars:  # torch checks a tensor lr again at the step, with a RuntimeError
            refuse_foreach_tensors(h, where, RuntimeError, ("lr",))
        if self.opt._structure(h) != self.opt._structure(g.seen):
            raise ValueError(
                f"{where}: changing {', '.join(repr(k) for k in changed)} after the optimizer was made "
                f"changes what state {self.name} keeps; make a new optimizer (or load a checkpoint) instead"
            )
        return self.built(h, where)

    def engine_view(self, p):
        # torch trains a complex parameter as pairs of reals (view_as_real), and so does this class
        return torch.view_as_real(p.detach()) if p.is_complex() else p

    def ready(self) -> bool:
        """No step where GradScaler (or a user) set `found_inf`, as torch reads it; torch's refusal
        of complex parameters with a gradient, before anything changes."""
        found_inf = getattr(self.opt, "found_inf", None)
        if found_inf is not None and bool(found_inf):
            return False
        for i, group in enumerate([] if self.opt._takes_complex else self.opt.param_groups):
            params = group.get("params", ())
            for k, (p, name) in enumerate(zip(params, group.get("param_names") or [None] * len(params))):
                if isinstance(p, torch.Tensor) and p.is_complex() and p.grad is not None:
                    raise RuntimeError(
                        f"{described(f'param_groups[{i}]', k, name)}: {self.name} does not support "
                        f"complex parameters (this one is {p.dtype}); give it to another optimizer, "
                        "or train its real view (torch.view_as_real)"
                    )
        return True

    def gradients(self, groups, grads: list) -> list:
        """What torch does to a gradient before its formula, in its order (sparse made dense,
        `grad_scale` divided out, `maximize`, non-decoupled `weight_decay`, complex viewed as
        reals), in a new list."""
        if self.opt._sparse:
            grads = [g if g is None or g.layout is torch.strided else g.to_dense() for g in grads]
        scale = getattr(self.opt, "grad_scale", None)
        if scale is not None:
            grads = [None if grad is None else grad / scale for grad in grads]
        for g in groups:
            h = g.seen
            if h.get("fused"):
                _check_fused(g, grads)
            maximize = h.get("maximize", False)
            decay = h.get("weight_decay", 0) if self.opt._l2 and not decoupled(h) else 0
            decays = isinstance(decay, torch.Tensor) or decay != 0
            if not (maximize or decays or g.has_complex):
                continue  # the gradients as they are (AdamW's usual case): no pass over them
            grads = list(grads)
            for position, p in zip(g.positions, g.params):
                grad = grads[position]
                if grad is None:
                    continue
                if maximize:
                    grad = -grad
                if decays:
                    grad = grad.add(p.detach(), alpha=decay)
                grads[position] = torch.view_as_real(grad) if grad.is_complex() else grad
        return grads


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


class DropIn(Optimizer):
    """What the classes with torch.optim's names share. Each gives torch's signature, `_rule(h)` (the
    rule of group hyperparameters `h`) and `_layout` (torch's names of the rule's state parts)."""

    _Policy, _Format = TorchPolicy, TorchFormat
    _l2: ClassVar[bool] = True  # "weight_decay" is added to the gradient (unless decoupled)
    _sparse: ClassVar[bool] = False  # takes sparse gradients (densified), as torch's class does
    _takes_complex: ClassVar[bool] = True  # else complex parameters are refused at the step
    _one_part: ClassVar[bool] = False  # the rule's state is one array (Muon's), not a tuple of parts
    _foreach_scalars: ClassVar[bool] = False  # foreach=True refuses a tensor lr and betas (Adam's)

    def __init__(self, params, hyper: dict):
        if isinstance(params, torch.nn.Module):
            raise TypeError(
                f"{type(self).__name__} takes params as torch.optim does: pass model.parameters() "
                "(or param groups); a tied weight is one Parameter there, so ties are kept"
            )
        self._hyper = hyper
        self._check(hyper, type(self).__name__)
        super().__init__(params)

    def _check(self, h: Mapping, where: str) -> None:
        """torch.optim's own checks of the values, in its words."""
        check_values(h, where, self._foreach_scalars)

    def _structure(self, h: dict) -> tuple:
        """What decides the state's layout (the layout, by default): a later change is refused."""
        return self._layout(h) if callable(getattr(self, "_layout", None)) else ()

    def _layout_for(self, h: dict, p) -> tuple[str, ...]:
        return self._layout(h) if callable(self._layout) else self._layout  # (Adafactor's: by p)

    def _check_params(self, params: list, names, where: str) -> None:
        """The class's own refusals of a group's tensors (Muon: vectors)."""
