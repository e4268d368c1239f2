"""`import optimisers` (and using it on NumPy arrays) must not import torch or jax."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
import numpy as np
import optimisers as opt

W = np.ones((3, 2), np.float32)
model = {"a": W, "b": [W, np.zeros(2, np.float32)]}
state = opt.setup(opt.Adam(), model)
grads = {"a": np.ones((3, 2), np.float32), "b": [None, np.ones(2, np.float32)]}
state, model = opt.update(state, model, grads)
state, model = opt.update_(state, model, grads)
flat, rebuild = opt.destructure(model)
rebuild(flat)
opt.trainables(model)
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in ("torch", "jax", "jaxlib"))
assert not loaded, loaded
"""


def test_import_optimisers_does_not_import_torch_or_jax():
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
