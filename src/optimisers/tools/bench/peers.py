"""Each rule's counterparts in torch.optim and optax, built from the rule itself: the one table of
peers, read by the bench's rows (`rules`) and by the repository's tests (`tests/rules_registry.py`,
which compares every rule with its peers at settings where the two compute the same steps; the
rule's docstring says where they differ).

`TORCH[type(rule)].make(rule, params)` is the torch.optim optimiser, `OPTAX[type(rule)](optax, rule)`
the optax transformation (its updates are added to the parameters).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import optimisers as opt


@dataclass(frozen=True)
class TorchOptim:
    """The torch.optim class computing the same steps, and the rule's hyperparameters as its
    keywords."""

    name: str
    kwargs: Callable[[opt.Rule], dict]
    fused: bool = False  # torch has a fused kernel for it
    differs_at_step: int | None = None  # one step that differs by design (see the rule's docstring)

    def make(self, rule: opt.Rule, params, **implementation):
        import torch

        return getattr(torch.optim, self.name)(params, **self.kwargs(rule), **implementation)

    def drop_in(self, rule: opt.Rule, params):
        """The same, made by `optimisers.torch`'s class of the same name and signature."""
        import optimisers.torch

        return getattr(optimisers.torch, self.name)(params, **self.kwargs(rule))


# optax's gradient transformations give updates to add; ours on their own subtract them
def _descend(optax, transform):
    return optax.chain(transform, optax.scale(-1.0))


def _adamw_torch(r):
    assert r.couple, "torch.optim.AdamW decays by lr·wd·x: couple=True"
    return dict(lr=r.eta, betas=r.beta, eps=r.epsilon, weight_decay=r.lambd)


def _adamw_optax(optax, r):
    assert r.couple, "optax.adamw decays by lr·wd·x: couple=True"
    return optax.adamw(r.eta, b1=r.beta[0], b2=r.beta[1], eps=r.epsilon, weight_decay=r.lambd)


def _adafactor_optax(optax, r):
    """optax.adafactor where it computes our steps: decay rate −τ, clipping threshold d, no
    momentum, its parameter-scale floor 1e-3 = ε₂, factoring every matrix (the two largest
    dimensions), relative step min(η, 1/√t), weight decay η·λ. It adds its eps = 1e-30 to |g|²
    where ours floors with ε₁: equal for gradients far above both."""
    import jax.numpy as jnp

    assert r.epsilon[1] == 1e-3, "optax.adafactor's parameter-scale floor is 1e-3"
    return optax.adafactor(
        learning_rate=lambda count: jnp.minimum(r.eta, 1 / jnp.sqrt(count + 1.0)),
        min_dim_size_to_factor=1, decay_rate=-r.beta2_decay, multiply_by_parameter_scale=True,
        clipping_threshold=r.d, momentum=None, weight_decay_rate=r.eta * r.lambd if r.lambd else None,
    )


def _muon_optax(optax, r):
    """optax.contrib.muon bias-corrects its momentum: the normalisation before Newton–Schulz
    cancels that without Nesterov, not in its Nesterov term. Its width scaling takes rows as the
    input axis: dimension numbers (1, 0) make it ours."""
    assert not r.nesterov, "optax.contrib.muon's Nesterov term is bias-corrected: nesterov=False"
    rms = r.scale == "match_rms_adamw"
    return optax.contrib.muon(
        r.eta, ns_coeffs=r.ns_coefficients, ns_steps=r.ns_steps, beta=r.beta, eps=r.epsilon,
        weight_decay=r.lambd, nesterov=False, consistent_rms=0.2 if rms else None,
        muon_weight_dimension_numbers=optax.contrib.MuonDimensionNumbers(1, 0),
    )


TORCH: dict[type, TorchOptim] = {
    opt.Descent: TorchOptim("SGD", lambda r: dict(lr=r.eta), fused=True),
    # torch keeps lr outside the velocity, we inside: the same for a constant lr
    opt.Momentum: TorchOptim("SGD", lambda r: dict(lr=r.eta, momentum=r.rho, dampening=0), fused=True),
    opt.Nesterov: TorchOptim("SGD", lambda r: dict(lr=r.eta, momentum=r.rho, nesterov=True), fused=True),
    opt.RMSProp: TorchOptim(
        "RMSprop", lambda r: dict(lr=r.eta, alpha=r.rho, eps=r.epsilon, centered=r.centred)
    ),
    opt.Rprop: TorchOptim("Rprop", lambda r: dict(lr=r.eta, etas=r.ell, step_sizes=r.gamma)),
    opt.Adam: TorchOptim("Adam", lambda r: dict(lr=r.eta, betas=r.beta, eps=r.epsilon), fused=True),
    # torch rectifies from ρₜ > 5, we from ρₜ > 4: with β₂ = 0.999 only step 5 differs
    opt.RAdam: TorchOptim("RAdam", lambda r: dict(lr=r.eta, betas=r.beta, eps=r.epsilon), differs_at_step=5),
    opt.AdaMax: TorchOptim("Adamax", lambda r: dict(lr=r.eta, betas=r.beta, eps=r.epsilon)),
    opt.AdaGrad: TorchOptim(
        "Adagrad", lambda r: dict(lr=r.eta, initial_accumulator_value=r.epsilon, eps=r.epsilon), fused=True
    ),
    opt.AdaDelta: TorchOptim("Adadelta", lambda r: dict(lr=1.0, rho=r.rho, eps=r.epsilon)),
    opt.AdamW: TorchOptim("AdamW", _adamw_torch, fused=True),
    opt.Adafactor: TorchOptim(
        "Adafactor",
        lambda r: dict(lr=r.eta, beta2_decay=r.beta2_decay, eps=r.epsilon, d=r.d, weight_decay=r.lambd),
    ),
}

OPTAX: dict[type, Callable] = {
    opt.Descent: lambda optax, r: optax.sgd(r.eta),
    opt.Momentum: lambda optax, r: optax.sgd(r.eta, momentum=r.rho),
    opt.Nesterov: lambda optax, r: optax.sgd(r.eta, momentum=r.rho, nesterov=True),
    # optax's default puts ε inside the root
    opt.RMSProp: lambda optax, r: optax.rmsprop(
        r.eta, decay=r.rho, eps=r.epsilon, eps_in_sqrt=False, centered=r.centred
    ),
    opt.Adam: lambda optax, r: optax.adam(r.eta, b1=r.beta[0], b2=r.beta[1], eps=r.epsilon),
    opt.RAdam: lambda optax, r: optax.radam(r.eta, b1=r.beta[0], b2=r.beta[1], eps=r.epsilon, threshold=4.0),
    opt.AdaMax: lambda optax, r: optax.adamax(r.eta, b1=r.beta[0], b2=r.beta[1], eps=r.epsilon),
    # optax puts ε inside the root: eps=0 and the accumulator's start ε
    opt.AdaGrad: lambda optax, r: optax.adagrad(r.eta, initial_accumulator_value=r.epsilon, eps=0.0),
    opt.AdaDelta: lambda optax, r: optax.adadelta(1.0, rho=r.rho, eps=r.epsilon),
    opt.AMSGrad: lambda optax, r: optax.amsgrad(r.eta, b1=r.beta[0], b2=r.beta[1], eps=r.epsilon),
    opt.NAdam: lambda optax, r: optax.nadam(r.eta, b1=r.beta[0], b2=r.beta[1], eps=r.epsilon),
    opt.AdamW: _adamw_optax,
    opt.AdaBelief: lambda optax, r: optax.adabelief(
        r.eta, b1=r.beta[0], b2=r.beta[1], eps=r.epsilon, eps_root=r.epsilon
    ),
    # optax.lion's defaults differ (b2=0.99, weight_decay=1e-3): all given
    opt.Lion: lambda optax, r: optax.lion(r.eta, b1=r.beta[0], b2=r.beta[1], weight_decay=0.0),
    opt.ADOPT: lambda optax, r: optax.contrib.adopt(r.eta, b1=r.beta[0], b2=r.beta[1], eps=r.epsilon),
    # constant b3 and alpha (no warm-up schedulers), eps_root=0; both scale the decay by the rate
    opt.AdEMAMix: lambda optax, r: optax.contrib.ademamix(
        r.eta, b1=r.beta[0], b2=r.beta[1], b3=r.beta[2], alpha=r.alpha, eps=r.epsilon, eps_root=0.0,
        weight_decay=r.lambd,
    ),
    # the same steps when warmup=0 and r=0 (optax has no r, and its warm-up lags one step)
    opt.ScheduleFreeAdamW: lambda optax, r: optax.contrib.schedule_free_adamw(
        r.eta, warmup_steps=None, b1=r.beta[0], b2=r.beta[1], eps=r.epsilon, weight_decay=r.lambd,
        weight_lr_power=r.weight_lr_power,
    ),
    opt.ScheduleFreeSGD: lambda optax, r: optax.contrib.schedule_free_sgd(
        r.eta, warmup_steps=None, b1=r.beta, weight_decay=r.lambd, weight_lr_power=r.weight_lr_power
    ),
    opt.LAMB: lambda optax, r: optax.lamb(
        r.eta, b1=r.beta[0], b2=r.beta[1], eps=r.epsilon, eps_root=0.0, weight_decay=r.lambd
    ),
    # at its default masks (decay and trust ratio on every array), the learning rate before its
    # momentum, as ours
    opt.LARS: lambda optax, r: optax.lars(
        r.eta, weight_decay=r.lambd, trust_coefficient=r.trust, eps=r.epsilon, momentum=r.beta,
        nesterov=r.nesterov,
    ),
    opt.Adafactor: _adafactor_optax,
    opt.Muon: _muon_optax,
    opt.WeightDecay: lambda optax, r: _descend(optax, optax.add_decayed_weights(r.lambd)),
    opt.ClipGrad: lambda optax, r: _descend(optax, optax.clip(r.delta)),
    # optax's norm is global, ours per array: equal for a model with a single array
    opt.ClipNorm: lambda optax, r: _descend(optax, optax.clip_by_global_norm(r.omega)),
}
