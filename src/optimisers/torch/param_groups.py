"""Param groups: group keys against a rule's hyperparameters, what the adapter keeps for each group
(`ParamGroup`), and `RulePolicy`, which builds groups from a module or group dicts."""

from __future__ import annotations

import copy
import dataclasses
import operator
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from optimisers.core.rule import Rule
from optimisers.core.tree import format_path
from optimisers.verbs.destructure import trainables
from optimisers.verbs.setup import rule_chooser, setup

# torch.optim's names for hyperparameters this library spells differently: where the rule has the
# field they mean the same, a group shows both names, kept equal (as "beta" and "betas")
ALIASES = {"beta": "betas", "lambd": "weight_decay", "epsilon": "eps"}
# torch's names that get a hint instead of a bare "unknown key" (the maths differs: torch's
# momentum keeps the learning rate out of the velocity)
TORCH_NAMES = {"weight_decay": "lambd", "eps": "epsilon", "momentum": "rho", "alpha": "rho"}
# what torch's lr schedulers keep in a group besides "lr"; carried along untouched
SCHEDULER_KEYS = ("initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "swa_lr")
# kept in a group, setting no rule field: "maximize", torch.optim's implementation switches (this
# adapter has one engine; True for "capturable" and "differentiable" is refused), schedulers' keys
CARRIED = ("maximize", "foreach", "fused", "capturable", "differentiable", *SCHEDULER_KEYS)
NOT_HYPERPARAMETERS = ("params", "param_names", "rule")  # group entries that set no rule field
MISSING = object()

# group key -> the rule's field: "lr" is `eta`, and torch's aliases name the library's fields
_RULE_NAMES = {"lr": "eta", **{torch_name: name for name, torch_name in ALIASES.items()}}


def rule_name(key: str) -> str:
    return _RULE_NAMES.get(key, key)


def adapter_entries(group: Mapping) -> dict:
    return {k: v for k, v in group.items() if k in CARRIED}


def check_switches(entries: Mapping, where: str) -> None:
    for key in ("capturable", "differentiable"):
        if entries.get(key):
            raise ValueError(
                f"{where}: {key}=True is not supported (the update runs outside autograd and outside "
                "CUDA graph capture); leave it False"
            )


def rule_value(rule, name):
    """Hyperparameter `name` of `rule`: its own field, else the first member rule's (a chain,
    MixedPrecision); `MISSING` when no field holds it. A wrapper whose `hyperparameters()` are its
    inner rule's (`Lookahead`, whose own `alpha` `adjust` does not reach) shows the inner rule's."""
    if not dataclasses.is_dataclass(rule):
        return MISSING
    own = tuple(f.name for f in dataclasses.fields(rule))
    if name in own and not isinstance(getattr(rule, name), Rule):
        inner = MISSING if rule.hyperparameters() == own else _inner_value(rule, name)
        return getattr(rule, name) if inner is MISSING else inner
    return _inner_value(rule, name)


def _inner_value(rule, name):
    """Hyperparameter `name` of the first rule that `rule` holds that has it."""
    for f in dataclasses.fields(rule):
        held = getattr(rule, f.name)
        for sub in held if isinstance(held, tuple) else (held,):
            if isinstance(sub, Rule) and name in sub.hyperparameters():
                found = rule_value(sub, name)
                if found is not MISSING:
                    return found
    return MISSING


def is_plain(v) -> bool:
    """A value a group dict may hold and `torch.load(weights_only=True)` reads back."""
    if isinstance(v, tuple):
        return all(is_plain(e) for e in v)
    return v is None or isinstance(v, (bool, int, float, str, torch.Tensor))


def group_entries(rule) -> dict:
    """The group entries that show `rule`'s hyperparameters: `"lr"` for `eta`, every other
    hyperparameter by its name, and `"betas"` beside a two-number `beta` (torch's name, which
    OneCycleLR and CyclicLR look for to cycle the momentum)."""
    out: dict = {}
    for name in rule.hyperparameters():
        v = rule_value(rule, name)
        if v is MISSING or not is_plain(v):
            continue
        out["lr" if name == "eta" else name] = v
        alias = ALIASES.get(name)
        if alias is not None and (name != "beta" or (isinstance(v, tuple) and len(v) == 2)):
            out[alias] = v
    return out


def same_value(a, b) -> bool:
    """Whether a group entry still holds what it held (a new tensor object counts as a change)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False  # comparing a tensor's values would sync the device
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def adjusted_rule(rule, changes: dict, where: str):
    """`rule` with the group entries `changes` applied (`"lr"` -> `eta`, torch's aliases -> the
    library's names); errors name `where` and the key."""
    hyper: dict = {}
    names = rule.hyperparameters()
    for key, v in changes.items():
        name = rule_name(key)
        if name in hyper and not same_value(hyper[name], v):
            raise ValueError(f"{where}: {key!r} and {name!r} give different values ({v!r}, {hyper[name]!r})")
        hyper[name] = v
    for key in changes:
        if rule_name(key) not in names:
            hint = f" (this library's name: {TORCH_NAMES[key]!r})" if key in TORCH_NAMES else ""
            if key in ALIASES.values():
                hint = f" (torch's name for {rule_name(key)!r}, which this rule does not have)"
            raise ValueError(
                f"{where}: unknown key {key!r}{hint}; {type(rule).__name__} takes 'lr' and "
                f"{', '.join(repr(n) for n in names if n != 'eta') or 'nothing else'}"
            )
    try:
        return rule.adjust(**hyper)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: {e}") from None


@dataclasses.dataclass(eq=False)
class ParamGroup:
    """One param group: its dict (`entries`, the object in `param_groups`), its tensors as last
    followed (`params`), its rule, the entries last synced into it (`seen`), and its tensors'
    Leafs (`leaves`, None for one without state)."""

    entries: dict
    params: list
    rule: Any
    seen: dict
    has_complex: bool = False  # a drop-in class trains complex parameters as real views
    first: int = 0  # the position (number in `param_groups`, as torch counts) of its first tensor
    leaves: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.follow(self.params)

    @property
    def positions(self) -> range:
        return range(self.first, self.first + len(self.params))

    def follow(self, params: list) -> None:
        """Take `params` as the group's tensors, and the list in `entries` as it is now (a copy
        where it is `params`: the user's edits of it must not edit `params`)."""
        self.params = params
        self.has_complex = any(p.is_complex() for p in params)
        listed = self.entries.get("params")
        if listed is params or not isinstance(listed, (list, tuple)):  # (a tensor, a generator)
            listed = self.entries["params"] = list(params)
        self._listed = tuple(listed)

    def edited(self, where: str) -> bool:
        """Has the user edited the `"params"` list (or put another in its place) since?"""
        listed = self.entries.get("params")
        if listed is None:
            raise KeyError(f"{where} lost its 'params' entry")
        if not isinstance(listed, (list, tuple)):
            return True
        return len(listed) != len(self._listed) or not all(map(operator.is_, listed, self._listed))

    def use_rule(self, rule) -> None:  # (one rule object for the group and all its Leafs)
        for leaf in self.leaves:
            if leaf is not None:
                leaf.rule = rule
        self.rule = rule

    def changed_entries(self, where: str) -> dict:
        """The synced entries whose values changed since (by a scheduler or by hand)."""
        changed = {}
        for key, old in self.seen.items():
            if key not in self.entries:
                raise KeyError(f"{where} lost its {key!r} entry")
            if not same_value(self.entries[key], old):
                changed[key] = self.entries[key]
        return changed

    def apply(self, changed: dict, rule) -> tuple:
        """Adopt `rule`, made from the `changed` entries; returns what `restore` takes to undo it."""
        aliases = {k: self.entries.get(k, MISSING) for pair in ALIASES.items() for k in pair}
        undo = (self.rule, dict(self.seen), aliases)
        self.use_rule(rule)
        self.seen.update(changed)
        for name, alias in ALIASES.items():  # keep torch's name and the library's equal
            if name in self.seen and alias in self.seen and (name in changed or alias in changed):
                value = changed.get(name, changed.get(alias))
                self.entries[name] = self.entries[alias] = self.seen[name] = self.seen[alias] = value
        return undo

    def restore(self, undo: tuple) -> None:
        """Undo `apply` (a step that failed leaves the group as it was)."""
        rule, seen, aliases = undo
        self.use_rule(rule)
        self.seen = seen
        for k, v in aliases.items():
            if v is not MISSING:
                self.entries[k] = v


def check_distinct(lists: list[list], named: list[bool] | None = None) -> None:
    """Each tensor in one group only (of the groups' tensor `lists`), and names for every
    group's parameters or for none (torch's checks, in its words, with the places named)."""
    where: dict[int, str] = {}
    for i, params in enumerate(lists):
        for j, p in enumerate(params):
            here = f"group {i}, parameter {j}"
            if id(p) in where:
                raise ValueError(
                    f"some parameters appear in more than one parameter group: {here} is the same "
                    f"tensor as {where[id(p)]} (a tied weight is one tensor: list it once)"
                )
            where[id(p)] = here
    named = [n for n, params in zip(named or [], lists) if params]
    if any(named) and not all(named):
        which = "with" if named[-1] else "without"
        raise ValueError(
            "all optimizer param groups should be with/without names. cannot add param group "
            f"{which} names to the optimizer (group {len(lists) - 1})"
        )


def check_rule(rule, where: str) -> None:
    if isinstance(rule, type) and issubclass(rule, Rule):
        raise TypeError(f"{where}: pass a rule instance, e.g. {rule.__name__}(), not the class")
    if not isinstance(rule, Rule):
        raise TypeError(f"{where}: expected an optimisers.Rule such as optimisers.AdamW(1e-3), got {rule!r}")


def check_group_dict(group, where: str) -> None:
    if not isinstance(group, Mapping):
        raise TypeError(f"{where}: expected a dict with a 'params' entry, got a {type(group).__name__}")
    if "params" not in group:
        raise ValueError(f"{where}: has no 'params' entry")


def group_tensors(raw, where: str) -> tuple[list, list | None]:
    """The tensors of a group's "params" (and their names, if given as (name, tensor) pairs)."""
    if isinstance(raw, torch.Tensor):
        raw = [raw]
    elif isinstance(raw, nn.Module):
        raise TypeError(f"{where}: a module must be passed as the optimizer's params itself, not in a group")
    elif isinstance(raw, (set, frozenset)):
        raise TypeError(f"{where}: params must be an ordered collection (a list), not a set")
    params, names, seen = [], [], set()
    for item in raw:
        name = None
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            name, item = item
        if not isinstance(item, torch.Tensor):
            raise TypeError(f"{where}: can only optimise tensors, got a {type(item).__name__}")
        if not (item.is_leaf or item.retains_grad):
            raise ValueError(f"{where}: cannot optimise a non-leaf tensor (one computed from others)")
        if id(item) in seen:
            warnings.warn(
                f"{where}: a parameter group with duplicate parameters; each is kept once "
                "(torch.optim steps it as often as it is listed, and will refuse it in future)",
                UserWarning,
                stacklevel=5,
            )
            continue
        seen.add(id(item))
        params.append(item)
        if name is not None:
            names.append(name)
    if names and len(names) != len(params):
        raise ValueError(
            f"{where}: all optimizer params should be with/without names. Some param names are missing"
        )
    return params, (names or None)  # an empty group is kept, as torch.optim keeps it


@dataclasses.dataclass(frozen=True)
class _Deferred(Rule):
    """Stands in for a parameter's rule while `setup` walks a module: the state is made at the
    first gradient, as torch.optim makes it (a frozen backbone costs no memory)."""

    rule: Any = None

    def init(self, x):
        return None


def _group_with_rule(groups: list[ParamGroup], rule) -> ParamGroup:
    """The group whose rule equals `rule`, a new one (appended) if none does."""
    for g in groups:
        try:
            equal = g.rule == rule
        except Exception:  # tensors as hyperparameters: no value comparison
            equal = g.rule is rule
        if equal:
            return g
    g = ParamGroup({}, [], copy.copy(rule), {})
    groups.append(g)
    return g


def initial_groups(params, policy) -> tuple[list, tuple | None]:
    """The groups of an optimizer's `params`, and a module's tree (see `RulePolicy.module_groups`)."""
    if isinstance(params, torch.Tensor):
        raise TypeError(  # torch.optim's words
            "params argument given to the optimizer should be an iterable of Tensors or dicts "
            f"(or a module), but got {torch.typename(params)}"
        )
    if isinstance(params, nn.Module):
        return policy.module_groups(params)
    if policy.rule is not None and not isinstance(policy.rule, Rule):
        raise TypeError("a rule function (path, x) -> Rule needs paths: pass the module itself as params")
    raw = list(params)
    if not raw:
        raise ValueError("optimizer got an empty parameter list")
    if not isinstance(raw[0], Mapping):
        raw = [{"params": raw}]
    return [policy.make(g, f"group {i}") for i, g in enumerate(raw)], None


def group_dict(params: list, names, *parts: Mapping) -> dict:
    """A group's dict: `"params"`, the entries of `parts` in order, and `"param_names"` if given."""
    entries = {"params": params}
    for part in parts:
        entries.update(part)
    if names is not None:
        entries["param_names"] = names
    return entries


class RulePolicy:
    """How `Optimizer(params, rule)` makes its groups (from its rule and keyword arguments) and
    syncs their entries into their rules (`Rule.adjust`)."""

    def __init__(self, optimizer):  # (made when used: see Optimizer._policy)
        self.rule, self.overrides = optimizer._base_rule, optimizer._overrides

    @staticmethod
    def check(rule) -> None:
        """Refuse what `Optimizer(params, rule)` cannot take as its rule."""
        if rule is not None and not (isinstance(rule, Rule) or callable(rule)):
            raise TypeError(
                "Optimizer expects an optimisers.Rule (e.g. optimisers.AdamW(1e-3)) as its rule, "
                f"got {rule!r}"
            )
        if isinstance(rule, type):
            check_rule(rule, "Optimizer")

    def module_groups(self, module) -> tuple[list[ParamGroup], tuple]:
        """Groups for a module: `setup` (paths, ties, rule functions) chooses each parameter's rule;
        those with equal rules form one group. Also returns `(the placeholders' tree, its keys,
        [(placeholder, tensor)])`, from which `optimiser_state` shows the module's tree."""
        if self.rule is None:
            check_rule(None, "Optimizer(module, rule)")
        choose = rule_chooser(self.rule)
        state = setup(lambda path, x: _Deferred(choose(path, x)), module)
        for leaf in state.leaves():
            leaf.rule = leaf.rule.rule
        groups: list[ParamGroup] = []
        names: dict[int, list] = {}
        pairs = []
        for path, p in trainables(module, path=True):
            leaf = state.tree
            for k in path:
                leaf = leaf[k]
            pairs.append((leaf, p))
            g = _group_with_rule(groups, leaf.rule)
            g.params.append(p)
            names.setdefault(id(g), []).append(format_path(path))
        if not groups:
            raise ValueError("the module has no trainable parameters (requires_grad=True)")
        for i, g in enumerate(groups):
            g.rule = adjusted_rule(g.rule, self.overrides, f"group {i}") if self.overrides else g.rule
            g.seen = group_entries(g.rule)
            g.entries = group_dict(g.params, names[id(g)], g.seen, adapter_entries(self.overrides))
            g.follow(g.params)
        return groups, (state.tree, state._keys, pairs)

    def make(self, group: Mapping, where: str) -> ParamGroup:
        """A group from torch.optim's group dict: its "rule" (else the optimizer's) adjusted by its
        entries and the optimizer's keyword arguments."""
        check_group_dict(group, where)
        rule = group.get("rule", self.rule if isinstance(self.rule, Rule) else None)
        if rule is None:
            raise TypeError(
                f"{where}: no rule; pass one, e.g. optimisers.torch.Optimizer(params, "
                "optimisers.AdamW(1e-3)), or use the class with torch.optim's signature, e.g. "
                "optimisers.torch.AdamW(params, lr=1e-3)"
            )
        check_rule(rule, f"{where}: 'rule'" if "rule" in group else where)
        params, names = group_tensors(group["params"], where)
        carried = adapter_entries({**self.overrides, **group})
        check_switches(carried, where)
        keys = {k: v for k, v in group.items() if k not in NOT_HYPERPARAMETERS and k not in carried}
        if "eta" in keys:  # the library's own name for the learning rate: stored as "lr"
            if "lr" in keys and not same_value(keys["lr"], keys["eta"]):
                raise ValueError(f"{where}: 'lr' and 'eta' give different learning rates")
            keys["lr"] = keys.pop("eta")
        keys = {k: v for k, v in {**self.overrides, **keys}.items() if k not in carried}
        rule = adjusted_rule(rule, keys, where)
        rule = copy.copy(rule)  # one rule object per group: adjusting one group leaves the others alone
        seen = group_entries(rule)
        return ParamGroup(group_dict(params, names, seen, carried), params, rule, seen)

    def defaults(self, groups) -> dict:
        return dict(groups[0].seen)

    def resync(self, g, changed: dict, where: str):  # group `g`'s rule, with the changed entries
        return adjusted_rule(g.rule, changed, where)

    def check_keys(self, g, i: int) -> None:
        """Refuse a key added to group `g` (number `i`) that sets nothing: a typo ("lamda") or
        torch's name would otherwise be ignored without a word."""
        for key in g.entries:
            if not (key in g.seen or key in NOT_HYPERPARAMETERS or key in CARRIED):
                hint = "its keys: " + ", ".join(repr(k) for k in g.seen)
                if key in TORCH_NAMES:
                    hint = f"this library calls it {TORCH_NAMES[key]!r}"
                raise ValueError(
                    f"param_groups[{i}] has key {key!r}, which {type(g.rule).__name__} does not take; {hint}"
                )

    def listed(self, params, where: str) -> list:  # an edited "params" list, checked as a new one
        return group_tensors(params, where)[0]

    def engine_view(self, p):  # what the update engine trains for parameter `p`
        return p

    def ready(self) -> bool:  # whether the step goes ahead
        return True

    def gradients(self, groups, grads: list) -> list:
        """The gradients by position, negated in groups with `maximize` (in a new list)."""
        maximized = [g for g in groups if g.entries.get("maximize")]
        if not maximized:
            return grads
        grads = list(grads)
        for g in maximized:
            for i in g.positions:
                if grads[i] is not None:
                    grads[i] = -grads[i]
        return grads
