"""Per-step overhead: models whose arithmetic is negligible, so a step costs what the library does
per array (walking the model, the checks on every gradient, grouping) and per model.

    python benchmarks/overhead.py            # about 20 seconds
    python benchmarks/overhead.py --steps 50

Run it from two checkouts (`PYTHONPATH=other/src`) to see what a change costs per array.

Rows, each an Adam step, median over `--steps` steps after warm-up:
- tiny: 1000 arrays of 16 elements (NumPy and PyTorch `update_`; torch.optim Adam foreach and
  fused on the same tensors);
- frozen backbone: a PyTorch model of 200 frozen Linear+GELU blocks and one trained Linear
  (`update_` against torch.optim fused Adam on the trained parameters); what is not trained must
  cost nothing per step;
- flat: 4000 PyTorch parameters of 256 elements after `optimisers.torch.flatten_` (`update_` and
  the drop-in `optimisers.torch.Adam`), beside torch.optim's fused Adam on one tensor of all
  their elements (what a step of the buffer costs) and on the 4000 tensors.

The ratio column divides by torch.optim's fused Adam on the same model, measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

try:
    import optimisers as opt
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import optimisers as opt


def median_ms(step, steps: int) -> float:
    for _ in range(5):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def tiny(steps: int) -> list[tuple[str, float]]:
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(16).astype(np.float32) for _ in range(1000)]
    grads = [rng.standard_normal(16).astype(np.float32) for _ in range(1000)]
    model = [v.copy() for v in values]
    state = opt.setup(opt.Adam(1e-3), model)
    rows = [("optimisers update_, NumPy", median_ms(lambda: opt.update_(state, model, grads), steps))]
    tensors = [torch.nn.Parameter(torch.from_numpy(v.copy())) for v in values]
    tgrads = [torch.from_numpy(g) for g in grads]
    tstate = opt.setup(opt.Adam(1e-3), tensors)
    step = lambda: opt.update_(tstate, tensors, tgrads)  # noqa: E731
    rows.append(("optimisers update_, PyTorch", median_ms(step, steps)))
    for p, g in zip(tensors, tgrads):
        p.grad = g
    for kind in ("foreach", "fused"):
        o = torch.optim.Adam(tensors, lr=1e-3, **{kind: True})
        rows.append((f"torch.optim Adam {kind}", median_ms(o.step, steps)))
    return rows


def frozen_backbone(steps: int) -> list[tuple[str, float]]:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()) for _ in range(200)]
    model = torch.nn.ModuleDict({"backbone": torch.nn.Sequential(*blocks), "head": torch.nn.Linear(4, 2)})
    for p in model["backbone"].parameters():
        p.requires_grad_(False)
    grads = {"head": {"weight": torch.ones(2, 4), "bias": torch.ones(2)}}
    state = opt.setup(opt.Adam(1e-3), model)
    rows = [("optimisers update_, PyTorch", median_ms(lambda: opt.update_(state, model, grads), steps))]
    head = model["head"]
    head.weight.grad, head.bias.grad = grads["head"]["weight"], grads["head"]["bias"]
    o = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
    rows.append(("torch.optim Adam fused", median_ms(o.step, steps)))
    return rows


def flat(steps: int) -> list[tuple[str, float]]:
    from optimisers.torch import Adam, flatten_

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(256) * 0.02) for _ in range(4000)]
    separate = [torch.nn.Parameter(p.detach().clone()) for p in params]
    flatten_(params)
    for p, q in zip(params, separate):
        p.grad.copy_(torch.randn(256) * 0.01)
        q.grad = p.grad.clone()
    state = opt.setup(opt.Adam(1e-3), params)
    grads = [p.grad for p in params]
    rows = [("optimisers update_, flatten_", median_ms(lambda: opt.update_(state, params, grads), steps))]
    rows.append(("optimisers Adam, flatten_", median_ms(Adam(params, lr=1e-3).step, steps)))
    one = torch.nn.Parameter(torch.cat([p.detach() for p in params]))
    one.grad = torch.cat(grads)
    for name, tensors in (("torch.optim Adam fused, 1 tensor", [one]), ("torch.optim Adam fused", separate)):
        rows.append((name, median_ms(torch.optim.Adam(tensors, fused=True).step, steps)))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per row (default 200)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # overhead, not arithmetic: one thread keeps the rows comparable
    print(f"{'model':<18} {'implementation':<33} {'median ms':>10} {'x fused':>8}")
    models = {"tiny (1000 x 16)": tiny, "frozen backbone": frozen_backbone, "flat (4000 x 256)": flat}
    for name, rows in ((name, run(args.steps)) for name, run in models.items()):
        fused = dict(rows)["torch.optim Adam fused"]
        for impl, ms in rows:
            print(f"{name:<18} {impl:<33} {ms:>10.3f} {ms / fused:>8.3f}")


if __name__ == "__main__":
    main()
