"""`grads(model)`: the gradient tree that PyTorch's `backward()` left in the `.grad` fields.

Kept apart from the torch backend so that `import optimisers` does not import torch: this walks the
model through the generic tree layer and only reads attributes.
"""

from __future__ import annotations

from optimisers.core.eager import eager_under_compile
from optimisers.core.tree import format_path, is_param, kind_of, trainable_children, walked


@eager_under_compile
def grads(model):
    """The gradient tree of `model` (an `nn.Module`, or any tree of tensors) after `backward()`.

    It mirrors the model: a dict for a module (keyed by parameter and submodule names), a list for
    a list, a tuple for a tuple, a dict of field names for any other container. Each trainable
    tensor contributes its `.grad` once, at its first place in depth-first order (the order of
    `named_parameters()`); every other place of a tied tensor gets `None`, because autograd has
    already summed the contributions of all places into the one `.grad`. A tensor whose `.grad` is
    `None` (unused in the loss) gives `None`, which `update` treats as "no gradient".

        loss.backward()
        state, model = optimisers.update_(state, model, optimisers.grads(model))
    """
    seen: set[int] = set()

    def visit(node, path):
        kind = kind_of(node)
        if kind is not None:
            pairs = [(k, visit(child, path + (k,))) for k, child in trainable_children(node, kind)]
            if type(node) is list:
                return [g for _, g in pairs]
            return tuple(g for _, g in pairs) if type(node) is tuple else dict(pairs)
        if not is_param(node) or id(node) in seen:
            return None
        seen.add(id(node))
        is_leaf = getattr(node, "is_leaf", None)
        if is_leaf is None:
            raise TypeError(
                f"grads reads PyTorch .grad fields, but the parameter at {format_path(path)} "
                f"is a {type(node).__module__}.{type(node).__name__}, which has none; build "
                "the gradient tree yourself for it"
            )
        # .grad of a non-leaf is only kept after retain_grad(); even asking for it warns
        return node.grad if is_leaf or node.retains_grad else None

    return walked(visit, model, ())
