"""Benchmark: one optimiser step of `optimisers.update_` against torch.optim, optax and a naive NumPy
loop, with the memory-bandwidth floor measured on the same machine in the same run.

    python benchmarks/run.py                 # full run, under 5 minutes on 2 cores
    python benchmarks/run.py --quick         # smaller S1/S2/S3, fewer repeats: well under a minute
    python benchmarks/run.py --json out.json --backends numpy,torch --shapes S1,S3 --rules adam

What is measured (see benchmarks/README.md for every column):

- the bandwidth floor: a NumPy copy and triad over arrays much larger than the last-level cache,
  split into one contiguous chunk per core and run on threads (NumPy ufuncs release the GIL);
- for each shape (S1 one big tensor, S2 a GPT-like tree of 148 tensors, S2-tied the same with the
  token embedding tied to the LM head, S3 4000 tensors of 256) and rule (Adam, AdamW, Momentum):
  the time of one step of every implementation, after checking that every implementation gives the
  same parameters as a float64 reference after a few steps;
- the ratios the targets judge, again with the two runners stepped in alternation (S2-tied
  against S2, and for Adam `optimisers` against its peer on S1 and S2), since rows timed a minute
  apart on a shared machine differ by more than those few percent.

Every implementation gets the same float32 initial parameters and gradients. Peers that have no notion
of tied weights (torch.optim, optax, the naive loop) get the tied parameter once with its gradients
already summed, which is what autograd / `jax.grad` would hand them; `optimisers` gets the tied model
and one gradient per place.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import gc
import io
import json
import os
import platform
import pstats
import statistics
import sys
import time
import traceback
import tracemalloc
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# --- the cost model ----------------------------------------------------------------------------

#: Bytes of DRAM traffic per float32 parameter for one step, counted as STREAM does (each array read
#: or written once; write-allocate traffic not counted). The floor of a step is this times the number
#: of distinct parameters divided by the measured triad bandwidth.
BYTES_PER_PARAM = {"adam": 28, "adamw": 28, "momentum": 20}
BYTES_MODEL = {
    "adam": "read x, g, m, v; write x, m, v: 7 arrays x 4 bytes = 28",
    "adamw": "as Adam (the decay reads x, which Adam already reads): 28",
    "momentum": "read x, g, v; write x, v: 5 arrays x 4 bytes = 20",
}

# Hyperparameters shared by every implementation (torch's and optax's names in comments).
LR_ADAM = 1e-3
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.01  # AdamW: optimisers `lambd`, torch `weight_decay`, optax `weight_decay`
LR_MOMENTUM = 1e-2
RHO = 0.9  # torch/optax `momentum`

CHECK_STEPS = 3  # steps run by every implementation before its result is compared
ATOL, RTOL = 1e-7, 1e-6  # float32 tolerance against the float64 reference (steps are ~1e-3)

ALL_BACKENDS = ("numpy", "torch", "jax")
ALL_SHAPES = ("S1", "S2", "S2-tied", "S3")
ALL_RULES = ("adam", "adamw", "momentum")


# --- shapes ------------------------------------------------------------------------------------


@dataclass
class Shape:
    name: str
    paths: list  # one path per distinct parameter, depth first
    shapes: list
    ties: dict = field(default_factory=dict)  # extra place -> index of the parameter it repeats
    layout: str = ""

    @property
    def n_params(self) -> int:
        return int(sum(int(np.prod(s)) for s in self.shapes))

    @property
    def n_tensors(self) -> int:
        return len(self.shapes)

    @property
    def n_places(self) -> int:
        return len(self.shapes) + len(self.ties)


def _gpt_paths(d, layers, vocab, ctx):
    """GPT-2's parameter layout (Conv1D weights stored (in, out)): 12 tensors per block."""
    items = [(("wte",), (vocab, d)), (("wpe",), (ctx, d))]
    for i in range(layers):
        h = ("h", i)
        items += [
            (h + ("ln_1", "weight"), (d,)),
            (h + ("ln_1", "bias"), (d,)),
            (h + ("attn", "c_attn", "weight"), (d, 3 * d)),
            (h + ("attn", "c_attn", "bias"), (3 * d,)),
            (h + ("attn", "c_proj", "weight"), (d, d)),
            (h + ("attn", "c_proj", "bias"), (d,)),
            (h + ("ln_2", "weight"), (d,)),
            (h + ("ln_2", "bias"), (d,)),
            (h + ("mlp", "c_fc", "weight"), (d, 4 * d)),
            (h + ("mlp", "c_fc", "bias"), (4 * d,)),
            (h + ("mlp", "c_proj", "weight"), (4 * d, d)),
            (h + ("mlp", "c_proj", "bias"), (d,)),
        ]
    items += [(("ln_f", "weight"), (d,)), (("ln_f", "bias"), (d,))]
    return [p for p, _ in items], [s for _, s in items]


def make_shapes(quick: bool) -> dict[str, Shape]:
    # --quick shrinks every shape; XLA's compile time grows about quadratically with the leaf count,
    # so it also has fewer tensors (the full S3 costs optax ~45 s per compile)
    side = 2048 if quick else 4096
    d, layers = (128, 4) if quick else (320, 12)
    n_small = 100 if quick else 4000
    gpt = dict(d=d, layers=layers, vocab=4096, ctx=256)
    gpt_text = (
        f"GPT-2 layout, d_model={d}, {layers} blocks x 12 tensors (ln_1, attn.c_attn, attn.c_proj, "
        f"ln_2, mlp.c_fc, mlp.c_proj; weight+bias each), wte {gpt['vocab']}x{d}, wpe {gpt['ctx']}x{d}, "
        "ln_f"
    )
    paths, shapes = _gpt_paths(**gpt)
    return {
        "S1": Shape("S1", [("weight",)], [(side, side)], layout=f"one {side}x{side} matrix"),
        "S2": Shape("S2", paths, shapes, layout=gpt_text),
        "S2-tied": Shape(
            "S2-tied", paths, shapes, {("lm_head",): 0}, layout="S2 + lm_head, the same array as wte"
        ),
        "S3": Shape("S3", [(i,) for i in range(n_small)], [(256,)] * n_small,
                    layout=f"a list of {n_small} vectors of 256"),
    }


def _nest(items):
    """A nested container from (path, value) pairs; a level whose keys are 0..n-1 becomes a list."""
    root: dict = {}
    for path, value in items:
        node = root
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = value
    return _listify(root)


def _listify(node):
    if isinstance(node, dict):
        node = {k: _listify(v) for k, v in node.items()}
        if node and all(isinstance(k, int) for k in node):
            return [node[i] for i in range(len(node))]
    return node


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


@dataclass
class Data:
    """The float32 parameters and gradients every implementation starts from."""

    shape: Shape
    params: list
    grads: list  # the gradient at each distinct parameter's first place
    tie_grads: dict  # extra place -> its own gradient contribution
    grads_sum: list  # per distinct parameter, summed over its places (what autograd gives peers)

    def model(self, convert):
        """The model tree (tied places hold the one converted object)."""
        values = [convert(p) for p in self.params]
        items = list(zip(self.shape.paths, values))
        items += [(path, values[i]) for path, i in self.shape.ties.items()]
        return _nest(items)

    def grad_tree(self, convert):
        items = [(p, convert(g)) for p, g in zip(self.shape.paths, self.grads)]
        items += [(path, convert(g)) for path, g in self.tie_grads.items()]
        return _nest(items)

    def distinct_tree(self, values):
        return _nest(list(zip(self.shape.paths, values)))


def make_data(shape: Shape, seed: int = 0) -> Data:
    rng = np.random.default_rng(seed)
    params = [(rng.standard_normal(s, dtype=np.float32) * np.float32(0.02)) for s in shape.shapes]
    grads = [(rng.standard_normal(s, dtype=np.float32) * np.float32(0.01)) for s in shape.shapes]
    tie_grads = {
        path: rng.standard_normal(shape.shapes[i], dtype=np.float32) * np.float32(0.01)
        for path, i in shape.ties.items()
    }
    grads_sum = list(grads)
    for path, i in shape.ties.items():
        grads_sum[i] = grads_sum[i] + tie_grads[path]
    return Data(shape, params, grads, tie_grads, grads_sum)


# --- the float64 reference and the naive NumPy loop --------------------------------------------


def reference(rule: str, data: Data, steps: int = CHECK_STEPS) -> list:
    """Every parameter after `steps` steps with the same gradients, in float64."""
    out = []
    for p, g in zip(data.params, data.grads_sum):
        x, g = p.astype(np.float64), g.astype(np.float64)
        m = np.zeros_like(x)
        v = np.zeros_like(x)
        for t in range(1, steps + 1):
            if rule == "momentum":
                m = RHO * m + LR_MOMENTUM * g
                x = x - m
                continue
            m = BETAS[0] * m + (1 - BETAS[0]) * g
            v = BETAS[1] * v + (1 - BETAS[1]) * g * g
            a = (m / (1 - BETAS[0] ** t)) / (np.sqrt(v / (1 - BETAS[1] ** t)) + EPS)
            x = x - LR_ADAM * (a + (WEIGHT_DECAY * x if rule == "adamw" else 0.0))
        out.append(x)
    return out


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


# --- memory ------------------------------------------------------------------------------------

try:
    _LIBC = ctypes.CDLL("libc.so.6")
except OSError:  # pragma: no cover - not glibc
    _LIBC = None


def _proc_status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def _can_reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return "VmHWM" in _proc_status()
    except OSError:
        return False


def rss_extra(step) -> int | None:
    """Peak resident memory during `step()` above the resident memory before it: free heap pages
    are handed back first (malloc_trim), the kernel's high-water mark is reset to the current RSS
    (/proc/self/clear_refs, Linux >= 4.0), and VmHWM is read after the step."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    before = _proc_status()["VmRSS"]
    step()
    return max(0, _proc_status()["VmHWM"] - before)


def tracemalloc_extra(make_runner, data) -> int:
    """Peak NumPy (and Python) allocation during one step above what is allocated before it. The
    runner is built with tracing on, so memory freed during the step is credited."""
    gc.collect()
    tracemalloc.start()
    try:
        runner = make_runner(data)
        runner.step()  # a first step may allocate lazily
        gc.collect()
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        runner.step()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return max(0, peak - before)


# --- implementations ---------------------------------------------------------------------------


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


def _opt_rule(rule: str):
    import optimisers as opt

    def cls(name):
        found = getattr(opt, name, None)
        if found is None:
            from optimisers import _rules

            found = getattr(_rules, name, None)
        if found is None:
            raise NotImplementedError(f"optimisers has no {name} yet")
        return found

    if rule == "adam":
        return cls("Adam")(eta=LR_ADAM, beta=BETAS, epsilon=EPS)
    if rule == "adamw":
        return cls("AdamW")(eta=LR_ADAM, beta=BETAS, lambd=WEIGHT_DECAY, epsilon=EPS)
    return cls("Momentum")(eta=LR_MOMENTUM, rho=RHO)


def _tie_status(model, shape: Shape, same) -> str | None:
    if not shape.ties:
        return None
    for path, i in shape.ties.items():
        if not same(_get(model, path), _get(model, shape.paths[i])):
            return "TIES BROKEN"
    return "tied"


def _make_optimisers_inplace(model, grads, rule: str, to_numpy, shape) -> Runner:
    """`optimisers.update_` on a ready model and gradient tree (NumPy or PyTorch)."""
    import optimisers as opt

    r = _opt_rule(rule)
    t0 = time.perf_counter()
    state = opt.setup(r, model)
    setup_s = time.perf_counter() - t0
    box = [state, model]

    def step():
        box[0], box[1] = opt.update_(box[0], box[1], grads)

    def fetch():
        m = box[1]
        return [to_numpy(_get(m, p)) for p in shape.paths], _tie_status(m, shape, lambda a, b: a is b)

    return Runner(step, fetch, setup_s=setup_s)


def _make_optimisers_numpy(data: Data, rule: str) -> Runner:
    model = data.model(np.copy)
    grads = data.grad_tree(lambda g: g)  # gradients are never written to
    return _make_optimisers_inplace(model, grads, rule, lambda x: x, data.shape)


def _make_naive(data: Data, rule: str) -> Runner:
    xs = [p.copy() for p in data.params]
    ms = [np.zeros_like(p) for p in data.params]
    vs = [np.zeros_like(p) for p in data.params] if rule != "momentum" else None
    gs = data.grads_sum
    t = [0]

    def step():
        t[0] += 1
        _naive_step(rule, xs, gs, ms, vs, t[0])

    return Runner(step, lambda: (xs, None))


def _make_optimisers_torch(data: Data, rule: str) -> Runner:
    import torch

    model = data.model(lambda a: torch.nn.Parameter(torch.tensor(a)))
    grads = data.grad_tree(torch.tensor)
    return _make_optimisers_inplace(model, grads, rule, lambda x: x.detach().numpy(), data.shape)


def _torch_optim(kind: str):
    def make(data: Data, rule: str) -> Runner:
        import torch

        params = [torch.nn.Parameter(torch.tensor(a)) for a in data.params]
        for p, g in zip(params, data.grads_sum):
            p.grad = torch.tensor(g)
        flags = {"foreach": False} if kind == "loop" else {"foreach": True} if kind == "foreach" else {
            "fused": True
        }
        if rule == "momentum":
            o = torch.optim.SGD(params, lr=LR_MOMENTUM, momentum=RHO, **flags)
        elif rule == "adamw":
            o = torch.optim.AdamW(params, lr=LR_ADAM, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                  **flags)
        else:
            o = torch.optim.Adam(params, lr=LR_ADAM, betas=BETAS, eps=EPS, **flags)
        return Runner(o.step, lambda: ([p.detach().numpy() for p in params], None))

    return make


def _make_optimisers_jax(data: Data, rule: str) -> Runner:
    import jax
    import jax.numpy as jnp

    import optimisers as opt

    model = data.model(jnp.array)
    r = _opt_rule(rule)
    t0 = time.perf_counter()
    state = opt.setup(r, model)
    setup_s = time.perf_counter() - t0
    distinct = getattr(opt, "distinct_buffers", None)
    if distinct is not None:
        model = distinct(model)
    elif data.shape.ties:  # JAX refuses to donate one buffer twice
        model = data.model(jnp.array)
        for path in data.shape.ties:
            parent = _get(model, path[:-1])
            parent[path[-1]] = jnp.array(parent[path[-1]])
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
        xs = [np.asarray(_get(m, p)) for p in data.shape.paths]
        return xs, _tie_status(m, data.shape, lambda a, b: bool(np.array_equal(a, b)))

    return Runner(step, fetch, setup_s=setup_s, compile_s=compile_s)


def _optax(donate: bool):
    def make(data: Data, rule: str) -> Runner:
        import jax
        import jax.numpy as jnp
        import optax

        if rule == "momentum":
            tx = optax.sgd(LR_MOMENTUM, momentum=RHO)
        elif rule == "adamw":
            tx = optax.adamw(LR_ADAM, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)
        else:
            tx = optax.adam(LR_ADAM, b1=BETAS[0], b2=BETAS[1], eps=EPS)
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
            leaves = [np.asarray(_get(box[0], p)) for p in data.shape.paths]
            return leaves, None

        return Runner(step, fetch, compile_s=compile_s)

    return make


IMPLS = [
    Impl("numpy", "optimisers update_", _make_optimisers_numpy, ours=True, tracemalloc=True),
    Impl("numpy", "naive NumPy loop", _make_naive, tracemalloc=True),
    Impl("torch", "optimisers update_", _make_optimisers_torch, ours=True),
    Impl("torch", "torch.optim foreach=False", _torch_optim("loop")),
    Impl("torch", "torch.optim foreach=True", _torch_optim("foreach")),
    Impl("torch", "torch.optim fused", _torch_optim("fused")),
    Impl("jax", "optimisers jit+donate", _make_optimisers_jax, ours=True, jit_key="optimisers"),
    Impl("jax", "optax jit+donate", _optax(True), jit_key="optax"),
    Impl("jax", "optax jit", _optax(False), jit_key="optax"),
]

#: The peer each backend's rows are compared with (the performance targets).
BEST_PEER = {
    "numpy": ("torch", "torch.optim fused"),
    "torch": ("torch", "torch.optim fused"),
    "jax": ("jax", "optax jit+donate"),
}
FALLBACK_PEER = {"numpy": ("numpy", "naive NumPy loop")}


# --- the bandwidth floor -----------------------------------------------------------------------


_KERNELS = ("copy", "triad", "update")


def measure_bandwidth(mb: int, threads: int, repeats: int, kernels=_KERNELS, one_thread=True) -> dict:
    """Memory bandwidth with NumPy over float32 arrays of `mb` MiB each, one contiguous chunk per
    thread (NumPy ufuncs release the GIL), bytes counted as STREAM counts them:

    - copy `b = a` (8 bytes/element) and triad `a = b + s*c` (12): STREAM's kernels, for reference.
      Their destination is written without being read, so the hardware also reads it first
      (write-allocate), traffic that is not counted: they understate what the memory delivers.
    - update `a += s*b` (12 bytes/element): every array written is read first, as in an optimiser
      step, so the counted bytes are the real traffic. The floor uses this one.

    Two-pass kernels run in blocks of 131072 elements (512 KiB) so that the passes meet in cache."""
    n = max(mb * 2**20 // 4, 1 << 16)
    a = np.ones(n, np.float32)
    b = np.full(n, 2.0, np.float32)
    c = np.full(n, 0.5, np.float32)
    s = np.float32(1e-3)
    block = 131072

    def bounds(k):
        step = -(-n // k)
        step = -(-step // 1024) * 1024
        return [(lo, min(lo + step, n)) for lo in range(0, n, step)]

    def copy_chunk(lo, hi):
        np.copyto(b[lo:hi], a[lo:hi])

    def triad_chunk(lo, hi):
        for i in range(lo, hi, block):
            j = min(i + block, hi)
            np.multiply(c[i:j], s, out=a[i:j])
            np.add(a[i:j], b[i:j], out=a[i:j])

    def update_chunk(lo, hi):
        tmp = np.empty(min(block, hi - lo), np.float32)
        for i in range(lo, hi, block):
            j = min(i + block, hi)
            t = tmp[: j - i]
            np.multiply(c[i:j], s, out=t)
            np.add(a[i:j], t, out=a[i:j])

    table = {"copy": (copy_chunk, 8 * n), "triad": (triad_chunk, 12 * n), "update": (update_chunk, 12 * n)}
    result = {"array_mib": round(n * 4 / 2**20, 1), "threads": threads, "repeats": repeats}
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for k in sorted({1, threads} if one_thread else {threads}):
            chunks = bounds(k)
            for name in kernels:
                fn, nbytes = table[name]
                times = []
                for _ in range(repeats + 1):  # the first pass warms the pages and the threads
                    t0 = time.perf_counter()
                    if k == 1:
                        fn(0, n)
                    else:
                        list(pool.map(lambda lh, fn=fn: fn(*lh), chunks))
                    times.append(time.perf_counter() - t0)
                times = times[1:]
                key = f"{name}_{k}t" if k != threads else name
                result[key + "_gbs_median"] = nbytes / statistics.median(times) / 1e9
                result[key + "_gbs_best"] = nbytes / min(times) / 1e9
    if "update_gbs_best" in result:
        result["floor_gbs"] = result["update_gbs_best"]
    return result


# --- running one row ---------------------------------------------------------------------------


def _compare(got: list, ref: list) -> tuple[bool, float]:
    ok, worst = True, 0.0
    for g, r in zip(got, ref):
        g = np.asarray(g, dtype=np.float64).reshape(r.shape)
        diff = np.abs(g - r)
        if diff.size:
            worst = max(worst, float(diff.max()))
            if not np.all(diff <= ATOL + RTOL * np.abs(r)):
                ok = False
    return ok, worst


def _time(step, repeats: int, warmup: int, quick: bool, est: float) -> list[float]:
    if warmup:
        t0 = time.perf_counter()
        for _ in range(warmup):
            step()
        est = (time.perf_counter() - t0) / warmup
    budget = 0.1 if quick else 0.25
    if est * repeats < budget:  # fast steps: more repeats for a steadier median
        repeats = min(50, max(repeats, int(budget / max(est, 1e-6))))
    elif quick and est > 0.15:  # slow steps in --quick: fewer
        repeats = min(repeats, 3)
    elif est > 0.5:  # slow steps: the minimum of 5
        repeats = min(repeats, 5)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times


def _profile(step, n: int, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.strip_dirs().sort_stats("tottime").print_stats(top)
    text = out.getvalue()
    start = text.find("   ncalls")
    return text[start:] if start >= 0 else text


def run_row(impl: Impl, data: Data, rule: str, ref: list, opts, compile_seen: dict) -> dict:
    shape = data.shape
    row: dict[str, Any] = {
        "backend": impl.backend,
        "impl": impl.name,
        "shape": shape.name,
        "rule": rule,
        "tensors": shape.n_tensors,
        "params": shape.n_params,
    }
    if impl.jit_key is not None:
        prior = compile_seen.get((impl.jit_key, shape.name))
        if prior is not None and prior[1] > opts.compile_limit:
            row["skipped"] = (
                f"{prior[0]} compile on {shape.name} took {prior[1]:.0f} s > --compile-limit "
                f"{opts.compile_limit:g} s"
            )
            return row
    runner = None
    row_started = time.perf_counter(), time.process_time()
    try:
        runner = impl.make(data, rule)
        if runner.compile_s is not None:
            row["compile_s"] = runner.compile_s
            compile_seen[(impl.jit_key, shape.name)] = (f"{impl.name} {rule}", runner.compile_s)
        if runner.setup_s is not None:
            row["setup_ms"] = runner.setup_s * 1e3
        for _ in range(CHECK_STEPS):
            t0 = time.perf_counter()
            runner.step()
            est = time.perf_counter() - t0
        got, ties = runner.fetch()
        ok, worst = _compare(got, ref)
        row["agree"] = ok and ties != "TIES BROKEN"
        row["max_abs_err"] = worst
        if ties is not None:
            row["ties"] = ties
        # the check steps warm up too; slow rows (a second per step) take no more
        warmup = opts.warmup if est < 0.25 else 0
        times = _time(runner.step, opts.repeats, warmup, opts.quick, est)
        row["repeats"] = len(times)
        row["times_ms"] = [t * 1e3 for t in times]
        row["median_ms"] = statistics.median(times) * 1e3
        row["min_ms"] = min(times) * 1e3
        row["max_ms"] = max(times) * 1e3
        if opts.rss_ok:
            row["extra_bytes_rss"] = rss_extra(runner.step)
        if opts.profile and impl.ours:
            row["profile"] = _profile(runner.step, 3, opts.profile)
        runner = None
        if impl.tracemalloc:
            row["extra_bytes_tracemalloc"] = tracemalloc_extra(lambda d: impl.make(d, rule), data)
    except Exception as e:  # a row that fails is reported, not fatal
        row["error"] = (f"{type(e).__name__}: {e}".splitlines() or [type(e).__name__])[0][:300]
        row["traceback"] = traceback.format_exc()
    finally:
        runner = None
        gc.collect()
        row["row_wall_s"] = time.perf_counter() - row_started[0]
        row["row_cpu_s"] = time.process_time() - row_started[1]
    extra = row.get("extra_bytes_tracemalloc", row.get("extra_bytes_rss"))
    if extra is not None:
        row["extra_bytes"] = extra
        row["extra_method"] = "tracemalloc" if "extra_bytes_tracemalloc" in row else "rss-hwm"
        row["extra_x_params"] = extra / (4 * shape.n_params)
    return row


def _alternate(first, second, pairs: int) -> tuple[float, float, float]:
    """Step two runners in alternation (which goes first alternates too): `(median of the
    per-pair ratios second/first, median ms of first, median ms of second)`. On a shared machine
    two rows timed a minute apart differ by more than the few percent a target is about, so the
    ratios the targets judge are measured this way."""
    runners = (first, second)
    for _ in range(2):
        first.step()
        second.step()
    times: tuple[list, list] = ([], [])
    for k in range(pairs):
        for which in ((0, 1) if k % 2 == 0 else (1, 0)):
            t = time.perf_counter()
            runners[which].step()
            times[which].append(time.perf_counter() - t)
    ratios = [b / a for a, b in zip(*times)]
    return statistics.median(ratios), statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3


def _paired(result: dict, make_first, make_second, pairs: int, names: tuple[str, str]) -> dict:
    """`result` with the paired ratio second/first and each side's median ms under `names`."""
    first = second = None
    try:
        first, second = make_first(), make_second()
        ratio, first_ms, second_ms = _alternate(first, second, pairs)
        result.update({"pairs": pairs, "ratio_median": ratio, names[0]: first_ms, names[1]: second_ms})
    except Exception as e:  # reported, not fatal
        result["error"] = (f"{type(e).__name__}: {e}".splitlines() or [type(e).__name__])[0][:300]
    finally:
        first = second = None
        gc.collect()
    return result


def paired_tie_ratio(impl: Impl, shapes: dict, rule: str, pairs: int) -> dict:
    """S2-tied against S2 for one implementation, timed in alternation."""
    return _paired(
        {"backend": impl.backend, "impl": impl.name, "rule": rule},
        lambda: impl.make(make_data(shapes["S2"]), rule),
        lambda: impl.make(make_data(shapes["S2-tied"]), rule),
        pairs,
        ("plain_ms", "tied_ms"),
    )


def paired_peer_ratio(impl: Impl, peer: Impl, shape: Shape, rule: str, pairs: int) -> dict:
    """One implementation against its peer on one shape, timed in alternation."""
    data = make_data(shape)
    return _paired(
        {"backend": impl.backend, "impl": impl.name, "peer": peer.name, "shape": shape.name, "rule": rule},
        lambda: peer.make(data, rule),
        lambda: impl.make(data, rule),
        pairs,
        ("peer_ms", "ours_ms"),
    )


def format_paired(title: str, results: list, label, detail) -> list[str]:
    """Lines for a list of paired results; `label(p)` names one, `detail(p)` its medians."""
    if not results:
        return []
    lines = [f"{title}, paired (the two stepped in alternation, median of the per-pair ratios; "
             "medians in ms):"]
    for p in results:
        what = f"  {label(p)}:"
        if "error" in p:
            lines.append(f"{what} n/a: {p['error']}")
        else:
            lines.append(f"{what} {p['ratio_median']:.3f}  ({detail(p)}, {p['pairs']} pairs)")
    return lines


# --- report ------------------------------------------------------------------------------------


def _fill_ratios(rows: list, floor_gbs: float | None) -> None:
    by = {(r["backend"], r["impl"], r["shape"], r["rule"]): r for r in rows}
    for r in rows:
        if floor_gbs:
            r["floor_ms"] = BYTES_PER_PARAM[r["rule"]] * r["params"] / (floor_gbs * 1e9) * 1e3
            if "median_ms" in r:
                r["x_floor"] = r["median_ms"] / r["floor_ms"]
                r["x_floor_min"] = r["min_ms"] / r["floor_ms"]
        if "median_ms" not in r:
            continue
        for backend, name in (BEST_PEER[r["backend"]], FALLBACK_PEER.get(r["backend"])):
            peer = by.get((backend, name, r["shape"], r["rule"])) if name else None
            if peer is not None and "median_ms" in peer:
                r["peer"] = name
                r["x_peer"] = r["median_ms"] / peer["median_ms"]
                r["x_peer_min"] = r["min_ms"] / peer["min_ms"]
                if "compile_s" in r and "compile_s" in peer:
                    r["x_peer_compile"] = r["compile_s"] / peer["compile_s"]
                break


def _fmt(value, spec, width):
    return (format(value, spec) if value is not None else "-").rjust(width)


_SHORT_PEER = {"torch.optim fused": "torch fused", "optax jit+donate": "optax j+d",
               "naive NumPy loop": "naive np"}


def format_table(rows: list) -> str:
    head = (
        f"{'backend':7} {'impl':26} {'shape':7} {'rule':8} {'median':>8} {'min':>8} {'max':>8} "
        f"{'n':>3} {'xfloor':>7} {'xpeer':>6} {'peer':11} {'compile':>8} {'setup':>7} "
        f"{'extraMB':>8} {'xparam':>6} agree"
    )
    units = (
        f"{'':7} {'':26} {'':7} {'':8} {'ms':>8} {'ms':>8} {'ms':>8} {'':>3} {'':>7} {'':>6} {'':11} "
        f"{'s':>8} {'ms':>7} {'':>8} {'':>6}"
    )
    lines = [head, units.rstrip(), "-" * len(head)]
    last = None
    for r in rows:
        group = (r["shape"], r["rule"])
        if last is not None and group != last:
            lines.append("")
        last = group
        lead = f"{r['backend']:7} {r['impl']:26} {r['shape']:7} {r['rule']:8} "
        if "median_ms" not in r:
            why = f"skipped ({r['skipped']})" if "skipped" in r else f"n/a (error: {r.get('error')})"
            lines.append(lead + why[:110])
            continue
        extra = r.get("extra_bytes")
        method = {"tracemalloc": "t", "rss-hwm": "r"}.get(r.get("extra_method"), "")
        agree = ("ok" if r["agree"] else f"DIFF {r['max_abs_err']:.1e}")
        if r.get("ties"):
            agree += ", " + r["ties"]
        lines.append(
            lead
            + f"{r['median_ms']:8.2f} {r['min_ms']:8.2f} {r['max_ms']:8.2f} {r['repeats']:3d} "
            + _fmt(r.get("x_floor"), ".2f", 7) + " "
            + _fmt(r.get("x_peer"), ".2f", 6) + " "
            + f"{_SHORT_PEER.get(r.get('peer'), r.get('peer') or '-'):11} "
            + _fmt(r.get("compile_s"), ".2f", 8) + " "
            + _fmt(r.get("setup_ms"), ".1f", 7) + " "
            + (_fmt(extra / 2**20, ".1f", 7) + method if extra is not None else _fmt(None, "", 8)) + " "
            + _fmt(r.get("extra_x_params"), ".2f", 6) + " "
            + agree
        )
    return "\n".join(lines)


def evaluate_targets(rows: list, paired: list = (), paired_peers: list = (), judged: bool = True) -> list:
    """The performance targets, on the Adam rows of this run; where there is a paired measurement
    (the two stepped in alternation), the target takes that ratio. The limits are meant for the
    full-size shapes: with `judged=False` (the --quick shapes, where fixed per-step costs weigh far
    more) the values are reported and `met` stays None."""
    by = {(r["backend"], r["impl"], r["shape"], r["rule"]): r for r in rows if "median_ms" in r}
    ours = {"numpy": "optimisers update_", "torch": "optimisers update_", "jax": "optimisers jit+donate"}
    out = []

    def add(text, limit, value, by_min=None):
        met = None if value is None or not judged else value <= limit
        out.append({"target": text, "measured": value, "limit": limit, "met": met,
                    "measured_by_min": by_min})

    def get(backend, shape, key, impl=None):
        r = by.get((backend, impl or ours[backend], shape, "adam"))
        return None if r is None else r.get(key)

    def ratio(backend, shape, key):
        return get(backend, shape, key), get(backend, shape, key + "_min")

    peer_pair = {(p["backend"], p["shape"]): p for p in paired_peers if "ratio_median" in p}

    def versus_peer(backend, shape, peer_name):
        p = peer_pair.get((backend, shape))
        if p is not None:
            add(f"{backend} {shape} Adam / {peer_name} (paired)", 1.05, p["ratio_median"])
        else:
            add(f"{backend} {shape} Adam / {peer_name}", 1.05, *ratio(backend, shape, "x_peer"))

    for shape in ("S1", "S2"):
        versus_peer("torch", shape, "torch.optim fused")
    add("torch S3 Adam / torch.optim fused", 0.5, *ratio("torch", "S3", "x_peer"))
    for shape in ("S1", "S2"):
        versus_peer("jax", shape, "optax jit+donate")
    add("jax S3 Adam / optax jit+donate (>= 5x faster)", 0.2, *ratio("jax", "S3", "x_peer"))
    add("jax S3 Adam compile / optax compile (>= 10x faster)", 0.1, get("jax", "S3", "x_peer_compile"))
    for shape in ("S1", "S2"):
        add(f"numpy {shape} Adam / bandwidth floor", 2.5, *ratio("numpy", shape, "x_floor"))
    r = by.get(("numpy", ours["numpy"], "S3", "adam"))
    fused = by.get(("torch", "torch.optim fused", "S3", "adam"))
    if r and fused:
        add("numpy S3 Adam / torch.optim fused", 0.2, r["median_ms"] / fused["median_ms"],
            r["min_ms"] / fused["min_ms"])
    else:
        add("numpy S3 Adam / torch.optim fused", 0.2, None)
    pair_of = {p["backend"]: p for p in paired if p["rule"] == "adam" and "ratio_median" in p}
    for backend in ALL_BACKENDS:
        tied, plain = by.get((backend, ours[backend], "S2-tied", "adam")), by.get(
            (backend, ours[backend], "S2", "adam"))
        if backend in pair_of:
            add(f"{backend} S2-tied / S2 Adam (paired)", 1.05, pair_of[backend]["ratio_median"])
        elif tied and plain:
            add(f"{backend} S2-tied / S2 Adam", 1.05, tied["median_ms"] / plain["median_ms"],
                tied["min_ms"] / plain["min_ms"])
        else:
            add(f"{backend} S2-tied / S2 Adam", 1.05, None)
    add("setup on S3 (numpy, ms)", 100.0, get("numpy", "S3", "setup_ms"))
    return out


def format_targets(targets: list, judged: bool = True) -> str:
    head = "Targets (Adam rows of this run; ratio of medians, [ratio of minimums])"
    if not judged:
        head += (
            "; --quick shapes are smaller than those the limits are set for, so the values are "
            "shown, not judged"
        )
    lines = [head + ":"]
    for t in targets:
        if t["measured"] is None:
            verdict, value = "n/a", "-"
        else:
            value = f"{t['measured']:.3g}"
            verdict = "not judged" if t["met"] is None else ("met" if t["met"] else "NOT MET")
        by_min = f"[{t['measured_by_min']:.3g}]" if t.get("measured_by_min") is not None else ""
        lines.append(f"  {t['target']:52} {value:>7} {by_min:>8}  limit {t['limit']:<5g} {verdict}")
    return "\n".join(lines)


# --- main --------------------------------------------------------------------------------------


def _csv(allowed):
    def parse(text):
        items = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in items if s not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad[0]!r}; choose from {', '.join(allowed)}")
        return items

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="optimisers bench",
        description="Time one optimiser step of optimisers against torch.optim, optax and a naive "
        "NumPy loop, with the memory-bandwidth floor measured in the same run.",
    )
    p.add_argument("--quick", action="store_true",
                   help="smaller shapes (S1 2048^2, S2 4 blocks of d=128, S3 100 tensors), fewer "
                   "repeats: a smoke run")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--backends", type=_csv(ALL_BACKENDS), default=list(ALL_BACKENDS),
                   help="comma-separated: numpy,torch,jax")
    p.add_argument("--shapes", type=_csv(ALL_SHAPES), default=list(ALL_SHAPES),
                   help="comma-separated: S1,S2,S2-tied,S3")
    p.add_argument("--rules", type=_csv(ALL_RULES), default=list(ALL_RULES),
                   help="comma-separated: adam,adamw,momentum")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed steps per row (default 7, --quick 5; fast rows take more)")
    p.add_argument("--compile-limit", type=float, default=None, metavar="S",
                   help="after a JAX compile longer than S seconds, skip the other rows of the same "
                   "library on that shape (default 20, --quick 5)")
    p.add_argument("--bandwidth-mb", type=int, default=None, metavar="MIB",
                   help="size of each bandwidth-test array (default 128, --quick 64; keep it well "
                   "above the last-level cache)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="print the top N cProfile entries of each optimisers row")
    return p


def _loadavg() -> tuple:
    try:
        return os.getloadavg()
    except (AttributeError, OSError):  # not available on this platform
        return (float("nan"),) * 3


def _warm_up_imports(backends) -> None:
    """Pay one-off start-up costs (imports, JAX's first compile, torch.optim's lazy imports) before
    anything is timed, then freeze the objects alive so far out of the garbage collector: every
    `gc.collect()` between rows then scans only what the benchmark made since."""
    if "torch" in backends:
        try:
            import torch

            torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])
        except Exception:  # reported per row
            pass
    if "jax" in backends:
        try:
            import jax
            import optax  # noqa: F401

            jax.jit(lambda x: x + 1).lower(np.float32(0)).compile()
        except Exception:  # reported per row
            pass
    gc.collect()
    gc.freeze()


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    try:
        return _run(opts)
    finally:
        gc.unfreeze()  # main() may run inside another program (the tests): leave the collector as found


def _run(opts) -> int:
    started = time.perf_counter()
    if opts.repeats is None:
        opts.repeats = 5 if opts.quick else 7
    opts.repeats = max(1, opts.repeats)
    opts.warmup = 1 if opts.quick else 2
    if opts.compile_limit is None:
        opts.compile_limit = 5.0 if opts.quick else 20.0
    if opts.bandwidth_mb is None:
        opts.bandwidth_mb = 64 if opts.quick else 128
    opts.rss_ok = _can_reset_hwm()
    threads = os.cpu_count() or 1

    def progress(msg):
        print(f"[{time.perf_counter() - started:6.1f}s] {msg}", file=sys.stderr, flush=True)

    import optimisers

    versions = {"python": platform.python_version(), "numpy": np.__version__,
                "optimisers": getattr(optimisers, "__version__", "?")}
    for mod in ("torch", "jax", "optax"):
        backend = "torch" if mod == "torch" else "jax"
        if backend in opts.backends:
            try:
                versions[mod] = __import__(mod).__version__
            except Exception as e:  # reported per row as well
                versions[mod] = f"not importable ({e})"
    _warm_up_imports(opts.backends)

    load_start = _loadavg()
    progress("measuring memory bandwidth")
    bw = measure_bandwidth(opts.bandwidth_mb, threads, 3 if opts.quick else 5)
    # Other work on a shared machine easily halves one measurement, so the update kernel is measured
    # again after every shape and the floor is the best of all of them.
    floor_samples = [bw["floor_gbs"]]
    shapes = make_shapes(opts.quick)

    impls = [i for i in IMPLS if i.backend in opts.backends]
    rows: list = []
    agreement: list = []
    compile_seen: dict = {}
    for name in opts.shapes:
        shape = shapes[name]
        data = make_data(shape)
        for rule in opts.rules:
            ref = reference(rule, data)
            group = []
            for impl in impls:
                progress(f"{name} {rule}: {impl.backend} {impl.name}")
                row = run_row(impl, data, rule, ref, opts, compile_seen)
                group.append(row)
                if "error" in row:
                    progress(f"  n/a: {row['error']}")
            rows += group
            checked = [r for r in group if "agree" in r]
            bad = [r for r in checked if not r["agree"]]
            worst = max(checked, key=lambda r: r["max_abs_err"], default=None)
            line = (
                f"check {name} {rule}: {len(checked) - len(bad)}/{len(checked)} implementations "
                f"agree with the float64 reference after {CHECK_STEPS} steps "
                f"(|err| <= {ATOL:g} + {RTOL:g}|x|)"
            )
            if worst is not None:
                line += f"; largest |err| {worst['max_abs_err']:.1e} ({worst['backend']} {worst['impl']})"
            if bad:
                line += "; DISAGREE: " + ", ".join(
                    f"{r['backend']} {r['impl']} ({r.get('ties') or format(r['max_abs_err'], '.1e')})"
                    for r in bad
                )
            agreement.append(line)
        del data
        gc.collect()
        again = measure_bandwidth(opts.bandwidth_mb, threads, 3, kernels=("update",), one_thread=False)
        floor_samples.append(again["floor_gbs"])
    pairs = 6 if opts.quick else 15
    paired = []
    if "S2" in opts.shapes and "S2-tied" in opts.shapes:
        for impl in [i for i in impls if i.ours]:
            for rule in opts.rules:
                progress(f"S2-tied against S2, paired: {impl.backend} {impl.name} {rule}")
                paired.append(paired_tie_ratio(impl, shapes, rule, pairs))
    paired_peers = []
    if "adam" in opts.rules:
        for impl in [i for i in impls if i.ours and BEST_PEER[i.backend][0] == i.backend]:
            peer = next((i for i in impls if (i.backend, i.name) == BEST_PEER[impl.backend]), None)
            for name in [n for n in ("S1", "S2") if n in opts.shapes and peer is not None]:
                progress(f"{name} adam against {peer.name}, paired: {impl.backend} {impl.name}")
                paired_peers.append(paired_peer_ratio(impl, peer, shapes[name], "adam", pairs))
    floor = max(floor_samples)
    bw["floor_samples_gbs"] = floor_samples
    bw["floor_gbs"] = floor
    out = [
        f"optimisers bench{' --quick' if opts.quick else ''}: {platform.machine()}, {threads} cores, "
        + ", ".join(f"{k} {v}" for k, v in versions.items()),
        "",
        f"Bandwidth ({bw['array_mib']} MiB float32 arrays, {threads} threads, median/best of "
        f"{bw['repeats']}):",
        "  " + "   ".join(
            f"{k} {bw[k + '_gbs_median']:5.1f} / {bw[k + '_gbs_best']:5.1f}" for k in _KERNELS
        ) + " GB/s",
    ]
    if threads != 1:
        out.append("  1 thread: " + ", ".join(
            f"{k} {bw[k + '_1t_gbs_median']:.1f} / {bw[k + '_1t_gbs_best']:.1f}" for k in _KERNELS
        ) + " GB/s")
    out.append(
        f"  floor bandwidth = {floor:.1f} GB/s: the best in-place update a += s*b with all threads, "
        f"measured at the start and after each shape ({', '.join(f'{x:.1f}' for x in floor_samples)})"
    )
    out.append("  (copy and triad also pay uncounted write-allocate reads; an optimiser step does not)")
    out.append("  bytes per float32 parameter per step: "
               + "; ".join(f"{k}: {v}" for k, v in BYTES_MODEL.items()))
    for name in opts.shapes:
        s = shapes[name]
        floors = ", ".join(
            f"{rule} {BYTES_PER_PARAM[rule] * s.n_params / floor / 1e6:.2f} ms" for rule in opts.rules
        )
        out.append(f"  {name:7} {s.n_tensors:5d} tensors, {s.n_places:5d} places, {s.n_params:>10,} "
                   f"params ({s.layout}); floor: {floors}")
    print("\n".join(out))

    _fill_ratios(rows, floor)
    targets = evaluate_targets(rows, paired, paired_peers, judged=not opts.quick)
    print()
    print("\n".join(agreement))
    print()
    print(format_table(rows))
    print()
    print(
        "xfloor: median / (bytes per param x params / floor bandwidth). xpeer: median / the peer's "
        "median (same shape and rule). extraMB: peak memory above the step's start, t = tracemalloc "
        "(NumPy allocations), r = RSS high-water mark; xparam: extraMB / parameter bytes."
    )
    paired_lines = format_paired(
        "S2-tied / S2", paired,
        lambda p: f"{p['backend']:7} {p['impl']:26} {p['rule']:9}",
        lambda p: f"S2 {p['plain_ms']:.2f}, S2-tied {p['tied_ms']:.2f}",
    ) + format_paired(
        "optimisers / peer", paired_peers,
        lambda p: f"{p['backend']:7} {p['shape']:7} {p['impl']} / {p['peer']}",
        lambda p: f"ours {p['ours_ms']:.2f}, peer {p['peer_ms']:.2f}",
    )
    if paired_lines:
        print("\n".join(paired_lines))
    print()
    print(format_targets(targets, judged=not opts.quick))
    profiles = [r for r in rows if r.get("profile")]
    for r in profiles:
        print(f"\ncProfile, 3 steps, {r['backend']} {r['impl']} {r['shape']} {r['rule']} (by tottime):")
        print(r["profile"].rstrip())
    elapsed = time.perf_counter() - started
    load_end = _loadavg()
    busy = max(load_start[0], load_end[0]) > threads + 0.5
    print(
        f"\ntotal time {elapsed:.0f} s; 1-minute load average {load_start[0]:.1f} at the start, "
        f"{load_end[0]:.1f} at the end, on {threads} cores"
        + ("  (the machine was busy with other work: timings are noisy)" if busy else "")
    )
    if opts.json:
        doc = {
            "args": {k: v for k, v in vars(opts).items()},
            "versions": versions,
            "machine": {"arch": platform.machine(), "cores": threads, "platform": platform.platform()},
            "bandwidth": bw,
            "bytes_per_param": BYTES_PER_PARAM,
            "bytes_model": BYTES_MODEL,
            "hyperparameters": {"adam_lr": LR_ADAM, "betas": BETAS, "eps": EPS,
                                "weight_decay": WEIGHT_DECAY, "momentum_lr": LR_MOMENTUM, "rho": RHO},
            "shapes": {n: {"tensors": shapes[n].n_tensors, "places": shapes[n].n_places,
                           "params": shapes[n].n_params, "layout": shapes[n].layout}
                       for n in opts.shapes},
            "agreement": agreement,
            "rows": rows,
            "paired_tie_ratios": paired,
            "paired_peer_ratios": paired_peers,
            "targets": targets,
            "elapsed_s": elapsed,
            "load_average": {"start": load_start, "end": load_end},
        }
        with open(opts.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        print(f"wrote {opts.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
