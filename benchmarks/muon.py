"""One Muon step on the hidden matrices of GPT-2 small (per layer: attention c_attn 768×2304, its
projection 768×768, the MLP's 768×3072 and 3072×768), ours against torch.optim.Muon and against
optax.contrib.muon under `jax.jit`, at the same settings.

    python benchmarks/muon.py                         # 12 layers of d_model 768
    python benchmarks/muon.py --layers 1 --threads 1  # one layer: what a small CPU can time
    python benchmarks/muon.py --dim 256               # the same layout at d_model 256

torch.optim.Muon's matrix products are bfloat16, which a CPU without bfloat16 matrix units
computes far more slowly than float32: on such a CPU the full size takes long, so time fewer
layers (the work per layer is the same, so the ratios carry over).

PyTorch rows (torch's defaults: nesterov, lr 0.02, weight decay 0.1): `torch.optim.Muon`, the
drop-in `optimisers.torch.Muon` and `optimisers.update_` on the list of tensors. torch runs
Newton–Schulz in bfloat16, we in float32: the same number of matrix products, in other
arithmetic. JAX rows (the settings where optax.contrib.muon computes our steps: nesterov=False,
eps 1e-7, dimension numbers (1, 0), weight decay 0.1): `optax.contrib.muon` and
`optimisers.update`, each one jitted step (compiled before timing). Gradients are made once; the
implementations are timed in interleaved rounds (one step of each per round, after a warm-up), so
a shared machine's slow spells hit them all alike; the table gives each median and its ratio to
the peer of its backend, measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

try:
    import optimisers
    import optimisers.torch as ot
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import optimisers
    import optimisers.torch as ot

LR, DECAY = 0.02, 0.1


def gpt2_matrices(layers: int, d: int) -> list[np.ndarray]:
    """The hidden matrices of GPT-2 (Conv1D layout, (in, out)): per layer c_attn, attn.c_proj,
    mlp.c_fc and mlp.c_proj."""
    rng = np.random.default_rng(0)
    shapes = [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)] * layers
    return [(0.02 * rng.standard_normal(s)).astype(np.float32) for s in shapes]


def gradients(values: list[np.ndarray]) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [(1e-2 * rng.standard_normal(v.shape)).astype(np.float32) for v in values]


def torch_steps(values, grads) -> dict:
    """name -> a function taking one step, for the PyTorch rows."""

    def params():
        ps = [torch.nn.Parameter(torch.tensor(v)) for v in values]
        for p, g in zip(ps, grads):
            p.grad = torch.tensor(g)
        return ps

    theirs = torch.optim.Muon(params(), lr=LR, weight_decay=DECAY)
    dropin = ot.Muon(params(), lr=LR, weight_decay=DECAY)
    model = [torch.tensor(v) for v in values]
    tensor_grads = [torch.tensor(g) for g in grads]
    state = optimisers.setup(optimisers.Muon(LR, lambd=DECAY), model)

    def functional():
        optimisers.update_(state, model, tensor_grads)

    return {
        "torch.optim.Muon": theirs.step,
        "optimisers.torch.Muon": dropin.step,
        "optimisers.update_ (torch)": functional,
    }


def jax_steps(values, grads) -> dict:
    """name -> a function taking one jitted step, for the JAX rows (compiled here)."""
    import jax
    import jax.numpy as jnp
    import optax

    params = [jnp.asarray(v) for v in values]
    jgrads = [jnp.asarray(g) for g in grads]
    tx = optax.contrib.muon(
        LR,
        eps=1e-7,
        weight_decay=DECAY,
        nesterov=False,
        muon_weight_dimension_numbers=optax.contrib.MuonDimensionNumbers(1, 0),
    )

    @jax.jit
    def optax_step(state, p, g):
        updates, state = tx.update(g, state, p)
        return state, optax.apply_updates(p, updates)

    ours_step = jax.jit(optimisers.update)
    holder = {
        "optax": (tx.init(params), params),
        "ours": (optimisers.setup(optimisers.Muon(LR, lambd=DECAY, nesterov=False), params), params),
    }

    def run_optax():
        holder["optax"] = jax.block_until_ready(optax_step(*holder["optax"], jgrads))

    def run_ours():
        holder["ours"] = jax.block_until_ready(ours_step(*holder["ours"], jgrads))

    return {"optax.contrib.muon (jit)": run_optax, "optimisers.update (jax.jit)": run_ours}


def batching_steps(values) -> tuple[dict, dict]:
    """The Newton–Schulz iterations alone, per matrix against one batched iteration per shape
    (the matrices of a shape stacked): does batching pay where the library steps each matrix on
    its own? (It did not on CPU, so the library has no batched path.)"""
    import jax
    import jax.numpy as jnp

    from optimisers.rules.muon import NS_COEFFICIENTS, newton_schulz

    def by_shape(arrays):
        out: dict = {}
        for a in arrays:
            out.setdefault(tuple(a.shape), []).append(a)
        return out

    def each(groups):
        return [newton_schulz(m, NS_COEFFICIENTS, 5, 1e-7) for ms in groups.values() for m in ms]

    def stacked(groups, stack):
        return [newton_schulz(stack(ms), NS_COEFFICIENTS, 5, 1e-7) for ms in groups.values()]

    tensors = by_shape([torch.tensor(v) for v in values])
    arrays = by_shape([jnp.asarray(v) for v in values])
    jax_each, jax_stacked = jax.jit(each), jax.jit(lambda g: stacked(g, jnp.stack))
    on_torch = {
        "torch, per matrix": lambda: each(tensors),
        "torch, batched": lambda: stacked(tensors, torch.stack),
    }
    on_jax = {
        "jax.jit, per matrix": lambda: jax.block_until_ready(jax_each(arrays)),
        "jax.jit, batched": lambda: jax.block_until_ready(jax_stacked(arrays)),
    }
    return on_torch, on_jax


def measure(steps: dict, rounds: int) -> dict[str, float]:
    """Median milliseconds per step of each function, timed in interleaved rounds."""
    for step in steps.values():  # warm-up: state made, programs compiled
        step()
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12, help="transformer layers (default 12)")
    parser.add_argument("--dim", type=int, default=768, help="d_model (default 768, GPT-2 small)")
    parser.add_argument("--rounds", type=int, default=7, help="timed steps per implementation")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--no-jax", action="store_true", help="PyTorch rows only")
    parser.add_argument(
        "--batching", action="store_true", help="also time Newton–Schulz per matrix against batched"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    values = gpt2_matrices(args.layers, args.dim)
    grads = gradients(values)
    count = sum(v.size for v in values)
    print(
        f"{args.layers} layers of d_model {args.dim}: {len(values)} matrices, {count / 1e6:.1f}M parameters; "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), {args.rounds} rounds"
    )
    rows = [("torch.optim.Muon", measure(torch_steps(values, grads), args.rounds))]
    if not args.no_jax:
        rows.append(("optax.contrib.muon (jit)", measure(jax_steps(values, grads), args.rounds)))
    if args.batching:
        on_torch, on_jax = batching_steps(values)
        rows.append(("torch, per matrix", measure(on_torch, args.rounds)))
        rows.append(("jax.jit, per matrix", measure(on_jax, args.rounds)))
    print(f"{'implementation':<30} {'median ms':>10} {'x peer':>7}")
    for peer, medians in rows:
        for name, ms in medians.items():
            print(f"{name:<30} {ms:>10.1f} {ms / medians[peer]:>7.2f}")


if __name__ == "__main__":
    main()
