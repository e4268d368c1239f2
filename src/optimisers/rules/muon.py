"""Muon: momentum orthogonalised by a Newton–Schulz iteration, one matrix at a time."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from optimisers import ops
from optimisers.core.rule import Rule, check_range
from optimisers.rules.common import at_least_float32, cast, nonnegative

__all__ = ["Muon"]

#: the quintic's coefficients of Keller Jordan's Muon, chosen for a steep slope at zero
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

#: `scale` name -> the factor of the learning rate for a (rows, cols) matrix
SCALES = {
    # Keller Jordan's: updates of tall matrices grow with √(rows/cols) (torch's "original")
    "original": lambda rows, cols: math.sqrt(max(1.0, rows / cols)),
    # Moonshot's: the update's RMS matches AdamW's, 0.2·√max(rows, cols)
    "match_rms_adamw": lambda rows, cols: 0.2 * math.sqrt(max(rows, cols)),
}


def newton_schulz(g, coefficients, steps: int, epsilon):
    """An approximately orthogonal matrix with `g`'s singular vectors, its singular values pushed
    towards 1 (with the default coefficients and 5 steps, into [0.68, 1.21] for those at least
    0.003 times the Frobenius norm): `g` divided by its Frobenius norm (at least ε, so that a zero
    matrix stays zero), then `steps` times
    `X ← aX + (bA + cA²)X` with `A = XXᵀ`. `g` may hold a batch of matrices (its last two axes).
    A tall matrix is iterated as its transpose, so `A` is the smaller Gram matrix."""
    tall = g.shape[-2] > g.shape[-1]
    x = ops.matrix_transpose(g) if tall else g
    norm = ops.sqrt(ops.sum(x * x, axis=(-2, -1), keepdims=True))
    x = x / ops.maximum(norm, ops.epsilon(epsilon, x))
    a, b, c = cast(x, *coefficients)
    for _ in range(steps):
        gram = ops.matmul(x, ops.matrix_transpose(x))
        x = a * x + ops.matmul(b * gram + c * ops.matmul(gram, gram), x)
    return ops.matrix_transpose(x) if tall else x


@dataclass(frozen=True)
class Muon(Rule):
    """Muon, momentum orthogonalised by Newton–Schulz (Keller Jordan, "Muon: An optimizer for
    hidden layers in neural networks", 2024; Liu et al., "Muon is Scalable for LLM Training",
    2025), for the matrices of hidden layers (docs/api.md compares it with torch's and optax's).

    State: the momentum `m = 0`, of the parameter's shape. With `x` the parameter before the step:
    `m ← β·m + (1−β)·g` (an average, as torch's `lerp`); the direction `u = (1−β)·g + β·m` with
    `nesterov=True`, else `u = m`; `O = NS(u)`, `ns_steps` Newton–Schulz iterations
    `X ← aX + (bA + cA²)X`, `A = XXᵀ`, from `X = u/max(‖u‖_F, ε)` with
    `(a, b, c) = ns_coefficients` (a tall matrix is iterated as its transpose); then
    `step = η·s·O + η·λ·x`: decoupled weight decay scaled by the unadjusted η. The shape factor
    `s` of a (rows, cols) matrix is `√max(1, rows/cols)` for `scale="original"` (Keller Jordan's)
    and `0.2·√max(rows, cols)` for `scale="match_rms_adamw"` (Moonshot's: the RMS of AdamW's
    updates, so AdamW's η and λ carry over).

    A parameter of 3 or more dimensions is orthogonalised as the matrix `(shape[0], product of
    the rest)`; 0-D and 1-D parameters make `setup` raise (give them another rule, e.g. AdamW, with
    `muon_or` or a per-parameter `setup`). Real parameters only. The iteration runs in float32 for
    float16/bfloat16 parameters, in the parameter's dtype otherwise.

    Defaults: `eta=0.001, beta=0.95, lambd=0.1, nesterov=True, ns_steps=5,
    ns_coefficients=(3.4445, -4.7750, 2.0315), epsilon=1e-7, scale="original"` (all but `eta`,
    `beta` and `lambd` keyword only), torch's. PyTorch: `torch.optim.Muon(lr=eta,
    weight_decay=lambd, momentum=beta, nesterov=nesterov, ns_coefficients=ns_coefficients,
    eps=epsilon, ns_steps=ns_steps, adjust_lr_fn=scale)`, for 2-D parameters, iterating in
    bfloat16 (1-3% apart). optax: `optax.contrib.muon(eta, ns_coeffs=ns_coefficients,
    ns_steps=ns_steps, beta=beta, eps=epsilon, weight_decay=lambd, nesterov=False,
    muon_weight_dimension_numbers=MuonDimensionNumbers(1, 0))` for `nesterov=False`.
    """

    never_raises = True

    eta: float = 0.001
    beta: float = 0.95
    lambd: float = 0.1
    nesterov: bool = field(default=True, kw_only=True)
    ns_steps: int = field(default=5, kw_only=True)
    ns_coefficients: tuple = field(default=NS_COEFFICIENTS, kw_only=True)
    epsilon: float = field(default=1e-7, kw_only=True)
    scale: str = field(default="original", kw_only=True)

    def validate(self):
        check_range(self, "beta", 0.0, 1.0)
        nonnegative(self, "lambd", "epsilon")
        if self.ns_steps < 0:
            raise ValueError(f"Muon: ns_steps must be at least 0, got {self.ns_steps}")
        if self.scale not in SCALES:
            raise ValueError(f"Muon: scale must be one of {sorted(SCALES)}, got {self.scale!r}")

    def init(self, x):
        if len(x.shape) < 2:
            raise ValueError(
                f"Muon orthogonalises matrices; this parameter has shape {tuple(x.shape)} "
                f"({len(x.shape)}-D). Give 0-D and 1-D parameters (biases, normalisation scales) "
                "another rule, e.g. AdamW, with a per-parameter setup: "
                "setup(lambda path, x: Muon() if x.ndim >= 2 else AdamW(), model)"
            )
        if ops.is_complex(x):
            raise TypeError(f"Muon is not defined for complex parameters; got an array of dtype {x.dtype}")
        return ops.zeros_like(x)

    stacks = True

    def apply(self, state, x, dx):
        return _step(self, state, x, dx, tuple(x.shape))

    def apply_stacked(self, state, x, dx):
        """`apply` of parameters of one shape stacked along a new first axis, each with the
        numbers of its own `apply`: the Newton–Schulz products run batched."""
        return _step(self, state, x, dx, tuple(x.shape[1:]))


def _step(rule, state, x, dx, shape):
    beta, keep = cast(dx, rule.beta, 1 - rule.beta)
    m = beta * state + keep * dx
    u = keep * dx + beta * m if rule.nesterov else m
    rows, cols = shape[0], math.prod(shape[1:])  # a conv filter (out, in, h, w): (out, in·h·w)
    matrix = at_least_float32(ops.reshape(u, (*x.shape[: len(x.shape) - len(shape)], rows, cols)))
    o = newton_schulz(matrix, rule.ns_coefficients, rule.ns_steps, rule.epsilon)
    o = ops.astype(ops.reshape(o, x.shape), x)
    eta, decay = cast(x, rule.eta * SCALES[rule.scale](rows, cols), rule.eta * rule.lambd)
    return m, eta * o + decay * x
