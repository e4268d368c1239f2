"""Per-parameter state made at the first gradient, as torch.optim does, and torch's view of it.

`LazyState` keeps the positions (a parameter's number in `param_groups`, as torch.optim counts)
and which of them have state: only those are stepped by `update_`, appear in `state_dict()` and
take memory. `StateView` is `optimizer.state`: torch's `state[p]`.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, MutableMapping

import torch

from optimisers.core.state import Leaf, State
from optimisers.engine import plan
from optimisers.engine.initial_state import initial_states

# optimizer -> (a bulk check, the gradients it found): what a step found, kept while no parameter
# gains or loses state (`_changed` lets go of it), so that a later step finding the same gradients
# knows that each of their parameters has state (`optimisers.torch.stepping`)
HELD_GRADIENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def set_state(leaf: Leaf, state, *, owned: bool) -> None:
    """Give `leaf` its rule's `state`. `owned`: the arrays are the Leaf's alone (made or copied
    for it), so the update engine may keep them as its buffers instead of copying them."""
    leaf.state = state
    leaf._owns = owned


def prune(node, ready: set):
    """The part of a state tree whose Leafs have state (tied places keep their shared Leaf)."""
    if isinstance(node, Leaf):
        return node if id(node) in ready else None
    out = {}
    for k, child in node.items():
        sub = prune(child, ready)
        if sub is not None:
            out[k] = sub
    return out or None


class LazyState:
    """The part of `Optimizer` that keeps track of parameters and of which have state."""

    def _start_tracking(self) -> None:
        self._flat = State({})  # position -> Leaf, for parameters with state: what update_ steps
        self._live: dict = {}  # position -> tensor, for the same parameters: the model update_ sees
        self._leaf_of: dict[int, tuple] = {}  # id(tensor) -> (tensor, Leaf, position)
        self._leaf_at: dict[int, Leaf] = {}  # position -> Leaf (with state or not yet)
        self._model: dict = {}  # position -> tensor, every parameter
        # the positions and tensors of every parameter a rule can train, in position order
        self._trained_at: list[int] = []
        self._trained: list = []
        self._module_tree = None  # a module's whole state tree (Leafs without state included)
        self._extra_state: dict = {}  # `state[key]` for keys that are not parameters (hooks' notes)
        self.optimiser_state: State = self._flat

    def _track(self, group) -> None:
        """Number the parameters of a new param group after those already there."""
        group.first = len(self._model)
        for position, p, leaf in zip(group.positions, group.params, group.leaves):
            self._model[position] = p
            if leaf is not None:
                self._leaf_at[position] = leaf
                self._leaf_of[id(p)] = (p, leaf, position)
                self._trained_at.append(position)
                self._trained.append(p)

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
        self._forget(list(self._flat.tree))
        self._extra_state = {}
        for p, entry in entries:
            self.state[p] = entry

    def _ready(self, positions) -> None:
        """Positions whose Leafs just got state join what update_ steps, in position order."""
        for position in positions:
            self._flat.tree[position] = self._leaf_at[position]
            self._live[position] = self._engine_view(self._model[position])
        self._flat.tree = dict(sorted(self._flat.tree.items()))
        self._live = dict(sorted(self._live.items()))
        self._changed()

    def _initialise(self, grads: dict) -> list[int]:
        """Make the state of parameters that have their first gradient; returns their positions."""
        have = self._flat.tree
        if grads.keys() <= have.keys():
            return []
        born = [i for i in grads if i not in have]
        with torch.no_grad():  # all made before any is kept (over one buffer where they fill one)
            items = [(self._leaf_at[i].rule, self._engine_view(self._model[i]), i) for i in born]
            made = dict(zip(born, initial_states(items, lambda rule, x, i: self._first_state(i))))
        for i, state in made.items():
            set_state(self._leaf_at[i], state, owned=True)  # fresh arrays: the engine keeps them
        self._ready(born)
        return born

    def _first_state(self, position: int):
        """The rule's initial state for the parameter at `position`; a parameter the rule
        refuses (a vector for Muon) is reported with its position."""
        try:
            return self._leaf_at[position].rule.init(self._engine_view(self._model[position]))
        except (TypeError, ValueError) as e:
            if type(e) not in (TypeError, ValueError):
                raise  # a subclass may not take a message alone
            raise type(e)(f"parameter {position}: {e}") from None

    def _forget(self, positions) -> None:
        """Drop the state of these parameters: it is made afresh at their next gradient."""
        for position in positions:
            self._flat.tree.pop(position, None)
            self._live.pop(position, None)
            self._leaf_at[position].state = None
        self._changed()

    def _changed(self) -> None:
        """After parameters gained or lost state: the engine plans again, and a module's
        `optimiser_state` shows the Leafs that have state now."""
        plan.forget(self._flat)
        HELD_GRADIENTS.pop(self, None)
        if self._module_tree is not None:
            ready = {id(leaf) for leaf in self._flat.tree.values()}
            self.optimiser_state.tree = prune(self._module_tree, ready) or {}
            plan.forget(self.optimiser_state)


class StateView(MutableMapping):
    """`optimizer.state` as torch code reads it: `state[p]` is parameter `p`'s entry of
    `state_dict()["state"]`, built on each read (an empty dict for a parameter that has had no
    gradient yet, as torch's lazy state gives); `state[p] = entry` loads such an entry into
    `p`'s Leaf, checked first, keeping the current hyperparameters (ZeroRedundancyOptimizer
    restores its shards this way); `del state[p]` and `state.clear()` drop state, which is made
    afresh at the next gradient, as in torch. A key that is not a tensor (a hook's note, as
    torch's own tests write) holds any value, and goes into `state_dict()["state"]` as it is."""

    def __init__(self, optimizer):
        self._optimizer = optimizer

    def _position(self, p) -> int:
        found = self._optimizer._leaf_of.get(id(p))
        if found is None or found[0] is not p:
            raise KeyError(p)
        return found[2]

    def __getitem__(self, p):
        if not isinstance(p, torch.Tensor):
            return self._optimizer._extra_state[p]
        position = self._position(p)
        leaf = self._optimizer._flat.tree.get(position)
        return {} if leaf is None else self._optimizer._entry(position, leaf)

    def __setitem__(self, p, entry):
        if not isinstance(p, torch.Tensor):
            self._optimizer._extra_state[p] = entry
            return
        self._optimizer._load_entry(self._position(p), entry)

    def __delitem__(self, p):
        if not isinstance(p, torch.Tensor):
            del self._optimizer._extra_state[p]
            return
        position = self._position(p)
        if position not in self._optimizer._flat.tree:
            raise KeyError(p)
        self._optimizer._forget([position])

    def __contains__(self, p) -> bool:
        if not isinstance(p, torch.Tensor):
            return p in self._optimizer._extra_state
        try:
            return self._position(p) in self._optimizer._flat.tree
        except KeyError:
            return False

    def clear(self) -> None:
        self._optimizer._forget(list(self._optimizer._flat.tree))
        self._optimizer._extra_state.clear()

    def _shown(self) -> list:
        model, tree = self._optimizer._model, self._optimizer._flat.tree
        return [model[i] for i, leaf in list(tree.items()) if self._optimizer._shows(leaf)]

    def __iter__(self):
        return iter([*self._shown(), *self._optimizer._extra_state])

    def __len__(self):
        return len(self._shown()) + len(self._optimizer._extra_state)

    def __repr__(self):
        return f"<optimiser state of {len(self)} parameters>"
