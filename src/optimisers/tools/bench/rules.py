"""The rules the bench steps: one `BenchRule` per rule in `RULES`, holding everything the rows of
that rule need (ours, its torch and optax peers, a naive NumPy formula, the bytes of its floor).

To bench another rule, add one entry to `RULES`: the rule, at hyperparameters where its peers
compute the same steps (the rule's docstring says where they differ) and with steps well above the
check's tolerance (about 1e-7 for the parameters of about 0.02: steps of 1e-5 or more). Its
torch.optim and optax peers are built from it by the table of peers (`peers`, which the
repository's tests read too); a peer from elsewhere is given by hand. A library without the rule
gets `None`: its rows say so ("—") instead of running.

The naive formula is written once, for any float dtype: run in float32 it is the "naive NumPy loop"
row, run in float64 it is the reference every row is checked against (without one, rows are
timed but unchecked).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import optimisers as opt

from . import peers
from .models import ATOL, RTOL

#: A naive formula: given the parameter arrays (stepped in place), `step(grads, t)` for t = 1, 2, ...
Naive = Callable[[list], Callable[[list, int], None]]

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
    `tolerance` (atol, rtol) against the float64 reference."""

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


# --- hyperparameters (the same for every implementation of a rule) ----------------------------

LR_ADAM = 1e-3
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.01  # AdamW: optimisers `lambd`, torch `weight_decay`, optax `weight_decay`
CLIP = 0.1  # ClipNorm's bound: the bench's gradients of 256 elements have norms of about 0.16
LR_MOMENTUM = 1e-2
RHO = 0.9  # torch/optax `momentum`

# LAMB and LARS move each array by a fraction of its own norm (the trust ratio): these rates give
# steps of about 1e-4 and 2e-5 of parameters about 0.02, well above the check's tolerance
LR_LAMB, EPS_LAMB = 1e-2, 1e-6  # optax.lamb's default eps, and ours
LR_LARS, TRUST_LARS = 1.0, 1e-3  # optax.lars's default trust_coefficient, and ours
BETAS_ADOPT, EPS_ADOPT = (0.9, 0.9999), 1e-6  # ADOPT's (and optax.contrib.adopt's) defaults
BETAS_ADEMAMIX, ALPHA_ADEMAMIX = (0.9, 0.999, 0.9999), 5.0  # AdEMAMix's defaults (b1, b2, b3)
# Lookahead synchronises on every k-th step: k = 3 puts a synchronisation inside the check's
# three steps, and makes two of every three timed steps plain Adam steps (the median is one)
K_LOOKAHEAD, ALPHA_LOOKAHEAD = 3, 0.5

# Adafactor at torch.optim's defaults but ε₁ = 1e-30 (None means the dtype's epsilon, which would
# differ between the float32 rows and the float64 reference); optax.adafactor adds its eps = 1e-30
# to g² where ours floors with ε₁: equal for gradients far above it
LR_ADAFACTOR, DECAY_ADAFACTOR, EPS_ADAFACTOR = 1e-2, -0.8, (1e-30, 1e-3)
LR_SOAP = 3e-3
# Muon at torch.optim.Muon's defaults but Nesterov off, where optax.contrib.muon computes the same
# steps (its Nesterov term is bias-corrected); torch.optim.Muon iterates in bfloat16, 1-3% apart
LR_MUON, BETA_MUON, DECAY_MUON, NS_MUON = 2e-2, 0.95, 0.1, (3.4445, -4.7750, 2.0315)
LR_SF_ADAMW, LR_SF_SGD = 2.5e-3, 1e-2  # schedule-free: the package's AdamW default, a gentle SGD rate

HYPERPARAMETERS = {"adam_lr": LR_ADAM, "betas": BETAS, "eps": EPS, "weight_decay": WEIGHT_DECAY,
                   "momentum_lr": LR_MOMENTUM, "rho": RHO}


# --- naive formulas: array by array, in place where easy, as a NumPy user would write them -------


def _zeros(xs):
    return [np.zeros_like(x) for x in xs]


def _norm(a):
    return np.sqrt(np.vdot(a, a))


def _trust_ratio(x, u, trust, eps):
    """`trust·‖x‖/(‖u‖ + eps)`, or 1 where either norm is 0 (as optax)."""
    nx, nu = _norm(x), _norm(u)
    return x.dtype.type(1) if nx == 0 or nu == 0 else x.dtype.type(trust) * nx / (nu + x.dtype.type(eps))


def _per_array(states: int):
    """A `Naive` from `formula(f, t)`, which gives at step `t` (`f` the arrays' float type, its
    scalars cast once a step) `each(x, g, *state)`, the step of one array in place; each array's
    `states` arrays start at zero."""

    def naive(formula) -> Naive:
        def make(xs):
            held = [_zeros(xs) for _ in range(states)]

            def step(gs, t):
                each = formula(xs[0].dtype.type, t)
                for x, g, *state in zip(xs, gs, *held):
                    each(x, g, *state)

            return step

        return make

    return naive


@_per_array(states=1)
def _naive_momentum(f, t):
    rho, lr = f(RHO), f(LR_MOMENTUM)

    def each(x, g, v):
        v *= rho
        v += lr * g
        x -= v

    return each


def _naive_adam(decay: float = 0.0) -> Naive:
    @_per_array(states=2)
    def adam(f, t):
        b1, b2, eps, lr = f(BETAS[0]), f(BETAS[1]), f(EPS), f(LR_ADAM)
        c1, c2 = f(1 - BETAS[0] ** t), f(1 - BETAS[1] ** t)
        keep = f(1 - LR_ADAM * decay)

        def each(x, g, m, v):
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * (g * g)
            s = (lr / c1) * m / (np.sqrt(v / c2) + eps)
            if decay:
                x *= keep
            x -= s

        return each

    return adam


def _naive_clip_adamw(xs):
    """Each array's gradient clipped to norm CLIP, then AdamW."""
    adamw = _naive_adam(decay=WEIGHT_DECAY)(xs)

    def step(gs, t):
        f = xs[0].dtype.type
        clipped = []
        for g in gs:
            norm = np.sqrt(np.sum(g.astype(np.float64) ** 2))
            clipped.append(g * f(min(1.0, CLIP / norm)) if norm > CLIP else g)
        adamw(clipped, t)

    return step


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


@_per_array(states=2)
def _naive_lamb(f, t):
    b1, b2, eps, lr, wd = f(BETAS[0]), f(BETAS[1]), f(EPS_LAMB), f(LR_LAMB), f(WEIGHT_DECAY)
    c1, c2 = f(1 - BETAS[0] ** t), f(1 - BETAS[1] ** t)

    def each(x, g, m, v):
        m *= b1
        m += (1 - b1) * g
        v *= b2
        v += (1 - b2) * (g * g)
        u = (m / c1) / (np.sqrt(v / c2) + eps) + wd * x
        x -= (lr * _trust_ratio(x, u, 1.0, 0.0)) * u

    return each


@_per_array(states=1)
def _naive_lars(f, t):
    beta, lr, wd = f(RHO), f(LR_LARS), f(WEIGHT_DECAY)

    def each(x, g, v):
        u = g + wd * x
        v *= beta
        v += (lr * _trust_ratio(x, u, TRUST_LARS, 0.0)) * u
        x -= v

    return each


@_per_array(states=2)
def _naive_adopt(f, t):
    b1, b2, eps, lr = f(BETAS_ADOPT[0]), f(BETAS_ADOPT[1]), f(EPS_ADOPT), f(LR_ADAM)
    bound = f((t - 1) ** 0.25)

    def each(x, g, m, v):
        if t == 1:  # the first step only records the second moment
            v[...] = g * g
            return
        u = np.clip(g / np.maximum(np.sqrt(v), eps), -bound, bound)
        m *= b1
        m += (1 - b1) * u
        v *= b2
        v += (1 - b2) * (g * g)
        x -= lr * m

    return each


@_per_array(states=3)
def _naive_ademamix(f, t):
    b1, b2, b3 = (f(b) for b in BETAS_ADEMAMIX)
    alpha, eps, lr, wd = f(ALPHA_ADEMAMIX), f(EPS), f(LR_ADAM), f(WEIGHT_DECAY)
    c1, c2 = f(1 - BETAS_ADEMAMIX[0] ** t), f(1 - BETAS_ADEMAMIX[1] ** t)

    def each(x, g, m1, m2, v):
        m1 *= b1
        m1 += (1 - b1) * g
        m2 *= b3
        m2 += (1 - b3) * g
        v *= b2
        v += (1 - b2) * (g * g)
        x -= lr * ((m1 / c1 + alpha * m2) / (np.sqrt(v / c2) + eps) + wd * x)

    return each


def _naive_adafactor(xs):
    """torch.optim.Adafactor's maths: factored second moments of the last two axes (full for
    vectors), the update's RMS clipped to 1, a step relative to the parameter's RMS."""
    rows = [np.zeros(x.shape[:-1] + (1,), x.dtype) if x.ndim >= 2 else None for x in xs]
    cols = [np.zeros(x.shape[:-2] + (1, x.shape[-1]), x.dtype) if x.ndim >= 2 else None for x in xs]
    fulls = [None if x.ndim >= 2 else np.zeros_like(x) for x in xs]

    def step(gs, t):
        f = xs[0].dtype.type
        eps1, eps2 = f(EPS_ADAFACTOR[0]), f(EPS_ADAFACTOR[1])
        w = f(t**DECAY_ADAFACTOR)  # 1 − β₂ₜ
        rho = f(min(LR_ADAFACTOR, 1 / np.sqrt(t)))
        for i, (x, g) in enumerate(zip(xs, gs)):
            g2 = g * g
            if x.ndim >= 2:
                rows[i] += w * (g2.mean(axis=-1, keepdims=True) - rows[i])
                cols[i] += w * (g2.mean(axis=-2, keepdims=True) - cols[i])
                v = rows[i] @ cols[i] / np.maximum(rows[i].mean(axis=-2, keepdims=True), eps1)
            else:
                fulls[i] += w * (g2 - fulls[i])
                v = fulls[i]
            u = g / np.sqrt(np.maximum(v, eps1 * eps1))
            root_n = f(np.sqrt(max(x.size, 1)))
            clip = max(f(1), _norm(u) / root_n)
            alpha = max(eps2, _norm(x) / root_n) * rho
            x -= (alpha / clip) * u

    return step


def _naive_schedule_free(adam: bool) -> Naive:
    """The schedulefree package's AdamW (adam=True) or SGD, no warm-up, r = 0, weight power 2:
    the parameter holds y; z the base iterate; the average x is implicit in y."""

    def make(xs):
        zs, vs = [x.copy() for x in xs], _zeros(xs)
        weight_sum = [0.0]

        def step(gs, t):
            f = xs[0].dtype.type
            lr = LR_SF_ADAMW if adam else LR_SF_SGD
            weight_sum[0] += lr**2
            c = lr**2 / weight_sum[0]
            b1 = BETAS[0] if adam else RHO
            scale, rate = f(lr * (b1 * (1 - c) - 1)), f(lr)
            for x, g, z, v in zip(xs, gs, zs, vs):
                if adam:
                    v *= f(BETAS[1])
                    v += f(1 - BETAS[1]) * (g * g)
                    u = g / (np.sqrt(v / f(1 - BETAS[1] ** t)) + f(EPS))
                else:
                    u = g
                x += f(c) * (z - x)  # y towards z by the averaging weight
                x += scale * u
                z -= rate * u

        return step

    return make


class _GradsRestored:
    """An optimiser whose `step()` first puts back the gradients it was made with: the bench sets
    `.grad` once, and schedulefree's AdamW divides `.grad` in place (its row times the copy too)."""

    def __init__(self, optimizer, params):
        self.optimizer, self.params = optimizer, params
        self.grads = [p.grad.clone() for p in params]

    def step(self):
        for p, g in zip(self.params, self.grads):
            p.grad.copy_(g)
        self.optimizer.step()


def _schedulefree_torch(name: str, restore_grads: bool = False, **kwargs):
    """A `schedulefree` package optimiser over the parameters, in train mode (it starts in eval)."""

    def make(torch, params, **flags):
        import schedulefree

        optimizer = getattr(schedulefree, name)(params, **kwargs, **flags)
        optimizer.train()
        return _GradsRestored(optimizer, params) if restore_grads else optimizer

    return make


def _newton_schulz(u):
    """Keller Jordan's quintic iteration, 5 steps, on the wider orientation of the matrix."""
    f = u.dtype.type
    a, b, c = (f(k) for k in NS_MUON)
    tall = u.shape[0] > u.shape[1]
    X = u.T if tall else u
    X = X / max(_norm(X), f(1e-7))
    for _ in range(5):
        A = X @ X.T
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.T if tall else X


@_per_array(states=1)
def _naive_muon(f, t):
    beta, lr, wd = f(BETA_MUON), f(LR_MUON), f(DECAY_MUON)

    def each(x, g, m):
        m += (1 - beta) * (g - m)
        rows, cols = x.shape[0], x.size // x.shape[0]
        scale = f(np.sqrt(max(1.0, rows / cols)))
        o = _newton_schulz(m.reshape(rows, cols)).reshape(x.shape)
        x *= 1 - lr * wd
        x -= lr * scale * o

    return each


def _naive_lookahead(inner: Naive, k: int, alpha: float) -> Naive:
    """`inner` moves the (fast) parameters; every k-th step the slow copies move `alpha` of the way
    to them and the parameters restart from there."""

    def make(xs):
        slows = [x.copy() for x in xs]
        inner_step = inner(xs)

        def step(gs, t):
            inner_step(gs, t)
            if t % k:
                return
            a = xs[0].dtype.type(alpha)
            for x, s in zip(xs, slows):
                s += a * (x - s)
                x[...] = s

        return step

    return make


def _lookahead_params(params):
    """What optax.lookahead trains, both parts at `params`; the slow part a copy, not the same
    arrays, since jit cannot donate one buffer twice."""
    import jax
    import optax

    return optax.LookaheadParams(fast=params, slow=jax.tree.map(lambda a: a.copy(), params))


# --- the table ----------------------------------------------------------------------------------

_ADAM_BYTES = "read x, g, m, v; write x, m, v: 7 arrays x 4 bytes = 28"
_NORMS = "not streaming (its per-array norms need a pass over the array before the step): no floor"

def _entry(name: str, title: str, rule: opt.Rule, naive: Naive | None, bytes_per_param: int | None,
           bytes_model: str, **given) -> BenchRule:
    """The entry of `rule`, whose peers, unless given, are its own in the table of peers."""
    torch_optim, optax_peer = peers.TORCH.get(type(rule)), peers.OPTAX.get(type(rule))
    if "torch" not in given and torch_optim is not None:
        variants = {k: v for k, v in TORCH_OPTIM_VARIANTS.items() if k != "fused" or torch_optim.fused}
        given["torch"] = TorchPeer(f"torch.optim.{torch_optim.name}",
                                   lambda torch, ps, **kw: torch_optim.make(rule, ps, **kw), variants)
    if "optax" not in given and optax_peer is not None:
        given["optax"] = OptaxPeer(lambda optax: optax_peer(optax, rule))
    return BenchRule(name, title, lambda: rule, given.pop("torch", None), given.pop("optax", None), naive,
                     bytes_per_param, bytes_model, **given)


RULES: dict[str, BenchRule] = {r.name: r for r in [
    _entry("adam", "Adam", opt.Adam(eta=LR_ADAM, beta=BETAS, epsilon=EPS), _naive_adam(), 28, _ADAM_BYTES,
           in_default_run=True),
    _entry("adamw", "AdamW", opt.AdamW(eta=LR_ADAM, beta=BETAS, lambd=WEIGHT_DECAY, epsilon=EPS),
           _naive_adam(decay=WEIGHT_DECAY), 28, "as Adam (the decay reads x, which Adam already reads): 28",
           in_default_run=True),
    _entry("momentum", "Momentum", opt.Momentum(eta=LR_MOMENTUM, rho=RHO), _naive_momentum,
           20, "read x, g, v; write x, v: 5 arrays x 4 bytes = 20", in_default_run=True),
    # each array's gradient clipped to a norm, then AdamW: optax clips by the global norm or a
    # block's RMS only, so it has no peer here
    _entry("clip-adamw", "ClipNorm+AdamW",
           opt.OptimiserChain(opt.ClipNorm(CLIP), opt.AdamW(eta=LR_ADAM, beta=BETAS, lambd=WEIGHT_DECAY,
                                                            epsilon=EPS)),
           _naive_clip_adamw, None,
           "not streaming (each array's norm needs a pass over its gradient before the step): no floor",
           torch=TorchPeer("torch clip_grad_norm_ per tensor + AdamW", _ClippedEachTensor)),
    _entry("lamb", "LAMB", opt.LAMB(eta=LR_LAMB, beta=BETAS, epsilon=EPS_LAMB, lambd=WEIGHT_DECAY),
           _naive_lamb, None, _NORMS),
    _entry("lars", "LARS", opt.LARS(eta=LR_LARS, beta=RHO, lambd=WEIGHT_DECAY, trust=TRUST_LARS, epsilon=0.0),
           _naive_lars, None, _NORMS),
    _entry("adopt", "ADOPT", opt.ADOPT(eta=LR_ADAM, beta=BETAS_ADOPT, epsilon=EPS_ADOPT), _naive_adopt,
           28, "as Adam: read x, g, m, v; write x, m, v = 28"),
    _entry("ademamix", "AdEMAMix",
           opt.AdEMAMix(eta=LR_ADAM, beta=BETAS_ADEMAMIX, alpha=ALPHA_ADEMAMIX, epsilon=EPS,
                        lambd=WEIGHT_DECAY),
           _naive_ademamix, 36, "read x, g, m1, m2, v; write x, m1, m2, v: 9 arrays x 4 bytes = 36"),
    # optax.lookahead trains LookaheadParams(fast, slow): the model is its fast part
    _entry("lookahead", "Lookahead(Adam)",
           opt.Lookahead(opt.Adam(eta=LR_ADAM, beta=BETAS, epsilon=EPS), k=K_LOOKAHEAD,
                         alpha=ALPHA_LOOKAHEAD),
           _naive_lookahead(_naive_adam(), K_LOOKAHEAD, ALPHA_LOOKAHEAD),
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
           _naive_adafactor, None,
           "not streaming (the update's RMS needs a pass over the array before the step): no floor"),
    # the schedulefree package (the oracle) and optax.contrib agree without warm-up and with r = 0
    _entry("sf-adamw", "ScheduleFreeAdamW", opt.ScheduleFreeAdamW(eta=LR_SF_ADAMW, beta=BETAS, epsilon=EPS),
           _naive_schedule_free(adam=True),
           36, "read y, g, z, v; write y, z, v: 7 arrays, plus the z read again for y = 36 at most",
           torch=TorchPeer("schedulefree.AdamWScheduleFree",
                           _schedulefree_torch("AdamWScheduleFree", restore_grads=True, lr=LR_SF_ADAMW,
                                               betas=BETAS, eps=EPS),
                           variants={"loop": {}})),
    _entry("sf-sgd", "ScheduleFreeSGD", opt.ScheduleFreeSGD(eta=LR_SF_SGD, beta=RHO),
           _naive_schedule_free(adam=False), 20, "read y, g, z; write y, z: 5 arrays x 4 bytes = 20",
           torch=TorchPeer("schedulefree.SGDScheduleFree",
                           _schedulefree_torch("SGDScheduleFree", lr=LR_SF_SGD, momentum=RHO),
                           variants={"loop": {}})),
    _entry("muon", "Muon", opt.Muon(eta=LR_MUON, beta=BETA_MUON, lambd=DECAY_MUON, nesterov=False),
           _naive_muon, None, "not streaming (matrix products): no floor", shapes=only_matrices,
           torch=TorchPeer("torch.optim.Muon",
                           lambda torch, ps, **kw: torch.optim.Muon(ps, lr=LR_MUON, weight_decay=DECAY_MUON,
                                                                    momentum=BETA_MUON, nesterov=False, **kw),
                           variants={"loop": {}})),
    # no torch.optim or optax SOAP: ours alone, timed and unchecked (tests/test_soap.py checks it
    # against the paper's algorithm and heavyball's)
    _entry("soap", "SOAP", opt.SOAP(eta=LR_SOAP), None,
           None, "not streaming (matrix products with its eigenbases): no floor"),
]}


def default_rules() -> list[str]:
    """What runs without `--rules`."""
    return [name for name, r in RULES.items() if r.in_default_run]


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
