"""`optimisers.torch.Optimizer`: any rule of this library as a `torch.optim.Optimizer`. torch.optim's
classes by name (`optimisers.torch.AdamW`, `SGD`, ...) are defined in `dropins` on top of it.

The adapter is a thin layer over the library's core. Each trained tensor has one `Leaf` (made by
`optimisers.setup`, so a module's ties, paths and per-parameter rule functions work as everywhere
else); a step hands the `.grad` fields to `optimisers.update_`; `param_groups` entries are synced
into the Leafs' rules (`Rule.adjust`) when they change; `state_dict` / `load_state_dict` are the
library's, keyed by parameter position as torch.optim does. As in torch.optim, a parameter's
state is made at its first gradient (its Leaf is set up without state until then).

The class is assembled from one module per job: `param_groups` (building groups and syncing their
entries into rules, with `hyperparameters` for the names), `lazy_state` (which parameters have
state; torch's `state[p]`), `stepping` (`step`, `zero_grad`) and `checkpointing` (`state_dict` /
`load_state_dict`).

Imported only on demand (`optimisers.torch` or `import optimisers.torch`): `import optimisers`
never imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from optimisers.core.rule import Rule
from optimisers.torch.checkpointing import Checkpointing
from optimisers.torch.hyperparameters import adjusted_rule, unknown_key_error
from optimisers.torch.lazy_state import LazyState
from optimisers.torch.param_groups import (
    ParamGroup,
    check_distinct,
    check_rule,
    group_of_dict,
    group_tensors,
    groups_of_module,
)
from optimisers.torch.stepping import Stepping

__all__ = ["Optimizer"]


class Optimizer(Stepping, LazyState, Checkpointing, torch.optim.Optimizer):
    """A `torch.optim.Optimizer` that trains with any rule of this library.

        opt = optimisers.torch.Optimizer(model, optimisers.AdamW(1e-3, lambd=0.01))
        loss.backward(); opt.step(); opt.zero_grad()

    `params` is what torch.optim takes (an iterable of tensors, of `(name, tensor)` pairs, or of
    group dicts) or an `nn.Module`. A module is set up by `optimisers.setup`: a tied parameter
    has one state, and `rule` may be a function `(path, x) -> Rule`; parameters whose rules are
    equal share one param group. In a group dict, `"lr"` sets the rule's learning rate `eta`,
    `"betas"` its `beta`, torch's `"weight_decay"` and `"eps"` its `lambd` and `epsilon` (where
    the rule has them), `"rule"` gives that group its own rule, `"maximize": True` climbs the
    loss instead, and any other key sets the hyperparameter of that name (`"lambd"`,
    `"epsilon"`, ...). Keyword arguments set entries of every group.

    Each group dict holds `"lr"` and the rule's other hyperparameters by name; a change to them
    (by a scheduler or by hand) takes effect at the next `step()` and keeps the optimiser state.
    As in torch.optim, a parameter's state is made at its first gradient: parameters without a
    `.grad` are skipped (a frozen backbone costs no memory), and `state_dict()` holds only real
    state. It holds only tensors, numbers, text, lists and dicts (it survives
    `torch.load(weights_only=True)`), and a run resumed from it continues bit for bit. The
    library's `State` is `optimiser_state` (the Leafs that have state); torch's per-parameter
    `state[p]` is a view: `p`'s entry of `state_dict()["state"]`, built when read, loaded into
    `p`'s Leaf when assigned.
    """

    def __init__(self, params, rule=None, **hyperparameters):
        _check_rule_argument(rule)
        self._overrides = dict(hyperparameters)
        self._base_rule = rule
        self._start_tracking()
        groups = self._initial_groups(params, rule)
        check_distinct([g.params for g in groups], ["param_names" in g.entries for g in groups])
        # torch's __init__ passes each group dict to add_param_group, which takes the group built here
        self._pending = {id(g.entries): g for g in groups}
        super().__init__([g.entries for g in groups], self._defaults(groups))
        del self._pending

    def _initial_groups(self, params, rule) -> list[ParamGroup]:
        if isinstance(params, torch.Tensor):
            raise TypeError(  # torch.optim's words
                "params argument given to the optimizer should be an iterable of Tensors or dicts "
                f"(or a module), but got {torch.typename(params)}"
            )
        if isinstance(params, nn.Module):
            return self._groups_of_module(params, rule)
        if rule is not None and not isinstance(rule, Rule):
            raise TypeError("a rule function (path, x) -> Rule needs paths: pass the module itself as params")
        raw = list(params)
        if not raw:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(raw[0], Mapping):
            raw = [{"params": raw}]
        return [self._make_group(g, f"group {i}") for i, g in enumerate(raw)]

    def add_param_group(self, param_group: dict) -> None:
        """Add a group of parameters, as torch.optim does: a dict with "params" and optionally
        "rule", "lr" and other hyperparameters (the optimizer's rule and keyword arguments give
        the rest). A failed call changes nothing."""
        g = getattr(self, "_pending", {}).get(id(param_group))
        if g is None:
            self._follow_edits()
            g = self._make_group(param_group, f"group {len(self.param_groups)}")
            groups = [*self._groups, g]
            check_distinct([h.params for h in groups], ["param_names" in h.entries for h in groups])
        self._groups.append(g)
        self.param_groups.append(g.entries)
        self._changed()

    # --- what a subclass with torch.optim's signature changes ---------------------------------------

    def _groups_of_module(self, module, rule) -> list[ParamGroup]:
        if rule is None:
            check_rule(None, "Optimizer(module, rule)")
        groups, self._module_tree = groups_of_module(module, rule, self._overrides)
        return groups

    def _make_group(self, group, where: str) -> ParamGroup:
        base = self._base_rule if isinstance(self._base_rule, Rule) else None
        return group_of_dict(group, base, self._overrides, where)

    def _defaults(self, groups) -> dict:
        return dict(groups[0].seen)

    def _resync(self, g: ParamGroup, changed: dict, where: str):
        """The rule of group `g` with the changed entries applied."""
        return adjusted_rule(g.rule, changed, where)

    def _refused_keys(self, g: ParamGroup) -> list:
        """Keys of group `g` that a step refuses (added since, setting nothing)."""
        return g.unknown_keys()

    def _unknown_key(self, g: ParamGroup, key: str, i: int) -> Exception:
        return unknown_key_error(g.rule, g.seen, key, f"param_groups[{i}]")

    def _engine_view(self, p):
        """What the update engine trains for parameter `p`."""
        return p

    def _listed(self, params, where: str) -> list:
        """The tensors of a group's edited `"params"` list, checked as a new group's are."""
        return group_tensors(params, where)[0]

    def _gradients(self, grads: list) -> list:
        """The gradients the rules see, by position: negated in groups with `maximize` (in a new
        list: the one handed in is left as it is)."""
        maximized = [g for g in self._groups if g.entries.get("maximize")]
        if not maximized:
            return grads
        grads = list(grads)
        for g in maximized:
            for i in g.positions:
                if grads[i] is not None:
                    grads[i] = -grads[i]
        return grads

    # --- copies (deepcopy, pickle) ----------------------------------------------------------------

    def __getstate__(self):
        d = super().__getstate__()
        d.pop("state", None)
        d.update(
            {k: v for k, v in self.__dict__.items() if k.startswith("_") and k not in d and "hook" not in k}
        )
        return d

    def __setstate__(self, state):
        super().__setstate__(state)
        # a copy holds new tensors: find each one's state by its new identity
        self._leaf_of = {id(p): (p, leaf, g) for p, leaf, g in self._leaf_of.values()}
        self._changed()


def _check_rule_argument(rule) -> None:
    if rule is not None and not (isinstance(rule, Rule) or callable(rule)):
        raise TypeError(
            f"Optimizer expects an optimisers.Rule (e.g. optimisers.AdamW(1e-3)) as its rule, got {rule!r}"
        )
    if isinstance(rule, type):
        check_rule(rule, "Optimizer")
