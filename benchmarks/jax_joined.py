"""Why JAX's State is not joined inside the jitted step: XLA's compile time of arrays joined into
one and sliced back out, against one fused loop per array.

    python benchmarks/jax_joined.py                    # 250, 500 and 1000 arrays; a few minutes
    python benchmarks/jax_joined.py --arrays 100 200   # quicker

For each count of float32 arrays of 256 elements, one run, seconds to lower and compile:

- join: `jnp.concatenate` of the arrays;
- slice: the arrays cut back out of one joined array;
- Adam per array: one Adam step per array (what `optimisers` and optax compile);
- Adam joined: flat moments and the gradients joined inside the step, the parameters sliced
  back out (a State of a handful of leaves), and its step's median milliseconds next to the
  per-array step's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

SIZE = 256


def _compile(f, *args, donate=()):
    t0 = time.perf_counter()
    compiled = jax.jit(f, donate_argnums=donate).lower(*args).compile()
    return compiled, time.perf_counter() - t0


def _adam(p, m, v, g, t):
    m = 0.9 * m + 0.1 * g
    v = 0.999 * v + 0.001 * g * g
    return p - 1e-3 * (m / (1 - 0.9**t)) / (jnp.sqrt(v / (1 - 0.999**t)) + 1e-8), m, v


def _step_ms(compiled, args, grads, repeats=20):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        args = compiled(*args, grads, 1.0)
        jax.block_until_ready(args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(n: int) -> dict:
    rng = np.random.default_rng(0)
    arrays = [jnp.asarray(rng.standard_normal(SIZE).astype(np.float32)) for _ in range(n)]
    grads = [jnp.asarray(rng.standard_normal(SIZE).astype(np.float32)) for _ in range(n)]
    cuts = np.arange(SIZE, SIZE * n, SIZE)

    def per_array(ps, ms, vs, gs, t):
        return tuple(map(list, zip(*(_adam(p, m, v, g, t) for p, m, v, g in zip(ps, ms, vs, gs)))))

    def joined(ps, m, v, gs, t):
        p, m, v = _adam(jnp.concatenate(ps), m, v, jnp.concatenate(gs), t)
        return jnp.split(p, cuts), m, v

    zeros = [jnp.zeros(SIZE) for _ in range(n)]
    _, join_s = _compile(jnp.concatenate, arrays)
    _, slice_s = _compile(lambda flat: jnp.split(flat, cuts), jnp.zeros(SIZE * n))
    each, each_s = _compile(per_array, arrays, zeros, zeros, grads, 1.0, donate=(0, 1, 2))
    flat, flat_s = _compile(joined, arrays, jnp.zeros(SIZE * n), jnp.zeros(SIZE * n), grads, 1.0,
                            donate=(0, 1, 2))
    copies = lambda xs: [jnp.array(x) for x in xs]  # noqa: E731 - fresh buffers to donate
    each_ms = _step_ms(each, (copies(arrays), copies(zeros), copies(zeros)), grads)
    flat_ms = _step_ms(flat, (copies(arrays), jnp.zeros(SIZE * n), jnp.zeros(SIZE * n)), grads)
    return {"join": join_s, "slice": slice_s, "each": each_s, "flat": flat_s,
            "each_ms": each_ms, "flat_ms": flat_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arrays", type=int, nargs="+", default=[250, 500, 1000])
    args = parser.parse_args()
    print(f"jax {jax.__version__}, arrays of {SIZE} float32; compile seconds, step median ms")
    print(f"{'arrays':>7} {'join s':>7} {'slice s':>8} {'Adam each s':>12} {'Adam joined s':>14} "
          f"{'each ms':>8} {'joined ms':>10}")
    for n in args.arrays:
        r = measure(n)
        print(f"{n:>7} {r['join']:>7.2f} {r['slice']:>8.2f} {r['each']:>12.2f} {r['flat']:>14.2f} "
              f"{r['each_ms']:>8.2f} {r['flat_ms']:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
