"""The rows of the bench: `optimisers` on NumPy, PyTorch and JAX, and its peers (a naive NumPy loop,
torch.optim with foreach off, on and fused, optax under `jit` with and without donation).

Peers that have no notion of tied weights get the tied parameter once with its gradients already
summed, which is what autograd / `jax.grad` would hand them; `optimisers` gets the tied model and
one gradient per place.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import optimisers as opt

from .models import BETAS, EPS, LR_ADAM, LR_MOMENTUM, RHO, WEIGHT_DECAY, Data, Shape, get


@dataclass
class Runner:
    step: Callable[[], None]
    fetch: Callable[[], tuple]  # -> (distinct parameters as NumPy float32, tie status or None)
    setup_s: float | None = None
    compile_s: float | None = None


@dataclass
class Impl:
    backend: str  # numpy, torch, jax: which array type the row works on
    name: str
    make: Callable[[Data, str], Runner]
    ours: bool = False
    jit_key: str | None = None  # rows sharing a key share the compile-time limit
    tracemalloc: bool = False  # NumPy rows: memory by tracemalloc (RSS as a cross-check)


def optimisers_rule(rule: str) -> opt.Rule:
    if rule == "adam":
        return opt.Adam(eta=LR_ADAM, beta=BETAS, epsilon=EPS)
    if rule == "adamw":
        return opt.AdamW(eta=LR_ADAM, beta=BETAS, lambd=WEIGHT_DECAY, epsilon=EPS)
    return opt.Momentum(eta=LR_MOMENTUM, rho=RHO)


def _tie_status(model, shape: Shape, same) -> str | None:
    if not shape.ties:
        return None
    for path, i in shape.ties.items():
        if not same(get(model, path), get(model, shape.paths[i])):
            return "TIES BROKEN"
    return "tied"


# --- optimisers ----------------------------------------------------------------------------------


def _optimisers_in_place(model, grads, rule: str, to_numpy, shape) -> Runner:
    """`optimisers.update_` on a ready model and gradient tree (NumPy or PyTorch)."""
    r = optimisers_rule(rule)
    t0 = time.perf_counter()
    state = opt.setup(r, model)
    setup_s = time.perf_counter() - t0
    box = [state, model]

    def step():
        box[0], box[1] = opt.update_(box[0], box[1], grads)

    def fetch():
        m = box[1]
        return [to_numpy(get(m, p)) for p in shape.paths], _tie_status(m, shape, lambda a, b: a is b)

    return Runner(step, fetch, setup_s=setup_s)


def _optimisers_numpy(data: Data, rule: str) -> Runner:
    model = data.model(np.copy)
    grads = data.grad_tree(lambda g: g)  # gradients are never written to
    return _optimisers_in_place(model, grads, rule, lambda x: x, data.shape)


def _optimisers_torch(data: Data, rule: str) -> Runner:
    import torch

    model = data.model(lambda a: torch.nn.Parameter(torch.tensor(a)))
    grads = data.grad_tree(torch.tensor)
    return _optimisers_in_place(model, grads, rule, lambda x: x.detach().numpy(), data.shape)


def _optimisers_jax(data: Data, rule: str) -> Runner:
    import jax
    import jax.numpy as jnp

    model = data.model(jnp.array)
    t0 = time.perf_counter()
    state = opt.setup(optimisers_rule(rule), model)
    setup_s = time.perf_counter() - t0
    model = opt.distinct_buffers(model)  # JAX refuses to donate one buffer twice
    grads = data.grad_tree(jnp.array)
    jax.block_until_ready((model, grads))
    t0 = time.perf_counter()
    compiled = jax.jit(opt.update, donate_argnums=(0, 1)).lower(state, model, grads).compile()
    compile_s = time.perf_counter() - t0
    box = [state, model]

    def step():
        out = compiled(box[0], box[1], grads)
        jax.block_until_ready(out)
        box[0], box[1] = out

    def fetch():
        m = box[1]
        xs = [np.asarray(get(m, p)) for p in data.shape.paths]
        return xs, _tie_status(m, data.shape, lambda a, b: bool(np.array_equal(a, b)))

    return Runner(step, fetch, setup_s=setup_s, compile_s=compile_s)


# --- peers ---------------------------------------------------------------------------------------


def _naive_step(rule, xs, gs, ms, vs, t):
    """One step written directly, array by array, as a NumPy user would (in place where easy)."""
    f = np.float32
    if rule == "momentum":
        rho, lr = f(RHO), f(LR_MOMENTUM)
        for x, g, v in zip(xs, gs, ms):
            v *= rho
            v += lr * g
            x -= v
        return
    b1, b2, eps, lr = f(BETAS[0]), f(BETAS[1]), f(EPS), f(LR_ADAM)
    c1, c2 = f(1 - BETAS[0] ** t), f(1 - BETAS[1] ** t)
    decay = f(1 - LR_ADAM * WEIGHT_DECAY)
    for x, g, m, v in zip(xs, gs, ms, vs):
        m *= b1
        m += (1 - b1) * g
        v *= b2
        v += (1 - b2) * (g * g)
        step = (lr / c1) * m / (np.sqrt(v / c2) + eps)
        if rule == "adamw":
            x *= decay
        x -= step


def _naive_numpy(data: Data, rule: str) -> Runner:
    xs = [p.copy() for p in data.params]
    ms = [np.zeros_like(p) for p in data.params]
    vs = [np.zeros_like(p) for p in data.params] if rule != "momentum" else None
    gs = data.grads_sum
    t = [0]

    def step():
        t[0] += 1
        _naive_step(rule, xs, gs, ms, vs, t[0])

    return Runner(step, lambda: (xs, None))


def _torch_optim(kind: str):
    def make(data: Data, rule: str) -> Runner:
        import torch

        params = [torch.nn.Parameter(torch.tensor(a)) for a in data.params]
        for p, g in zip(params, data.grads_sum):
            p.grad = torch.tensor(g)
        flags = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[kind]
        if rule == "momentum":
            o = torch.optim.SGD(params, lr=LR_MOMENTUM, momentum=RHO, **flags)
        elif rule == "adamw":
            o = torch.optim.AdamW(params, lr=LR_ADAM, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                  **flags)
        else:
            o = torch.optim.Adam(params, lr=LR_ADAM, betas=BETAS, eps=EPS, **flags)
        return Runner(o.step, lambda: ([p.detach().numpy() for p in params], None))

    return make


def _optax_transform(rule: str):
    import optax

    if rule == "momentum":
        return optax.sgd(LR_MOMENTUM, momentum=RHO)
    if rule == "adamw":
        return optax.adamw(LR_ADAM, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)
    return optax.adam(LR_ADAM, b1=BETAS[0], b2=BETAS[1], eps=EPS)


def _optax(donate: bool):
    def make(data: Data, rule: str) -> Runner:
        import jax
        import jax.numpy as jnp
        import optax

        tx = _optax_transform(rule)
        params = data.distinct_tree([jnp.array(a) for a in data.params])
        grads = data.distinct_tree([jnp.array(g) for g in data.grads_sum])
        state = tx.init(params)

        def update(p, s, g):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        jax.block_until_ready((params, state, grads))
        t0 = time.perf_counter()
        jitted = jax.jit(update, donate_argnums=(0, 1) if donate else ())
        compiled = jitted.lower(params, state, grads).compile()
        compile_s = time.perf_counter() - t0
        box = [params, state]

        def step():
            out = compiled(box[0], box[1], grads)
            jax.block_until_ready(out)
            box[0], box[1] = out

        def fetch():
            return [np.asarray(get(box[0], p)) for p in data.shape.paths], None

        return Runner(step, fetch, compile_s=compile_s)

    return make


IMPLS = [
    Impl("numpy", "optimisers update_", _optimisers_numpy, ours=True, tracemalloc=True),
    Impl("numpy", "naive NumPy loop", _naive_numpy, tracemalloc=True),
    Impl("torch", "optimisers update_", _optimisers_torch, ours=True),
    Impl("torch", "torch.optim foreach=False", _torch_optim("loop")),
    Impl("torch", "torch.optim foreach=True", _torch_optim("foreach")),
    Impl("torch", "torch.optim fused", _torch_optim("fused")),
    Impl("jax", "optimisers jit+donate", _optimisers_jax, ours=True, jit_key="optimisers"),
    Impl("jax", "optax jit+donate", _optax(True), jit_key="optax"),
    Impl("jax", "optax jit", _optax(False), jit_key="optax"),
]

#: The peer each backend's rows are compared with: the fastest of the established libraries.
BEST_PEER = {
    "numpy": ("torch", "torch.optim fused"),
    "torch": ("torch", "torch.optim fused"),
    "jax": ("jax", "optax jit+donate"),
}
#: The peer a backend's rows fall back on when the best one did not run.
FALLBACK_PEER = {"numpy": ("numpy", "naive NumPy loop")}
