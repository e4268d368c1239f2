"""SOAP: Adam run in the eigenbasis of Shampoo's preconditioner (not elementwise: it rotates)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from optimisers import ops
from optimisers.core.rule import Rule, Scheduled, check_range
from optimisers.rules.common import at_least_float32, cast, nonnegative

__all__ = ["SOAP"]


@dataclass(frozen=True)
class SOAP(Rule):
    """SOAP (Vyas et al., "SOAP: Improving and Stabilizing Shampoo using Adam", 2024,
    arXiv:2409.11321): Adam run in the eigenbasis of Shampoo's preconditioner, with the
    paper's algorithm and defaults.

    Every axis `i` of a parameter with `nᵢ ≤ max_precond_dim` entries (a 1-D parameter only with
    `precondition_1d=True`; a scalar has none) gets Shampoo's preconditioner
    `Lᵢ ← σ·Lᵢ + (1−σ)·GᵢGᵢᵀ` (σ = `shampoo_beta`, `GᵢGᵢᵀ` the gradient contracted with itself
    over every other axis: `L = GGᵀ` and `R = GᵀG` for a matrix) and an orthogonal basis `Qᵢ` of
    its eigenvectors, columns by descending eigenvalue. `rot(a)` multiplies axis `i` of `a` by
    `Qᵢᵀ` and `rot⁻¹(a)` by `Qᵢ`; axes without a basis are left alone. On step `t`, counting the
    first call as step 0:

    - `t = 0`: `Lᵢ` from `g` and `Qᵢ = eigh(Lᵢ)`; the parameter does not move (no decay either);
    - `t ≥ 1`: `g' = rot(g)`, `m ← β₁m + (1−β₁)g'`, `v ← β₂v + (1−β₂)g'²`,
      `u = rot⁻¹(m / (√v + ε))`, `x_new = (x − η·√(1−β₂ᵗ)/(1−β₁ᵗ)·u)·(1 − η·λ)`. Then `Lᵢ` takes
      `g`, and when `t % precondition_frequency == 0` each basis is refreshed by one step of power
      iteration: the columns of `Qᵢ` sorted by `diag(QᵢᵀLᵢQᵢ)` descending, `Qᵢ ← qr(Lᵢ·Qᵢ).q`;
      `v` is permuted along axis `i` with the columns and `m` is rotated into the new basis.

    State `(m, v, L, Q, t)`: `L` and `Q` hold one `nᵢ×nᵢ` matrix per axis (None for an axis
    without a basis), fixed at `setup` (`adjust` of `max_precond_dim` or `precondition_1d` applies
    to new state only). `eigh` and `qr` run in float32 or wider. A non-finite gradient gives NaN
    steps, as in Adam (wrap in `SkipNonFinite` to skip such steps). Not elementwise; real
    parameters only. A repeated eigenvalue (the first `GGᵀ` of a matrix whose axes differ in
    length by two or more) leaves the basis of its eigenspace to the linear-algebra library, so
    NumPy, PyTorch and XLA runs may then differ by more than rounding.

    Defaults: `eta=3e-3, beta=(0.95, 0.95), shampoo_beta=0.95, epsilon=1e-8, lambd=0.01,
    precondition_frequency=10, max_precond_dim=10000, precondition_1d=False` (keyword only).
    The reference implementation (github.com/nikhilvyas/SOAP, its other options at their
    defaults) `SOAP(params, lr=eta, betas=beta, shampoo_beta=shampoo_beta, eps=epsilon,
    weight_decay=lambd, ...)` computes the same steps to rounding. heavyball's `SOAP(...,
    merge_dims=False, warmup_steps=0)` agrees to about 1e-4 of the distance moved until its
    refreshes (one call earlier where its sum of `1/precondition_frequency` is exact) part; its
    defaults differ. PyTorch and optax have no SOAP.
    """

    nonnegative_state = (1,)  # (LowBit's unsigned maps)

    eta: float = 3e-3
    beta: tuple = (0.95, 0.95)
    shampoo_beta: float = 0.95
    epsilon: float = 1e-8
    lambd: float = 0.01
    precondition_frequency: int = 10
    max_precond_dim: int = 10000
    precondition_1d: bool = field(default=False, kw_only=True)
    real_only = True

    def validate(self):
        check_range(self, "beta", 0.0, 1.0, high_open=True)
        check_range(self, "shampoo_beta", 0.0, 1.0, high_open=True)
        nonnegative(self, "epsilon", "lambd", "max_precond_dim")
        check_range(self, "precondition_frequency", 1, np.inf)

    def init(self, x):
        preconditioned = len(x.shape) != 1 or self.precondition_1d
        sizes = [n if preconditioned and n <= self.max_precond_dim else None for n in x.shape]
        # preconditioners and bases are distinct arrays: one buffer at two places of a state
        # cannot be donated to a jitted step
        ls, qs = (tuple(None if n is None else ops.zeros((n, n), x) for n in sizes) for _ in range(2))
        return ops.zeros_like(x), ops.zeros_like(x), ls, qs, 0

    def exact_parts(self, state):
        # the preconditioners and bases (each axis' n×n, or None), after m and v: a square
        # parameter's would otherwise look like moments to LowBit
        own = state.state if type(state) is Scheduled else state
        first = 3 if type(state) is Scheduled else 2
        return frozenset(range(first, first + len(own[2]) + len(own[3])))

    def apply(self, state, x, dx):
        # (the refresh, too, is chosen with `ops.cond`: the rule runs under `jax.jit` unretraced)
        return ops.cond(state[-1] == 0, lambda: _first(self, state, dx), lambda: _step(self, state, x, dx))


def _first(rule, state, g):
    """Step 0: the preconditioners from `g` and their bases; no move, so that the gradient never
    meets a basis made from itself."""
    m, v, ls, qs, t = state
    ls = _accumulate(rule, ls, g)
    qs = tuple(None if lm is None else _eigenbasis(lm) for lm in ls)
    return (m, v, ls, qs, t + 1), ops.zeros_like(g)


def _step(rule, state, x, g):
    m, v, ls, qs, t = state
    b1, b2 = rule.beta
    cb1, cm, cb2, cv = cast(x, b1, 1 - b1, b2, 1 - b2)
    g_rot = _rotate(g, qs, back=False)
    m = cb1 * m + cm * g_rot
    v = cb2 * v + cv * g_rot * g_rot
    u = _rotate(m / (ops.sqrt(v) + ops.epsilon(rule.epsilon, x)), qs, back=True)
    size, decay = cast(x, rule.eta * (1 - b2**t) ** 0.5 / (1 - b1**t), rule.eta * rule.lambd)
    step = size * u
    # ε after the root of the uncorrected second moment, the decoupled decay after the step, as
    # the reference implementation: x_new = (x − η·u)(1 − ηλ)
    step = step + decay * (x - step)
    ls = _accumulate(rule, ls, g)
    refresh = t % rule.precondition_frequency == 0
    m, v, qs = ops.cond(refresh, lambda: _refresh(ls, qs, m, v), lambda: (m, v, qs))
    return (m, v, ls, qs, t + 1), step


def _accumulate(rule, ls, g):
    """Each axis' `L ← σL + (1−σ)·G Gᵀ` (G Gᵀ contracts every other axis)."""

    def accumulated(i, lm):
        rest = [j for j in range(len(g.shape)) if j != i]
        sigma, rate = cast(lm, rule.shampoo_beta, 1 - rule.shampoo_beta)
        return sigma * lm + rate * ops.tensordot(g, g, (rest, rest))

    return tuple(None if lm is None else accumulated(i, lm) for i, lm in enumerate(ls))


def _rotate(a, qs, back):
    """`a` with axis `i` multiplied by `Qᵢᵀ` (into the eigenbasis), or by `Qᵢ` with `back`; axes
    without a basis unchanged. Each contraction moves its axis last, so after all axes the
    order is the original one."""
    if all(q is None for q in qs):
        return a
    for q in qs:
        a = _first_axis_last(a) if q is None else ops.tensordot(a, q, ([0], [1 if back else 0]))
    return a


def _first_axis_last(a):
    shape = tuple(a.shape)
    moved = ops.matrix_transpose(ops.reshape(a, (shape[0], -1)))
    return ops.reshape(moved, (*shape[1:], shape[0]))


def _finite_or_zero(a):
    """`(a, True)` for a finite matrix, else `(zeros, False)`: NumPy's and PyTorch's eigh and qr
    raise on inf or NaN (XLA's return NaN), and a NaN gradient should give NaN steps, as in
    Adam, on every backend alike."""
    finite = ops.all_finite(a)
    return ops.where(finite, a, ops.zeros_like(a)), finite


def _nan_unless(finite, q):
    return ops.where(finite, q, ops.full_like(q, float("nan")))


def _eigenbasis(lm):
    """The eigenvectors of `lm` as columns, by descending eigenvalue."""
    lw, finite = _finite_or_zero(at_least_float32(lm))
    w, q = ops.eigh(lw)
    q = _nan_unless(finite, ops.take(q, ops.argsort(w, descending=True), 1))
    return ops.astype(q, lm)


def _refresh(ls, qs, m, v):
    """One step of power iteration per basis: its columns sorted by their estimated eigenvalues
    `diag(QᵀLQ)` descending (`v` permuted with them), then `Q = qr(L·Q).q`. `m` is rotated from
    the old bases into the new ones."""
    m = _rotate(m, qs, back=True)
    new = []
    for i, (lm, q) in enumerate(zip(ls, qs)):
        if q is None:
            new.append(None)
            continue
        lw, qw = at_least_float32(lm), at_least_float32(q)
        order = ops.argsort(ops.sum(qw * ops.matmul(lw, qw), axis=0), descending=True)
        v = ops.take(v, order, i)
        power, finite = _finite_or_zero(ops.matmul(lw, ops.take(qw, order, 1)))
        new.append(ops.astype(_nan_unless(finite, ops.qr(power)[0]), q))
    qs = tuple(new)
    return _rotate(m, qs, back=False), v, qs
