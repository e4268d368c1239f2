"""`optimisers.torch.Optimizer`: any rule of this library as a `torch.optim.Optimizer`, a thin shell
over its helpers (docs/architecture.md). The `Book` holds the state; the policy and the format are
views of the optimizer made when used, so that nothing it holds refers back to it (a reference
cycle would keep its tensors until the garbage collector runs)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from optimisers.torch import checkpointing, stepping
from optimisers.torch.lazy_state import Book, StateView
from optimisers.torch.param_groups import RulePolicy

__all__ = ["Optimizer"]


class Optimizer(torch.optim.Optimizer):
    """A `torch.optim.Optimizer` that trains with any rule of this library.

        opt = optimisers.torch.Optimizer(model, optimisers.AdamW(1e-3, lambd=0.01))
        loss.backward(); opt.step(); opt.zero_grad()

    `params`: what torch.optim takes, or a module (ties kept; `rule` may be a function `(path, x)
    -> Rule`). Group keys (`"lr"`, torch's names, the rule's, `"rule"`, `"maximize"`) and keyword
    arguments set hyperparameters; a change takes effect at the next `step()`. State is made at a
    parameter's first gradient; `optimiser_state` is the library's `State` (docs/torch-optimizer.md)."""

    _Policy, _Format = RulePolicy, checkpointing.LibraryFormat  # (a drop-in's: TorchPolicy, TorchFormat)
    _policy = property(lambda self: self._Policy(self))
    _format = property(lambda self: self._Format(self))
    optimiser_state = property(lambda self: self._book.optimiser_state, doc="The library's `State`.")

    def __init__(self, params, rule=None, **hyperparameters):
        RulePolicy.check(rule)
        self._base_rule, self._overrides, self._book = rule, hyperparameters, Book()
        self._groups = self._book.groups
        groups = self._book.start(params, self._policy)  # checked, for torch's __init__ to add
        super().__init__([g.entries for g in groups], self._policy.defaults(groups))
        self._book.pending = {}

    def add_param_group(self, param_group: dict) -> None:
        """Add a group as torch.optim does: a dict with "params" and hyperparameters (the
        optimizer's give the rest). A failed call changes nothing."""
        self._book.add_group(param_group, self.param_groups, self._policy)

    def step(self, closure=None):
        """One step on every parameter that has a `.grad` (a first gradient makes its state).
        `closure`, if given, re-evaluates the model and returns the loss, which is returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepping.eager_step(self)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch.optim's, except that gradients that are views of a flat buffer (`flatten_`) are
        zeroed in place and kept, whatever `set_to_none` says."""
        if not stepping.zeroed_flat_grads(self, set_to_none):  # (torch's here: one frame for torch.compile)
            super().zero_grad(set_to_none)

    def state_dict(self) -> dict:
        """torch.optim's layout, `{"state": {position: entry}, "param_groups": [...]}`, holding the
        state's own tensors; an entry has `optimisers.state_dict`'s keys (a drop-in's: torch's)."""
        return checkpointing.state_dict(self)

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Restore what `state_dict()` gave (a drop-in class also takes its torch.optim class's,
        with hyperparameters, as torch.optim does): checked in full first (a `CheckpointError`
        lists every difference), then loaded. Parameters not in it have no state after it."""
        checkpointing.load_state_dict(self, state_dict)

    # torch's `state[p]`: parameter `p`'s entry of `state_dict()["state"]` (a `StateView`)
    state = property(StateView, lambda self, value: self._book.reset_state(value, StateView(self)))

    def __getstate__(self):  # (copies) torch's, and the helpers
        d = super().__getstate__()
        d.pop("state", None)
        return {**{k: v for k, v in vars(self).items() if k.startswith("_") and "hook" not in k}, **d}

    def __setstate__(self, state):
        super().__setstate__(state)
        self._book.rekey()

    def train(self):
        """For trainers that call it (rules here have no train/eval modes): does nothing."""

    eval = train
