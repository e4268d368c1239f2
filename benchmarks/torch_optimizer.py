"""`optimisers.torch` against torch.optim: one `optimizer.step()` of AdamW, on a GPT-2-shaped model
and on 2,000 small tensors, for the generic adapter `Optimizer(params, optimisers.AdamW(...))`,
the drop-in class `optimisers.torch.AdamW` and torch.optim's AdamW (fused and foreach).

    python benchmarks/torch_optimizer.py                 # CPU, about a minute
    python benchmarks/torch_optimizer.py --device cuda   # where there is a GPU
    python benchmarks/torch_optimizer.py --profile 20    # cProfile of the adapter's step

Each model's gradients are set once; a timed call is `optimizer.step()` alone (on CUDA followed
by a synchronisation). The implementations are timed in interleaved rounds (one step of each per
round, after warm-up), so a shared machine's slow spells hit them all alike; the table gives each
median and its ratio to torch.optim's fused AdamW on the same model in the same run.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

try:
    import optimisers
    import optimisers.torch as ot
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import optimisers
    import optimisers.torch as ot

LR, DECAY = 1e-3, 0.01


def gpt2_shaped(d=320, blocks=12, vocab=4096, context=256) -> list[torch.Tensor]:
    """GPT-2's parameter layout (per block: ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc,
    mlp.c_proj, weights and biases; wte, wpe, ln_f): 148 tensors, 16.2M parameters at the
    defaults. The LM head is wte itself, so it is not listed again (as model.parameters())."""
    shapes = [(vocab, d), (context, d)]
    for _ in range(blocks):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,)]
        shapes += [(4 * d, d), (d,)]
    shapes += [(d,), (d,)]
    return [torch.randn(s) * 0.02 for s in shapes]


def small_tensors(n=2000, size=256) -> list[torch.Tensor]:
    return [torch.randn(size) for _ in range(n)]


def _params(values, device) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(v.to(device)) for v in values]
    gen = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(device) * 1e-2
    return params


def implementations(device):
    """name -> function making an optimizer over a list of parameters."""
    return {
        "torch.optim.AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=DECAY, fused=True),
        "torch.optim.AdamW foreach": lambda ps: torch.optim.AdamW(
            ps, lr=LR, weight_decay=DECAY, foreach=True
        ),
        "optimisers.torch.AdamW": lambda ps: ot.AdamW(ps, lr=LR, weight_decay=DECAY),
        "Optimizer(ps, AdamW)": lambda ps: ot.Optimizer(ps, optimisers.AdamW(LR, lambd=DECAY)),
    }


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(values, device, rounds: int) -> dict[str, float]:
    """Median milliseconds per step of each implementation, timed in interleaved rounds."""
    made = {name: make(_params(values, device)) for name, make in implementations(device).items()}
    for opt in made.values():  # warm-up: the state is made, plans and kernels are ready
        for _ in range(3):
            opt.step()
    _sync(device)
    times: dict[str, list[float]] = {name: [] for name in made}
    for _ in range(rounds):
        for name, opt in made.items():
            start = time.perf_counter()
            opt.step()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def state_bytes(optimizer) -> int:
    """Bytes of the parameter-shaped tensors in `optimizer.state` (step counters left out)."""
    return sum(
        v.numel() * v.element_size()
        for entry in optimizer.state_dict()["state"].values()
        for v in entry.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )


def frozen_backbone_state(values, device) -> dict[str, int]:
    """Optimiser state after one step on the GPT-2-shaped model with everything but the last
    block and ln_f frozen, all parameters handed to the optimizer (`model.parameters()`)."""
    out = {}
    for name, make in implementations(device).items():
        params = _params(values, device)
        for p in params[:-14]:
            p.requires_grad_(False)
            p.grad = None
        optimizer = make(params)
        optimizer.step()
        out[name] = state_bytes(optimizer)
    return out


def profile(values, device, top: int) -> str:
    opt = ot.Optimizer(_params(values, device), optimisers.AdamW(LR, lambd=DECAY))
    for _ in range(3):
        opt.step()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(20):
        opt.step()
    _sync(device)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=30, help="timed steps per implementation")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--profile", type=int, default=0, help="print the top N cProfile entries")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    models = {"GPT-2-shaped (148 tensors, 16.2M)": gpt2_shaped(), "2,000 x 256": small_tensors()}
    print(
        f"torch {torch.__version__}, device {device}, {torch.get_num_threads()} threads, {args.rounds} rounds"
    )
    print(f"{'model':<36} {'implementation':<28} {'median ms':>10} {'x fused':>8}")
    for model, values in models.items():
        medians = measure(values, device, args.rounds)
        fused = medians["torch.optim.AdamW fused"]
        for name, ms in medians.items():
            print(f"{model:<36} {name:<28} {ms:>10.3f} {ms / fused:>8.2f}")
    values = models["GPT-2-shaped (148 tensors, 16.2M)"]
    memory = frozen_backbone_state(values, device)
    print(f"\noptimiser state, GPT-2-shaped with all but its last block frozen ({'x fused':>8})")
    for name, size in memory.items():
        print(f"{name:<28} {size / 2**20:>10.2f} MiB {size / memory['torch.optim.AdamW fused']:>8.2f}")
    if args.profile:
        for model, values in models.items():
            print(f"\ncProfile of Optimizer(ps, AdamW).step() x 20, {model}:")
            print(profile(values, device, args.profile))


if __name__ == "__main__":
    main()
