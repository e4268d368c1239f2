"""PyTorch: the `torch.optim` adapter and drop-in classes.

    from optimisers.torch import AdamW      # instead of: from torch.optim import AdamW

`Optimizer(params, rule)` takes any rule of this library; the drop-in classes take torch.optim's
signatures, defaults, group keys and `state[p]` keys, and so do `AdamWScheduleFree` and
`SGDScheduleFree`, the `schedulefree` package's classes. `flatten_(model)` moves parameters and
gradients into flat buffers, which a step takes as one array.
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
from optimisers.torch.flat import FlatBuffers, flatten_
from optimisers.torch.low_bit import (
    Adam4bit,
    Adam8bit,
    AdamFp8,
    AdamW4bit,
    AdamW8bit,
    AdamWFp8,
    Lion8bit,
    PagedAdamW8bit,
)
from optimisers.torch.optimizer import Optimizer
from optimisers.torch.schedule_free import AdamWScheduleFree, SGDScheduleFree

__all__ = [
    "Optimizer", "flatten_", "FlatBuffers", "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta",
    "Adamax", "NAdam", "RAdam", "Rprop", "Adafactor", "AdamWScheduleFree", "SGDScheduleFree", "Muon",
    "AdamW8bit", "Adam8bit", "PagedAdamW8bit", "Lion8bit", "AdamW4bit", "Adam4bit", "AdamWFp8", "AdamFp8",
]  # fmt: skip
