"""Adafactor: a second moment kept as row and column factors, so its state is far smaller than
the parameter (Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost",
2018). Not elementwise: its norms and factors couple the array.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from optimisers import ops
from optimisers.core.rule import Rule, check_range
from optimisers.rules.common import cast, nonnegative, real_zeros

__all__ = ["Adafactor"]


def is_factored(x) -> bool:
    """Whether Adafactor keeps row and column factors for `x` (two or more dimensions) rather
    than a full second moment (a vector or a scalar)."""
    return len(x.shape) >= 2


def _rms(a, stacked):
    """The root mean square of all entries of `a`, a 0-d array of its real dtype (0 for an empty
    array); `stacked`: of each slice along the first axis, shaped to multiply the stack
    (`ops.norms` gives each slice its own norm's bits)."""
    if not stacked:
        return ops.norm(a, 2) / math.sqrt(max(math.prod(a.shape), 1))
    norms = ops.reshape(ops.norms(list(a), 2), (-1,) + (1,) * (len(a.shape) - 1))
    return norms / math.sqrt(max(math.prod(a.shape[1:]), 1))


@dataclass(frozen=True)
class Adafactor(Rule):
    """Adafactor (Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory
    Cost", 2018), as `torch.optim.Adafactor` computes it.

    State for a parameter of two or more dimensions: `(R, C, t)`, the row factor `R` (its shape
    with the last dimension 1) and the column factor `C` (its shape with the second-to-last
    dimension 1), both of its real dtype; leading dimensions are batch dimensions, each slice
    factored on its own. For a vector or a scalar: `(V, t)`, a full second moment. So a
    `m×n` matrix keeps `m + n` numbers where Adam keeps `2mn`.

    Each step, with `g` the gradient, `x` the parameter before the step, `1 − β₂ₜ = t^τ`
    (τ = `beta2_decay`) and means over the last (`mean₋₁`) or second-to-last (`mean₋₂`) axis:

    - matrices: `R ← β₂ₜR + (1−β₂ₜ)·mean₋₁|g|²`, `C ← β₂ₜC + (1−β₂ₜ)·mean₋₂|g|²`,
      `V̂ = R·C / max(mean₋₂R, ε₁)`; vectors and scalars: `V̂ = V ← β₂ₜV + (1−β₂ₜ)|g|²`;
    - `U = g / √max(V̂, ε₁²)`, clipped: `Û = U / max(1, RMS(U)/d)`;
    - relative step `ρ = min(η, 1/√t)`, `α = max(ε₂, RMS(x))·ρ`;
    - `step = α·Û + η·λ·x` (decoupled weight decay scaled by η, as torch).

    `epsilon = (ε₁, ε₂)`; `ε₁ = None` is the machine epsilon of the dtype the maths runs in: the
    parameter's, and float32 for float16/bfloat16 parameters (whose maths the library runs in
    float32, where torch uses float16's epsilon). ε₁ is placed as torch places it (a floor under
    the row factors' mean and under `V̂`), not added to `|g|²` as in the paper and optax. RMS is
    over the whole array. Complex parameters use `|g|²` (as optax; torch refuses them).

    Defaults: `eta=0.01, beta2_decay=-0.8, epsilon=(None, 1e-3), d=1.0, lambd=0.0`, torch's.
    PyTorch: `torch.optim.Adafactor(lr=eta, beta2_decay, eps=epsilon, d, weight_decay=lambd)`
    computes the same steps. optax: `optax.adafactor(learning_rate=eta, min_dim_size_to_factor=1,
    decay_rate=-beta2_decay, momentum=None, ...)` coincides while `1/√t ≥ η`, for arrays whose
    two largest dimensions are the last two (docs/api.md lists the settings and limits).
    """

    never_raises = True
    stacks = True  # small vectors (or matrices) of one shape step as one stack

    eta: float = 1e-2
    beta2_decay: float = -0.8
    epsilon: tuple = (None, 1e-3)
    d: float = 1.0
    lambd: float = 0.0

    def validate(self):
        e1 = self.epsilon[0]
        if e1 is not None:
            if isinstance(e1, bool) or not (isinstance(e1, numbers.Real) or getattr(e1, "shape", None) == ()):
                raise TypeError(f"Adafactor: epsilon[0] must be None or a real number, got {e1!r}")
            if isinstance(e1, numbers.Integral):  # a float, so that jit traces it like epsilon[1]
                object.__setattr__(self, "epsilon", (float(e1), self.epsilon[1]))
        check_range(self, "beta2_decay", -math.inf, 0.0)
        check_range(self, "d", 1.0, math.inf)
        nonnegative(self, "epsilon", "lambd")

    def init(self, x):
        if is_factored(x):
            return real_zeros(x[..., :1]), real_zeros(x[..., :1, :]), 0
        return real_zeros(x), 0

    def apply(self, state, x, dx):
        return self._step(state, x, dx, stacked=False)

    def apply_stacked(self, state, x, dx):
        """`apply` of parameters of one shape stacked along a new first axis: each slice with its
        own factors and RMS, the same numbers."""
        return self._step(state, x, dx, stacked=True)

    def _step(self, state, x, dx, stacked):
        *moments, t = state
        t = t + 1
        if math.prod(x.shape) == 0:  # no entries: the means over an empty axis would be NaN
            return (*moments, t), ops.zeros_like(x)
        new = t**self.beta2_decay  # 1 − β₂ₜ, in the hyperparameters' precision
        g2 = ops.abs2(dx)
        eps1 = ops.dtype_epsilon(x) if self.epsilon[0] is None else self.epsilon[0]
        keep, new = cast(g2, 1 - new, new)
        factored = len(x.shape) >= (3 if stacked else 2)  # (a stack's first axis lists parameters)
        root, moments = _second_moment(factored, moments, g2, keep, new, eps1)
        u = dx / ops.maximum(root, ops.epsilon(eps1, g2))
        rms_x = _rms(x, stacked)
        # min(η, 1/√t), η a number or a traced value (ops picks a backend by its first argument)
        eta, root = self.eta, t**-0.5
        rho = ops.minimum(root, eta) if isinstance(eta, numbers.Number) else ops.minimum(eta, root)
        eps2, rho, d, one = cast(rms_x, self.epsilon[1], rho, self.d, 1)
        alpha = ops.maximum(rms_x, eps2) * rho
        scale = alpha / ops.maximum(_rms(u, stacked) / d, one)
        step = (ops.astype(scale, x) if stacked else ops.scalar(scale, x)) * u
        if ops.concrete(self.lambd) != 0:  # (traced: always added)
            step = step + ops.scalar(self.eta * self.lambd, x) * x
        return (*moments, t), step


def _second_moment(factored, moments, g2, keep, new, eps1):
    """`(√V̂, new moments)`: the factors `(R, C)` of a matrix, or the full `V` of a vector."""
    if not factored:
        v = keep * moments[0] + new * g2
        return ops.sqrt(v), (v,)
    row, col = moments
    row = keep * row + new * ops.mean(g2, axis=-1, keepdims=True)
    col = keep * col + new * ops.mean(g2, axis=-2, keepdims=True)
    floor = ops.maximum(ops.mean(row, axis=-2, keepdims=True), ops.epsilon(eps1, g2))
    # √V̂ = √R·√(C/floor): the roots and the division on the small factors, so the full size sees
    # one product (√max(V̂, ε₁²) = max(√V̂, ε₁), up to rounding)
    return ops.sqrt(row) * ops.sqrt(col / floor), (row, col)
