"""`Optimizer.step` and `zero_grad`. A step reads the groups as torch.optim does, at every step:
changed entries go into the rules, an edited `"params"` list is followed, each parameter's
`.grad` is read (None: skipped), a parameter's first gradient makes its state, and the gradients
go to `optimisers.update_`. A step that fails changes nothing."""

from __future__ import annotations

import operator

import torch

from optimisers.torch.flat import has_flat_grads, zero_flat_grads_
from optimisers.torch.hyperparameters import check_switches
from optimisers.torch.param_groups import ParamGroup, check_distinct
from optimisers.verbs.update import update_

_GRAD = operator.attrgetter("grad")


class Stepping:
    """The part of `Optimizer` that steps. It uses the subclass hooks `_gradients`, `_listed`,
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
        """torch.optim's, except that the gradients of trainable parameters that are views of a
        flat buffer (made by `optimisers.torch.flatten_`) are zeroed in place and kept, whatever
        `set_to_none` says."""
        params = [p for g in self.param_groups for p in g["params"]]
        rest = zero_flat_grads_([p for p in params if p.requires_grad]) if has_flat_grads() else params
        if len(rest) == len(params):
            super().zero_grad(set_to_none)
            return
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

    def _step(self):
        undo = self._sync()
        born: list = []
        try:
            self._follow_edits()
            grads = list(map(_GRAD, self._params))
            born = [self._params[i] for i in self._waiting if grads[i] is not None]
            if born:
                self._make_states(born)
            grads = self._gradients(grads)
            if len(self._stepped) != len(grads):
                grads = [grads[i] for i in self._stepped]
            self._update(grads)
        except BaseException:  # a failed step changes nothing
            if born:
                self._forget(born)
            for g, record in undo:
                g.restore(record)
            raise

    def _update(self, grads: list) -> None:
        """`update_` of the parameters with state. A parameter frozen by the user after its state
        was made (torch.optim steps it while its `.grad` is not None) is stepped through a detached
        view: `update_` refuses a frozen parameter, and changes nothing when it does."""
        live = self._live
        if self._complex:
            live = [self._engine_view(p) for p in live]
        if self._frozen:
            self._frozen = [k for k in self._frozen if not self._live[k].requires_grad]
            live = _detached(live, self._frozen)
        try:
            update_(self._flat, live, grads)
        except Exception:
            frozen = [k for k, p in enumerate(self._live) if not p.requires_grad and k not in self._frozen]
            if not frozen:
                raise
            self._frozen += frozen
            update_(self._flat, _detached(live, frozen), grads)

    def _sync(self) -> list[tuple[ParamGroup, tuple]]:
        """Apply changed group entries to the rules; returns what to restore if the step fails."""
        if len(self.param_groups) != len(self._groups):
            raise RuntimeError(
                f"the optimizer has {len(self._groups)} param groups, param_groups "
                f"{len(self.param_groups)}: add a group with add_param_group"
            )
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

    def _follow_edits(self) -> None:
        """Follow each group's `"params"` list as it is now (torch.optim reads it at every step):
        a tensor added gets state at its first gradient, one removed is no longer stepped and
        keeps its state (`state[p]`), as in torch.optim."""
        edited = [(i, g) for i, g in enumerate(self._groups) if g.edited(f"param_groups[{i}]")]
        if not edited:
            return
        listed = {i: self._listed(g.entries["params"], f"param_groups[{i}]") for i, g in edited}
        check_distinct([listed.get(i, g.params) for i, g in enumerate(self._groups)])
        for i, g in edited:
            g.follow(listed[i])
        self._changed()

    def train(self):
        """For trainers that call it (rules here have no train/eval modes): does nothing."""

    def eval(self):
        """For trainers that call it (rules here have no train/eval modes): does nothing."""


def _detached(live: list, places: list) -> list:
    live = list(live)
    for k in places:
        live[k] = live[k].detach()
    return live


# Under torch.compile the step runs eagerly, as the library's update does (see optimisers.core.eager):
# its Python bookkeeping (group entries, state made at a first gradient) traced by dynamo would
# become guards that fail from one step to the next.
@torch.compiler.disable(recursive=True)
def _eager_step(optimizer) -> None:
    optimizer._step()
