"""Adafactor's optimiser state against Adam's on the same model, and its step time against
torch.optim.Adafactor's (PyTorch CPU, float32).

    python benchmarks/adafactor_memory.py            # a GPT-2-small-like stack of matrices
    python benchmarks/adafactor_memory.py --small    # a smaller one, a few seconds

The model is a transformer's parameters without the network: a token embedding, and per layer
the attention's qkv and output projections, the MLP's two matrices, their biases and two
LayerNorms. Adafactor keeps a row and a column factor for each matrix (m + n numbers for m·n)
and a full second moment for each vector; Adam keeps two moments of every parameter. So the state
is about 1/d of Adam's for d×d matrices (a little more, for the vectors).

**State.** Bytes of the tensors in `optimizer.state` after one step (step counters not counted:
one scalar per parameter for every class), per class, as a multiple of the parameters' bytes and
as a ratio to torch.optim.Adam's.

**Step time.** Median over `--repeats` interleaved rounds (after two warm-up steps; each round
times one `optimizer.step()` of every class) with fixed gradients, for torch.optim.Adafactor
(its default for-loop and `foreach=True`) and `optimisers.torch.Adafactor` (the drop-in class;
it checks the gradients and runs the library's rule per parameter), each row with its ratio to
torch's default. Before timing, the classes are checked to agree after three steps.
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


def transformer_shapes(vocab: int, dim: int, layers: int) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = [(vocab, dim)]
    for _ in range(layers):
        shapes += [(dim,), (dim,), (3 * dim, dim), (3 * dim,), (dim, dim), (dim,)]  # LN, attention
        shapes += [(dim,), (dim,), (4 * dim, dim), (4 * dim,), (dim, 4 * dim), (dim,)]  # LN, MLP
    return shapes


def make_params(shapes, seed=0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(0.02 * torch.randn(s, generator=g)) for s in shapes]
    grads = [torch.randn(s, generator=g) for s in shapes]
    for p, grad in zip(params, grads):
        p.grad = grad
    return params


OPTIMIZERS = {
    "torch.optim.Adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "torch.optim.Adafactor": lambda ps: torch.optim.Adafactor(ps),
    "torch.optim.Adafactor(foreach)": lambda ps: torch.optim.Adafactor(ps, foreach=True),
    "optimisers.torch.Adam": lambda ps: ot.Adam(ps, lr=1e-3),
    "optimisers.torch.Adafactor": lambda ps: ot.Adafactor(ps),
}


def state_bytes(optimizer, params) -> int:
    return sum(
        v.numel() * v.element_size()
        for p in params
        for v in optimizer.state[p].values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )


def state_table(shapes) -> list[str]:
    param_bytes = sum(torch.Size(s).numel() for s in shapes) * 4
    measured = {}
    for name in (
        "torch.optim.Adam",
        "torch.optim.Adafactor",
        "optimisers.torch.Adam",
        "optimisers.torch.Adafactor",
    ):
        params = make_params(shapes)
        optimizer = OPTIMIZERS[name](params)
        optimizer.step()
        measured[name] = state_bytes(optimizer, params)
    adam = measured["torch.optim.Adam"]
    lines = [f"{'optimizer':<30} {'state MiB':>10} {'x params':>9} {'/ Adam':>8}"]
    for name, n in measured.items():
        lines.append(f"{name:<30} {n / 2**20:>10.2f} {n / param_bytes:>9.4f} {n / adam:>8.4f}")
    return lines


def check_agreement(shapes) -> float:
    """The largest difference between the classes after three steps, relative to each tensor."""
    runs = {}
    for name in ("torch.optim.Adafactor", "torch.optim.Adafactor(foreach)", "optimisers.torch.Adafactor"):
        params = make_params(shapes)
        optimizer = OPTIMIZERS[name](params)
        for _ in range(3):
            optimizer.step()
        runs[name] = [p.detach() for p in params]
    ref = runs["torch.optim.Adafactor"]
    worst = 0.0
    for ps in runs.values():
        for a, b in zip(ps, ref):
            worst = max(worst, ((a - b).abs().max() / b.abs().max()).item())
    return worst


def time_table(shapes, repeats: int) -> list[str]:
    """Medians of interleaved rounds (one step of each optimizer per round), so that a shared
    machine's load drifting during the run weighs on every row alike."""
    names = ("torch.optim.Adafactor", "torch.optim.Adafactor(foreach)", "optimisers.torch.Adafactor")
    optimizers = {}
    for name in names:
        optimizer = OPTIMIZERS[name](make_params(shapes))
        for _ in range(2):
            optimizer.step()
        optimizers[name] = optimizer
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(repeats):
        for name, optimizer in optimizers.items():
            start = time.perf_counter()
            optimizer.step()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    base = medians["torch.optim.Adafactor"]
    lines = [f"{'optimizer':<32} {'median ms':>10} {'/ torch':>8}"]
    for name, t in medians.items():
        lines.append(f"{name:<32} {1e3 * t:>10.2f} {t / base:>8.2f}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a smaller model")
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args(argv)
    vocab, dim, layers = (2048, 256, 2) if args.small else (50257, 768, 12)
    shapes = transformer_shapes(vocab, dim, layers)
    n = sum(torch.Size(s).numel() for s in shapes)
    size = f"{len(shapes)} tensors, {n / 1e6:.1f}M parameters"
    print(f"model: embedding {vocab}x{dim}, {layers} layers of width {dim}: {size}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32 CPU\n")
    print("Optimiser state after one step")
    print("\n".join(state_table(shapes)))
    print(f"\nAdafactor's classes agree after 3 steps to {check_agreement(shapes):.1e} (relative)")
    print(f"\nStep time, median of {args.repeats}")
    print("\n".join(time_table(shapes, args.repeats)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
