"""`optimisers.torch.Optimizer`: any rule of this library as a `torch.optim.Optimizer`. torch.optim's
classes by name (`optimisers.torch.AdamW`, `SGD`, ...) are defined in `dropins` on top of it.

The class is a thin shell that hands each job to a helper: its policy (`RulePolicy` here, a
drop-in class's `TorchPolicy`: how group dicts become rules and what a gradient goes through),
its `Book` (`lazy_state`: the groups, the parameters by position, which have state; torch's
`state[p]` is a `StateView` of it), its format (`checkpointing.LibraryFormat`, a drop-in's
`TorchFormat`), and the functions of `stepping` and `checkpointing`. Each trained tensor has one
`Leaf`, made by `optimisers.setup` at its first gradient (so ties, paths and per-parameter rule
functions work as everywhere else); a step hands the `.grad` fields to `optimisers.update_`.

Imported only on demand (`optimisers.torch` or `import optimisers.torch`): `import optimisers`
never imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from optimisers.core.rule import Rule
from optimisers.torch import checkpointing, stepping
from optimisers.torch.hyperparameters import adjusted_rule, unknown_key_error
from optimisers.torch.lazy_state import Book, StateView
from optimisers.torch.param_groups import check_rule, group_of_dict, group_tensors, groups_of_module

__all__ = ["Optimizer"]


class RulePolicy:
    """How `Optimizer(params, rule)` makes its groups (from its rule and keyword arguments) and
    syncs their entries into their rules (`Rule.adjust`); the gradients go to the rules as they
    are, negated in groups with `maximize`."""

    def __init__(self, optimizer, rule, overrides: dict):
        if rule is not None and not (isinstance(rule, Rule) or callable(rule)):
            raise TypeError(
                "Optimizer expects an optimisers.Rule (e.g. optimisers.AdamW(1e-3)) as its rule, "
                f"got {rule!r}"
            )
        if isinstance(rule, type):
            check_rule(rule, "Optimizer")
        self.opt, self.rule, self.overrides = optimizer, rule, dict(overrides)

    def module_groups(self, module) -> list:
        if self.rule is None:
            check_rule(None, "Optimizer(module, rule)")
        groups, self.opt._book.module_tree = groups_of_module(module, self.rule, self.overrides)
        return groups

    def make(self, group, where: str):
        base = self.rule if isinstance(self.rule, Rule) else None
        return group_of_dict(group, base, self.overrides, where)

    def defaults(self, groups) -> dict:
        return dict(groups[0].seen)

    def resync(self, g, changed: dict, where: str):
        """The rule of group `g` with the changed entries applied."""
        return adjusted_rule(g.rule, changed, where)

    def check_keys(self, g, i: int) -> None:
        """Refuse keys added to group `g` (number `i`) since that set nothing."""
        unknown = g.unknown_keys()
        if unknown:
            raise unknown_key_error(g.rule, g.seen, unknown[0], f"param_groups[{i}]")

    def listed(self, params, where: str) -> list:
        """The tensors of a group's edited `"params"` list, checked as a new group's are."""
        return group_tensors(params, where)[0]

    def engine_view(self, p):
        """What the update engine trains for parameter `p`."""
        return p

    def ready(self) -> bool:
        """Whether the step goes ahead."""
        return True

    def gradients(self, groups, grads: list) -> list:
        """The gradients the rules see, by position: negated in groups with `maximize` (in a new
        list: the one handed in is left as it is)."""
        maximized = [g for g in groups if g.entries.get("maximize")]
        if not maximized:
            return grads
        grads = list(grads)
        for g in maximized:
            for i in g.positions:
                if grads[i] is not None:
                    grads[i] = -grads[i]
        return grads


class Optimizer(torch.optim.Optimizer):
    """A `torch.optim.Optimizer` that trains with any rule of this library.

        opt = optimisers.torch.Optimizer(model, optimisers.AdamW(1e-3, lambd=0.01))
        loss.backward(); opt.step(); opt.zero_grad()

    `params` is what torch.optim takes (tensors, `(name, tensor)` pairs, group dicts) or a module
    (ties kept; `rule` may be a function `(path, x) -> Rule`). Group keys (`"lr"`, torch's names,
    the rule's, `"rule"`, `"maximize"`) and keyword arguments set the rules' hyperparameters, and
    a change takes effect at the next `step()`. State is made at a parameter's first gradient;
    `optimiser_state` is the library's `State` (see docs/torch-optimizer.md)."""

    _Policy = RulePolicy  # (a drop-in class: TorchPolicy)
    _Format = checkpointing.LibraryFormat

    def __init__(self, params, rule=None, **hyperparameters):
        self._policy = self._Policy(self, rule, hyperparameters)
        self._book = Book(self)
        self._groups, self._format = self._book.groups, self._Format(self)
        groups = self._book.start(params)  # checked, for torch's __init__ to add
        super().__init__([g.entries for g in groups], self._policy.defaults(groups))
        self._book.pending = {}

    def add_param_group(self, param_group: dict) -> None:
        """Add a group as torch.optim does: a dict with "params" and hyperparameters (the
        optimizer's give the rest). A failed call changes nothing."""
        self._book.add_group(param_group)

    def step(self, closure=None):
        """One step on every parameter that has a `.grad` (a first gradient makes its state).
        `closure`, if given, re-evaluates the model and returns the loss, which is returned."""
        return stepping.step(self, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch.optim's, except that gradients that are views of a flat buffer (`flatten_`) are
        zeroed in place and kept, whatever `set_to_none` says."""
        stepping.zero_grad(self, set_to_none)

    def state_dict(self) -> dict:
        """torch.optim's layout, `{"state": {position: entry}, "param_groups": [...]}`, holding
        the state's own tensors; an entry has its rule as text and `optimisers.state_dict`'s keys
        (a drop-in class's, torch's keys)."""
        return checkpointing.state_dict(self)

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Restore what `state_dict()` gave (a drop-in class also takes its torch.optim class's,
        with hyperparameters, as torch.optim does): checked in full first (a `CheckpointError`
        lists every difference), then loaded. Parameters not in it have no state after it."""
        checkpointing.load_state_dict(self, state_dict)

    @property
    def state(self):
        """torch's `state[p]`: parameter `p`'s entry of `state_dict()["state"]` (a `StateView`)."""
        return StateView(self)

    @state.setter
    def state(self, value):
        self._book.reset_state(value)

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
