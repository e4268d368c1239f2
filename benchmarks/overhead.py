"""Per-step overhead: models whose arithmetic is negligible, so a step costs what the library does
per array (walking the model, the checks on every gradient, grouping) and per model.

    python benchmarks/overhead.py            # about two minutes
    python benchmarks/overhead.py --steps 50
    python benchmarks/overhead.py --quick    # tiny sizes, a few steps: a smoke run

Run it from two checkouts (`PYTHONPATH=other/src`) to see what a change costs per array.

Rows, each an Adam step, median over `--steps` steps after warm-up. Stepped back to back, with the
same gradient tensors every step:
- tiny: 1000 arrays of 16 elements (NumPy and PyTorch `update_`; torch.optim Adam foreach and
  fused on the same tensors);
- frozen backbone: a PyTorch model of 200 frozen Linear+GELU blocks and one trained Linear
  (`update_` against torch.optim fused Adam on the trained parameters); what is not trained must
  cost nothing per step;
- flat: 4000 PyTorch parameters of 256 elements after `optimisers.torch.flatten_` (`update_` and
  the drop-in `optimisers.torch.Adam`), beside torch.optim's fused Adam on one tensor of all
  their elements (what a step of the buffer costs) and on the 4000 tensors.

Stepped as in training, in one interleaved run (each round steps every row of the section once,
the first row rotating; medians over the rounds, and the paired ratios as the median of the
per-round ratios): before each step, untimed, every parameter gets a new `.grad` tensor (as
`zero_grad()` then `backward()` make them) and the caches are made cold (every core reads and
writes a 64 MiB buffer, more than the last-level cache, as forward and backward passes do):
- nested: the 4000 arrays of 256 as an nn.Module of ModuleLists and ModuleDicts (200 blocks of
  20 parameters), `update_(state, model, optimisers.grads(model))`; the same tensors as a flat
  list (`update_` with `[p.grad for p in params]`); the drop-in `optimisers.torch.Adam` and
  torch.optim's fused Adam on `model.parameters()`;
- tied: a 145-tensor model (an embedding tied to the LM head, 72 Linear blocks) stepped with
  `optimisers.grads(model)` (None at the head's place), its untied twin (146 tensors) stepped the
  same way, and the drop-in and torch.optim's fused Adam on the tied model;
- flat, cold: the flat model's rows (their `.grad` views are kept: backward writes them in place)
  beside `update_` on ONE tensor of the same elements, and NumPy `update_` on views of one
  buffer beside one NumPy array of the same elements.

The ratio column divides by torch.optim's fused Adam on the same model, measured in the same run.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
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


# --- stepped as in training: new gradient tensors, cold cache, interleaved rounds ------------------


class Evict:
    """Every core reads and writes a buffer larger than the last-level cache (the first chunk on
    the calling thread), so that a step finds none of its data in cache; as `optimisers bench`
    does for its cold rows (kept here so that the script runs against an older checkout)."""

    def __init__(self, mib: int = 64):
        threads = os.cpu_count() or 1
        buffer = np.zeros(mib * 2**20 // 4, np.float32)
        step = -(-buffer.size // threads)
        self.chunks = [buffer[lo : lo + step] for lo in range(0, buffer.size, step)]
        self.pool = ThreadPoolExecutor(max_workers=max(1, threads - 1))

    def __call__(self) -> None:
        futures = [self.pool.submit(np.add, c, np.float32(1), out=c) for c in self.chunks[1:]]
        np.add(self.chunks[0], np.float32(1), out=self.chunks[0])
        for f in futures:
            f.result()


def new_grads(params, values):
    """What `zero_grad()` then `backward()` leave: a new `.grad` tensor for every parameter."""

    def prepare():
        for p, v in zip(params, values):
            p.grad = v.clone()

    return prepare


def interleaved(rows, rounds: int, evict) -> dict:
    """`rows`: (name, prepare or None, step). Every round steps each row once, untimed `prepare`
    and `evict` before each step, the first row rotating from round to round. Returns name ->
    the list of its step times in seconds (one per round, in round order)."""
    for _ in range(3):  # warm-up: first steps, lazy imports
        for _, prepare, step in rows:
            if prepare is not None:
                prepare()
            step()
    times: dict = {name: [] for name, _, _ in rows}
    for k in range(rounds):
        for name, prepare, step in rows[k % len(rows):] + rows[: k % len(rows)]:
            if prepare is not None:
                prepare()
            evict()
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return times


def paired(times: dict, over: str, under: str) -> float:
    """The median of the per-round ratios over/under."""
    return statistics.median(a / b for a, b in zip(times[over], times[under]))


class Leaves(torch.nn.Module):
    """A module holding vectors of `n` elements by name (a Linear's weight and bias, a norm's)."""

    def __init__(self, n: int, *names: str):
        super().__init__()
        for name in names:
            self.register_parameter(name, torch.nn.Parameter(torch.randn(n) * 0.02))


def nested_block(n: int) -> torch.nn.Module:
    """20 vectors in dicts and lists, as a transformer block nests them (the bench's S3-nested)."""
    def wb():
        return Leaves(n, "weight", "bias")

    return torch.nn.ModuleDict({
        "attn": torch.nn.ModuleDict({k: wb() for k in ("q", "k", "v", "o")}),
        "mlp": torch.nn.ModuleList([wb(), wb()]),
        "norms": torch.nn.ModuleList([wb(), wb()]),
        "extra": Leaves(n, "scale", "shift"),
        "gate": wb(),
    })


def nested(rounds: int, evict, blocks: int = 200) -> list[tuple[str, float]]:
    from optimisers.torch import Adam

    torch.manual_seed(0)
    root = torch.nn.ModuleDict({"blocks": torch.nn.ModuleList([nested_block(256) for _ in range(blocks)])})
    models = [root]
    models += [copy.deepcopy(models[0]) for _ in range(3)]
    values = [torch.randn_like(p) * 0.01 for p in models[0].parameters()]
    tree, listed, drop_in, fused = models
    listed = [torch.nn.Parameter(p.detach().clone()) for p in listed.parameters()]
    box = {"tree": [opt.setup(opt.Adam(1e-3), tree), tree],
           "list": [opt.setup(opt.Adam(1e-3), listed), listed]}

    def step_tree():
        box["tree"] = list(opt.update_(box["tree"][0], box["tree"][1], opt.grads(box["tree"][1])))

    def step_list():
        box["list"] = list(opt.update_(box["list"][0], box["list"][1], [p.grad for p in listed]))

    rows = [
        ("optimisers update_, opt.grads", new_grads(list(tree.parameters()), values), step_tree),
        ("optimisers update_, flat list", new_grads(listed, values), step_list),
        ("optimisers Adam (drop-in)", new_grads(list(drop_in.parameters()), values),
         Adam(drop_in.parameters(), lr=1e-3).step),
        ("torch.optim Adam fused", new_grads(list(fused.parameters()), values),
         torch.optim.Adam(fused.parameters(), lr=1e-3, fused=True).step),
    ]
    times = interleaved(rows, rounds, evict)
    out = [(name, statistics.median(t) * 1e3) for name, t in times.items()]
    out.append(("nested / flat list, paired", paired(times, rows[0][0], rows[1][0])))
    return out


class TiedLM(torch.nn.Module):
    """An embedding, `blocks` Linear layers and an LM head whose weight IS the embedding's when
    `tied` (1 + 2 x blocks tensors; one more untied)."""

    def __init__(self, vocab: int, d: int, blocks: int, tied: bool):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(d, d) for _ in range(blocks)])
        self.head = torch.nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight


def tied(rounds: int, evict, blocks: int = 72) -> list[tuple[str, float]]:
    from optimisers.torch import Adam

    torch.manual_seed(0)
    models = [TiedLM(512, 64, blocks, tied=True) for _ in range(3)] + [TiedLM(512, 64, blocks, tied=False)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    values = [torch.randn_like(p) * 0.01 for p in models[0].parameters()]
    untied_values = [torch.randn_like(p) * 0.01 for p in models[3].parameters()]
    box = {k: [opt.setup(opt.Adam(1e-3), m), m] for k, m in (("tied", models[0]), ("untied", models[3]))}

    def stepper(key):
        def step():
            box[key] = list(opt.update_(box[key][0], box[key][1], opt.grads(box[key][1])))

        return step

    rows = [
        ("optimisers update_, opt.grads, tied", new_grads(list(models[0].parameters()), values),
         stepper("tied")),
        ("optimisers update_, opt.grads, untied", new_grads(list(models[3].parameters()), untied_values),
         stepper("untied")),
        ("optimisers Adam (drop-in), tied", new_grads(list(models[1].parameters()), values),
         Adam(models[1].parameters(), lr=1e-3).step),
        ("torch.optim Adam fused", new_grads(list(models[2].parameters()), values),
         torch.optim.Adam(models[2].parameters(), lr=1e-3, fused=True).step),
    ]
    times = interleaved(rows, rounds, evict)
    out = [(name, statistics.median(t) * 1e3) for name, t in times.items()]
    out.append(("tied / untied, paired", paired(times, rows[0][0], rows[1][0])))
    return out


def flat_cold(rounds: int, evict, n: int = 4000) -> list[tuple[str, float]]:
    from optimisers.torch import Adam, flatten_

    torch.manual_seed(0)
    values = [torch.randn(256) * 0.02 for _ in range(n)]
    grads = [torch.randn(256) * 0.01 for _ in range(n)]
    sets = [[torch.nn.Parameter(v.clone()) for v in values] for _ in range(3)]
    for params in sets[:2]:
        flatten_(params)
        for p, g in zip(params, grads):
            p.grad.copy_(g)
    for p, g in zip(sets[2], grads):
        p.grad = g.clone()
    flat, drop_in, separate = sets
    ones = [torch.nn.Parameter(torch.cat(values)) for _ in range(3)]
    for one in ones:
        one.grad = torch.cat(grads)
    np_values = np.concatenate([v.numpy() for v in values])
    np_grads = np.concatenate([g.numpy() for g in grads])
    np_flat, np_flat_grads = np_values.copy(), np_grads.copy()
    np_views = [np_flat[i * 256 : (i + 1) * 256] for i in range(n)]
    np_grad_views = [np_flat_grads[i * 256 : (i + 1) * 256] for i in range(n)]
    box = {}

    def stepper(key, model, grads):
        box[key] = [opt.setup(opt.Adam(1e-3), model), model]

        def step():
            box[key] = list(opt.update_(box[key][0], box[key][1], grads))

        return step

    rows = [
        ("optimisers update_, flatten_", None, stepper("flat", flat, [p.grad for p in flat])),
        ("optimisers update_, 1 tensor", None, stepper("one", [ones[0]], [ones[0].grad])),
        ("optimisers Adam (drop-in), flatten_", None, Adam(drop_in, lr=1e-3).step),
        ("optimisers Adam (drop-in), 1 tensor", None, Adam([ones[1]], lr=1e-3).step),
        ("optimisers update_, NumPy views", None, stepper("np", np_views, np_grad_views)),
        ("optimisers update_, NumPy 1 array", None, stepper("np one", [np_values.copy()], [np_grads])),
        ("torch.optim Adam fused, 1 tensor", None, torch.optim.Adam([ones[2]], lr=1e-3, fused=True).step),
        ("torch.optim Adam fused", None, torch.optim.Adam(separate, lr=1e-3, fused=True).step),
    ]
    times = interleaved(rows, rounds, evict)
    out = [(name, statistics.median(t) * 1e3) for name, t in times.items()]
    pairs = (("update_: flatten_ / 1 tensor", 0, 1), ("drop-in: flatten_ / 1 tensor", 2, 3),
             ("NumPy: views / 1 array", 4, 5))
    for label, many, single in pairs:
        out.append((f"{label}, paired", paired(times, rows[many][0], rows[single][0])))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps (rounds) per row (default 200)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 5 steps, and the cold sections at a fortieth of their size")
    args = parser.parse_args(argv)
    steps = 5 if args.quick else args.steps
    torch.set_num_threads(1)  # overhead, not arithmetic: one thread keeps the rows comparable
    print(f"{'model':<24} {'implementation':<40} {'median ms':>10} {'x fused':>8}")
    models = {"tiny (1000 x 16)": tiny, "frozen backbone": frozen_backbone, "flat (4000 x 256)": flat}
    for name, rows in ((name, run(steps)) for name, run in models.items()):
        fused = dict(rows)["torch.optim Adam fused"]
        for impl, ms in rows:
            print(f"{name:<24} {impl:<40} {ms:>10.3f} {ms / fused:>8.3f}")
    evict = Evict(64)
    print("\nstepped as in training: new .grad tensors before every step, cold cache (64 MiB touched "
          "by every core before every step), rows interleaved")
    blocks, layers, arrays = (5, 4, 100) if args.quick else (200, 72, 4000)
    cold = {f"nested ({blocks * 20} x 256)": lambda: nested(steps, evict, blocks),
            f"tied ({2 * layers + 1} tensors)": lambda: tied(steps, evict, layers),
            f"flat, cold ({arrays} x 256)": lambda: flat_cold(steps, evict, arrays)}
    for name, run in cold.items():
        rows = run()
        fused = dict(rows)["torch.optim Adam fused"]
        for impl, ms in rows:
            if impl.endswith(", paired"):
                print(f"{name:<24} {impl:<40} {'':>10} {ms:>8.3f}")
            else:
                print(f"{name:<24} {impl:<40} {ms:>10.3f} {ms / fused:>8.3f}")


if __name__ == "__main__":
    main()
