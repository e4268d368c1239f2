"""Rules that change the gradient before a step: decay and clipping."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from optimisers import ops
from optimisers.core.rule import Rule, concrete
from optimisers.rules.common import Elementwise

__all__ = ["WeightDecay", "SignDecay", "ClipGrad", "ClipNorm"]


@dataclass(frozen=True)
class WeightDecay(Elementwise):
    """Weight decay (L2 regularisation): `step = g + λ·x`.

    First in a chain, it adds `λ/2·‖x‖²` to the loss: `OptimiserChain(WeightDecay(λ), Adam())` is
    Adam with L2 regularisation (PyTorch's `Adam(weight_decay=λ)`); after the optimiser,
    `OptimiserChain(Adam(η), WeightDecay(λ))` is decoupled decay (`AdamW(couple=False)`). Alone it
    subtracts the whole modified gradient, like `Descent(1)`.

    Defaults: `lambd=5e-4`. optax: `optax.add_decayed_weights(lambd)`.
    """

    lambd: float = 5e-4

    def apply(self, state, x, dx):
        return state, dx + ops.scalar(self.lambd, x) * x


@dataclass(frozen=True)
class SignDecay(Elementwise):
    """Sign decay (L1 regularisation): `step = g + λ·sign(x)` (with `sign(0) = 0`).

    First in a chain, it adds `λ·‖x‖₁` to the loss; `OptimiserChain(SignDecay(0.012),
    WeightDecay(0.034), Adam())` is Adam on the loss plus `0.012‖x‖₁ + 0.017‖x‖²`.

    Defaults: `lambd=1e-3`. No direct PyTorch/optax rule (optax:
    `optax.add_decayed_weights` is the L2 analogue). Real parameters only.
    """

    lambd: float = 1e-3
    real_only = True

    def apply(self, state, x, dx):
        return state, dx + ops.scalar(self.lambd, x) * ops.sign(x)


@dataclass(frozen=True)
class ClipGrad(Elementwise):
    """Clip every gradient entry to `[−δ, δ]`: `step = clamp(g, −δ, δ)`.

    Defaults: `delta=10.0`. PyTorch: `torch.nn.utils.clip_grad_value_(params, delta)` before the
    optimiser step; optax: `optax.clip(delta)`. Real parameters only.
    """

    delta: float = 10.0
    infinite_ok: ClassVar[tuple[str, ...]] = ("delta",)  # no clipping
    real_only = True

    def apply(self, state, x, dx):
        delta = ops.scalar(self.delta, x)
        return state, ops.clip(dx, -delta, delta)


@dataclass(frozen=True)
class ClipNorm(Rule):
    """Rescale each parameter's gradient so that its p-norm is at most ω:
    `n = ‖g‖_p`, `step = min(ω/n, 1)·g`.

    `p` is any real: 2 (Euclidean), 1, `inf` (largest |gᵢ|), `-inf` (smallest), 0 (the number of
    non-zero entries), or another value for `(Σ|gᵢ|ᵖ)^(1/p)`. With `throw=True` (default) a norm
    that is not finite (an inf or NaN in the gradient) raises ValueError; with `throw=False` an
    infinite norm scales the gradient by 0 (so an infinite entry becomes NaN) and a NaN norm gives
    NaN. The check is skipped when the norm cannot be inspected (traced under `jax.jit`).

    The norm is per parameter array. PyTorch's `torch.nn.utils.clip_grad_norm_(params,
    max_norm=omega, norm_type=p)` and optax's `optax.clip_by_global_norm(omega)` (p = 2) compute
    one norm over all parameters instead, so they agree with this for a single array only.

    Defaults: `omega=10.0, p=2.0, throw=True` (keyword only).
    """

    scales_gradient = True  # its step is gradient_factor(dx) · dx

    omega: float = 10.0
    infinite_ok: ClassVar[tuple[str, ...]] = ("omega", "p")  # no clipping; the max-norm
    p: float = field(default=2.0, metadata={"static": True})
    throw: bool = field(default=True, kw_only=True)

    def validate(self):
        omega = concrete(self.omega)
        if omega is not None and not omega > 0:
            raise ValueError(f"ClipNorm: omega (the largest norm) must be positive, got {omega}")
        p = concrete(self.p)
        if p is not None and math.isnan(p):
            raise ValueError("ClipNorm: p must be a number, got nan")

    def gradient_factor(self, dx):
        """`min(ω/‖dx‖, 1)`, a scalar of `dx`'s dtype: the step is `factor · dx`."""
        n = ops.norm(dx, self.p)
        if self.throw and ops.isfinite(n) is False:
            raise ValueError(
                f"ClipNorm: the {self.p}-norm of the gradient is {float(n)}, which is not finite; "
                "use ClipNorm(..., throw=False) to continue anyway"
            )
        omega = ops.scalar(self.omega, n)
        # min(ω/n, 1) written as ω/max(n, ω): n = 0 needs no division by zero, NaN propagates;
        # the norm may be wider than dx (float16 sums in float32), so cast the factor back
        return ops.scalar(omega / ops.maximum(n, omega), dx)

    def gradient_factors(self, dxs):
        """`gradient_factor` of each of `dxs` (of one backend and dtype) as a 1-D array, the norms
        taken together (`ops.norms`)."""
        ns = ops.norms(dxs, self.p)
        if self.throw and ops.isfinite(ns) is False:
            return [self.gradient_factor(dx) for dx in dxs]  # raises, naming the norm
        omega = ops.scalar(self.omega, ns)
        return ops.astype(omega / ops.maximum(ns, omega), dxs[0])

    def apply(self, state, x, dx):
        return state, self.gradient_factor(dx) * dx
