"""Which backend serves a value: a table from array libraries (the top-level module of a value's
type) to backend module names, filled in by `optimisers.backends`; each backend is imported on its
first use, so `import optimisers` imports neither torch nor jax (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

_SCALARS = (bool, int, float, complex)
_MODULE_OF_LIBRARY: dict[str, str] = {}  # "torch" -> "optimisers.backends.torch"
_FALLBACK = ""  # the module for every other type (NumPy's: it takes lists, NumPy scalars, ...)
_SCALAR_MODULE = ""  # the module for Python numbers
_BY_TYPE: dict[type, ModuleType] = {}
_MODULE_OF_TYPE: dict[type, str] = {}  # types served apart from their library (a tracer's arrays)


def register(libraries: str | tuple[str, ...], module: str, *, fallback: bool = False,
             scalars: bool = False) -> None:
    """Serve values whose type comes from `libraries` with the backend module named `module`
    (`fallback`: also types of no registered library; `scalars`: Python numbers)."""
    global _FALLBACK, _SCALAR_MODULE
    for library in (libraries,) if isinstance(libraries, str) else libraries:
        _MODULE_OF_LIBRARY[library] = module
    if fallback:
        _FALLBACK = module
    if scalars:
        _SCALAR_MODULE = module
    _BY_TYPE.clear()


def register_type(t: type, module: str) -> None:
    """Serve values of exactly type `t` with the backend module named `module`."""
    _MODULE_OF_TYPE[t] = module
    _BY_TYPE.pop(t, None)


def library_of(t: type) -> str:
    return t.__module__.partition(".")[0]


def is_array_library(library: str) -> bool:
    """Whether types from `library` may be arrays (containers never are)."""
    return library in _MODULE_OF_LIBRARY


def backend(x) -> ModuleType:
    """The backend module that handles values of `type(x)`."""
    t = type(x)
    found = _BY_TYPE.get(t)
    if found is None:
        name = _MODULE_OF_TYPE.get(t) or _MODULE_OF_LIBRARY.get(library_of(t))
        if name is None:
            # np.float64 subclasses float but is NumPy's
            name = _SCALAR_MODULE if issubclass(t, _SCALARS) else _FALLBACK
        found = _BY_TYPE[t] = importlib.import_module(name)
    return found


def loaded(library: str) -> ModuleType | None:
    """The backend of `library` when the user has imported that library, else None (never imports
    the library itself)."""
    name = _MODULE_OF_LIBRARY.get(library)
    if name is None or library not in sys.modules:
        return None
    return importlib.import_module(name)


def loaded_backends() -> list[ModuleType]:
    """The backends whose libraries the user has imported, in the order they were registered."""
    names = dict.fromkeys(m for lib, m in _MODULE_OF_LIBRARY.items() if lib in sys.modules)
    return [importlib.import_module(name) for name in names]
