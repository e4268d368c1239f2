"""Memory of flat buffers against per-array state, as multiples of the parameters' bytes.

    python benchmarks/flat_memory.py           # S3 (4000 x 256) and S2 (148 tensors, 16.2M)
    python benchmarks/flat_memory.py --small   # the bench's --quick sizes

For each model and backend, Adam through `update_` on the model as it is (per-array parameters)
and on the model over flat buffers (NumPy: views of one array, gradients views of another;
PyTorch: after `optimisers.torch.flatten_`). Columns:

- held: what `setup` and three steps leave held (the optimiser state, and whatever the engine
  keeps: its buffers, summed-gradient buffers, views), counted from before `setup`;
- first: the peak of `setup` and the first step above what was held before `setup`, minus
  `held` (what the first step needed beyond what it keeps);
- step: the peak of a later step above what was held before it.

Adam's own state is 2.00x the parameters in every case; flat buffers should add nothing to it.
NumPy is measured by tracemalloc, PyTorch CPU by the profiler's allocation events (as
`benchmarks/memory.py` does).
"""

from __future__ import annotations

import argparse
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
from optimisers.tools.bench.implementations import views_of_one_buffer
from optimisers.tools.bench.models import make_shapes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import _torch_peak  # noqa: E402  (the allocation peak, as memory.py measures it)


def _values(shape):
    rng = np.random.default_rng(0)
    params = [rng.standard_normal(s).astype(np.float32) for s in shape.shapes]
    grads = [rng.standard_normal(s).astype(np.float32) for s in shape.shapes]
    return params, grads


def _views(values):
    return views_of_one_buffer(values, lambda n: np.empty(n, np.float32))


def numpy_row(shape, flat: bool) -> tuple:
    params, grads = _values(shape)
    if flat:
        params, grads = _views(params), _views(grads)
    nbytes = sum(p.nbytes for p in params)
    gc.collect()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        state = opt.setup(opt.Adam(1e-3), params)
        state, params = opt.update_(state, params, grads)
        first_peak = tracemalloc.get_traced_memory()[1] - start
        for _ in range(2):
            state, params = opt.update_(state, params, grads)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - start
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        state, params = opt.update_(state, params, grads)
        step = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    return held / nbytes, (first_peak - held) / nbytes, step / nbytes


def torch_row(shape, flat: bool) -> tuple:
    import torch

    from optimisers.torch import flatten_

    values, grad_values = _values(shape)
    params = [torch.nn.Parameter(torch.from_numpy(v)) for v in values]
    if flat:
        flatten_(params)
        for p, g in zip(params, grad_values):
            p.grad.copy_(torch.from_numpy(g))
        grads = [p.grad for p in params]
    else:
        grads = [torch.from_numpy(g) for g in grad_values]
    nbytes = sum(p.numel() * 4 for p in params)
    box: list = [None, params]

    def first():
        box[0] = opt.setup(opt.Adam(1e-3), box[1])
        box[0], box[1] = opt.update_(box[0], box[1], grads)

    def step():
        box[0], box[1] = opt.update_(box[0], box[1], grads)

    peak_first, level_first = _torch_peak(first)
    for _ in range(2):
        step()
    peak_step, _ = _torch_peak(step)
    return level_first / nbytes, (peak_first - level_first) / nbytes, peak_step / nbytes


def _warm_up(backends) -> None:
    """One step of each kind before measuring: compiling a kernel (numba) or loading a library
    allocates memory once per process, which is not the step's."""
    for backend in backends:
        for flat in (False, True):
            values = [np.ones((70000,), np.float32), np.ones((3,), np.float32)]
            if backend == "numpy":
                params = _views(values) if flat else values
                opt.update_(opt.setup(opt.Adam(1e-3), params), params, [v.copy() for v in values])
            else:
                import torch

                params = [torch.from_numpy(v.copy()) for v in values]
                opt.update_(opt.setup(opt.Adam(1e-3), params), params, [torch.ones_like(p) for p in params])


FLAT_HOW = {"numpy": "views of flat buffers", "torch": "after flatten_"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="the bench's --quick sizes")
    p.add_argument("--backends", default="numpy,torch")
    args = p.parse_args()
    shapes = make_shapes(args.small)
    _warm_up(args.backends.split(","))
    print(f"{'model':34} {'backend':8} {'parameters':24} {'held':>6} {'first':>6} {'step':>6}")
    for name in ("S3", "S2"):
        s = shapes[name]
        label = f"{name} ({s.n_tensors} tensors, {s.n_params / 1e6:.1f}M)"
        for backend in args.backends.split(","):
            row = numpy_row if backend == "numpy" else torch_row
            for flat in (False, True):
                how = FLAT_HOW[backend] if flat else "per array"
                held, first, step = row(s, flat)
                print(f"{label:34} {backend:8} {how:24} {held:6.2f} {first:6.2f} {step:6.2f}")


if __name__ == "__main__":
    main()
