"""torch.optim's state format for the drop-in classes: `state[p]` with torch's keys ("exp_avg",
"step", ...), and `load_state_dict` of a dict written by torch.optim's class of the same name (or
by the drop-in class), hyperparameters included."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from optimisers.checkpoints.state_dict import CheckpointError
from optimisers.torch.lazy_state import owned_leaf
from optimisers.torch.param_groups import ParamGroup

# names in a drop-in class's `_layout`, beside torch's names of state tensors:
STEP = "step"  # the step count, which torch keeps as a float32 scalar tensor
NOT_SHOWN = ""  # SGD's momentum: the state counts steps only to know the first one; torch shows none
SCALAR_STATE = ("mu_product",)  # float state kept as a float32 scalar tensor by torch


class _Misfit(Exception):
    """A part of a checkpoint that does not fit; its message is one of the problems reported."""


def _decoded_part(name: str, value, p: torch.Tensor, where: str, shape):
    """The rule's state part `name` (of `shape`) from torch's `value`, for parameter `p`."""
    if name == STEP or name in SCALAR_STATE:
        number = float(value) if isinstance(value, (torch.Tensor, int, float)) else math.nan
        if not math.isfinite(number) or (name == STEP and number < 0):
            raise _Misfit(f"{where}: {name!r} must be a finite number, got {value!r}")
        return int(round(number)) if name == STEP else number
    if not isinstance(value, torch.Tensor) or value.shape != shape:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        whose = "the parameter" if shape == p.shape else f"expected for the parameter's {tuple(p.shape)}:"
        raise _Misfit(f"{where}: {name!r} has shape {got}, {whose} {tuple(shape)}")
    if value.is_complex() != p.is_complex():
        raise _Misfit(f"{where}: {name!r} is {value.dtype}, the parameter {p.dtype}")
    value = value.detach().to(dtype=p.dtype, device=p.device, copy=True)
    return torch.view_as_real(value) if value.is_complex() else value  # complex trained as real


class TorchStateFormat:
    """The part of a drop-in class that reads and writes torch.optim's state format, one
    parameter's entry at a time (`state[p]`). It uses the
    class's `_layout(h)` (torch's name of each part of the rule's state), `_built(h, where)` (the
    rule) and `_is_group_key(key)`; a class whose state depends on the parameter's shape (torch's
    Adafactor: factors for matrices) gives `_layout_for(h, p)` and `_part_shape(name, p)`."""

    def _layout_for(self, h: dict, p: torch.Tensor) -> tuple[str, ...]:
        """torch's name of each part of the rule's state for parameter `p`."""
        return self._layout(h)

    def _part_shape(self, name: str, p: torch.Tensor) -> torch.Size:
        """The shape of state part `name` of parameter `p`."""
        return p.shape

    #: the rule's state is one array (Muon's momentum), not a tuple of parts
    _one_part: ClassVar[bool] = False

    def _shows(self, leaf) -> bool:
        """Whether the Leaf's state shows in torch's `state[p]` (a stateless rule's does not, as
        torch's SGD without momentum keeps none)."""
        return not (leaf.state is None or (isinstance(leaf.state, tuple) and not leaf.state))

    def _entry(self, p, leaf) -> dict:
        """`state[p]` with torch's keys: the rule's state arrays (complex again for a complex
        parameter) and "step" as torch keeps it."""
        state = leaf.state
        parts = (state,) if self._one_part else state if isinstance(state, tuple) else ()
        out: dict = {}
        for name, part in zip(self._layout_for(self._group_of(p).seen, p), parts):
            if name == NOT_SHOWN:
                continue
            if name == STEP or name in SCALAR_STATE:
                out[name] = torch.tensor(float(part), dtype=torch.float32)
            else:
                out[name] = torch.view_as_complex(part) if p.is_complex() else part
        return out

    def _decode(self, position: int, h: dict, entry, problems: list) -> Any:
        """The rule's state for the parameter at `position` from torch's `entry` (under group
        hyperparameters `h`); what does not fit goes to `problems`."""
        p = self._params[position]
        layout = self._layout_for(h, p)
        where = f"parameter {position}"
        try:
            self._check_entry_keys(entry, layout, where)
            # the step count torch does not show (SGD's): a saved buffer means a step was taken
            parts = [
                1
                if name == NOT_SHOWN
                else _decoded_part(name, entry[name], p, where, self._part_shape(name, p))
                for name in layout
            ]
        except _Misfit as e:
            problems.append(str(e))
            return None
        if not parts:
            return None
        return parts[0] if self._one_part else tuple(parts)

    def _check_entry_keys(self, entry, layout: tuple, where: str) -> None:
        if not isinstance(entry, Mapping):
            raise _Misfit(f"{where}: expected a dict of state, got a {type(entry).__name__}")
        expected = {name for name in layout if name != NOT_SHOWN}
        if set(entry) != expected:
            found = {"missing": sorted(expected - set(entry)), "unexpected": sorted(set(entry) - expected)}
            detail = "; ".join(f"{what} {', '.join(map(repr, keys))}" for what, keys in found.items() if keys)
            raise _Misfit(
                f"{where}: torch.optim.{type(self).__name__} with these settings keeps "
                f"{', '.join(map(repr, sorted(expected))) or 'no state'}; the checkpoint has "
                f"{detail} (was it written by another optimizer class, or other settings such as "
                "amsgrad, momentum or centered?)"
            )

    def _load_entry(self, p, entry: Mapping) -> None:
        problems: list[str] = []
        g = self._group_of(p)
        position = self._position_of.get(id(p))
        if position is None:  # a parameter removed from its group: not numbered
            raise KeyError("a parameter removed from param_groups takes no state: list it again first")
        state = self._decode(position, g.seen, entry, problems)
        if problems:
            raise CheckpointError("; ".join(problems))
        self._adopt(p, owned_leaf(g.rule, state))  # decoded copies: the engine keeps them
        self._changed()


class TorchStateDict(TorchStateFormat):
    """`load_state_dict` of a whole state dict in torch.optim's format (see `TorchStateFormat`
    for one parameter's entry)."""

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Restore a state dict written by this class or by the torch.optim class of the same
        name: checked in full first (a `CheckpointError` lists every mismatch: groups, keys,
        shapes), then loaded, hyperparameters included, as torch.optim does. A run resumed from
        it continues as the saved one would have."""
        self._load(state_dict, "an optimizer state dict")

    def _load_checked(self, saved_groups, saved_state: Mapping) -> list[dict]:
        problems: list[str] = []
        hypers, rules = self._saved_hyperparameters(saved_groups, problems)
        states = self._saved_states(saved_state, hypers, problems)
        if problems:
            raise CheckpointError("the checkpoint does not fit this optimizer:\n  " + "\n  ".join(problems))
        # everything checked: load (torch's load replaces the state: parameters not in it have none)
        new_groups = [
            self._adopt_saved_group(saved, g, h, rule)
            for saved, g, h, rule in zip(saved_groups, self._groups, hypers, rules)
        ]
        self._leaf_of.clear()
        for position, state in states.items():
            rule = self._groups[self._group_index(position)].rule
            self._adopt(self._params[position], owned_leaf(rule, state))  # decoded copies: kept
        return new_groups

    def _saved_hyperparameters(self, saved_groups, problems: list) -> tuple[list, list]:
        """Each saved group's hyperparameters and the rule they make (None where they do not fit)."""
        hypers, rules = [], []
        for i, (saved, g) in enumerate(zip(saved_groups, self._groups)):
            unknown = [k for k in saved if not (self._is_group_key(k) or k in g.entries)]
            if unknown:
                problems.append(
                    f"group {i}: the checkpoint has {', '.join(map(repr, unknown))}, which "
                    f"torch.optim.{type(self).__name__} does not take (another optimizer class?)"
                )
                hypers.append(None)
                rules.append(None)
                continue
            h = {k: saved.get(k, v) for k, v in g.seen.items()}
            try:
                rules.append(self._built(h, f"group {i} of the checkpoint"))
            except (TypeError, ValueError) as e:
                problems.append(str(e))
                rules.append(None)
            hypers.append(h)
        return hypers, rules

    def _saved_states(self, saved_state: Mapping, hypers: list, problems: list) -> dict:
        """Each saved parameter's state, decoded under its saved group's hyperparameters."""
        states = {}
        for position in self._checkpoint_positions(saved_state):
            h = hypers[self._group_index(position)]
            if h is not None:
                states[position] = self._decode(position, h, saved_state[position], problems)
        return states

    @staticmethod
    def _adopt_saved_group(saved: Mapping, g: ParamGroup, h: dict, rule) -> dict:
        """Group `g` takes the saved hyperparameters `h` and their `rule`; returns its new dict."""
        carried = {k: v for k, v in saved.items() if k not in h and k not in ("params", "param_names")}
        entries = {"params": g.params, **h, **carried}
        # the names: this group's, else the checkpoint's (as torch.optim keeps them)
        names = g.entries.get("param_names", saved.get("param_names"))
        if names is not None:
            entries["param_names"] = names
        g.entries, g.seen, g.rule = entries, dict(h), rule
        return entries
