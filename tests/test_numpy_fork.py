"""A process that stepped NumPy Adam with the compiled kernel on all its threads, then forks (as
`multiprocessing` does by default on Linux): the child trains on, with the parent's numbers.
numba's GNU OpenMP threading layer killed such a child ("fork() called from a process already
using GNU OpenMP") and a Pool waited forever; the kernel now runs on threads of the library's
own, which a child starts anew (and so do the engine's chunks for other rules)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import optimisers
from optimisers.backends import numpy_kernels

pytestmark = pytest.mark.skipif(
    not (numpy_kernels.AVAILABLE and hasattr(os, "fork")), reason="numba's kernel, and fork, are needed"
)

SCRIPT = textwrap.dedent(
    """
    import multiprocessing, sys
    import numpy as np
    import optimisers as opt
    from optimisers.backends import numpy_kernels
    from optimisers.engine import chunks

    # shared out over the threads: the compiled kernel's (Adam), the engine's chunks' (Momentum)
    N = max(4 * numpy_kernels.PARALLEL_FROM, chunks.THREADS_FROM)
    RULE = opt.Adam(1e-2) if sys.argv[1] == "adam" else opt.Momentum(1e-2)


    def grads(k):
        return {"w": np.random.default_rng(k).standard_normal(N).astype(np.float32),
                "small": [np.random.default_rng(k + 9).standard_normal(300).astype(np.float32)] * 2}


    rng = np.random.default_rng(0)
    model = {"w": rng.standard_normal(N).astype(np.float32),
             "small": [rng.standard_normal(300).astype(np.float32) for _ in range(2)]}
    state = opt.setup(RULE, model)
    for k in range(3):
        state, model = opt.update_(state, model, grads(k))


    def train_on(_=None):
        # the same steps in the parent and in each child, from the parent's state
        global state, model
        for k in range(3, 6):
            state, model = opt.update_(state, model, grads(k))
        return [model["w"].copy(), *(x.copy() for x in model["small"])]


    if __name__ == "__main__":
        fork = multiprocessing.get_context("fork")
        with fork.Pool(2) as pool:
            children = pool.map_async(train_on, range(2)).get(timeout=30)
        queue = fork.Queue()
        child = fork.Process(target=lambda: queue.put(train_on()))
        child.start()
        children.append(queue.get(timeout=30))
        child.join(timeout=60)
        mine = train_on()
        same = all(all(np.array_equal(a, b) for a, b in zip(theirs, mine)) for theirs in children)
        print("exit", child.exitcode, "same", same, "children", len(children))
    """
)


@pytest.mark.parametrize("rule", ["adam", "momentum"])
def test_a_forked_child_trains_on_with_the_parents_numbers(tmp_path, rule):
    script = tmp_path / "fork_after_a_step.py"
    script.write_text(SCRIPT)
    src = os.path.dirname(os.path.dirname(optimisers.__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
           "NUMBA_NUM_THREADS": "2"}  # (threads even on one core)
    try:
        done = subprocess.run([sys.executable, str(script), rule], capture_output=True, text=True, env=env,
                              timeout=240)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the forked children never answered: {e.stdout!r} {e.stderr!r}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["exit", "0", "same", "True", "children", "3"], done.stderr
