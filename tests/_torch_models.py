"""Small PyTorch models shared by the torch tests and the DDP worker script (not a test module)."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HIDDEN, CONTEXT = 13, 8, 16, 6


@contextlib.contextmanager
def one_thread():
    """Run torch single-threaded. These tensors are tiny: torch's intra-op threads only add
    overhead here, and they spin on the CPU cores that other test processes need."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class TinyGPT(nn.Module):
    """Token + position embedding, one causal self-attention block and one MLP block, and an LM
    head whose weight *is* the embedding weight (the tie every test here cares about)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(0.1 * torch.randn(CONTEXT, DIM))
        self.norm1 = nn.LayerNorm(DIM)
        # no bias: the key bias would get an exactly-zero gradient (softmax ignores a constant
        # added to all scores), i.e. pure rounding noise, which Adam-like rules scale up to full
        # steps, so two correct optimisers would train it apart
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("causal", torch.ones(CONTEXT, CONTEXT, dtype=torch.bool).tril())

    def forward(self, tokens):
        n = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:n]
        q, k, v = self.qkv(self.norm1(h)).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(DIM)
        scores = scores.masked_fill(~self.causal[:n, :n], float("-inf"))
        h = h + self.proj(scores.softmax(-1) @ v)
        h = h + self.mlp(self.norm2(h))
        return self.head(h)


def make_gpt(dtype=torch.float32, seed=0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT().to(dtype)


def batch(n=8, seed=1):
    """Fixed token data: inputs and next-token targets."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, CONTEXT + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(model, inputs, targets):
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
