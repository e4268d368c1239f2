"""`Optimizer.state_dict` / `load_state_dict` (torch's hooks around the optimizer's format), and
`LibraryFormat`: the library's checkpoint format (`optimisers.state_dict`), keyed by parameter
position as torch.optim does; `state[p]` entries are read and written in the same format."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from optimisers.checkpoints.state_dict import FORMAT, FORMAT_KEY, CheckpointError
from optimisers.checkpoints.state_dict import encode as encode_rule
from optimisers.checkpoints.state_dict import load_state_dict as library_load_state_dict
from optimisers.checkpoints.state_dict import state_dict as library_state_dict
from optimisers.core.rule import Rule
from optimisers.core.state import Leaf, State
from optimisers.core.tree import format_path
from optimisers.torch.hyperparameters import group_entries
from optimisers.torch.lazy_state import trainable

_ROOT = format_path(())  # how the library's state_dict names a lone Leaf's place


def state_dict(optimizer) -> dict:
    book, entry_of = optimizer._book, optimizer._format
    for hook in optimizer._optimizer_state_dict_pre_hooks.values():
        hook(optimizer)
    book.follow_edits()
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
    """`param_groups` as a checkpoint keeps them: tensors as positions (a tensor listed again,
    as in a group appended twice, keeps its first number, as torch.optim numbers them), rules
    as text."""
    groups, numbers = [], {}
    for entries in param_groups:
        saved = {k: encode_rule(v) if isinstance(v, Rule) else v for k, v in entries.items() if k != "params"}
        for p in entries["params"]:
            numbers.setdefault(id(p), len(numbers))
        saved["params"] = [numbers[id(p)] for p in entries["params"]]
        groups.append(saved)
    return groups


def load_state_dict(optimizer, state_dict) -> None:
    """Torch's hooks around the format's `load_checked`, which checks the whole checkpoint before
    it changes anything and returns the new group dicts."""
    for hook in optimizer._optimizer_load_state_dict_pre_hooks.values():
        result = hook(optimizer, state_dict)
        if result is not None:
            state_dict = result
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        raise CheckpointError(f"expected {optimizer._format.expected}, with 'state' and 'param_groups'")
    book = optimizer._book
    book.follow_edits()
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
    state = state_dict["state"]
    # keys that are not positions: what `state[key]` held for keys that are not parameters
    extra = {k: v for k, v in state.items() if not _is_position(k)}
    saved_state = {k: v for k, v in state.items() if _is_position(k)}
    param_groups[:] = optimizer._format.load_checked(saved_groups, saved_state)
    book.extra_state = extra
    for g in book.groups:
        g.follow(g.params)
    book.changed()
    for hook in optimizer._optimizer_load_state_dict_post_hooks.values():
        hook(optimizer)


def _is_position(key) -> bool:
    return isinstance(key, int) and not isinstance(key, bool)


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
    """`Optimizer`'s format: each parameter's entry is `optimisers.state_dict` of its Leaf (its
    rule as text, frozen flag and `"state/0"`, ... entries)."""

    expected = "the dict from Optimizer.state_dict()"

    def __init__(self, optimizer):
        self.book = optimizer._book

    def shows(self, leaf) -> bool:
        """Whether a Leaf with state has an entry in `state_dict()` and `optimizer.state`."""
        return True

    def entry(self, p, leaf) -> dict:
        """Parameter `p`'s entry of `state_dict()["state"]`."""
        prefix = _ROOT + "/"
        return {k.removeprefix(prefix): v for k, v in library_state_dict(leaf).items() if k != FORMAT_KEY}

    def _template(self, p) -> Leaf:
        """A Leaf with state shaped as parameter `p`'s is or will be, for a checkpoint to load into."""
        leaf = self.book.leaf(p)
        if leaf is not None:
            return leaf
        rule = self.book.group_of(p).rule
        with torch.no_grad():
            return Leaf(rule, rule.init(self.book.opt._policy.engine_view(p)))

    def load_entry(self, p, entry: Mapping) -> None:
        flat = {FORMAT_KEY: FORMAT, **{f"{_ROOT}/{k}": v for k, v in entry.items()}}
        where = f"parameter {self.book.position_of.get(id(p), '(removed)')}"
        try:
            new = library_load_state_dict(self._template(p), flat, hyperparameters="state").tree
        except CheckpointError as e:
            raise CheckpointError(str(e).replace(_ROOT, where)) from None
        self.book.adopt(p, new)
        self.book.changed()

    def load_checked(self, saved_groups, saved_state: Mapping) -> list[dict]:
        book = self.book
        flat = _flattened(saved_state)
        positions = checkpoint_positions(book, saved_state)
        template = State({i: self._template(book.params[i]) for i in sorted(positions)})
        loaded = library_load_state_dict(template, flat)  # checks everything; changes nothing
        new_groups = [_restored_group(saved, now) for saved, now in zip(saved_groups, book.opt.param_groups)]
        book.leaf_of.clear()  # torch's load replaces the state: parameters not in it have none
        for i, leaf in loaded.tree.items():
            book.adopt(book.params[i], leaf)
        for g, entries in zip(book.groups, new_groups):
            g.entries = entries
            # the group's rule is the one its loaded Leafs got, else unchanged
            g.rule = next((loaded.tree[i].rule for i in g.positions if i in loaded.tree), g.rule)
            g.seen = group_entries(g.rule)
        return new_groups


def _flattened(saved_state: Mapping) -> dict:
    """`state_dict()["state"]` as one dict of the library's format, `"position/key"` entries."""
    flat: dict = {FORMAT_KEY: FORMAT}
    for position, entries in saved_state.items():
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
    return flat


def _restored_group(saved: Mapping, entries: Mapping) -> dict:
    """A saved group's dict, with this optimizer's tensors, names and rule object."""
    group = {k: v for k, v in saved.items() if k not in ("params", "rule")}
    for k in ("params", "param_names", "rule"):
        if k in entries:
            group[k] = entries[k]
    return group
