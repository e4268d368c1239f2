"""torch.optim's classes, with their names, signatures, defaults, group keys and `state[p]` keys,
trained by this library's engine (docs/torch-optimizer.md). Each maps a param group's torch
hyperparameters to one rule: the library's where torch's formula is theirs, else a rule of
`optimisers.rules.torch_named` that writes out torch's. What they share is `DropIn` (`dropin_base`).
"""

from __future__ import annotations

from optimisers.rules.adafactor import Adafactor as _Adafactor
from optimisers.rules.adafactor import is_factored
from optimisers.rules.adam import Adam as _Adam
from optimisers.rules.adam import AdamW as _AdamW
from optimisers.rules.muon import NS_COEFFICIENTS
from optimisers.rules.muon import Muon as _Muon
from optimisers.rules.sgd import Descent
from optimisers.rules.torch_named import (
    TorchAdadelta,
    TorchAdagrad,
    TorchAdamax,
    TorchAMSGrad,
    TorchNAdam,
    TorchRAdam,
    TorchRMSprop,
    TorchRprop,
    TorchSGD,
)
from optimisers.torch.checkpointing import NOT_SHOWN, STEP
from optimisers.torch.dropin_base import (
    DropIn,
    as_number,
    check_torch_switches,
    decoupled,
    described,
    torch_args,
)

__all__ = [
    "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "Rprop",
    "Adafactor", "Muon",
]  # fmt: skip


class SGD(DropIn):
    """torch.optim.SGD, trained by this library (same signature, defaults, group and state keys).
    Sparse gradients (`nn.Embedding(sparse=True)`) are taken, made dense."""

    _sparse = True

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, *,
                 maximize=False, foreach=None, differentiable=False, fused=None):  # fmt: skip
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, torch_args(locals()))

    def _rule(self, h):
        if as_number(h, "momentum") > 0:
            return TorchSGD(h["lr"], h["momentum"], h["dampening"], h["nesterov"])
        if h["nesterov"]:
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        return Descent(h["lr"])

    def _layout(self, h):
        return ("momentum_buffer", NOT_SHOWN) if as_number(h, "momentum") > 0 else ()


class Adam(DropIn):
    """torch.optim.Adam, trained by this library: without amsgrad, on float32/float64 tensors, bit
    for bit `torch.optim.Adam(fused=True)` (the library's `Adam` runs torch's fused kernel)."""

    _foreach_scalars = True  # torch's foreach kernels take neither a tensor lr nor tensor betas
    ORDER = "lr betas eps weight_decay amsgrad maximize foreach capturable differentiable fused"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=False):  # fmt: skip
        super().__init__(params, torch_args(locals(), self.ORDER + " decoupled_weight_decay"))

    def _rule(self, h):
        decay = h["weight_decay"] if decoupled(h) else 0.0
        if h["amsgrad"]:
            return TorchAMSGrad(h["lr"], tuple(h["betas"]), h["eps"], decay)
        if decoupled(h):
            return _AdamW(h["lr"], tuple(h["betas"]), decay, h["eps"])
        return _Adam(h["lr"], tuple(h["betas"]), h["eps"])

    def _layout(self, h):
        if h["amsgrad"]:
            return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", STEP)
        return ("exp_avg", "exp_avg_sq", STEP)


class AdamW(Adam):
    """torch.optim.AdamW, trained by this library's `AdamW` (decay `lr·λ·p`): on float32/float64
    tensors bit for bit `torch.optim.AdamW(fused=True)`, whose kernel it runs."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None):  # fmt: skip
        DropIn.__init__(self, params, torch_args(locals(), Adam.ORDER, decoupled_weight_decay=True))


class RMSprop(DropIn):
    """torch.optim.RMSprop, trained by this library with torch's formula (`alpha`, `centered`,
    `momentum`)."""

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0, centered=False,
                 capturable=False, foreach=None, maximize=False, differentiable=False):  # fmt: skip
        super().__init__(params, torch_args(locals(), "lr momentum alpha eps centered weight_decay "
                                            "capturable foreach maximize differentiable"))

    def _rule(self, h):
        return TorchRMSprop(h["lr"], h["alpha"], h["eps"], h["momentum"], h["centered"])

    def _layout(self, h):
        centred = ("grad_avg",) if h["centered"] else ()
        momentum = ("momentum_buffer",) if as_number(h, "momentum") > 0 else ()
        return ("square_avg", *centred, *momentum, STEP)


class Adagrad(DropIn):
    """torch.optim.Adagrad, trained by this library with torch's formula (`lr_decay`,
    `initial_accumulator_value`). Unlike torch, the state is made at the first gradient. Sparse
    gradients are taken, made dense (the same numbers: a zero gradient leaves an element as it is)."""

    _sparse = True

    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0, eps=1e-10,
                 foreach=None, *, maximize=False, differentiable=False, fused=None):  # fmt: skip
        order = "lr lr_decay eps weight_decay initial_accumulator_value foreach maximize differentiable fused"
        super().__init__(params, torch_args(locals(), order))

    def _structure(self, h):
        return (h["initial_accumulator_value"],)  # the state starts there: a change would not apply

    def _rule(self, h):
        return TorchAdagrad(h["lr"], h["lr_decay"], h["eps"], h["initial_accumulator_value"])

    _layout = ("sum", STEP)


class Adadelta(DropIn):
    """torch.optim.Adadelta, trained by this library with torch's formula (with `lr`)."""

    def __init__(self, params, lr=1.0, rho=0.9, eps=1e-6, weight_decay=0, foreach=None, *, capturable=False,
                 maximize=False, differentiable=False):  # fmt: skip
        super().__init__(params, torch_args(locals(), "lr rho eps weight_decay maximize capturable foreach "
                                            "differentiable"))

    def _rule(self, h):
        return TorchAdadelta(h["lr"], h["rho"], h["eps"])

    _layout = ("square_avg", "acc_delta", STEP)


class Adamax(DropIn):
    """torch.optim.Adamax, trained by this library with torch's formula (ε inside the maximum)."""

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, foreach=None, *,
                 maximize=False, differentiable=False, capturable=False):  # fmt: skip
        super().__init__(params, torch_args(locals()))

    def _rule(self, h):
        return TorchAdamax(h["lr"], tuple(h["betas"]), h["eps"])

    _layout = ("exp_avg", "exp_inf", STEP)


class NAdam(DropIn):
    """torch.optim.NAdam, trained by this library with torch's formula (momentum schedule
    `momentum_decay`, `decoupled_weight_decay`)."""

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, momentum_decay=4e-3,
                 decoupled_weight_decay=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False):  # fmt: skip
        order = "lr betas eps weight_decay momentum_decay decoupled_weight_decay maximize foreach capturable"
        super().__init__(params, torch_args(locals(), order + " differentiable"))

    def _rule(self, h):
        decay = h["weight_decay"] if decoupled(h) else 0.0
        return TorchNAdam(h["lr"], tuple(h["betas"]), h["eps"], h["momentum_decay"], decay)

    _layout = ("exp_avg", "exp_avg_sq", "mu_product", STEP)


class RAdam(DropIn):
    """torch.optim.RAdam, trained by this library with torch's formula (rectified from ρ > 5,
    `decoupled_weight_decay`)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 decoupled_weight_decay=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False):  # fmt: skip
        super().__init__(params, torch_args(locals(), "lr betas eps weight_decay maximize foreach capturable "
                                            "decoupled_weight_decay differentiable"))

    def _rule(self, h):
        decay = h["weight_decay"] if decoupled(h) else 0.0
        return TorchRAdam(h["lr"], tuple(h["betas"]), h["eps"], decay)

    _layout = ("exp_avg", "exp_avg_sq", STEP)


class Rprop(DropIn):
    """torch.optim.Rprop, trained by this library with torch's formula (step sizes start at
    `lr`, clamped to `step_sizes`)."""

    _l2 = False  # torch's Rprop has no weight decay

    def __init__(self, params, lr=1e-2, etas=(0.5, 1.2), step_sizes=(1e-6, 50), *, capturable=False,
                 foreach=None, maximize=False, differentiable=False):  # fmt: skip
        super().__init__(params, torch_args(locals(), "lr etas step_sizes foreach maximize differentiable "
                                            "capturable"))

    def _check(self, h, where):
        super()._check(h, where)
        minus, plus = h["etas"]
        if not 0.0 < minus < 1.0 < plus:
            raise ValueError(f"{where}: Invalid eta values: {minus}, {plus}")

    def _rule(self, h):
        return TorchRprop(h["lr"], tuple(h["etas"]), tuple(float(s) for s in h["step_sizes"]))

    _layout = ("prev", "step_size", STEP)


class Adafactor(DropIn):
    """torch.optim.Adafactor, trained by this library's `Adafactor` (docs/torch-optimizer.md).
    `foreach` is carried along (the library groups the work its own way)."""

    _l2 = False  # its weight decay is decoupled (lr·weight_decay·p), inside the rule
    _takes_complex = False  # refused at the step, as torch does

    def __init__(self, params, lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0, weight_decay=0.0, *,
                 foreach=None, maximize=False):  # fmt: skip
        super().__init__(params, torch_args(locals()))

    def _check(self, h, where):
        # torch.optim.Adafactor's own checks, in its words (eps is a pair, so not the base's)
        check_torch_switches(h, where)
        lr, decay = as_number(h, "lr"), as_number(h, "weight_decay")
        if not 0.0 <= lr:
            raise ValueError(f"{where}: Learning rate should be >= 0 but is: {lr}")
        if not 0.0 >= h["beta2_decay"]:
            raise ValueError(f"{where}: beta2_decay should be <= 0 but is: {h['beta2_decay']}")
        eps = h["eps"]
        if not (isinstance(eps, (tuple, list)) and len(eps) == 2):
            raise ValueError(f"{where}: eps must be a pair (epsilon1 or None, epsilon2), got {eps!r}")
        if eps[0] is not None and not 0.0 <= eps[0]:
            raise ValueError(f"{where}: epsilon1 should be >= 0 but is: {eps[0]}")
        if not 0.0 <= eps[1]:
            raise ValueError(f"{where}: epsilon2 should be >= 0 but is: {eps[1]}")
        if not 1.0 <= h["d"]:
            raise ValueError(f"{where}: Clipping threshold d should be >= 1 but is: {h['d']}")
        if not 0.0 <= decay:
            raise ValueError(f"{where}: weight_decay should be >= 0 but is: {decay}")

    def _rule(self, h):
        lr, decay = as_number(h, "lr"), as_number(h, "weight_decay")
        return _Adafactor(lr, h["beta2_decay"], tuple(h["eps"]), h["d"], decay)

    def _layout_for(self, h, p):
        return ("row_var", "col_var", STEP) if is_factored(p) else ("variance", STEP)


class Muon(DropIn):
    """torch.optim.Muon, trained by this library's `Muon` with Newton–Schulz in float32 where
    torch's is bfloat16 (steps 1-3% apart, docs/torch-optimizer.md). Like torch it refuses
    parameters that are not 2-D when made (route those to AdamW), complex ones at the step."""

    _l2 = False  # the decay is the rule's own, decoupled
    _one_part = True  # the rule's state is the momentum buffer alone
    _takes_complex = False  # refused at the step, as torch does

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=NS_COEFFICIENTS, eps=1e-7, ns_steps=5, adjust_lr_fn=None):  # fmt: skip
        super().__init__(params, torch_args(locals()))

    def _check(self, h, where):
        super()._check(h, where)
        if h["adjust_lr_fn"] not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"{where}: Adjust learning rate function {h['adjust_lr_fn']} is not supported")

    def _rule(self, h):
        return _Muon(
            h["lr"], h["momentum"], h["weight_decay"], nesterov=h["nesterov"], ns_steps=h["ns_steps"],
            ns_coefficients=tuple(h["ns_coefficients"]), epsilon=h["eps"],
            scale=h["adjust_lr_fn"] or "original",
        )  # fmt: skip

    _layout = ("momentum_buffer",)

    def _check_params(self, params, names, where):
        for i, (p, name) in enumerate(zip(params, names or [None] * len(params))):
            if p.ndim != 2:
                raise ValueError(
                    f"{described(where, i, name)}: Muon only supports 2D parameters (matrices), got one "
                    f"of shape {tuple(p.shape)}; give biases, normalisation weights, convolution kernels "
                    "(and, as advised, embeddings and the output head) to another optimizer such as AdamW"
                )
