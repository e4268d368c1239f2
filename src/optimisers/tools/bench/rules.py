"""The rules the bench steps: one `BenchRule` per rule in `RULES`, holding everything the rows of
that rule need (ours, its torch and optax peers, a naive NumPy formula, the bytes of its floor).

To bench another rule, add one entry to `RULES`: the rule, at hyperparameters where its peers
compute the same steps (the rule's docstring says where they differ) and with steps well above the
check's tolerance (about 1e-7 for the parameters of about 0.02: steps of 1e-5 or more). Its
torch.optim and optax peers are built from it by the table of peers (`peers`, which the
repository's tests read too); a peer from elsewhere is given by hand. A library without the rule
gets `None`: its rows say so ("—") instead of running.

The naive formula (in `naive`, with the hyperparameters in `hyperparameters`) is written once, for
any float dtype: run in float32 it is the "naive NumPy loop" row, run in float64 it is the
reference every row is checked against (without one, rows are timed but unchecked). `--rules all`
runs every entry: every elementwise rule the library exports has one, on its own or in a chain.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import optimisers as opt

from . import naive, peers
from .hyperparameters import (  # the same for every implementation of a rule
    ALPHA_ADEMAMIX,
    ALPHA_LOOKAHEAD,
    BETA_MUON,
    BETAS,
    BETAS_ADEMAMIX,
    BETAS_ADOPT,
    BETAS_LION,
    BETAS_OADAM,
    CLIP,
    CLIP_VALUE,
    DECAY_ADAFACTOR,
    DECAY_MUON,
    EPS,
    EPS_ADABELIEF,
    EPS_ADADELTA,
    EPS_ADAFACTOR,
    EPS_ADAGRAD,
    EPS_ADAMAX,
    EPS_ADOPT,
    EPS_CHAINS,
    EPS_LAMB,
    ETAS_RPROP,
    K_LOOKAHEAD,
    L1_DECAY,
    L2_DECAY,
    LR_ADAFACTOR,
    LR_ADAM,
    LR_LAMB,
    LR_LARS,
    LR_MOMENTUM,
    LR_MUON,
    LR_SF_ADAMW,
    LR_SF_SGD,
    LR_SOAP,
    RHO,
    STEP_SIZES_RPROP,
    TRUST_LARS,
    WEIGHT_DECAY,
)
from .models import ATOL, RTOL, agrees, agrees_but_a_few
from .naive import Naive

#: torch.optim's three ways of running one rule: the bench's torch rows, by kind.
TORCH_OPTIM_VARIANTS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


@dataclass(frozen=True)
class TorchPeer:
    """A torch optimiser with the rule. `make(torch, params, **flags)` builds it over a list of
    `torch.nn.Parameter` whose `.grad` is set; `variants` are the bench's torch rows it has
    (kind -> the keyword arguments that select it). A class from another package (no
    foreach/fused) has just `{"loop": {}}`; its other rows say so."""

    name: str  # e.g. "torch.optim.Adam", for the rows that say it lacks a variant
    make: Callable[..., Any]
    variants: dict = field(default_factory=lambda: dict(TORCH_OPTIM_VARIANTS))


@dataclass(frozen=True)
class OptaxPeer:
    """An optax transformation with the rule: `make(optax)`. A transformation that trains more
    than the parameters (optax.lookahead trains `LookaheadParams(fast, slow)`) gives `wrap(params)`,
    what it trains, and `unwrap(trained)`, the parameters the model holds."""

    make: Callable[[Any], Any]
    wrap: Callable[[Any], Any] = lambda params: params
    unwrap: Callable[[Any], Any] = lambda trained: trained


def every_shape(shape) -> str | None:
    """The default shape predicate: every shape is fine."""
    return None


def only_matrices(shape) -> str | None:
    """The shape predicate of a rule whose peers take only parameters of two or more dimensions
    (Muon, SOAP): why `shape` cannot be run, or None."""
    vectors = sum(len(s) < 2 for s in shape.shapes)
    if vectors:
        return f"needs >=2-D parameters; {shape.name} has {vectors} of fewer dimensions"
    return None


@dataclass(frozen=True)
class BenchRule:
    """One rule of the bench. `ours()` is the `optimisers` rule; `torch`, `optax`, `naive` the peers
    (None where a library lacks the rule); `bytes_per_param` the DRAM bytes per float32 parameter
    of one step of an ideal streaming implementation, counted as STREAM counts them (each array
    read or written once, write-allocate traffic not counted; the floor of a step is this times the
    distinct parameters over the measured bandwidth), with `bytes_model` saying how (None: not a
    streaming rule, e.g. one whose per-array norms need a pass before the step: no floor);
    `shapes(shape)` why a shape cannot be run, or None; `in_default_run`: run without `--rules`;
    `tolerance` (atol, rtol) against the float64 reference, or `check(got, ref) -> (ok, largest
    |err|)` with `check_text` saying what it allows. A low-precision entry names its float32 rule
    (`anchor`): its torch.optim and optax rows run that rule, as the anchor its rows are timed
    against, and are checked against that rule's reference; `others` are its torch peers from
    other packages (package -> peer, each a row of its own) and `drop_in(torch, params)` our
    drop-in class (else the table of peers gives it)."""

    name: str  # the --rules name
    title: str  # how the rows name it ("torch.optim has no LAMB")
    ours: Callable[[], opt.Rule]
    torch: TorchPeer | None
    optax: OptaxPeer | None
    naive: Naive | None
    bytes_per_param: int | None
    bytes_model: str
    shapes: Callable[[Any], str | None] = every_shape
    in_default_run: bool = False
    tolerance: tuple = (ATOL, RTOL)
    check: Callable[[list, list], tuple] | None = None
    check_text: str | None = None
    anchor: str | None = None
    others: dict = field(default_factory=dict)
    drop_in: Callable[..., Any] | None = None

    def agreement(self, got: list, ref: list) -> tuple[bool, float]:
        """`(got agrees with ref, the largest absolute error)`, as this entry checks its rows."""
        return self.check(got, ref) if self.check is not None else agrees(got, ref, *self.tolerance)

    def describe_check(self) -> str:
        return self.check_text or f"|err| <= {self.tolerance[0]:g} + {self.tolerance[1]:g}|x|"


# --- torch peers written by hand (a training loop's gradient surgery, another package) ---------


class _ClippedEachTensor:
    """torch's AdamW after clipping each tensor's gradient to norm CLIP (a loop of
    `clip_grad_norm_` over the tensors, as a training loop writes it); `.grad` is put back first
    (the bench sets it once, and clipping scales it in place)."""

    def __init__(self, torch, params, **kw):
        self.torch, self.params = torch, params
        self.grads = [p.grad.clone() for p in params]
        self.optimizer = torch.optim.AdamW(params, lr=LR_ADAM, betas=BETAS, eps=EPS,
                                           weight_decay=WEIGHT_DECAY, **kw)

    def step(self):
        for p, g in zip(self.params, self.grads):
            p.grad.copy_(g)
            self.torch.nn.utils.clip_grad_norm_([p], CLIP)
        self.optimizer.step()


class _GradsPutBack:
    """A torch optimiser whose `.grad` is put back before each step, untimed (`prepare`), as a
    training loop's backward pass writes a new one: torch's foreach SGD with Nesterov adds the
    momentum into `.grad` in place, and the bench sets it once."""

    def __init__(self, optimizer, params):
        self.optimizer, self.params = optimizer, params
        self.grads = [p.grad.clone() for p in params]

    def prepare(self):
        for p, g in zip(self.params, self.grads):
            p.grad.copy_(g)

    def step(self):
        self.optimizer.step()


class _GradsRestored(_GradsPutBack):
    """The same with the copy inside the timed step: schedulefree's AdamW divides `.grad` in place
    (its row times the copy too)."""

    prepare = None  # (the copy is the step's)

    def step(self):
        _GradsPutBack.prepare(self)
        self.optimizer.step()


def _schedulefree_torch(name: str, restore_grads: bool = False, **kwargs):
    """A `schedulefree` package optimiser over the parameters, in train mode (it starts in eval)."""

    def make(torch, params, **flags):
        import schedulefree

        optimizer = getattr(schedulefree, name)(params, **kwargs, **flags)
        optimizer.train()
        return _GradsRestored(optimizer, params) if restore_grads else optimizer

    return make


def _grads_put_back(rule: opt.Rule) -> TorchPeer:
    """The torch.optim peer of `rule` in the table of peers, its gradients put back before each step."""
    torch_optim = peers.TORCH[type(rule)]
    return TorchPeer(f"torch.optim.{torch_optim.name}",
                     lambda torch, ps, **kw: _GradsPutBack(torch_optim.make(rule, ps, **kw), ps))


class _ClippedValues:
    """torch.optim.Adam with L2 decay (`weight_decay`, added to the gradient) after
    `clip_grad_value_`, as a training loop writes it. Clipping twice is clipping once, so the
    `.grad` the bench sets once stays the gradient the step sees; the clipping runs over the
    tensors as the optimiser's variant does (a loop, foreach, or torch's default)."""

    def __init__(self, torch, params, **kw):
        self.torch, self.params, self.foreach = torch, params, kw.get("foreach")
        self.optimizer = torch.optim.Adam(params, lr=LR_ADAM, betas=BETAS, eps=EPS_CHAINS,
                                          weight_decay=L2_DECAY, **kw)

    def step(self):
        self.torch.nn.utils.clip_grad_value_(self.params, CLIP_VALUE, foreach=self.foreach)
        self.optimizer.step()


def _clip_wd_adam_optax(optax):
    return optax.chain(optax.clip(CLIP_VALUE), optax.add_decayed_weights(L2_DECAY),
                       optax.adam(LR_ADAM, b1=BETAS[0], b2=BETAS[1], eps=EPS_CHAINS))


def _oadam_optax(optax):
    """optax's optimistic Adam (alpha = beta = 1, no Nesterov) with its first update doubled: it
    takes the current Adam step for the missing previous one, where ours (and the paper) takes
    zero, so its first step is half of ours; from the second step on the two coincide (the
    doubling is one multiplication, which XLA fuses into the step)."""
    import jax.numpy as jnp

    return optax.chain(
        optax.optimistic_adam_v2(LR_ADAM, alpha=1.0, beta=1.0, b1=BETAS_OADAM[0], b2=BETAS_OADAM[1], eps=EPS,
                                 nesterov=False),
        optax.scale_by_schedule(lambda count: jnp.where(count == 0, 2.0, 1.0)),
    )


def _lookahead_params(params):
    """What optax.lookahead trains, both parts at `params`; the slow part a copy, not the same
    arrays, since jit cannot donate one buffer twice."""
    import jax
    import optax

    return optax.LookaheadParams(fast=params, slow=jax.tree.map(lambda a: a.copy(), params))


# --- low-precision state (LowBit) ---------------------------------------------------------------

# Quantised moments make the trajectory differ from float32 AdamW's by the quantisation error, so
# these rows are checked against AdamW whose moments are quantised after each step, in float64
# (`naive.low_bit_adamw`): the same trajectory up to float32 rounding, except where a float32
# moment and the float64 one fall on either side of a rounding midpoint of the map and take
# different codes (about 1 element in 10^6 on S2). The check allows that: at most a fraction
# LOW_BIT_FLIPS of the elements beyond the float32 tolerance, none further than one step (a flipped
# code changes the later steps by a fraction of a step each). It fails for a row that does not
# quantise (float32 AdamW: ~99% of the elements beyond), uses another map, block or order, or
# starts from other moments.
LOW_BIT_FLIPS = 1e-4
_LOW_BIT_CHECK = (f"|err| <= {ATOL:g} + {RTOL:g}|x| but for <= {LOW_BIT_FLIPS:g} of the elements "
                  f"(a code flipped at a rounding midpoint), those <= {LR_ADAM:g}")


def _low_bit_check(got: list, ref: list) -> tuple[bool, float]:
    return agrees_but_a_few(got, ref, ATOL, RTOL, LOW_BIT_FLIPS, LR_ADAM)


_ADAMW = opt.AdamW(eta=LR_ADAM, beta=BETAS, lambd=WEIGHT_DECAY, epsilon=EPS)
_ADAMW_KW = dict(lr=LR_ADAM, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
# torch.optim's fused AdamW in float32: the anchor the low-bit rows are timed against
_FLOAT32_ADAMW = TorchPeer("float32 torch.optim.AdamW",
                           lambda torch, ps, **kw: torch.optim.AdamW(ps, **_ADAMW_KW, **kw),
                           variants={"fused": {"fused": True}})


def _bitsandbytes(name: str) -> TorchPeer:
    def make(torch, params):
        import bitsandbytes

        return getattr(bitsandbytes.optim, name)(params, **_ADAMW_KW)  # (min_8bit_size 4096, as ours)

    return TorchPeer(f"bitsandbytes.optim.{name}", make, variants={"loop": {}})


def _torchao(name: str) -> TorchPeer:
    def make(torch, params):
        import torchao.optim

        return getattr(torchao.optim, name)(params, **_ADAMW_KW)

    return TorchPeer(f"torchao.optim.{name}", make, variants={"loop": {}})


def _low_bit_entry(name: str, bits, bytes_model: str, others: dict) -> BenchRule:
    """`LowBit(AdamW, bits)`: ours, its drop-in (`optimisers.torch.<drop_in>`), the packages'
    classes, and float32 AdamW (torch.optim fused, optax.adamw) as the anchor."""
    drop_in = {8: "AdamW8bit", 4: "AdamW4bit", "fp8": "AdamWFp8"}[bits]

    def make_drop_in(torch, params):
        import optimisers.torch

        return getattr(optimisers.torch, drop_in)(params, **_ADAMW_KW)

    title = f"LowBit(AdamW, {bits!r})"
    optax_adamw = OptaxPeer(lambda optax: peers.OPTAX[opt.AdamW](optax, _ADAMW))
    return BenchRule(name, title, lambda: opt.LowBit(_ADAMW, bits=bits), _FLOAT32_ADAMW, optax_adamw,
                     naive.low_bit_adamw(bits), None, bytes_model, check=_low_bit_check,
                     check_text=_LOW_BIT_CHECK, anchor="adamw", others=others, drop_in=make_drop_in)


_LOW_BIT_BYTES = ("not streaming (each block's scale needs a pass over the block before its codes are "
                  "written): no floor; state {} bytes per parameter of the quantised arrays")

# --- the table ----------------------------------------------------------------------------------

_ADAM_BYTES = "read x, g, m, v; write x, m, v: 7 arrays x 4 bytes = 28"
_NORMS = "not streaming (its per-array norms need a pass over the array before the step): no floor"
_ONE_STATE = "read x, g, s; write x, s: 5 arrays x 4 bytes = 20"
_TWO_STATES = "as Adam: read x, g and two state arrays; write x and both: 7 arrays x 4 bytes = 28"
_THREE_STATES = "read x, g and three state arrays; write x and the three: 9 arrays x 4 bytes = 36"

def _entry(name: str, title: str, rule: opt.Rule, formula: Naive | None, bytes_per_param: int | None,
           bytes_model: str, **given) -> BenchRule:
    """The entry of `rule`, whose peers, unless given, are its own in the table of peers."""
    torch_optim, optax_peer = peers.TORCH.get(type(rule)), peers.OPTAX.get(type(rule))
    if "torch" not in given and torch_optim is not None:
        variants = {k: v for k, v in TORCH_OPTIM_VARIANTS.items() if k != "fused" or torch_optim.fused}
        given["torch"] = TorchPeer(f"torch.optim.{torch_optim.name}",
                                   lambda torch, ps, **kw: torch_optim.make(rule, ps, **kw), variants)
    if "optax" not in given and optax_peer is not None:
        given["optax"] = OptaxPeer(lambda optax: optax_peer(optax, rule))
    return BenchRule(name, title, lambda: rule, given.pop("torch", None), given.pop("optax", None), formula,
                     bytes_per_param, bytes_model, **given)


RULES: dict[str, BenchRule] = {r.name: r for r in [
    _entry("adam", "Adam", opt.Adam(eta=LR_ADAM, beta=BETAS, epsilon=EPS), naive.adam(), 28, _ADAM_BYTES,
           in_default_run=True),
    _entry("adamw", "AdamW", opt.AdamW(eta=LR_ADAM, beta=BETAS, lambd=WEIGHT_DECAY, epsilon=EPS),
           naive.adam(decay=WEIGHT_DECAY), 28, "as Adam (the decay reads x, which Adam already reads): 28",
           in_default_run=True),
    _entry("momentum", "Momentum", opt.Momentum(eta=LR_MOMENTUM, rho=RHO), naive.momentum,
           20, "read x, g, v; write x, v: 5 arrays x 4 bytes = 20", in_default_run=True),
    # each array's gradient clipped to a norm, then AdamW: optax clips by the global norm or a
    # block's RMS only, so it has no peer here
    _entry("clip-adamw", "ClipNorm+AdamW",
           opt.OptimiserChain(opt.ClipNorm(CLIP), opt.AdamW(eta=LR_ADAM, beta=BETAS, lambd=WEIGHT_DECAY,
                                                            epsilon=EPS)),
           naive.clip_adamw, None,
           "not streaming (each array's norm needs a pass over its gradient before the step): no floor",
           torch=TorchPeer("torch clip_grad_norm_ per tensor + AdamW", _ClippedEachTensor)),
    _entry("lamb", "LAMB", opt.LAMB(eta=LR_LAMB, beta=BETAS, epsilon=EPS_LAMB, lambd=WEIGHT_DECAY),
           naive.lamb, None, _NORMS),
    _entry("lars", "LARS", opt.LARS(eta=LR_LARS, beta=RHO, lambd=WEIGHT_DECAY, trust=TRUST_LARS, epsilon=0.0),
           naive.lars, None, _NORMS),
    _entry("adopt", "ADOPT", opt.ADOPT(eta=LR_ADAM, beta=BETAS_ADOPT, epsilon=EPS_ADOPT), naive.adopt,
           28, "as Adam: read x, g, m, v; write x, m, v = 28"),
    _entry("ademamix", "AdEMAMix",
           opt.AdEMAMix(eta=LR_ADAM, beta=BETAS_ADEMAMIX, alpha=ALPHA_ADEMAMIX, epsilon=EPS,
                        lambd=WEIGHT_DECAY),
           naive.ademamix, 36, "read x, g, m1, m2, v; write x, m1, m2, v: 9 arrays x 4 bytes = 36"),
    # optax.lookahead trains LookaheadParams(fast, slow): the model is its fast part
    _entry("lookahead", "Lookahead(Adam)",
           opt.Lookahead(opt.Adam(eta=LR_ADAM, beta=BETAS, epsilon=EPS), k=K_LOOKAHEAD,
                         alpha=ALPHA_LOOKAHEAD),
           naive.lookahead(naive.adam(), K_LOOKAHEAD, ALPHA_LOOKAHEAD),
           28, "Adam's 28 on the median step (a synchronisation, every k-th step, also reads and "
           "writes the slow copy)",
           optax=OptaxPeer(
               lambda optax: optax.lookahead(optax.adam(LR_ADAM, b1=BETAS[0], b2=BETAS[1], eps=EPS),
                                             sync_period=K_LOOKAHEAD, slow_step_size=ALPHA_LOOKAHEAD),
               wrap=_lookahead_params,
               unwrap=lambda trained: trained.fast,
           )),
    _entry("adafactor", "Adafactor",
           opt.Adafactor(eta=LR_ADAFACTOR, beta2_decay=DECAY_ADAFACTOR, epsilon=EPS_ADAFACTOR),
           naive.adafactor, None,
           "not streaming (the update's RMS needs a pass over the array before the step): no floor"),
    # the schedulefree package (the oracle) and optax.contrib agree without warm-up and with r = 0
    _entry("sf-adamw", "ScheduleFreeAdamW", opt.ScheduleFreeAdamW(eta=LR_SF_ADAMW, beta=BETAS, epsilon=EPS),
           naive.schedule_free(adam=True),
           36, "read y, g, z, v; write y, z, v: 7 arrays, plus the z read again for y = 36 at most",
           torch=TorchPeer("schedulefree.AdamWScheduleFree",
                           _schedulefree_torch("AdamWScheduleFree", restore_grads=True, lr=LR_SF_ADAMW,
                                               betas=BETAS, eps=EPS),
                           variants={"loop": {}})),
    _entry("sf-sgd", "ScheduleFreeSGD", opt.ScheduleFreeSGD(eta=LR_SF_SGD, beta=RHO),
           naive.schedule_free(adam=False), 20, "read y, g, z; write y, z: 5 arrays x 4 bytes = 20",
           torch=TorchPeer("schedulefree.SGDScheduleFree",
                           _schedulefree_torch("SGDScheduleFree", lr=LR_SF_SGD, momentum=RHO),
                           variants={"loop": {}})),
    _entry("muon", "Muon", opt.Muon(eta=LR_MUON, beta=BETA_MUON, lambd=DECAY_MUON, nesterov=False),
           naive.muon, None, "not streaming (matrix products): no floor", shapes=only_matrices,
           torch=TorchPeer("torch.optim.Muon",
                           lambda torch, ps, **kw: torch.optim.Muon(ps, lr=LR_MUON, weight_decay=DECAY_MUON,
                                                                    momentum=BETA_MUON, nesterov=False, **kw),
                           variants={"loop": {}})),
    # no torch.optim or optax SOAP: ours alone, timed and unchecked (tests/test_soap.py checks it
    # against the paper's algorithm and heavyball's)
    _entry("soap", "SOAP", opt.SOAP(eta=LR_SOAP), None,
           None, "not streaming (matrix products with its eigenbases): no floor"),
    # --- every other elementwise rule, and a chain of elementwise rules --------------------------
    _entry("descent", "Descent", opt.Descent(eta=LR_MOMENTUM), naive.descent,
           12, "read x, g; write x: 3 arrays x 4 bytes = 12"),
    _entry("nesterov", "Nesterov", opt.Nesterov(eta=LR_MOMENTUM, rho=RHO), naive.nesterov, 20,
           "as Momentum: read x, g, v; write x, v = 20",
           torch=_grads_put_back(opt.Nesterov(eta=LR_MOMENTUM, rho=RHO))),
    _entry("rmsprop", "RMSProp", opt.RMSProp(eta=LR_ADAM, rho=RHO, epsilon=EPS), naive.rmsprop,
           20, _ONE_STATE),
    # (one gradient every step: no sign flips, so the steps grow; tests/test_rules.py flips them)
    _entry("rprop", "Rprop", opt.Rprop(eta=LR_ADAM, ell=ETAS_RPROP, gamma=STEP_SIZES_RPROP), naive.rprop,
           28, "read x, g, the last gradient p and the step sizes s; write x, p, s: 7 arrays x 4 bytes = 28"),
    _entry("adagrad", "AdaGrad", opt.AdaGrad(eta=LR_ADAM, epsilon=EPS_ADAGRAD), naive.adagrad,
           20, _ONE_STATE),
    _entry("adadelta", "AdaDelta", opt.AdaDelta(rho=RHO, epsilon=EPS_ADADELTA), naive.adadelta, 28,
           _TWO_STATES),
    # torch.optim.RAdam rectifies from ρₜ > 5 (we and optax from 4: only step 5 differs) and puts ε
    # elsewhere: the check's three steps are unrectified (ρₜ < 4), where all three agree; the timed
    # steps are rectified, the formula each library keeps from then on
    _entry("radam", "RAdam", opt.RAdam(eta=LR_ADAM, beta=BETAS, epsilon=EPS), naive.radam, 28, _TWO_STATES),
    # torch.optim.NAdam's momentum schedule is Dozat's, which no setting makes ours: optax only
    _entry("nadam", "NAdam", opt.NAdam(eta=LR_ADAM, beta=BETAS, epsilon=EPS), naive.nadam, 28, _TWO_STATES),
    _entry("adamax", "AdaMax", opt.AdaMax(eta=LR_ADAM, beta=BETAS, epsilon=EPS_ADAMAX), naive.adamax, 28,
           _TWO_STATES),
    # torch's Adam(amsgrad=True) takes the maximum of the uncorrected v: optax only. The bench steps
    # with one gradient, where the corrected v never decreases and AMSGrad's maximum is Adam's v:
    # its check tells its rows from a wrong formula, not from Adam (tests/test_rules.py does that)
    _entry("amsgrad", "AMSGrad", opt.AMSGrad(eta=LR_ADAM, beta=BETAS, epsilon=EPS), naive.amsgrad, 36,
           _THREE_STATES),
    _entry("adabelief", "AdaBelief", opt.AdaBelief(eta=LR_ADAM, beta=BETAS, epsilon=EPS_ADABELIEF),
           naive.adabelief, 28, _TWO_STATES),
    _entry("oadam", "OAdam", opt.OAdam(eta=LR_ADAM, beta=BETAS_OADAM, epsilon=EPS), naive.oadam, 36,
           _THREE_STATES, optax=OptaxPeer(_oadam_optax)),
    _entry("lion", "Lion", opt.Lion(eta=LR_ADAM, beta=BETAS_LION), naive.lion, 20, _ONE_STATE),
    # clip_grad_value_ then Adam(weight_decay) in torch: the decay is added to the clipped gradient
    _entry("clip-wd-adam", "ClipGrad+WeightDecay+Adam",
           opt.OptimiserChain(opt.ClipGrad(CLIP_VALUE), opt.WeightDecay(L2_DECAY),
                              opt.Adam(eta=LR_ADAM, beta=BETAS, epsilon=EPS_CHAINS)),
           naive.clip_wd_adam, 28, "as Adam (the clipping and the decay read g and x, which Adam reads): 28",
           torch=TorchPeer("torch clip_grad_value_ + Adam(weight_decay)", _ClippedValues),
           optax=OptaxPeer(_clip_wd_adam_optax)),
    # L1 decay: neither torch.optim nor optax has it, so ours and the naive loop alone. With
    # Momentum, not Adam: an element whose x comes within rounding of 0 takes the other sign's decay
    # in float32, and Adam's float32 β₂ widens that window a hundredfold (S1 has such elements)
    _entry("sign-decay-momentum", "SignDecay+Momentum",
           opt.OptimiserChain(opt.SignDecay(L1_DECAY), opt.Momentum(eta=LR_MOMENTUM, rho=RHO)),
           naive.sign_decay_momentum, 20, "as Momentum (the decay reads x, which Momentum reads): 20"),
    # --- low-precision state (issue 40): LowBit(AdamW) against bitsandbytes and torchao --------
    # (bitsandbytes' CPU quantiser does not always take the nearest code, ~3% of a second moment's
    # codes: its row disagrees. LowBit(bits=4)'s v starts at 1/16 x the smallest scale 1e-12, not
    # 0 as torchao's: on the bench's gradients ~4% of the elements step differently at first, and
    # our 4-bit rows disagree; tests/test_bench.py marks that xfail, strict)
    _low_bit_entry("adamw8bit", 8, _LOW_BIT_BYTES.format("2 + 8/256 = 2.03"),
                   {"bitsandbytes": _bitsandbytes("AdamW8bit"), "torchao": _torchao("AdamW8bit")}),
    _low_bit_entry("adamw4bit", 4, _LOW_BIT_BYTES.format("1 + 8/128 = 1.06"),
                   {"torchao": _torchao("AdamW4bit")}),
    _low_bit_entry("adamwfp8", "fp8", _LOW_BIT_BYTES.format("2 + 8/256 = 2.03"),
                   {"torchao": _torchao("AdamWFp8")}),
]}


def default_rules() -> list[str]:
    """What runs without `--rules`."""
    return [name for name, r in RULES.items() if r.in_default_run]


def checked_as(rule: str, impl) -> str:
    """The entry whose reference and check a row of `impl` on `rule` answers to: the anchor's for
    the float32 rows (torch.optim, optax) of a low-precision entry, else the entry's own."""
    anchor = RULES[rule].anchor
    return anchor if anchor is not None and impl.runs_anchor else rule


def reference(rule: str, data, steps: int) -> list | None:
    """Every parameter after `steps` steps with the same gradients: the naive formula in float64
    (None if the rule has none)."""
    naive = RULES[rule].naive
    if naive is None:
        return None
    xs = [p.astype(np.float64) for p in data.params]
    gs = [g.astype(np.float64) for g in data.grads_sum]
    step = naive(xs)
    for t in range(1, steps + 1):
        step(gs, t)
    return xs
