"""One CPU step of AdamW with low-bit state: `LowBit(AdamW)` on NumPy and torch, the torch
drop-ins, and bitsandbytes' `AdamW8bit` (where installed), beside torch's fused float32 AdamW.

    python benchmarks/low_bit_speed.py                 # one parameter of 4M elements
    python benchmarks/low_bit_speed.py --elements 1048576 --repeats 15

Each row: the median over `--repeats` steps of one parameter (float32, its gradient about 1e-2),
after a first step (which compiles), in ms and ns per parameter, and its time over
bitsandbytes' where that ran. The rows run in turn in one process (compare them within a run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np

try:
    import optimisers as opt
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import optimisers as opt

FORMATS = (8, 4, "fp8")


def _median_s(step, repeats: int) -> float:
    step()  # (the first step compiles the kernel)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ours_numpy(n, bits):
    rng = np.random.default_rng(0)
    model = {"w": rng.standard_normal(n).astype(np.float32)}
    grads = {"w": (rng.standard_normal(n) * 1e-2).astype(np.float32)}
    box = [opt.setup(opt.LowBit(opt.AdamW(1e-3), bits=bits), model), model]

    def step():
        box[0], box[1] = opt.update_(box[0], box[1], grads)

    return step


def _ours_torch(n, bits):
    import torch

    p = torch.nn.Parameter(torch.randn(n))
    grads = {"w": torch.randn(n) * 1e-2}
    box = [opt.setup(opt.LowBit(opt.AdamW(1e-3), bits=bits), {"w": p}), {"w": p}]

    def step():
        box[0], box[1] = opt.update_(box[0], box[1], grads)

    return step


def _torch_class(n, make):
    import torch

    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n) * 1e-2
    return make([p], lr=1e-3).step


def rows(n: int):
    """`(name, make a step)` for each row whose library is installed."""
    out = [(f"LowBit(AdamW, {b!r}), NumPy", lambda b=b: _ours_numpy(n, b)) for b in FORMATS]
    try:
        import torch

        import optimisers.torch as ot
    except ImportError:
        return out
    out += [(f"LowBit(AdamW, {b!r}), torch CPU", lambda b=b: _ours_torch(n, b)) for b in FORMATS]
    out += [(f"optimisers.torch.{c.__name__}", lambda c=c: _torch_class(n, c))
            for c in (ot.AdamW8bit, ot.AdamW4bit, ot.AdamWFp8)]
    try:
        import bitsandbytes as bnb

        out.append(("bitsandbytes AdamW8bit", lambda: _torch_class(n, bnb.optim.AdamW8bit)))
    except ImportError:
        pass
    fused = lambda params, lr: torch.optim.AdamW(params, lr=lr, fused=True)  # noqa: E731
    out.append(("torch.optim.AdamW fused, float32 state", lambda: _torch_class(n, fused)))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--elements", type=int, default=1 << 22)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")  # (bitsandbytes' notices about its GPU kernels)
    measured = [(name, _median_s(make(), args.repeats)) for name, make in rows(args.elements)]
    anchor = dict(measured).get("bitsandbytes AdamW8bit")
    print(f"one float32 parameter of {args.elements:,} elements; median of {args.repeats} steps")
    print("| step | ms | ns/param | / bitsandbytes |")
    print("|---|---|---|---|")
    for name, s in measured:
        ratio = f"{s / anchor:.2f}x" if anchor else "-"
        print(f"| {name} | {s * 1e3:.1f} | {s / args.elements * 1e9:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
