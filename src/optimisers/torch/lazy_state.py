"""Which parameters an optimizer steps and which have state (`Book`), and torch's `state[p]`
(`StateView`). A parameter's "position" is its place in `param_groups`, as torch.optim counts; its
state, made at its first gradient, is kept by the tensor: one removed from its group keeps it."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

import torch

from optimisers.core.state import Leaf, State
from optimisers.torch.param_groups import check_distinct, initial_groups
from optimisers.verbs.setup import setup


def owned_leaf(rule, state) -> Leaf:
    """A Leaf holding `state`, arrays made for it alone (the update engine may keep them)."""
    leaf = Leaf(rule, state)
    leaf._owns = True
    return leaf


def trainable(p) -> bool:
    """Can a rule train tensor `p` (a floating or complex one)?"""
    return p.is_floating_point() or p.is_complex()


def _shown(tree, leaf_of_placeholder):
    """A module's tree of placeholders with the Leafs that have state in their places (or None)."""
    if isinstance(tree, Leaf):
        return leaf_of_placeholder(tree)
    out = {k: sub for k, child in tree.items() if (sub := _shown(child, leaf_of_placeholder)) is not None}
    return out or None


class Book:
    """An optimizer's groups (`ParamGroup`s), its parameters by position and their states:
    `leaf_of` maps `id(tensor)` to `(tensor, its Leaf, its group)` for each tensor with state;
    `flat` is what `update_` steps. It holds no reference to its optimizer."""

    def __init__(self):
        self.groups: list = []
        self.leaf_of: dict[int, tuple] = {}
        self.module_tree = None  # (a module) its tree of placeholders (see `RulePolicy.module_groups`)
        self.extra_state: dict = {}  # `state[key]` for keys that are not parameters (hooks' notes)
        self.pending: dict = {}  # id(group dict) -> the group built for it, which torch's __init__ adds
        self.changed()

    def leaf(self, p):
        return self.leaf_of.get(id(p), (None, None, None))[1]

    def changed(self) -> None:
        """After the groups' parameters changed, or parameters gained or lost state: number the
        parameters, give each group's Leafs its rule, make what `update_` steps anew."""
        self.params = []
        for g in self.groups:
            g.first = len(self.params)
            g.leaves = [self.leaf(p) for p in g.params]
            for p, leaf in zip(g.params, g.leaves):
                if leaf is not None:  # (one rule object per group: the engine steps them together)
                    leaf.rule = g.rule
                    self.leaf_of[id(p)] = (p, leaf, g)
            self.params += g.params
        self.position_of = {id(p): i for i, p in enumerate(self.params)}
        self.stepped = [i for i, p in enumerate(self.params) if id(p) in self.leaf_of]
        self.live = [self.params[i] for i in self.stepped]
        leaves = [self.leaf(p) for p in self.live]
        self.flat = State(dict(enumerate(leaves)))
        # parameters that may get state at their first gradient
        self.waiting = [i for i, p in enumerate(self.params) if id(p) not in self.leaf_of and trainable(p)]
        self.frozen: list[int] = []  # places of `live` stepped through a detached view
        self.complex = any(g.has_complex for g in self.groups)
        if self.module_tree is None:
            self.optimiser_state = State(dict(zip(self.stepped, leaves)))
        else:
            tree, keys, pairs = self.module_tree
            tensor_of = {id(h): p for h, p in pairs}
            self.optimiser_state = State(_shown(tree, lambda h: self.leaf(tensor_of[id(h)])) or {}, keys)

    def make_states(self, params: list, policy) -> None:
        """Make the state of `params` (at their first gradient) by `setup`."""
        rule_at = {i: g.rule for g in self.groups for i in g.positions}
        views = {self.position_of[id(p)]: policy.engine_view(p).detach() for p in params}
        try:
            with torch.no_grad():
                made = setup(lambda path, x: rule_at[path[0]], views).tree
        except (TypeError, ValueError) as e:  # a rule that refuses a parameter: named by its position
            if type(e) in (TypeError, ValueError) and str(e).startswith("the parameter at "):
                raise type(e)("parameter " + str(e).removeprefix("the parameter at ")) from None
            raise
        for i, leaf in made.items():
            self.adopt(self.params[i], leaf)
        self.changed()

    def forget(self, params) -> None:
        for p in params:
            self.leaf_of.pop(id(p), None)
        self.changed()

    def adopt(self, p, leaf) -> None:
        self.leaf_of[id(p)] = (p, leaf, None)

    def group_of(self, p):
        """The group that parameter `p` is in (for a removed one with state: the one it was in)."""
        found = self.leaf_of.get(id(p))
        if found is not None and found[2] is not None and id(p) not in self.position_of:
            return found[2]
        return self.groups[self.group_index(self.position_of[id(p)])]

    def group_index(self, position: int) -> int:
        return next(k for k, g in enumerate(self.groups) if position < g.first + len(g.params))

    def with_state(self) -> list:
        """The parameters with state, listed ones in position order, then removed ones."""
        return self.live + [t for t, _, _ in self.leaf_of.values() if id(t) not in self.position_of]

    def follow_edits(self, policy) -> None:
        """Follow each group's `"params"` list as it is now, as torch.optim reads it at every step."""
        edited = [(i, g) for i, g in enumerate(self.groups) if g.edited(f"param_groups[{i}]")]
        if not edited:
            return
        listed = {i: policy.listed(g.entries["params"], f"param_groups[{i}]") for i, g in edited}
        check_distinct([listed.get(i, g.params) for i, g in enumerate(self.groups)])
        for i, g in edited:
            g.follow(listed[i])
        self.changed()

    def start(self, params, policy) -> list:
        """The groups of the optimizer's `params`, kept for torch's __init__ to add."""
        groups, self.module_tree = initial_groups(params, policy)
        check_distinct([g.params for g in groups], ["param_names" in g.entries for g in groups])
        self.pending = {id(g.entries): g for g in groups}
        return groups

    def add_group(self, param_group, param_groups: list, policy) -> None:
        g = self.pending.get(id(param_group))
        if g is None:
            self.follow_edits(policy)
            g = policy.make(param_group, f"group {len(self.groups)}")
            groups = [*self.groups, g]
            check_distinct([h.params for h in groups], ["param_names" in h.entries for h in groups])
        self.groups.append(g)
        param_groups.append(g.entries)
        self.changed()

    def reset_state(self, value, view) -> None:
        """`optimizer.state = value` (torch.optim.Optimizer.__init__ assigns an empty dict)."""
        if isinstance(value, StateView) and value._book is self:
            return
        if not isinstance(value, Mapping):
            raise TypeError(
                f"optimizer.state must be a mapping from parameter to state, got {type(value).__name__}"
            )
        entries = list(value.items())
        self.leaf_of.clear()
        self.extra_state = {}
        self.changed()
        for p, entry in entries:
            view[p] = entry

    def rekey(self) -> None:
        """After a copy (deepcopy, pickle): find each new tensor's state by its new identity."""
        self.leaf_of = {id(p): (p, leaf, g) for p, leaf, g in self.leaf_of.values()}
        self.changed()


class StateView(MutableMapping):
    """`optimizer.state` as torch code reads it: `state[p]` is `p`'s entry of `state_dict()["state"]`,
    built on each read ({} before its first gradient); `state[p] = entry` loads one, checked first
    (ZeroRedundancyOptimizer restores its shards this way); `del state[p]` and `clear()` drop
    state. A key that is not a tensor (a hook's note) holds any value, saved as it is."""

    def __init__(self, optimizer):
        self._optimizer = optimizer
        self._book, self._format = optimizer._book, optimizer._format

    def _known(self, p) -> bool:
        book = self._book
        if id(p) not in book.position_of:
            book.follow_edits(self._optimizer._policy)  # a parameter listed since the last step
        return id(p) in book.position_of or id(p) in book.leaf_of

    def __getitem__(self, p):
        if not isinstance(p, torch.Tensor):
            return self._book.extra_state[p]
        leaf = self._book.leaf(p)
        if leaf is None and not self._known(p):
            raise KeyError(p)
        return {} if leaf is None else self._format.entry(p, leaf)

    def __setitem__(self, p, entry):
        if not isinstance(p, torch.Tensor):
            self._book.extra_state[p] = entry
        elif not self._known(p):
            raise KeyError(p)
        else:
            self._format.load_entry(p, entry)
            self._book.changed()

    def __delitem__(self, p):
        if not isinstance(p, torch.Tensor):
            del self._book.extra_state[p]
        elif self._book.leaf(p) is None:
            raise KeyError(p)
        else:
            self._book.forget([p])

    def __contains__(self, p) -> bool:
        if not isinstance(p, torch.Tensor):
            return p in self._book.extra_state
        leaf = self._book.leaf(p)
        return leaf is not None and self._format.shows(leaf)

    def clear(self) -> None:
        self._book.forget(self._book.with_state())
        self._book.extra_state.clear()

    def __iter__(self):
        shown = [p for p in self._book.with_state() if self._format.shows(self._book.leaf(p))]
        return iter([*shown, *self._book.extra_state])

    def __len__(self):
        return len(list(iter(self)))

    def __repr__(self):
        return f"<optimiser state of {len(self)} parameters>"
