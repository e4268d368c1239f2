"""The JAX State against optax's Adam state, at many arrays: what every jitted step pays in Python.

    python benchmarks/jax_state.py                 # 5000 arrays; about a minute
    python benchmarks/jax_state.py --arrays 1000 --repeats 5
    python benchmarks/jax_state.py --profile unflatten   # cProfile of one of the rows, ours

Rows (median milliseconds over `--repeats` runs after one warm-up; ratio = ours / optax's, both
measured in this run, on the same parameters: `--arrays` float32 arrays of 16 elements):

- setup: `optimisers.setup(Adam(), params)` against `optax.adam(1e-3).init(params)`;
- setup includes planning the State's flatten (on JAX, `setup` flattens the new State once);
- flatten (fresh): `jax.tree_util.tree_flatten` of a State that `setup` returned, not flattened
  by anything since (the first jitted call pays this);
- flatten (again): of that State once flattened before (it keeps what flattening gave while it
  is unchanged: a second call with it, or `jit` flattening it again for argument names);
- flatten (after a step): of a State that `tree_unflatten` made (every later jitted call pays this);
- unflatten: `tree_unflatten(treedef, leaves)` (every jitted call pays it for its output, and
  once more under tracing);
- trace: `jax.jit(step).trace(state, params, grads)` of one training step (Adam update and the new
  parameters), without compiling, of a State that has been flattened before;
- trace (fresh): the same, with a State fresh from `setup` (the first step of training).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import jax
import optax

try:
    import optimisers as opt
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import optimisers as opt


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def first_flatten(init, repeats: int):
    """Flattening, each run, a state that `init` made beforehand and nothing flattened yet."""
    states = iter([init() for _ in range(repeats + 1)])
    return lambda: jax.tree_util.tree_flatten(next(states))


def rows(arrays: int, repeats: int) -> list[tuple[str, object, object]]:
    """`(name, our function, optax's function)` for each row."""
    keys = jax.random.split(jax.random.key(0), arrays)
    params = {f"layer{i}": jax.random.normal(k, (16,)) for i, k in enumerate(keys)}
    grads = jax.tree.map(lambda x: x * 0.5, params)
    tx = optax.adam(1e-3)

    ours_state = opt.setup(opt.Adam(1e-3), params)
    theirs_state = tx.init(params)
    ours_leaves, ours_def = jax.tree_util.tree_flatten(ours_state)
    theirs_leaves, theirs_def = jax.tree_util.tree_flatten(theirs_state)
    ours_made = jax.tree_util.tree_unflatten(ours_def, ours_leaves)
    theirs_made = jax.tree_util.tree_unflatten(theirs_def, theirs_leaves)

    def ours_step(state, params, grads):
        return opt.update(state, params, grads)

    def theirs_step(state, params, grads):
        updates, state = tx.update(grads, state, params)
        return state, optax.apply_updates(params, updates)

    def trace(step, state):
        # a fresh jit each time: tracing is what is measured, not the cache
        return lambda: jax.jit(step).trace(state, params, grads)

    def trace_first(step, init):
        # the first step of training: a State fresh from setup, never flattened before
        states = iter([init() for _ in range(repeats + 1)])
        return lambda: jax.jit(step).trace(next(states), params, grads)

    return [
        ("setup", lambda: opt.setup(opt.Adam(1e-3), params), lambda: tx.init(params)),
        (
            "flatten (fresh)",
            # a State never flattened before (one per run, made beforehand): nothing kept yet
            first_flatten(lambda: opt.setup(opt.Adam(1e-3), params), repeats),
            first_flatten(lambda: tx.init(params), repeats),
        ),
        (
            "flatten (again)",
            lambda: jax.tree_util.tree_flatten(ours_state),  # from setup, flattened before
            lambda: jax.tree_util.tree_flatten(theirs_state),
        ),
        (
            "flatten (after a step)",
            lambda: jax.tree_util.tree_flatten(ours_made),
            lambda: jax.tree_util.tree_flatten(theirs_made),
        ),
        (
            "unflatten",
            lambda: jax.tree_util.tree_unflatten(ours_def, ours_leaves),
            lambda: jax.tree_util.tree_unflatten(theirs_def, theirs_leaves),
        ),
        ("trace", trace(ours_step, ours_state), trace(theirs_step, theirs_state)),
        (
            "trace (fresh)",
            trace_first(ours_step, lambda: opt.setup(opt.Adam(1e-3), params)),
            trace_first(theirs_step, lambda: tx.init(params)),
        ),
    ]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arrays", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--profile", default=None, help="a row name: print a cProfile of ours")
    args = parser.parse_args(argv)
    table = rows(args.arrays, args.repeats)
    if args.profile:
        fn = {name: ours for name, ours, _ in table}[args.profile]
        fn()
        profile = cProfile.Profile()
        profile.runcall(fn)
        pstats.Stats(profile).sort_stats("cumulative").print_stats(25)
        return
    print(f"JAX State vs optax.adam state, {args.arrays} arrays of 16 float32, median of {args.repeats}")
    print(f"{'row':<24}{'optimisers ms':>15}{'optax ms':>12}{'ratio':>8}")
    for name, ours, theirs in table:
        a, b = median_ms(ours, args.repeats), median_ms(theirs, args.repeats)
        print(f"{name:<24}{a:>15.2f}{b:>12.2f}{a / b:>8.2f}")


if __name__ == "__main__":
    main()
