"""Smoke test of benchmarks/muon.py (benchmarks/ itself is not collected): its smallest run
prints a row for every implementation with its ratio to the peer of its backend."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_smallest_run_prints_every_row():
    argv = ["--layers", "1", "--dim", "8", "--rounds", "1", "--threads", "1", "--batching"]
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "muon.py"), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert "1 layers of d_model 8: 4 matrices" in out
    rows = {line[:30].strip(): line.split()[-1] for line in out.splitlines()[2:] if line.strip()}
    for peer in ("torch.optim.Muon", "optax.contrib.muon (jit)", "torch, per matrix", "jax.jit, per matrix"):
        assert rows[peer] == "1.00"
    for ours in ("optimisers.torch.Muon", "optimisers.update_ (torch)", "optimisers.update (jax.jit)"):
        assert float(rows[ours]) > 0
