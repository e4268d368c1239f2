"""Held-out loss of a tiny tied language model trained with low-precision optimiser state and
bfloat16 parameters, against float32 AdamW (mean of seeds).

    python benchmarks/low_bit_accuracy.py                 # 600 steps, seeds 0 and 1
    python benchmarks/low_bit_accuracy.py --steps 50      # a smoke run

The corpus is synthetic: each token is drawn from a softmax of two random tables, one indexed by
the previous token and one by the token before it, so the model has something to learn in a few
hundred steps. The model: token and position embeddings, two pre-norm transformer blocks, an LM
head that is the token embedding (so the embedding, 256 × 64 = 16384 elements, is quantised:
`min_8bit_size` 4096). Every run starts from the same weights and sees the same batches for a
seed; the held-out loss is over a fixed set of sequences, computed in float32.

Runs (all AdamW, lr 2e-3, weight decay 0.01, betas (0.9, 0.999)):
float32 parameters: `torch.optim.AdamW` (the reference), `optimisers.torch.AdamW8bit`,
`AdamWFp8`, `AdamW4bit`; bfloat16 parameters (no float32 copy): `optimisers.torch.AdamW` (moments
and updates in bfloat16, rounded to nearest), `Optimizer(params, StochasticRounding(AdamW))` and
`Optimizer(params, KahanSummation(AdamW))`. Printed: a markdown table of each run's mean loss
and its difference from the reference, in percent.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

try:
    import optimisers as opt
    import optimisers.torch as ot
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import optimisers as opt
    import optimisers.torch as ot

VOCAB, DIM, LAYERS, CONTEXT, BATCH = 256, 64, 2, 32, 32
LR, DECAY = 2e-3, 0.01


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, h):
        q, k, v = self.qkv(self.norm1(h)).chunk(3, dim=-1)
        heads = [t.unflatten(-1, (4, -1)).transpose(1, 2) for t in (q, k, v)]
        attended = F.scaled_dot_product_attention(*heads, is_causal=True)
        h = h + self.proj(attended.transpose(1, 2).flatten(-2))
        return h + self.down(F.gelu(self.up(self.norm2(h))))


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        nn.init.normal_(self.embed.weight, std=0.02)  # (it is the head too: small initial logits)
        self.pos = nn.Parameter(0.02 * torch.randn(CONTEXT, DIM))
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def source_logits():
    """The fixed second-order source: logits of the next token given the previous token and the
    one before it are `previous[a] + before[b]`."""
    tables = torch.Generator().manual_seed(1234)
    return 2.5 * torch.randn(VOCAB, VOCAB, generator=tables), 1.5 * torch.randn(
        VOCAB, VOCAB, generator=tables
    )


def source_loss(x: torch.Tensor) -> float:
    """The source's own cross-entropy on `x` (tokens 2 onwards): what a perfect model reaches."""
    previous, before = source_logits()
    logits = previous[x[:, 1:-1]] + before[x[:, :-2]]
    return float(F.cross_entropy(logits.flatten(0, 1), x[:, 2:].flatten()))


def corpus(n_sequences: int, seed: int) -> torch.Tensor:
    """Sequences of CONTEXT + 1 tokens from the source (`seed` picks the sequences)."""
    previous, before = source_logits()
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(n_sequences, CONTEXT + 1, dtype=torch.long)
    x[:, :2] = torch.randint(0, VOCAB, (n_sequences, 2), generator=g)
    for t in range(2, CONTEXT + 1):
        logits = previous[x[:, t - 1]] + before[x[:, t - 2]]
        x[:, t] = torch.multinomial(logits.softmax(-1), 1, generator=g).squeeze(1)
    return x


def loss_of(model, batch) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def rule_optimizer(rule):
    return lambda params: ot.Optimizer(params, rule)


RUNS = {  # name -> (parameter dtype, optimizer of the parameters)
    "AdamW, float32 (torch.optim)": (
        torch.float32,
        lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=DECAY),
    ),
    "AdamW8bit": (torch.float32, lambda ps: ot.AdamW8bit(ps, lr=LR, weight_decay=DECAY)),
    "AdamWFp8": (torch.float32, lambda ps: ot.AdamWFp8(ps, lr=LR, weight_decay=DECAY)),
    "AdamW4bit": (torch.float32, lambda ps: ot.AdamW4bit(ps, lr=LR, weight_decay=DECAY)),
    "bf16 parameters, plain": (torch.bfloat16, lambda ps: ot.AdamW(ps, lr=LR, weight_decay=DECAY)),
    "bf16, StochasticRounding": (
        torch.bfloat16,
        rule_optimizer(opt.StochasticRounding(opt.AdamW(LR, lambd=DECAY))),
    ),
    "bf16, KahanSummation": (torch.bfloat16, rule_optimizer(opt.KahanSummation(opt.AdamW(LR, lambd=DECAY)))),
}


def train(name: str, seed: int, steps: int, held_out: torch.Tensor) -> float:
    dtype, make = RUNS[name]
    torch.manual_seed(seed)
    model = TiedLM().to(dtype)
    optimizer = make(list(model.parameters()))
    train_set = corpus(steps * BATCH, seed=100 + seed)
    for step in range(steps):
        optimizer.zero_grad()
        loss_of(model, train_set[step * BATCH : (step + 1) * BATCH]).backward()
        optimizer.step()
    evaluated = TiedLM()
    torch.manual_seed(seed)
    evaluated.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    with torch.no_grad():
        return float(loss_of(evaluated, held_out))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--runs", default="all", help="comma-separated names of RUNS, or all")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    names = list(RUNS) if args.runs == "all" else [n.strip() for n in args.runs.split(",")]
    held_out = corpus(256, seed=99)
    floor, uniform = source_loss(held_out), math.log(VOCAB)
    print(f"TiedLM(vocab={VOCAB}, dim={DIM}, layers={LAYERS}, context={CONTEXT}), batch {BATCH}, "
          f"{args.steps} steps, seeds {list(range(args.seeds))}; the source's own held-out loss "
          f"(tokens 2 onwards) {floor:.4f}, a uniform guess {uniform:.4f}")  # fmt: skip
    print()
    print("| run | held-out loss (mean) | per seed | vs float32 AdamW | seconds |")
    print("|---|---|---|---|---|")
    reference = None
    for name in names:
        start = time.perf_counter()
        losses = [train(name, seed, args.steps, held_out) for seed in range(args.seeds)]
        mean = statistics.fmean(losses)
        reference = mean if reference is None else reference
        diff = 100 * (mean / reference - 1)
        seeds = ", ".join(f"{x:.4f}" for x in losses)
        print(
            f"| {name} | {mean:.4f} | {seeds} | {diff:+.2f}% | {time.perf_counter() - start:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
