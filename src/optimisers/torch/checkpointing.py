"""`Optimizer.state_dict` / `load_state_dict`: the library's checkpoint format
(`optimisers.state_dict`), keyed by parameter position as torch.optim does, and `state[p]`
entries read and written in the same format."""

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


def _split_extra_state(saved_state: Mapping) -> tuple[dict, dict]:
    """A checkpoint's `"state"`: the parameters' entries (keyed by number) and the rest, which
    `state[key]` held for keys that are not parameters (torch keeps and restores those too)."""
    params, extra = {}, {}
    for key, value in saved_state.items():
        (params if isinstance(key, int) and not isinstance(key, bool) else extra)[key] = value
    return params, extra


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


class Checkpointing:
    """The part of `Optimizer` that saves and restores its state (torch's hooks included)."""

    # --- one parameter's entry (also what `state[p]` reads and writes) ----------------------------

    def _entry(self, p, leaf) -> dict:
        """Parameter `p`'s entry of `state_dict()["state"]`."""
        prefix = _ROOT + "/"
        return {k.removeprefix(prefix): v for k, v in library_state_dict(leaf).items() if k != FORMAT_KEY}

    def _shows(self, leaf) -> bool:
        """Whether a Leaf with state has an entry in `state_dict()` and `optimizer.state`."""
        return True

    def _template(self, p) -> Leaf:
        """A Leaf with state shaped as parameter `p`'s is or will be, for a checkpoint to load into."""
        leaf = self._leaf(p)
        if leaf is not None:
            return leaf
        rule = self._group_of(p).rule
        with torch.no_grad():
            return Leaf(rule, rule.init(self._engine_view(p)))

    def _load_entry(self, p, entry: Mapping) -> None:
        flat = {FORMAT_KEY: FORMAT, **{f"{_ROOT}/{k}": v for k, v in entry.items()}}
        where = f"parameter {self._position_of.get(id(p), '(removed)')}"
        try:
            new = library_load_state_dict(self._template(p), flat, hyperparameters="state").tree
        except CheckpointError as e:
            raise CheckpointError(str(e).replace(_ROOT, where)) from None
        self._adopt(p, new)
        self._changed()

    # --- the whole optimizer ----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """`{"state": {position: {...}}, "param_groups": [...]}` as torch.optim has it: parameters
        numbered by their position in `param_groups`, each parameter that has state with its rule
        (as text), frozen flag and state entries (`"state/0"`, ...) from `optimisers.state_dict`.
        Holds the state's own tensors (not copies), as torch.optim does."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        self._follow_edits()
        if len(self._stepped) != len(self._leaf_of):
            raise KeyError(
                "a parameter removed from param_groups still has state, which a state dict cannot "
                "number (torch.optim raises here too): `del optimizer.state[p]` drops it"
            )
        state = {i: self._entry(self._params[i], leaf) for i, leaf in self._flat_items() if self._shows(leaf)}
        out = {"state": {**state, **self._extra_state}, "param_groups": self._saved_groups()}
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, out)
            if result is not None:
                out = result
        return out

    def _flat_items(self) -> list:
        """`(position, Leaf)` of the listed parameters that have state."""
        return list(zip(self._stepped, self._flat.tree.values()))

    def _saved_groups(self) -> list[dict]:
        """`param_groups` as a checkpoint keeps them: tensors as positions (a tensor listed again,
        as in a group appended twice, keeps its first number, as torch.optim numbers them), rules
        as text."""
        groups, numbers = [], {}
        for entries in self.param_groups:
            saved = {
                k: (encode_rule(v) if isinstance(v, Rule) else v) for k, v in entries.items() if k != "params"
            }
            for p in entries["params"]:
                numbers.setdefault(id(p), len(numbers))
            saved["params"] = [numbers[id(p)] for p in entries["params"]]
            groups.append(saved)
        return groups

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Restore what `state_dict()` gave, into an optimizer over the same parameters: checked
        in full first (groups, sizes, rules, shapes, dtypes; a `CheckpointError` lists every
        difference), then loaded; tensors take the dtype and device of this optimizer's state.
        Parameters without state in the checkpoint have none after it, as in torch.optim."""
        self._load(state_dict, "the dict from Optimizer.state_dict()")

    def _load(self, state_dict, expected: str) -> None:
        """What every `load_state_dict` does: torch's hooks around `_load_checked`, which checks
        the whole checkpoint before it changes anything and returns the new group dicts."""
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
            raise CheckpointError(f"expected {expected}, with 'state' and 'param_groups'")
        self._follow_edits()
        self._check_groups(state_dict["param_groups"])
        saved_state, extra = _split_extra_state(state_dict["state"])
        self.param_groups[:] = self._load_checked(state_dict["param_groups"], saved_state)
        self._extra_state = extra
        for g in self._groups:
            g.follow(g.params)
        self._changed()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _load_checked(self, saved_groups, saved_state: Mapping) -> list[dict]:
        flat = _flattened(saved_state)
        positions = self._checkpoint_positions(saved_state)
        template = State({i: self._template(self._params[i]) for i in sorted(positions)})
        loaded = library_load_state_dict(template, flat)  # checks everything; changes nothing
        new_groups = [self._restored_group(saved, now) for saved, now in zip(saved_groups, self.param_groups)]
        self._leaf_of.clear()  # torch's load replaces the state: parameters not in it have none
        for i, leaf in loaded.tree.items():
            self._adopt(self._params[i], leaf)
        for g, entries in zip(self._groups, new_groups):
            g.entries = entries
            # the group's rule is the one its loaded Leafs got, else unchanged
            loaded_rules = (loaded.tree[i].rule for i in g.positions if i in loaded.tree)
            g.rule = next(loaded_rules, g.rule)
            g.seen = group_entries(g.rule)
        return new_groups

    @staticmethod
    def _restored_group(saved: Mapping, entries: Mapping) -> dict:
        """A saved group's dict, with this optimizer's tensors, names and rule object."""
        group = {k: v for k, v in saved.items() if k not in ("params", "rule")}
        for k in ("params", "param_names", "rule"):
            if k in entries:
                group[k] = entries[k]
        return group

    # --- shared with the drop-in classes' torch.optim format ----------------------------------------

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
            listed = isinstance(position, int) and 0 <= position < len(self._params)
            if not (listed and trainable(self._params[position])):
                raise CheckpointError(
                    f"the checkpoint has state for parameter {position!r}, but this optimizer's "
                    f"parameters are numbered 0 to {len(self._params) - 1}"
                )
            positions.append(position)
        return positions
