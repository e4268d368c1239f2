"""The state format of the low-bit drop-in classes (`optimisers.torch.AdamW8bit`, ...):
bitsandbytes 0.50's keys in plain tensors, so a checkpoint loads into `bnb.optim.AdamW8bit` and
back, and `torch.load(weights_only=True)` reads it.

`state[p]`: `step` (a Python int), then for each moment `k` (1: Adam's m or Lion's m, 2: Adam's
v) `statek`: a quantised moment's codes (uint8; 4 bits: two a byte, 1-D), `absmaxk` its block
scales (float32; FP8: the scales, absmax/448) and `qmapk` the map of its codes (float32; FP8: the
value of each float8_e4m3fn bit pattern), or, for an array under the threshold, the moment
itself in float32. `state_dict()` nests the quantised keys under `__bnb_optimizer_quant_state__`,
as bitsandbytes does (FSDP gathers only tensors shaped as the parameter). Loading also takes
torch.optim's Adam/AdamW entries (`exp_avg`, `exp_avg_sq`, `step`), quantising them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch

from optimisers import ops
from optimisers.checkpoints.state_dict import CheckpointError
from optimisers.core.quant_lookup import codebook
from optimisers.core.quantised import Quantised
from optimisers.torch.checkpointing import TorchFormat
from optimisers.torch.lazy_state import owned_leaf

WRAPPED = "__bnb_optimizer_quant_state__"  # bitsandbytes' nesting of the quantised keys
QUANTISED_KEYS = ("state1", "qmap1", "absmax1", "state2", "qmap2", "absmax2")
TORCH_NAMES = ("exp_avg", "exp_avg_sq")  # torch.optim's names of Adam's moments


def code_map(q: Quantised) -> torch.Tensor:
    """The float32 value of each code of `q`'s format (bitsandbytes' `qmap`)."""
    return torch.from_numpy(codebook(q.bits, q.signed).values.copy())


def unwrapped(entry):
    """A checkpoint entry with bitsandbytes' nested keys moved up (a new dict)."""
    if not isinstance(entry, Mapping) or WRAPPED not in entry:
        return entry
    inner = entry[WRAPPED]
    return {
        **{k: v for k, v in entry.items() if k != WRAPPED},
        **(inner if isinstance(inner, Mapping) else {}),
    }


def wrapped(entry: Mapping) -> dict:
    """`entry` with the quantised keys nested as bitsandbytes' `state_dict` nests them."""
    kept = {k: v for k, v in entry.items() if k not in QUANTISED_KEYS}
    nested = {k: entry[k] for k in QUANTISED_KEYS if k in entry}
    return {**kept, WRAPPED: nested} if nested else kept


class LowBitFormat(TorchFormat):
    """bitsandbytes' layout for a state `(moments..., step)` of `LowBit`, possibly inside
    `StochasticRounding`; the class says how to read the moments and the step out of the rule's
    state (`_moments_and_step`) and put them back (`_with_moments_and_step`)."""

    expected = "an optimizer state dict (bitsandbytes' or torch.optim's layout)"

    def entry(self, p, leaf) -> dict:
        moments, step = self.opt._moments_and_step(leaf.state)
        out: dict = {"step": int(step)}
        for k, m in enumerate(moments, start=1):
            if isinstance(m, Quantised):
                out.update({f"state{k}": m.codes, f"qmap{k}": code_map(m), f"absmax{k}": m.scale})
            else:
                out[f"state{k}"] = m
        return out

    def decode(self, position: int, h: dict, entry, problems: list):
        p = self.book.params[position]
        where = f"parameter {position}"
        try:
            return self._decoded(self.opt._policy.built(h, where), p, unwrapped(entry), where)
        except (CheckpointError, TypeError, ValueError) as e:
            problems.append(str(e))
            return None

    def load_entry(self, p, entry: Mapping) -> None:
        g = self.book.group_of(p)
        if self.book.position_of.get(id(p)) is None:
            raise KeyError("a parameter removed from param_groups takes no state: list it again first")
        where = f"parameter {self.book.position_of[id(p)]}"
        state = self._decoded(g.rule, p, unwrapped(entry), where)
        self.book.adopt(p, owned_leaf(g.rule, state))

    def _decoded(self, rule, p, entry, where: str):
        """The rule's state for `p` from a bitsandbytes or torch.optim entry, or a CheckpointError."""
        if not isinstance(entry, Mapping):
            raise CheckpointError(f"{where}: expected a dict of state, got a {type(entry).__name__}")
        with torch.no_grad():
            template = rule.init(self.opt._policy.engine_view(p))
        moments, _ = self.opt._moments_and_step(template)
        torch_layout = any(name in entry for name in TORCH_NAMES)
        names = (
            TORCH_NAMES[: len(moments)] if torch_layout else [f"state{k}" for k in range(1, len(moments) + 1)]
        )
        expected = {"step", *names}
        if not torch_layout:
            expected |= {f"{key}{k}" for k in range(1, len(moments) + 1) for key in ("qmap", "absmax")}
        missing = sorted({"step", *names} - set(entry))
        unexpected = sorted(set(entry) - expected)
        if missing or unexpected:
            raise CheckpointError(
                f"{where}: {self.name} keeps 'step' and {', '.join(map(repr, names))} (with 'qmapK' and "
                f"'absmaxK' for quantised moments); the checkpoint has "
                + "; ".join(f"{what} {', '.join(map(repr, keys))}" for what, keys in
                            (("missing", missing), ("unexpected", unexpected)) if keys)
            )  # fmt: skip
        step = _step(entry["step"], where)
        new = [
            _moment(like, entry, name, str(k), p, f"{where}: {name!r}")
            for k, (like, name) in enumerate(zip(moments, names), start=1)
        ]
        return self.opt._with_moments_and_step(template, new, step)


def _step(value, where: str) -> int:
    number = float(value) if isinstance(value, (torch.Tensor, int, float)) else math.nan
    if not (math.isfinite(number) and number >= 0 and number == round(number)):
        raise CheckpointError(f"{where}: 'step' must be a whole number >= 0, got {value!r}")
    return int(number)


def _moment(like, entry: Mapping, name: str, k: str, p: torch.Tensor, where: str):
    """Moment `k` in the form of `like` (a Quantised or a tensor of this optimizer's state), from
    the checkpoint's codes (with `qmapk`, `absmaxk`) or values (quantised here if `like` is)."""
    value = entry[name]
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{where}: expected a tensor, got a {type(value).__name__}")
    if f"absmax{k}" in entry or f"qmap{k}" in entry:
        values = _codes_read(like, entry, name, k, p, where)
    else:
        if tuple(value.shape) != tuple(p.shape) or not value.is_floating_point():
            raise CheckpointError(
                f"{where}: a moment kept unquantised must be a floating tensor of the parameter's shape "
                f"{tuple(p.shape)}; got {value.dtype} of shape {tuple(value.shape)}"
            )
        values = value.detach().to(device=p.device, dtype=torch.float32, copy=True)
    if isinstance(like, Quantised):
        return (
            values
            if isinstance(values, Quantised)
            else ops.quantise(values, like.bits, like.signed, like.block)
        )
    if isinstance(values, Quantised):
        values = ops.dequantise(values)
    return values.to(dtype=like.dtype, device=like.device)


def _codes_read(like, entry, name, k, p, where) -> Quantised:
    """A quantised moment from the checkpoint's codes, scales and map, checked against this
    optimizer's format (its map, block and code layout must be the checkpoint's)."""
    if not isinstance(like, Quantised):
        raise CheckpointError(
            f"{where}: the checkpoint keeps this moment quantised, this optimizer in full precision "
            "(a parameter under its threshold, min_8bit_size): make it with the checkpoint's threshold"
        )
    codes, scale, qmap = entry[name], entry.get(f"absmax{k}"), entry.get(f"qmap{k}")
    for key, t in ((f"absmax{k}", scale), (f"qmap{k}", qmap)):
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(
                f"{where}: {key!r} must be a tensor beside the codes, got {type(t).__name__}"
            )
    ours = code_map(like)
    if qmap.dtype != torch.float32 or not torch.equal(qmap.cpu().view(torch.int32), ours.view(torch.int32)):
        raise CheckpointError(
            f"{where}: 'qmap{k}' is not this optimizer's map for that moment ({len(ours)} float32 values of "
            f"the {like.bits!r}-bit {'signed' if like.signed else 'unsigned'} format): another class?"
        )
    want_codes, want_scale = tuple(like.codes.shape), tuple(like.scale.shape)
    if codes.dtype != torch.uint8 or tuple(codes.shape) != want_codes or tuple(scale.shape) != want_scale:
        raise CheckpointError(
            f"{where}: expected uint8 codes of shape {want_codes} and {want_scale} scales (blocks of "
            f"{like.block}); the checkpoint has {codes.dtype} codes of shape {tuple(codes.shape)} and "
            f"{tuple(scale.shape)} scales (another block_size?)"
        )
    device = like.codes.device
    return dataclasses.replace(
        like,
        codes=codes.detach().to(device, copy=True),
        scale=scale.detach().to(device, torch.float32, copy=True),
    )
