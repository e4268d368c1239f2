"""`Optimizer.state_dict` / `load_state_dict` (torch's hooks around the optimizer's format), and
the two formats, which also read and write `state[p]`: `LibraryFormat` (`optimisers.state_dict` of
each Leaf) and `TorchFormat` (the drop-in classes': torch.optim's keys and hyperparameters)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from optimisers.checkpoints.state_dict import FORMAT, FORMAT_KEY, CheckpointError
from optimisers.checkpoints.state_dict import encode as encode_rule
from optimisers.checkpoints.state_dict import load_state_dict as library_load_state_dict
from optimisers.checkpoints.state_dict import state_dict as library_state_dict
from optimisers.core.rule import Rule
from optimisers.core.state import Leaf, State
from optimisers.core.tree import format_path
from optimisers.torch.lazy_state import owned_leaf, trainable
from optimisers.torch.param_groups import NOT_HYPERPARAMETERS, SCHEDULER_KEYS, group_dict, group_entries

_ROOT = format_path(())  # how the library's state_dict names a lone Leaf's place


def state_dict(optimizer) -> dict:
    book, entry_of = optimizer._book, optimizer._format
    for hook in optimizer._optimizer_state_dict_pre_hooks.values():
        hook(optimizer)
    book.follow_edits(optimizer._policy)
    if len(book.stepped) != len(book.leaf_of):
        raise KeyError(
            "a parameter removed from param_groups still has state, which a state dict cannot "
            "number (torch.optim raises here too): `del optimizer.state[p]` drops it"
        )
    listed = zip(book.stepped, book.flat.tree.values())
    state = {i: entry_of.entry(book.params[i], leaf) for i, leaf in listed if entry_of.shows(leaf)}
    out = {"state": {**state, **book.extra_state}, "param_groups": _saved_groups(optimizer.param_groups)}
    for hook in optimizer._optimizer_state_dict_post_hooks.values():
        result = hook(optimizer, out)
        if result is not None:
            out = result
    return out


def _saved_groups(param_groups) -> list[dict]:
    """`param_groups` as a checkpoint keeps them: rules as text, tensors as positions (a tensor
    listed again keeps its first number, as torch.optim numbers them)."""
    groups, numbers = [], {}
    for entries in param_groups:
        saved = {k: encode_rule(v) if isinstance(v, Rule) else v for k, v in entries.items() if k != "params"}
        for p in entries["params"]:
            numbers.setdefault(id(p), len(numbers))
        saved["params"] = [numbers[id(p)] for p in entries["params"]]
        groups.append(saved)
    return groups


def load_state_dict(optimizer, state_dict) -> None:
    """Torch's hooks around the format's `load_checked` (checks everything, then loads)."""
    for hook in optimizer._optimizer_load_state_dict_pre_hooks.values():
        result = hook(optimizer, state_dict)
        if result is not None:
            state_dict = result
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        raise CheckpointError(f"expected {optimizer._format.expected}, with 'state' and 'param_groups'")
    book = optimizer._book
    book.follow_edits(optimizer._policy)
    saved_groups, param_groups = state_dict["param_groups"], optimizer.param_groups
    if len(saved_groups) != len(param_groups):
        raise CheckpointError(
            f"the checkpoint has {len(saved_groups)} param groups, this optimizer {len(param_groups)}"
        )
    for i, (saved, entries) in enumerate(zip(saved_groups, param_groups)):
        if len(saved["params"]) != len(entries["params"]):
            raise CheckpointError(
                f"group {i} has {len(saved['params'])} parameters in the checkpoint, "
                f"{len(entries['params'])} here"
            )
    saved_state, extra = {}, {}  # (extra: what `state[key]` held for keys that are not parameters)
    for k, v in state_dict["state"].items():
        (saved_state if isinstance(k, int) and not isinstance(k, bool) else extra)[k] = v
    param_groups[:] = optimizer._format.load_checked(saved_groups, saved_state)
    book.extra_state = extra
    for g in book.groups:
        g.follow(g.params)
    book.changed()
    for hook in optimizer._optimizer_load_state_dict_post_hooks.values():
        hook(optimizer)


def checkpoint_positions(book, state: Mapping) -> list[int]:
    """The positions of a checkpoint's `"state"`, checked against the optimizer's parameters."""
    for position in state:
        listed = isinstance(position, int) and 0 <= position < len(book.params)
        if not (listed and trainable(book.params[position])):
            raise CheckpointError(
                f"the checkpoint has state for parameter {position!r}, but this optimizer's "
                f"parameters are numbered 0 to {len(book.params) - 1}"
            )
    return list(state)


class LibraryFormat:
    """`Optimizer`'s format: each parameter's entry is `optimisers.state_dict` of its Leaf."""

    expected = "the dict from Optimizer.state_dict()"

    def __init__(self, optimizer):  # (made when used: see Optimizer._format)
        self.opt, self.book = optimizer, optimizer._book

    def shows(self, leaf) -> bool:
        """Whether a Leaf with state has an entry in `state_dict()` and `optimizer.state`."""
        return True

    def entry(self, p, leaf) -> dict:
        prefix = _ROOT + "/"
        return {k.removeprefix(prefix): v for k, v in library_state_dict(leaf).items() if k != FORMAT_KEY}

    def _template(self, p) -> Leaf:
        """A Leaf with state shaped as `p`'s is or will be, for a checkpoint to load into."""
        leaf = self.book.leaf(p)
        if leaf is not None:
            return leaf
        rule = self.book.group_of(p).rule
        with torch.no_grad():
            return Leaf(rule, rule.init(self.opt._policy.engine_view(p)))

    def load_entry(self, p, entry: Mapping) -> None:
        flat = {FORMAT_KEY: FORMAT, **{f"{_ROOT}/{k}": v for k, v in entry.items()}}
        where = f"parameter {self.book.position_of.get(id(p), '(removed)')}"
        try:
            new = library_load_state_dict(self._template(p), flat, hyperparameters="state").tree
        except CheckpointError as e:
            raise CheckpointError(str(e).replace(_ROOT, where)) from None
        self.book.adopt(p, new)

    def load_checked(self, saved_groups, saved_state: Mapping) -> list[dict]:
        book, flat = self.book, {FORMAT_KEY: FORMAT}  # the entries as one dict of the library's format
        for position, entries in saved_state.items():
            if not isinstance(entries, Mapping) or "rule" not in entries:
                some = ", ".join(map(repr, list(entries)[:4])) if isinstance(entries, Mapping) else ""
                raise CheckpointError(
                    f"parameter {position} has no 'rule' entry (it has {some or 'nothing'}); "
                    "is this a torch.optim optimizer's state dict? It loads into the class of "
                    "optimisers.torch with torch.optim's name (optimisers.torch.AdamW, ...), not "
                    "into Optimizer(params, rule)"
                )
            flat.update({f"{position}/{key}": value for key, value in entries.items()})
        positions = checkpoint_positions(book, saved_state)
        template = State({i: self._template(book.params[i]) for i in sorted(positions)})
        loaded = library_load_state_dict(template, flat)  # checks everything; changes nothing
        new_groups = []  # the saved groups, with this optimizer's tensors, names and rule object
        for saved, now in zip(saved_groups, self.opt.param_groups):
            group = {k: v for k, v in saved.items() if k not in ("params", "rule")}
            new_groups.append({**group, **{k: now[k] for k in ("params", "param_names", "rule") if k in now}})
        book.leaf_of.clear()  # torch's load replaces the state: parameters not in it have none
        for i, leaf in loaded.tree.items():
            book.adopt(book.params[i], leaf)
        for g, entries in zip(book.groups, new_groups):
            g.entries = entries
            # the group's rule is the one its loaded Leafs got, else unchanged
            g.rule = next((loaded.tree[i].rule for i in g.positions if i in loaded.tree), g.rule)
            g.seen = group_entries(g.rule)
        return new_groups


# names in a drop-in class's `_layout`, beside torch's names of state tensors:
STEP = "step"  # the step count, which torch keeps as a float32 scalar tensor
NOT_SHOWN = ""  # SGD's momentum: the state counts steps only to know the first one; torch shows none
SCALAR_STATE = ("mu_product",)  # float state kept as a float32 scalar tensor by torch
# torch's Adafactor: the factors of a parameter's last two dimensions (other parts: its shape)
_PART_SHAPES = {"row_var": lambda s: (*s[:-1], 1), "col_var": lambda s: (*s[:-2], 1, s[-1])}


def _decoded_part(name: str, value, p: torch.Tensor, where: str):
    """The rule's state part `name` from torch's `value`, for parameter `p`."""
    if name == STEP or name in SCALAR_STATE:
        number = float(value) if isinstance(value, (torch.Tensor, int, float)) else math.nan
        if not math.isfinite(number) or (name == STEP and number < 0):
            raise CheckpointError(f"{where}: {name!r} must be a finite number, got {value!r}")
        return int(round(number)) if name == STEP else number
    shape = _PART_SHAPES[name](p.shape) if name in _PART_SHAPES else p.shape
    if not isinstance(value, torch.Tensor) or value.shape != shape:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        whose = "the parameter" if shape == p.shape else f"expected for the parameter's {tuple(p.shape)}:"
        raise CheckpointError(f"{where}: {name!r} has shape {got}, {whose} {tuple(shape)}")
    if value.is_complex() != p.is_complex():
        raise CheckpointError(f"{where}: {name!r} is {value.dtype}, the parameter {p.dtype}")
    value = value.detach().to(dtype=p.dtype, device=p.device, copy=True)
    return torch.view_as_real(value) if value.is_complex() else value  # complex trained as real


def _check_entry_keys(entry, layout: tuple, where: str, name: str) -> None:
    if not isinstance(entry, Mapping):
        raise CheckpointError(f"{where}: expected a dict of state, got a {type(entry).__name__}")
    expected = {key for key in layout if key != NOT_SHOWN}
    if set(entry) != expected:
        found = {"missing": sorted(expected - set(entry)), "unexpected": sorted(set(entry) - expected)}
        detail = "; ".join(f"{what} {', '.join(map(repr, keys))}" for what, keys in found.items() if keys)
        raise CheckpointError(
            f"{where}: torch.optim.{name} with these settings keeps "
            f"{', '.join(map(repr, sorted(expected))) or 'no state'}; the checkpoint has "
            f"{detail} (was it written by another optimizer class, or other settings such as "
            "amsgrad, momentum or centered?)"
        )


class TorchFormat:
    """A drop-in class's format, by the class's `_layout_for(h, p)` (torch's name of each part of
    the rule's state) and `_one_part`, for `state[p]` and whole state dicts."""

    expected = "an optimizer state dict"

    def __init__(self, optimizer):
        self.opt, self.book, self.name = optimizer, optimizer._book, type(optimizer).__name__

    def shows(self, leaf) -> bool:
        """Whether the Leaf's state shows in `state[p]` (torch's SGD without momentum keeps none)."""
        return not (leaf.state is None or (isinstance(leaf.state, tuple) and not leaf.state))

    def entry(self, p, leaf) -> dict:
        """`state[p]` with torch's keys, arrays and "step" as torch keeps them."""
        state = leaf.state
        parts = (state,) if self.opt._one_part else state if isinstance(state, tuple) else ()
        out: dict = {}
        for name, part in zip(self.opt._layout_for(self.book.group_of(p).seen, p), parts):
            if name == STEP or name in SCALAR_STATE:
                out[name] = torch.tensor(float(part), dtype=torch.float32)
            elif name != NOT_SHOWN:
                out[name] = torch.view_as_complex(part) if p.is_complex() else part
        return out

    def decode(self, position: int, h: dict, entry, problems: list) -> Any:
        """The rule's state at `position` from torch's `entry`; what does not fit goes to `problems`."""
        p = self.book.params[position]
        layout = self.opt._layout_for(h, p)
        where = f"parameter {position}"
        try:
            _check_entry_keys(entry, layout, where, self.name)
            # the step count torch does not show (SGD's): a saved buffer means a step was taken
            parts = [name == NOT_SHOWN or _decoded_part(name, entry[name], p, where) for name in layout]
        except CheckpointError as e:  # one of the problems reported
            problems.append(str(e))
            return None
        if not parts:
            return None
        return parts[0] if self.opt._one_part else tuple(parts)

    def load_entry(self, p, entry: Mapping) -> None:
        problems: list[str] = []
        g = self.book.group_of(p)
        position = self.book.position_of.get(id(p))
        if position is None:  # a parameter removed from its group: not numbered
            raise KeyError("a parameter removed from param_groups takes no state: list it again first")
        state = self.decode(position, g.seen, entry, problems)
        if problems:
            raise CheckpointError("; ".join(problems))
        self.book.adopt(p, owned_leaf(g.rule, state))  # decoded copies: the engine keeps them

    def load_checked(self, saved_groups, saved_state: Mapping) -> list[dict]:
        """The new group dicts, after the whole checkpoint is checked (a `CheckpointError` lists
        every problem) and loaded, hyperparameters included."""
        book, policy, problems, hypers, rules = self.book, self.opt._policy, [], [], []
        for i, (saved, g) in enumerate(zip(saved_groups, book.groups)):  # each group's h and rule
            known = {*g.entries, *policy.hyper, *NOT_HYPERPARAMETERS, *SCHEDULER_KEYS}
            unknown = [k for k in saved if k not in known]
            h = rule = None
            if unknown:
                problems.append(
                    f"group {i}: the checkpoint has {', '.join(map(repr, unknown))}, which "
                    f"torch.optim.{self.name} does not take (another optimizer class?)"
                )
            else:
                h = {k: saved.get(k, v) for k, v in g.seen.items()}
                try:
                    rule = policy.built(h, f"group {i} of the checkpoint")
                except (TypeError, ValueError) as e:
                    problems.append(str(e))
            hypers.append(h)
            rules.append(rule)
        states = {}
        for position in checkpoint_positions(book, saved_state):
            h = hypers[book.group_index(position)]
            if h is not None:
                states[position] = self.decode(position, h, saved_state[position], problems)
        if problems:
            raise CheckpointError("the checkpoint does not fit this optimizer:\n  " + "\n  ".join(problems))
        # everything checked: load (torch's load replaces the state: parameters not in it have none)
        new_groups = []
        for saved, g, h, rule in zip(saved_groups, book.groups, hypers, rules):
            carried = {k: v for k, v in saved.items() if k not in h and k not in ("params", "param_names")}
            # the names: this group's, else the checkpoint's (as torch.optim keeps them)
            names = g.entries.get("param_names", saved.get("param_names"))
            g.entries, g.seen, g.rule = group_dict(g.params, names, h, carried), dict(h), rule
            new_groups.append(g.entries)
        book.leaf_of.clear()
        for position, state in states.items():  # (decoded copies: the engine keeps them)
            book.adopt(book.params[position], owned_leaf(rules[book.group_index(position)], state))
        return new_groups
