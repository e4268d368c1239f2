"""Peak memory of optimiser steps, as a multiple of the parameters' bytes.

    python benchmarks/memory.py            # NumPy (tracemalloc) and PyTorch CPU (allocator events)
    python benchmarks/memory.py --small    # smaller models, a few seconds
    python benchmarks/memory.py --first    # only the first steps (and torch fused beside them)

Two models: one big matrix (S1) and a GPT-2-like layout of 148 tensors (S2, as in `optimisers
bench`). Two tables:

**Steady steps.** For `update_` and the pure `update`, with Adam, AdamW, OptimiserChain(ClipNorm,
Adam) and OptimiserChain(ClipGrad, WeightDecay, Adam), one step after two warm-up steps:

- peak: the most memory held during the call above what was held before it;
- transient: peak minus what the call leaves held (its results: for the pure `update` the new
  parameters and state, 1 + 2 = 3x the parameters for Adam, which any pure step must return).
  For `update_` the two are about the same: it returns nothing new.

**First steps.** Adam's first `update_` (or the first `step()` of `optimisers.torch.Optimizer`) after `setup`,
after a `copy.deepcopy` of a trained state, and after `load_state_dict`: the first `update_`
moves the state into the engine's groups. Measured from before the optimiser is made (for the
setup row) or before the step: `peak` is the most held above that start, `over state` is peak
minus the optimiser state that exists after the step (2x the parameters for Adam: what any Adam
must hold), i.e. what the step needed beyond the state. torch.optim's fused Adam, whose state is
made inside its first step, is measured the same way.

NumPy reports its allocations to `tracemalloc`. PyTorch CPU does not, so its rows read the
process's allocations through `torch.profiler` (profile_memory). optax under `jit` allocates
inside XLA, invisible to both, so it has no row; its donated step holds no more than its outputs.
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import tracemalloc
from pathlib import Path

import numpy as np

try:
    import optimisers as opt
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import optimisers as opt
from optimisers.tools.bench.models import make_shapes, nest

RULES = {
    "Adam": lambda: opt.Adam(1e-3),
    "AdamW": lambda: opt.AdamW(1e-3, lambd=1e-2),
    "Chain(ClipNorm, Adam)": lambda: opt.OptimiserChain(opt.ClipNorm(1.0), opt.Adam(1e-3)),
    "Chain(ClipGrad, WeightDecay, Adam)": lambda: opt.OptimiserChain(
        opt.ClipGrad(0.5), opt.WeightDecay(1e-2), opt.Adam(1e-3)
    ),
}


def models(small: bool) -> dict[str, list[tuple[tuple, tuple]]]:
    """S1 and S2 of `optimisers bench` (its --quick sizes with --small)."""
    shapes = make_shapes(small)
    out = {}
    for name in ("S1", "S2"):
        s = shapes[name]
        out[f"{name} ({s.n_tensors} tensors, {s.n_params / 1e6:.1f}M)"] = list(zip(s.paths, s.shapes))
    return out


def build(layout, make):
    rng = np.random.default_rng(0)
    params = nest([(p, make(rng.standard_normal(s).astype(np.float32))) for p, s in layout])
    grads = nest([(p, make(rng.standard_normal(s).astype(np.float32))) for p, s in layout])
    return params, grads


def nbytes(tree) -> int:
    return sum(int(x.nbytes) for x in opt.trainables(tree))


def numpy_step(layout, rule, pure):
    """(parameter bytes, peak, transient) of one NumPy step, by tracemalloc (started before the
    model is built, so that the arrays a step frees are counted too)."""
    tracemalloc.start()
    try:
        model, grads = build(layout, lambda a: a)
        state = opt.setup(rule, model)
        step = opt.update if pure else opt.update_
        for _ in range(2):
            state, model = step(state, model, grads)
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        result = step(state, model, grads)
        peak = tracemalloc.get_traced_memory()[1]
        gc.collect()  # what the call leaves held, not garbage awaiting the cycle collector
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del result
    return nbytes(model), peak - before, peak - after


def torch_step(layout, rule, pure, torch_optim=False):
    """(peak, transient) bytes of one PyTorch CPU step, from the profiler's allocation events."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    model, grads = build(layout, torch.from_numpy)
    if torch_optim:
        params = opt.trainables(model)
        for p, g in zip(params, opt.trainables(grads)):
            p.grad = g
        o = torch.optim.Adam(params, lr=1e-3, foreach=True) if rule == "Adam" else None
        if o is None:
            return None
        run = o.step
    else:
        state = opt.setup(RULES[rule](), model)
        step = opt.update if pure else opt.update_
        holder = [state, model]

        def run():
            holder[0], holder[1] = step(holder[0], holder[1], grads)
            return holder

    for _ in range(2):
        run()
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = run()
        gc.collect()  # frees of garbage awaiting the cycle collector count as freed
    level = peak = 0
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    for e in events:
        level += e.nbytes()
        peak = max(peak, level)
    del result
    return nbytes(model), peak, peak - level


def _state_nbytes(state) -> int:
    return sum(int(p.nbytes) for p in _arrays(opt.state_dict(state)))


def _arrays(d):
    return [v for v in d.values() if hasattr(v, "nbytes") and getattr(v, "ndim", 0) > 0]


def numpy_first(layout, start):
    """(parameter bytes, peak, peak over the state) of NumPy Adam's first `update_` after `start`:
    "setup" (from before `setup`), "deepcopy" or "load" (a copy of a state trained two steps)."""
    tracemalloc.start()
    try:
        model, grads = build(layout, lambda a: a)
        if start != "setup":
            state = opt.setup(opt.Adam(1e-3), model)
            for _ in range(2):
                state, model = opt.update_(state, model, grads)
            if start == "deepcopy":
                state = copy.deepcopy(state)
            else:
                saved = {k: (v.copy() if isinstance(v, np.ndarray) else v)
                         for k, v in opt.state_dict(state).items()}
                state = opt.load_state_dict(opt.setup(opt.Adam(1e-3), model), saved)
                del saved
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        if start == "setup":
            state = opt.setup(opt.Adam(1e-3), model)
        state, model = opt.update_(state, model, grads)
        peak = tracemalloc.get_traced_memory()[1] - before
        gc.collect()
        held = _state_nbytes(state) if start == "setup" else 0  # made inside the measured span
    finally:
        tracemalloc.stop()
    return nbytes(model), peak, peak - held


def _torch_peak(run):
    """(peak, level at the end) bytes of the torch allocations of `run()`."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = run()
        gc.collect()
    level = peak = 0
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    for e in events:
        level += e.nbytes()
        peak = max(peak, level)
    del result
    return peak, level


def torch_first(layout, impl, start="setup"):
    """(parameter bytes, peak, peak over the state) of a first Adam step on PyTorch CPU:
    impl "update_" (opt.setup + opt.update_), "adapter" (optimisers.torch.Optimizer + step()) or
    "fused" (torch.optim.Adam(fused=True)); start "setup", "deepcopy" or "load" (ours only)."""
    import torch

    model, grads = build(layout, torch.from_numpy)
    params = opt.trainables(model)
    for p, g in zip(params, opt.trainables(grads)):
        p.grad = g
    held = 2 * sum(int(p.nbytes) for p in params)  # Adam's m and v, made inside a setup row's span
    if impl == "fused":
        def run():
            o = torch.optim.Adam(params, lr=1e-3, fused=True)
            o.step()
            return o
    elif impl == "adapter":
        import optimisers.torch as ot

        def run():
            o = ot.Optimizer(params, opt.Adam(1e-3))
            o.step()
            return o
    else:
        state = None
        if start != "setup":
            state = opt.setup(opt.Adam(1e-3), model)
            for _ in range(2):
                state, model = opt.update_(state, model, grads)
            if start == "deepcopy":
                state = copy.deepcopy(state)
            else:
                saved = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                         for k, v in opt.state_dict(state).items()}
                state = opt.load_state_dict(opt.setup(opt.Adam(1e-3), model), saved)
                del saved
            held = 0
        holder = [state, model]

        def run():
            if holder[0] is None:
                holder[0] = opt.setup(opt.Adam(1e-3), holder[1])
            holder[0], holder[1] = opt.update_(holder[0], holder[1], grads)
            return holder

    peak, _ = _torch_peak(run)
    return nbytes(model), peak, peak - held


def first_tables(layouts, backends):
    rows = []
    for mname, layout in layouts.items():
        if "numpy" in backends:
            for start in ("setup", "deepcopy", "load"):
                rows.append((mname, f"numpy update_ after {start}", numpy_first(layout, start)))
        if "torch" in backends:
            for start in ("setup", "deepcopy", "load"):
                rows.append((mname, f"torch update_ after {start}", torch_first(layout, "update_", start)))
            rows.append((mname, "torch adapter Adam, first step()", torch_first(layout, "adapter")))
            rows.append((mname, "torch.optim Adam fused, first step()", torch_first(layout, "fused")))
    print("\nFirst Adam steps: bytes above the start / parameter bytes")
    print(f"  {'model':24} {'what':40} {'peak':>5} {'over state':>10}")
    for model, what, (n, peak, over) in rows:
        print(f"  {model:24} {what:40} {peak / n:5.2f} {over / n:10.2f}")


def table(rows, title):
    print(f"\n{title}")
    print(f"  {'model':24} {'rule':35} {'call':19} {'peak':>5} {'transient':>9}")
    for model, rule, call, (n, peak, transient) in rows:
        print(f"  {model:24} {rule:35} {call:19} {peak / n:5.2f} {transient / n:9.2f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="smaller models")
    p.add_argument("--backends", default="numpy,torch")
    p.add_argument("--first", action="store_true", help="only the first steps")
    opts = p.parse_args(argv)
    layouts = models(opts.small)
    backends = opts.backends.split(",")
    first_tables(layouts, backends)
    if opts.first:
        return
    if "numpy" in backends:
        rows = []
        for mname, layout in layouts.items():
            for rname, make in RULES.items():
                for pure in (False, True):
                    rows.append((mname, rname, "update" if pure else "update_",
                                 numpy_step(layout, make(), pure)))
        table(rows, "Steady steps, NumPy, tracemalloc: bytes above the start / parameter bytes")
    if "torch" in backends:
        rows = []
        for mname, layout in layouts.items():
            for rname in RULES:
                for pure in (False, True):
                    call = "update" if pure else "update_"
                    rows.append((mname, rname, call, torch_step(layout, rname, pure)))
            rows.append((mname, "Adam", "torch.optim foreach", torch_step(layout, "Adam", False, True)))
        table(rows, "Steady steps, PyTorch CPU, torch.profiler: bytes above the start / parameter bytes")


if __name__ == "__main__":
    main()
