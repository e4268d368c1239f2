"""`torch.compile`: a library call met inside a compiled function runs eagerly.

The tree walk, the grouping and the rules' bookkeeping are Python over object identities and
Python-number hyperparameters; traced by dynamo they would become guards that fail on every step
(new gradient objects, a changed learning rate), i.e. a recompilation per step. So the entry
points ask `tracing()` first and, under dynamo, call `EAGER[name]`, themselves wrapped in
`torch.compiler.disable`: one graph break, no guards on the optimiser, and the step runs exactly
as it does eagerly (same kernels, same numbers). The torch backend calls `install` when it is
imported, so this module never imports torch.
"""

from __future__ import annotations


def _never() -> bool:
    return False


tracing = _never  # after install: torch.compiler.is_compiling
EAGER: dict = {}


def install(is_compiling, disable) -> None:
    global tracing
    from ._interface import adjust, adjust_, update, update_
    from ._torch_grads import grads

    # made here, not under tracing: dynamo cannot trace the call to `disable` itself
    for fn in (update, update_, adjust, adjust_, grads):
        EAGER[fn.__name__] = disable(fn, recursive=True)
    tracing = is_compiling
