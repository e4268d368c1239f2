"""`optimisers.torch.Optimizer`: any rule of this library as a `torch.optim.Optimizer`.

The adapter is a thin layer over the library's core. Each trained tensor has one `Leaf` (made by
`optimisers.setup`, so a module's ties, paths and per-parameter rule functions work as everywhere
else); a step hands the `.grad` fields to `optimisers.update_`; `param_groups` entries are synced
into the Leafs' rules (`Rule.adjust`) when they change; `state_dict` / `load_state_dict` are the
library's, keyed by parameter position as torch.optim does.

Imported only on demand (`optimisers.torch` or `import optimisers.torch`): `import optimisers`
never imports torch.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

from ._checkpoint import FORMAT, FORMAT_KEY, CheckpointError, _encode
from ._checkpoint import load_state_dict as _load_state_dict
from ._checkpoint import state_dict as _state_dict
from ._interface import setup, update_
from ._rule import Rule
from ._state import State
from ._tree import format_path

__all__ = ["Optimizer"]

# torch.optim's names for hyperparameters this library spells differently ("lr" and "betas" are
# accepted as they are; these get a hint instead of a bare "unknown key")
_TORCH_NAMES = {"weight_decay": "lambd", "eps": "epsilon", "momentum": "rho", "alpha": "rho"}
# what torch's lr schedulers keep in a group besides "lr"; carried along untouched
_SCHEDULER_KEYS = ("initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "swa_lr")
_MISSING = object()
_CARRIED = ("params", "param_names", "rule")  # group entries that are no hyperparameters


# --- hyperparameters as group entries -------------------------------------------------------------


def _value(rule, name):
    """Hyperparameter `name` of `rule`: its own field, else the first member rule's (a chain,
    MixedPrecision); `_MISSING` when no field holds it."""
    if not dataclasses.is_dataclass(rule):
        return _MISSING
    fields = dataclasses.fields(rule)
    for f in fields:
        if f.name == name and not isinstance(getattr(rule, name), Rule):
            return getattr(rule, name)
    for f in fields:
        held = getattr(rule, f.name)
        for sub in held if isinstance(held, tuple) else (held,):
            if isinstance(sub, Rule) and name in sub.hyperparameters():
                found = _value(sub, name)
                if found is not _MISSING:
                    return found
    return _MISSING


def _plain(v) -> bool:
    """A value a group dict may hold and `torch.load(weights_only=True)` reads back."""
    if isinstance(v, tuple):
        return all(_plain(e) for e in v)
    return v is None or isinstance(v, (bool, int, float, str, torch.Tensor))


def _entries(rule) -> dict:
    """The group entries that show `rule`'s hyperparameters: `"lr"` for `eta`, every other
    hyperparameter by its name, and `"betas"` beside a two-number `beta` (torch's name, which
    OneCycleLR and CyclicLR look for to cycle the momentum)."""
    out: dict = {}
    for name in rule.hyperparameters():
        v = _value(rule, name)
        if v is _MISSING or not _plain(v):
            continue
        out["lr" if name == "eta" else name] = v
        if name == "beta" and isinstance(v, tuple) and len(v) == 2:
            out["betas"] = v
    return out


def _rule_name(key: str) -> str:
    return {"lr": "eta", "betas": "beta"}.get(key, key)


def _same(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False  # a new tensor object is a change (comparing values would sync the device)
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _adjusted(rule, changes: dict, where: str):
    """`rule` with the group entries `changes` applied (`"lr"` -> `eta`, `"betas"` -> `beta`);
    errors name `where` and the key."""
    hyper: dict = {}
    for key, v in changes.items():
        name = _rule_name(key)
        if name in hyper and not _same(hyper[name], v):
            raise ValueError(f"{where}: {key!r} and {name!r} give different values ({v!r}, {hyper[name]!r})")
        hyper[name] = v
    names = rule.hyperparameters()
    for key in changes:
        if _rule_name(key) not in names:
            hint = f" (this library's name: {_TORCH_NAMES[key]!r})" if key in _TORCH_NAMES else ""
            raise ValueError(
                f"{where}: unknown key {key!r}{hint}; {type(rule).__name__} takes 'lr' and "
                f"{', '.join(repr(n) for n in names if n != 'eta') or 'nothing else'}"
            )
    try:
        return rule.adjust(**hyper)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: {e}") from None


# --- building groups ----------------------------------------------------------------------------


@dataclasses.dataclass
class _Group:
    """One param group as the adapter keeps it: its dict, its tensors and their Leafs (None for a
    tensor that can never be trained, e.g. an integer one), its rule, and the entries last synced."""

    entries: dict
    params: list
    leaves: list
    rule: Any
    seen: dict


def _check_rule(rule, where: str):
    if isinstance(rule, type) and issubclass(rule, Rule):
        raise TypeError(f"{where}: pass a rule instance, e.g. {rule.__name__}(), not the class")
    if not isinstance(rule, Rule):
        raise TypeError(f"{where}: expected an optimisers.Rule such as optimisers.AdamW(1e-3), got {rule!r}")


def _tensors(raw, where: str) -> tuple[list, list | None]:
    """The tensors of a group's "params" (and their names, if given as (name, tensor) pairs)."""
    if isinstance(raw, torch.Tensor):
        raw = [raw]
    elif isinstance(raw, nn.Module):
        raise TypeError(f"{where}: a module must be passed as the optimizer's params itself, not in a group")
    elif isinstance(raw, (set, frozenset)):
        raise TypeError(f"{where}: params must be an ordered collection (a list), not a set")
    params, names = [], []
    for item in raw:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            names.append(item[0])
            item = item[1]
        if not isinstance(item, torch.Tensor):
            raise TypeError(f"{where}: can only optimise tensors, got a {type(item).__name__}")
        if not (item.is_leaf or item.retains_grad):
            raise ValueError(f"{where}: cannot optimise a non-leaf tensor (one computed from others)")
        params.append(item)
    if names and len(names) != len(params):
        raise ValueError(f"{where}: give every parameter a name, or none")
    return params, (names or None)


def _setup_list(rule, params):
    """One Leaf per tensor, by `optimisers.setup` (which checks for tensors that overlap in memory).
    A frozen parameter is set up through a detached view: it may be unfrozen later."""
    model = [p.detach() if isinstance(p, nn.Parameter) and not p.requires_grad else p for p in params]
    tree = setup(rule, model).tree
    return [tree.get(i) if isinstance(tree, dict) else None for i in range(len(params))]


def _from_module(module, rule, overrides) -> tuple[list[_Group], State]:
    """Groups for a module: `setup` makes the Leafs (ties, paths, rule functions); parameters
    whose rules are equal form one group, which then shares one rule object."""
    from ._destructure import trainables

    state = setup(rule, module)
    groups: list[_Group] = []
    for path, p in trainables(module, path=True):
        leaf = state.tree
        for k in path:
            leaf = leaf[k]
        for g in groups:
            try:
                equal = g.rule == leaf.rule
            except Exception:  # tensors as hyperparameters: no value comparison
                equal = g.rule is leaf.rule
            if equal:
                break
        else:
            g = _Group({}, [], [], copy.copy(leaf.rule), {})
            groups.append(g)
        g.params.append(p)
        g.leaves.append(leaf)
        g.entries.setdefault("param_names", []).append(format_path(path))
    if not groups:
        raise ValueError("the module has no trainable parameters (requires_grad=True)")
    for i, g in enumerate(groups):
        rule = _adjusted(g.rule, overrides, f"group {i}") if overrides else g.rule
        for leaf in g.leaves:
            leaf.rule = rule
        g.rule = rule
        g.seen = _entries(rule)
        names = g.entries.pop("param_names")
        g.entries = {"params": g.params, **g.seen, "param_names": names}
    return groups, state


def _from_dict(group: Mapping, base, overrides: dict, where: str) -> _Group:
    if not isinstance(group, Mapping):
        raise TypeError(f"{where}: expected a dict with a 'params' entry, got a {type(group).__name__}")
    if "params" not in group:
        raise ValueError(f"{where}: has no 'params' entry")
    rule = group.get("rule", base)
    if rule is None:
        raise TypeError(
            f"{where}: no rule; pass one, e.g. optimisers.torch.Optimizer(params, optimisers.AdamW(1e-3)) "
            "(the adapter takes a rule, not torch.optim's keyword hyperparameters)"
        )
    _check_rule(rule, f"{where}: 'rule'" if "rule" in group else where)
    params, names = _tensors(group["params"], where)
    if not params:
        raise ValueError(f"{where}: its params are empty")
    carried = {k: v for k, v in group.items() if k in _SCHEDULER_KEYS}
    keys = {k: v for k, v in group.items() if k not in _CARRIED and k not in carried}
    if "eta" in keys:  # the library's own name for the learning rate: stored as "lr"
        if "lr" in keys and not _same(keys["lr"], keys["eta"]):
            raise ValueError(f"{where}: 'lr' and 'eta' give different learning rates")
        keys["lr"] = keys.pop("eta")
    rule = _adjusted(rule, {**overrides, **keys}, where)
    rule = copy.copy(rule)  # one rule object per group: adjusting one group leaves the others alone
    leaves = _setup_list(rule, params)
    seen = _entries(rule)
    entries = {"params": params, **seen, **carried}
    if names is not None:
        entries["param_names"] = names
    return _Group(entries, params, leaves, rule, seen)


# --- torch's per-parameter state, as a view ------------------------------------------------------


class _StateView(MutableMapping):
    """`optimizer.state` as torch code reads it: `state[p]` is parameter `p`'s entry of
    `state_dict()["state"]` (its rule as text, frozen flag, `"state/0"`, ...), built on each read;
    `state[p] = entry` loads such an entry into `p`'s Leaf, checked first (the kind of rule,
    shapes, dtypes), keeping the rule's current hyperparameters. ZeroRedundancyOptimizer restores
    its shards this way."""

    def __init__(self, optimizer):
        self._optimizer = optimizer

    def _leaf(self, p):
        found = self._optimizer._leaf_of.get(id(p))
        if found is None or found[0] is not p:
            raise KeyError(p)
        return found[1]

    def __getitem__(self, p):
        prefix = format_path(()) + "/"
        return {k.removeprefix(prefix): v for k, v in _state_dict(self._leaf(p)).items() if k != FORMAT_KEY}

    def __setitem__(self, p, entry):
        leaf = self._leaf(p)
        flat = {FORMAT_KEY: FORMAT, **{f"{format_path(())}/{k}": v for k, v in entry.items()}}
        try:
            new = _load_state_dict(leaf, flat, hyperparameters="state").tree
        except CheckpointError as e:
            where = f"parameter {self._optimizer._leaf_of[id(p)][2]}"
            raise CheckpointError(str(e).replace(format_path(()), where)) from None
        leaf.state, leaf.frozen = new.state, new.frozen
        leaf._owns = new._owns  # converted copies: the engine may keep them

    def __delitem__(self, p):
        raise TypeError("the optimiser state of a parameter cannot be deleted; load another one instead")

    def __iter__(self):
        return (found[0] for found in self._optimizer._leaf_of.values())

    def __len__(self):
        return len(self._optimizer._leaf_of)

    def __repr__(self):
        return f"<optimiser state of {len(self)} parameters>"


# --- the optimizer ------------------------------------------------------------------------------


class Optimizer(torch.optim.Optimizer):
    """A `torch.optim.Optimizer` that trains with any rule of this library.

        opt = optimisers.torch.Optimizer(model, optimisers.AdamW(1e-3, lambd=0.01))
        loss.backward(); opt.step(); opt.zero_grad()

    `params` is what torch.optim takes (an iterable of tensors, of `(name, tensor)` pairs, or of
    group dicts) or an `nn.Module`. A module is set up by `optimisers.setup`: a tied parameter
    has one state, and `rule` may be a function `(path, x) -> Rule`; parameters whose rules are
    equal share one param group. In a group dict, `"lr"` sets the rule's learning rate `eta`,
    `"betas"` its `beta`, `"rule"` gives that group its own rule, and any other key sets the
    hyperparameter of that name (`"lambd"`, `"epsilon"`, ...). Keyword arguments set entries of
    every group.

    Each group dict holds `"lr"` and the rule's other hyperparameters by name; a change to them
    (by a scheduler or by hand) takes effect at the next `step()` and keeps the optimiser state.
    Parameters without a `.grad` are skipped (their state does not advance). `state_dict()` holds
    only tensors, numbers, text, lists and dicts (it survives `torch.load(weights_only=True)`),
    and a run resumed from it continues bit for bit. The library's `State` is
    `optimiser_state`; torch's per-parameter `state[p]` is a view: `p`'s entry of
    `state_dict()["state"]`, built when read, loaded into `p`'s Leaf when assigned.
    """

    def __init__(self, params, rule=None, **hyperparameters):
        if rule is not None and not (isinstance(rule, Rule) or callable(rule)):
            raise TypeError(
                f"Optimizer expects an optimisers.Rule (e.g. optimisers.AdamW(1e-3)) as its rule, "
                f"got {rule!r}"
            )
        if isinstance(rule, type):
            _check_rule(rule, "Optimizer")
        self._groups: list[_Group] = []
        self._overrides = dict(hyperparameters)
        self._base_rule = rule
        self._flat = State({})  # global parameter position -> Leaf: what update_ steps
        self._leaf_of: dict[int, tuple] = {}  # id(tensor) -> (tensor, Leaf, position)
        self._model: dict = {}  # global parameter position -> tensor
        self.optimiser_state: State = self._flat
        if isinstance(params, torch.Tensor):
            raise TypeError("params should be an iterable of tensors or dicts, or a module; got a tensor")
        if isinstance(params, nn.Module):
            if rule is None:
                _check_rule(None, "Optimizer(module, rule)")
            groups, self.optimiser_state = _from_module(params, rule, self._overrides)
        else:
            if rule is not None and not isinstance(rule, Rule):
                raise TypeError(
                    "a rule function (path, x) -> Rule needs paths: pass the module itself as params"
                )
            raw = list(params)
            if not raw:
                raise ValueError("optimizer got an empty parameter list")
            if not isinstance(raw[0], Mapping):
                raw = [{"params": raw}]
            groups = [_from_dict(g, rule, self._overrides, f"group {i}") for i, g in enumerate(raw)]
        self._check_distinct(groups)
        self._pending = {id(g.entries): g for g in groups}
        defaults = dict(groups[0].seen)
        super().__init__([g.entries for g in groups], defaults)
        self.state = _StateView(self)
        del self._pending

    # --- groups -----------------------------------------------------------------------------------

    def _check_distinct(self, new: list[_Group]):
        where: dict[int, str] = {}
        for i, g in enumerate(self._groups + new):
            for j, p in enumerate(g.params):
                here = f"group {i}, parameter {j}"
                if id(p) in where:
                    raise ValueError(
                        f"{here} is the same tensor as {where[id(p)]}; a parameter may appear once "
                        "(a tied weight is one tensor: list it once)"
                    )
                where[id(p)] = here

    def add_param_group(self, param_group: dict) -> None:
        """Add a group of parameters, as torch.optim does: a dict with "params" and optionally
        "rule", "lr" and other hyperparameters (the optimizer's rule and keyword arguments give
        the rest). A failed call changes nothing."""
        g = getattr(self, "_pending", {}).get(id(param_group))
        if g is None:
            g = _from_dict(
                param_group,
                self._base_rule if isinstance(self._base_rule, Rule) else None,
                self._overrides,
                f"group {len(self.param_groups)}",
            )
            self._check_distinct([g])
        start = len(self._model)
        for j, (p, leaf) in enumerate(zip(g.params, g.leaves)):
            self._model[start + j] = p
            if leaf is not None:
                self._flat.tree[start + j] = leaf
                self._leaf_of[id(p)] = (p, leaf, start + j)
        self._flat._plan = None
        self._groups.append(g)
        self.param_groups.append(g.entries)

    # --- a step -----------------------------------------------------------------------------------

    def _sync(self):
        """Apply changed group entries to the rules; returns what to restore if the step fails."""
        plans = []
        for i, (entries, g) in enumerate(zip(self.param_groups, self._groups)):
            if entries is not g.entries:  # the list entry was replaced by a new dict
                g.entries = entries
            changed = {}
            for key, old in g.seen.items():
                if key not in entries:
                    raise KeyError(f"param_groups[{i}] lost its {key!r} entry")
                if not _same(entries[key], old):
                    changed[key] = entries[key]
            for key in entries:
                if key in g.seen or key in _CARRIED or key in _SCHEDULER_KEYS:
                    continue
                # a key added since construction that no rule field has: a typo ("lamda") or
                # torch's name would otherwise be ignored without a word
                if key in _TORCH_NAMES:
                    hint = f"this library calls it {_TORCH_NAMES[key]!r}"
                else:
                    hint = "its keys: " + ", ".join(repr(k) for k in g.seen)
                raise ValueError(
                    f"param_groups[{i}] has key {key!r}, which {type(g.rule).__name__} does not "
                    f"take; {hint}"
                )
            if changed:
                plans.append((g, changed, _adjusted(g.rule, changed, f"param_groups[{i}]")))
        undo = []
        for g, changed, rule in plans:
            undo.append((g, g.rule, dict(g.seen), {k: g.entries.get(k, _MISSING) for k in ("beta", "betas")}))
            for leaf in g.leaves:
                if leaf is not None:
                    leaf.rule = rule
            g.rule = rule
            g.seen.update(changed)
            if "beta" in g.seen and ("beta" in changed or "betas" in changed):  # keep the two names equal
                beta = changed.get("beta", changed.get("betas"))
                for k in ("beta", "betas"):
                    if k in g.seen:
                        g.entries[k] = g.seen[k] = beta
        return undo

    @staticmethod
    def _undo(undo):
        for g, rule, seen, betas in undo:
            for leaf in g.leaves:
                if leaf is not None:
                    leaf.rule = rule
            g.rule, g.seen = rule, seen
            for k, v in betas.items():
                if v is not _MISSING:
                    g.entries[k] = v

    def step(self, closure=None):
        """One optimisation step on every parameter that has a `.grad`. `closure`, if given,
        re-evaluates the model and returns the loss (run with gradients enabled); its result is
        returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        undo = self._sync()
        try:
            model, grads = self._model, {}
            for i, p in model.items():
                if type(p) is not torch.Tensor and not p.requires_grad and isinstance(p, nn.Parameter):
                    # frozen by the user after setup: stepped through a view if it has a .grad
                    model = dict(model) if model is self._model else model
                    model[i] = p.detach()
                g = p.grad
                if g is not None:
                    grads[i] = g
            if grads:
                update_(self._flat, model, grads)
        except BaseException:
            self._undo(undo)
            raise
        return loss

    def train(self):
        """For trainers that call it (rules here have no train/eval modes): does nothing."""

    def eval(self):
        """For trainers that call it (rules here have no train/eval modes): does nothing."""

    # --- checkpoints --------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """`{"state": {position: {...}}, "param_groups": [...]}` as torch.optim has it: parameters
        numbered by their position in `param_groups`, each with its rule (as text), frozen flag and
        state entries (`"state/0"`, ...) from `optimisers.state_dict`. Holds the state's own
        tensors (not copies), as torch.optim does."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        flat = _state_dict(self._flat)
        state: dict[int, dict] = {}
        for key, value in flat.items():
            if key == FORMAT_KEY:
                continue
            position, _, rest = key.partition("/")
            state.setdefault(int(position), {})[rest] = value
        groups, start = [], 0
        for entries in self.param_groups:
            saved = {
                k: (_encode(v) if isinstance(v, Rule) else v) for k, v in entries.items() if k != "params"
            }
            saved["params"] = list(range(start, start + len(entries["params"])))
            start += len(entries["params"])
            groups.append(saved)
        out = {"state": state, "param_groups": groups}
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, out)
            if result is not None:
                out = result
        return out

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Restore what `state_dict()` gave, into an optimizer over the same parameters: checked
        in full first (groups, sizes, rules, shapes, dtypes; a `CheckpointError` lists every
        difference), then loaded; tensors take the dtype and device of this optimizer's state."""
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
            raise CheckpointError(
                "expected the dict from Optimizer.state_dict(), with 'state' and 'param_groups'"
            )
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise CheckpointError(
                f"the checkpoint has {len(saved_groups)} param groups, this optimizer "
                f"{len(self.param_groups)}"
            )
        for i, (saved, entries) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(entries["params"]):
                raise CheckpointError(
                    f"group {i} has {len(saved['params'])} parameters in the checkpoint, "
                    f"{len(entries['params'])} here"
                )
        flat: dict[str, Any] = {FORMAT_KEY: FORMAT}
        for position, entries in state_dict["state"].items():
            if not isinstance(entries, Mapping) or "rule" not in entries:
                some = ", ".join(map(repr, list(entries)[:4])) if isinstance(entries, Mapping) else ""
                raise CheckpointError(
                    f"parameter {position} has no 'rule' entry (it has {some or 'nothing'}); "
                    "is this a torch.optim optimizer's state dict? Only optimisers.torch.Optimizer's "
                    "loads here"
                )
            for key, value in entries.items():
                flat[f"{position}/{key}"] = value
        loaded = _load_state_dict(self._flat, flat)  # checks everything; changes nothing
        new_groups = []
        for saved, entries in zip(saved_groups, self.param_groups):
            group = {k: v for k, v in saved.items() if k not in ("params", "rule")}
            for k in ("params", "param_names", "rule"):
                if k in entries:
                    group[k] = entries[k]
            new_groups.append(group)
        for position, leaf in self._flat.tree.items():
            new = loaded.tree[position]
            leaf.rule, leaf.state, leaf.frozen = new.rule, new.state, new.frozen
            leaf._owns = new._owns
        for g, entries in zip(self._groups, new_groups):
            g.entries = entries
            rule = next((leaf.rule for leaf in g.leaves if leaf is not None), g.rule)
            g.rule, g.seen = rule, _entries(rule)
        self.param_groups[:] = new_groups
        self._flat._plan = None
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def __getstate__(self):
        d = super().__getstate__()
        d.update(
            {k: v for k, v in self.__dict__.items() if k.startswith("_") and k not in d and "hook" not in k}
        )
        d["optimiser_state"] = self.optimiser_state
        return d
