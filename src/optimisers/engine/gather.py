"""Gather, the first phase of an update: walk model, state and gradients together, check every
gradient against its parameter, and collect each Leaf's gradient contributions (a tied Leaf gets
one per place). Nothing is written here.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

from optimisers import ops
from optimisers.core.state import (
    Leaf,
    flatten_state,
    is_scalar,
    path_of,
)
from optimisers.core.tree import format_path, is_param, kind_of, params, walked, why_not_param
from optimisers.engine import ties

_SEQUENCES = ("list", "tuple", "namedtuple")


def _grad_children(node, kind, children: dict, grad, path) -> dict:
    """The gradient of each child of `node`, as a dict (missing key = no gradient)."""
    if grad is None:
        return {}
    if kind.grad_children is not None:
        found = kind.grad_children(node, grad, path)
        if found is not None:
            return found
    if isinstance(grad, Mapping):
        unknown = [k for k in grad if k not in children]
        if unknown:
            have = ", ".join(repr(k) for k in children)
            raise ValueError(
                f"gradient at {format_path(path)} has key {unknown[0]!r}, which the model does not "
                f"have there (model keys: {have})"
            )
        return dict(grad)
    if kind.name in _SEQUENCES and isinstance(grad, Sequence) and not isinstance(grad, str):
        if len(grad) != len(children):
            raise ValueError(
                f"gradient at {format_path(path)} is a sequence of length {len(grad)}, but the "
                f"model has {len(children)} entries there"
            )
        return dict(zip(children, grad))
    if type(grad) is type(node):
        return dict(kind.children(grad))
    raise TypeError(
        f"gradient at {format_path(path)} is a {type(grad).__name__}, but the model has a "
        f"{type(node).__name__} there; expected a gradient of the same structure (or a mapping of "
        "its keys, or None)"
    )


def _check_grad(grad, x, path):
    shape = getattr(grad, "shape", None)
    if shape is x.shape or shape == x.shape:  # the common case, decided without building anything
        return
    if shape is None or kind_of(grad) is not None:
        raise TypeError(
            f"gradient at {format_path(path)} is a {type(grad).__name__}; expected an array of "
            f"shape {tuple(x.shape)} (or None)"
        )
    if tuple(shape) != tuple(x.shape):
        raise ValueError(
            f"gradient at {format_path(path)} has shape {tuple(shape)}, but the parameter has "
            f"shape {tuple(x.shape)}"
        )


_MISSING = object()
_ANY_SHAPE = "any"  # a Leaf whose state does not say which parameter shape it fits


def _state_shape(leaf):
    """The parameter shape a Leaf's state was made for, read from its arrays (for a Leaf that
    `setup` did not make: loaded, or rebuilt by JAX): the one shape they all have, else
    `_ANY_SHAPE` (no arrays, as for a stateless rule, or arrays of several shapes)."""
    parts: list = []
    flatten_state(leaf.state, parts)
    shapes = {tuple(p.shape) for p in parts if not is_scalar(p) and hasattr(p, "shape")}
    return shapes.pop() if len(shapes) == 1 else _ANY_SHAPE


def _check_shape(leaf, x, path):
    """A parameter must have the shape its state was made for: an update would otherwise run the
    rule on arrays that do not fit (a fused kernel would write past the end of the state)."""
    want = leaf._shape
    if want is None:
        want = leaf._shape = _state_shape(leaf)
    if want is _ANY_SHAPE or tuple(x.shape) == want:
        return
    raise ValueError(
        f"the parameter at {format_path(path)} has shape {tuple(x.shape)}, but its optimiser state "
        f"was set up for shape {want}: the model changed after setup (a resized layer?). Run "
        "setup again for the changed model; nothing was changed"
    )


class Contribution:
    """What one update gathered for a Leaf: the parameter at its first place, each place's
    gradient, and whether other places hold a different array object (equal copies)."""

    __slots__ = ("leaf", "x", "grads", "copies", "where")

    def __init__(self, leaf, x):
        self.leaf = leaf
        self.x = x
        self.grads: list = []
        self.copies = False
        self.where: list = []  # for a tie: the path of each gradient (None: the first place; empty: all)

    def dx(self):
        """The summed gradient, in the parameter's dtype (gradient arrays are never written)."""
        dx = ties.summed(self.grads) if len(self.grads) > 1 else self.grads[0]
        # every backend's astype hands back a gradient that already fits (kind, dtype, device, no
        # autograd graph) as it is
        return self.fitted(dx)

    def fitted(self, g):
        """`g` as a gradient of the parameter (the same object when it already is one)."""
        try:
            return ops.astype(g, self.x)
        except ops.GradientError as e:
            e.leaf = self.leaf  # the update says where
            raise


def _take(tree, found, owner, tied, leaf, x, grad, path):
    """Collect the parameter `x` and its gradient at `path`, a place of `leaf`, into what `gather`
    has found so far (`found`, `owner`, `tied`)."""
    if not is_param(x):
        why = why_not_param(x)
        if why is not None:
            raise KeyError(
                f"the state has a parameter at {format_path(path)}, which the model does not train: {why}"
            )
        raise TypeError(
            f"the state has a parameter at {format_path(path)}, but the model has a "
            f"{type(x).__name__} there; was the state set up for another model?"
        )
    entry = found.get(id(leaf))
    later = entry is not None  # a place after the Leaf's first
    if entry is None:
        if x.shape != leaf._shape:
            _check_shape(leaf, x, path)
        other = owner(id(x), leaf)
        if other is not leaf:
            raise ValueError(
                f"the model has one array at {format_path(path_of(tree, other))} and "
                f"{format_path(path)}, but the optimiser state has a Leaf for each: the model was "
                "tied after setup, and an update would step that array twice. Tie them in the state "
                "too (state[...] = state[...] at the second place) or run setup again for the "
                "changed model; nothing was changed"
            )
        entry = found[id(leaf)] = Contribution(leaf, x)
    elif x is not entry.x:
        _check_copy(tree, entry, x, path)
        entry.copies = True
    if grad is not None:
        _check_grad(grad, x, path)
        if later:
            if not entry.where:
                entry.where = [None] * len(entry.grads)  # those came from the first place
                tied.append(entry)
            entry.where.append(path)
        entry.grads.append(grad)


def gather(tree, model, grads, known=None) -> dict[int, Contribution]:
    """Each Leaf's contribution, keyed by `id(leaf)`; `known`: a State's `_keys`."""
    found: dict[int, Contribution] = {}
    owner = {}.setdefault  # id(parameter) -> its Leaf: one array, two Leafs is refused
    tied: list[Contribution] = []  # Leafs with gradients from places after their first
    take = functools.partial(_take, tree, found, owner, tied)
    if isinstance(tree, Leaf):  # a model that is one array: one place
        take(tree, model, grads, ())
        return found

    def visit(snode, node, grad, path):
        if not snode:  # nothing trainable here
            return
        kind = kind_of(node)
        if kind is None:
            raise TypeError(
                f"the state expects a container at {format_path(path)}, but the model has a "
                f"{type(node).__name__} there; was the state set up for another model?"
            )
        children = dict(kind.children(node))
        grad_of = _grad_children(node, kind, children, grad, path).get
        seen = found.get
        for k, sub in snode.items():
            x = children.get(k, _MISSING)
            if x is _MISSING:
                raise _missing_child(kind, node, k, path)
            if type(sub) is not Leaf:
                visit(sub, x, grad_of(k), path + (k,))
                continue
            # `take`, inlined for the common case (a parameter's first place, a gradient of its
            # shape): this loop is the per-parameter cost of every update, so the path is built
            # only when something needs checking or reporting
            g = grad_of(k)
            if seen(id(sub)) is None and is_param(x) and owner(id(x), sub) is sub:
                if x.shape != sub._shape:
                    _check_shape(sub, x, path + (k,))
                entry = found[id(sub)] = Contribution(sub, x)
                if g is not None:
                    if getattr(g, "shape", None) != x.shape:
                        _check_grad(g, x, path + (k,))
                    entry.grads.append(g)
            else:
                take(sub, x, g, path + (k,))
        if len(children) != len(snode):
            _check_no_new_params(node, children, snode, path, known.get(path) if known else None)

    walked(visit, tree, model, grads, ())
    for entry in tied:
        _check_each_place(tree, entry)
    return found


def _missing_child(kind, node, key, path) -> KeyError:
    why = kind.why_not_child(node, key) if kind.why_not_child is not None else None
    if why is not None:
        return KeyError(
            f"the state has a parameter at {format_path(path + (key,))}, which the model "
            f"does not train: {why}"
        )
    return KeyError(
        f"the state has key {key!r} at {format_path(path)}, which the model lacks; "
        "was the state set up for another model?"
    )


def _check_each_place(tree, entry) -> None:
    """Check each place's gradient of a tied Leaf as an untied one is checked, before they are
    summed (a bool or str array would otherwise be summed into a number, or fail inside the sum),
    naming that place. A gradient of another array type (a torch tensor for a NumPy parameter)
    is converted as it would be alone, so that the sum is of the parameter's own kind; the rest
    are summed as given, then converted once, as before."""
    backend = ops.backend(entry.x)
    for i, (g, path) in enumerate(zip(entry.grads, entry.where)):
        try:
            fitted = entry.fitted(g)
        except ops.GradientError as e:
            where = format_path(path_of(tree, entry.leaf) if path is None else path)
            raise ops.GradientError(f"gradient at {where}: {e}; nothing was changed") from None
        if fitted is not g and ops.backend(g) is not backend:
            entry.grads[i] = fitted


def _check_copy(tree, entry, x, path):
    """Another array at a tied place must be an equal copy (what JAX's donation needs): other
    values there mean the model changed after setup, and the update would overwrite them."""
    first = entry.x
    if x.shape != first.shape:
        raise ValueError(
            f"the parameter at {format_path(path)} has shape {tuple(x.shape)}, but it is "
            f"tied to a parameter of shape {tuple(first.shape)} in the optimiser state; "
            "the model changed after setup. Run setup again; nothing was changed"
        )
    if not entry.leaf._placed and ops.same_values(x, first) is False:  # None: traced (jit)
        raise ValueError(
            f"the parameters at {format_path(path_of(tree, entry.leaf))} and {format_path(path)} "
            "share one Leaf of the optimiser state (they are tied), but the model holds different "
            "values at them: it changed after setup, and an update would overwrite one with the "
            "other. Run setup again for the changed model (or give both places one array); "
            "nothing was changed"
        )


def _check_no_new_params(node, children, snode, path, at_setup):
    """A parameter the state has no Leaf for was added after setup: its gradient would be dropped
    without a word, so an update refuses it. Where the State knows the keys the model had there
    at setup (`at_setup`), only new keys are searched: walking a frozen backbone on every step
    would cost more than the step. (So a part that was all frozen at setup and trained later, by
    `requires_grad_(True)`, needs setup again, as the docs say.)"""
    names = getattr(type(node), "__trainable__", None)
    for k, child in children.items():
        if k in snode or (names is not None and k not in names) or (at_setup and k in at_setup):
            continue
        for sub_path, _ in params(child, with_paths=True)[:1]:
            where = format_path(path + (k,) + sub_path)
            raise KeyError(
                f"the model has a parameter at {where}, which the optimiser state does not know: "
                "it was added after setup (or the state was set up for another model), and its "
                "gradient would be ignored. Run setup again for the changed model (or give it state: "
                "state[key] = optimisers.setup(rule, new_array)); nothing was changed"
            )
