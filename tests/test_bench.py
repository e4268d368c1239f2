"""Smoke test of the benchmark (benchmarks/ itself is not collected): the smallest run prints the
table and writes JSON whose rows agree with the float64 reference; every rule of its table runs
on each backend that has it, and a rule whose peers need matrices, or whose torch peer comes from
another package, fits in one entry. Also: S3-nested (S3's arrays nested as a model nests them) and
its pairing with S3, the PyTorch row stepped with `optimisers.grads(module)` and new gradients,
the cold cache, and benchmarks/overhead.py's smallest run."""

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import optimisers as opt
from optimisers.tools import bench
from optimisers.tools.bench import naive, report
from optimisers.tools.bench.cache import Evictor, evict_mib, is_cold
from optimisers.tools.bench.implementations import IMPLS
from optimisers.tools.bench.models import CHECK_STEPS, Shape, agrees, as_module, get, make_data, make_shapes
from optimisers.tools.bench.rules import (
    LOW_BIT_FLIPS,
    LR_MOMENTUM,
    RHO,
    RULES,
    BenchRule,
    TorchPeer,
    checked_as,
    default_rules,
    only_matrices,
    reference,
)
from optimisers.tools.bench.timing import run_row

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, capsys, shapes, backend, *extra):
    """The smallest run of the bench on `shapes` and `backend`: (printed output, JSON document)."""
    path = tmp_path / "bench.json"
    argv = ["--quick", "--shapes", shapes, "--backends", backend, "--rules", "adam",
            "--repeats", "1", "--bandwidth-mb", "4", "--evict-mb", "4", "--json", str(path), *extra]
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
        ("numpy", "optimisers update_, flat views"),
        ("numpy", "naive NumPy loop"),
    }
    naive = next(r for r in rows if r["impl"] == "naive NumPy loop")
    assert naive["agree"] and naive["median_ms"] > 0 and naive["x_floor"] > 0
    for r in rows:  # a row may be n/a (error), but a row that ran must agree
        assert "error" in r or r["agree"], r
    # the per-rule summary: our fastest row, against the naive loop where no library ran
    (line,) = doc["rule_summary"]
    fastest = min((r for r in rows if r["impl"] != "naive NumPy loop"), key=lambda r: r["median_ms"])
    assert (line["rule"], line["shape"], line["backend"]) == ("adam", "S3", "numpy")
    assert line["ours"] == fastest["impl"]
    assert line["x_floor"] == fastest["x_floor"] and line["peer"] == "naive NumPy loop"
    assert line["x_peer"] == pytest.approx(fastest["median_ms"] / naive["median_ms"])
    assert "| rule | shape | NumPy |" in out and "| adam | S3 | " in out
    # without torch, NumPy is compared with the naive loop, as the median of one over the other
    entries = doc["summary"]
    assert len(entries) == 2  # the usual row, and the row over flat views
    for impl, entry in zip(("optimisers update_", "optimisers update_, flat views"), entries):
        ours = next(r for r in rows if r["impl"] == impl)
        assert entry["what"] == f"numpy S3: {impl} / naive NumPy loop" and not entry["paired"]
        assert entry["ratio"] == pytest.approx(ours["median_ms"] / naive["median_ms"])


def test_bench_reports_the_cost_of_each_array_against_one_vector(tmp_path, capsys):
    """S3-one holds S3's elements as one vector: the per-array line is what the extra arrays cost,
    computed from the two rows of each `optimisers` implementation."""
    out, doc = _run(tmp_path, capsys, "S3,S3-one", "numpy")
    assert doc["shapes"]["S3-one"] == {**doc["shapes"]["S3"], "tensors": 1, "places": 1,
                                       "layout": doc["shapes"]["S3-one"]["layout"]}
    rows = {(r["impl"], r["shape"]): r for r in doc["rows"]}
    entries = doc["per_array"]
    assert [e["impl"] for e in entries] == ["optimisers update_", "optimisers update_, flat views"]
    for e in entries:
        many, one = rows[e["impl"], "S3"], rows[e["impl"], "S3-one"]
        assert one["agree"] and many["agree"]
        # the S3 family is timed with a cold cache by default, and the line says so
        assert e["cache"] == many["cache"] == one["cache"] == "cold" and e["shape"] == "S3"
        assert e["us_per_array"] == pytest.approx((many["median_ms"] - one["median_ms"]) * 1e3 / 100)
        assert e["x_one"] == pytest.approx(many["median_ms"] / one["median_ms"])
    assert "Per-array overhead, Adam" in out and "µs per array per step" in out
    assert "cold cache)" in out


# --- S3-nested, the row stepped with optimisers.grads, the cold cache -------------------------------


def test_s3_nested_holds_s3s_arrays_in_blocks_of_dicts_and_lists():
    for quick, blocks in ((False, 200), (True, 5)):
        shapes = make_shapes(quick)
        s3, nested = shapes["S3"], shapes["S3-nested"]
        assert nested.shapes == s3.shapes and nested.n_params == s3.n_params and not nested.ties
        assert nested.module and not s3.module
        assert len(set(nested.paths)) == len(nested.paths) == 20 * blocks
        assert {p[:2] for p in nested.paths} == {("blocks", b) for b in range(blocks)}
    data = make_data(make_shapes(True)["S3-nested"])
    tree = data.model(np.copy)
    block = tree["blocks"][0]
    assert isinstance(tree["blocks"], list) and isinstance(block, dict)
    assert isinstance(block["mlp"], list) and isinstance(block["attn"]["q"], dict)
    assert all(np.array_equal(get(tree, p), v) for p, v in zip(data.shape.paths, data.params))


def test_as_module_nests_modulelists_and_moduledicts_and_keeps_ties():
    torch = pytest.importorskip("torch")
    data = make_data(make_shapes(True)["S3-nested"])
    params = [torch.nn.Parameter(torch.tensor(a)) for a in data.params]
    module = as_module(data.tree(params))
    assert isinstance(module, torch.nn.ModuleDict) and isinstance(module["blocks"], torch.nn.ModuleList)
    assert isinstance(module["blocks"][0], torch.nn.ModuleDict)
    assert isinstance(module["blocks"][0]["mlp"], torch.nn.ModuleList)
    assert [id(p) for p in module.parameters()] == [id(p) for p in params]  # depth first, as the paths
    assert all(get(module, path) is p for path, p in zip(data.shape.paths, params))
    # S2-tied: the head is the very Parameter of the embedding, listed once
    tied = make_data(make_shapes(True)["S2-tied"])
    params = [torch.nn.Parameter(torch.tensor(a)) for a in tied.params]
    module = as_module(tied.tree(params))
    assert module.lm_head is module.wte is params[0]
    assert len(list(module.parameters())) == len(params)


def test_the_opt_grads_row_hands_new_gradients_and_none_at_the_later_tied_place(monkeypatch):
    """The row "optimisers update_, opt.grads" steps as a training loop: before each step new
    `.grad` tensors (the summed gradient at the tied parameter), and `update_` gets
    `optimisers.grads(module)`: the embedding's `.grad` at `wte`, None at `lm_head`."""
    pytest.importorskip("torch")
    impl = next(i for i in IMPLS if i.module_grads)
    data = make_data(make_shapes(True)["S2-tied"])
    seen = []
    real = opt.update_

    def spy(state, model, grads):
        seen.append((grads, model.wte.grad))
        return real(state, model, grads)

    monkeypatch.setattr(opt, "update_", spy)
    runner = impl.make(data, "adam")
    for _ in range(2):
        runner.prepare()
        runner.step()
    (first, g1), (second, g2) = seen
    for grads, g in seen:
        assert grads["wte"] is g and grads["lm_head"] is None
        np.testing.assert_array_equal(g.numpy(), data.grads_sum[0])
    assert g1 is not g2 and g1.data_ptr() != g2.data_ptr()  # a new tensor, with new memory
    assert first["h"] is not second["h"]
    got, ties = runner.fetch()
    assert ties == "tied"


def test_cache_policy_and_eviction():
    assert is_cold("S3", "auto") and is_cold("S3-nested", "auto") and is_cold("S3-one", "auto")
    assert not is_cold("S2", "auto") and not is_cold("S1", "auto")
    assert is_cold("S2", "cold") and not is_cold("S3", "warm")
    assert evict_mib(None) >= 64 and evict_mib(8) == 8
    evictor = Evictor(1, 2)
    try:
        evictor()
        evictor()
        assert all(np.all(c == 2) for c in evictor._chunks) and len(evictor._chunks) == 2
    finally:
        evictor.close()


def test_bench_times_nested_s3_against_s3_in_alternation(tmp_path, capsys):
    out, doc = _run(tmp_path, capsys, "S3,S3-nested", "numpy")
    assert doc["shapes"]["S3-nested"]["tensors"] == doc["shapes"]["S3"]["tensors"] == 100
    nested_rows = [r for r in doc["rows"] if r["shape"] == "S3-nested"]
    assert {r["impl"] for r in nested_rows} == {
        "optimisers update_", "optimisers update_, flat views", "naive NumPy loop"}
    assert all(r["agree"] and r["cache"] == "cold" for r in doc["rows"])
    assert "cache: cold for S3, S3-nested: before each timed step" in out
    assert "nested S3 / S3, paired" in out
    pairs = {p["impl"]: p for p in doc["paired_nested_ratios"]}
    assert set(pairs) == {"optimisers update_", "optimisers update_, flat views"}
    for impl, p in pairs.items():
        assert p["pairs"] == 6 and p["ratio_median"] > 0 and p["flat_ms"] > 0 and p["nested_ms"] > 0
        assert p["cache"] == "cold"
        entry = next(e for e in doc["summary"] if e["what"] == f"numpy nested S3 / S3: {impl}")
        assert entry["ratio"] == p["ratio_median"] and entry["paired"]


def test_bench_warm_cache_on_request(tmp_path, capsys):
    out, doc = _run(tmp_path, capsys, "S3", "numpy", "--cache", "warm")
    assert all(r["cache"] == "warm" for r in doc["rows"] if "median_ms" in r)
    assert "cache: warm" in out and ", cold" not in out
    assert doc["args"]["cache"] == "warm"


def test_bench_torch_rows_on_the_tied_module_and_the_nested_module(tmp_path, capsys):
    """PyTorch: S2-tied stepped with `optimisers.grads(module)` paired against S2 stepped the
    same way ("S2-tied (opt.grads) / S2"), and S3-nested (an nn.Module) against S3 for each of
    ours whose step sees the tree (not the drop-in)."""
    pytest.importorskip("torch")
    out, doc = _run(tmp_path, capsys, "S2,S2-tied,S3,S3-nested", "torch")
    rows = {(r["impl"], r["shape"]): r for r in doc["rows"]}
    for shape in ("S2", "S2-tied", "S3", "S3-nested"):
        r = rows["optimisers update_, opt.grads", shape]
        assert r["agree"] and r["median_ms"] > 0, r
        assert r["cache"] == ("cold" if shape.startswith("S3") else "warm")
    assert rows["optimisers update_, opt.grads", "S2-tied"]["ties"] == "tied"
    for impl in ("optimisers update_", "optimisers update_, flatten_", "optimisers drop-in, flatten_",
                 "torch.optim fused"):
        assert rows[impl, "S3-nested"]["agree"], impl
    ties = {p["impl"]: p for p in doc["paired_tie_ratios"]}
    assert set(ties) == {"optimisers update_", "optimisers update_, opt.grads"}
    assert "S2-tied / S2, paired" in out
    entry = next(e for e in doc["summary"]
                 if e["what"] == "torch S2-tied (opt.grads) / S2: optimisers update_, opt.grads")
    assert entry["ratio"] == ties["optimisers update_, opt.grads"]["ratio_median"] and entry["paired"]
    nested = {p["impl"]: p for p in doc["paired_nested_ratios"]}
    assert set(nested) == {"optimisers update_", "optimisers update_, opt.grads",
                           "optimisers update_, flatten_"}
    assert all("error" not in p and p["ratio_median"] > 0 for p in nested.values())
    assert {e["what"] for e in doc["summary"] if "nested S3 / S3" in e["what"]} == {
        f"torch nested S3 / S3: {impl}" for impl in nested}
    # the row stepped with opt.grads is not paired against torch.optim (that is the main row's)
    assert {p["impl"] for p in doc["paired_peer_ratios"]} == {"optimisers update_"}


def test_overhead_script_smallest_run():
    pytest.importorskip("torch")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--quick"],
                         capture_output=True, text=True, timeout=600, check=True, env=env).stdout
    for model in ("nested (100 x 256)", "tied (9 tensors)", "flat, cold (100 x 256)"):
        assert f"{model} " in out
    for ratio in ("nested / flat list, paired", "tied / untied, paired",
                  "update_: flatten_ / 1 tensor, paired", "drop-in: flatten_ / 1 tensor, paired",
                  "NumPy: views / 1 array, paired"):
        assert float(next(li for li in out.splitlines() if ratio in li).split()[-1]) > 0, ratio
    assert "optimisers update_, opt.grads, tied" in out and "optimisers Adam (drop-in), tied" in out


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
    paired_peers = [{"backend": "torch", "impl": "optimisers update_", "shape": "S1", "ratio_median": 0.9}]
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


# --- the table of rules ----------------------------------------------------------------------------


def _rules_action():
    return next(a for a in bench.build_parser()._actions if a.dest == "rules")


def test_rules_option_offers_exactly_the_table():
    action = _rules_action()
    assert action.type("all") == list(RULES)
    for name in RULES:
        assert action.type(name) == [name]
    with pytest.raises(argparse.ArgumentTypeError, match="choose from " + ", ".join(RULES)):
        action.type("adam,nonsense")
    # the help lists the table's names, in its order; the default run is the three first rules
    listed = re.search(r"or all: (\S+) \(default", action.help).group(1)
    assert listed.split(",") == list(RULES)
    assert action.default == ["adam", "adamw", "momentum"] == default_rules()
    assert {"lamb", "lars", "adopt", "ademamix", "lookahead"} <= set(RULES)


def test_every_entry_names_itself_and_builds_its_rule():
    for name, rule in RULES.items():
        assert rule.name == name
        assert isinstance(rule.ours(), opt.Rule)
        assert (rule.bytes_per_param is None) == rule.bytes_model.startswith("not streaming")


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:.*_stable_hash_for_caching:UserWarning")  # (torchao's rows)
@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_every_rule_runs_on_each_backend_it_supports(tmp_path, capsys, backend):
    """A --quick run of every table entry on one backend: each row the table says a library has
    runs and agrees with the float64 reference (the naive formula in float64; optax and
    torch.optim are the independent oracles), and each row it lacks says so."""
    pytest.importorskip({"numpy": "numpy", "torch": "torch", "jax": "optax"}[backend])
    path = tmp_path / "bench.json"
    argv = ["--quick", "--shapes", "S3", "--backends", backend, "--rules", "all", "--repeats", "1",
            "--bandwidth-mb", "4", "--compile-limit", "1e9", "--json", str(path)]
    assert bench.main(argv) == 0
    out, doc = capsys.readouterr().out, json.loads(path.read_text())
    rows = {(r["impl"], r["rule"]): r for r in doc["rows"]}
    impls = [i for i in IMPLS if i.backend == backend]
    s3 = make_shapes(quick=True)["S3"]
    assert len(rows) == len(doc["rows"]) == len(impls) * len(RULES)
    for impl in impls:
        for name, rule in RULES.items():
            r = rows[(impl.name, name)]
            why = rule.shapes(s3) or impl.absent(rule)  # Muon: S3's vectors are no matrices
            if why is not None:
                assert r["absent"] == why and "median_ms" not in r, r
                assert f"— ({why})" in out
                continue
            assert "error" not in r and "skipped" not in r, r
            # a rule without a naive formula (SOAP: no peer either) is timed but unchecked
            assert r["median_ms"] > 0 and (r["agree"] if rule.naive else "agree" not in r), r
            assert ("x_floor" in r) == (rule.bytes_per_param is not None)
    for name, rule in RULES.items():
        if rule.naive and rule.shapes(s3) is None:
            assert re.search(rf"check S3 {name}: (\d+)/\1 implementations agree", out), name
    # the rules torch.optim lacks: their torch rows say so, and ours has no peer there
    if backend == "torch":
        assert rows[("torch.optim fused", "lamb")]["absent"] == "torch.optim has no LAMB"
        assert "x_peer" not in rows[("optimisers update_", "lamb")]


def test_every_rule_keeps_a_tied_weight_tied_on_each_backend():
    """Every entry's `optimisers` rows on a tiny model with a tied weight (the peers see it once,
    with the summed gradient, as on S2-tied): tied after the check steps, and equal to the
    reference, which is the untied model stepped with the summed gradient."""
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    tiny = Shape("tiny", [("w",), ("b",)], [(8, 4), (4,)], {("head",): 0}, layout="tiny, tied")
    matrices = Shape("tiny", [("w",), ("v",)], [(8, 4), (4, 6)], {("head",): 0}, layout="tiny, tied")
    opts = argparse.Namespace(compile_limit=1e9, warmup=0, repeats=1, quick=True, rss_ok=False, profile=0)
    for name, rule in RULES.items():
        data = make_data(tiny if rule.shapes(tiny) is None else matrices)  # Muon: matrices only
        ref = reference(name, data, CHECK_STEPS)
        for impl in [i for i in IMPLS if i.ours]:
            row = run_row(impl, data, name, ref, opts, {})
            if "absent" in row:  # JAX's flat vector, for a rule that sees whole arrays; a drop-in
                expected = "no drop-in" if impl.name == "optimisers drop-in, flatten_" else "not elementwise"
                assert impl.flat and expected in row["absent"], (name, impl.name, row)  # that torch lacks
                continue
            agrees = row.get("agree") if ref is not None else "agree" not in row  # SOAP: unchecked
            assert agrees and row["ties"] == "tied", (name, impl.backend, row)


def test_a_rule_without_a_naive_formula_is_timed_but_unchecked(monkeypatch):
    entry = dataclasses.replace(RULES["momentum"], name="no-naive", naive=None)
    monkeypatch.setitem(RULES, entry.name, entry)
    data = make_data(Shape("tiny", [("w",)], [(8, 4)]))
    opts = argparse.Namespace(compile_limit=1e9, warmup=0, repeats=1, quick=True, rss_ok=False, profile=0)
    ours, naive = [i for i in IMPLS if i.backend == "numpy" and not i.flat]
    rows = [run_row(impl, data, entry.name, None, opts, {}) for impl in (ours, naive)]
    assert rows[0]["median_ms"] > 0 and "agree" not in rows[0]
    assert rows[1] == {**rows[1], "absent": "no naive NumPy formula for Momentum"}
    table = report.format_table(rows)
    assert "unchecked" in table and "— (no naive NumPy formula for Momentum)" in table
    assert "not checked" in report.agreement_line("tiny", entry.name, rows)


class OtherPackageMomentum:
    """A torch optimiser from outside torch.optim (no foreach, no fused), for 2-D parameters only,
    as matrix rules' peers are: `v <- rho*v + lr*g`, `x <- x - v`."""

    def __init__(self, params, lr, rho):
        import torch

        if any(p.ndim < 2 for p in params):
            raise ValueError("OtherPackageMomentum takes matrices only")
        self.params, self.lr, self.rho = params, lr, rho
        self.velocity = [torch.zeros_like(p) for p in params]

    def step(self):
        import torch

        with torch.no_grad():
            for p, v in zip(self.params, self.velocity):
                v.mul_(self.rho).add_(p.grad, alpha=self.lr)
                p.sub_(v)


def test_a_matrix_rule_with_a_peer_from_another_package_is_one_entry(tmp_path, capsys, monkeypatch):
    """What a matrix rule (Muon, SOAP...) needs: a shape predicate (a shape with vectors is not run,
    and its rows say why) and a torch peer from another package (its one row runs; the foreach and
    fused rows say it has none)."""
    pytest.importorskip("torch")
    momentum = RULES["momentum"]
    entry = BenchRule(
        "matrix-momentum", "Momentum on matrices",
        momentum.ours,
        TorchPeer("otherpackage.Momentum",
                  lambda torch, ps, **kw: OtherPackageMomentum(ps, lr=LR_MOMENTUM, rho=RHO, **kw),
                  variants={"loop": {}}),
        None,
        momentum.naive,
        20, "as Momentum",
        shapes=only_matrices,
    )
    monkeypatch.setitem(RULES, entry.name, entry)
    path = tmp_path / "bench.json"
    argv = ["--quick", "--shapes", "S1,S3", "--backends", "numpy,torch,jax", "--rules", entry.name,
            "--repeats", "1", "--bandwidth-mb", "4", "--json", str(path)]
    assert bench.main(argv) == 0
    out, doc = capsys.readouterr().out, json.loads(path.read_text())
    rows = {(r["shape"], r["impl"]): r for r in doc["rows"]}
    why = "needs >=2-D parameters; S3 has 100 of fewer dimensions"
    assert all(r["absent"] == why for (shape, _), r in rows.items() if shape == "S3")
    assert f"check S3 matrix-momentum: not run ({why})" in out
    other = rows[("S1", "torch.optim foreach=False")]
    assert other["agree"] and other["note"] == "otherpackage.Momentum"
    assert rows[("S1", "torch.optim fused")]["absent"] == "otherpackage.Momentum has no fused variant"
    assert rows[("S1", "optax jit+donate")]["absent"] == "optax has no Momentum on matrices"
    for impl in ("optimisers update_", "naive NumPy loop", "optimisers jit+donate"):
        assert rows[("S1", impl)]["agree"], impl
    assert only_matrices(make_shapes(True)["S1"]) is None


# --- every elementwise rule (issue 39), and the per-rule summary ---------------------------------------

#: the entries added so that `--rules all` times every elementwise rule
EVERY_ELEMENTWISE = ["descent", "nesterov", "rmsprop", "rprop", "adagrad", "adadelta", "radam", "nadam",
                     "adamax", "amsgrad", "adabelief", "oadam", "lion", "clip-wd-adam", "sign-decay-momentum"]


def _rule_types(rule) -> set:
    """The classes of `rule` and of the rules inside it (a chain's, a wrapper's)."""
    inner = [*getattr(rule, "rules", ()), *([rule.rule] if hasattr(rule, "rule") else [])]
    return {type(rule)}.union(*(_rule_types(r) for r in inner))


def test_every_public_elementwise_rule_has_an_entry():
    """`--rules all` runs every entry, so it times every elementwise rule the library exports:
    each optimiser on its own, the gradient transformations (decays, clipping) in chains."""
    elementwise = set()
    for cls in [getattr(opt, name) for name in opt.__all__]:
        if not (isinstance(cls, type) and issubclass(cls, opt.Rule)) or cls is opt.OptimiserChain:
            continue
        try:
            rule = cls()
        except TypeError:  # a wrapper (Lookahead, AccumGrad...): it needs its rule or its count
            continue
        if rule.elementwise:
            elementwise.add(cls)
    assert {opt.Descent, opt.Adam, opt.Lion, opt.ClipGrad, opt.ScheduleFreeSGD} <= elementwise
    transforms = {opt.WeightDecay, opt.SignDecay, opt.ClipGrad}
    alone = {type(entry.ours()) for entry in RULES.values()}
    in_chains = set().union(*(_rule_types(entry.ours()) for entry in RULES.values()))
    assert elementwise - transforms <= alone
    assert transforms <= in_chains
    assert _rules_action().type("all") == list(RULES) and set(EVERY_ELEMENTWISE) <= set(RULES)


def test_streaming_entries_count_their_bytes():
    """Where an entry's bytes model counts arrays, 4 bytes each make its bytes per parameter."""
    counted = 0
    for name, entry in RULES.items():
        match = re.search(r"(\d+) arrays x 4 bytes = (\d+)", entry.bytes_model)
        if match:
            counted += 1
            assert int(match[1]) * 4 == int(match[2]) == entry.bytes_per_param, name
        if entry.bytes_per_param is not None:
            assert re.search(rf"\b{entry.bytes_per_param}\b", entry.bytes_model), name
    assert counted >= 10


_TINY = Shape("tiny", [("w",), ("b",)], [(16, 8), (40,)], layout="a matrix and a vector")
_PEERS = [i for i in IMPLS if not i.ours and i.name != "optax jit"]  # (optax jit: as jit+donate)


def _agrees_after_the_check_steps(impl, data, name: str, ref: list) -> bool:
    """The check of a row (its steps, then its parameters against the reference), untimed."""
    runner = impl.make(data, name)
    for _ in range(CHECK_STEPS):
        if runner.prepare is not None:
            runner.prepare()
        runner.step()
    got, _ = runner.fetch()
    return agrees(got, ref, *RULES[name].tolerance)[0]


@pytest.mark.parametrize("name", EVERY_ELEMENTWISE)
def test_each_new_entry_agrees_with_its_peers(name):
    """The entry's naive formula (in float64, the reference) against its peers in float32 on a tiny
    model: the naive loop itself, torch.optim's variants (or the entry's own torch peer) and optax,
    each computing the rule from its own code at the entry's hyperparameters. The libraries
    without the rule are the ones whose rows say so."""
    pytest.importorskip("torch")
    pytest.importorskip("optax")
    entry = RULES[name]
    data = make_data(_TINY)
    ref = reference(name, data, CHECK_STEPS)
    ran = [impl.name for impl in _PEERS if impl.absent(entry) is None]
    for impl in [i for i in _PEERS if i.name in ran]:
        assert _agrees_after_the_check_steps(impl, data, name, ref), impl.name
    assert "naive NumPy loop" in ran
    assert ("torch.optim foreach=False" in ran) == (entry.torch is not None)
    assert ("optax jit+donate" in ran) == (entry.optax is not None)


def _row(backend, impl, ms, rule="lion", agree=True):
    return {"backend": backend, "impl": impl, "shape": "S1", "rule": rule, "params": 10**6,
            "median_ms": ms, "min_ms": ms, "agree": agree}


def test_rule_summary_takes_our_fastest_row_against_the_fastest_library_peer():
    rows = [
        # Adam: torch.optim's fastest variant on the CPU is NumPy's and PyTorch's peer; a row that
        # disagrees with the reference is no result, however fast
        _row("numpy", "optimisers update_", 3.0, "adam"), _row("numpy", "naive NumPy loop", 1.5, "adam"),
        _row("torch", "optimisers update_", 2.0, "adam"), _row("torch", "optimisers update_, flatten_", 1.0,
                                                               "adam", agree=False),
        _row("torch", "torch.optim foreach=True", 3.5, "adam"),
        _row("torch", "torch.optim fused", 2.5, "adam"),
        _row("jax", "optimisers jit+donate", 4.0, "adam"), _row("jax", "optax jit+donate", 3.5, "adam"),
        _row("jax", "optax jit", 3.0, "adam"),
        # Lion: no torch.optim, so the naive NumPy loop on the CPU; ours fastest over flat views
        _row("numpy", "optimisers update_", 3.0), _row("numpy", "optimisers update_, flat views", 2.0),
        _row("numpy", "naive NumPy loop", 6.0), _row("torch", "optimisers update_", 4.0),
    ]
    report.fill_ratios(rows, floor_gbs=20.0)
    entries = {(e["rule"], e["backend"]): e for e in report.rule_summary(rows)}
    assert set(entries) == {("adam", "numpy"), ("adam", "torch"), ("adam", "jax"), ("lion", "numpy"),
                            ("lion", "torch")}
    expected = {("adam", "numpy"): ("optimisers update_", 3.0, "torch.optim fused", 2.5),
                ("adam", "torch"): ("optimisers update_", 2.0, "torch.optim fused", 2.5),
                ("adam", "jax"): ("optimisers jit+donate", 4.0, "optax jit", 3.0),
                ("lion", "numpy"): ("optimisers update_, flat views", 2.0, "naive NumPy loop", 6.0),
                ("lion", "torch"): ("optimisers update_", 4.0, "naive NumPy loop", 6.0)}
    for key, (ours, ours_ms, peer, peer_ms) in expected.items():
        e = entries[key]
        floor_ms = RULES[key[0]].bytes_per_param * 10**6 / 20e9 * 1e3
        assert (e["ours"], e["ours_ms"], e["peer"], e["peer_ms"]) == (ours, ours_ms, peer, peer_ms), key
        assert e["x_peer"] == pytest.approx(ours_ms / peer_ms)
        assert e["x_floor"] == pytest.approx(ours_ms / floor_ms)
    table = report.format_rule_summary(report.rule_summary(rows))
    assert table[2] == "| rule | shape | NumPy | PyTorch | JAX |"
    lion = next(line for line in table if line.startswith("| lion | S1 |"))
    assert f"{2.0 / 6.0:.2f}× naive np (flat)" in lion and lion.endswith(" |  |")  # no JAX row
    adam = next(line for line in table if line.startswith("| adam | S1 |"))
    assert f"{2.0 / 2.5:.2f}× torch fused" in adam and f"{4.0 / 3.0:.2f}× optax jit" in adam


def test_the_agreement_line_names_rows_that_failed():
    """A row that raised is neither agreeing nor disagreeing: the check line names it, so that
    "k/k agree" is not read as every row."""
    group = [{**_row("numpy", "optimisers update_", 1.0), "max_abs_err": 1e-9},
             {"backend": "torch", "impl": "optimisers update_", "shape": "S1", "rule": "lion",
              "error": "RuntimeError: boom"}]
    line = report.agreement_line("S1", "lion", group)
    assert "1/1 implementations agree" in line
    assert "FAILED (error, see the table): torch optimisers update_" in line
    assert "FAILED" not in report.agreement_line("S1", "lion", group[:1])


# --- low-precision state (issue 40) and the eager label (issue 39) ---------------------------------

LOW_BIT = ["adamw8bit", "adamw4bit", "adamwfp8"]
# a matrix of 8192 elements (quantised: LowBit's, bitsandbytes' and torchao's threshold is 4096) and
# a vector of 300 (kept in float32)
_QUANTISED = Shape("lowbit", [("w",), ("b",)], [(64, 128), (300,)], layout="a quantised matrix, a vector")
_OPTS = argparse.Namespace(compile_limit=1e9, warmup=0, repeats=1, quick=True, rss_ok=False, profile=0)
def _reference_row(impl, data, name):
    ref = reference(checked_as(name, impl), data, CHECK_STEPS)
    return run_row(impl, data, name, ref, _OPTS, {})


def test_the_quantising_round_trip_keeps_the_nearest_map_value_of_each_block():
    """The reference's quantisation, by hand: FP8 scales a block so that its largest magnitude is
    448, and keeps the nearest float8_e4m3fn value (between 112 and 120 the spacing is 8); 8 bits
    keeps the dynamic map's nearest value times the block's largest magnitude; a block of zeros
    stays zero."""
    signed, _, block, divisor = naive._low_bit_format("fp8")
    a = np.array([1.0, 0.5, -0.26, 0.0])
    naive._round_trip(a, signed, block, divisor)
    assert a.tolist() == pytest.approx([1.0, 0.5, -120 / 448, 0.0], rel=1e-7)  # (a float32 scale)
    signed, unsigned, block, divisor = naive._low_bit_format(8)
    b = np.zeros(10)
    b[0], b[1] = 2.0, 0.3  # (blocks of 4 here: the second and third are all zeros)
    naive._round_trip(b, unsigned, 4, divisor)
    near = unsigned[np.argmin(np.abs(unsigned - 0.15))]  # 0.3 / 2.0 on the map
    assert b[0] == 2.0 and b[1] == pytest.approx(2.0 * near, rel=1e-7) and not b[2:].any()
    assert abs(b[1] - 0.3) < 0.3 * 0.02  # (the dynamic map is fine near 0.15: steps of ~1%)


@pytest.mark.parametrize("name", LOW_BIT)
def test_our_low_bit_rows_agree_with_the_quantised_reference(name):
    """Every row of ours (NumPy, PyTorch, the drop-in, JAX under jit) and the naive loop in float32
    agree with AdamW whose moments are quantised after each step, in float64; the float32 anchors
    (torch.optim's fused AdamW, optax.adamw) agree with AdamW's own reference."""
    pytest.importorskip("torch")
    pytest.importorskip("optax")
    data = make_data(_QUANTISED)
    rows = {}
    for impl in IMPLS:
        if impl.absent(RULES[name]) is None and impl.name not in ("bitsandbytes", "torchao"):
            rows[impl.backend, impl.name] = _reference_row(impl, data, name)
    for key, row in rows.items():
        assert "error" not in row and row["agree"], (key, row)
    assert {("numpy", "optimisers update_"), ("torch", "optimisers drop-in, flatten_"),
            ("jax", "optimisers jit+donate"), ("numpy", "naive NumPy loop")} <= set(rows)
    for key in (("torch", "torch.optim fused"), ("jax", "optax jit+donate")):
        assert rows[key]["checked_as"] == "adamw" and rows[key]["note"].startswith("float32 ")
    # state per parameter: codes of 1 byte (8-bit, FP8) or half a byte (4-bit) and a float32 scale
    # a block for the matrix, two float32 moments for the vector
    codes, block = {"adamw8bit": (1, 256), "adamw4bit": (0.5, 128), "adamwfp8": (1, 256)}[name]
    expected = (2 * 8192 * (codes + 4 / block) + 2 * 300 * 4) / data.shape.n_params
    assert rows["numpy", "optimisers update_"]["state_bytes_per_param"] == pytest.approx(expected)
    assert rows["torch", "torch.optim fused"]["state_bytes_per_param"] == 8.0
    # LowBit(AdamW) takes the compiled way (its quantised pass), so no row says "eager"
    assert not any(rows[b, "optimisers update_"]["eager"] for b in ("numpy", "torch"))


def test_the_low_bit_check_fails_for_float32_adamw_and_a_perturbed_row():
    """The check can fail: float32 AdamW (no quantisation) differs almost everywhere; our row with
    one element moved by more than a step, or with more than LOW_BIT_FLIPS of its elements moved
    beyond float32 rounding, disagrees; our row as it is agrees."""
    data = make_data(_QUANTISED)
    entry = RULES["adamw8bit"]
    ref = reference("adamw8bit", data, CHECK_STEPS)
    ours = [p.copy() for p in data.params]
    state = opt.setup(entry.ours(), ours)
    float32 = [p.copy() for p in data.params]
    plain = opt.setup(opt.AdamW(1e-3, lambd=0.01), float32)
    for _ in range(CHECK_STEPS):
        state, ours = opt.update_(state, ours, list(data.grads_sum))
        plain, float32 = opt.update_(plain, float32, list(data.grads_sum))
    assert entry.agreement(ours, ref)[0]
    assert not entry.agreement(float32, ref)[0]
    one_far = [ours[0].copy(), ours[1]]
    one_far[0][3, 5] += 2e-3
    ok, worst = entry.agreement(one_far, ref)
    assert not ok and worst >= 2e-3 - 1e-4
    n = data.shape.n_params
    many = [ours[0].copy(), ours[1]]
    many[0].reshape(-1)[: int(3 * LOW_BIT_FLIPS * n) + 1] += 1e-6  # (each well within one step)
    assert not entry.agreement(many, ref)[0]
    few = [ours[0].copy(), ours[1]]
    few[0].reshape(-1)[:1] += 1e-6  # (one element: the fraction, rounded up)
    assert entry.agreement(few, ref)[0]
    line = report.agreement_line("lowbit", "adamw8bit", [
        {"backend": "numpy", "impl": "optimisers update_", "agree": True, "max_abs_err": 1e-9},
        {"backend": "torch", "impl": "torch.optim fused", "agree": True, "max_abs_err": 1e-9,
         "checked_as": "adamw"}])
    assert f"but for <= {LOW_BIT_FLIPS:g} of the elements" in line and "float32 rows against adamw's" in line


# (what importing torch's inductor and tracing torchao's classes warn: pytest makes warnings errors)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:.*_stable_hash_for_caching:UserWarning")
def test_the_low_bit_peers_from_other_packages_run_and_say_when_missing(monkeypatch):
    """bitsandbytes' and torchao's classes are rows of their own, checked against the quantised
    reference (bitsandbytes' CPU quantiser does not always take the nearest code, so its row may
    disagree: the check says so, the row still runs); a package that is not installed makes its
    rows absent, saying so, and the others still run."""
    pytest.importorskip("torch")
    data = make_data(_QUANTISED)
    by_name = {impl.name: impl for impl in IMPLS if impl.backend == "torch"}
    assert by_name["bitsandbytes"].absent(RULES["adamw4bit"]) == "bitsandbytes has no LowBit(AdamW, 4)"
    if importlib.util.find_spec("bitsandbytes") is not None:
        row = _reference_row(by_name["bitsandbytes"], data, "adamw8bit")
        assert "error" not in row and "agree" in row, row
        assert row["note"] == "bitsandbytes.optim.AdamW8bit" and row["ns_per_param"] > 0
        assert row["state_bytes_per_param"] == pytest.approx((2 * 8192 * (1 + 4 / 256) + 2 * 300 * 4) / 8492)
    if importlib.util.find_spec("torchao") is not None:
        row = _reference_row(by_name["torchao"], data, "adamw8bit")  # (torch.compile: seconds)
        assert "error" not in row and row["agree"], row.get("traceback", row)
        assert row["note"] == "torchao.optim.AdamW8bit" and row["compile_s"] > 0
        assert row["state_bytes_per_param"] == pytest.approx((2 * 8192 * (1 + 4 / 256) + 2 * 300 * 4) / 8492)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("bitsandbytes", "torchao") else real(name, *a))
    for name in ("bitsandbytes", "torchao"):
        row = run_row(by_name[name], data, "adamw8bit", None, _OPTS, {})
        assert row["absent"] == f"{name} is not installed" and "median_ms" not in row
        assert f"— ({name} is not installed)" in report.format_table([row])
    assert "median_ms" in run_row(by_name["optimisers update_"], data, "adamw8bit", None, _OPTS, {})


def test_a_rule_the_compiled_way_cannot_trace_says_eager():
    """Our NumPy and PyTorch rows of a rule whose step runs eagerly (Muon's Newton–Schulz) say
    "eager" in the compile column; an elementwise rule's rows show the compile time, and so do
    those of rules that find a factor per array first (LAMB; Adafactor, whose vectors compile)."""
    pytest.importorskip("torch")
    data = make_data(_TINY)
    matrix = make_data(Shape("tiny-matrix", [("w",)], [(16, 8)], layout="a matrix"))  # (Muon's)
    for impl in [i for i in IMPLS if i.ours and i.backend in ("numpy", "torch") and not i.flat]:
        muon = run_row(impl, matrix, "muon", reference("muon", matrix, CHECK_STEPS), _OPTS, {})
        adam = run_row(impl, data, "adam", reference("adam", data, CHECK_STEPS), _OPTS, {})
        assert muon["eager"] and muon["agree"] and not adam["eager"] and adam["agree"], impl.name
        for scaled in ("lamb", "adafactor"):  # (their factors first, then compiled)
            row = run_row(impl, data, scaled, reference(scaled, data, CHECK_STEPS), _OPTS, {})
            assert not row["eager"] and row["agree"], (impl.name, scaled)
        table = report.format_table([muon, adam])
        eager_line, adam_line = (line for line in table.splitlines() if line.startswith(impl.backend))
        assert " eager " in eager_line and " eager " not in adam_line
    jax = next(i for i in IMPLS if i.backend == "jax" and i.ours)
    jax_row = run_row(jax, data, "adafactor", None, _OPTS, {})
    assert "eager" not in jax_row  # (jitted: the label is for the NumPy and PyTorch rows)


def test_rules_all_runs_the_low_bit_entries():
    assert set(LOW_BIT) <= set(_rules_action().type("all"))
    assert not set(LOW_BIT) & set(default_rules())


def test_a_long_compile_skips_the_same_rules_rows_only():
    """`--compile-limit`: after optax's long compile for one rule on a shape, its other optax row
    of that rule is skipped, and the next rule's optax rows still run (`--rules all` shows every
    rule's rows)."""
    pytest.importorskip("optax")
    data = make_data(_TINY)
    opts = argparse.Namespace(**{**vars(_OPTS), "compile_limit": 0.0})
    donate, plain = [i for i in IMPLS if i.jit_key == "optax"]
    seen: dict = {}
    first = run_row(donate, data, "adam", None, opts, seen)
    assert "median_ms" in first and first["compile_s"] > 0
    skipped = run_row(plain, data, "adam", None, opts, seen)["skipped"]
    assert skipped.startswith("optax jit+donate adam compile")
    assert "median_ms" in run_row(donate, data, "momentum", None, opts, seen)
