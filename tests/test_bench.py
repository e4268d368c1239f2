"""Smoke test of the benchmark (benchmarks/ itself is not collected): the smallest run prints the
table and writes JSON whose rows agree with the float64 reference."""

import json
import re

import pytest

from optimisers.tools import bench


def test_bench_smallest_run_prints_table_and_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = ["--quick", "--shapes", "S3", "--backends", "numpy", "--rules", "adam", "--repeats", "1",
            "--bandwidth-mb", "4", "--json", str(path)]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "Bandwidth" in out and "median" in out and "Targets" in out
    assert "naive NumPy loop" in out and "optimisers update_" in out

    doc = json.loads(path.read_text())
    assert doc["bandwidth"]["floor_gbs"] > 0
    assert doc["shapes"]["S3"]["tensors"] == 100
    rows = doc["rows"]
    assert {(r["backend"], r["impl"]) for r in rows} == {
        ("numpy", "optimisers update_"),
        ("numpy", "naive NumPy loop"),
    }
    naive = next(r for r in rows if r["impl"] == "naive NumPy loop")
    assert naive["agree"] and naive["median_ms"] > 0 and naive["x_floor"] > 0
    for r in rows:  # a row may be n/a (error), but a row that ran must agree
        assert "error" in r or r["agree"], r


def _run(tmp_path, capsys, shapes, backend):
    """The smallest run of the bench on `shapes` and `backend`: (printed output, JSON document)."""
    path = tmp_path / "bench.json"
    argv = ["--quick", "--shapes", shapes, "--backends", backend, "--rules", "adam",
            "--repeats", "1", "--bandwidth-mb", "4", "--json", str(path)]
    assert bench.main(argv) == 0
    return capsys.readouterr().out, json.loads(path.read_text())


def test_bench_times_s2_tied_against_s2_in_alternation(tmp_path, capsys):
    out, doc = _run(tmp_path, capsys, "S2,S2-tied", "numpy")
    assert "S2-tied / S2, paired" in out
    (pair,) = doc["paired_tie_ratios"]
    assert pair["impl"] == "optimisers update_" and pair["pairs"] == 6
    assert pair["ratio_median"] > 0 and pair["plain_ms"] > 0 and pair["tied_ms"] > 0
    target = next(t for t in doc["targets"] if t["target"].startswith("numpy S2-tied"))
    assert target["measured"] == pair["ratio_median"]
    # --quick shapes are not the ones the limits are for: shown, not judged
    assert all(t["met"] is None for t in doc["targets"])
    assert "not judged" in out and "NOT MET" not in out and " met" not in out
    assert not re.search(r"issue \d", out, re.IGNORECASE)


def test_full_size_targets_are_judged():
    rows = [
        {"backend": "numpy", "impl": "optimisers update_", "shape": "S3", "rule": "adam", "median_ms": 9.0,
         "min_ms": 8.0, "setup_ms": 50.0},
    ]
    setup = next(t for t in bench.evaluate_targets(rows) if t["target"].startswith("setup on S3"))
    assert setup["met"] is True and setup["measured"] == 50.0
    rows[0]["setup_ms"] = 150.0
    setup = next(t for t in bench.evaluate_targets(rows) if t["target"].startswith("setup on S3"))
    assert setup["met"] is False
    quick = next(t for t in bench.evaluate_targets(rows, judged=False) if t["target"].startswith("setup"))
    assert quick["met"] is None and quick["measured"] == 150.0
    assert "NOT MET" in bench.format_targets(bench.evaluate_targets(rows))
    assert "not judged" in bench.format_targets(bench.evaluate_targets(rows, judged=False), judged=False)


def test_bench_times_ours_against_the_peer_in_alternation(tmp_path, capsys):
    pytest.importorskip("torch")
    out, doc = _run(tmp_path, capsys, "S1", "torch")
    assert "optimisers / peer, paired" in out
    (pair,) = doc["paired_peer_ratios"]
    assert (pair["impl"], pair["peer"], pair["shape"]) == ("optimisers update_", "torch.optim fused", "S1")
    assert pair["ratio_median"] > 0 and pair["ours_ms"] > 0 and pair["peer_ms"] > 0
    target = next(t for t in doc["targets"] if t["target"].startswith("torch S1 Adam"))
    assert target["measured"] == pair["ratio_median"] and "(paired)" in target["target"]
