"""`LowBit(AdamW())` under `jax.jit` against `optax.adamw`: time of one training step.

    python benchmarks/low_bit_jax.py                  # both models, about a minute on 2 CPUs
    python benchmarks/low_bit_jax.py --steps 10 --repeats 3

Each row times one jitted step (`optimisers.update`, or optax's `update` and `apply_updates`),
state and parameters donated to both, outputs fed back in, on the same parameters and gradients:

- one array: a single float32 array of 2048 × 2048 (4M elements);
- blocks: a nested pytree of 12 transformer-like blocks (width 128: attention `qkv` and `out`, an
  MLP `up` and `down`, two norms), 2.4M elements in 72 arrays; the norms stay in float32
  (below `min_size`).

The time of a row is the median over `--repeats` runs of the mean of `--steps` steps, after a
warm-up step (which compiles), the rows of a model run in turn; ratio = the row's time /
optax.adamw's, measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

try:
    import optimisers as opt
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import optimisers as opt

LR, WEIGHT_DECAY = 1e-3, 1e-2


def one_array():
    return {"w": jax.random.normal(jax.random.key(0), (2048, 2048))}


def blocks(n=12, width=128):
    keys = iter(jax.random.split(jax.random.key(1), 6 * n))

    def w(*shape):
        return jax.random.normal(next(keys), shape) * 0.02

    return {
        "blocks": [
            {
                "attn": {"qkv": w(width, 3 * width), "out": w(width, width)},
                "mlp": {"up": w(width, 4 * width), "down": w(4 * width, width)},
                "norm1": jnp.ones(width),
                "norm2": jnp.ones(width),
            }
            for _ in range(n)
        ]
    }


def gradients_like(params):
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    grads = [jax.random.normal(k, x.shape) * 1e-2 for k, x in zip(keys, leaves)]
    return jax.tree_util.tree_unflatten(treedef, grads)


def optax_step():
    tx = optax.adamw(LR, weight_decay=WEIGHT_DECAY)

    def step(state, params, grads):
        updates, state = tx.update(grads, state, params)
        return state, optax.apply_updates(params, updates)

    return tx.init, step


def ours_step(bits):
    rule = opt.AdamW(LR, lambd=WEIGHT_DECAY)
    if bits is not None:
        rule = opt.LowBit(rule, bits=bits)
    return (lambda params: opt.setup(rule, params)), opt.update


def runner(init, step, make_params, grads, steps: int):
    """A function that runs `steps` jitted steps and returns the mean seconds a step; compiled."""
    jitted = jax.jit(step, donate_argnums=(0, 1))
    params = make_params()
    carry = [init(params), params]
    carry[:] = jitted(*carry, grads)  # compiles
    jax.block_until_ready(carry)

    def run() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            carry[:] = jitted(*carry, grads)
        jax.block_until_ready(carry)
        return (time.perf_counter() - start) / steps

    return run


ROWS = [
    ("optax.adamw", optax_step),
    ("AdamW (float32 state)", lambda: ours_step(None)),
    ("LowBit(AdamW), 8-bit", lambda: ours_step(8)),
    ("LowBit(AdamW), 4-bit", lambda: ours_step(4)),
    ('LowBit(AdamW), "fp8"', lambda: ours_step("fp8")),
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--only", choices=["one array", "blocks"], default=None)
    args = parser.parse_args(argv)
    models = [("one array", one_array), ("blocks", blocks)]
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; median ms per step")
    print("| model | step | ms | / optax.adamw |")
    print("|---|---|---|---|")
    for model_name, make_params in models:
        if args.only and model_name != args.only:
            continue
        grads = gradients_like(make_params())
        runs = {name: runner(*make(), make_params, grads, args.steps) for name, make in ROWS}
        times: dict = {name: [] for name in runs}
        for _ in range(args.repeats):  # rows in turn: a change in the machine's load hits them all
            for name, run in runs.items():
                times[name].append(run())
        base = statistics.median(times[ROWS[0][0]])
        for name, ts in times.items():
            t = statistics.median(ts)
            print(f"| {model_name} | {name} | {t * 1e3:.2f} | {t / base:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
