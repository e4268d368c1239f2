"""`Optimizer.step` and `zero_grad`. A step reads the groups as torch.optim does, at every step
(changed entries, an edited `"params"` list, each `.grad`), makes a parameter's state at its first
gradient and hands the gradients to `optimisers.update_`; a step that fails changes nothing."""

from __future__ import annotations

import operator

import torch

from optimisers.torch.flat import has_flat_grads, zero_flat_grads_
from optimisers.torch.param_groups import check_switches
from optimisers.verbs.update import update_

_GRAD = operator.attrgetter("grad")


def zeroed_flat_grads(optimizer, set_to_none: bool) -> bool:
    """`zero_grad` where some gradients are views of a flat buffer: those are zeroed in place and
    kept, the rest set as torch sets them. False, having done nothing, where none is."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    rest = zero_flat_grads_([p for p in params if p.requires_grad]) if has_flat_grads() else params
    if len(rest) == len(params):
        return False
    rest += [p for p in params if not p.requires_grad]  # a frozen one's view: as torch does
    for p in rest:
        if set_to_none:
            p.grad = None
        elif p.grad is not None:
            if p.grad.grad_fn is not None:
                p.grad.detach_()
            else:
                p.grad.requires_grad_(False)
            p.grad.zero_()
    return True


# Under torch.compile the step runs eagerly, as the library's update does (see optimisers.core.eager):
# its Python bookkeeping (group entries, state made at a first gradient) traced by dynamo would
# become guards that fail from one step to the next.
@torch.compiler.disable(recursive=True)
def eager_step(optimizer) -> None:
    book, policy = optimizer._book, optimizer._policy
    if not policy.ready():
        return
    undo = _sync(optimizer)
    born: list = []
    try:
        book.follow_edits(policy)
        grads = list(map(_GRAD, book.params))
        born = [book.params[i] for i in book.waiting if grads[i] is not None]
        if born:
            book.make_states(born, policy)
        grads = policy.gradients(book.groups, grads)
        if len(book.stepped) != len(grads):
            grads = [grads[i] for i in book.stepped]
        _update(book, policy, grads)
    except BaseException:  # a failed step changes nothing
        if born:
            book.forget(born)
        for g, record in undo:
            g.restore(record)
        raise


def _update(book, policy, grads: list) -> None:
    """`update_` of the parameters with state. A parameter frozen by the user after its state
    was made (torch.optim steps it while its `.grad` is not None) is stepped through a detached
    view: `update_` refuses a frozen parameter, and changes nothing when it does."""
    live = book.live
    if book.complex:
        live = [policy.engine_view(p) for p in live]
    if book.frozen:
        book.frozen = [k for k in book.frozen if not book.live[k].requires_grad]
        live = _detached(live, book.frozen)
    try:
        update_(book.flat, live, grads)
    except Exception:
        frozen = [k for k, p in enumerate(book.live) if not p.requires_grad and k not in book.frozen]
        if not frozen:
            raise
        book.frozen += frozen
        update_(book.flat, _detached(live, frozen), grads)


def _sync(optimizer) -> list[tuple]:
    """Apply changed group entries to the rules; returns what to restore if the step fails."""
    book, policy, param_groups = optimizer._book, optimizer._policy, optimizer.param_groups
    if len(param_groups) != len(book.groups):
        raise RuntimeError(
            f"the optimizer has {len(book.groups)} param groups, param_groups "
            f"{len(param_groups)}: add a group with add_param_group"
        )
    plans = []
    for i, (entries, g) in enumerate(zip(param_groups, book.groups)):
        where = f"param_groups[{i}]"
        g.entries = entries  # the list entry may have been replaced by a new dict
        changed = g.changed_entries(where)
        policy.check_keys(g, i)
        check_switches(entries, where)
        if changed:
            plans.append((g, changed, policy.resync(g, changed, where)))
    # every group checked: only now change any
    return [(g, g.apply(changed, rule)) for g, changed, rule in plans]


def _detached(live: list, places: list) -> list:
    live = list(live)
    for k in places:
        live[k] = live[k].detach()
    return live
