"""The one list of rules that the generic tests run (not a test module).

Each rule of the library has one `RuleInfo` in `RULES` below, in the style of PyTorch's
OptimizerInfo database: its class, its documented defaults, its independent reference formula
(`rule_reference.py`), flags (takes complex parameters, elementwise), its counterparts in
torch.optim and optax (their mapping of hyperparameters is in the table of peers
`optimisers.tools.bench.peers`, which the bench reads too), and the hyperparameters
that each family of generic tests runs it with. `COMPOSITES` lists the chains and wrappers that
the same tests run. The tests ask the functions at the end of this module for their cases, so a
rule registered here is run by all of them:

- family `toy`, `test_rules.py` (NumPy): convergence on three toy losses, dtypes, purity, pure
  against in place bit for bit, the reference formulas over 20 steps (real and complex), the
  documented defaults; `test_torch_rules.py`: the same cases on torch tensors with a tied weight
  (NumPy's numbers, every float dtype, pure and in place bit for bit, no autograd graph);
  `test_properties.py`: random trees with ties and missing gradients; `test_engine.py` (elementwise
  rules): the in-place engine against the per-Leaf path through freezing, missing gradients and
  adjusting; `test_half_precision.py`: float16/bfloat16 state in the parameter's dtype, pure and
  in place bit for bit (at the `half` hyperparameters where given);
- `jit`: `test_jax_rules.py`, under `jax.jit` with ties, as eagerly; `test_optax_adapter.py`,
  through `optimisers.optax.transform` bit for bit; `test_jax.py`, one trace through a schedule;
- `checkpoint`: `test_checkpoint.py` (NumPy) and `test_checkpoint_backends.py` (torch), a run
  resumed from a checkpoint continues bit for bit;
- `train`: `test_layouts.py`, channels_last, transposed and Fortran-order parameters bit for bit
  against contiguous ones (and against torch.optim where it has the rule);
  `test_torch_optim_reference.py`, torch.optim training a tiny GPT with tied weights;
- `torch64`, `optax64`: `test_rules_vs_libraries.py`, 25 float64 steps on one array to 1e-11;
  `optax32`: `test_jax_rules.py`, 100 jitted float32 steps; `half`: `test_half_precision.py`, no
  less accurate than torch.optim in float16/bfloat16;
- `test_registry.py`: every public rule of the library is registered here, the flags written here
  are the library's, and the reference formulas have the documented defaults.

How to register a new rule
--------------------------
1. Write its reference formula in `rule_reference.py`: a factory taking the rule's hyperparameters
   as keyword arguments with the documented defaults, returning `step(x, g) -> u` (the amount
   subtracted from x; None for no move), from the paper, not from the library's code.
2. Add one `RuleInfo` to `RULES`. For an elementwise optimiser (here `MyRule` with
   hyperparameters eta and beta) that is all:

       RuleInfo(opt.MyRule, dict(eta=1e-3, beta=(0.9, 0.999)), ref.my_rule, toy=[hp(eta=0.05)]),

   The second argument is the documented defaults (checked against the constructor and the
   reference formula). `toy` holds the hyperparameters with which the rule must shrink the loss
   gap of three toy problems tenfold in `toy_steps` (300) steps; give `toy_steps=0` for a gradient
   transformation that is not an optimiser on its own. The families `jit`, `train` and
   `checkpoint` run the rule at its defaults unless given other hyperparameters. Set
   `complex=False` if the rule rejects complex parameters, `elementwise=False` if an element's
   step depends on other elements, and `jit=[]` if it decides in Python (it cannot be traced).
3. If torch.optim or optax has the rule, give the mapping once, in the table of peers that the
   bench shares (`TORCH` and `OPTAX` in `optimisers/tools/bench/peers.py`, both computed from
   the rule instance `r`), and here the hyperparameters to compare at (`torch64`, `optax64`,
   `optax32`, `train`, `half`). Choose them where the two formulas agree (e.g. a small ε where the
   peer puts ε elsewhere) and say why in a comment next to the entry.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

import optimisers as opt
import rule_reference as ref
from optimisers.tools.bench.peers import OPTAX, TORCH, TorchOptim


@dataclasses.dataclass(frozen=True)
class Hyper:
    """Keyword arguments for one instance; `tag` tells instances of one rule apart in test ids."""

    kwargs: dict
    tag: str = ""


def hp(tag: str = "", **kwargs) -> Hyper:
    return Hyper(kwargs, tag)


DEFAULT = (Hyper({}),)  # the rule at its defaults


@dataclasses.dataclass(frozen=True)
class RuleInfo:
    cls: type
    defaults: dict | None  # the documented defaults; None: a hyperparameter has no default
    reference: Callable | None = None  # rule_reference factory, the rule's keyword arguments
    complex: bool = True  # takes complex parameters (else setup raises TypeError)
    # the fewest axes a parameter may have (Muon: 2, it orthogonalises matrices; setup raises
    # ValueError for fewer); the generic tests give their arrays the shapes `shaped` says
    min_ndim: int = 0
    elementwise: bool = True  # each element's step depends on that element alone
    # its steps depend on a basis of eigenvectors, which is arbitrary within a repeated
    # eigenvalue's eigenspace: a matrix's first G Gᵀ has a repeated zero eigenvalue on an axis
    # longer than the other by 2 or more, where NumPy, torch, XLA (and jit and eager) choose
    # different bases, each a valid step. Tests comparing two implementations give such a rule
    # arrays without such an axis (square matrices).
    ambiguous_basis: bool = False
    # sets the parameter to a value far from it (a NewValue): optax's `x + (new − x)` is then
    # `new` only to within a rounding
    sets_value: bool = False
    # hyperparameters per family of generic tests (see the module docstring). The `toy` learning
    # rates are what a user would pick for the well-scaled toy problems; rules without a learning
    # rate run at their defaults and converge only inside a chain.
    toy: Sequence[Hyper] = DEFAULT
    toy_steps: int = 300  # 0: not an optimiser on its own (runs in chains only)
    jit: Sequence[Hyper] = DEFAULT
    checkpoint: Sequence[Hyper] = DEFAULT
    train: Sequence[Hyper] = DEFAULT  # small torch models: strided layouts, torch.optim's numbers
    torch64: Sequence[Hyper] = ()
    optax64: Sequence[Hyper] = ()
    optax32: Sequence[Hyper] = ()
    half: Sequence[Hyper] = ()

    @property
    def name(self) -> str:
        return self.cls.__name__

    @property
    def torch(self) -> TorchOptim | None:
        return TORCH.get(self.cls)

    @property
    def optax(self) -> Callable | None:
        """(optax, rule) -> the transformation whose updates are added."""
        return OPTAX.get(self.cls)

    def make(self, h: Hyper = DEFAULT[0]) -> opt.Rule:
        return self.cls(**h.kwargs)

    def case_id(self, h: Hyper) -> str:
        return f"{self.name}({h.tag})" if h.tag else self.name


RULES: tuple[RuleInfo, ...] = (
    RuleInfo(
        opt.Descent,
        dict(eta=0.1),
        ref.descent,
        toy=[hp(eta=0.1)],
        torch64=[hp(eta=0.1)],
        optax32=[hp(eta=0.1)],
        train=[hp(eta=0.1)],
    ),
    # torch and optax keep lr outside the velocity (b ← ρb + g, x ← x − lr·b), we keep it inside
    # (v ← ρv + η·g): the same for a constant lr. torch's dampening is 0 by default.
    RuleInfo(
        opt.Momentum,
        dict(eta=0.01, rho=0.9),
        ref.momentum,
        toy=[hp(eta=0.02)],
        torch64=[hp(eta=0.01, rho=0.9)],
        optax64=[hp(eta=0.01, rho=0.9)],
        optax32=[hp(eta=0.01, rho=0.9)],
        train=[hp(eta=0.05, rho=0.9)],
        half=[hp(eta=0.05, rho=0.9)],
        checkpoint=[hp(eta=0.01, rho=0.9)],
    ),
    # torch: b ← ρb + g, x ← x − lr·(g + ρb); ours with v = −lr·b is the same for a constant lr
    RuleInfo(
        opt.Nesterov,
        dict(eta=0.001, rho=0.9),
        ref.nesterov,
        toy=[hp(eta=0.02)],
        torch64=[hp(eta=0.01, rho=0.9)],
        optax64=[hp(eta=0.01, rho=0.9)],
        optax32=[hp(eta=0.01, rho=0.9)],
        train=[hp(eta=0.05, rho=0.9)],
        half=[hp(eta=0.05, rho=0.9)],
        checkpoint=[hp(eta=0.01)],
    ),
    # torch's alpha and optax's decay are our rho; optax's default puts ε inside the root
    RuleInfo(
        opt.RMSProp,
        dict(eta=0.001, rho=0.9, epsilon=1e-8, centred=False),
        ref.rmsprop,
        toy=[hp(eta=0.01), hp("centred", eta=0.01, centred=True)],
        jit=[hp(), hp("centred", centred=True)],
        torch64=[
            hp(eta=0.01, rho=0.9, epsilon=1e-8),
            hp("centred", eta=0.01, rho=0.9, epsilon=1e-8, centred=True),
        ],
        optax64=[hp(eta=0.01), hp("centred", eta=0.01, centred=True)],
        optax32=[
            hp(eta=0.01, rho=0.9, epsilon=1e-8),
            hp("centred", eta=0.01, rho=0.9, epsilon=1e-8, centred=True),
        ],
        train=[
            hp(eta=1e-3, rho=0.9, epsilon=1e-8),
            hp("centred", eta=1e-3, rho=0.9, epsilon=1e-8, centred=True),
        ],
        half=[hp(eta=1e-3, rho=0.9)],
        checkpoint=[hp(eta=0.01, centred=True)],
    ),
    # torch's etas = ell = (shrink, grow), step_sizes = gamma = (min, max); both start every step
    # size at lr and take no step where the gradient's sign flipped. optax has no Rprop.
    RuleInfo(
        opt.Rprop,
        dict(eta=1e-3, ell=(0.5, 1.2), gamma=(1e-6, 50.0)),
        ref.rprop,
        complex=False,
        toy=[hp(eta=0.01)],
        torch64=[hp(eta=0.01, ell=(0.5, 1.2), gamma=(1e-6, 50.0))],
        train=[hp(eta=1e-3, ell=(0.5, 1.2), gamma=(1e-6, 50.0))],
        half=[hp(eta=1e-3)],
        checkpoint=[hp(eta=0.01)],
    ),
    RuleInfo(
        opt.Adam,
        dict(eta=0.001, beta=(0.9, 0.999), epsilon=1e-8),
        ref.adam,
        toy=[hp(eta=0.05)],
        torch64=[hp(eta=0.01, beta=(0.9, 0.999), epsilon=1e-8)],
        optax64=[hp(eta=0.01)],
        optax32=[hp(eta=0.01, beta=(0.9, 0.999), epsilon=1e-8)],
        train=[hp(eta=1e-2, beta=(0.9, 0.999), epsilon=1e-8)],
        half=[hp(eta=1e-3)],
        checkpoint=[hp(eta=0.01)],
    ),
    # torch rectifies when ρₜ > 5, we (Optimisers.jl, the paper's code) and optax's threshold=4
    # when ρₜ > 4: with β₂ = 0.999, ρ₅ ≈ 4.996 and only step 5 differs (we rectify, torch takes
    # η·m̂). torch also adds eps to √v before dividing by √(1 − β₂ᵗ), so our ε acts as its
    # eps/√(1 − β₂ᵗ) (proportional to eps); eps=1e-13 compares the rest of the formula.
    RuleInfo(
        opt.RAdam,
        dict(eta=0.001, beta=(0.9, 0.999), epsilon=1e-8),
        ref.radam,
        toy=[hp(eta=0.05)],
        toy_steps=400,  # its warm-up is plain momentum
        optax64=[hp(eta=0.01)],
        optax32=[hp(eta=0.01)],
        train=[hp(eta=1e-2, beta=(0.9, 0.999), epsilon=1e-13)],
        checkpoint=[hp(eta=0.01)],
    ),
    # torch and optax add ε inside the max (w ← max(β₂w, |g| + ε), step ∝ m/w), we add it to the
    # denominator (m/(w + ε)): steps differ by about ε/w relative, so the float64 comparisons with
    # torch take ε = 0 (gradients without exact zeros) or 1e-10
    RuleInfo(
        opt.AdaMax,
        dict(eta=0.001, beta=(0.9, 0.999), epsilon=1e-8),
        ref.adamax,
        toy=[hp(eta=0.05)],
        torch64=[hp(eta=0.01, epsilon=0.0)],
        optax64=[hp(eta=0.01)],
        optax32=[hp(eta=0.01)],
        train=[hp(eta=2e-3, beta=(0.9, 0.999), epsilon=1e-10)],
        half=[hp(eta=2e-3, epsilon=1e-10)],
        checkpoint=[hp(eta=0.01)],
    ),
    # optax.optimistic_adam_v2 differs in the first step: test_rules_vs_libraries and
    # test_jax_rules compare it from the second step on
    RuleInfo(
        opt.OAdam,
        dict(eta=0.001, beta=(0.5, 0.9), epsilon=1e-8),
        ref.oadam,
        toy=[hp(eta=0.05)],
        checkpoint=[hp(eta=0.01)],
    ),
    # our accumulator starts at ε (Optimisers.jl), torch's and optax's at initial_accumulator_value
    RuleInfo(
        opt.AdaGrad,
        dict(eta=0.1, epsilon=1e-8),
        ref.adagrad,
        toy=[hp(eta=0.3)],
        # optax puts ε inside the root: eps=0 and the accumulator's start ε
        torch64=[hp(eta=0.1, epsilon=1e-8)],
        optax32=[hp(eta=0.1, epsilon=1e-8)],
        train=[hp(eta=0.05, epsilon=1e-8)],
        half=[hp(eta=0.01, epsilon=1e-8)],
        checkpoint=[hp(eta=0.1)],
    ),
    # AdaDelta's steps start near √ε·g/|g| and grow slowly (at ε = 1e-8 it barely moves in 1000
    # steps); near a minimum its effective learning rate tends to 1, too much for curvature 10, so
    # on the ill-conditioned problem the gap creeps back up over thousands of steps. It has no
    # learning rate: torch's and optax's lr = 1.
    RuleInfo(
        opt.AdaDelta,
        dict(rho=0.9, epsilon=1e-8),
        ref.adadelta,
        toy=[hp(rho=0.9, epsilon=1e-5)],
        toy_steps=600,
        torch64=[hp(rho=0.9, epsilon=1e-6)],
        optax64=[hp(rho=0.9, epsilon=1e-6)],
        optax32=[hp(rho=0.9, epsilon=1e-6)],
        train=[hp(rho=0.9, epsilon=1e-6)],
        half=[hp(rho=0.9, epsilon=1e-6)],
    ),
    # optax's AMSGrad (bias-corrected maximum); torch's Adam(amsgrad=True) takes the maximum of
    # the uncorrected v, so it is not compared with torch
    RuleInfo(
        opt.AMSGrad,
        dict(eta=0.001, beta=(0.9, 0.999), epsilon=1e-8),
        ref.amsgrad,
        toy=[hp(eta=0.05)],
        optax64=[hp(eta=0.01)],
        optax32=[hp(eta=0.01)],
        train=[hp(eta=1e-2)],
        checkpoint=[hp(eta=0.01)],
    ),
    # torch.optim.NAdam uses Dozat's momentum schedule, ours the formula optax uses (see NAdam's
    # docstring), so NAdam is compared with optax only
    RuleInfo(
        opt.NAdam,
        dict(eta=0.001, beta=(0.9, 0.999), epsilon=1e-8),
        ref.nadam,
        toy=[hp(eta=0.05)],
        optax64=[hp(eta=0.01)],
        optax32=[hp(eta=0.01)],
        train=[hp(eta=1e-2)],
        checkpoint=[hp(eta=0.01)],
    ),
    # couple=True: x ← x − η·(adam + λx), torch's and optax's x ← x(1 − lr·wd) then the Adam step
    RuleInfo(
        opt.AdamW,
        dict(eta=0.001, beta=(0.9, 0.999), lambd=0.0, epsilon=1e-8, couple=True),
        ref.adamw,
        toy=[
            hp(eta=0.05),
            hp("lambd", eta=0.05, lambd=0.01),
            hp("decoupled", eta=0.05, lambd=1e-3, couple=False),
        ],
        jit=[hp("lambd", lambd=0.1), hp("decoupled", lambd=0.1, couple=False)],
        torch64=[hp(eta=0.01, beta=(0.9, 0.999), lambd=0.1)],
        optax64=[hp(eta=0.01, lambd=0.1)],
        optax32=[hp(eta=0.01, beta=(0.9, 0.999), lambd=0.1)],
        train=[hp(eta=1e-2, beta=(0.9, 0.999), lambd=0.1, epsilon=1e-8)],
        half=[hp(eta=1e-3, lambd=0.1)],
        checkpoint=[hp(eta=0.01, lambd=0.01)],
    ),
    RuleInfo(
        opt.AdaBelief,
        dict(eta=0.001, beta=(0.9, 0.999), epsilon=1e-16),
        ref.adabelief,
        toy=[hp(eta=0.05)],
        optax64=[hp(eta=0.01)],
        optax32=[hp(eta=0.01)],
        checkpoint=[hp(eta=0.01)],
    ),
    RuleInfo(
        opt.Lion,
        dict(eta=0.001, beta=(0.9, 0.999)),
        ref.lion,
        complex=False,
        toy=[hp(eta=0.02)],
        optax64=[hp(eta=0.01)],
        optax32=[hp(eta=0.001, beta=(0.9, 0.99))],
        checkpoint=[hp(eta=0.01)],
    ),
    # optax.contrib.adopt at its defaults (clipping at (t−1)^¼): the oracle
    RuleInfo(
        opt.ADOPT,
        dict(eta=0.001, beta=(0.9, 0.9999), epsilon=1e-6),
        complex=False,
        toy=[hp(eta=0.05)],
        optax64=[hp(eta=0.01), hp("beta2", eta=0.01, beta=(0.9, 0.999))],
        optax32=[hp(eta=0.001)],
        checkpoint=[hp(eta=0.01)],
    ),
    # optax.contrib.ademamix with constant b3 and alpha (no warm-up schedulers) and eps_root=0;
    # its weight decay is scaled by the learning rate, as ours
    RuleInfo(
        opt.AdEMAMix,
        dict(eta=0.001, beta=(0.9, 0.999, 0.9999), alpha=5.0, epsilon=1e-8, lambd=0.0),
        ref.ademamix,
        toy=[hp(eta=0.05), hp("lambd", eta=0.05, lambd=1e-3)],
        jit=[hp(), hp("lambd", lambd=0.1)],
        optax64=[hp(eta=0.01), hp("fast", eta=0.01, beta=(0.8, 0.99, 0.95), alpha=2.0, lambd=0.1)],
        optax32=[hp(eta=0.001), hp("lambd", eta=0.01, lambd=0.1)],
        checkpoint=[hp(eta=0.01, lambd=0.01)],
    ),
    # optax.contrib.schedule_free_adamw: the same steps when warmup=0 and r=0 (optax has no r,
    # and in its warm-up the base step's schedule lags one step); it forms x = (y − (1−β₁)z)/β₁
    # where we step y directly, so float32 runs agree up to rounding. The parameter is y; the
    # package schedulefree is the oracle of tests/test_schedule_free.py
    RuleInfo(
        opt.ScheduleFreeAdamW,
        dict(eta=2.5e-3, beta=(0.9, 0.999), epsilon=1e-8, lambd=0.0, warmup=0, r=0.0, weight_lr_power=2.0),
        ref.schedule_free_adamw,
        sets_value=True,
        toy=[hp(eta=0.05), hp("warmup", eta=0.05, lambd=1e-3, warmup=10, r=1.0)],
        jit=[hp(), hp("warmup", lambd=0.1, warmup=5, r=1.0, weight_lr_power=1.0)],
        optax64=[hp(eta=0.01), hp("lambd", eta=0.01, beta=(0.8, 0.99), lambd=0.1, weight_lr_power=1.0)],
        optax32=[hp(eta=0.01), hp("lambd", eta=0.01, lambd=0.1)],
        train=[hp(eta=1e-2, lambd=0.1, warmup=3)],
        checkpoint=[hp(eta=0.01, lambd=0.01, warmup=3)],
    ),
    RuleInfo(
        opt.ScheduleFreeSGD,
        dict(eta=1.0, beta=0.9, lambd=0.0, warmup=0, r=0.0, weight_lr_power=2.0),
        ref.schedule_free_sgd,
        sets_value=True,
        toy=[hp(eta=0.15), hp("warmup", eta=0.15, lambd=1e-3, warmup=10, r=1.0)],
        jit=[hp(), hp("warmup", eta=0.1, lambd=0.1, warmup=5, r=1.0, weight_lr_power=1.0)],
        optax64=[hp(eta=0.1), hp("lambd", eta=0.1, beta=0.8, lambd=0.1, weight_lr_power=1.0)],
        optax32=[hp(eta=0.1), hp("lambd", eta=0.1, lambd=0.1)],
        train=[hp(eta=0.1, lambd=0.1, warmup=3)],
        checkpoint=[hp(eta=0.1, lambd=0.01, warmup=3)],
    ),
    # optax.lamb: Adam direction plus decay, scaled by the trust ratio of each array (as ours)
    RuleInfo(
        opt.LAMB,
        dict(eta=0.001, beta=(0.9, 0.999), epsilon=1e-6, lambd=0.0),
        ref.lamb,
        elementwise=False,
        train=(),  # norms are summed in memory order: strided and contiguous round differently
        toy=[hp(eta=0.02), hp("lambd", eta=0.02, lambd=1e-3)],
        jit=[hp(), hp("lambd", lambd=0.1)],
        optax64=[hp(eta=0.01), hp("lambd", eta=0.01, beta=(0.8, 0.99), epsilon=1e-8, lambd=0.1)],
        optax32=[hp(eta=0.001), hp("lambd", eta=0.01, lambd=0.1)],
        checkpoint=[hp(eta=0.01, lambd=0.01)],
    ),
    # optax.lars at its default masks (decay and trust ratio on every array, as ours); optax
    # scales by the learning rate before its momentum, as ours
    RuleInfo(
        opt.LARS,
        dict(eta=0.001, beta=0.9, lambd=0.0, trust=0.001, epsilon=0.0, nesterov=False),
        ref.lars,
        elementwise=False,
        train=(),  # norms are summed in memory order: strided and contiguous round differently
        toy=[hp(eta=1.0, trust=0.01), hp("nesterov", eta=1.0, trust=0.01, lambd=1e-4, nesterov=True)],
        jit=[hp(), hp("nesterov", lambd=0.1, epsilon=1e-3, nesterov=True)],
        optax64=[
            hp(eta=1.0),
            hp("nesterov", eta=1.0, beta=0.8, lambd=0.1, trust=0.02, epsilon=1e-3, nesterov=True),
        ],
        optax32=[hp(eta=1.0), hp("nesterov", eta=1.0, lambd=0.1, trust=0.01, nesterov=True)],
        checkpoint=[hp(eta=1.0, lambd=0.01)],
    ),
    # Adam in the eigenbasis of per-axis preconditioners: not elementwise, state of other shapes
    # (matrices per axis); torch.optim and optax have no SOAP (tests/test_soap.py: the reference
    # implementation's numbers and heavyball's). A 1-D parameter is rotated only with
    # precondition_1d, and its first preconditioner (rank 1) then has a repeated zero eigenvalue
    # too (see `ambiguous_basis`). Contractions sum in memory order: strided and contiguous
    # parameters round differently, so no `train` family (tests/test_soap.py: to rounding).
    RuleInfo(
        opt.SOAP,
        dict(
            eta=3e-3,
            beta=(0.95, 0.95),
            shampoo_beta=0.95,
            epsilon=1e-8,
            lambd=0.01,
            precondition_frequency=10,
            max_precond_dim=10000,
            precondition_1d=False,
        ),
        ref.soap,
        complex=False,
        elementwise=False,
        ambiguous_basis=True,
        toy=[hp(eta=0.05), hp("often", eta=0.05, precondition_frequency=3, lambd=0.0)],
        jit=[hp(), hp("often", precondition_frequency=2, lambd=0.1)],
        checkpoint=[hp(eta=0.01, precondition_frequency=3)],
        train=(),
    ),
    # torch.optim.Adafactor is the formula written out (ε₁'s placement, ρ = min(lr, 1/√t)).
    # optax.adafactor coincides at decay_rate = −τ, clipping_threshold = d, no momentum, its
    # parameter-scale floor 1e-3 = ε₂, min_dim_size_to_factor = 1 (it factors the two largest
    # dimensions: the only two of a matrix), a learning-rate schedule min(η, 1/√t) and
    # weight_decay_rate = η·λ; it adds its eps = 1e-30 to |g|², ours floors with ε₁: equal for
    # gradients far above both. Its β₂ₜ is float32 (so no optax64: tests/test_adafactor.py compares
    # float64 runs at the precision that allows).
    RuleInfo(
        opt.Adafactor,
        dict(eta=1e-2, beta2_decay=-0.8, epsilon=(None, 1e-3), d=1.0, lambd=0.0),
        ref.adafactor,
        elementwise=False,
        train=[hp(), hp("lambd", lambd=0.1)],
        toy=[hp(eta=0.1), hp("lambd", eta=0.1, lambd=1e-3, d=2.0, epsilon=(1e-12, 1e-2))],
        jit=[hp(), hp("lambd", lambd=0.1, epsilon=(1e-12, 1e-2), d=1.5, beta2_decay=-0.6)],
        torch64=[hp(), hp("lambd", eta=0.05, lambd=0.1, d=1.5, beta2_decay=-0.6, epsilon=(1e-20, 1e-2))],
        optax32=[hp(), hp("lambd", eta=0.05, lambd=0.1, d=1.5, beta2_decay=-0.6)],
        half=[hp()],
        checkpoint=[hp(), hp("lambd", lambd=0.01)],
    ),
    # optax.contrib.muon bias-corrects its momentum: the normalisation before Newton–Schulz
    # cancels that for nesterov=False, not for its Nesterov term, so it is compared at
    # nesterov=False; its width scaling takes rows as the input axis, dimension numbers (1, 0)
    # make it ours. torch.optim.Muon iterates in bfloat16: tests/test_muon.py compares with it.
    RuleInfo(
        opt.Muon,
        dict(
            eta=0.001,
            beta=0.95,
            lambd=0.1,
            nesterov=True,
            ns_steps=5,
            ns_coefficients=(3.4445, -4.7750, 2.0315),
            epsilon=1e-7,
            scale="original",
        ),
        ref.muon,
        complex=False,
        min_ndim=2,
        elementwise=False,
        toy=[hp(eta=0.02, lambd=0.0), hp("plain", eta=0.02, lambd=0.0, nesterov=False)],
        jit=[hp(), hp("rms", nesterov=False, scale="match_rms_adamw")],
        # optax adds ε to the norm where we take max(norm, ε): 1e-7 moves float64 steps by ~1e-10
        optax64=[
            hp(eta=0.01, nesterov=False, epsilon=1e-30),
            hp("rms", eta=0.01, nesterov=False, epsilon=1e-30, scale="match_rms_adamw"),
        ],
        optax32=[hp(eta=0.01, nesterov=False)],
        checkpoint=[hp(eta=0.01)],
    ),
    RuleInfo(
        opt.WeightDecay,
        dict(lambd=5e-4),
        ref.weight_decay,
        toy_steps=0,
        optax64=[hp(lambd=0.1)],
    ),
    RuleInfo(opt.SignDecay, dict(lambd=1e-3), ref.sign_decay, complex=False, toy_steps=0),
    RuleInfo(
        opt.ClipGrad,
        dict(delta=10.0),
        ref.clip_grad,
        complex=False,
        toy_steps=0,
        jit=[hp(delta=0.5)],
        optax64=[hp(delta=0.5)],
        checkpoint=[hp(delta=0.5)],
    ),
    # per-array norm here, global norm in optax: equal for a model with a single array, p = 2
    RuleInfo(
        opt.ClipNorm,
        dict(omega=10.0, p=2.0, throw=True),
        ref.clip_norm,
        elementwise=False,
        toy_steps=0,
        train=(),  # a norm is summed in memory order: strided and contiguous round differently
        jit=[hp(omega=1.0), hp("inf", omega=1.0, p=math.inf)],
        optax64=[hp(omega=2.0)],
        checkpoint=[hp(omega=1.0)],
    ),
    # decides in Python whether to step, so it runs eagerly: no jit
    RuleInfo(
        opt.AccumGrad,
        None,
        ref.accum_grad,
        toy=[hp(n=3)],
        toy_steps=0,
        jit=(),
        train=(),
        checkpoint=[hp(n=2)],
    ),
)

RULE_INFO = {info.cls: info for info in RULES}


@dataclasses.dataclass(frozen=True)
class Composite:
    """A chain or wrapper that the generic tests run: `families` names them (see RuleInfo)."""

    name: str  # its id in the peer tests
    make: Callable[[], opt.Rule]
    families: frozenset
    reference: Callable | None = None  # () -> step, as RuleInfo.reference; None: tested apart
    toy_steps: int = 300
    toy_dtype: type = np.float64  # the model's dtype in the convergence tests
    optax: Callable | None = None  # optax -> transformation
    torch: TorchOptim | None = None
    torch_before_step: Callable | None = None  # (params) -> None: gradient surgery before step()


def _fam(*names):
    return frozenset(names)


def _clip_value(delta):
    def clip(params):
        import torch

        torch.nn.utils.clip_grad_value_(params, delta)

    return clip


COMPOSITES: tuple[Composite, ...] = (
    Composite("()", lambda: opt.OptimiserChain(), _fam("toy"), lambda: ref.chain(), toy_steps=0),
    Composite(
        "ClipGrad>Adam",
        lambda: opt.OptimiserChain(opt.ClipGrad(1.0), opt.Adam(0.05)),
        _fam("toy"),
        lambda: ref.chain(ref.clip_grad(1.0), ref.adam(0.05)),
    ),
    Composite(
        "WeightDecay>Momentum",
        lambda: opt.OptimiserChain(opt.WeightDecay(), opt.Momentum(0.02)),
        _fam("toy"),
        lambda: ref.chain(ref.weight_decay(), ref.momentum(0.02)),
    ),
    Composite(
        "AccumGrad>Descent",
        lambda: opt.OptimiserChain(opt.AccumGrad(2), opt.Descent(0.1)),
        _fam("toy"),
        lambda: ref.chain(ref.accum_grad(2), ref.descent(0.1)),
        toy_steps=600,
    ),
    Composite(
        "ClipNorm>Descent",
        lambda: opt.OptimiserChain(opt.ClipNorm(1.0), opt.Descent(0.1)),
        _fam("toy"),
        lambda: ref.chain(ref.clip_norm(1.0), ref.descent(0.1)),
    ),
    Composite(
        "SignDecay>WeightDecay>Adam",
        lambda: opt.OptimiserChain(opt.SignDecay(), opt.WeightDecay(), opt.Adam(0.05)),
        _fam("toy"),
        lambda: ref.chain(ref.sign_decay(), ref.weight_decay(), ref.adam(0.05)),
    ),
    Composite(
        "(ClipGrad)>AccumGrad>Nesterov",
        lambda: opt.OptimiserChain(
            opt.OptimiserChain(opt.ClipGrad(1.0)), opt.AccumGrad(2), opt.Nesterov(0.02)
        ),
        _fam("toy"),
        lambda: ref.chain(ref.clip_grad(1.0), ref.accum_grad(2), ref.nesterov(0.02)),
        toy_steps=600,
    ),
    Composite(
        "MixedPrecision(Adam)", lambda: opt.MixedPrecision(opt.Adam(0.05)), _fam("toy"), toy_dtype=np.float16
    ),
    Composite(
        "MixedPrecision(ClipGrad>Lion)",
        lambda: opt.MixedPrecision(opt.OptimiserChain(opt.ClipGrad(1.0), opt.Lion(0.02))),
        _fam("toy"),
        toy_dtype=np.float16,
    ),
    # on finite gradients it is its rule; tests/test_reliability.py checks the skipping
    Composite(
        "SkipNonFinite(Adam)", lambda: opt.SkipNonFinite(opt.Adam(0.05)), _fam("toy"), lambda: ref.adam(0.05)
    ),
    Composite(
        "SkipNonFinite(ClipNorm>Momentum)",
        lambda: opt.SkipNonFinite(opt.OptimiserChain(opt.ClipNorm(1.0), opt.Momentum(0.02))),
        _fam("toy"),
        lambda: ref.chain(ref.clip_norm(1.0), ref.momentum(0.02)),
    ),
    # slow weights in the state, the parameter set to them every k-th step (a NewValue);
    # tests/test_lookahead.py compares with optax.lookahead, which trains LookaheadParams
    Composite(
        "Lookahead(Adam)",
        lambda: opt.Lookahead(opt.Adam(0.05), k=5),
        _fam("toy", "jit", "checkpoint", "layouts"),
        lambda: ref.lookahead(ref.adam(0.05), k=5),
    ),
    Composite(
        "Lookahead(ClipNorm>Momentum)",
        lambda: opt.Lookahead(opt.OptimiserChain(opt.ClipNorm(1.0), opt.Momentum(0.02)), k=3, alpha=0.8),
        _fam("toy", "jit", "checkpoint"),
        lambda: ref.lookahead(ref.chain(ref.clip_norm(1.0), ref.momentum(0.02)), k=3, alpha=0.8),
    ),
    # AccumGrad's calls without a step do not count towards k
    Composite(
        "Lookahead(AccumGrad>Descent)",
        lambda: opt.Lookahead(opt.OptimiserChain(opt.AccumGrad(2), opt.Descent(0.1)), k=4),
        _fam("toy"),
        lambda: ref.lookahead(ref.chain(ref.accum_grad(2), ref.descent(0.1)), k=4),
        toy_steps=600,
    ),
    Composite(
        "ClipGrad>Lookahead(Nesterov)",
        lambda: opt.OptimiserChain(opt.ClipGrad(1.0), opt.Lookahead(opt.Nesterov(0.02), k=2, alpha=0.3)),
        _fam("toy", "jit"),
        lambda: ref.chain(ref.clip_grad(1.0), ref.lookahead(ref.nesterov(0.02), k=2, alpha=0.3)),
    ),
    # moments kept quantised (min_size=1: the toy arrays are small); tests/test_low_bit.py
    # compares the numbers with a written-out computation and with torchao
    Composite(
        "LowBit(Adam)",
        lambda: opt.LowBit(opt.Adam(0.05), min_size=1),
        _fam("toy", "jit", "checkpoint"),
    ),
    Composite(
        "LowBit(ClipNorm>AdamW), 4 bits",
        lambda: opt.LowBit(
            opt.OptimiserChain(opt.ClipNorm(1.0), opt.AdamW(0.05, lambd=0.01)), bits=4, min_size=1
        ),
        _fam("toy", "jit", "checkpoint"),
    ),
    Composite(
        "LowBit(AdamW), fp8",
        lambda: opt.LowBit(opt.AdamW(0.05, lambd=0.01), bits="fp8", min_size=1),
        _fam("toy", "jit", "checkpoint"),
    ),
    Composite("LowBit(Lion)", lambda: opt.LowBit(opt.Lion(0.02), min_size=1), _fam("toy", "jit")),
    Composite(
        "MixedPrecision(Lookahead(Adam))",
        lambda: opt.MixedPrecision(opt.Lookahead(opt.Adam(0.05), k=4)),
        _fam("toy", "checkpoint"),
        toy_dtype=np.float16,
    ),
    Composite(
        "ClipNorm>WeightDecay>Adam",
        lambda: opt.OptimiserChain(opt.ClipNorm(1.0), opt.WeightDecay(), opt.Adam()),
        _fam("jit"),
    ),
    Composite("MixedPrecision(Adam())", lambda: opt.MixedPrecision(opt.Adam()), _fam("jit")),
    Composite(
        "WeightDecay>Adam",
        lambda: opt.OptimiserChain(opt.WeightDecay(0.1), opt.Adam(0.01)),
        _fam("optax32"),
        optax=lambda optax: optax.chain(optax.add_decayed_weights(0.1), optax.adam(0.01)),
    ),
    Composite(
        "ClipGrad>Adam",
        lambda: opt.OptimiserChain(opt.ClipGrad(0.5), opt.Adam(0.01)),
        _fam("optax32", "optax64"),
        optax=lambda optax: optax.chain(optax.clip(0.5), optax.adam(0.01)),
    ),
    # torch's weight_decay in SGD/Adam is L2 added to the gradient: WeightDecay first in a chain
    Composite(
        "WeightDecay+Descent",
        lambda: opt.OptimiserChain(opt.WeightDecay(0.05), opt.Descent(0.1)),
        _fam("train"),
        torch=TorchOptim("SGD", lambda r: dict(lr=0.1, weight_decay=0.05)),
    ),
    Composite(
        "WeightDecay+Adam",
        lambda: opt.OptimiserChain(opt.WeightDecay(0.05), opt.Adam(1e-2)),
        _fam("train"),
        torch=TorchOptim("Adam", lambda r: dict(lr=1e-2, weight_decay=0.05)),
    ),
    # clip_grad_value_ before the step is ClipGrad first in a chain
    Composite(
        "ClipGrad+Momentum",
        lambda: opt.OptimiserChain(opt.ClipGrad(0.02), opt.Momentum(0.1, 0.9)),
        _fam("train"),
        torch=TorchOptim("SGD", lambda r: dict(lr=0.1, momentum=0.9)),
        torch_before_step=_clip_value(0.02),
    ),
    Composite(
        "ClipNorm+Adam", lambda: opt.OptimiserChain(opt.ClipNorm(1.0), opt.Adam(1e-2)), _fam("layouts")
    ),
    Composite(
        "ClipNorm>WeightDecay>Adam(0.01)",
        lambda: opt.OptimiserChain(opt.ClipNorm(1.0), opt.WeightDecay(0.01), opt.Adam(0.01)),
        _fam("checkpoint"),
    ),
    Composite(
        "MixedPrecision(Adam,float64)",
        lambda: opt.MixedPrecision(opt.Adam(0.01), np.float64),
        _fam("checkpoint"),
    ),
)


def ambiguous_basis(rule: opt.Rule) -> bool:
    """Whether `rule`'s steps depend on an arbitrary eigenbasis (see `RuleInfo.ambiguous_basis`)."""
    if isinstance(rule, opt.OptimiserChain):
        return any(ambiguous_basis(r) for r in rule.rules)
    if isinstance(rule, (opt.MixedPrecision, opt.SkipNonFinite, opt.Lookahead, opt.LowBit)):
        return ambiguous_basis(rule.rule)
    return RULE_INFO[type(rule)].ambiguous_basis


def supports_complex(rule: opt.Rule) -> bool:
    """Whether `rule` takes complex parameters (else setup raises TypeError)."""
    if isinstance(rule, opt.OptimiserChain):
        return all(supports_complex(r) for r in rule.rules)
    if isinstance(rule, opt.MixedPrecision):
        return False  # its master copy is real floating point
    if isinstance(rule, (opt.SkipNonFinite, opt.Lookahead, opt.LowBit)):
        return supports_complex(rule.rule)
    return RULE_INFO[type(rule)].complex


def sets_values(rule: opt.Rule) -> bool:
    """Whether `rule` may set parameters far from where they were (`Lookahead` at its
    synchronisations, the schedule-free rules' `y`), where optax's `x + (new − x)` is `new` only
    to within a rounding."""
    if isinstance(rule, opt.OptimiserChain):
        return any(sets_values(r) for r in rule.rules)
    if isinstance(rule, opt.Lookahead):
        return True
    if isinstance(rule, (opt.MixedPrecision, opt.SkipNonFinite, opt.LowBit)):
        return sets_values(rule.rule)
    return RULE_INFO[type(rule)].sets_value


def min_ndim(rule: opt.Rule) -> int:
    """The fewest axes a parameter of `rule` may have (0: any array)."""
    if isinstance(rule, opt.OptimiserChain):
        return max((min_ndim(r) for r in rule.rules), default=0)
    if isinstance(rule, (opt.MixedPrecision, opt.SkipNonFinite, opt.Lookahead, opt.LowBit)):
        return min_ndim(rule.rule)
    return RULE_INFO[type(rule)].min_ndim


def shaped(rule: opt.Rule, shape: tuple) -> tuple:
    """`shape` for a parameter of `rule`: as it is, or with trailing axes of length 1 up to the
    axes the rule needs (a vector (n,) becomes the matrix (n, 1) for Muon). The size is kept, so
    test data made for `shape` reshapes to it."""
    shape = tuple(shape)
    return shape + (1,) * max(0, min_ndim(rule) - len(shape))


def shaped_like(rule: opt.Rule, tree):
    """A dict or list of arrays (any backend) with each array reshaped as `shaped` says (the same
    objects where nothing changes)."""
    if isinstance(tree, dict):
        return {k: shaped_like(rule, v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [shaped_like(rule, v) for v in tree]
    want = shaped(rule, tree.shape)
    return tree if tuple(tree.shape) == want else tree.reshape(want)


def routed(rule: opt.Rule):
    """What to give `setup` to train a model whose arrays have any shape with `rule`: `rule`
    itself, or, for a rule that needs more axes than some arrays have (Muon's matrices), a
    function `(path, x) -> rule` giving those arrays AdamW, as Muon's users route biases and
    normalisation scales."""
    k = min_ndim(rule)
    if k == 0:
        return rule
    return lambda path, x: rule if len(x.shape) >= k else opt.AdamW(1e-3)


# --- the cases of each family of generic tests ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ToyCase:
    """A rule instance for test_rules.py and test_torch_rules.py."""

    rule: opt.Rule
    ref: Callable | None  # () -> reference step function; None: tested on its own
    steps: int = 300  # for the convergence tests; 0: not an optimiser on its own
    dtype: type = np.float64  # the model's dtype in the convergence tests


def toy_cases() -> list[ToyCase]:
    out = []
    for info in RULES:
        for h in info.toy:
            reference = None if info.reference is None else (lambda f=info.reference, k=h.kwargs: f(**k))
            out.append(ToyCase(info.make(h), reference, info.toy_steps))
    for c in COMPOSITES:
        if "toy" in c.families:
            out.append(ToyCase(c.make(), c.reference, c.toy_steps, c.toy_dtype))
    return out


def _family(field: str) -> list[tuple[str, RuleInfo, Hyper]]:
    return [(info.case_id(h), info, h) for info in RULES for h in getattr(info, field)]


def jit_rules() -> list[opt.Rule]:
    """Rule instances that `jax.jit(update)` must run like eager calls, ties kept."""
    rules = [info.make(h) for _, info, h in _family("jit")]
    return rules + [c.make() for c in COMPOSITES if "jit" in c.families]


def checkpoint_rules() -> list[opt.Rule]:
    """Rule instances whose runs must resume from a checkpoint bit for bit."""
    rules = [info.make(h) for _, info, h in _family("checkpoint")]
    return rules + [c.make() for c in COMPOSITES if "checkpoint" in c.families]


def layout_rules() -> dict[str, Callable[[], opt.Rule]]:
    """Name -> factory: rules that must step strided parameters like contiguous ones."""
    out = {case_id: (lambda i=info, h=h: i.make(h)) for case_id, info, h in _family("train")}
    return out | {c.name: c.make for c in COMPOSITES if "layouts" in c.families}


def layout_reductions() -> set[str]:
    """The names in `layout_rules()` whose rules are not elementwise: they sum over whole arrays
    (norms, means) in memory order, so a strided parameter's steps agree with a contiguous one's
    to rounding, not bit for bit."""
    return {name for name, make in layout_rules().items() if not make().elementwise}


def engine_layout_rules() -> dict[str, Callable[[], opt.Rule]]:
    """The part of `layout_rules()` that the update engine steps over flat buffers: elementwise
    rules, and rules that step elementwise given one factor per array (ClipNorm chains, LAMB,
    LARS). Adafactor takes the engine only for vectors (a matrix keeps row and column factors),
    and other rules are stepped one parameter at a time."""

    def engine_steps(rule):
        scaled = getattr(rule, "scaled_elementwise", False) and not isinstance(rule, opt.Adafactor)
        return rule.elementwise or scaled

    return {name: make for name, make in layout_rules().items() if engine_steps(make())}


@dataclasses.dataclass(frozen=True)
class TorchCase:
    """A rule and its torch.optim counterpart: `theirs(params, **implementation)` builds it."""

    name: str
    ours: Callable[[], opt.Rule]
    peer: TorchOptim
    before_step: Callable | None = None  # torch side: gradient surgery before optimizer.step()

    def theirs(self, params, **implementation):
        return self.peer.make(self.ours(), params, **implementation)

    @property
    def fused(self) -> bool:
        return self.peer.fused


def torch_cases(field: str, composites: bool = False) -> list[TorchCase]:
    """The rules of family `field` ("torch64", "train", "half") that torch.optim also has; with
    `composites`, also the chains of that family with a torch.optim counterpart."""
    out = [
        TorchCase(case_id, lambda i=info, h=h: i.make(h), info.torch)
        for case_id, info, h in _family(field)
        if info.torch is not None
    ]
    if composites:
        out += [
            TorchCase(c.name, c.make, c.torch, c.torch_before_step)
            for c in COMPOSITES
            if field in c.families and c.torch is not None
        ]
    return out


@dataclasses.dataclass(frozen=True)
class OptaxCase:
    name: str
    ours: Callable[[], opt.Rule]
    theirs: Callable  # optax -> transformation whose updates are added


def optax_cases(field: str) -> list[OptaxCase]:
    """The rules of family `field` ("optax64", "optax32") and their optax counterparts."""
    out = [
        OptaxCase(
            case_id, lambda i=info, h=h: i.make(h), lambda optax, i=info, h=h: i.optax(optax, i.make(h))
        )
        for case_id, info, h in _family(field)
    ]
    return out + [OptaxCase(c.name, c.make, c.optax) for c in COMPOSITES if field in c.families]
