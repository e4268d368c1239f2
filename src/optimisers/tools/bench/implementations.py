"""The rows of the bench: `optimisers` on NumPy, PyTorch and JAX, and its peers (a naive NumPy loop,
torch.optim with foreach off, on and fused, optax under `jit` with and without donation). Each row
builds its rule from the rule's entry in `rules.RULES`; a peer the entry lacks is absent, and
`Impl.absent` says why.

Peers that have no notion of tied weights get the tied parameter once with its gradients already
summed, which is what autograd / `jax.grad` would hand them; `optimisers` gets the tied model and
one gradient per place, except the row "optimisers update_, opt.grads", which is stepped as a
PyTorch user steps a module: new `.grad` tensors before every step (the summed gradient of a tied
parameter, as autograd leaves it), and `optimisers.grads(module)` (one gradient per tensor, None
at the later places of a tied one) handed to `update_`.

On the shapes marked `module` (S3-nested), the PyTorch rows of `optimisers` step an `nn.Module`
(`models.as_module`) with the gradient tree `optimisers.grads` makes of it; the peers step the
same tensors as they step any other shape.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import optimisers as opt

from . import peers
from .models import Data, Shape, as_module, get, nest
from .rules import RULES, BenchRule


@dataclass
class Runner:
    step: Callable[[], None]
    fetch: Callable[[], tuple]  # -> (distinct parameters as NumPy float32, tie status or None)
    setup_s: float | None = None
    compile_s: float | None = None
    note: str | None = None  # shown beside the row: a torch peer from another package
    # untimed work before each step that belongs to the training loop, not to the optimiser (new
    # `.grad` tensors, as `zero_grad()` then `backward()` make them)
    prepare: Callable[[], None] | None = None
    state_bytes: Callable[[], int] | None = None  # bytes of the optimiser's state arrays now


@dataclass
class Impl:
    backend: str  # numpy, torch, jax: which array type the row works on
    name: str
    make: Callable[[Data, str], Runner]
    ours: bool = False
    jit_key: str | None = None  # rows sharing a key share the compile-time limit
    tracemalloc: bool = False  # NumPy rows: memory by tracemalloc (RSS as a cross-check)
    absent: Callable[[BenchRule], str | None] = lambda rule: None  # why this row cannot run a rule
    flat: bool = False  # ours, with the parameters and gradients as views of flat buffers
    # ours, stepped with `optimisers.grads(module)` and new gradient tensors every step: a variant
    # reported on its own lines (S2-tied / S2), not against the peers
    module_grads: bool = False
    # False: what the step gets does not depend on the tree (a drop-in takes a list of parameters,
    # JAX's flat vector is one array)
    sees_nesting: bool = True
    # torch.optim's and optax's rows: for a low-precision entry they run its float32 anchor
    runs_anchor: bool = False
    # its first step compiles (torchao's torch.compile): that step's extra time is its compile time
    first_step_compiles: bool = False


def optimisers_rule(rule: str) -> opt.Rule:
    return RULES[rule].ours()


def _tie_status(model, shape: Shape, same) -> str | None:
    if not shape.ties:
        return None
    for path, i in shape.ties.items():
        if not same(get(model, path), get(model, shape.paths[i])):
            return "TIES BROKEN"
    return "tied"


def nbytes(value) -> int:
    """Bytes of an array of any backend, 0 for a number or a 0-d array (a step counter); a
    torchao low-bit tensor (a tensor subclass that reports float32) counts its codes and scales."""
    if hasattr(value, "codes") and hasattr(value, "scale"):
        return nbytes(value.codes) + nbytes(value.scale)
    if getattr(value, "ndim", 0) == 0:
        return 0
    if hasattr(value, "element_size"):
        return value.numel() * value.element_size()
    return int(value.nbytes)


def _ours_state_bytes(state) -> int:
    """Bytes of the arrays of an `optimisers` State (a Quantised counts its codes and scales)."""
    return sum(nbytes(v) for v in opt.state_dict(state).values())


def _torch_state_bytes(optimizer) -> int:
    """Bytes of a torch optimiser's `state[p]` tensors, less bitsandbytes' maps (`qmapK`: one
    table shared by every parameter)."""
    held = getattr(optimizer, "optimizer", optimizer)  # (the bench's wrappers hold the optimiser)
    return sum(nbytes(v) for per_param in held.state.values() for k, v in per_param.items()
               if not str(k).startswith("qmap"))


# --- optimisers ----------------------------------------------------------------------------------


def _setup(rule, model, times=3):
    """`opt.setup(rule, model)` and the median of `times` timings of it (one can catch a full
    garbage collection, whose cost is the whole process's heap, not this setup's)."""
    took = []
    for _ in range(times):
        state = None  # (the last State is let go first: at most one held while timing)
        t0 = time.perf_counter()
        state = opt.setup(rule, model)
        took.append(time.perf_counter() - t0)
    return state, statistics.median(took)


def _optimisers_in_place(model, grads, rule: str, to_numpy, shape) -> Runner:
    """`optimisers.update_` on a ready model and gradient tree (NumPy or PyTorch)."""
    state, setup_s = _setup(optimisers_rule(rule), model)
    box = [state, model]

    def step():
        box[0], box[1] = opt.update_(box[0], box[1], grads)

    def fetch():
        m = box[1]
        return [to_numpy(get(m, p)) for p in shape.paths], _tie_status(m, shape, lambda a, b: a is b)

    return Runner(step, fetch, setup_s=setup_s, state_bytes=lambda: _ours_state_bytes(box[0]))


def _optimisers_numpy(data: Data, rule: str) -> Runner:
    model = data.model(np.copy)
    grads = data.grad_tree(lambda g: g)  # gradients are never written to
    return _optimisers_in_place(model, grads, rule, lambda x: x, data.shape)


def _torch_params(data: Data) -> list:
    import torch

    return [torch.nn.Parameter(torch.tensor(a)) for a in data.params]


def _torch_model(data: Data, params: list):
    """The model of `params`: the nested tree, or on a `module` shape the nn.Module of it."""
    tree = data.tree(params)
    return as_module(tree) if data.shape.module else tree


def _optimisers_torch(data: Data, rule: str) -> Runner:
    import torch

    params = _torch_params(data)
    model = _torch_model(data, params)
    if data.shape.module:  # gradients as a module user hands them: `optimisers.grads(module)`
        for p, g in zip(params, data.grads_sum):
            p.grad = torch.tensor(g)
        grads = opt.grads(model)
    else:
        grads = data.grad_tree(torch.tensor)
    return _optimisers_in_place(model, grads, rule, lambda x: x.detach().numpy(), data.shape)


def _optimisers_torch_module_grads(data: Data, rule: str) -> Runner:
    """The model as an `nn.Module` (a tied place registers the one Parameter again), stepped as a
    training loop steps it: before each step (untimed) every parameter gets a new `.grad` tensor,
    as `zero_grad()` then `backward()` make them (a tied parameter's holds the sum over its
    places, as autograd's does); the step is `update_(state, module, optimisers.grads(module))`,
    `grads` included (one gradient per tensor, None at the later places of a tied one)."""
    import torch

    params = _torch_params(data)
    model = as_module(data.tree(params))
    values = [torch.from_numpy(g) for g in data.grads_sum]
    state, setup_s = _setup(optimisers_rule(rule), model)
    box = [state, model]

    def prepare():
        for p, g in zip(params, values):
            p.grad = g.clone()  # a new tensor with new memory, as backward makes after zero_grad()

    def step():
        box[0], box[1] = opt.update_(box[0], box[1], opt.grads(box[1]))

    def fetch():
        m = box[1]
        return [p.detach().numpy() for p in params], _tie_status(m, data.shape, lambda a, b: a is b)

    return Runner(step, fetch, setup_s=setup_s, prepare=prepare,
                  state_bytes=lambda: _ours_state_bytes(box[0]))


def views_of_one_buffer(values, make):
    """Each of `values` (NumPy arrays) copied into one new flat buffer `make(total)`, back to
    back; the views, in order."""
    base = make(sum(v.size for v in values))
    out, at = [], 0
    for v in values:
        view = base[at : at + v.size].reshape(v.shape)
        view[...] = v
        out.append(view)
        at += v.size
    return out


def _optimisers_numpy_flat(data: Data, rule: str) -> Runner:
    """NumPy arrays that are views of one flat buffer, and gradients views of another: the engine
    steps the buffers as one array (a tied place's extra gradient is its own array)."""
    params = views_of_one_buffer(data.params, lambda n: np.empty(n, np.float32))
    grads = views_of_one_buffer(data.grads, lambda n: np.empty(n, np.float32))
    model = nest([*zip(data.shape.paths, params), *((p, params[i]) for p, i in data.shape.ties.items())])
    grad_tree = nest([*zip(data.shape.paths, grads), *data.tie_grads.items()])
    return _optimisers_in_place(model, grad_tree, rule, lambda x: x, data.shape)


def _optimisers_torch_flat(data: Data, rule: str) -> Runner:
    """`optimisers.torch.flatten_` on the parameters: their data and `.grad` views of flat buffers
    (on a `module` shape, the gradients handed over are `optimisers.grads(module)`: those views)."""
    import torch

    from optimisers.torch import flatten_

    params = _torch_params(data)
    model = _torch_model(data, params)
    flatten_(params)
    if data.shape.module:
        for p, g in zip(params, data.grads_sum):
            p.grad.copy_(torch.from_numpy(g))
        grads = opt.grads(model)
    else:
        for p, g in zip(params, data.grads):
            p.grad.copy_(torch.from_numpy(g))
        tie_grads = [(path, torch.tensor(g)) for path, g in data.tie_grads.items()]
        grads = nest([*((path, p.grad) for path, p in zip(data.shape.paths, params)), *tie_grads])
    return _optimisers_in_place(model, grads, rule, lambda x: x.detach().numpy(), data.shape)


def _optimisers_torch_drop_in(data: Data, rule: str) -> Runner:
    """The drop-in class of torch.optim's name and signature (`optimisers.torch.Adam` & co.) after
    `flatten_`: it reads each parameter's `.grad`, a view of a flat buffer, as backward leaves it
    (a tied parameter once, with its gradients summed, as autograd sums them)."""
    import torch

    from optimisers.torch import flatten_

    params = _torch_params(data)
    model = _torch_model(data, params)
    flatten_(params)
    for p, g in zip(params, data.grads_sum):
        p.grad.copy_(torch.from_numpy(g))
    ours, entry = optimisers_rule(rule), RULES[rule]
    if entry.drop_in is not None:
        o = entry.drop_in(torch, params)
    else:
        o = peers.TORCH[type(ours)].drop_in(ours, params)

    def fetch():
        return [p.detach().numpy() for p in params], _tie_status(model, data.shape, lambda a, b: a is b)

    return Runner(o.step, fetch, state_bytes=lambda: _torch_state_bytes(o))


def _no_drop_in(rule: BenchRule) -> str | None:
    # (optimisers.torch has a drop-in class for each torch.optim class of `peers.TORCH`, and the
    # low-bit entries name theirs)
    if rule.drop_in is None and peers.TORCH.get(type(rule.ours())) is None:
        return f"torch.optim has no class for {rule.title}, so optimisers.torch no drop-in"
    return None


def _compiled(update, carry: tuple, grads, donate: bool):
    """`update(a, b, grads) -> (a, b)` compiled under `jax.jit` (donating `a` and `b` when
    `donate`): `box`, which holds `[a, b]`, a step that carries them, and the compile time."""
    import jax

    jax.block_until_ready((carry, grads))
    t0 = time.perf_counter()
    compiled = jax.jit(update, donate_argnums=(0, 1) if donate else ()).lower(*carry, grads).compile()
    compile_s = time.perf_counter() - t0
    box = list(carry)

    def step():
        out = compiled(box[0], box[1], grads)
        jax.block_until_ready(out)
        box[0], box[1] = out

    return box, step, compile_s


def _jitted(data: Data, rule: str, model, grads, setup_model, as_model) -> Runner:
    """`optimisers.update` under `jax.jit` with donation, stepping `model` (its state set up from
    `setup_model`) with `grads`; `as_model(trained)` is the model tree the check reads."""
    state, setup_s = _setup(optimisers_rule(rule), setup_model)
    box, step, compile_s = _compiled(opt.update, (state, model), grads, donate=True)

    def fetch():
        m = as_model(box[1])
        xs = [np.asarray(get(m, p)) for p in data.shape.paths]
        return xs, _tie_status(m, data.shape, lambda a, b: bool(np.array_equal(a, b)))

    return Runner(step, fetch, setup_s=setup_s, compile_s=compile_s,
                  state_bytes=lambda: _ours_state_bytes(box[0]))


def _optimisers_jax(data: Data, rule: str) -> Runner:
    import jax.numpy as jnp

    model = data.model(jnp.array)
    donated = opt.distinct_buffers(model)  # JAX refuses to donate one buffer twice
    return _jitted(data, rule, donated, data.grad_tree(jnp.array), model, lambda m: m)


def _optimisers_jax_flat(data: Data, rule: str) -> Runner:
    """The model kept as one flat vector (`destructure`'s), which the model views through
    `rebuild`: the jitted step updates one array however many the model has. Its gradient is
    what `jax.grad` through `rebuild` gives: each distinct parameter's gradient, summed over a
    tie's places, in `destructure`'s order (that of the distinct parameters)."""
    import jax.numpy as jnp

    flat, rebuild = opt.destructure(data.model(jnp.array))
    grad, _ = opt.destructure(data.distinct_tree([jnp.array(g) for g in data.grads_sum]))
    return _jitted(data, rule, flat, grad, flat, rebuild)


def _not_elementwise(rule: BenchRule) -> str | None:
    """Why a rule cannot step the model as one flat vector: one whose maths looks at a whole
    array (a norm, a matrix) would see the whole model instead."""
    if getattr(rule.ours(), "elementwise", False):
        return None
    return f"{rule.title} is not elementwise: on one flat vector it would see the whole model"


# --- peers ---------------------------------------------------------------------------------------


def _naive_numpy(data: Data, rule: str) -> Runner:
    xs = [p.copy() for p in data.params]
    step_at = RULES[rule].naive(xs)
    gs = data.grads_sum
    t = [0]

    def step():
        t[0] += 1
        step_at(gs, t[0])

    return Runner(step, lambda: (xs, None))


def _no_naive(rule: BenchRule) -> str | None:
    return None if rule.naive is not None else f"no naive NumPy formula for {rule.title}"


def _torch_optim(kind: str):
    def make(data: Data, rule: str) -> Runner:
        import torch

        peer = RULES[rule].torch
        params = [torch.nn.Parameter(torch.tensor(a)) for a in data.params]
        for p, g in zip(params, data.grads_sum):
            p.grad = torch.tensor(g)
        o = peer.make(torch, params, **peer.variants[kind])
        note = None if peer.name.startswith("torch.optim.") else peer.name
        # an optimiser that writes into `.grad` gets it back before each step, untimed
        return Runner(o.step, lambda: ([p.detach().numpy() for p in params], None), note=note,
                      prepare=getattr(o, "prepare", None), state_bytes=lambda: _torch_state_bytes(o))

    return make


def _no_torch(kind: str):
    def absent(rule: BenchRule) -> str | None:
        if rule.torch is None:
            return f"torch.optim has no {rule.title}"
        if kind not in rule.torch.variants:
            return f"{rule.torch.name} has no {kind} variant"
        return None

    return absent


def _optax(donate: bool):
    def make(data: Data, rule: str) -> Runner:
        import jax.numpy as jnp
        import optax

        peer = RULES[rule].optax
        tx = peer.make(optax)
        params = peer.wrap(data.distinct_tree([jnp.array(a) for a in data.params]))
        grads = data.distinct_tree([jnp.array(g) for g in data.grads_sum])

        def update(p, s, g):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        box, step, compile_s = _compiled(update, (params, tx.init(params)), grads, donate)

        def fetch():
            model = peer.unwrap(box[0])
            return [np.asarray(get(model, p)) for p in data.shape.paths], None

        def state_bytes():
            import jax

            return sum(nbytes(leaf) for leaf in jax.tree.leaves(box[1]))

        note = "float32 optax.adamw" if RULES[rule].anchor else None  # (the anchor of a low-bit rule)
        return Runner(step, fetch, compile_s=compile_s, note=note, state_bytes=state_bytes)

    return make


def _no_optax(rule: BenchRule) -> str | None:
    return None if rule.optax is not None else f"optax has no {rule.title}"


def _other_package(package: str):
    """The row of an entry's torch peer from `package` (bitsandbytes, torchao), stepped as the
    torch.optim rows are."""

    def make(data: Data, rule: str) -> Runner:
        import torch

        peer = RULES[rule].others[package]
        params = [torch.nn.Parameter(torch.tensor(a)) for a in data.params]
        for p, g in zip(params, data.grads_sum):
            p.grad = torch.tensor(g)
        o = peer.make(torch, params)
        return Runner(o.step, lambda: ([p.detach().numpy() for p in params], None), note=peer.name,
                      state_bytes=lambda: _torch_state_bytes(o))

    return make


def _no_other_package(package: str):
    def absent(rule: BenchRule) -> str | None:
        if package not in rule.others:
            return f"{package} has no {rule.title}"
        if importlib.util.find_spec(package) is None:
            return f"{package} is not installed"
        return None

    return absent


IMPLS = [
    Impl("numpy", "optimisers update_", _optimisers_numpy, ours=True, tracemalloc=True),
    Impl("numpy", "naive NumPy loop", _naive_numpy, tracemalloc=True, absent=_no_naive),
    Impl("numpy", "optimisers update_, flat views", _optimisers_numpy_flat, ours=True, tracemalloc=True,
         flat=True),
    Impl("torch", "optimisers update_", _optimisers_torch, ours=True),
    Impl("torch", "optimisers update_, opt.grads", _optimisers_torch_module_grads, ours=True,
         module_grads=True),
    Impl("torch", "optimisers update_, flatten_", _optimisers_torch_flat, ours=True, flat=True),
    Impl("torch", "optimisers drop-in, flatten_", _optimisers_torch_drop_in, ours=True, flat=True,
         absent=_no_drop_in, sees_nesting=False),
    Impl("torch", "torch.optim foreach=False", _torch_optim("loop"), absent=_no_torch("loop"),
         runs_anchor=True),
    Impl("torch", "torch.optim foreach=True", _torch_optim("foreach"), absent=_no_torch("foreach"),
         runs_anchor=True),
    Impl("torch", "torch.optim fused", _torch_optim("fused"), absent=_no_torch("fused"), runs_anchor=True),
    Impl("torch", "bitsandbytes", _other_package("bitsandbytes"), absent=_no_other_package("bitsandbytes")),
    # torchao's step is torch.compile'd: its first step compiles (the `compile` column)
    Impl("torch", "torchao", _other_package("torchao"), absent=_no_other_package("torchao"),
         first_step_compiles=True),
    Impl("jax", "optimisers jit+donate", _optimisers_jax, ours=True, jit_key="optimisers"),
    Impl("jax", "optimisers jit+donate, flat vector", _optimisers_jax_flat, ours=True,
         jit_key="optimisers-flat", flat=True, absent=_not_elementwise, sees_nesting=False),
    Impl("jax", "optax jit+donate", _optax(True), jit_key="optax", absent=_no_optax, runs_anchor=True),
    Impl("jax", "optax jit", _optax(False), jit_key="optax", absent=_no_optax, runs_anchor=True),
]

#: The peer each backend's rows are compared with: the fastest of the established libraries.
BEST_PEER = {
    "numpy": ("torch", "torch.optim fused"),
    "torch": ("torch", "torch.optim fused"),
    "jax": ("jax", "optax jit+donate"),
}
#: The peer a backend's rows fall back on when the best one did not run.
FALLBACK_PEER = {"numpy": ("numpy", "naive NumPy loop")}
