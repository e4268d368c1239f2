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
  token embedding tied to the LM head, S3 4000 tensors of 256, S3-nested the same tensors in 200
  blocks of dicts and lists (for PyTorch an nn.Module of ModuleLists and ModuleDicts), S3-one
  their elements as one vector; `models`) and rule (Adam, AdamW, Momentum by default; `--rules`
  picks from the table in `rules`, one entry per rule with its peers): the time and peak memory
  of one step of every implementation that has the rule (`implementations`, `timing`, `memory`),
  after checking that every implementation gives the same parameters as a float64 reference
  after a few steps. PyTorch also has a row stepped as a training loop steps a module: new
  `.grad` tensors before every step, and `update_(state, module, optimisers.grads(module))`;
- a cold cache for the S3 family (`--cache`, `cache`): before each timed step, untimed, every
  core reads and writes a buffer larger than the last-level cache, as the forward and backward
  passes of training do between two steps;
- the ratios worth a few percent, again with the two runners stepped in alternation (S2-tied
  against S2, S3-nested against S3, and for Adam `optimisers` against its peer on S1 and S2),
  since rows timed a minute apart on a shared machine differ by more than that.

After the table, the report (`report`) has a line per rule and shape: our fastest row on each
backend over the floor and over the fastest peer (`--rules all` runs every rule of the table,
every elementwise rule of the library among them). It ends with the Adam ratios of `optimisers`
to torch.optim and optax, of S2-tied to S2 (also stepped with `optimisers.grads`) and of nested S3
to S3, and the cost of each of S3's arrays over S3-one.
"""

from .command import build_parser, main

__all__ = ["build_parser", "main"]
