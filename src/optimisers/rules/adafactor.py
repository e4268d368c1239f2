"""Adafactor: a second moment kept as row and column factors, so its state is far smaller than
the parameter (Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost",
2018). Not elementwise: its norms and factors couple the array.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from optimisers import ops
from optimisers.core.rule import Rule, check_range, scheduled_fields
from optimisers.rules.common import cast, nonnegative, real_zeros

__all__ = ["Adafactor"]


def is_factored(x) -> bool:
    """Whether Adafactor keeps row and column factors for `x` (two or more dimensions) rather
    than a full second moment (a vector or a scalar)."""
    return len(x.shape) >= 2


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

    @property
    def scaled_elementwise(self):
        # a vector's step is elementwise given one factor per array (the RMS of x and of U); a
        # matrix's second moment is not, but its state is not shaped like it, so the engine and
        # the compiled way leave it to `apply` (the factors come from outside `apply`: no schedule)
        return not scheduled_fields(self)

    def init(self, x):
        if is_factored(x):
            return real_zeros(x[..., :1]), real_zeros(x[..., :1, :]), 0
        return real_zeros(x), 0

    def apply(self, state, x, dx):
        new_state, u = self._moments_and_direction(state, x, dx, stacked=False)
        if u is None:
            return new_state, ops.zeros_like(x)
        return new_state, self._scaled_step(new_state, x, u, self.step_factors([x], [u])[0])

    def apply_stacked(self, state, x, dx):
        """`apply` of parameters of one shape stacked along a new first axis: each slice with its
        own factors and RMS, the same numbers."""
        new_state, u = self._moments_and_direction(state, x, dx, stacked=True)
        if u is None:
            return new_state, ops.zeros_like(x)
        factors = ops.reshape(self.step_factors(list(x), list(u)), (-1,) + (1,) * (len(x.shape) - 1))
        return new_state, self._scaled_step(new_state, x, u, factors)

    def direction(self, state, x, dx):
        """`U = g/√max(V̂, ε₁²)` with the new second moment (whole arrays for a matrix)."""
        return self._moments_and_direction(state, x, dx, stacked=False)[1]

    def step_factors(self, xs, us):
        """`max(ε₂, RMS(x)) / max(1, RMS(U)/d)` of each array (the relative step `ρ`, which needs
        the step count, is applied by `apply_scaled`)."""
        sizes = [math.prod(x.shape) for x in xs] if isinstance(xs, list) else [xs.shape[-1]]
        norm_x, norm_u = ops.norms(xs, 2), ops.norms(us, 2)
        if min(sizes) == max(sizes):
            root = math.sqrt(max(sizes[0], 1))
        else:  # (each array's √n, as the division by a number rounds it)
            roots = [ops.full_like(norm_x[:1], math.sqrt(max(n, 1))) for n in sizes]
            root = ops.reshape(ops.stack(roots), (-1,))
        rms_x, rms_u = norm_x / root, norm_u / root
        eps2, d, one = cast(rms_x, self.epsilon[1], self.d, 1)
        return ops.astype(ops.maximum(rms_x, eps2) / ops.maximum(rms_u / d, one), xs[0])

    def apply_scaled(self, state, x, dx, factor):
        new_state, u = self._moments_and_direction(state, x, dx, stacked=False)
        if u is None:
            return new_state, ops.zeros_like(x)
        return new_state, self._scaled_step(new_state, x, u, factor)

    def _moments_and_direction(self, state, x, dx, stacked):
        """The new state and `U`; `U` None for an array of no entries (whose means over an empty
        axis would be NaN)."""
        *moments, t = state
        t = t + 1
        if math.prod(x.shape) == 0:
            return (*moments, t), None
        new = t**self.beta2_decay  # 1 − β₂ₜ, in the hyperparameters' precision
        g2 = ops.abs2(dx)
        eps1 = ops.dtype_epsilon(x) if self.epsilon[0] is None else self.epsilon[0]
        keep, new = cast(g2, 1 - new, new)
        factored = len(x.shape) >= (3 if stacked else 2)  # (a stack's first axis lists parameters)
        root, moments = _second_moment(factored, moments, g2, keep, new, eps1)
        return (*moments, t), dx / ops.maximum(root, ops.epsilon(eps1, g2))

    def _scaled_step(self, new_state, x, u, factor):
        """`ρ·factor·U + η·λ·x`, `ρ = min(η, 1/√t)` with the new step count `t`."""
        t = new_state[-1]
        # min(η, 1/√t), η a number or a traced value (ops picks a backend by its first argument)
        eta, root = self.eta, t**-0.5
        rho = ops.minimum(root, eta) if isinstance(eta, numbers.Number) else ops.minimum(eta, root)
        step = (ops.scalar(rho, x) * factor) * u
        if ops.concrete(self.lambd) != 0:  # (traced: always added)
            step = step + ops.scalar(self.eta * self.lambd, x) * x
        return step


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
