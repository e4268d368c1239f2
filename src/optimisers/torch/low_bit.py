"""bitsandbytes' and torchao's low-bit optimizer classes, trained by this library's `LowBit`
(docs/low-precision.md): `AdamW8bit`, `Adam8bit`, `PagedAdamW8bit`, `Lion8bit`, `AdamW4bit`,
`Adam4bit`, `AdamWFp8`, `AdamFp8`.

They take both libraries' keywords with their defaults (bitsandbytes': `optim_bits`, `args`,
`min_8bit_size`, `is_paged`, `percentile_clipping`, `block_wise`; torchao's: `block_size`,
`bf16_stochastic_round`), compute torchao's numbers (`LowBit(AdamW(...))`: dequantise, step with
the new float32 moments, quantise), and keep bitsandbytes 0.50's state layout
(`low_bit_format`), so checkpoints move between these classes and `bnb.optim.AdamW8bit`.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from optimisers.checkpoints.state_dict import CheckpointError
from optimisers.core.rule import Rule
from optimisers.rules.adam import Adam as _Adam
from optimisers.rules.adam import AdamW as _AdamW
from optimisers.rules.adam import Lion as _Lion
from optimisers.rules.combinators import OptimiserChain, _Wrapper
from optimisers.rules.gradient import WeightDecay
from optimisers.rules.low_bit import LowBit
from optimisers.rules.rounding import StochasticRounding
from optimisers.torch.dropin_base import DropIn, check_values, torch_args
from optimisers.torch.low_bit_format import LowBitFormat, unwrapped, wrapped

__all__ = [
    "AdamW8bit", "Adam8bit", "PagedAdamW8bit", "Lion8bit", "AdamW4bit", "Adam4bit", "AdamWFp8", "AdamFp8",
]  # fmt: skip

# keys that bitsandbytes' groups carry for its AdEMAMix (unused by Adam and Lion), at their values
BNB_GROUP_KEYS = {"alpha": 0.0, "t_alpha": None, "t_beta3": None}
# torch.optim's switches, which a torch.optim.Adam/AdamW checkpoint carries; off, they change nothing
TORCH_SWITCHES = ("foreach", "maximize", "capturable", "differentiable", "fused")
# keywords of the two libraries whose other values this library does not do
ONLY = {"amsgrad": False, "optim_bits": 32, "args": None, "percentile_clipping": 100, "block_wise": True}
# what decides the state's layout: changing it in a group after the optimizer is made is refused
STRUCTURE = ("min_8bit_size", "block_size", "bf16_stochastic_round")


class _LowBitDropIn(DropIn):
    """What the classes share: the rule `LowBit(_inner(h), bits, block_size, min_8bit_size)`,
    in `StochasticRounding` with `bf16_stochastic_round`; bitsandbytes' state layout."""

    _Format = LowBitFormat
    _takes_complex = False
    _bits: object = 8
    _decoupled = True  # AdamW's decay (lr·wd·p), else Adam's L2 term added to the gradient

    @property
    def _l2(self):  # (the base adds "weight_decay" to the gradient where this is true)
        return not self._decoupled

    def _check(self, h, where):
        for key, only in ONLY.items():
            if key in h and h[key] != only:
                raise ValueError(
                    f"{where}: {type(self).__name__} takes {key}={only!r} only (got {h[key]!r}); "
                    + ("use torch.optim-style AdamW for amsgrad" if key == "amsgrad" else
                       "this library's low-bit classes do not do other values")
                )  # fmt: skip
        check_values(h, where)
        for key, least in (("block_size", 1), ("min_8bit_size", 0)):
            v = h.get(key)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < least:
                raise ValueError(f"{where}: {key} must be an integer >= {least}, got {v!r}")
        if not isinstance(h.get("bf16_stochastic_round"), bool):
            raise ValueError(
                f"{where}: bf16_stochastic_round must be True or False, got {h['bf16_stochastic_round']!r}"
            )

    def _structure(self, h):
        return tuple(h.get(k) for k in STRUCTURE)

    def _rule(self, h):
        rule = LowBit(
            self._inner(h), bits=self._bits, block=int(h["block_size"]), min_size=int(h["min_8bit_size"])
        )
        return StochasticRounding(rule) if h["bf16_stochastic_round"] else rule

    def _inner(self, h):
        lr, betas = float(h["lr"]), tuple(float(b) for b in h["betas"])
        if self._decoupled:
            return _AdamW(lr, betas, float(h["weight_decay"]), float(h["eps"]))
        return _Adam(lr, betas, float(h["eps"]))

    # the rule's state: LowBit(Adam)'s `(m, v, t)`, inside StochasticRounding's `(inner, t, dtype)`
    def _moments_and_step(self, state):
        inner = state[0] if isinstance(state, tuple) and len(state) == 3 and _is_rounding(state) else state
        *moments, step = inner
        return moments, step

    def _with_moments_and_step(self, template, moments, step):
        if _is_rounding(template):
            inner, _, dtype = template
            return (*moments, step), (step if dtype is not None else 0), dtype
        return (*moments, step)

    def state_dict(self) -> dict:
        """bitsandbytes' layout: the quantised keys of each entry nested under
        `__bnb_optimizer_quant_state__` (`state[p]` shows them flat, as bitsandbytes' does)."""
        out = super().state_dict()
        return {
            **out,
            "state": {k: wrapped(v) if isinstance(v, dict) else v for k, v in out["state"].items()},
        }

    def load_state_dict(self, state_dict) -> None:
        """This class's, bitsandbytes' (`bnb.optim.AdamW8bit` & co.) or torch.optim's Adam/AdamW
        state dict (its moments quantised here); checked in full first, then loaded."""
        if isinstance(state_dict, dict) and isinstance(state_dict.get("param_groups"), list):
            state = state_dict.get("state")
            state_dict = {
                **state_dict,
                "state": {k: unwrapped(v) for k, v in state.items()} if isinstance(state, dict) else state,
                "param_groups": [self._own_keys(g, i) for i, g in enumerate(state_dict["param_groups"])],
            }
        super().load_state_dict(state_dict)

    def _own_keys(self, group, i: int):
        """A saved group without the other library's keys that change nothing here (bitsandbytes'
        AdEMAMix keys at their values, torch.optim's switches off); a clear error for the rest."""
        if not isinstance(group, dict):
            return group
        out = dict(group)
        for key, value in [*BNB_GROUP_KEYS.items(), *((k, False) for k in TORCH_SWITCHES)]:
            if key in out and key not in self._hyper:
                if out[key] not in (value, None):
                    raise CheckpointError(
                        f"group {i} of the checkpoint has {key}={out[key]!r}, which {type(self).__name__} "
                        "does not do; it loads checkpoints of bitsandbytes' and torch.optim's Adam/AdamW "
                        "with their defaults"
                    )
                del out[key]
        if "decoupled_weight_decay" in out and "decoupled_weight_decay" not in self._hyper:
            if bool(out.pop("decoupled_weight_decay")) != self._decoupled:
                raise CheckpointError(
                    f"group {i} of the checkpoint decays weights "
                    f"{'as AdamW' if not self._decoupled else 'as Adam (L2)'}, {type(self).__name__} "
                    f"{'as AdamW' if self._decoupled else 'as Adam'}: load it into the matching class"
                )
        return out


def _is_rounding(state) -> bool:
    """Whether `state` is StochasticRounding's `(inner, t, dtype)` (its inner part a tuple)."""
    return isinstance(state, tuple) and len(state) == 3 and isinstance(state[0], tuple)


_ORDER = ("lr betas eps weight_decay amsgrad optim_bits args min_8bit_size is_paged percentile_clipping "
          "block_wise block_size bf16_stochastic_round")  # fmt: skip


def _group(args: dict) -> dict:
    """A class's `__init__` arguments as its group keys, in one order for all the classes."""
    return torch_args(args, " ".join(k for k in _ORDER.split() if k in args))


class AdamW8bit(_LowBitDropIn):
    """`bnb.optim.AdamW8bit` / `torchao.optim.AdamW8bit`, trained by `LowBit(AdamW(...), bits=8)`:
    moments in bitsandbytes' dynamic maps (m signed, v unsigned), blocks of `block_size`, for
    parameters of `min_8bit_size` elements or more; bitsandbytes' `state[p]`/`state_dict`. `is_paged`
    is taken and changes nothing (the state is made as the parameter's, on its device)."""

    _bits = 8

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, is_paged=False, *, percentile_clipping=100,
                 block_wise=True, block_size=256, bf16_stochastic_round=False):  # fmt: skip
        super().__init__(params, _group(locals()))


class PagedAdamW8bit(AdamW8bit):
    """`bnb.optim.PagedAdamW8bit`: `AdamW8bit` (this library does not page; where there is no
    CUDA, bitsandbytes' is AdamW8bit too)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, *, percentile_clipping=100, block_wise=True,
                 block_size=256, bf16_stochastic_round=False):  # fmt: skip
        is_paged = True
        DropIn.__init__(self, params, _group(locals()))


class Adam8bit(AdamW8bit):
    """`torchao.optim.Adam8bit` / `bnb.optim.Adam8bit`: `AdamW8bit` with `weight_decay` (default 0)
    added to the gradient, torchao's (L2)."""

    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, is_paged=False, *, percentile_clipping=100,
                 block_wise=True, block_size=256, bf16_stochastic_round=False):  # fmt: skip
        DropIn.__init__(self, params, _group(locals()))


class AdamW4bit(_LowBitDropIn):
    """`torchao.optim.AdamW4bit`, trained by `LowBit(AdamW(...), bits=4)`: torchao's 4-bit maps in
    blocks of `block_size` (128), two codes a byte; the 8-bit classes' state keys."""

    _bits = 4

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 block_size=128, bf16_stochastic_round=False, min_8bit_size=4096):  # fmt: skip
        super().__init__(params, _group(locals()))


class Adam4bit(AdamW4bit):
    """`torchao.optim.Adam4bit`: `AdamW4bit` with `weight_decay` (default 0) added to the gradient."""

    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, *,
                 block_size=128, bf16_stochastic_round=False, min_8bit_size=4096):  # fmt: skip
        DropIn.__init__(self, params, _group(locals()))


class AdamWFp8(_LowBitDropIn):
    """`torchao.optim.AdamWFp8`, trained by `LowBit(AdamW(...), bits="fp8")`: float8_e4m3fn codes,
    blocks of `block_size` (256) scaled by absmax/448 (kept as `absmaxK`); the 8-bit keys."""

    _bits = "fp8"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 block_size=256, bf16_stochastic_round=False, min_8bit_size=4096):  # fmt: skip
        super().__init__(params, _group(locals()))


class AdamFp8(AdamWFp8):
    """`torchao.optim.AdamFp8`: `AdamWFp8` with `weight_decay` (default 0) added to the gradient."""

    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, *,
                 block_size=256, bf16_stochastic_round=False, min_8bit_size=4096):  # fmt: skip
        DropIn.__init__(self, params, _group(locals()))


@dataclass(frozen=True, repr=False)
class _StepCounted(_Wrapper):
    """`rule`, with a count of its steps beside its state `(inner, t)`: bitsandbytes keeps a
    `step` for Lion, which needs none."""

    rule: Rule
    elementwise = False  # (its count is per parameter, as bitsandbytes' is)

    def init(self, x):
        return self.rule.init(x), 0

    def apply(self, state, x, dx):
        inner, step = self.rule.apply(state[0], x, dx)
        return (inner, state[1] + 1), step


class Lion8bit(_LowBitDropIn):
    """`bnb.optim.Lion8bit`, trained by `LowBit(OptimiserChain(Lion(lr, betas), WeightDecay(lr·wd)))`
    (momentum in the signed dynamic map; the decay decoupled, `p ← p·(1 − lr·wd)`, as
    bitsandbytes'), with a step count. Its keys: `step`, `state1`, `qmap1`, `absmax1`."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0, args=None, min_8bit_size=4096,
                 is_paged=False, *, percentile_clipping=100, block_wise=True, block_size=256,
                 bf16_stochastic_round=False):  # fmt: skip
        eps = 0.0  # (a group key of bitsandbytes' Lion, which it reads and does not use)
        super().__init__(params, _group(locals()))

    def _check(self, h, where):
        super()._check(h, where)
        if h.get("eps") != 0:
            raise ValueError(f"{where}: Lion8bit takes eps=0.0 only (Lion has no epsilon), got {h['eps']!r}")

    def _rule(self, h):
        return _StepCounted(super()._rule(h))

    def _inner(self, h):
        lr = float(h["lr"])
        lion = _Lion(lr, tuple(float(b) for b in h["betas"]))
        return OptimiserChain(lion, WeightDecay(lr * float(h["weight_decay"])))

    # the rule's state: `(inner, step)`, inner the chain's `(m, None)` or StochasticRounding's
    # `(chain, t, dtype)`
    def _moments_and_step(self, state):
        inner, step = state
        chain = inner[0] if len(inner) == 3 else inner
        return [chain[0]], step

    def _with_moments_and_step(self, template, moments, step):
        inner, _ = template
        if len(inner) == 3:
            chain, _, dtype = inner
            return ((moments[0], *chain[1:]), (step if dtype is not None else 0), dtype), step
        return (moments[0], *inner[1:]), step
