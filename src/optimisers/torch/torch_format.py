"""torch.optim's state format for the drop-in classes: `state[p]` with torch's keys ("exp_avg",
"step", ...), and `load_state_dict` of a dict written by torch.optim's class of the same name (or
by the drop-in class), hyperparameters included."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from optimisers.checkpoints.state_dict import CheckpointError
from optimisers.torch.checkpointing import checkpoint_positions
from optimisers.torch.lazy_state import owned_leaf
from optimisers.torch.param_groups import group_dict

# names in a drop-in class's `_layout`, beside torch's names of state tensors:
STEP = "step"  # the step count, which torch keeps as a float32 scalar tensor
NOT_SHOWN = ""  # SGD's momentum: the state counts steps only to know the first one; torch shows none
SCALAR_STATE = ("mu_product",)  # float state kept as a float32 scalar tensor by torch
# torch's Adafactor: the factors of a parameter's last two dimensions (other parts: its shape)
_PART_SHAPES = {"row_var": lambda s: (*s[:-1], 1), "col_var": lambda s: (*s[:-2], 1, s[-1])}


class _Misfit(Exception):
    """A part of a checkpoint that does not fit; its message is one of the problems reported."""


def _decoded_part(name: str, value, p: torch.Tensor, where: str):
    """The rule's state part `name` from torch's `value`, for parameter `p`."""
    if name == STEP or name in SCALAR_STATE:
        number = float(value) if isinstance(value, (torch.Tensor, int, float)) else math.nan
        if not math.isfinite(number) or (name == STEP and number < 0):
            raise _Misfit(f"{where}: {name!r} must be a finite number, got {value!r}")
        return int(round(number)) if name == STEP else number
    shape = _PART_SHAPES[name](p.shape) if name in _PART_SHAPES else p.shape
    if not isinstance(value, torch.Tensor) or value.shape != shape:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        whose = "the parameter" if shape == p.shape else f"expected for the parameter's {tuple(p.shape)}:"
        raise _Misfit(f"{where}: {name!r} has shape {got}, {whose} {tuple(shape)}")
    if value.is_complex() != p.is_complex():
        raise _Misfit(f"{where}: {name!r} is {value.dtype}, the parameter {p.dtype}")
    value = value.detach().to(dtype=p.dtype, device=p.device, copy=True)
    return torch.view_as_real(value) if value.is_complex() else value  # complex trained as real


def _check_entry_keys(entry, layout: tuple, where: str, name: str) -> None:
    if not isinstance(entry, Mapping):
        raise _Misfit(f"{where}: expected a dict of state, got a {type(entry).__name__}")
    expected = {key for key in layout if key != NOT_SHOWN}
    if set(entry) != expected:
        found = {"missing": sorted(expected - set(entry)), "unexpected": sorted(set(entry) - expected)}
        detail = "; ".join(f"{what} {', '.join(map(repr, keys))}" for what, keys in found.items() if keys)
        raise _Misfit(
            f"{where}: torch.optim.{name} with these settings keeps "
            f"{', '.join(map(repr, sorted(expected))) or 'no state'}; the checkpoint has "
            f"{detail} (was it written by another optimizer class, or other settings such as "
            "amsgrad, momentum or centered?)"
        )


class TorchFormat:
    """A drop-in class's format, one parameter's entry at a time (`state[p]`) and whole state
    dicts. It uses the class's `_layout_for(h, p)` (torch's name of each part of the rule's
    state), `_one_part` and its policy's `built(h, where)` (the rule) and `is_group_key(key)`."""

    expected = "an optimizer state dict"

    def __init__(self, optimizer):
        self.opt, self.book, self.name = optimizer, optimizer._book, type(optimizer).__name__

    def shows(self, leaf) -> bool:
        """Whether the Leaf's state shows in torch's `state[p]` (a stateless rule's does not, as
        torch's SGD without momentum keeps none)."""
        return not (leaf.state is None or (isinstance(leaf.state, tuple) and not leaf.state))

    def entry(self, p, leaf) -> dict:
        """`state[p]` with torch's keys: the rule's state arrays (complex again for a complex
        parameter) and "step" as torch keeps it."""
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
        """The rule's state for the parameter at `position` from torch's `entry` (under group
        hyperparameters `h`); what does not fit goes to `problems`."""
        p = self.book.params[position]
        layout = self.opt._layout_for(h, p)
        where = f"parameter {position}"
        try:
            _check_entry_keys(entry, layout, where, self.name)
            # the step count torch does not show (SGD's): a saved buffer means a step was taken
            parts = [name == NOT_SHOWN or _decoded_part(name, entry[name], p, where) for name in layout]
        except _Misfit as e:
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
        self.book.changed()

    def load_checked(self, saved_groups, saved_state: Mapping) -> list[dict]:
        """The new group dicts, after the whole checkpoint is checked (a `CheckpointError` lists
        every problem) and loaded, hyperparameters included, as torch.optim does."""
        book, problems = self.book, []
        hypers, rules = self._saved_hyperparameters(saved_groups, problems)
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
        for position, state in states.items():
            rule = book.groups[book.group_index(position)].rule
            book.adopt(book.params[position], owned_leaf(rule, state))  # decoded copies: kept
        return new_groups

    def _saved_hyperparameters(self, saved_groups, problems: list) -> tuple[list, list]:
        """Each saved group's hyperparameters and the rule they make (None where they do not fit)."""
        hypers, rules, policy = [], [], self.opt._policy
        for i, (saved, g) in enumerate(zip(saved_groups, self.book.groups)):
            unknown = [k for k in saved if not (policy.is_group_key(k) or k in g.entries)]
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
        return hypers, rules
