"""Seeing a model as a tree: which objects are containers, what their children are, how to rebuild
one with some children replaced, and which leaves are parameters.

Everything here is about structure; nothing here knows about rules or optimiser state.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, NamedTuple

from optimisers.core import dispatch

Path = tuple


class NodeKind(NamedTuple):
    """How to take a container apart and put it back together."""

    name: str
    children: Callable[[Any], list]  # node -> [(key, child), ...]
    rebuild: Callable[[Any, dict], Any]  # (node, {key: new child}) -> a node with those children
    # (node, grad, path) -> {key: gradient} for a form other than the generic ones (mapping,
    # sequence, same type), or None where it does not recognise `grad`
    grad_children: Callable | None = None
    # (node, key) -> why a key the state has is not a child now (a torch parameter frozen with
    # `requires_grad_(False)` after setup), or None
    why_not_child: Callable | None = None
    # node -> the tuple of dicts that hold its children where they are (a module's parameters and
    # submodules), which a replayed step reads without calling `children`
    fields: Callable | None = None


# --- the built-in kinds ------------------------------------------------------------------------


def _mapping_rebuild(node, changes):
    if type(node) is dict:
        return {k: changes.get(k, v) for k, v in node.items()}
    if isinstance(node, MutableMapping):
        new = copy.copy(node)
        new.update(changes)
        return new
    return type(node)({k: changes[k] if k in changes else v for k, v in node.items()})


def _list_rebuild(node, changes):
    new = list(node) if type(node) is list else copy.copy(node)
    for k, v in changes.items():
        new[k] = v
    return new


def _tuple_rebuild(node, changes):
    values = [changes[i] if i in changes else v for i, v in enumerate(node)]
    return tuple(values) if type(node) is tuple else type(node)(values)


def _attrs_rebuild(node, changes):
    # copy + setattr keeps fields that __init__ does not take, and works for frozen dataclasses
    new = copy.copy(node)
    for k, v in changes.items():
        object.__setattr__(new, k, v)
    return new


MAPPING = NodeKind("mapping", lambda n: list(n.items()), _mapping_rebuild)
LIST = NodeKind("list", lambda n: list(enumerate(n)), _list_rebuild)
TUPLE = NodeKind("tuple", lambda n: list(enumerate(n)), _tuple_rebuild)
NAMEDTUPLE = NodeKind(
    "namedtuple", lambda n: list(zip(n._fields, n)), lambda n, c: n._replace(**c) if c else n
)
DATACLASS = NodeKind(
    "dataclass",
    lambda n: [(f.name, getattr(n, f.name)) for f in dataclasses.fields(n)],
    _attrs_rebuild,
)

_REGISTRY: dict[type, NodeKind] = {}
_KIND_CACHE: dict[type, NodeKind | None] = {}


def register(cls: type, fields=None, *, children=None, rebuild=None) -> type:
    """Let the library see inside instances of `cls`.

    Either name the attributes that hold children, `register(Linear, ("weight", "bias"))`, or give
    `children(obj) -> [(key, child), ...]` and `rebuild(obj, {key: new_child}) -> new_obj`. Returns
    `cls`, so it also works as a class decorator when used as `register(cls, fields)`.
    """
    if not isinstance(cls, type):
        raise TypeError(f"register expects a class, got {cls!r}")
    if fields is not None:
        if children is not None or rebuild is not None:
            raise TypeError("register takes either `fields` or `children` and `rebuild`, not both")
        names = (fields,) if isinstance(fields, str) else tuple(fields)
        kind = NodeKind(cls.__name__, lambda n: [(k, getattr(n, k)) for k in names], _attrs_rebuild)
    elif children is not None and rebuild is not None:
        kind = NodeKind(cls.__name__, children, rebuild)
    else:
        raise TypeError("register needs `fields`, or both `children` and `rebuild`")
    _REGISTRY[cls] = kind
    _KIND_CACHE.clear()
    return cls


def _find_kind(obj) -> NodeKind | None:
    t = type(obj)
    for base in t.__mro__:
        if base in _REGISTRY:
            return _REGISTRY[base]
    if isinstance(obj, Mapping):
        jax = dispatch.loaded("jax")
        if jax is not None and isinstance(obj, MutableMapping) and not isinstance(obj, dict):
            # a mutable mapping that JAX flattens (Flax's nnx.State) is rebuilt by its own
            # unflatten: a shallow copy of nnx.State shares its storage with the caller's
            kind = jax.node_kind(obj)
            if kind is not None:
                return kind
        return MAPPING
    if isinstance(obj, tuple):
        return NAMEDTUPLE if hasattr(t, "_fields") else TUPLE
    if isinstance(obj, list):
        return LIST
    if dataclasses.is_dataclass(obj):
        return DATACLASS
    # framework containers, asked only of the frameworks the user has imported
    for backend in dispatch.loaded_backends():
        kind = backend.node_kind(obj)
        if kind is not None:
            return kind
    return None


def kind_of(obj) -> NodeKind | None:
    """The container kind of `obj`, or None for a leaf (arrays, numbers, strings, anything else)."""
    try:
        return _KIND_CACHE[type(obj)]
    except KeyError:
        kind = _KIND_CACHE[type(obj)] = None if _is_array(obj) else _find_kind(obj)
        return kind


def _is_array(x) -> bool:
    # Only array libraries' own types can be arrays; this keeps containers away from their backends.
    return dispatch.is_array_library(dispatch.library_of(type(x))) and dispatch.backend(x).is_array(x)


_PARAM_CHECK: dict[type, Callable | None] = {}


def is_param(x) -> bool:
    """Is `x` a trainable array (floating or complex dtype)?"""
    t = type(x)
    try:
        check = _PARAM_CHECK[t]
    except KeyError:
        is_array_type = dispatch.is_array_library(dispatch.library_of(t))
        check = _PARAM_CHECK[t] = dispatch.backend(x).is_param if is_array_type else None
    return check is not None and check(x)


def why_not_param(x) -> str | None:
    """Why the array `x` is not trained now, in its backend's words (a torch parameter frozen
    with `requires_grad_(False)`), or None."""
    if not dispatch.is_array_library(dispatch.library_of(type(x))):
        return None
    why = getattr(dispatch.backend(x), "why_not_param", None)
    return None if why is None else why(x)


def trainable_children(node, kind: NodeKind) -> list:
    """The `(key, child)` pairs the library trains; `__trainable__` on the class restricts them."""
    pairs = kind.children(node)
    names = getattr(type(node), "__trainable__", None)
    if names is None:
        return pairs
    return [(k, c) for k, c in pairs if k in names]


# --- paths -------------------------------------------------------------------------------------


def format_path(path: Path) -> str:
    """`("decoder", "layers", 0, "w")` -> `decoder.layers.0.w`; the root is `<model>`."""
    return ".".join(str(k) for k in path) if path else "<model>"


# --- maps over the distinct parameters -----------------------------------------------------------


def walked(visit, *args):
    """`visit(*args)` for a nested function that calls itself, which is then let go: through its
    closure it refers to itself, a reference cycle that would keep it and everything its caller
    made (parameters, gradients, Leafs) alive until the garbage collector runs."""
    try:
        return visit(*args)
    finally:
        names = visit.__code__.co_freevars
        visit.__closure__[names.index(visit.__name__)].cell_contents = None


def params(model, with_paths: bool = False) -> list:
    """The distinct trainable arrays of `model`, depth first, each once (at its first path)."""
    seen: set[int] = set()
    out: list = []

    def visit(node, path):
        if is_param(node):
            if id(node) not in seen:
                seen.add(id(node))
                out.append((path, node) if with_paths else node)
            return
        kind = kind_of(node)
        if kind is None or id(node) in seen:
            return
        seen.add(id(node))
        for k, child in trainable_children(node, kind):
            visit(child, path + (k,))

    walked(visit, model, ())
    return out


def map_params(fn, model):
    """Rebuild `model` with each distinct parameter `x` replaced by `fn(x)` (called once per array),
    keeping shared containers shared and everything else the same object."""
    done: dict[int, Any] = {}

    def visit(node):
        key = id(node)
        if key in done:
            return done[key]
        if is_param(node):
            new = fn(node)
        else:
            kind = kind_of(node)
            if kind is None:
                return node
            new = rebuilt(node, kind, trainable_children(node, kind), lambda _, child: visit(child))
        done[key] = new
        return new

    return walked(visit, model)


def rebuilt(node, kind: NodeKind, pairs, new_child):
    """`node` with each child of its `(key, child)` `pairs` replaced by `new_child(key, child)`:
    rebuilt when one of those is a new object, else `node` itself."""
    changes = {}
    for k, child in pairs:
        new = new_child(k, child)
        if new is not child:
            changes[k] = new
    return kind.rebuild(node, changes) if changes else node
