"""Library calls met inside `torch.compile` run eagerly: traced by dynamo, the tree walk and the
rules' bookkeeping (Python over object identities and numbers) would become guards that fail on
every step. Under dynamo an entry point calls its undecorated self wrapped in
`torch.compiler.disable`: one graph break (docs/torch-compile.md). The torch backend calls
`install` when it is imported, so this module never imports torch.
"""

from __future__ import annotations

import functools


def _never() -> bool:
    return False


tracing = _never  # after install: torch.compiler.is_compiling
EAGER: dict = {}  # entry point's name -> its undecorated self, wrapped in torch.compiler.disable
_ENTRY_POINTS: dict = {}  # entry point's name -> its undecorated self
_disable = None


def eager_under_compile(fn):
    """Decorate a library entry point so that it runs eagerly inside a compiled function."""
    name = f"{fn.__module__}.{fn.__qualname__}"
    _ENTRY_POINTS[name] = fn
    if _disable is not None:  # decorated after install
        EAGER[name] = _disable(fn, recursive=True)

    @functools.wraps(fn)
    def entry_point(*args, **kwargs):
        if tracing():
            return EAGER[name](*args, **kwargs)
        return fn(*args, **kwargs)

    # a code object of its own: dynamo decides per code object whether to trace or skip a frame,
    # and one entry point's decision must not be taken for the others
    entry_point.__code__ = entry_point.__code__.replace()
    return entry_point


def install(is_compiling, disable) -> None:
    global tracing, _disable
    # made here, not under tracing: dynamo cannot trace the call to `disable` itself
    _disable = disable
    for name, fn in _ENTRY_POINTS.items():
        EAGER[name] = disable(fn, recursive=True)
    tracing = is_compiling
