"""The optimisation rules. Each is a frozen dataclass of hyperparameters with `init` and `apply`
(see `optimisers.Rule`); the maths uses `optimisers.ops`, so one formula serves every backend.

Conventions shared by every rule here:

* Hyperparameters are cast to the parameter's dtype when a step is taken (`ops.scalar`), and
  epsilons to its real dtype with Optimisers.jl's float16 floor (`ops.epsilon`), so float16, bfloat16,
  float32 and float64 parameters keep their dtype. Scalars derived from hyperparameters (`1−β`,
  the bias corrections `1−βᵗ`, RAdam's ρ) are computed in the hyperparameters' own precision
  (Python floats, or traced values under `jax.jit`) and cast last: in bfloat16, 0.999 rounds to 1,
  so `1 − bf16(β₂)` would be 0 where `bf16(1 − β₂)` is 0.001. (Optimisers.jl casts β first.)
  The library's updates call `apply` for a float16/bfloat16 parameter with float32 copies of the
  parameter, gradient and state (`optimisers.engine.precision`), so the maths here meets float32 there.
* State arrays have the parameter's dtype, except MixedPrecision's master copy (its `dtype`) and a
  running *maximum* of magnitudes (AdaMax, AMSGrad): complex numbers have no order, so for a complex
  parameter those arrays hold the real dtype. Step counters are Python ints counting completed
  steps, so `t` is 1 on the first step.
* `elementwise` and the other flags, and `apply` never writing to its inputs: docs/custom-rules.md.
  ClipNorm, LAMB, LARS, Adafactor, SOAP and Muon look across an array; chains and MixedPrecision
  inherit the flag from their members.
* Complex parameters work wherever the maths is defined (`|g|²` is `ops.abs2`). Rules built on the
  sign or the order of numbers (Rprop, Lion, SignDecay, ClipGrad) raise TypeError for them in `init`.
* `x_new = x - step`. In the formulas `g` is the gradient and `t` the step number.
"""

from optimisers.rules import (
    adafactor,
    adam,
    adaptive,
    combinators,
    gradient,
    low_bit,
    muon,
    rounding,
    routing,
    schedule_free,
    sgd,
    soap,
    trust_ratio,
)
from optimisers.rules.adafactor import *  # noqa: F403
from optimisers.rules.adam import *  # noqa: F403
from optimisers.rules.adaptive import *  # noqa: F403
from optimisers.rules.combinators import *  # noqa: F403
from optimisers.rules.gradient import *  # noqa: F403
from optimisers.rules.low_bit import *  # noqa: F403
from optimisers.rules.muon import *  # noqa: F403
from optimisers.rules.rounding import *  # noqa: F403
from optimisers.rules.routing import *  # noqa: F403
from optimisers.rules.schedule_free import *  # noqa: F403
from optimisers.rules.sgd import *  # noqa: F403
from optimisers.rules.soap import *  # noqa: F403
from optimisers.rules.trust_ratio import *  # noqa: F403

__all__ = [
    *sgd.__all__,
    *adaptive.__all__,
    *adam.__all__,
    *trust_ratio.__all__,
    *soap.__all__,
    *adafactor.__all__,
    *schedule_free.__all__,
    *muon.__all__,
    *routing.__all__,
    *gradient.__all__,
    *combinators.__all__,
    *low_bit.__all__,
    *rounding.__all__,
]
