"""The naive formulas of the bench's rules: each written from the rule's paper (or its docstring),
array by array and in place where easy, as a NumPy user would write it, without the library's
code. Run in float32 it is the "naive NumPy loop" row; run in float64 it is the reference every
row is checked against.

A formula is a `Naive`: given the parameter arrays (stepped in place), it returns
`step(grads, t)`, called for t = 1, 2, ... Its hyperparameters are the table's
(`hyperparameters`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

import optimisers as opt

from .hyperparameters import (
    ALPHA_ADEMAMIX,
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
    NS_MUON,
    RHO,
    STEP_SIZES_RPROP,
    TRUST_LARS,
    WEIGHT_DECAY,
)

#: A naive formula: given the parameter arrays (stepped in place), `step(grads, t)` for t = 1, 2, ...
Naive = Callable[[list], Callable[[list, int], None]]


def _zeros(xs):
    return [np.zeros_like(x) for x in xs]


def _norm(a):
    return np.sqrt(np.vdot(a, a))


def _trust_ratio(x, u, trust, eps):
    """`trust·‖x‖/(‖u‖ + eps)`, or 1 where either norm is 0 (as optax)."""
    nx, nu = _norm(x), _norm(u)
    return x.dtype.type(1) if nx == 0 or nu == 0 else x.dtype.type(trust) * nx / (nu + x.dtype.type(eps))


def _per_array(*starts: float):
    """A `Naive` from `formula(f, t)`, which gives at step `t` (`f` the arrays' float type, its
    scalars cast once a step) `each(x, g, *state)`, the step of one array in place; each array
    has one state array per value of `starts`, filled with it at the start."""

    def naive(formula) -> Naive:
        def make(xs):
            held = [[np.full_like(x, start) for x in xs] for start in starts]

            def step(gs, t):
                each = formula(xs[0].dtype.type, t)
                for x, g, *state in zip(xs, gs, *held):
                    each(x, g, *state)

            return step

        return make

    return naive


@_per_array(0.0)
def momentum(f, t):
    rho, lr = f(RHO), f(LR_MOMENTUM)

    def each(x, g, v):
        v *= rho
        v += lr * g
        x -= v

    return each


def _adam_each(f, t, decay: float, epsilon: float):
    """Adam's (AdamW's when `decay`) step of one array at step `t`, in place: `each(x, g, m, v)`."""
    b1, b2, eps, lr = f(BETAS[0]), f(BETAS[1]), f(epsilon), f(LR_ADAM)
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


def adam(decay: float = 0.0, epsilon: float = EPS) -> Naive:
    """Adam; AdamW (torch's and optax's: the decay scaled by the rate) when `decay`."""

    @_per_array(0.0, 0.0)
    def formula(f, t):
        return _adam_each(f, t, decay, epsilon)

    return formula


def clip_adamw(xs):
    """Each array's gradient clipped to norm CLIP, then AdamW."""
    adamw = adam(decay=WEIGHT_DECAY)(xs)

    def step(gs, t):
        f = xs[0].dtype.type
        clipped = []
        for g in gs:
            norm = np.sqrt(np.sum(g.astype(np.float64) ** 2))
            clipped.append(g * f(min(1.0, CLIP / norm)) if norm > CLIP else g)
        adamw(clipped, t)

    return step


@_per_array(0.0, 0.0)
def lamb(f, t):
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


@_per_array(0.0)
def lars(f, t):
    beta, lr, wd = f(RHO), f(LR_LARS), f(WEIGHT_DECAY)

    def each(x, g, v):
        u = g + wd * x
        v *= beta
        v += (lr * _trust_ratio(x, u, TRUST_LARS, 0.0)) * u
        x -= v

    return each


@_per_array(0.0, 0.0)
def adopt(f, t):
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


@_per_array(0.0, 0.0, 0.0)
def ademamix(f, t):
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


def adafactor(xs):
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


def schedule_free(adam: bool) -> Naive:
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


@_per_array(0.0)
def muon(f, t):
    beta, lr, wd = f(BETA_MUON), f(LR_MUON), f(DECAY_MUON)

    def each(x, g, m):
        m += (1 - beta) * (g - m)
        rows, cols = x.shape[0], x.size // x.shape[0]
        scale = f(np.sqrt(max(1.0, rows / cols)))
        o = _newton_schulz(m.reshape(rows, cols)).reshape(x.shape)
        x *= 1 - lr * wd
        x -= lr * scale * o

    return each


def lookahead(inner: Naive, k: int, alpha: float) -> Naive:
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


# --- the rules added for every elementwise rule (issue 39) ---------------------------------------


@_per_array()
def descent(f, t):
    lr = f(LR_MOMENTUM)

    def each(x, g):
        x -= lr * g

    return each


@_per_array(0.0)
def nesterov(f, t):
    """As torch.optim.SGD(nesterov=True) writes it: the rate outside the buffer `b`."""
    rho, lr = f(RHO), f(LR_MOMENTUM)

    def each(x, g, b):
        b *= rho
        b += g
        x -= lr * (g + rho * b)

    return each


@_per_array(0.0)
def rmsprop(f, t):
    rho, lr, eps = f(RHO), f(LR_ADAM), f(EPS)

    def each(x, g, s):
        s *= rho
        s += (1 - rho) * (g * g)
        x -= lr * g / (np.sqrt(s) + eps)

    return each


@_per_array(0.0, LR_ADAM)
def rprop(f, t):
    """Rprop without weight backtracking: each element's step size grows while its gradient keeps
    its sign and shrinks when it flips, where the element then does not move."""
    (shrink, grow), (low, high) = (f(e) for e in ETAS_RPROP), (f(s) for s in STEP_SIZES_RPROP)

    def each(x, g, previous, size):
        turn = np.sign(previous * g)
        size[turn > 0] *= grow
        size[turn < 0] *= shrink
        np.clip(size, low, high, out=size)
        g = np.where(turn < 0, 0, g)
        x -= size * np.sign(g)
        previous[...] = g

    return each


@_per_array(EPS_ADAGRAD)
def adagrad(f, t):
    lr, eps = f(LR_ADAM), f(EPS_ADAGRAD)

    def each(x, g, a):
        a += g * g
        x -= lr * g / (np.sqrt(a) + eps)

    return each


@_per_array(0.0, 0.0)
def adadelta(f, t):
    """Zeiler's AdaDelta: the step is the gradient scaled by the RMS of past steps over its own."""
    rho, eps = f(RHO), f(EPS_ADADELTA)

    def each(x, g, a, d):
        a *= rho
        a += (1 - rho) * (g * g)
        step = g * np.sqrt(d + eps) / np.sqrt(a + eps)
        d *= rho
        d += (1 - rho) * (step * step)
        x -= step

    return each


def _moments(b1, b2):
    """`each`'s first lines in Adam's family: both moments updated in place."""

    def update(g, m, v):
        m *= b1
        m += (1 - b1) * g
        v *= b2
        v += (1 - b2) * (g * g)

    return update


@_per_array(0.0, 0.0)
def radam(f, t):
    """Liu et al.'s Algorithm 2: Adam scaled by the rectification r once the variance's length
    ρₜ exceeds 4, momentum alone before (ρₜ ≈ t for the first steps)."""
    b1, b2 = BETAS
    rho_inf = 2 / (1 - b2) - 1
    rho_t = rho_inf - 2 * t * b2**t / (1 - b2**t)
    lr, eps, c1, c2 = f(LR_ADAM), f(EPS), f(1 - b1**t), f(1 - b2**t)
    moments = _moments(f(b1), f(b2))
    r = None  # no rectification yet
    if rho_t > 4:
        r = np.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))

    def each(x, g, m, v):
        moments(g, m, v)
        if r is None:
            x -= (lr / c1) * m
        else:
            x -= (lr * f(r) / c1) * m / (np.sqrt(v / c2) + eps)

    return each


@_per_array(0.0, 0.0)
def nadam(f, t):
    """Dozat's NAdam as written in its paper (and optax): the momentum looked one step ahead."""
    b1, b2 = BETAS
    lr, eps, c2 = f(LR_ADAM), f(EPS), f(1 - b2**t)
    ahead, now = f(b1 / (1 - b1 ** (t + 1))), f((1 - b1) / (1 - b1**t))
    moments = _moments(f(b1), f(b2))

    def each(x, g, m, v):
        moments(g, m, v)
        x -= lr * (ahead * m + now * g) / (np.sqrt(v / c2) + eps)

    return each


@_per_array(0.0, 0.0)
def adamax(f, t):
    b1, b2 = f(BETAS[0]), f(BETAS[1])
    rate, eps = f(LR_ADAM / (1 - BETAS[0] ** t)), f(EPS_ADAMAX)

    def each(x, g, m, u):
        m *= b1
        m += (1 - b1) * g
        np.maximum(b2 * u, np.abs(g), out=u)
        x -= rate * m / (u + eps)

    return each


@_per_array(0.0, 0.0, 0.0)
def amsgrad(f, t):
    """Adam dividing by the largest bias-corrected second moment so far (optax's AMSGrad)."""
    lr, eps, c1, c2 = f(LR_ADAM), f(EPS), f(1 - BETAS[0] ** t), f(1 - BETAS[1] ** t)
    moments = _moments(f(BETAS[0]), f(BETAS[1]))

    def each(x, g, m, v, most):
        moments(g, m, v)
        np.maximum(most, v / c2, out=most)
        x -= lr * (m / c1) / (np.sqrt(most) + eps)

    return each


@_per_array(0.0, 0.0)
def adabelief(f, t):
    """Adam whose second moment tracks the gradient's distance from its mean, ε inside too."""
    b1, b2, lr, eps = f(BETAS[0]), f(BETAS[1]), f(LR_ADAM), f(EPS_ADABELIEF)
    c1, c2 = f(1 - BETAS[0] ** t), f(1 - BETAS[1] ** t)

    def each(x, g, m, s):
        m *= b1
        m += (1 - b1) * g
        s *= b2
        s += (1 - b2) * (g - m) ** 2 + eps
        x -= lr * (m / c1) / (np.sqrt(s / c2) + eps)

    return each


@_per_array(0.0, 0.0, 0.0)
def oadam(f, t):
    """Optimistic Adam: twice this step's Adam step less the last one's (none before the first)."""
    b1, b2 = BETAS_OADAM
    lr, eps, c1, c2 = f(LR_ADAM), f(EPS), f(1 - b1**t), f(1 - b2**t)
    moments = _moments(f(b1), f(b2))

    def each(x, g, m, v, last):
        moments(g, m, v)
        now = lr * (m / c1) / (np.sqrt(v / c2) + eps)
        x -= 2 * now - last
        last[...] = now

    return each


@_per_array(0.0)
def lion(f, t):
    """Chen et al.'s Lion: the sign of an interpolation of momentum and gradient, then the
    momentum's own update with β₂."""
    b1, b2, lr = f(BETAS_LION[0]), f(BETAS_LION[1]), f(LR_ADAM)

    def each(x, g, m):
        x -= lr * np.sign(b1 * m + (1 - b1) * g)
        m *= b2
        m += (1 - b2) * g

    return each


def clip_wd_adam(xs):
    """Each gradient entry clipped to ±CLIP_VALUE, L2 decay added (with the parameter before the
    step), then Adam."""
    adam_step = adam(epsilon=EPS_CHAINS)(xs)

    def step(gs, t):
        f = xs[0].dtype.type
        delta, decay = f(CLIP_VALUE), f(L2_DECAY)
        adam_step([np.clip(g, -delta, delta) + decay * x for x, g in zip(xs, gs)], t)

    return step


def sign_decay_momentum(xs):
    """L1 decay, λ·sign(x) added to the gradient (with the parameter before the step), then
    momentum."""
    momentum_step = momentum(xs)

    def step(gs, t):
        decay = xs[0].dtype.type(L1_DECAY)
        momentum_step([g + decay * np.sign(x) for x, g in zip(xs, gs)], t)

    return step


# --- low-precision state ------------------------------------------------------------------------

#: Arrays of fewer elements keep float moments (bitsandbytes', torchao's and LowBit's threshold).
LOW_BIT_MIN_SIZE = 4096


def _low_bit_format(bits) -> tuple:
    """`(signed map, unsigned map, block, divisor)` of a format: the map values (float64,
    ascending, no NaN), the block's elements, and what the block's largest magnitude is divided
    by to give its scale (FP8: its largest value, 448, so that the block's largest element is
    448). The maps are the library's (`_map`; tests/test_quantise.py checks them bit for bit
    against bitsandbytes' and torchao's); everything else is written here from the format's
    definition."""
    if bits == 8:
        return _map(8, True), _map(8, False), 256, 1.0
    if bits == 4:
        return _map(4, True), _map(4, False), 128, 1.0
    return _map("fp8", True), _map("fp8", True), 256, 448.0


def _map(bits, signed: bool):
    """Every value of a format's map, ascending, once each, without NaN: `optimisers.dequantise`
    of one block holding each code once, at scale 1."""
    n = 16 if bits == 4 else 256
    codes = np.arange(n, dtype=np.uint8)
    if bits == 4:  # (two codes a byte, the first in the high nibble)
        codes = (codes[0::2] << 4) | codes[1::2]
    each = opt.quantise(np.zeros(n, np.float32), bits, signed, block=n)
    values = opt.dequantise(dataclasses.replace(each, codes=codes, scale=np.ones(1, np.float32)))
    values = np.asarray(values, np.float64)
    return np.unique(values[~np.isnan(values)])  # (FP8: one 0 for +0 and -0)


def _nearest(values, table):
    """Each of `values` replaced by the nearest entry of the ascending `table` (a tie: the
    larger entry; a value beyond the ends: the end)."""
    i = np.clip(np.searchsorted(table, values), 1, len(table) - 1)
    below, above = table[i - 1], table[i]
    return np.where(values - below < above - values, below, above)


def _round_trip(a, table, block: int, divisor: float) -> None:
    """`a` replaced, in place, by the values its blockwise quantised form keeps: row-major blocks
    of `block` elements, each with the scale max(|largest|, 1e-12) / `divisor` (stored as
    float32), each element scale x the map value nearest to element / scale."""
    flat = a.reshape(-1)
    blocks = np.concatenate([flat, np.zeros((-flat.size) % block, a.dtype)]).reshape(-1, block)
    scale = np.maximum(np.abs(blocks).max(axis=1), 1e-12) / divisor
    scale = scale.astype(np.float32).astype(a.dtype)[:, None]
    kept = _nearest(blocks / scale, table.astype(a.dtype)) * scale
    a[...] = kept.reshape(-1)[: flat.size].reshape(a.shape)


def low_bit_adamw(bits) -> Naive:
    """AdamW (as `adam(decay=WEIGHT_DECAY)`) whose moments are kept blockwise quantised between
    steps in the format `bits` (8, 4 or "fp8"), for arrays of LOW_BIT_MIN_SIZE elements or more:
    each step computes the new moments from the kept ones, steps the parameter with them
    unrounded, then keeps their quantised values (bitsandbytes' and torchao's order); `m` takes
    the signed map, `v` (never negative) the unsigned one. In float64 it is the reference of the
    low-bit rows: the quantisation is part of the rule, so a row that skips it disagrees."""
    signed, unsigned, block, divisor = _low_bit_format(bits)

    @_per_array(0.0, 0.0)
    def formula(f, t):
        adamw = _adam_each(f, t, WEIGHT_DECAY, EPS)

        def each(x, g, m, v):
            adamw(x, g, m, v)
            if m.size >= LOW_BIT_MIN_SIZE:
                _round_trip(m, signed, block, divisor)
                _round_trip(v, unsigned, block, divisor)

        return each

    return formula
