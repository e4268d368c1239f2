"""optimisers: composable optimisation rules for whole models, with tied weights handled for you.

    state = optimisers.setup(optimisers.Adam(1e-3), model)
    state, model = optimisers.update(state, model, grads)    # pure
    state, model = optimisers.update_(state, model, grads)   # in place

The public names are the ones below (`__all__`), plus the modules `ops` (maths for writing rules),
`schedules`, and the integrations `optimisers.torch` and `optimisers.optax`. The subpackages are the
library's layers (docs/architecture.md); their other names may change between versions.
"""

from optimisers import (
    backends,  # noqa: F401  (registers the array backends with the core)
    ops,
    rules,
    schedules,
)
from optimisers.checkpoints.files import load, save
from optimisers.checkpoints.state_dict import CheckpointError, load_state_dict, state_dict
from optimisers.core import dispatch as _dispatch
from optimisers.core.quantised import Quantised
from optimisers.core.rule import NewValue, Rule, check_range, has_schedules
from optimisers.core.state import Leaf, State
from optimisers.core.tree import register
from optimisers.ops import dequantise, quantise
from optimisers.rules import *  # noqa: F403  (every built-in rule, by name)
from optimisers.verbs.adjust import adjust, adjust_, freeze_, thaw_
from optimisers.verbs.compiles import compiles
from optimisers.verbs.destructure import destructure, trainables
from optimisers.verbs.distinct_buffers import distinct_buffers
from optimisers.verbs.eval_params import eval_params
from optimisers.verbs.grads import grads
from optimisers.verbs.setup import setup
from optimisers.verbs.update import update, update_

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "load",
    "load_state_dict",
    "save",
    "schedules",
    "state_dict",
    *rules.__all__,
    "Leaf",
    "NewValue",
    "Rule",
    "check_range",
    "has_schedules",
    "compiles",
    "ops",
    "Quantised",
    "quantise",
    "dequantise",
    "State",
    "adjust",
    "adjust_",
    "destructure",
    "distinct_buffers",
    "eval_params",
    "freeze_",
    "grads",
    "register",
    "setup",
    "thaw_",
    "trainables",
    "update",
    "update_",
]

# jax imported first: register State/Leaf as pytrees now
_dispatch.loaded("jax")


def __getattr__(name):
    # the integrations (`optimisers.torch`: the torch.optim adapter; `optimisers.optax`: optax and
    # Flax) are imported on first use: `import optimisers` must import neither torch nor jax
    if name in ("torch", "optax"):
        import importlib

        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'optimisers' has no attribute {name!r}")
