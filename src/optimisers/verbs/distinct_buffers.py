"""distinct_buffers: one buffer per place, for `jax.jit(..., donate_argnums=...)`."""

from __future__ import annotations

from optimisers import ops
from optimisers.core.tree import _is_array, kind_of, rebuilt, walked


def distinct_buffers(model):
    """The model with every repeated array replaced by a copy at each place after its first.

    JAX refuses to donate one buffer twice, so a model whose tied places hold one array cannot be
    passed to a function jitted with `donate_argnums`. Call `setup` on the tied model first (the
    `State` then records what is tied), and donate the model that `distinct_buffers` returns: the
    update still treats the tied places as one parameter (the gradients of all places are summed,
    the rule runs once, every place gets the new value), and the jitted step returns one buffer per
    place, so the loop can donate again on every step (docs/tied-weights.md shows such a loop).

    A container that appears at several places is copied as well (its arrays are repeats). Arrays
    seen for the first time, and everything that is not an array, stay the same objects; the result
    is `model` itself when nothing repeats.
    """
    seen: set[int] = set()

    def visit(node):
        if _is_array(node):
            if id(node) in seen:
                return ops.copy(node)
            seen.add(id(node))
            return node
        kind = kind_of(node)
        if kind is None:
            return node
        return rebuilt(node, kind, kind.children(node), lambda _, child: visit(child))

    return walked(visit, model)
