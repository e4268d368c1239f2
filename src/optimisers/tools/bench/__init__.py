"""`optimisers bench`: one optimiser step of `optimisers.update_` against torch.optim, optax and a
naive NumPy loop, with the memory-bandwidth floor measured on the same machine in the same run.

    optimisers bench                 # full run, a few minutes on 2 cores
    optimisers bench --quick         # smaller S1/S2/S3, fewer repeats: about a minute
    optimisers bench --json out.json --backends numpy,torch --shapes S1,S3 --rules adam
    optimisers bench --quick --rules lamb,lars,adopt,ademamix,lookahead,adafactor   # or --rules all

What is measured (benchmarks/README.md in the repository explains every column):

- the bandwidth floor: a NumPy copy and triad over arrays much larger than the last-level cache,
  split into one contiguous chunk per core and run on threads (`bandwidth`);
- for each shape (S1 one big tensor, S2 a GPT-like tree of 148 tensors, S2-tied the same with the
  token embedding tied to the LM head, S3 4000 tensors of 256; `models`) and rule (Adam, AdamW,
  Momentum by default; `--rules` picks from the table in `rules`, one entry per rule with its
  peers): the time and peak memory of one step of every implementation that has the rule
  (`implementations`, `timing`, `memory`), after checking that every implementation gives the
  same parameters as a float64 reference after a few steps;
- the ratios worth a few percent, again with the two runners stepped in alternation (S2-tied
  against S2, and for Adam `optimisers` against its peer on S1 and S2), since rows timed a minute
  apart on a shared machine differ by more than that.

The report (`report`) ends with the Adam ratios of `optimisers` to torch.optim and optax.
"""

from .command import build_parser, main

__all__ = ["build_parser", "main"]
