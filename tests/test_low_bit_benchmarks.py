"""Smoke test of benchmarks/low_bit_memory.py (benchmarks/ itself is not collected): its small
run prints each format's bytes per parameter, which must be those of the format's layout,
counted here from the model's shapes (codes plus one float32 scale a block, two moments)."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_small_run_prints_the_layouts_bytes_per_parameter():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "low_bit_memory.py"), "--small"],
        capture_output=True, text=True, timeout=600, check=True,
    ).stdout  # fmt: skip
    rows = {
        cells[1].strip(): cells[2:]
        for cells in (line.split("|") for line in out.splitlines())
        if len(cells) > 4
    }
    # the small model's distinct arrays of >= 4096 elements: embedding (tied head), position
    # embedding, per layer qkv, proj, up and down weights (vocab 2048, dim 128, 2 layers)
    vocab, dim, layers, context = 2048, 128, 2, 128
    big = [vocab * dim, context * dim] + [3 * dim * dim, dim * dim, 4 * dim * dim, 4 * dim * dim] * layers
    n = sum(big)
    for name, codes_per_byte, block in (("8-bit", 1, 256), ("FP8", 1, 256), ("4-bit", 2, 128)):
        expected = sum(2 * (math.ceil(k / codes_per_byte) + 4 * math.ceil(k / block)) for k in big) / n
        cells = rows[f"LowBit(AdamW), {name}"]
        assert float(cells[0]) == pytest.approx(expected, abs=1e-4)
        assert "same bytes" in cells[3]
    assert float(rows["AdamW, float32"][0]) == 8.0
    assert float(rows["LowBit(AdamW), 8-bit"][0]) <= 2.04 and float(rows["LowBit(AdamW), 4-bit"][0]) <= 1.07


def test_accuracy_smoke_run_prints_every_run_against_the_reference():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "low_bit_accuracy.py"), "--steps", "3", "--seeds", "1"],
        capture_output=True, text=True, timeout=600, check=True,
    ).stdout  # fmt: skip
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    names = [cells[0].strip() for cells in rows[1:]]
    assert names[0] == "AdamW, float32 (torch.optim)" and rows[1][3].strip() == "+0.00%"
    assert {"AdamW8bit", "AdamWFp8", "AdamW4bit", "bf16, StochasticRounding", "bf16, KahanSummation"} <= set(
        names
    )
    for cells in rows[1:]:
        assert 0 < float(cells[1]) < 10  # finite losses, below a wild guess's (ln 256 ≈ 5.5, plus)


def test_the_speed_benchmark_times_every_row():
    """benchmarks/low_bit_speed.py, on a small parameter: a row for each format on NumPy and
    torch, the three drop-ins, bitsandbytes and torch's fused AdamW, each with a positive time,
    and the ratio to bitsandbytes' row (1.00x on its own)."""
    pytest.importorskip("torch")
    pytest.importorskip("bitsandbytes")
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "low_bit_speed.py"), "--elements", "40000",
         "--repeats", "2"],
        capture_output=True, text=True, timeout=600, check=True,
    ).stdout  # fmt: skip
    rows = {cells[1].strip(): cells[2:5] for cells in (line.split("|") for line in out.splitlines())
            if len(cells) > 4 and cells[2].strip()[:1].isdigit()}
    formats = ("8", "4", "'fp8'")
    expected = {f"LowBit(AdamW, {f}), {where}" for f in formats for where in ("NumPy", "torch CPU")}
    expected |= {f"optimisers.torch.{c}" for c in ("AdamW8bit", "AdamW4bit", "AdamWFp8")}
    expected |= {"bitsandbytes AdamW8bit", "torch.optim.AdamW fused, float32 state"}
    assert set(rows) == expected
    assert all(float(ms) > 0 for ms, _, _ in rows.values())
    assert rows["bitsandbytes AdamW8bit"][2].strip() == "1.00x"
