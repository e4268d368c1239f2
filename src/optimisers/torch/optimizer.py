"""`optimisers.torch.Optimizer`: any rule of this library as a `torch.optim.Optimizer`; and
torch.optim's classes by name (`optimisers.torch.AdamW`, `SGD`, ...), defined in `_torch_dropins`
on top of it.

The adapter is a thin layer over the library's core. Each trained tensor has one `Leaf` (made by
`optimisers.setup`, so a module's ties, paths and per-parameter rule functions work as everywhere
else); a step hands the `.grad` fields to `optimisers.update_`; `param_groups` entries are synced
into the Leafs' rules (`Rule.adjust`) when they change; `state_dict` / `load_state_dict` are the
library's, keyed by parameter position as torch.optim does. As in torch.optim, a parameter's
state is made at its first gradient (its Leaf is set up without state until then).

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

from optimisers.checkpoints.state_dict import FORMAT, FORMAT_KEY, CheckpointError, _encode
from optimisers.checkpoints.state_dict import load_state_dict as _load_state_dict
from optimisers.checkpoints.state_dict import state_dict as _state_dict
from optimisers.core.rule import Rule
from optimisers.core.state import Leaf, State
from optimisers.core.tree import format_path
from optimisers.verbs.setup import setup
from optimisers.verbs.update import update_

__all__ = ["Optimizer"]

# torch.optim's names for hyperparameters this library spells differently: where the rule has the
# field they mean the same, a group shows both names, kept equal (as "beta" and "betas")
_ALIASES = {"beta": "betas", "lambd": "weight_decay", "epsilon": "eps"}
# torch's names that get a hint instead of a bare "unknown key" (the maths differs: torch's
# momentum keeps the learning rate out of the velocity)
_TORCH_NAMES = {"weight_decay": "lambd", "eps": "epsilon", "momentum": "rho", "alpha": "rho"}
# torch.optim's implementation switches: accepted and carried (this adapter has one engine);
# "capturable" and "differentiable" ask for what it does not do, so True is refused
_SWITCHES = ("foreach", "fused", "capturable", "differentiable")
_ADAPTER_KEYS = ("maximize",) + _SWITCHES
# what torch's lr schedulers keep in a group besides "lr"; carried along untouched
_SCHEDULER_KEYS = ("initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "swa_lr")
_MISSING = object()
_CARRIED = ("params", "param_names", "rule")  # group entries that are no hyperparameters


def _check_switches(entries: Mapping, where: str) -> None:
    for key in ("capturable", "differentiable"):
        if entries.get(key):
            raise ValueError(
                f"{where}: {key}=True is not supported (the update runs outside autograd and outside "
                "CUDA graph capture); leave it False"
            )


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
        alias = _ALIASES.get(name)
        if alias is not None and (name != "beta" or (isinstance(v, tuple) and len(v) == 2)):
            out[alias] = v
    return out


_RULE_NAMES = {"lr": "eta", **{torch_name: name for name, torch_name in _ALIASES.items()}}


def _rule_name(key: str) -> str:
    return _RULE_NAMES.get(key, key)


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
    """`rule` with the group entries `changes` applied (`"lr"` -> `eta`, and torch's `"betas"`,
    `"weight_decay"`, `"eps"` -> `beta`, `lambd`, `epsilon`); errors name `where` and the key."""
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
            if key in _ALIASES.values():
                hint = f" (torch's name for {_rule_name(key)!r}, which this rule does not have)"
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
    has_complex: bool = False  # a drop-in class trains complex parameters as real views


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


@dataclasses.dataclass(frozen=True)
class _Deferred(Rule):
    """Stands in for a parameter's rule while `setup` walks the model: no state yet. Like
    torch.optim, the adapter makes a parameter's state at its first gradient, so a frozen
    backbone or a parameter that never gets a gradient costs no memory."""

    rule: Any = None

    def init(self, x):
        return None


def _lazy_setup(rule, model) -> State:
    """`optimisers.setup` (paths, ties, rule functions, the check for tensors that overlap in
    memory) with each Leaf's rule chosen but its state not made."""
    from optimisers.verbs.setup import rule_chooser as _rule_chooser

    choose = _rule_chooser(rule)
    state = setup(lambda path, x: _Deferred(choose(path, x)), model)
    for leaf in state.leaves():
        leaf.rule = leaf.rule.rule
    return state


def _setup_list(rule, params):
    """One Leaf per tensor, state not made yet. A frozen parameter is set up through a detached
    view: it may be unfrozen later."""
    model = [p.detach() if isinstance(p, nn.Parameter) and not p.requires_grad else p for p in params]
    tree = _lazy_setup(rule, model).tree
    return [tree.get(i) if isinstance(tree, dict) else None for i in range(len(params))]


def _from_module(module, rule, overrides) -> tuple[list[_Group], State]:
    """Groups for a module: `setup` makes the Leafs (ties, paths, rule functions); parameters
    whose rules are equal form one group, which then shares one rule object."""
    from optimisers.verbs.destructure import trainables

    state = _lazy_setup(rule, module)
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
        g.entries = {"params": g.params, **g.seen, **_adapter_keys(overrides), "param_names": names}
    return groups, state


def _adapter_keys(group: Mapping) -> dict:
    """The entries the adapter itself acts on ("maximize") or carries (torch's switches and what
    schedulers add)."""
    return {k: v for k, v in group.items() if k in _SCHEDULER_KEYS or k in _ADAPTER_KEYS}


def _from_dict(group: Mapping, base, overrides: dict, where: str) -> _Group:
    if not isinstance(group, Mapping):
        raise TypeError(f"{where}: expected a dict with a 'params' entry, got a {type(group).__name__}")
    if "params" not in group:
        raise ValueError(f"{where}: has no 'params' entry")
    rule = group.get("rule", base)
    if rule is None:
        raise TypeError(
            f"{where}: no rule; pass one, e.g. optimisers.torch.Optimizer(params, optimisers.AdamW(1e-3)), "
            "or use the class with torch.optim's signature, e.g. optimisers.torch.AdamW(params, lr=1e-3)"
        )
    _check_rule(rule, f"{where}: 'rule'" if "rule" in group else where)
    params, names = _tensors(group["params"], where)
    if not params:
        raise ValueError(f"{where}: its params are empty")
    carried = _adapter_keys({**overrides, **group})
    _check_switches(carried, where)
    keys = {k: v for k, v in group.items() if k not in _CARRIED and k not in carried}
    if "eta" in keys:  # the library's own name for the learning rate: stored as "lr"
        if "lr" in keys and not _same(keys["lr"], keys["eta"]):
            raise ValueError(f"{where}: 'lr' and 'eta' give different learning rates")
        keys["lr"] = keys.pop("eta")
    rule = _adjusted(rule, {k: v for k, v in {**overrides, **keys}.items() if k not in carried}, where)
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
    `state_dict()["state"]`, built on each read (an empty dict for a parameter that has had no
    gradient yet, as torch's lazy state gives); `state[p] = entry` loads such an entry into
    `p`'s Leaf, checked first, keeping the current hyperparameters (ZeroRedundancyOptimizer
    restores its shards this way); `del state[p]` and `state.clear()` drop state, which is made
    afresh at the next gradient, as in torch."""

    def __init__(self, optimizer):
        self._optimizer = optimizer

    def _position(self, p) -> int:
        found = self._optimizer._leaf_of.get(id(p))
        if found is None or found[0] is not p:
            raise KeyError(p)
        return found[2]

    def __getitem__(self, p):
        position = self._position(p)
        leaf = self._optimizer._flat.tree.get(position)
        return {} if leaf is None else self._optimizer._entry(position, leaf)

    def __setitem__(self, p, entry):
        self._optimizer._load_entry(self._position(p), entry)

    def __delitem__(self, p):
        position = self._position(p)
        if position not in self._optimizer._flat.tree:
            raise KeyError(p)
        self._optimizer._forget([position])

    def __contains__(self, p) -> bool:
        try:
            return self._position(p) in self._optimizer._flat.tree
        except KeyError:
            return False

    def clear(self) -> None:
        self._optimizer._forget(list(self._optimizer._flat.tree))

    def __iter__(self):
        model = self._optimizer._model
        return (model[position] for position in list(self._optimizer._flat.tree))

    def __len__(self):
        return len(self._optimizer._flat.tree)

    def __repr__(self):
        return f"<optimiser state of {len(self)} parameters>"


def _prune(node, ready: set):
    """The part of a state tree whose Leafs have state (tied places keep their shared Leaf)."""
    if isinstance(node, Leaf):
        return node if id(node) in ready else None
    out = {}
    for k, child in node.items():
        sub = _prune(child, ready)
        if sub is not None:
            out[k] = sub
    return out or None


# --- the optimizer ------------------------------------------------------------------------------


class Optimizer(torch.optim.Optimizer):
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
        self._flat = State({})  # position -> Leaf, for parameters with state: what update_ steps
        self._live: dict = {}  # position -> tensor, for the same parameters: the model update_ sees
        self._leaf_of: dict[int, tuple] = {}  # id(tensor) -> (tensor, Leaf, position)
        self._leaf_at: dict[int, Leaf] = {}  # position -> Leaf (with state or not yet)
        self._model: dict = {}  # position -> tensor, every parameter
        self._trained: list = []  # (position, tensor) of every parameter a rule can train
        self._module_tree = None  # a module's whole state tree (Leafs without state included)
        self.optimiser_state: State = self._flat
        if isinstance(params, torch.Tensor):
            raise TypeError("params should be an iterable of tensors or dicts, or a module; got a tensor")
        if isinstance(params, nn.Module):
            groups = self._groups_of_module(params, rule)
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
            groups = [self._make_group(g, f"group {i}") for i, g in enumerate(raw)]
        self._check_distinct(groups)
        self._pending = {id(g.entries): g for g in groups}
        super().__init__([g.entries for g in groups], self._defaults(groups))
        del self._pending

    # --- what a subclass with torch.optim's signature changes ---------------------------------------

    def _groups_of_module(self, module, rule) -> list[_Group]:
        if rule is None:
            _check_rule(None, "Optimizer(module, rule)")
        groups, state = _from_module(module, rule, self._overrides)
        self._module_tree = state.tree
        self.optimiser_state = State({}, state._keys)
        return groups

    def _make_group(self, group, where: str) -> _Group:
        base = self._base_rule if isinstance(self._base_rule, Rule) else None
        return _from_dict(group, base, self._overrides, where)

    def _defaults(self, groups) -> dict:
        return dict(groups[0].seen)

    def _resync(self, g: _Group, changed: dict, where: str):
        """The rule of group `g` with the changed entries applied."""
        return _adjusted(g.rule, changed, where)

    def _unknown_key(self, g: _Group, key: str, i: int) -> Exception:
        # a key added since construction that no rule field has: a typo ("lamda") or torch's
        # name would otherwise be ignored without a word
        if key in _TORCH_NAMES:
            hint = f"this library calls it {_TORCH_NAMES[key]!r}"
        else:
            hint = "its keys: " + ", ".join(repr(k) for k in g.seen)
        return ValueError(
            f"param_groups[{i}] has key {key!r}, which {type(g.rule).__name__} does not take; {hint}"
        )

    def _engine_view(self, p):
        """What the update engine trains for parameter `p`."""
        return p

    def _gradients(self, grads: dict) -> dict:
        """The gradients the rules see: negated in groups with `maximize`."""
        start = 0
        for g in self._groups:
            if g.entries.get("maximize"):
                for position in range(start, start + len(g.params)):
                    if position in grads:
                        grads[position] = -grads[position]
            start += len(g.params)
        return grads

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
            g = self._make_group(param_group, f"group {len(self.param_groups)}")
            self._check_distinct([g])
        start = len(self._model)
        for j, (p, leaf) in enumerate(zip(g.params, g.leaves)):
            self._model[start + j] = p
            if leaf is not None:
                self._leaf_at[start + j] = leaf
                self._leaf_of[id(p)] = (p, leaf, start + j)
                self._trained.append((start + j, p))
        self._groups.append(g)
        self.param_groups.append(g.entries)

    # --- state made at the first gradient ----------------------------------------------------------

    @property
    def state(self):
        """torch's per-parameter state: `state[p]` for parameter `p` (see `_StateView`)."""
        return _StateView(self)

    @state.setter
    def state(self, value):
        # torch.optim.Optimizer.__init__ assigns an empty dict; code that resets the state
        # assigns one too: both mean "no state", made afresh at the next gradient
        if isinstance(value, _StateView) and value._optimizer is self:
            return
        if not isinstance(value, Mapping):
            raise TypeError(
                f"optimizer.state must be a mapping from parameter to state, got {type(value).__name__}"
            )
        if getattr(self, "_leaf_of", None) is None:  # during torch's __init__
            return
        entries = list(value.items())
        self._forget(list(self._flat.tree))
        for p, entry in entries:
            self.state[p] = entry

    def _ready(self, positions) -> None:
        """Positions whose Leafs just got state join what update_ steps, in position order."""
        for position in positions:
            self._flat.tree[position] = self._leaf_at[position]
            self._live[position] = self._engine_view(self._model[position])
        self._flat.tree = dict(sorted(self._flat.tree.items()))
        self._live = dict(sorted(self._live.items()))
        self._changed()

    def _initialise(self, grads: dict) -> list[int]:
        """Make the state of parameters that have their first gradient; returns their positions."""
        born = [i for i in grads if i not in self._flat.tree]
        if not born:
            return born
        with torch.no_grad():
            for i in born:
                leaf = self._leaf_at[i]
                leaf.state = leaf.rule.init(self._engine_view(self._model[i]))
                leaf._owns = True  # fresh arrays: the engine keeps them as its buffers, no copy
        self._ready(born)
        return born

    def _forget(self, positions) -> None:
        """Drop the state of these parameters: it is made afresh at their next gradient."""
        for position in positions:
            self._flat.tree.pop(position, None)
            self._live.pop(position, None)
            leaf = self._leaf_at[position]
            leaf.state = None
        self._changed()

    def _changed(self) -> None:
        self._flat._plan = None
        if self._module_tree is not None:
            ready = {id(leaf) for leaf in self._flat.tree.values()}
            self.optimiser_state.tree = _prune(self._module_tree, ready) or {}
            self.optimiser_state._plan = None

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
                if key in g.seen or key in _CARRIED or key in _SCHEDULER_KEYS or key in _ADAPTER_KEYS:
                    continue
                raise self._unknown_key(g, key, i)
            _check_switches(entries, f"param_groups[{i}]")
            if changed:
                plans.append((g, changed, self._resync(g, changed, f"param_groups[{i}]")))
        undo = []
        for g, changed, rule in plans:
            aliases = {k: g.entries.get(k, _MISSING) for pair in _ALIASES.items() for k in pair}
            undo.append((g, g.rule, dict(g.seen), aliases))
            for leaf in g.leaves:
                if leaf is not None:
                    leaf.rule = rule
            g.rule = rule
            g.seen.update(changed)
            for name, alias in _ALIASES.items():  # keep the two names equal
                if name in g.seen and alias in g.seen and (name in changed or alias in changed):
                    value = changed.get(name, changed.get(alias))
                    g.entries[name] = g.entries[alias] = g.seen[name] = g.seen[alias] = value
        return undo

    @staticmethod
    def _undo(undo):
        for g, rule, seen, aliases in undo:
            for leaf in g.leaves:
                if leaf is not None:
                    leaf.rule = rule
            g.rule, g.seen = rule, seen
            for k, v in aliases.items():
                if v is not _MISSING:
                    g.entries[k] = v

    def step(self, closure=None):
        """One optimisation step on every parameter that has a `.grad` (a parameter's first
        gradient makes its state). `closure`, if given, re-evaluates the model and returns the
        loss (run with gradients enabled); its result is returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        _eager_step(self)
        return loss

    def _step(self):
        undo = self._sync()
        born: list[int] = []
        try:
            grads = {i: g for i, p in self._trained if (g := p.grad) is not None}
            if grads:
                grads = self._gradients(grads)
                born = self._initialise(grads)
                model = self._live
                frozen = [i for i, p in model.items() if not p.requires_grad and isinstance(p, nn.Parameter)]
                if frozen:  # frozen by the user after its state was made: stepped through a view
                    model = {**model, **{i: model[i].detach() for i in frozen}}
                update_(self._flat, model, grads)
        except BaseException:
            if born:
                self._forget(born)
            self._undo(undo)
            raise

    def train(self):
        """For trainers that call it (rules here have no train/eval modes): does nothing."""

    def eval(self):
        """For trainers that call it (rules here have no train/eval modes): does nothing."""

    # --- checkpoints --------------------------------------------------------------------------------

    def _entry(self, position: int, leaf) -> dict:
        """Parameter `position`'s entry of `state_dict()["state"]`."""
        prefix = format_path(()) + "/"
        return {k.removeprefix(prefix): v for k, v in _state_dict(leaf).items() if k != FORMAT_KEY}

    def _template(self, position: int):
        """A Leaf with state shaped as `position`'s will be, for a checkpoint to load into."""
        leaf = self._leaf_at[position]
        if position in self._flat.tree:
            return leaf
        with torch.no_grad():
            return leaf._successor(leaf.rule, leaf.rule.init(self._engine_view(self._model[position])))

    def _load_entry(self, position: int, entry: Mapping) -> None:
        flat = {FORMAT_KEY: FORMAT, **{f"{format_path(())}/{k}": v for k, v in entry.items()}}
        try:
            new = _load_state_dict(self._template(position), flat, hyperparameters="state").tree
        except CheckpointError as e:
            raise CheckpointError(str(e).replace(format_path(()), f"parameter {position}")) from None
        leaf = self._leaf_at[position]
        leaf.state, leaf.frozen = new.state, new.frozen
        leaf._owns = new._owns  # converted copies: the engine may keep them
        if position not in self._flat.tree:
            self._ready([position])

    def state_dict(self) -> dict:
        """`{"state": {position: {...}}, "param_groups": [...]}` as torch.optim has it: parameters
        numbered by their position in `param_groups`, each parameter that has state with its rule
        (as text), frozen flag and state entries (`"state/0"`, ...) from `optimisers.state_dict`.
        Holds the state's own tensors (not copies), as torch.optim does."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        state = {position: self._entry(position, leaf) for position, leaf in self._flat.tree.items()}
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

    def _check_groups(self, saved_groups) -> None:
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

    def _checkpoint_positions(self, state: Mapping) -> list[int]:
        positions = []
        for position in state:
            if not isinstance(position, int) or position not in self._leaf_at:
                raise CheckpointError(
                    f"the checkpoint has state for parameter {position!r}, but this optimizer's "
                    f"parameters are numbered 0 to {len(self._model) - 1}"
                )
            positions.append(position)
        return positions

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Restore what `state_dict()` gave, into an optimizer over the same parameters: checked
        in full first (groups, sizes, rules, shapes, dtypes; a `CheckpointError` lists every
        difference), then loaded; tensors take the dtype and device of this optimizer's state.
        Parameters without state in the checkpoint have none after it, as in torch.optim."""
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
            raise CheckpointError(
                "expected the dict from Optimizer.state_dict(), with 'state' and 'param_groups'"
            )
        saved_groups = state_dict["param_groups"]
        self._check_groups(saved_groups)
        flat: dict[str, Any] = {FORMAT_KEY: FORMAT}
        for position, entries in state_dict["state"].items():
            if not isinstance(entries, Mapping) or "rule" not in entries:
                some = ", ".join(map(repr, list(entries)[:4])) if isinstance(entries, Mapping) else ""
                raise CheckpointError(
                    f"parameter {position} has no 'rule' entry (it has {some or 'nothing'}); "
                    "is this a torch.optim optimizer's state dict? It loads into the class of "
                    "optimisers.torch with torch.optim's name (optimisers.torch.AdamW, ...), not "
                    "into Optimizer(params, rule)"
                )
            for key, value in entries.items():
                flat[f"{position}/{key}"] = value
        positions = self._checkpoint_positions(state_dict["state"])
        template = State({position: self._template(position) for position in sorted(positions)})
        loaded = _load_state_dict(template, flat)  # checks everything; changes nothing
        new_groups = []
        for saved, entries in zip(saved_groups, self.param_groups):
            group = {k: v for k, v in saved.items() if k not in ("params", "rule")}
            for k in ("params", "param_names", "rule"):
                if k in entries:
                    group[k] = entries[k]
            new_groups.append(group)
        self._forget([p for p in self._flat.tree if p not in loaded.tree])
        for position, new in loaded.tree.items():
            leaf = self._leaf_at[position]
            leaf.rule, leaf.state, leaf.frozen = new.rule, new.state, new.frozen
            leaf._owns = new._owns
        self._ready([p for p in loaded.tree if p not in self._flat.tree])
        for g, entries in zip(self._groups, new_groups):
            g.entries = entries
            ready = {id(leaf) for leaf in self._flat.tree.values()}
            rule = next((leaf.rule for leaf in g.leaves if leaf is not None and id(leaf) in ready), g.rule)
            for leaf in g.leaves:
                if leaf is not None:
                    leaf.rule = rule
            g.rule, g.seen = rule, _entries(rule)
        self.param_groups[:] = new_groups
        self._changed()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def __getstate__(self):
        d = super().__getstate__()
        d.pop("state", None)
        d.update(
            {k: v for k, v in self.__dict__.items() if k.startswith("_") and k not in d and "hook" not in k}
        )
        d["optimiser_state"] = self.optimiser_state
        return d

    def __setstate__(self, state):
        super().__setstate__(state)
        # a copy (deepcopy, pickle) holds new tensors: find each one's Leaf by its new identity
        self._leaf_of = {id(self._model[i]): (self._model[i], leaf, i) for i, leaf in self._leaf_at.items()}
        self._live = {i: self._engine_view(self._model[i]) for i in self._flat.tree}
        self._flat._plan = None


# Under torch.compile the step runs eagerly, as the library's update does (see optimisers.core.eager):
# its Python bookkeeping (group entries, state made at a first gradient) traced by dynamo would
# become guards that fail from one step to the next.
@torch.compiler.disable(recursive=True)
def _eager_step(optimizer: Optimizer) -> None:
    optimizer._step()

