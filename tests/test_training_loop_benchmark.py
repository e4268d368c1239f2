"""Smoke test of benchmarks/training_loop.py (benchmarks/ itself is not collected): its smallest
run prints, for every rule, torch.optim's fused step as the 1.00 anchor and our drop-in's ratio,
after backward and back to back."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_smallest_run_prints_every_rule_against_torch_fused():
    argv = ["--width", "32", "--blocks", "2", "--batch", "4", "--rounds", "2", "--steps", "2"]
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "training_loop.py"), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    body = [r for r in rows if r[0] != "rule"]
    assert {r[0] for r in body} == {"SGD momentum", "SGD nesterov", "Adagrad", "AdamW"}
    for _, kind, after, after_ratio, alone, alone_ratio in body:
        assert float(after) > 0 and float(alone) > 0
        if kind == "torch.optim fused":
            assert after_ratio == alone_ratio == "1.00×"
        else:
            assert kind == "optimisers drop-in" and float(after_ratio[:-1]) > 0
