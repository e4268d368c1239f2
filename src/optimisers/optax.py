"""Any rule as an optax `GradientTransformation`, for optax chains, Flax NNX and linen
(docs/optax.md): `transform(rule)`, whose update is the rule's step negated (`new - x` where a
rule sets a new value or steps a float16/bfloat16 parameter in float32), and its state, a
`TransformState`. Importing this module imports jax and optax; `import optimisers` does not.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import operator
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax as _optax

from optimisers import rules
from optimisers.core import rule as _rule
from optimisers.core.rule import NewValue, Rule, Scheduled
from optimisers.core.state import Leaf, State, flatten_state, map_leaves, unflatten_state
from optimisers.core.tree import kind_of, walked
from optimisers.verbs.setup import rule_chooser, setup
from optimisers.verbs.update import rebuild, stepped

__all__ = ["transform", "TransformState"]


def transform(rule, *, state_dtypes=None) -> _optax.GradientTransformationExtraArgs:
    """An optax `GradientTransformationExtraArgs` that runs `rule` (an `optimisers.Rule`, or a
    function `(path, x) -> Rule` as `setup` takes) with tied weights handled (docs/optax.md).

    * `init(params)` is `optimisers.setup(rule, params)`, eagerly and under `jax.jit`,
      `jax.eval_shape` and `jax.vmap` (there ties are found among the arrays the traced function
      holds: close over the model, `jax.jit(lambda: tx.init(params))()`). NNX `Variable`s are read
      as their values; a leaf that is not an array is a `TypeError`.
    * `update(updates, state, params)` returns `(updates, new_state)` such that
      `optax.apply_updates(params, updates)` is the model `optimisers.update(state, params,
      updates)` returns, bit for bit. `params` is required; extra keyword arguments are ignored.
      It returns the kind of State it is given (`adjust` returns a plain State).
    * `state_dtypes`: a dtype for state arrays by their optax name (`{"mu": jnp.bfloat16}`, as
      optax's `mu_dtype`; `{"trace": ...}` for momentum's): they are made and stored in it.

    `optimisers.adjust(state, 1e-4)` changes the learning rate. A transformation that made no
    state with its own `init` applies the hyperparameters that `rule` holds as JAX arrays instead
    of the State's: that is how `optax.inject_hyperparams(lambda learning_rate:
    transform(Adam(learning_rate)))(learning_rate=schedule)` hands over each step's value.
    """
    rule_chooser(rule)  # a State, an optax transformation, a class: fail now
    live = _LiveHyperparameters(rule)
    live.dtypes = _checked_dtypes(rule, state_dtypes)
    # a function choosing rules per parameter cannot say before it sees the params which state
    # arrays each has: its states keep them inside (no params-shaped views)
    views = isinstance(rule, Rule)

    def init_fn(params):
        if type(params).__name__ == "_ParamsPlaceholder" and type(params).__module__.startswith("optax"):
            # optax.tree_utils.tree_map_params' stand-in for the params: the state's structure,
            # with `params` where a params-shaped tree is
            names = _layout(rule).names if views else ()
            return TransformState._of(_NOT_PARAMS, {name: params for name in names}, views)
        variables, params = params, _values_of(params)
        _check_leaves(params, "init")
        state = _in_dtypes(setup(rule, params), live.dtypes, fresh=True)  # under jit as eagerly
        live.made_states = True
        if variables is not params:
            _annotate_sharded(state, variables, params)
        return TransformState._split(state, params, views)

    def update_fn(updates, state, params=None, **extra_args):
        return _update(live, updates, state, params)

    return _optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _update(live, updates, state, params):
    """`transform`'s `update`: `(updates, new_state)`, each update the rule's step negated."""
    if params is None:
        raise TypeError(
            "optimisers.optax.transform(...).update(updates, state, params) needs the current "
            "params: optimisers' rules read the parameters and its state is keyed by them"
        )
    if not isinstance(state, State):
        raise TypeError(
            "optimisers.optax.transform(...).update expects the state its init returned (an "
            f"optimisers.State), got a {type(state).__name__}; arguments are "
            "(updates, state, params)"
        )
    params, grads = _values_of(params), _values_of(updates)
    given = state
    state = live.applied(state, params)
    new_state, results = stepped(state, params, (grads,), "transform(...).update")
    made: dict = {}

    def place(leaf, x):
        key = id(leaf)
        if key not in made:
            moved = results.get(key)
            made[key] = _optax_update(moved[1] if moved else None, x)
        return made[key]

    rebuilt = rebuild(state.tree, params, place)

    def unmoved(u, p):
        # a place the state does not cover (an integer array, say) came back as itself: it
        # gets an update that leaves it as it is
        if u is not p:
            return u
        if not _is_array(p):
            _check_leaves(params, "update")  # an unfiltered Equinox module: say where
        return _no_move(p)

    new_state = _in_dtypes(new_state, live.dtypes)
    if isinstance(given, TransformState):
        new_state = TransformState._split(new_state, params, given._views_on)
    return jax.tree.map(unmoved, rebuilt, params), new_state


def _optax_update(step, x):
    """The update optax adds to `x` for a rule's `step` (`x_new = x - step`), in `x`'s dtype."""
    if step is None:
        return _no_move(x)
    if isinstance(step, NewValue):
        return jnp.asarray(step.value, dtype=x.dtype) - x
    step = jnp.asarray(step)
    if step.dtype == x.dtype:
        # a rule may step by a scalar: optax expects updates shaped like params
        return jnp.broadcast_to(jnp.negative(step), x.shape)
    # a step in another dtype (float32 for a float16/bfloat16 parameter, whose maths runs in
    # float32): the update is the parameter `optimisers.update` gives (`x - step` rounded to
    # x's dtype) less `x`, in x's dtype, as for a new value
    return jnp.broadcast_to((x - step).astype(x.dtype) - x, x.shape)


def _no_move(x):
    """An update that leaves `x` exactly as it is under `x + u`: -0.0 keeps a negative zero."""
    zeros = jnp.zeros_like(x)
    return jnp.negative(zeros) if jnp.issubdtype(zeros.dtype, jnp.inexact) else zeros


def _nnx_variable_type():
    # Flax is not a dependency: only seen once imported
    return getattr(sys.modules.get("flax.nnx"), "Variable", None)


def _nnx_variable_like(variable, value):
    """A new NNX `Variable` like `variable` (kind, metadata, dtype, placement) holding `value`:
    what `adjust` puts where `nnx.Optimizer` holds a hyperparameter (nothing compiles again)."""
    if not _rule._is_number(value):
        raise TypeError(
            f"adjust: this hyperparameter is held by Flax NNX (nnx.Optimizer) as a "
            f"{type(variable).__name__} of a number; it takes a number, got {value!r}"
        )
    old = variable.get_value()
    new = jnp.asarray(value, dtype=old.dtype)
    # placed as the old value was: committed to its devices when it was, and left uncommitted
    # otherwise (jit compiles again for a committed argument where it had an uncommitted one,
    # and once more for the outputs, which that argument commits)
    if isinstance(old, jax.Array) and not isinstance(old, jax.core.Tracer) and old.committed:
        new = jax.device_put(new, old.sharding)
    return variable.copy(new)


# `adjust(optimizer.opt_state, 1e-3)` on an nnx.Optimizer's state keeps Variables where they were
_rule.HELD_VALUES.append((lambda x: isinstance(x, _nnx_variable_type() or ()), _nnx_variable_like))


def _annotate_sharded(state: State, variables, params) -> None:
    """Hold each state array shaped like its parameter in a copy of the parameter's NNX
    `Variable` when that declares a sharding, as optax's states do (docs/flax.md)."""
    variable = _nnx_variable_type()
    sharded = {
        id(v.get_value()): v
        for v in jax.tree.leaves(variables, is_leaf=lambda x: isinstance(x, variable))
        if isinstance(v, variable) and v.get_metadata().get("out_sharding") is not None
    }
    places = _first_places(state.tree, params) if sharded else None
    for leaf in state.leaves() if places else ():
        v = sharded.get(id(places[id(leaf)][1]))
        if v is not None:
            parts: list = []
            spec = flatten_state(leaf.state, parts)
            held = [v.copy(p) if getattr(p, "shape", None) == v.shape else p for p in parts]
            leaf.state = unflatten_state(spec, iter(held))


def _values_of(tree):
    """`tree` with each Flax NNX `Variable` replaced by its value (what `nnx.as_pure` does)."""
    variable = _nnx_variable_type()
    held = (lambda x: isinstance(x, variable)) if variable else None  # noqa: E731
    if held is None or not any(map(held, jax.tree.leaves(tree, is_leaf=held))):
        return tree
    return jax.tree.map(lambda v: v.get_value() if held(v) else v, tree, is_leaf=held)


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, numbers.Number))


def _check_leaves(params, call: str) -> None:
    """Refuse anything but arrays in `params` (an Equinox module's function), as optax's `init` does."""
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not _is_array(x):
            raise TypeError(
                f"optimisers.optax.transform(...).{call}: params holds a {type(x).__name__} at "
                f"{jax.tree_util.keystr(path) or 'the root'}, not an array; optax transformations "
                "take a tree of arrays. With Equinox, filter the model first: "
                "init(eqx.filter(model, eqx.is_array)), and update(grads, state, "
                "eqx.filter(model, eqx.is_array))"
            )


# --- hyperparameters held as JAX arrays ----------------------------------------------------------


class _LiveHyperparameters:
    """The hyperparameters that `transform`'s rule holds as JAX arrays, which `update` applies in
    place of the State's (docs/optax.md, `inject_hyperparams`); not after its own `init`, where
    applying them again would undo `adjust`."""

    def __init__(self, rule):
        self.rule = rule
        self.made_states = False  # set by init
        # None: not known yet (a rule function is asked at each Leaf's place, at the first update)
        self.any = _holds_arrays(rule) if isinstance(rule, Rule) else None

    def applied(self, state: State, params) -> State:
        """`state` with each Leaf's rule holding the live values; `state` itself when none."""
        if self.any is False or self.made_states:
            return state
        if isinstance(self.rule, Rule):
            chosen = None
        else:
            places = _first_places(state.tree, params)
            if places is None:
                return state  # not the state of this model: the update says what is wrong
            choose = rule_chooser(self.rule)
            chosen = {key: choose(path, x) for key, (path, x) in places.items()}
            if self.any is None:
                self.any = any(map(_holds_arrays, chosen.values()))
                if not self.any:
                    return state
        merged: dict = {}

        def with_live(leaf):
            fresh = self.rule if chosen is None else chosen[id(leaf)]
            key = (id(leaf.rule), id(fresh))
            if key not in merged:
                merged[key] = _merged(leaf.rule, fresh)
            rule = merged[key]
            return leaf if rule is leaf.rule else leaf._successor(rule, leaf.state)

        return State(map_leaves(with_live, state.tree), state._keys)


def _holds_arrays(value) -> bool:
    if isinstance(value, Rule):
        return dataclasses.is_dataclass(value) and any(
            _holds_arrays(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if not f.metadata.get("static", False)
        )
    if isinstance(value, (tuple, list)):
        return any(map(_holds_arrays, value))
    return isinstance(value, jax.Array)  # tracers included


def _merged(held, fresh):
    """`held` (a rule in the State) with each hyperparameter that `fresh` holds as a JAX array
    taken from `fresh`; `held` itself when there is none."""
    if type(held) is not type(fresh):
        raise TypeError(
            f"optimisers.optax.transform(...).update: the state holds {held!r} where this "
            f"transformation applies {type(fresh).__name__}; was the state made by another one?"
        )
    changes = {}
    for f in dataclasses.fields(fresh):
        if f.metadata.get("static", False):
            continue
        old = getattr(held, f.name)
        new = _merged_value(old, getattr(fresh, f.name))
        if new is not old:
            changes[f.name] = new
    if not changes:
        return held
    # built as unflattening builds rules: the values come from a rule that was validated
    return _rule._unchecked(held, changes)


def _merged_value(old, new):
    if isinstance(new, Rule):
        return _merged(old, new)
    if isinstance(new, (tuple, list)) and isinstance(old, (tuple, list)) and len(old) == len(new):
        items = [_merged_value(o, n) for o, n in zip(old, new)]
        if all(a is b for a, b in zip(items, old)):
            return old
        return type(old)(items) if type(old) in (tuple, list) else type(old)(*items)
    return new if isinstance(new, jax.Array) else old


def _first_places(tree, model):
    """`{id(leaf): (path, parameter)}` at each Leaf's first place; None when `model` does not
    have the state's structure."""
    places: dict = {}

    def visit(snode, node, path) -> bool:
        if isinstance(snode, Leaf):
            places.setdefault(id(snode), (path, node))
            return True
        kind = kind_of(node)
        if kind is None:
            return False
        children = dict(kind.children(node))
        return all(k in children and visit(sub, children[k], path + (k,)) for k, sub in snode.items())

    return places if walked(visit, tree, model, ()) else None


# --- the state in optax's layout: a params-shaped tree per state array ---------------------------


class TransformState(State):
    """The state `transform(rule).init` returns: an `optimisers.State` (index it, `adjust` it,
    `freeze_` it, save it with `state_dict`), laid out for JAX as optax lays out its own states.

    Its pytree children are `"state"`, the State without the arrays below, and `"params"`, a dict
    from an optax name (Adam's `"mu"` and `"nu"`) to a tree shaped like the params holding each
    state array kept per parameter element, at every place of its parameter (`optax.MaskedNode()`
    where no Leaf is), for `optax.tree_utils.tree_map_params` and `optax.tree.get` (docs/optax.md).
    """

    __slots__ = ("_core", "_views", "_views_on", "_made_from")

    @classmethod
    def _of(cls, core, views: dict, views_on: bool) -> TransformState:
        """The state with these children; its tree is built when first asked for."""
        state = cls.__new__(cls)
        state._core, state._views, state._views_on = core, views, views_on
        state._tree, state._keys, state._made_from = None, getattr(core, "_keys", None), None
        state._build = functools.partial(_merged_tree, core, views)
        return state

    @classmethod
    def _split(cls, state: State, params, views_on: bool, template=None) -> TransformState:
        """`state` (a State of the model `params`) in this layout; `template`: the views of
        another state of the model, in place of `params`."""
        if not views_on:
            return cls._of(State(state.tree, state._keys), {}, False)
        if template is None:  # the model's structure, a MaskedNode where no Leaf's array is
            shape = lambda: jax.tree.map(lambda _: _optax.MaskedNode(), params)  # noqa: E731
        else:  # as another state's views show it (any of them: they are shaped alike)
            shape = lambda: next(iter(template.values()))  # noqa: E731
        core, views = _split_views(state.tree, shape)
        return cls._of(State(core, state._keys), views, True)

    def _relaid(self, state: State) -> TransformState:
        """`state`, a plain State of the same model (loaded from a checkpoint), in this layout."""
        return TransformState._split(state, None, self._views_on, self._children()[1])

    def _children(self):
        """`(core, views)`: as made while the tree has not been built; once it has (`state["w"]`,
        `adjust_`, `freeze_` may change it), from the tree."""
        if self._build is not None:
            return self._core, self._views
        tree = self.tree
        if self._made_from is not None and self._made_from.fits(tree):
            return self._core, self._views  # (the same objects: jit's flatten of them is kept)
        split = TransformState._split(State(tree, self._keys), None, self._views_on, self._views)
        self._core, self._views, self._made_from = split._core, split._views, _Snapshot(tree)
        return self._core, self._views


class _Snapshot:
    """What a built tree's children were made from: the count of Leaf edits, and each dict of the
    tree with its keys and values, held (so identity stays meaningful) and compared by identity."""

    __slots__ = ("edits", "tree", "dicts")

    def __init__(self, tree):
        self.edits, self.tree, self.dicts = Leaf.edits, tree, []

        def visit(node):
            if isinstance(node, dict):
                self.dicts.append((node, tuple(node), tuple(node.values())))
                for child in node.values():
                    visit(child)

        walked(visit, tree)

    def fits(self, tree) -> bool:
        if Leaf.edits != self.edits or self.tree is not tree:
            return False
        return all(
            len(node) == len(keys)
            and all(map(operator.is_, node, keys))
            and all(map(operator.is_, node.values(), values))
            for node, keys, values in self.dicts
        )


def _transform_state_flatten_with_keys(state):
    if not _FLAX_REGISTERED:
        _register_flax_serialization()
    core, views = state._children()
    key = jax.tree_util.DictKey
    return [(key("state"), core), (key("params"), views)], state._views_on


jax.tree_util.register_pytree_with_keys(
    TransformState,
    _transform_state_flatten_with_keys,
    lambda views_on, children: TransformState._of(*children, views_on),
    lambda state: (list(state._children()), state._views_on),
)


# --- flax.serialization: a TransformState is stored as the State it holds -----------------------

_FLAX_REGISTERED = False


def _register_flax_serialization() -> None:
    """Teach `flax.serialization` (msgpack) the TransformState, if Flax is imported: stored as
    the plain State it holds, restored into the target's layout (docs/optax.md)."""
    global _FLAX_REGISTERED
    serialization = sys.modules.get("flax.serialization")
    if serialization is None or not hasattr(serialization, "register_serialization_state"):
        return
    _FLAX_REGISTERED = True

    def to_dict(state):
        return serialization.to_state_dict(State(state.tree, state._keys))

    def from_dict(target, saved):
        return target._relaid(serialization.from_state_dict(State(target.tree, target._keys), saved))

    serialization.register_serialization_state(TransformState, to_dict, from_dict, override=True)


@dataclasses.dataclass(frozen=True)
class _InView:
    """In a Leaf's state inside a `TransformState`'s `"state"`: the array that was here is in the
    params-shaped tree `name`, at the Leaf's places. A pytree without leaves."""

    name: str

    def __repr__(self):
        return f"<in params[{self.name!r}]>"


jax.tree_util.register_pytree_node(_InView, lambda m: ((), m.name), lambda name, _: _InView(name))


class _NotParams:
    """The `"state"` child of the state `init` makes for `tree_map_params` (a leaf there: the
    whole `"state"` of the real state is not params-shaped)."""

    def __repr__(self):
        return "<not params>"


_NOT_PARAMS = _NotParams()


# --- which state arrays are params-shaped, and their names -------------------------------------


class _Layout(NamedTuple):
    """Where a rule's state keeps params-shaped arrays: `spec`, the structure of its state
    (`flatten_state`), and `(index, name)` for each such part. Decided from the rule alone (the
    same for every parameter), so that `tree_map_params` can know the names before it sees params."""

    spec: Any
    parts: tuple

    @property
    def names(self):
        return tuple(name for _, name in self.parts)


_NO_VIEWS = _Layout(None, ())
# arrays of these shapes stand for a parameter: a part shaped like each of them, in the state of
# every one the rule takes, is an array shaped like the parameter
_PROBES = ((5,), (4, 3), (2, 3, 4))


def _layout(rule) -> _Layout:
    key = _structure_key(rule)
    try:
        if key not in _LAYOUTS:
            _LAYOUTS[key] = _found_layout(rule)
        return _LAYOUTS[key]
    except TypeError:  # an unhashable static field: asked again each time
        return _found_layout(rule)


_LAYOUTS: dict = {}


def _structure_key(value):
    """What decides the structure of a rule's state: its class and its fields but the numbers
    (traced under `jit`), schedules as schedules."""
    if isinstance(value, Rule) and dataclasses.is_dataclass(value):
        return (type(value),) + tuple(
            (f.name, _structure_key(getattr(value, f.name))) for f in dataclasses.fields(value)
        )
    if isinstance(value, (tuple, list)):
        return (type(value),) + tuple(_structure_key(v) for v in value)
    if isinstance(value, (bool, str, type(None), np.dtype, type)):
        return value
    if _rule._is_schedule(value):
        return "schedule"
    if isinstance(value, (numbers.Number, jax.Array, np.ndarray, np.generic)) or _rule._is_held(value):
        return "number"
    return value  # hashable (a dtype object) or not (then the layout is not kept)


def _found_layout(rule) -> _Layout:
    specs, shaped = [], []
    for shape in _PROBES:
        try:
            abstract = jax.eval_shape(rule.init, jax.ShapeDtypeStruct(shape, jnp.float32))
        except Exception:  # noqa: BLE001 - a rule for some shapes only (Muon: matrices)
            continue
        parts: list = []
        specs.append(flatten_state(abstract, parts))
        shaped.append([getattr(p, "shape", None) == shape for p in parts])
    if not specs or any(spec != specs[0] for spec in specs):
        return _NO_VIEWS
    names = _part_names(rule, specs[0])
    chosen, taken = [], set()
    for i, name in enumerate(names):
        if name is None or not all(s[i] for s in shaped):
            continue
        unique, n = name, 1
        while unique in taken:
            n += 1
            unique = f"{name}_{n}"
        taken.add(unique)
        chosen.append((i, unique))
    return _Layout(specs[0], tuple(chosen)) if chosen else _NO_VIEWS


# optax's names for the arrays of its states, for the rules that have an optax counterpart, in
# the order of the rule's own state (`(m, v, t)`: t is a counter, never params-shaped)
_OPTAX_NAMES = {
    **dict.fromkeys((rules.Momentum, rules.Nesterov, rules.LARS), ("trace",)),
    **dict.fromkeys((rules.Lion, rules.Muon), ("mu",)),
    **dict.fromkeys(
        (rules.Adam, rules.AdamW, rules.RAdam, rules.NAdam, rules.AdaMax, rules.AdaBelief, rules.ADOPT),
        ("mu", "nu"),
    ),
    rules.LAMB: ("mu", "nu"),
    rules.AMSGrad: ("mu", "nu", "nu_max"),
    rules.OAdam: ("mu", "nu", "previous_direction"),
    rules.AdEMAMix: ("m1", "m2", "nu"),
    rules.AdaGrad: ("sum_of_squares",),
    rules.RMSProp: ("nu", "mu"),  # (s, c), c when centred
    rules.AdaDelta: ("e_g", "e_x"),
    rules.Rprop: ("prev_updates", "step_sizes"),
    rules.ScheduleFreeAdamW: ("z", "nu"),
    rules.ScheduleFreeSGD: ("z",),
}


def _part_names(rule, spec) -> list:
    """A name (or None) for each part of a state of structure `spec` of `rule`."""
    if spec is not None and spec[0] is Scheduled:  # (count, the rule's own state)
        return [None, *_part_names(rule, spec[1][1])]
    count = _count_parts(spec)
    if isinstance(rule, rules.OptimiserChain) and spec is not None and len(spec[1]) == len(rule.rules):
        return [n for r, sub in zip(rule.rules, spec[1]) for n in _part_names(r, sub)]
    inner = getattr(rule, "rule", None)
    if isinstance(inner, Rule) and spec is not None and spec[0] is tuple:
        subs = spec[1]
        if isinstance(rule, rules.MixedPrecision) and len(subs) == 2:  # (master, inner)
            return ["master", *_part_names(inner, subs[1])]
        if isinstance(rule, rules.Lookahead) and len(subs) == 3:  # (slow, inner, n)
            return ["slow", *_part_names(inner, subs[1]), None]
        if isinstance(rule, rules.SkipNonFinite) and len(subs) == 2:  # (inner, skipped)
            return [*_part_names(inner, subs[0]), None]
    known = _OPTAX_NAMES.get(type(rule))
    if known is not None and (spec is None or spec[0] is tuple):  # the rest: counters
        return [*known[:count], *[None] * (count - len(known))]
    base = type(rule).__name__.lower()
    return [f"{base}_{i}" for i in range(count)]


def _count_parts(spec) -> int:
    return 1 if spec is None else sum(_count_parts(s) for s in spec[1])


# --- between the tree and (core, views) ---------------------------------------------------------


def _split_views(tree, template):
    """`(core tree, views)`: each Leaf's params-shaped arrays moved out of its state into the
    views (an `_InView` left in their place), every place of the Leaf holding them."""
    layouts: dict = {}
    moved: dict = {}  # id(Leaf) -> {name: array}

    def strip(leaf):
        rule = leaf.rule
        layout = layouts.get(id(rule))
        if layout is None:
            layout = layouts[id(rule)] = _layout(rule)
        if not layout.parts:
            return leaf
        parts: list = []
        spec = flatten_state(leaf.state, parts)
        if spec != layout.spec:
            return leaf  # a state of another structure than its rule makes: kept whole
        moved[id(leaf)] = {name: parts[i] for i, name in layout.parts}
        for i, name in layout.parts:
            parts[i] = _InView(name)
        return leaf._successor(rule, unflatten_state(spec, iter(parts)))

    core = map_leaves(strip, tree)
    names = sorted({name for layout in layouts.values() for name in layout.names})
    views = {}
    if names:
        base = template()
        for name in names:

            def place(leaf, x, name=name):
                own = moved.get(id(leaf))
                return own[name] if own is not None and name in own else _optax.MaskedNode()

            views[name] = rebuild(tree, base, place)
    return core, views


def _merged_tree(core, views):
    """The state tree of a `TransformState`: its core's Leafs with their arrays back from the
    views, each read at the Leaf's first place."""
    if not isinstance(core, State):
        raise TypeError(
            f"this TransformState holds {core!r} in place of its state (made by a tree map that "
            "replaced the state's arrays, e.g. with sharding specs); it is not a state to update"
        )
    tree = core.tree
    if not views:
        return tree
    found = {name: _first_places(tree, view) for name, view in views.items()}

    def filled(leaf):
        parts: list = []
        spec = flatten_state(leaf.state, parts)
        if not any(isinstance(p, _InView) for p in parts):
            return leaf
        parts = [found[p.name][id(leaf)][1] if isinstance(p, _InView) else p for p in parts]
        return leaf._successor(leaf.rule, unflatten_state(spec, iter(parts)))

    return map_leaves(filled, tree)


# --- explicit state dtypes ---------------------------------------------------------------------


def _checked_dtypes(rule, state_dtypes) -> dict:
    """`state_dtypes` as `{name: dtype}`; a name that `rule`'s state does not have is an error
    (for a rule function, asked of each rule it chooses, at `init`)."""
    if not state_dtypes:
        return {}
    if not isinstance(state_dtypes, dict):
        raise TypeError(
            f"transform: state_dtypes takes a dict from a state array's name to a dtype, e.g. "
            f'{{"mu": jnp.bfloat16}}; got {state_dtypes!r}'
        )
    dtypes = {}
    for name, dtype in state_dtypes.items():
        try:
            dtypes[name] = jnp.dtype(dtype)
        except TypeError:
            raise TypeError(f"transform: state_dtypes[{name!r}] is {dtype!r}, not a dtype") from None
    if isinstance(rule, Rule):
        _check_names(rule, dtypes)
    return dtypes


def _check_names(rule, dtypes) -> None:
    names = _layout(rule).names
    unknown = [n for n in dtypes if n not in names]
    if unknown:
        has = ", ".join(map(repr, names)) or "none"
        raise ValueError(
            f"transform: state_dtypes names {', '.join(map(repr, unknown))}, which {rule!r} does not "
            f"keep per parameter element; its state arrays by name: {has}"
        )


def _in_dtypes(state: State, dtypes: dict, fresh: bool = False) -> State:
    """`state` with its arrays named in `dtypes` in those dtypes (`fresh`: made by `init`)."""
    if not dtypes:
        return state
    checked: set = set()

    def cast(leaf):
        layout = _layout(leaf.rule)
        if id(leaf.rule) not in checked:
            _check_names(leaf.rule, dtypes)
            checked.add(id(leaf.rule))
        parts: list = []
        spec = flatten_state(leaf.state, parts)
        if spec != layout.spec:
            return leaf
        changed = False
        for i, name in layout.parts:
            dtype = dtypes.get(name)
            if dtype is not None and parts[i].dtype != dtype:
                # a fresh state's zeros are made real first: a real dtype for a complex parameter
                # then discards nothing (later, astype warns as NumPy does)
                part = jnp.real(parts[i]) if fresh and jnp.iscomplexobj(parts[i]) else parts[i]
                parts[i] = part.astype(dtype)
                changed = True
        return leaf._successor(leaf.rule, unflatten_state(spec, iter(parts))) if changed else leaf

    return State(map_leaves(cast, state.tree), state._keys)
