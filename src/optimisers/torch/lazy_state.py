"""Which parameters an optimizer steps and which have state, kept as torch.optim keeps them.

A parameter's number ("position") is its place in `param_groups`, counted as torch.optim counts.
Its state is made at its first gradient, by `optimisers.setup` (over one buffer where parameters
fill one), and kept by the tensor itself: a parameter removed from its group's `"params"` keeps
its state (torch's `state[p]`) and takes it up again when it is listed again. `StateView` is
`optimizer.state`.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

import torch

from optimisers.core.state import Leaf, State
from optimisers.verbs.setup import setup


def owned_leaf(rule, state) -> Leaf:
    """A Leaf holding `state`, arrays made or copied for it alone, which the update engine may
    therefore keep as its buffers instead of copying them."""
    leaf = Leaf(rule, state)
    if hasattr(leaf, "_owns"):
        leaf._owns = True
    return leaf


def trainable(p) -> bool:
    """Can a rule train tensor `p` (a floating or complex one)?"""
    return p.is_floating_point() or p.is_complex()


def _shown(tree, leaf_of_placeholder):
    """A module's tree of placeholders with the Leafs that have state in their places (a tie keeps
    one Leaf at both places); None where nothing has state."""
    if isinstance(tree, Leaf):
        return leaf_of_placeholder(tree)
    out = {}
    for k, child in tree.items():
        sub = _shown(child, leaf_of_placeholder)
        if sub is not None:
            out[k] = sub
    return out or None


class LazyState:
    """The part of `Optimizer` that keeps track of parameters and of which have state."""

    def _start_tracking(self) -> None:
        self._groups: list = []  # a ParamGroup per param group
        self._leaf_of: dict[int, tuple] = {}  # id(tensor) -> (tensor, its Leaf, its group): has state
        self._params: list = []  # position -> tensor
        self._position_of: dict[int, int] = {}  # id(tensor) -> position
        self._module_tree = None  # (a module) its tree of placeholders (see `groups_of_module`)
        self._extra_state: dict = {}  # `state[key]` for keys that are not parameters (hooks' notes)
        self._changed()

    def _leaf(self, p):
        found = self._leaf_of.get(id(p))
        return None if found is None else found[1]

    def _changed(self) -> None:
        """After the groups' parameters changed, or parameters gained or lost state: number the
        parameters, give each group's Leafs its rule, and make what `update_` steps anew (a new
        State: the engine plans it afresh)."""
        self._params = []
        for g in self._groups:
            g.first = len(self._params)
            g.leaves = [self._leaf(p) for p in g.params]
            for p, leaf in zip(g.params, g.leaves):
                if leaf is not None:  # (one rule object per group: the engine steps them together)
                    leaf.rule = g.rule
                    self._leaf_of[id(p)] = (p, leaf, g)
            self._params += g.params
        self._position_of = {id(p): i for i, p in enumerate(self._params)}
        # what update_ steps: the parameters with state, in position order, numbered 0, 1, ...
        self._stepped = [i for i, p in enumerate(self._params) if id(p) in self._leaf_of]
        self._live = [self._params[i] for i in self._stepped]
        leaves = [self._leaf(p) for p in self._live]
        self._flat = State(dict(enumerate(leaves)))
        # parameters that may get state at their first gradient
        self._waiting = [i for i, p in enumerate(self._params) if id(p) not in self._leaf_of and trainable(p)]
        self._frozen: list[int] = []  # places of `_live` stepped through a detached view
        self._complex = any(g.has_complex for g in self._groups)
        if self._module_tree is None:
            self.optimiser_state = State(dict(zip(self._stepped, leaves)))
        else:
            tree, keys, pairs = self._module_tree
            tensor_of = {id(h): p for h, p in pairs}
            self.optimiser_state = State(_shown(tree, lambda h: self._leaf(tensor_of[id(h)])) or {}, keys)

    def _make_states(self, params: list) -> None:
        """Make the state of `params` (at their first gradient) by `setup`: over one buffer where
        they fill one."""
        rule_at = {i: g.rule for g in self._groups for i in g.positions}
        views = {self._position_of[id(p)]: self._engine_view(p).detach() for p in params}
        try:
            with torch.no_grad():
                made = setup(lambda path, x: rule_at[path[0]], views).tree
        except (TypeError, ValueError) as e:  # a rule that refuses a parameter: named by its position
            if type(e) in (TypeError, ValueError) and str(e).startswith("the parameter at "):
                raise type(e)("parameter " + str(e).removeprefix("the parameter at ")) from None
            raise
        for i, leaf in made.items():
            self._adopt(self._params[i], leaf)
        self._changed()

    def _forget(self, params) -> None:
        """Drop the state of these parameters: it is made afresh at their next gradient."""
        for p in params:
            self._leaf_of.pop(id(p), None)
        self._changed()

    def _adopt(self, p, leaf) -> None:
        """`leaf` (with state, e.g. loaded from a checkpoint) becomes parameter `p`'s."""
        self._leaf_of[id(p)] = (p, leaf, None)

    def _group_of(self, p):
        """The group that parameter `p` is in (for a parameter removed from its group that has
        state: the group it was in)."""
        found = self._leaf_of.get(id(p))
        if found is not None and found[2] is not None and id(p) not in self._position_of:
            return found[2]
        return self._groups[self._group_index(self._position_of[id(p)])]

    def _group_index(self, position: int) -> int:
        return next(k for k, g in enumerate(self._groups) if position < g.first + len(g.params))

    def _with_state(self) -> list:
        """The parameters with state, listed ones in position order, then removed ones."""
        listed = [self._params[i] for i in self._stepped]
        return listed + [t for t, _, _ in self._leaf_of.values() if id(t) not in self._position_of]

    @property
    def state(self):
        """torch's per-parameter state: `state[p]` for parameter `p` (see `StateView`)."""
        return StateView(self)

    @state.setter
    def state(self, value):
        # torch.optim.Optimizer.__init__ assigns an empty dict; code that resets the state
        # assigns one too: both mean "no state", made afresh at the next gradient
        if isinstance(value, StateView) and value._optimizer is self:
            return
        if not isinstance(value, Mapping):
            raise TypeError(
                f"optimizer.state must be a mapping from parameter to state, got {type(value).__name__}"
            )
        entries = list(value.items())
        self._leaf_of.clear()
        self._extra_state = {}
        self._changed()
        for p, entry in entries:
            self.state[p] = entry


class StateView(MutableMapping):
    """`optimizer.state` as torch code reads it: `state[p]` is parameter `p`'s entry of
    `state_dict()["state"]`, built on each read (an empty dict for a parameter that has had no
    gradient yet, as torch's lazy state gives); `state[p] = entry` loads such an entry into
    `p`'s state, checked first, keeping the current hyperparameters (ZeroRedundancyOptimizer
    restores its shards this way); `del state[p]` and `state.clear()` drop state, which is made
    afresh at the next gradient, as in torch. A parameter removed from its group keeps its entry,
    as in torch. A key that is not a tensor (a hook's note, as torch's own tests write) holds any
    value, and goes into `state_dict()["state"]` as it is."""

    def __init__(self, optimizer):
        self._optimizer = optimizer

    def _known(self, p) -> bool:
        o = self._optimizer
        if id(p) not in o._position_of:
            o._follow_edits()  # a parameter listed since the last step
        return id(p) in o._position_of or id(p) in o._leaf_of

    def __getitem__(self, p):
        o = self._optimizer
        if not isinstance(p, torch.Tensor):
            return o._extra_state[p]
        leaf = o._leaf(p)
        if leaf is None and not self._known(p):
            raise KeyError(p)
        return {} if leaf is None else o._entry(p, leaf)

    def __setitem__(self, p, entry):
        o = self._optimizer
        if not isinstance(p, torch.Tensor):
            o._extra_state[p] = entry
        elif not self._known(p):
            raise KeyError(p)
        else:
            o._load_entry(p, entry)

    def __delitem__(self, p):
        o = self._optimizer
        if not isinstance(p, torch.Tensor):
            del o._extra_state[p]
        elif o._leaf(p) is None:
            raise KeyError(p)
        else:
            o._forget([p])

    def __contains__(self, p) -> bool:
        o = self._optimizer
        if not isinstance(p, torch.Tensor):
            return p in o._extra_state
        leaf = o._leaf(p)
        return leaf is not None and o._shows(leaf)

    def clear(self) -> None:
        self._optimizer._forget(self._optimizer._with_state())
        self._optimizer._extra_state.clear()

    def _shown(self) -> list:
        o = self._optimizer
        return [p for p in o._with_state() if o._shows(o._leaf(p))]

    def __iter__(self):
        return iter([*self._shown(), *self._optimizer._extra_state])

    def __len__(self):
        return len(self._shown()) + len(self._optimizer._extra_state)

    def __repr__(self):
        return f"<optimiser state of {len(self)} parameters>"
