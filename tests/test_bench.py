"""Smoke test of the benchmark (benchmarks/ itself is not collected): the smallest run prints the
table and writes JSON whose rows agree with the float64 reference."""

import json
import re

import pytest

from optimisers.tools import bench
from optimisers.tools.bench import report


def _run(tmp_path, capsys, shapes, backend):
    """The smallest run of the bench on `shapes` and `backend`: (printed output, JSON document)."""
    path = tmp_path / "bench.json"
    argv = ["--quick", "--shapes", shapes, "--backends", backend, "--rules", "adam",
            "--repeats", "1", "--bandwidth-mb", "4", "--json", str(path)]
    assert bench.main(argv) == 0
    return capsys.readouterr().out, json.loads(path.read_text())


def test_bench_smallest_run_prints_table_and_writes_json(tmp_path, capsys):
    out, doc = _run(tmp_path, capsys, "S3", "numpy")
    assert "Bandwidth" in out and "median" in out
    assert "naive NumPy loop" in out and "optimisers update_" in out
    # ratios to the peers, not limits a user cannot act on
    assert "optimisers against the peers" in out
    assert not re.search(r"Targets|NOT MET|\blimit\b|not judged", out)
    assert "targets" not in doc

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
    # without torch, NumPy is compared with the naive loop, as the median of one over the other
    ours = next(r for r in rows if r["impl"] == "optimisers update_")
    (entry,) = doc["summary"]
    assert entry["what"] == "numpy S3: optimisers update_ / naive NumPy loop" and not entry["paired"]
    assert entry["ratio"] == pytest.approx(ours["median_ms"] / naive["median_ms"])


def test_bench_times_s2_tied_against_s2_in_alternation(tmp_path, capsys):
    out, doc = _run(tmp_path, capsys, "S2,S2-tied", "numpy")
    assert "S2-tied / S2, paired" in out
    (pair,) = doc["paired_tie_ratios"]
    assert pair["impl"] == "optimisers update_" and pair["pairs"] == 6
    assert pair["ratio_median"] > 0 and pair["plain_ms"] > 0 and pair["tied_ms"] > 0
    entry = next(e for e in doc["summary"] if e["what"].startswith("numpy S2-tied / S2"))
    assert entry["ratio"] == pair["ratio_median"] and entry["paired"]
    assert not re.search(r"issue \d", out, re.IGNORECASE)


def test_summary_prefers_the_paired_ratio():
    rows = [
        {"backend": "torch", "impl": impl, "shape": shape, "rule": "adam", "params": 10,
         "median_ms": ms, "min_ms": ms - 1}
        for shape in ("S1", "S3")
        for impl, ms in (("optimisers update_", 6.0), ("torch.optim fused", 4.0))
    ]
    report.fill_ratios(rows, None)
    paired_peers = [{"backend": "torch", "shape": "S1", "ratio_median": 0.9}]
    s1, s3 = report.summary(rows, paired_peers=paired_peers)
    assert s1 == {"what": "torch S1: optimisers update_ / torch.optim fused", "ratio": 0.9,
                  "ratio_of_minimums": None, "paired": True}
    assert s3["ratio"] == 6.0 / 4.0 and s3["ratio_of_minimums"] == 5.0 / 3.0 and not s3["paired"]
    text = "\n".join(report.format_summary([s1, s3]))
    assert "(paired)" in text and "[1.67]" in text and "limit" not in text


def test_bench_times_ours_against_the_peer_in_alternation(tmp_path, capsys):
    pytest.importorskip("torch")
    out, doc = _run(tmp_path, capsys, "S1", "torch")
    assert "optimisers / peer, paired" in out
    (pair,) = doc["paired_peer_ratios"]
    assert (pair["impl"], pair["peer"], pair["shape"]) == ("optimisers update_", "torch.optim fused", "S1")
    assert pair["ratio_median"] > 0 and pair["ours_ms"] > 0 and pair["peer_ms"] > 0
    entry = next(e for e in doc["summary"] if e["what"].startswith("torch S1"))
    assert entry["ratio"] == pair["ratio_median"] and entry["paired"]
    assert "torch.optim fused" in entry["what"]
