"""`State` and `Leaf` as JAX pytrees, and their Flax serialisation; `optimisers.backends.jax`
registers them (`register`) when JAX is first used. The pytree's keys and leaves, and what keeps
one compile across updates and adjusts: docs/backends.md#the-state-as-a-pytree.

* Flattening stores each distinct Leaf and each distinct rule object once; the skeleton (which
  places share which Leaf), each rule's class and non-numeric fields (bools, ints, dtypes,
  schedules; a field with `metadata={"static": True}`) and frozen flags are static aux data, so
  ties survive `jit`. Rules are rebuilt without validation: JAX unflattens with tracers and
  placeholders.
* Numbers and scalar state reach JAX in one normal form (`_normal`); a scalar state part that
  Leafs of one elementwise rule share (`SHARE_SCALAR_STATE`) is one leaf (`_layout_by_value`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import numbers
import operator
import sys
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from optimisers.core.narrow import NarrowDtype
from optimisers.core.quantised import Quantised
from optimisers.core.rule import Rule, _is_held
from optimisers.core.state import Leaf, State, flatten_state, is_scalar, scalar_key, unflatten_state
from optimisers.core.tree import format_path, walked

_Tracer = jax.core.Tracer

# --- a rule as aux data and numeric leaves ----------------------------------------------------


class _Static:
    """A static value in aux data: compared by type and value when hashable, by identity if not."""

    __slots__ = ("value", "_key", "_hash")

    def __init__(self, value):
        self.value = value
        try:
            self._key = (type(value), value)
            self._hash = hash(self._key)
        except TypeError:
            self._key = (type(value), id(value))
            self._hash = hash(self._key)

    def __eq__(self, other):
        if not isinstance(other, _Static):
            return NotImplemented
        try:
            return bool(self._key == other._key)
        except Exception:
            return self.value is other.value

    def __hash__(self):
        return self._hash

    def __repr__(self):
        return f"static({self.value!r})"


_NUM = "num"


def _is_numeric(value) -> bool:
    if isinstance(value, (bool, np.bool_, numbers.Integral)):
        return False  # flags and integer hyperparameters (AccumGrad.n) decide the program's shape
    if isinstance(value, numbers.Number):
        return True
    return isinstance(value, (jax.Array, np.ndarray, np.generic))


# A rule rebuilt by unflatten remembers its description: JAX unflattens with placeholders (bools,
# None, object()) in the numeric slots, and flattening such a rule again must give the same aux data.
_DESC_ATTR = "_optimisers_pytree_desc"


def _describe(value, static: bool = False):
    """A hashable description of `value`: `_NUM` in each numeric slot, the rest static."""
    if isinstance(value, Rule) and dataclasses.is_dataclass(value):
        desc = getattr(value, _DESC_ATTR, None)
        if desc is None:
            fields = [(f.name, f.metadata.get("static", False)) for f in dataclasses.fields(value)]
            desc = ("rule", type(value), tuple((n, _describe(getattr(value, n), st)) for n, st in fields))
        return desc
    if type(value) in (tuple, list) or (isinstance(value, tuple) and hasattr(value, "_fields")):
        return ("seq", type(value), tuple(_describe(v, static) for v in value))
    if not static and (_is_numeric(value) or _is_held(value)):  # held: a Flax Variable, say
        return _NUM
    return ("static", _Static(value))


def _has_numbers(desc) -> bool:
    if desc == _NUM:
        return True
    if desc[0] == "seq":
        return any(_has_numbers(d) for d in desc[2])
    return desc[0] == "rule" and any(_has_numbers(d) for _, d in desc[2])


def _named(desc, value, fn):
    """The numbers in the numeric slots of `value` (a rule, or what `_named` gave for one), each
    through `fn`, keyed as `desc` lays them out: a dict by field name for a rule (fields without
    numbers left out), a tuple for a sequence (None for an entry without numbers), so that
    `optax.tree_utils.tree_get(state, "eta")` finds them."""
    if desc == _NUM:
        return fn(value)
    if desc[0] == "seq":
        return tuple(_named(d, value[i], fn) if _has_numbers(d) else None for i, d in enumerate(desc[2]))
    if desc[0] == "rule":
        get = value.__getitem__ if type(value) is dict else functools.partial(getattr, value)
        return {name: _named(d, get(name), fn) for name, d in desc[2] if _has_numbers(d)}
    return None


def _decode(desc, named):
    """The value `desc` describes, with the numbers of `named` (as `_named` gives them). A rule is
    rebuilt without validation: JAX unflattens with tracers and placeholder objects."""
    if desc == _NUM:
        return named
    tag, cls = desc[0], desc[1]
    if tag == "static":
        return cls.value
    if tag == "seq":
        items = [_decode(d, named[i] if _has_numbers(d) else None) for i, d in enumerate(desc[2])]
        return cls(items) if cls is tuple or cls is list else cls(*items)  # else a NamedTuple
    rule = object.__new__(cls)
    for name, d in desc[2]:
        object.__setattr__(rule, name, _decode(d, named[name] if _has_numbers(d) else None))
    with contextlib.suppress(AttributeError, TypeError):  # __slots__: described by value again
        object.__setattr__(rule, _DESC_ATTR, desc)
    return rule


def _rule_parts(rule):
    """A rule's description and its numbers by name (`_named`), in normal form."""
    desc = _describe(rule)
    return desc, _named(desc, rule, _normal)


# --- the normal form of scalar leaves ----------------------------------------------------------

_WIDEST = ((jnp.bool_, np.bool_), (jnp.integer, np.int64), (jnp.complexfloating, np.complex128))


def _normal_dtype(dtype):
    return _normal_dtype_of(dtype, jax.dtypes.canonicalize_dtype(np.int64))  # (x64 or not)


@functools.cache
def _normal_dtype_of(dtype, _x64):
    for kind, widest in _WIDEST:
        if jnp.issubdtype(dtype, kind):
            return jax.dtypes.canonicalize_dtype(widest)
    return jax.dtypes.canonicalize_dtype(np.float64)


_PYTHON_NUMBER_DTYPE = {int: np.int64, float: np.float64, complex: np.complex128}


def _normal(value):
    """A hyperparameter or scalar state part as the leaf a pytree gets: a strong 0-d array of the
    default dtype of its kind (float32 and int32, or float64 and int64 under `jax_enable_x64`),
    whether it is now a Python number, a NumPy or JAX 0-d array, weak-typed or not. Anything else
    (bools, placeholders such as None or a ShapeDtypeStruct, arrays with dimensions) passes."""
    t = type(value)
    if t in _PYTHON_NUMBER_DTYPE:  # host data: jit moves it to the device with the call
        return np.asarray(value, _normal_dtype(np.dtype(_PYTHON_NUMBER_DTYPE[t])))
    if isinstance(value, (jax.Array, _Tracer)):
        if value.ndim:
            return value
        dtype = _normal_dtype(value.dtype)
        if value.dtype == dtype and not value.weak_type:
            return value
        return jax.lax.convert_element_type(value, dtype)
    if isinstance(value, (np.ndarray, np.generic)) and value.ndim == 0 and value.dtype.kind in "iufc":
        dtype = _normal_dtype(value.dtype)
        return value if type(value) is np.ndarray and value.dtype == dtype else np.asarray(value, dtype)
    return value


# --- State as a pytree -------------------------------------------------------------------------

_RULES, _SCALARS = "rules", "scalars"
# State -> the `_Unflattened` it was made from or last flattened to: a cache beside the State,
# not in it, that goes when the State goes
_MADE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _without_gc(fn):
    """`fn` run with the cyclic garbage collector paused: the many small tuples that flattening or
    building a State of thousands of Leafs makes would set off collections that cost more."""

    @functools.wraps(fn)
    def paused(*args, **kwargs):
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return paused


@_without_gc
def _state_parts(state: State):
    """`(keyed children, aux)`: children `"rules"` (each distinct rule's numbers), `"scalars"` (each
    scalar state part once however many Leafs share it), then each Leaf's other state parts by
    parameter path; aux the skeleton, rule descriptions and per Leaf (rule number, frozen, state
    structure, scalar slot of each part)."""
    skel, found, rules, dicts = _skeleton(state.tree)
    flat, groups = [], []
    for leaf, _, _ in found:
        parts: list = []
        flat.append((flatten_state(leaf.state, parts), parts))
        # Leafs of one elementwise rule and frozen flag get one new counter object from the update
        groups.append((id(leaf.rule), bool(leaf.frozen)) if leaf.rule.elementwise else None)
    made = _MADE.get(state)
    kept = made and tuple((spec, slots) for _, _, spec, slots in made.aux[2])
    layout = _kept_layout(kept, flat, groups) or _layout_by_value(flat, groups)
    names = _leaf_names([path for _, path, _ in found])
    scalars, slot_names, leaf_meta, leaf_children = _split_parts(found, flat, layout, names)
    aux = (skel, tuple(desc for desc, _ in rules), tuple(leaf_meta), bool(scalars))
    place = _host_scalar_placement(leaf_children)
    rule_values = [_named(desc, values, place) if place else values for desc, values in rules]
    scalars = tuple(place(_normal(v)) if place else _normal(v) for v in scalars)
    tu = jax.tree_util
    head = [(tu.DictKey(_RULES), tuple(rule_values))] if rule_values else []
    if scalars:
        head.append((tu.DictKey(_SCALARS), tuple({n: v} for n, v in zip(slot_names, scalars))))
    keyed = head + leaf_children
    # kept for the next flatten of this State, unchanged (`jit` flattens it twice per trace)
    made = _MADE[state] = _Unflattened(aux, [c for _, c in keyed])
    made.built(state.tree, dicts, [leaf for leaf, _, _ in found])
    made.keyed = keyed
    return keyed, aux


def _skeleton(root):
    """The tree's skeleton (a Leaf by its number, a dict seen before as `("ref", its number)`) and,
    in skeleton order, the distinct Leafs as `(Leaf, path, rule number)`, the distinct rules as
    `(description, numbers by name)`, and the tree's dicts."""
    rule_num, rules, leaf_num, found, dict_num, dicts = {}, [], {}, [], {}, []  # (numbers by id)

    def walk(node, path):
        if isinstance(node, Leaf):
            j = leaf_num.get(id(node))
            if j is None:
                r = rule_num.get(id(node.rule))
                if r is None:
                    r = rule_num[id(node.rule)] = len(rules)
                    rules.append(_rule_parts(node.rule))
                j = leaf_num[id(node)] = len(found)
                found.append((node, path, r))
            return j
        d = dict_num.get(id(node))
        if d is not None:
            return ("ref", d)
        dict_num[id(node)] = len(dicts)
        dicts.append(node)
        return ("dict", tuple([(k, walk(v, path + (k,))) for k, v in node.items()]))

    return walked(walk, root, ()), found, rules, dicts


def _split_parts(found, flat, layout, names):
    """Each Leaf's state parts as the layout places them: the shared scalars and their names, in
    slot order; per Leaf, its aux entry and, if it has any, its other parts as its own child."""
    n_slots = 1 + max((s for _, slots in layout for s in slots if s is not None), default=-1)
    scalars, slot_names = [None] * n_slots, [None] * n_slots
    leaf_meta, leaf_children = [], []
    for j, ((leaf, _, r), (spec, slots), (_, parts)) in enumerate(zip(found, layout, flat)):
        own = []
        for slot, p, part_name in zip(slots, parts, _part_names(spec)):
            if slot is None:
                own.append(p)
            else:
                scalars[slot] = p
                slot_names[slot] = part_name
        leaf_meta.append((r, bool(leaf.frozen), spec, slots))
        if own:
            leaf_children.append((jax.tree_util.DictKey(names[j]), tuple(own)))
    return scalars, slot_names, leaf_meta, leaf_children


@functools.cache
def _part_names(spec, name: str = "count") -> tuple:
    """The key of each part among the shared scalars: its NamedTuple field, else "count" (optax's)."""
    if spec is None:
        return (name,)
    cls, specs = spec
    fields = getattr(cls, "_fields", None) or ("count",) * len(specs)
    return tuple(n for field, sub in zip(fields, specs) for n in _part_names(sub, field))


def _host_scalar_placement(leaf_children):
    """For a State whose arrays are sharded over a mesh: a function that puts a host number (fresh
    from setup or adjust) on that mesh, replicated, where a jitted step returns them, so that the
    next step does not compile again. None for anything else."""
    # a quantised part (LowBit) is placed as its codes are
    parts = (getattr(p, "codes", p) for _, own in leaf_children for p in own)
    arrays = (p for p in parts if isinstance(p, jax.Array))
    first = next((p for p in arrays if p.ndim and not isinstance(p, _Tracer)), None)
    if first is None or not isinstance(first.sharding, jax.sharding.NamedSharding):
        return None
    replicated = jax.sharding.NamedSharding(first.sharding.mesh, jax.sharding.PartitionSpec())
    return lambda value: jax.device_put(value, replicated) if type(value) is np.ndarray else value


def _leaf_names(paths) -> list[str]:
    """Each Leaf's key: its `format_path`, made unique with a `#n` suffix (also for "rules.*": orbax
    would store "rules.0" part 0 and rule 0's field 0 both as "rules.0.0")."""
    used = {_RULES, _SCALARS}
    names = []
    for j, path in enumerate(paths):
        name = base = format_path(path)
        if name in used or name.startswith(_RULES + "."):
            name = f"{base}#{j}"
        while name in used:
            name += "_"
        used.add(name)
        names.append(name)
    return names


def _layout_by_value(flat, groups) -> list:
    """Per Leaf `(spec, slots)`: each scalar part numbered. Leafs of one share group whose scalar
    parts are interchangeable (`scalar_key`) share one slot per position, as the update shares
    their new counters; every other Leaf gets its own, so the slots stay the same step to step."""
    slot_of: dict = {}
    layout = []
    for j, ((spec, parts), group) in enumerate(zip(flat, groups)):
        at = [i for i, p in enumerate(parts) if is_scalar(p)]
        owner = ("own", j) if group is None else (group, spec, tuple(scalar_key(parts[i]) for i in at))
        slots: list = [None] * len(parts)
        for i in at:
            slots[i] = slot_of.setdefault((owner, i), len(slot_of))
        layout.append((spec, tuple(slots)))
    return layout


def _kept_layout(layout, flat, groups):
    """The layout a State was unflattened with, while each Leaf has its structure and the Leafs of
    a slot one share group and interchangeable values: JAX (and Equinox's filters) unflatten with
    placeholders such as `False`, and flattening that State again must give the same aux data."""
    if layout is None or len(layout) != len(flat):
        return None
    held: dict = {}
    for j, ((spec, slots), (now_spec, parts), group) in enumerate(zip(layout, flat, groups)):
        if spec != now_spec or len(slots) != len(parts):
            return None
        for slot, p in zip(slots, parts):
            if slot is None:
                continue
            mine = (group, scalar_key(p))
            first = held.setdefault(slot, (j, mine))
            if first[1] != mine or (group is None and first[0] != j):
                return None
    return layout


def plan_flatten(state: State, x) -> None:
    """At `setup` of a model of JAX arrays (`x` one of them): flatten the new State once, for the
    first jitted step. Only a cache: a State that cannot be flattened says so when flattened."""
    if not isinstance(x, jax.Array) or isinstance(x, _Tracer):
        return
    try:
        _state_parts(state)
    except Exception:  # noqa: BLE001 - reported by the flatten that needs it, where it is used
        _MADE.pop(state, None)


def _state_flatten_with_keys(state):
    if not _FLAX_REGISTERED:
        register_flax_serialization()
    made = _MADE.get(state)
    if made is not None and made.keyed is not None and made.fits(state):
        return made.keyed, made.aux
    return _state_parts(state)


def _state_flatten(state):
    made = _MADE.get(state)
    if made is not None and made.fits(state):
        return made.children, made.aux
    keyed, aux = _state_parts(state)  # with keys: jit flattens again with keys, from the record
    return [c for _, c in keyed], aux


_GET_STATE, _GET_RULE, _GET_FROZEN = (operator.attrgetter(a) for a in ("_state", "rule", "frozen"))


class _Unflattened:
    """What a State was unflattened from (or last flattened to). Until its tree is built (on first
    use), flattening it gives back these children and aux; once built, it still does while its
    dicts hold the same Leafs and those the same rule, state and frozen flag (C-level checks)."""

    def __init__(self, aux, children):
        self.aux, self.children = aux, children
        self.root = None  # the tree, once built
        self.keyed = None  # the children with their keys, once flattened with keys

    def built(self, root, dicts, leaves) -> None:
        self.root = root
        dicts = [] if isinstance(root, Leaf) else dicts  # a lone Leaf: no dicts to watch
        self.dicts = [(d, tuple(d), tuple(d.values())) for d in dicts]
        self.leaves = leaves
        self.states = list(map(_GET_STATE, leaves))
        self.rules = list(map(_GET_RULE, leaves))
        self.frozen = list(map(_GET_FROZEN, leaves))
        # a list in a state could change in place, unseen by an identity check
        self.cacheable = all(_tuples_only(spec) for spec in {meta[2] for meta in self.aux[2]})

    def fits(self, state) -> bool:
        if state._build is not None:  # its tree not built yet: nothing in it can have changed
            return True
        if self.root is None or not self.cacheable or state.tree is not self.root:
            return False
        for d, keys, values in self.dicts:
            if len(d) != len(keys) or tuple(d) != keys or not all(map(operator.is_, d.values(), values)):
                return False
        leaves = self.leaves
        return (
            all(map(operator.is_, map(_GET_STATE, leaves), self.states))
            and all(map(operator.is_, map(_GET_RULE, leaves), self.rules))
            and list(map(_GET_FROZEN, leaves)) == self.frozen
        )


def _tuples_only(spec) -> bool:
    return spec is None or (spec[0] is not list and all(_tuples_only(s) for s in spec[1]))


def _state_unflatten(aux, children):
    """A State whose tree is built on first use (`_build_tree`)."""
    _, rule_descs, _, has_scalars = aux
    head = bool(rule_descs)
    values = children[0] if head else ()  # as given, as all but the scalars: the tree holds them
    named_scalars = children[head] if has_scalars else ()
    scalars = [next(iter(named.values())) for named in named_scalars]
    own = list(children[head + has_scalars :])
    normal = [tuple(_named(d, v, _normal) for d, v in zip(rule_descs, values))] if head else []
    if has_scalars:
        normal.append(tuple({k: _normal(v) for k, v in named.items()} for named in named_scalars))
    made = _Unflattened(aux, normal + own)
    state = State._lazy(functools.partial(_build_tree, aux, values, scalars, own, made))
    _MADE[state] = made
    return state


@_without_gc
def _build_tree(aux, values, scalars, own_children, made):
    skel, rule_descs, leaf_meta, _ = aux
    rules = [_decode(d, v) for d, v in zip(rule_descs, values)]
    own_of = iter(own_children)
    leaves = []
    for r, frozen, spec, slots in leaf_meta:
        own = iter(next(own_of)) if None in slots else iter(())
        parts = [next(own) if slot is None else scalars[slot] for slot in slots]
        leaves.append(Leaf(rules[r], unflatten_state(spec, iter(parts)), frozen))
    dicts: list = []

    def build(node):
        if isinstance(node, int):
            return leaves[node]
        if node[0] == "ref":
            return dicts[node[1]]
        out: dict = {}
        dicts.append(out)
        for k, sub in node[1]:
            out[k] = build(sub)
        return out

    root = walked(build, skel)
    made.built(root, dicts, leaves)
    return root


# --- Leaf alone as a pytree --------------------------------------------------------------------


def _leaf_flatten_with_keys(leaf):
    desc, named = _rule_parts(leaf.rule)
    parts: list = []
    spec = flatten_state(leaf.state, parts)
    state = unflatten_state(spec, iter([_normal(p) if is_scalar(p) else p for p in parts]))
    key = jax.tree_util.GetAttrKey
    return [(key("rule"), named), (key("state"), state)], (desc, bool(leaf.frozen))


def _leaf_unflatten(aux, children):
    desc, frozen = aux
    named, st = children
    return Leaf(_decode(desc, named), st, frozen)


def _quantised_flatten_with_keys(q):
    # codes and scale are traced; the format and shape are static (one compile per format)
    key = jax.tree_util.GetAttrKey
    return [(key("codes"), q.codes), (key("scale"), q.scale)], (q.signed, q.bits, q.block, q.shape)


def _quantised_unflatten(aux, children):
    return Quantised(*children, *aux)


def register() -> None:
    """Register `State` and `Leaf` as pytrees, and with Flax's serialisation if Flax is imported."""
    for args in (
        (State, _state_flatten_with_keys, _state_unflatten, _state_flatten),
        (Leaf, _leaf_flatten_with_keys, _leaf_unflatten),
        (Quantised, _quantised_flatten_with_keys, _quantised_unflatten),
        (NarrowDtype, lambda d: ((), d.name), lambda name, _: NarrowDtype(name)),
    ):
        with contextlib.suppress(ValueError):  # already registered (module reloaded)
            jax.tree_util.register_pytree_with_keys(*args)
    register_flax_serialization()


# --- flax.serialization (msgpack `to_bytes` / `from_bytes` of a TrainState) ---------------------

_FLAX_REGISTERED = False


def register_flax_serialization() -> None:
    """Teach `flax.serialization` the State and the Leaf (and the Quantised and NarrowDtype parts
    of rule states), once Flax is imported (this runs again
    whenever a State is flattened). Their state dicts are their pytree children by key; restoring
    takes the structure (rules, ties, frozen flags) from the target, as Flax does."""
    global _FLAX_REGISTERED
    if _FLAX_REGISTERED:
        return
    serialization = sys.modules.get("flax.serialization")
    if serialization is None or not hasattr(serialization, "register_serialization_state"):
        return
    _FLAX_REGISTERED = True
    for cls, flatten, unflatten, kept in (
        (State, _state_parts, _state_unflatten, ("_keys",)),
        (Leaf, _leaf_flatten_with_keys, _leaf_unflatten, ("_shape", "_placed")),
        (Quantised, _quantised_flatten_with_keys, _quantised_unflatten, ()),  # codes and scale
        (NarrowDtype, lambda d: ((), d.name), lambda name, _: NarrowDtype(name), ()),  # nothing
    ):
        from_dict = functools.partial(_from_dict, flatten, unflatten, kept)
        serialization.register_serialization_state(
            cls, functools.partial(_to_dict, flatten), from_dict, override=True
        )


def _names(keyed) -> list:
    return [k.key if isinstance(k, jax.tree_util.DictKey) else k.name for k, _ in keyed]


def _to_dict(flatten_with_keys, value) -> dict:
    keyed, _ = flatten_with_keys(value)
    to_state_dict = sys.modules["flax.serialization"].to_state_dict
    return {name: to_state_dict(child) for name, (_, child) in zip(_names(keyed), keyed)}


def _from_dict(flatten_with_keys, unflatten, kept, target, saved):
    keyed, aux = flatten_with_keys(target)
    what = type(target).__name__
    serialization = sys.modules["flax.serialization"]
    if not isinstance(saved, dict):
        raise ValueError(
            f"flax.serialization: expected the state dict of an optimisers {what} at "
            f"{serialization.current_path()}, got a {type(saved).__name__}"
        )
    names = _names(keyed)
    if set(names) != set(saved):
        missing = sorted(set(map(str, names)) - set(map(str, saved)))
        extra = sorted(set(map(str, saved)) - set(map(str, names)))
        raise ValueError(
            f"flax.serialization: the saved optimisers {what} at {serialization.current_path()} does "
            f"not match the target (missing: {missing or 'none'}; unexpected: {extra or 'none'}); "
            "restore into a state made by the same setup (same model, rule and ties)"
        )
    children = [serialization.from_state_dict(c, saved[n], name=str(n)) for n, (_, c) in zip(names, keyed)]
    restored = unflatten(aux, children)
    for attr in kept:  # what the target knows beyond its pytree
        setattr(restored, attr, getattr(target, attr))
    return restored
