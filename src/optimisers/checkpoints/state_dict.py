"""Optimiser state as a flat dict keyed by parameter path: `state_dict` / `load_state_dict` (the
layout: docs/checkpoints.md). A state's `None` gives no entry, a bare array `"P/state"`. Files
(`save` / `load`) are in `optimisers.checkpoints.files`."""

from __future__ import annotations

import ast
import dataclasses
import math
import sys
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from optimisers import schedules
from optimisers.core import dispatch
from optimisers.core.narrow import NarrowDtype
from optimisers.core.quantised import Quantised
from optimisers.core.rule import Rule, _held_like
from optimisers.core.state import Leaf, State, describe, map_leaves
from optimisers.core.tree import format_path, walked
from optimisers.schedules import Schedule

FORMAT = "optimisers.state_dict.v1"
FORMAT_KEY = "__format__"
META_KEY = "__optimisers__"  # the JSON entry of a file
_HYPER_MODES = ("checkpoint", "state", "check")
_MAX_PROBLEMS = 25
_NUMBERS = (bool, int, float, complex)  # (bool before int: a bool is an int)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into the given state; the message lists every difference."""


# --- walking the state tree ----------------------------------------------------------------------


def _tree_of(state, name):
    if isinstance(state, State):
        return state.tree
    if isinstance(state, Leaf):
        return state
    raise TypeError(
        f"{name} expects the State returned by optimisers.setup (or a part of one), got a "
        f"{type(state).__name__}; did you pass the model?"
    )


def _our_places(tree) -> tuple[dict[str, str], dict[str, Leaf]]:
    """`{dotted path: path that stores its state}` for every place of a Leaf, depth first, and the
    Leaf stored at each such path."""
    ours, leaf_at, first, owner = {}, {}, {}, {}  # (first: path by id(Leaf); owner: key path by path)

    def visit(node, path):
        if isinstance(node, Leaf):
            name = format_path(path)
            if name in owner and owner[name] != path:
                raise ValueError(
                    f"the parameter paths {owner[name]!r} and {path!r} both read {name!r}; a "
                    "state dict needs distinct names (rename one of the keys)"
                )
            owner[name] = path
            ours[name] = first.setdefault(id(node), name)
            leaf_at.setdefault(ours[name], node)
            return
        for k, child in node.items():
            visit(child, path + (k,))

    walked(visit, tree, ())
    return ours, leaf_at


def _is_variable(x) -> bool:
    """A Flax NNX `Variable`, as `nnx.Optimizer` holds the numbers and arrays of rules and states."""
    variable = getattr(sys.modules.get("flax.nnx"), "Variable", None)  # Flax: only once imported
    return variable is not None and isinstance(x, variable)


def _unheld(x):
    """The value a Flax NNX `Variable` holds; `x` itself for anything else."""
    return x.get_value() if _is_variable(x) else x


def _is_array(x) -> bool:  # (or a NumPy scalar) of a library with a backend
    library = dispatch.library_of(type(x))
    return dispatch.is_array_library(library) and hasattr(x, "shape") and hasattr(x, "dtype")


def _map_state(value, key: str, fn):
    """One Leaf's state with each array or number `e` at `key` replaced by `fn(key, e)`, in order,
    its containers rebuilt alike."""
    if value is None or isinstance(value, NarrowDtype):  # (static: the target state keeps its own)
        return value
    if _is_array(value) or isinstance(value, _NUMBERS) or _is_variable(value):
        return fn(key, value)
    if isinstance(value, Quantised):  # its arrays; the format comes from the state's rule
        codes, scale = fn(f"{key}/codes", value.codes), fn(f"{key}/scale", value.scale)
        return dataclasses.replace(value, codes=codes, scale=scale)
    if isinstance(value, (tuple, list, dict)):
        pairs = value.items() if isinstance(value, dict) else enumerate(value)
        items = [(k, _map_state(v, f"{key}/{k}", fn)) for k, v in pairs]
        if isinstance(value, dict):
            return type(value)(items)
        if hasattr(type(value), "_fields"):  # a NamedTuple
            return type(value)(*(v for _, v in items))
        return type(value)(v for _, v in items)
    raise TypeError(
        f"{key}: cannot store a {type(value).__name__} in a state dict; a rule's state must be "
        "arrays, numbers, None, and tuples/lists/dicts of them"
    )


def _state_items(value, key: str, out: list) -> list:
    """`(key, element)` for the arrays and numbers of one Leaf's state, in order."""
    _map_state(value, key, lambda k, v: out.append((k, v)))
    return out


# --- rules as text -------------------------------------------------------------------------------


class _Spec(NamedTuple):  # a rule read back from its text
    name: str
    fields: dict


def _rule_fields(rule) -> list[str]:
    """The fields a rule's text holds: a state dtype (`Adam(mu_dtype=...)`) only when given, so that
    a rule without one has the text it had before rules took them."""
    if not dataclasses.is_dataclass(rule):
        return []
    return [
        f.name
        for f in dataclasses.fields(rule)
        if f.init and not (f.metadata.get("state_dtype") and getattr(rule, f.name) is None)
    ]


def _is_described(x) -> bool:  # stored as its class name and fields
    return isinstance(x, Rule) or (isinstance(x, Schedule) and dataclasses.is_dataclass(x))


def _number(x):
    """A Python number for a number or a concrete 0-d array (Flax Variables unwrapped), else None."""
    x = _unheld(x)
    if isinstance(x, (bool, int, float)):
        return x
    if isinstance(x, np.generic) or (_is_array(x) and tuple(x.shape) == ()):
        if dispatch.backend(x).is_traced(x):
            return None
        v = x.item()
        return v if isinstance(v, (bool, int, float)) else None
    return None


def encode(x, label: str | None = None) -> str:
    """Text for a rule or hyperparameter that `_parse` reads back; floats are exact (repr). Given
    the `label` of `x` (when saving), a callable other than a schedule of `optimisers.schedules`
    (a lambda, an optax schedule) is refused: it cannot be written as data."""
    if _is_described(x):
        x = _Spec(type(x).__name__, {k: getattr(x, k) for k in _rule_fields(x)})
    if isinstance(x, _Spec):
        inner = ", ".join(f"{k}={encode(v, label and f'{label}.{k}')}" for k, v in x.fields.items())
        return f"{x.name}({inner})"
    if isinstance(x, (tuple, list)):
        inner = ", ".join(encode(v, label and f"{label}[{i}]") for i, v in enumerate(x))
        return f"({inner},)" if len(x) == 1 else f"({inner})"
    if x is None or isinstance(x, str):
        return repr(x)
    n = _number(x)
    if n is not None:
        return repr(n)
    # a dtype (NumPy's, torch's, `jnp.float32`): a class goes to NumPy's backend, or its library's
    name = None if isinstance(x, _NUMBERS) else dispatch.backend(x).dtype_name(x)
    if name is not None:
        return repr(name)
    if label is not None and callable(_unheld(x)):
        raise TypeError(
            f"{label} is {_unheld(x)!r}, which a checkpoint cannot store: only numbers and the "
            "schedules of optimisers.schedules (Cosine, Linear, Join, ...) are saved as data. Use "
            "one of those, or adjust the hyperparameter to a number before saving."
        )
    return repr(repr(x))  # compared as text, never restored


def _parse(node):
    """The value of a rule's text parsed by `ast`: a `_Spec`, number, text, None or tuple of them."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args:
        return _Spec(node.func.id, {kw.arg: _parse(kw.value) for kw in node.keywords})
    if isinstance(node, ast.Constant) and isinstance(node.value, (bool, int, float, str, type(None))):
        return node.value
    if isinstance(node, ast.Tuple):
        return tuple(_parse(e) for e in node.elts)
    if isinstance(node, ast.Name) and node.id in ("inf", "nan"):
        return float(node.id)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _parse(node.operand)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return -v
    raise ValueError(f"unexpected {ast.dump(node)}")


def _same_number(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _same_in_float32(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, float | int):
        return False
    fa, fb = np.float32(a), np.float32(b)
    return bool(fa == fb) and (float(fa) == a or float(fb) == b)


def _compare_rule(spec, rule, label: str, found: tuple):
    """Walk the checkpoint's rule `spec` beside the state's `rule` and return `rule` with the numbers
    of `spec`. `found` takes the labels where the kind of rule differs (class, fields, non-numeric
    values), the numbers that differ, and what the rule's own checks refuse (a negative rate)."""
    kinds, diffs, errors = found
    if isinstance(rule, Schedule) and encode(spec) != encode(rule):
        new = _schedule_from(spec)  # another schedule is another value, not another kind of rule
        if new is None:
            kinds.append(label)
            return rule
        diffs.append((label, encode(spec), encode(rule)))
        return new
    if _is_described(rule):
        fields = _rule_fields(rule)
        if not isinstance(spec, _Spec) or spec.name != type(rule).__name__ or set(spec.fields) != set(fields):
            kinds.append(label)
            return rule
        changes = {}
        for k in fields:
            new = _compare_rule(spec.fields[k], getattr(rule, k), f"{label}.{k}", found)
            if new is not getattr(rule, k):
                changes[k] = new
        if not changes:
            return rule
        try:
            return dataclasses.replace(rule, **changes)
        except (ValueError, OverflowError) as e:
            errors.append(e)
            return rule
        except TypeError:  # a rule with its own __init__: set the fields as they were saved
            new_rule = object.__new__(type(rule))
            for f in dataclasses.fields(rule):
                object.__setattr__(new_rule, f.name, changes.get(f.name, getattr(rule, f.name)))
            return new_rule
    if isinstance(rule, (tuple, list)):
        if not isinstance(spec, tuple) or len(spec) != len(rule):
            kinds.append(label)
            return rule
        items = [_compare_rule(s, r, f"{label}[{i}]", found) for i, (s, r) in enumerate(zip(spec, rule))]
        return rule if all(a is b for a, b in zip(items, rule)) else type(rule)(items)
    n = _number(rule)
    if n is None:
        if encode(spec) != encode(rule):
            kinds.append(label)
    elif isinstance(spec, bool) != isinstance(n, bool) or not isinstance(spec, (int, float)):
        kinds.append(label)
    elif not _same_number(spec, n):
        diffs.append((label, spec, n))
        try:
            return _held_like(rule, spec)  # in a Flax Variable where nnx.Optimizer held the old one
        except (ValueError, TypeError, OverflowError) as e:
            errors.append(e)
    return rule


def _schedule_from(spec):
    """The schedule of `optimisers.schedules` that `spec` describes, or None if it describes none."""
    try:
        return _schedule_value(spec) if isinstance(spec, _Spec) else None
    except (TypeError, ValueError):
        return None


def _schedule_value(spec):
    """A schedule's field from its spec (numbers, schedules, tuples of them); TypeError if none."""
    if isinstance(spec, _Spec):
        cls = getattr(schedules, spec.name, None)
        if not (isinstance(cls, type) and issubclass(cls, Schedule) and dataclasses.is_dataclass(cls)):
            raise TypeError(spec.name)
        return cls(**{k: _schedule_value(v) for k, v in spec.fields.items()})
    return tuple(map(_schedule_value, spec)) if isinstance(spec, tuple) else spec


# --- values --------------------------------------------------------------------------------------


def _value_dtype(v) -> str:
    return str(v.dtype).removeprefix("torch.")


def _kind(v) -> str | None:
    """'bool', 'int', 'float' or 'complex' for a number or an array's dtype; None otherwise."""
    for number_type in _NUMBERS:
        if isinstance(v, number_type):
            return number_type.__name__
    if not _is_array(v):
        return None
    name = _value_dtype(v)
    kinds = {"bool": "bool", "int": "int", "uint": "int", "complex": "complex"}
    return kinds.get(name.rstrip("0123456789"), "float")


def _incompatible(value, like) -> str | None:
    """Why checkpoint entry `value` cannot replace state element `like`, or None. Arrays must
    agree in shape and dtype; a number or 0-d array need only hold the same kind of number, so
    a step counter saved as a Python int loads where a jitted run left a 0-d int32 array."""
    value_is_array = _is_array(value)
    if not value_is_array and not isinstance(value, _NUMBERS):
        return f"the checkpoint holds a {type(value).__name__}, this state an array or number"
    like_shape = tuple(like.shape) if _is_array(like) else ()
    shape = tuple(value.shape) if value_is_array else ()
    if shape != like_shape:
        return f"shape {shape} in the checkpoint, {like_shape} in this state"
    if like_shape:
        both_numpy = isinstance(value.dtype, np.dtype) and isinstance(like.dtype, np.dtype)
        if both_numpy and value.dtype == like.dtype:  # the common case, without building names
            return None
        if _value_dtype(value) != _value_dtype(like):
            return f"dtype {_value_dtype(value)} in the checkpoint, {_value_dtype(like)} in this state"
        return None
    if _kind(value) != _kind(like):
        what = {"bool": "a bool", "int": "an integer", "float": "a real number"}
        return (
            f"{what.get(_kind(value), 'a complex number')} in the checkpoint, "
            f"{what.get(_kind(like), 'a complex number')} in this state"
        )
    if _kind(like) == "int":  # the integers of a rule's state count steps: never below 0
        n = _number(value)
        if n is not None and n < 0:
            return f"{n} in the checkpoint, but a step counter cannot be negative"
        try:  # its dtype's maximum (a jitted run's int32); a Python int's: int64's, as torch's
            top = int(np.iinfo(np.dtype(_value_dtype(like))).max)
        except (AttributeError, TypeError, ValueError):
            top = np.iinfo(np.int64).max
        if n is not None and n > top:
            return f"{n} in the checkpoint, more than a step counter here holds ({top})"
    return None


def _convert(value, like):
    """`value` as a fresh element like `like`: a Python number, or an array of its backend, dtype,
    device (JAX: sharding, weak type), in a Flax Variable if `like` is one."""
    if _is_variable(like):
        return like.copy(_convert(value, like.get_value()))
    if isinstance(like, _NUMBERS):
        return type(like)(value.item() if hasattr(value, "item") else value)
    backend = dispatch.backend(like)
    if not _is_array(value):
        value = np.array(value)  # a number
    elif dispatch.backend(value) is not backend:
        value = dispatch.backend(value).to_host(value)  # from another backend: through the host
    return backend.from_host(value, like)


def _convert_shared(value, like, shared: dict):
    """`_convert(value, like)`, made once for a counter object that several Leafs share and the
    checkpoint gives one value: the loaded State flattens to the same pytree (a jitted step does
    not compile again), and in `nnx.Optimizer` they stay one Variable. JAX arrays and Variables
    only: an in-place step would advance a shared NumPy or torch counter once per Leaf."""
    held = _unheld(like)
    functional = _is_variable(like) or (_is_array(held) and dispatch.backend(held).SHARE_SCALAR_STATE)
    n = _number(value) if functional and tuple(getattr(held, "shape", (0,))) == () else None
    if n is None:
        return _convert(value, like)
    key = (id(like), type(n), n)
    if key not in shared:
        shared[key] = _convert(value, like)
    return shared[key]


def _text(value, key):
    """A text entry: a str, or a 0-d text array as `np.savez` gives back."""
    if isinstance(value, str):
        return value
    if isinstance(value, np.ndarray) and value.shape == () and value.dtype.kind in "US":
        v = value.item()
        return v.decode() if isinstance(v, bytes) else v
    raise CheckpointError(f"{key}: expected text, the checkpoint holds {describe(value)}")


def _flag(value):  # a bool, or a 0-d bool array
    if isinstance(value, bool) or (_is_array(value) and tuple(value.shape) == () and _kind(value) == "bool"):
        return bool(value)
    return None


# --- state_dict ----------------------------------------------------------------------------------


def state_dict(state) -> dict:
    """The optimiser state as a flat dict of plain values, keyed by parameter path `P`:
    `"P/rule"` (text such as `"Adam(eta=0.001, beta=(0.9, 0.999), epsilon=1e-08)"`), `"P/frozen"`,
    `"P/state/0"`, `"P/state/1/0"`, ... (state arrays and step counters), `"Q/tied_to": "P"` for
    each further place `Q` of a tied parameter (stored once, under its first path), `"__format__"`.

    The arrays are the state's own (not copies): save or copy them before a later `update_` or a
    donated jitted step overwrites them. Any checkpointer that keeps arrays, numbers and text
    (`torch.save`, `np.savez(f, **d)`) gives back a dict that `load_state_dict` reads.
    """
    ours, leaf_at = _our_places(_tree_of(state, "state_dict"))
    d: dict[str, Any] = {FORMAT_KEY: FORMAT}
    for name, owner in ours.items():
        if owner != name:
            d[f"{name}/tied_to"] = owner
            continue
        leaf = leaf_at[name]
        d[f"{name}/rule"] = encode(leaf.rule, f"{name}: {type(leaf.rule).__name__}")
        d[f"{name}/frozen"] = bool(leaf.frozen)
        for key, value in _state_items(leaf.state, f"{name}/state", []):
            value = _unheld(value)
            if _is_array(value) and dispatch.backend(value).is_traced(value):
                raise TypeError(f"{key}: state_dict needs concrete arrays; call it outside jax.jit")
            if key in d:
                raise ValueError(f"two state entries are both named {key!r}; rename a model key")
            d[key] = value
    return d


# --- load_state_dict -----------------------------------------------------------------------------


def _listing(names, limit=8) -> str:
    names = list(names)
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def load_state_dict(state, d: Mapping, *, hyperparameters: str = "checkpoint") -> State:
    """Restore optimiser state saved by `state_dict` into `state` (a fresh `setup` of the same
    model); returns a new `State`, leaving `state` and `d` as they were.

    Paths, ties, the kind of rule (class, nested rules, non-numeric settings), state entries,
    shapes and dtypes are all checked before anything is built; a `CheckpointError` lists every
    difference. Arrays take the backend, dtype and device (JAX: sharding) of `state`'s, step
    counters the type `state` has; frozen flags come from `d`. `hyperparameters` says where the
    rules' numbers come from: `"checkpoint"` (default, as `torch.optim`: a scheduled run resumes
    exactly), `"state"` (keep `state`'s, to resume with new values) or `"check"` (raise if they
    differ).
    """
    tree = _checked_call(state, d, hyperparameters)
    ours, leaf_at = _our_places(tree)
    stored = {k[: -len("/rule")] for k in d if isinstance(k, str) and k.endswith("/rule")}
    problems: list[str] = []
    theirs, state_keys = _their_places(d, stored, problems)
    problems += _place_problems(ours, theirs)
    planner = _Planner(d, hyperparameters, state_keys)
    plans = {name: planner.plan(name, leaf) for name, leaf in leaf_at.items() if theirs.get(name) == name}
    problems += planner.problems
    # the keys this format has a meaning for; any other is reported
    explained = {FORMAT_KEY, *(f"{n}/tied_to" for n, t in theirs.items() if t != n)}
    explained.update(f"{n}/{what}" for n in stored for what in ("rule", "frozen"))
    explained.update(key for keys in state_keys.values() for key in keys)
    unknown = [str(k) for k in d if k not in explained]
    if unknown:
        problems.append(f"entries this format does not have: {_listing(unknown)}")
    problems += planner.hyper_problems
    if problems:
        shown, more = problems[:_MAX_PROBLEMS], len(problems) - _MAX_PROBLEMS
        raise CheckpointError(
            "the checkpoint does not match this optimiser state; nothing was loaded:\n  - "
            + "\n  - ".join(shown)
            + (f"\n  ... and {more} more" if more > 0 else "")
        )
    return _build(state, tree, leaf_at, plans, hyperparameters)


def _checked_call(state, d, hyperparameters: str):
    """The tree of `state`, once the arguments are checked and `d` is a state dict of this format."""
    if hyperparameters not in _HYPER_MODES:
        raise ValueError(
            f"hyperparameters must be one of {', '.join(map(repr, _HYPER_MODES))}, got {hyperparameters!r}"
        )
    tree = _tree_of(state, "load_state_dict")
    if not isinstance(d, Mapping):
        raise TypeError(f"load_state_dict expects the dict from state_dict, got {type(d).__name__}")
    if FORMAT_KEY not in d:
        some = _listing(sorted(map(str, d)), 5) or "none"
        raise CheckpointError(
            f"this is not an optimisers state dict: it has no {FORMAT_KEY!r} entry (its keys: "
            f"{some}); was it a model's state dict?"
        )
    fmt = _text(d[FORMAT_KEY], FORMAT_KEY)
    if fmt != FORMAT:
        raise CheckpointError(f"unknown checkpoint format {fmt!r}; this version reads {FORMAT!r}")
    return tree


def _their_places(d: Mapping, stored: set, problems: list) -> tuple[dict[str, str], dict[str, list]]:
    """`{path: path that stores its state}` for the checkpoint (bad ties go to `problems`), and the
    state entries (`P/state`, `P/state/...`) of each stored path `P`."""
    theirs: dict[str, str] = {}
    state_keys: dict[str, list] = {}
    for key in d:  # in the checkpoint's order, so that messages list paths depth first
        if not isinstance(key, str):
            continue
        if key.endswith("/rule"):
            theirs[key[: -len("/rule")]] = key[: -len("/rule")]
        elif key.endswith("/tied_to"):
            name, target = key[: -len("/tied_to")], _text(d[key], key)
            if name in stored:
                problems.append(f"{name}: the checkpoint both stores it and ties it to {target}")
            else:
                if target not in stored:
                    problems.append(f"{name}: the checkpoint ties it to {target}, which it does not store")
                theirs[name] = target
        start = key.find("/state")
        while start >= 0:  # a path may itself hold "/state": try each place it occurs
            end = start + len("/state")
            if (end == len(key) or key[end] == "/") and key[:start] in stored:
                state_keys.setdefault(key[:start], []).append(key)
                break
            start = key.find("/state", start + 1)
    return theirs, state_keys


def _place_problems(ours: dict, theirs: dict) -> list[str]:
    """The paths that one side has and the other lacks, and the ties they disagree on."""
    problems = []
    missing = [n for n in ours if n not in theirs]
    extra = [n for n in theirs if n not in ours]
    if missing:
        problems.append(f"in this state but not in the checkpoint: {_listing(missing)}")
    if extra:
        problems.append(f"in the checkpoint but not in this state: {_listing(extra)}")
    for name, owner in ours.items():
        if name not in theirs or theirs[name] == owner:
            continue
        if owner == name:
            problems.append(f"{name}: the checkpoint ties it to {theirs[name]}, this state keeps it separate")
        elif theirs[name] == name:
            problems.append(
                f"{name}: this state ties it to {owner}, the checkpoint stores it separately "
                "(a tie split in two?)"
            )
        else:
            problems.append(f"{name}: this state ties it to {owner}, the checkpoint to {theirs[name]}")
    return problems


class _Planner:
    """Checks each stored Leaf against the checkpoint and plans its loading; mismatches go to
    `problems` (hyperparameters that differ under "check" to `hyper_problems`, listed last). Most
    parameters share a rule, so rule texts are parsed and compared once."""

    def __init__(self, d: Mapping, hyperparameters: str, state_keys: dict):
        self.d, self.hyperparameters, self.state_keys = d, hyperparameters, state_keys
        self.problems, self.hyper_problems = [], []
        self.parsed: dict[str, Any] = {}  # rule text -> spec
        self.compared: dict[tuple, tuple] = {}  # (rule text, id(rule)) -> (kinds, diffs, errors, rule)

    def plan(self, name: str, leaf: Leaf) -> tuple | None:
        """`(rule, frozen, state entries)` the Leaf stored at `name` loads; None: its rule differs."""
        rule = self._rule_checked(name, leaf.rule)
        if rule is None:
            return None
        key = f"{name}/frozen"
        frozen = _flag(self.d[key]) if key in self.d else None
        if frozen is None:
            self.problems.append(f"{key}: " + ("missing" if key not in self.d else "expected True or False"))
        return rule, frozen, self._state_values(name, leaf)

    def _rule_checked(self, name: str, rule):
        """`rule` with the numbers of the checkpoint's if both are of one kind and those numbers
        acceptable (else None: a problem)."""
        rule_key = f"{name}/rule"
        try:
            text = _text(self.d[rule_key], rule_key)
            if text not in self.parsed:
                self.parsed[text] = _parse(ast.parse(text, mode="eval").body)
        except (CheckpointError, SyntaxError, ValueError, RecursionError, MemoryError) as e:
            e = e if str(e) else type(e).__name__  # a crafted text nested too deeply
            self.problems.append(f"{rule_key}: cannot read the rule ({e})")
            return None
        spec = self.parsed[text]
        if (text, id(rule)) not in self.compared:
            found = ([], [], [])
            self.compared[text, id(rule)] = (*found, _compare_rule(spec, rule, type(rule).__name__, found))
        kinds, diffs, errors, restored = self.compared[text, id(rule)]
        if kinds:
            where = [k for k in kinds if k != type(rule).__name__]
            self.problems.append(
                f"{name}: the checkpoint has rule {encode(spec)}, this state has "
                f"{encode(rule)}" + (f" (they differ at {', '.join(where[:3])})" if where else "")
            )
            return None
        if errors and self.hyperparameters == "checkpoint":  # a negative learning rate, say
            why = str(errors[0])[:200] or type(errors[0]).__name__
            self.problems.append(f"{rule_key}: the checkpoint's hyperparameters are not valid ({why})")
            return None
        if diffs and self.hyperparameters == "check":
            for label, theirs_v, ours_v in diffs:
                if _same_in_float32(theirs_v, ours_v):
                    continue  # a value that went through a jitted step comes back as float32
                self.hyper_problems.append(
                    f"{name}: {label} is {theirs_v!r} in the checkpoint, {ours_v!r} in this state"
                )
        return restored

    def _state_values(self, name: str, leaf: Leaf) -> dict:
        """The checkpoint's entries for `leaf`'s state; missing, extra or incompatible: problems."""
        values = {}
        for key, like in _state_items(leaf.state, f"{name}/state", []):
            if key not in self.d:
                self.problems.append(f"{key}: missing from the checkpoint (this state has {describe(like)})")
                continue
            why = _incompatible(self.d[key], _unheld(like))
            if why:
                self.problems.append(f"{key}: {why}")
            values[key] = self.d[key]
        for key in self.state_keys.get(name, ()):  # (each in `d`: in `values` when expected)
            if key not in values:
                self.problems.append(
                    f"{key}: in the checkpoint, but the state of {type(leaf.rule).__name__} "
                    f"here has no such entry ({describe(leaf.state)})"
                )
        return values


def _build(state, tree, leaf_at: dict, plans: dict, hyperparameters: str) -> State:
    """The new State: every check passed, so this only converts."""
    new_leaf: dict[int, Leaf] = {}
    shared: dict[tuple, Any] = {}
    for name, leaf in leaf_at.items():
        restored, frozen, values = plans[name]
        rule = restored if hyperparameters == "checkpoint" else leaf.rule
        convert = lambda key, like, values=values: _convert_shared(values[key], like, shared)  # noqa: E731
        new_state = _map_state(leaf.state, f"{name}/state", convert)
        new_leaf[id(leaf)] = new = leaf._successor(rule, new_state)
        new.frozen, new._owns = frozen, True  # the checkpoint's; its arrays were made just now
    loaded = State(map_leaves(lambda leaf: new_leaf[id(leaf)], tree), getattr(state, "_keys", None))
    # a State laid out for another library (optimisers.optax's TransformState) keeps its layout
    relaid = getattr(state, "_relaid", None)
    return relaid(loaded) if relaid is not None else loaded


__all__ = ["CheckpointError", "load_state_dict", "state_dict"]
