"""PyTorch: the `torch.optim` adapter and drop-in classes.

    from optimisers.torch import AdamW      # instead of: from torch.optim import AdamW

`Optimizer(params, rule)` takes any rule of this library; the drop-in classes take torch.optim's
signatures, defaults, group keys and `state[p]` keys, and so do `AdamWScheduleFree` and
`SGDScheduleFree`, the `schedulefree` package's classes.
"""

from optimisers.torch.dropins import (
    SGD,
    Adadelta,
    Adafactor,
    Adagrad,
    Adam,
    Adamax,
    AdamW,
    Muon,
    NAdam,
    RAdam,
    RMSprop,
    Rprop,
)
from optimisers.torch.optimizer import Optimizer
from optimisers.torch.schedule_free import AdamWScheduleFree, SGDScheduleFree

__all__ = [
    "Optimizer",
    "SGD",
    "Adam",
    "AdamW",
    "RMSprop",
    "Adagrad",
    "Adadelta",
    "Adamax",
    "NAdam",
    "RAdam",
    "Rprop",
    "Adafactor",
    "AdamWScheduleFree",
    "SGDScheduleFree",
    "Muon",
]
