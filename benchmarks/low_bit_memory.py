"""Optimiser state bytes per parameter: AdamW's moments in float32 against `LowBit(AdamW)` in 8
bits, 4 bits and FP8, on a small GPT-like model whose LM head is its token embedding.

    python benchmarks/low_bit_memory.py            # vocabulary 8192, width 256, 4 layers
    python benchmarks/low_bit_memory.py --small    # a smaller one

The state is measured from `optimisers.state_dict(setup(rule, model))`: the bytes of every
array it holds (codes, scales, moments kept in float32), step counters left out (one integer per
parameter for every rule). The model is given with both names of the tied weight, so the table
also shows that a tie has one state. Two figures per rule: over the parameters of at least
`min_size` (4096) elements, whose moments are quantised, and over the whole model (its small
vectors keep float32 moments). As a cross-check, the torch drop-in class of each format
(`optimisers.torch.AdamW8bit`, ...) is stepped once on the same module and its `state[p]`
tensors (less the shared `qmapK` maps) are counted too: the same bytes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

try:
    import optimisers as opt
    import optimisers.torch as ot
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import optimisers as opt
    import optimisers.torch as ot

MIN_SIZE = 4096


class TinyGPT(nn.Module):
    """Token and position embeddings, pre-norm attention and MLP blocks, a final norm, and an LM
    head whose weight is the token embedding's."""

    def __init__(self, vocab: int, dim: int, layers: int, context: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                dict(
                    norm1=nn.LayerNorm(dim),
                    qkv=nn.Linear(dim, 3 * dim),
                    proj=nn.Linear(dim, dim),
                    norm2=nn.LayerNorm(dim),
                    up=nn.Linear(dim, 4 * dim),
                    down=nn.Linear(4 * dim, dim),
                )  # fmt: skip
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight


RULES = {
    "AdamW, float32": lambda: opt.AdamW(1e-3, lambd=0.01),
    "LowBit(AdamW), 8-bit": lambda: opt.LowBit(opt.AdamW(1e-3, lambd=0.01), bits=8, min_size=MIN_SIZE),
    "LowBit(AdamW), FP8": lambda: opt.LowBit(opt.AdamW(1e-3, lambd=0.01), bits="fp8", min_size=MIN_SIZE),
    "LowBit(AdamW), 4-bit": lambda: opt.LowBit(opt.AdamW(1e-3, lambd=0.01), bits=4, min_size=MIN_SIZE),
}
DROP_INS = {"8-bit": ot.AdamW8bit, "FP8": ot.AdamWFp8, "4-bit": ot.AdamW4bit}


def state_bytes(state) -> dict[str, int]:
    """Bytes of the arrays of each place's state, by place (a tied place has none of its own)."""
    out: dict[str, int] = {}
    for key, value in opt.state_dict(state).items():
        place, sep, _ = key.partition("/state/")
        if sep and isinstance(value, torch.Tensor):
            out[place] = out.get(place, 0) + value.numel() * value.element_size()
    return out


def drop_in_bytes(cls, model: nn.Module) -> int:
    """Bytes of the drop-in class's `state[p]` tensors after one step, less the shared maps."""
    params = list(model.parameters())
    optimizer = cls(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    return sum(
        v.numel() * v.element_size()
        for p in params
        for k, v in optimizer.state[p].items()
        if isinstance(v, torch.Tensor) and not k.startswith("qmap")
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="vocabulary 2048, width 128, 2 layers")
    args = ap.parse_args(argv)
    vocab, dim, layers = (2048, 128, 2) if args.small else (8192, 256, 4)
    torch.manual_seed(0)
    model = TinyGPT(vocab, dim, layers, context=128)
    places = dict(model.named_parameters(remove_duplicate=False))  # both names of the tied weight
    distinct = {id(p): p for p in places.values()}
    size = {name: p.numel() for name, p in places.items()}
    n_all = sum(p.numel() for p in distinct.values())
    n_big = sum(p.numel() for p in distinct.values() if p.numel() >= MIN_SIZE)
    print(
        f"TinyGPT(vocab={vocab}, dim={dim}, layers={layers}): {len(places)} places, "
        f"{len(distinct)} distinct parameters ({n_all:,} numbers; {n_big:,} in arrays of >= {MIN_SIZE})"
    )
    print()
    print(
        "| state | bytes/param, arrays >= min_size | bytes/param, whole model | state, MiB | drop-in check |"
    )
    print("|---|---|---|---|---|")
    with torch.no_grad():
        for name, make in RULES.items():
            per_place = state_bytes(opt.setup(make(), places))
            if len(per_place) != len(distinct):
                raise AssertionError(f"{name}: {len(per_place)} states for {len(distinct)} distinct arrays")
            big = sum(b for place, b in per_place.items() if size[place] >= MIN_SIZE)
            total = sum(per_place.values())
            fmt = name.rpartition(", ")[2]
            check = ""
            if fmt in DROP_INS:
                same = drop_in_bytes(DROP_INS[fmt], model) == total
                check = f"{DROP_INS[fmt].__name__}: {'same bytes' if same else 'DIFFERENT'}"
            print(f"| {name} | {big / n_big:.4f} | {total / n_all:.4f} | {total / 2**20:.2f} | {check} |")


if __name__ == "__main__":
    main()
