"""`Optimizer.step` and `zero_grad`: a step syncs changed group entries into the rules, makes the
state of parameters at their first gradient and hands the gradients to `optimisers.update_`; a
step that fails changes nothing."""

from __future__ import annotations

import operator
from itertools import repeat

import torch
from torch import nn

from optimisers.torch.flat import has_flat_grads, zero_flat_grads_
from optimisers.torch.hyperparameters import check_switches
from optimisers.torch.param_groups import ParamGroup
from optimisers.verbs.update import update_


class Stepping:
    """The part of `Optimizer` that steps. It uses the subclass hooks `_gradients`,
    `_refused_keys`, `_unknown_key` and `_resync` (see `Optimizer`)."""

    def step(self, closure=None):
        """One optimisation step on every parameter that has a `.grad` (a parameter's first
        gradient makes its state). `closure`, if given, re-evaluates the model and returns the
        loss (run with gradients enabled); its result is returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        _eager_step(self)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch.optim's, except that gradients that are views of a flat buffer (made by
        `optimisers.torch.flatten_`) are zeroed in place and kept, whatever `set_to_none` says."""
        params = [p for g in self.param_groups for p in g["params"]]
        rest = zero_flat_grads_(params) if has_flat_grads() else params
        if len(rest) == len(params):
            super().zero_grad(set_to_none)
            return
        for p in rest:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    def _step(self):
        undo = self._sync()
        born: list[int] = []
        try:
            grads, held = _gradients_now(self)
            if grads:
                grads = self._gradients(grads)
                born = [] if held else self._initialise(grads)
                update_(self._flat, self._stepped_model(held), grads)
        except BaseException:  # a failed step changes nothing
            if born:
                self._forget(born)
            for g, record in undo:
                g.restore(record)
            raise

    def _sync(self) -> list[tuple[ParamGroup, tuple]]:
        """Apply changed group entries to the rules; returns what to restore if the step fails."""
        plans = []
        for i, (entries, g) in enumerate(zip(self.param_groups, self._groups)):
            where = f"param_groups[{i}]"
            g.entries = entries  # the list entry may have been replaced by a new dict
            changed = g.changed_entries(where)
            unknown = self._refused_keys(g)
            if unknown:
                raise self._unknown_key(g, unknown[0], i)
            check_switches(entries, where)
            if changed:
                plans.append((g, changed, self._resync(g, changed, where)))
        # every group checked: only now change any
        return [(g, g.apply(changed, rule)) for g, changed, rule in plans]

    def _stepped_model(self, held: bool) -> dict:
        """The tensors `update_` steps (`held`: each of them requires grad). A parameter frozen by
        the user after its state was made is stepped through a detached view (its `.grad` may be
        left from before)."""
        model = self._live
        if held or all(map(_REQUIRES_GRAD, model.values())):  # (the usual case)
            return model
        frozen = [i for i, p in model.items() if not p.requires_grad and isinstance(p, nn.Parameter)]
        if frozen:
            model = {**model, **{i: model[i].detach() for i in frozen}}
        return model

    def train(self):
        """For trainers that call it (rules here have no train/eval modes): does nothing."""

    def eval(self):
        """For trainers that call it (rules here have no train/eval modes): does nothing."""


def _gradients_now(optimizer) -> tuple[dict, bool]:
    """`({position: p.grad}, held)`: each parameter's `.grad` as it is now (`held`: False)."""
    return _gradients_at(optimizer._trained_at, optimizer._trained), False


def _gradients_at(positions, params) -> dict:
    """`{position: p.grad}` of the parameters that have one (read in one pass of C)."""
    grads = list(map(_GRAD, params))
    if any(map(operator.is_, grads, repeat(None))):
        return {i: g for i, g in zip(positions, grads) if g is not None}
    return dict(zip(positions, grads))


_GRAD, _REQUIRES_GRAD = operator.attrgetter("grad"), operator.attrgetter("requires_grad")


# Under torch.compile the step runs eagerly, as the library's update does (see optimisers.core.eager):
# its Python bookkeeping (group entries, state made at a first gradient) traced by dynamo would
# become guards that fail from one step to the next.
@torch.compiler.disable(recursive=True)
def _eager_step(optimizer) -> None:
    optimizer._step()
