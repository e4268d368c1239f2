"""optimisers: composable optimisation rules for whole models, with tied weights handled for you.

    state = optimisers.setup(optimisers.Adam(1e-3), model)
    state, model = optimisers.update(state, model, grads)    # pure
    state, model = optimisers.update_(state, model, grads)   # in place
"""

from . import ops, schedules
from ._buffers import distinct_buffers
from ._checkpoint import CheckpointError, load_state_dict, state_dict
from ._checkpoint_file import load, save
from ._destructure import destructure, trainables
from ._interface import adjust, adjust_, freeze_, setup, thaw_, update, update_
from ._rule import Rule
from ._rules import (
    AccumGrad,
    AdaBelief,
    AdaDelta,
    AdaGrad,
    Adam,
    AdaMax,
    AdamW,
    AMSGrad,
    ClipGrad,
    ClipNorm,
    Descent,
    Lion,
    MixedPrecision,
    Momentum,
    NAdam,
    Nesterov,
    OAdam,
    OptimiserChain,
    RAdam,
    RMSProp,
    Rprop,
    SignDecay,
    SkipNonFinite,
    WeightDecay,
)
from ._state import Leaf, State
from ._torch_grads import grads
from ._tree import register

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "load",
    "load_state_dict",
    "save",
    "schedules",
    "state_dict",
    "AccumGrad",
    "AdaBelief",
    "AdaDelta",
    "AdaGrad",
    "AdaMax",
    "Adam",
    "AdamW",
    "AMSGrad",
    "ClipGrad",
    "ClipNorm",
    "Descent",
    "Lion",
    "MixedPrecision",
    "Momentum",
    "NAdam",
    "Nesterov",
    "OAdam",
    "OptimiserChain",
    "RAdam",
    "RMSProp",
    "Rprop",
    "SignDecay",
    "SkipNonFinite",
    "WeightDecay",
    "Leaf",
    "Rule",
    "ops",
    "State",
    "adjust",
    "adjust_",
    "destructure",
    "distinct_buffers",
    "freeze_",
    "grads",
    "register",
    "setup",
    "thaw_",
    "trainables",
    "update",
    "update_",
]

import sys as _sys  # noqa: E402

if "jax" in _sys.modules:  # jax imported first: register State/Leaf as pytrees now
    from .backends import _jax as _jax_backend  # noqa: E402, F401
del _sys


def __getattr__(name):
    # the integrations (`optimisers.torch`: the torch.optim adapter; `optimisers.optax`: optax and
    # Flax) are imported on first use: `import optimisers` must import neither torch nor jax
    if name in ("torch", "optax"):
        import importlib

        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'optimisers' has no attribute {name!r}")
