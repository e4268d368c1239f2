"""A param group's keys against a rule's hyperparameters: the names torch.optim and this library
each use, the group entries that show a rule, and the rule that changed entries ask for."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from optimisers.core.rule import Rule

# torch.optim's names for hyperparameters this library spells differently: where the rule has the
# field they mean the same, a group shows both names, kept equal (as "beta" and "betas")
ALIASES = {"beta": "betas", "lambd": "weight_decay", "epsilon": "eps"}
# torch's names that get a hint instead of a bare "unknown key" (the maths differs: torch's
# momentum keeps the learning rate out of the velocity)
TORCH_NAMES = {"weight_decay": "lambd", "eps": "epsilon", "momentum": "rho", "alpha": "rho"}
# torch.optim's implementation switches: accepted and carried (this adapter has one engine);
# "capturable" and "differentiable" ask for what it does not do, so True is refused
SWITCHES = ("foreach", "fused", "capturable", "differentiable")
ADAPTER_KEYS = ("maximize",) + SWITCHES
# what torch's lr schedulers keep in a group besides "lr"; carried along untouched
SCHEDULER_KEYS = ("initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "swa_lr")
NOT_HYPERPARAMETERS = ("params", "param_names", "rule")  # group entries that set no rule field
MISSING = object()

# group key -> the rule's field: "lr" is `eta`, and torch's aliases name the library's fields
_RULE_NAMES = {"lr": "eta", **{torch_name: name for name, torch_name in ALIASES.items()}}


def rule_name(key: str) -> str:
    """The rule field that group key `key` sets."""
    return _RULE_NAMES.get(key, key)


def is_adapter_key(key: str) -> bool:
    """A key the adapter acts on ("maximize") or carries (torch's switches, schedulers' keys)."""
    return key in ADAPTER_KEYS or key in SCHEDULER_KEYS


def adapter_entries(group: Mapping) -> dict:
    """The entries of `group` that set no rule field but stay in the group (see `is_adapter_key`)."""
    return {k: v for k, v in group.items() if is_adapter_key(k)}


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
    """`rule` with the group entries `changes` applied (`"lr"` -> `eta`, and torch's `"betas"`,
    `"weight_decay"`, `"eps"` -> `beta`, `lambd`, `epsilon`); errors name `where` and the key."""
    hyper: dict = {}
    for key, v in changes.items():
        name = rule_name(key)
        if name in hyper and not same_value(hyper[name], v):
            raise ValueError(f"{where}: {key!r} and {name!r} give different values ({v!r}, {hyper[name]!r})")
        hyper[name] = v
    _check_known(rule, changes, where)
    try:
        return rule.adjust(**hyper)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: {e}") from None


def _check_known(rule, changes: dict, where: str) -> None:
    names = rule.hyperparameters()
    for key in changes:
        if rule_name(key) in names:
            continue
        hint = f" (this library's name: {TORCH_NAMES[key]!r})" if key in TORCH_NAMES else ""
        if key in ALIASES.values():
            hint = f" (torch's name for {rule_name(key)!r}, which this rule does not have)"
        raise ValueError(
            f"{where}: unknown key {key!r}{hint}; {type(rule).__name__} takes 'lr' and "
            f"{', '.join(repr(n) for n in names if n != 'eta') or 'nothing else'}"
        )


def unknown_key_error(rule, known, key: str, where: str) -> ValueError:
    """The error for group key `key`, added after construction, that no field of `rule` has: a
    typo ("lamda") or torch's name would otherwise be ignored without a word."""
    if key in TORCH_NAMES:
        hint = f"this library calls it {TORCH_NAMES[key]!r}"
    else:
        hint = "its keys: " + ", ".join(repr(k) for k in known)
    return ValueError(f"{where} has key {key!r}, which {type(rule).__name__} does not take; {hint}")
