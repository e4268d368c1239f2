"""The `schedulefree` package's optimisers, trained by this library (docs/api.md, "PyTorch optimizer";
docs/evaluation-weights.md: train and eval modes).

The package keeps its counters (`k`, `lr_max`, `weight_sum`, `scheduled_lr`) in each param group;
the library keeps them per parameter and shows those of the group's first parameter with state
in the group's dict after each step (the same numbers when every parameter of the group gets a
gradient at every step). Those entries are shown, not read: editing them changes nothing, except
in a checkpoint, where `load_state_dict` takes them as every parameter's counters (so a state
dict written by the package loads here).
"""

from __future__ import annotations

import torch

from optimisers.rules.schedule_free import ScheduleFreeAdamW, ScheduleFreeSGD
from optimisers.torch.checkpointing import NOT_SHOWN, TorchFormat
from optimisers.torch.dropin_base import DropIn, as_number, torch_args

__all__ = ["AdamWScheduleFree", "SGDScheduleFree"]

_DEFAULT_FOREACH = hasattr(torch, "_foreach_mul_")

# the package's group keys: its counters (shown here, see above) and mode, and their order
_COUNTERS = dict(k=0, train_mode=False, weight_sum=0.0, lr_max=-1.0, scheduled_lr=0.0)
_LATER = "train_mode weight_sum lr_max scheduled_lr weight_lr_power weight_decay foreach"

_NOT_IN_TRAIN_MODE = (
    "Optimizer was not in train mode when step is called. Please insert .train() and .eval() "
    "calls on the optimizer. See documentation for details."
)


def _show(g, **entries) -> None:
    """Set entries of the group's dict that are not synced into the rule."""
    g.entries.update(entries)
    g.seen.update(entries)


@torch.no_grad()
def _switch(optimizer, train: bool, weight) -> None:
    """Move each group not in the mode asked for: `p ← lerp(p, z, weight(β₁))`."""
    optimizer._book.follow_edits(optimizer._policy)
    for g in optimizer._book.groups:
        if bool(g.entries["train_mode"]) != train:
            h = g.entries
            w = weight(h["betas"][0] if "betas" in h else h["momentum"])  # β₁: AdamW's, SGD's
            for p, leaf in zip(g.params, g.leaves):
                if leaf is not None:  # parameters with state (a gradient seen), as the package's
                    p = optimizer._policy.engine_view(p)
                    p.lerp_(leaf.state[0].to(p.device), w)
            _show(g, train_mode=train)


def _show_counters(g) -> None:
    leaf = next((leaf for leaf in g.leaves if leaf is not None and leaf.state is not None), None)
    if leaf is None:
        return
    k, lr_max, weight_sum = leaf.state[-3:]
    warmup = g.seen["warmup_steps"]
    scheduled = as_number(g.seen, "lr") * (min(k / warmup, 1.0) if warmup > 0 else 1.0)
    _show(g, k=int(k), lr_max=float(lr_max), weight_sum=float(weight_sum), scheduled_lr=scheduled)


class ScheduleFreeFormat(TorchFormat):
    """torch's format, the rule's state `(z, ..., k, lr_max, weight_sum)`: the arrays by torch's
    names, the counters taken from the group."""

    def decode(self, position, h, entry, problems):
        state = super().decode(position, h, entry, problems)
        if state is None:
            return None
        try:
            counters = (int(h["k"]), float(h["lr_max"]), float(h["weight_sum"]))
        except (TypeError, ValueError):
            problems.append(
                f"parameter {position}: the group's 'k', 'lr_max' and 'weight_sum' must be numbers, "
                f"got {h['k']!r}, {h['lr_max']!r}, {h['weight_sum']!r}"
            )
            return None
        return (*state[:-3], *counters)


class _ScheduleFreeDropIn(DropIn):
    """What both classes share: train/eval modes, counters shown after each step, state format."""

    _Format = ScheduleFreeFormat
    _l2 = False  # the weight decay is the rule's own, at y

    def eval(self):
        """Set the parameters to the average `x` (for evaluating and saving), as the package's
        `eval()`: `p ← lerp(p, z, 1 − 1/β₁)`. Does nothing in eval mode."""
        _switch(self, False, lambda b1: 1 - 1 / b1)

    def train(self):
        """Set the parameters back to `y` (where gradients are taken), as the package's
        `train()`: `p ← lerp(p, z, 1 − β₁)`. Does nothing in train mode."""
        _switch(self, True, lambda b1: 1 - b1)

    def step(self, closure=None):
        if not self.param_groups[0]["train_mode"]:
            raise RuntimeError(_NOT_IN_TRAIN_MODE)
        loss = super().step(closure)
        for g in self._groups:
            _show_counters(g)
        return loss


class AdamWScheduleFree(_ScheduleFreeDropIn):
    """`schedulefree.AdamWScheduleFree`, trained by this library's `ScheduleFreeAdamW` (same
    signature, defaults, group keys and `state[p]` keys "z", "exp_avg_sq"; `.train()`/`.eval()`
    switch the parameters between `y` and the average `x`)."""

    def __init__(self, params, lr=0.0025, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, warmup_steps=0, r=0.0,
                 weight_lr_power=2.0, foreach=_DEFAULT_FOREACH):  # fmt: skip
        super().__init__(params, torch_args(locals(), "lr betas eps r k warmup_steps " + _LATER, **_COUNTERS))

    def _rule(self, h):
        return ScheduleFreeAdamW(
            as_number(h, "lr"), tuple(h["betas"]), h["eps"], h["weight_decay"], h["warmup_steps"], h["r"],
            h["weight_lr_power"],
        )  # fmt: skip

    _layout = ("z", "exp_avg_sq", NOT_SHOWN, NOT_SHOWN, NOT_SHOWN)


class SGDScheduleFree(_ScheduleFreeDropIn):
    """`schedulefree.SGDScheduleFree`, trained by this library's `ScheduleFreeSGD` (same signature,
    defaults, group keys and `state[p]` key "z"; `.train()` and `.eval()` as the package's)."""

    def __init__(self, params, lr=1.0, momentum=0.9, weight_decay=0, warmup_steps=0, r=0.0, weight_lr_power=2,
                 foreach=_DEFAULT_FOREACH):  # fmt: skip
        super().__init__(params, torch_args(locals(), "lr momentum r k warmup_steps " + _LATER, **_COUNTERS))

    def _check(self, h, where):
        super()._check(h, where)
        if not 0 < as_number(h, "momentum") < 1:
            raise ValueError(f"{where}: momentum must be between 0 and 1 exclusive: {h['momentum']!r}")

    def _rule(self, h):
        return ScheduleFreeSGD(
            as_number(h, "lr"), h["momentum"], h["weight_decay"], h["warmup_steps"], h["r"],
            h["weight_lr_power"],
        )  # fmt: skip

    _layout = ("z", NOT_SHOWN, NOT_SHOWN, NOT_SHOWN)
