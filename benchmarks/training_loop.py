"""The optimiser step inside a PyTorch training loop on the CPU: timed right after `backward`,
as users run it, and timed back to back (as `optimisers bench` times it), ours against
torch.optim's fused step, in the same run.

    python benchmarks/training_loop.py               # an MLP of 8 blocks of 1024 x 1024, about a minute
    python benchmarks/training_loop.py --width 512 --rounds 10

Why both: torch runs its operations on OpenMP threads, which keep spinning for some milliseconds
after each parallel region (libgomp's default wait policy) so that the next operation starts at
once. torch.optim's fused step is such an operation; our compiled step runs numba's loop on
threads of our own, which then share the cores with the spinning ones for the first
milliseconds after `backward`. Back to back, no torch operation precedes our step.

Each round runs one training iteration of every row in turn (zero_grad(set_to_none=True),
forward, backward, the step): "after backward" is the step's time there. Then each row steps
`--steps` times back to back: "back to back" is the median of those. Ratios are against
torch.optim fused, measured in the same rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

try:
    import optimisers.torch as ot
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import optimisers.torch as ot

RULES = {
    # name: (torch.optim class, ours, keywords)
    "SGD momentum": (torch.optim.SGD, ot.SGD, {"lr": 0.01, "momentum": 0.9}),
    "SGD nesterov": (torch.optim.SGD, ot.SGD, {"lr": 0.01, "momentum": 0.9, "nesterov": True}),
    "Adagrad": (torch.optim.Adagrad, ot.Adagrad, {"lr": 0.01}),
    "AdamW": (torch.optim.AdamW, ot.AdamW, {"lr": 1e-3}),
}


def mlp(width: int, blocks: int):
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(blocks)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def row(kind, rule, width, blocks, batch):
    theirs, ours, keywords = RULES[rule]
    model = mlp(width, blocks)
    if kind == "torch.optim fused":
        optimiser = theirs(model.parameters(), fused=True, **keywords)
    else:
        optimiser = ours(model.parameters(), **keywords)
    x, y = torch.randn(batch, width), torch.randint(0, 10, (batch,))

    def iteration() -> float:
        optimiser.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        start = time.perf_counter()
        optimiser.step()
        return time.perf_counter() - start

    def back_to_back(steps) -> list:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            optimiser.step()
            times.append(time.perf_counter() - start)
        return times

    for _ in range(3):
        iteration()
    return iteration, back_to_back


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--steps", type=int, default=5, help="back-to-back steps a row a round")
    parser.add_argument("--rules", default=",".join(RULES))
    args = parser.parse_args(argv)
    params = sum(p.numel() for p in mlp(args.width, args.blocks).parameters())
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; an MLP of {params:,} parameters, "
        f"batch {args.batch}; median ms per step over {args.rounds} rounds"
    )
    print("| rule | step | after backward | / fused | back to back | / fused |")
    print("|---|---|---|---|---|---|")
    for rule in args.rules.split(","):
        rows = {
            kind: row(kind, rule, args.width, args.blocks, args.batch)
            for kind in ("torch.optim fused", "optimisers drop-in")
        }
        after: dict = {kind: [] for kind in rows}
        alone: dict = {kind: [] for kind in rows}
        for _ in range(args.rounds):  # rows in turn: a change in the machine's load hits both
            for kind, (iteration, back_to_back) in rows.items():
                after[kind].append(iteration())
                alone[kind].extend(back_to_back(args.steps))
        base_after = statistics.median(after["torch.optim fused"])
        base_alone = statistics.median(alone["torch.optim fused"])
        for kind in rows:
            a, b = statistics.median(after[kind]), statistics.median(alone[kind])
            ratios = f"{a * 1e3:.2f} | {a / base_after:.2f}× | {b * 1e3:.2f} | {b / base_alone:.2f}×"
            print(f"| {rule} | {kind} | {ratios} |", flush=True)


if __name__ == "__main__":
    main()
