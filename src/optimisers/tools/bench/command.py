"""`optimisers bench`: its options, and the run from the first measurement to the last line."""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field

import numpy as np

import optimisers as opt

from . import report
from .bandwidth import measure_bandwidth
from .cache import CACHE_MODES, Evictor, evict_mib
from .hyperparameters import HYPERPARAMETERS
from .implementations import BEST_PEER, IMPLS
from .memory import can_reset_hwm
from .models import ALL_BACKENDS, ALL_SHAPES, CHECK_STEPS, EXTRA_SHAPES, make_data, make_shapes
from .rules import RULES, checked_as, default_rules, reference
from .timing import paired_nested_ratio, paired_peer_ratio, paired_tie_ratio, run_row


def _csv(allowed, everything: bool = False):
    """A comma-separated list of names from `allowed` (or `all` when `everything`)."""

    def parse(text):
        items = [s.strip() for s in text.split(",") if s.strip()]
        if everything and items == ["all"]:
            return list(allowed)
        bad = [s for s in items if s not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad[0]!r}; choose from {', '.join(allowed)}")
        return items

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="optimisers bench",
        description="Time one optimiser step of optimisers against torch.optim, optax and a naive "
        "NumPy loop, with the memory-bandwidth floor measured in the same run.",
    )
    p.add_argument("--quick", action="store_true",
                   help="smaller shapes (S1 2048^2, S2 4 blocks of d=128, S3 100 tensors), fewer "
                   "repeats: a smoke run")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--backends", type=_csv(ALL_BACKENDS), default=list(ALL_BACKENDS),
                   help="comma-separated: numpy,torch,jax")
    p.add_argument("--shapes", type=_csv(ALL_SHAPES + EXTRA_SHAPES), default=list(ALL_SHAPES),
                   help="comma-separated: S1,S2,S2-tied,S3,S3-nested,S3-one (default), and S3-matrices "
                   "(4000 16x16 matrices, for muon and clip-adamw)")
    p.add_argument("--rules", type=_csv(tuple(RULES), everything=True), default=default_rules(),
                   help=f"comma-separated, or all: {','.join(RULES)} (default: "
                   f"{','.join(default_rules())})")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed steps per row (default 7, --quick 5; fast rows take more)")
    p.add_argument("--compile-limit", type=float, default=None, metavar="S",
                   help="after a JAX compile longer than S seconds, skip the other rows of the same "
                   "library on that shape and rule (default 20, --quick 5)")
    p.add_argument("--bandwidth-mb", type=int, default=None, metavar="MIB",
                   help="size of each bandwidth-test array (default 128, --quick 64; keep it well "
                   "above the last-level cache)")
    p.add_argument("--cache", choices=CACHE_MODES, default="auto",
                   help="between timed steps, evict the caches (as a training step's forward and "
                   "backward passes do) for the S3 family (auto, the default), every shape (cold), "
                   "or none (warm)")
    p.add_argument("--evict-mb", type=int, default=None, metavar="MIB",
                   help="size of the buffer touched between timed steps on a cold cache (default: "
                   "the larger of 64 and twice the last-level cache)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="print the top N cProfile entries of each optimisers row")
    return p


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    try:
        return _run(opts)
    finally:
        gc.unfreeze()  # main() may run inside another program (the tests): leave the collector as found


def _fill_defaults(opts) -> None:
    """The defaults that depend on --quick, and whether RSS peaks can be measured here."""
    if opts.repeats is None:
        opts.repeats = 5 if opts.quick else 7
    opts.repeats = max(1, opts.repeats)
    opts.warmup = 1 if opts.quick else 2
    if opts.compile_limit is None:
        opts.compile_limit = 5.0 if opts.quick else 20.0
    if opts.bandwidth_mb is None:
        opts.bandwidth_mb = 64 if opts.quick else 128
    opts.rss_ok = can_reset_hwm()
    opts.evict_mb = evict_mib(opts.evict_mb)


def _versions(backends) -> dict:
    versions = {"python": platform.python_version(), "numpy": np.__version__, "optimisers": opt.__version__}
    for mod in ("torch", "jax", "optax"):
        if ("torch" if mod == "torch" else "jax") in backends:
            try:
                versions[mod] = __import__(mod).__version__
            except Exception as e:  # reported per row as well
                versions[mod] = f"not importable ({e})"
    return versions


def _loadavg() -> tuple:
    try:
        return os.getloadavg()
    except (AttributeError, OSError):  # not available on this platform
        return (float("nan"),) * 3


def _warm_up_imports(backends) -> None:
    """Pay one-off start-up costs (imports, JAX's first compile, torch.optim's lazy imports) before
    anything is timed, then freeze the objects alive so far out of the garbage collector: every
    `gc.collect()` between rows then scans only what the benchmark made since."""
    if "torch" in backends:
        try:
            import torch

            torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])
        except Exception:  # reported per row
            pass
    if "jax" in backends:
        try:
            import jax
            import optax  # noqa: F401

            jax.jit(lambda x: x + 1).lower(np.float32(0)).compile()
        except Exception:  # reported per row
            pass
    gc.collect()
    gc.freeze()


@dataclass
class _Run:
    """Everything one run measured."""

    opts: argparse.Namespace
    threads: int
    versions: dict
    shapes: dict
    bandwidth: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)
    agreement: list = field(default_factory=list)
    paired: list = field(default_factory=list)
    paired_nested: list = field(default_factory=list)
    paired_peers: list = field(default_factory=list)
    summary: list = field(default_factory=list)
    rule_summary: list = field(default_factory=list)
    per_array: list = field(default_factory=list)
    cache: str = ""  # how the caches are evicted between timed steps, for the header


def _time_every_row(run: _Run, impls: list, progress) -> None:
    """Every implementation on every shape and rule; the bandwidth is measured again after each
    shape, since other work on a shared machine easily halves one measurement."""
    opts, compile_seen = run.opts, {}
    floor_samples = [run.bandwidth["floor_gbs"]]
    for name in opts.shapes:
        data = make_data(run.shapes[name])
        for rule in opts.rules:
            runs = RULES[rule].shapes(data.shape) is None
            refs = {}  # by the entry a row is checked as (a low-bit entry's float32 rows: its anchor's)
            group = []
            for impl in impls:
                progress(f"{name} {rule}: {impl.backend} {impl.name}")
                checked = checked_as(rule, impl)
                if checked not in refs:
                    refs[checked] = reference(checked, data, CHECK_STEPS) if runs else None
                group.append(run_row(impl, data, rule, refs[checked], opts, compile_seen))
                if "error" in group[-1]:
                    progress(f"  n/a: {group[-1]['error']}")
            run.rows += group
            run.agreement.append(report.agreement_line(name, rule, group))
        del data
        gc.collect()
        again = measure_bandwidth(opts.bandwidth_mb, run.threads, 3, kernels=("update",), one_thread=False)
        floor_samples.append(again["floor_gbs"])
    run.bandwidth["floor_samples_gbs"] = floor_samples
    run.bandwidth["floor_gbs"] = max(floor_samples)


def _time_pairs(run: _Run, impls: list, progress) -> None:
    """The ratios worth a few percent, timed in alternation: S2-tied against S2 for each of ours,
    S3-nested against S3 for each of ours on NumPy and PyTorch that sees the tree, and for Adam
    each of ours against its peer on S1 and S2."""
    opts = run.opts
    pairs = 6 if opts.quick else 15
    ours = [i for i in impls if i.ours and not i.flat]
    if "S2" in opts.shapes and "S2-tied" in opts.shapes:
        for impl in ours:
            for rule in [r for r in opts.rules if RULES[r].shapes(run.shapes["S2"]) is None]:
                progress(f"S2-tied against S2, paired: {impl.backend} {impl.name} {rule}")
                run.paired.append(paired_tie_ratio(impl, run.shapes, rule, pairs, opts))
    if "S3" in opts.shapes and "S3-nested" in opts.shapes:
        nested = [i for i in impls if i.ours and i.sees_nesting and i.backend in ("numpy", "torch")]
        for impl in nested:
            for rule in [r for r in opts.rules
                         if RULES[r].shapes(run.shapes["S3"]) is None and impl.absent(RULES[r]) is None]:
                progress(f"S3-nested against S3, paired: {impl.backend} {impl.name} {rule}")
                run.paired_nested.append(paired_nested_ratio(impl, run.shapes, rule, pairs, opts))
    if "adam" not in opts.rules:
        return
    for impl in [i for i in ours if BEST_PEER[i.backend][0] == i.backend and not i.module_grads]:
        peer = next((i for i in impls if (i.backend, i.name) == BEST_PEER[impl.backend]), None)
        for name in [n for n in ("S1", "S2") if n in opts.shapes and peer is not None]:
            progress(f"{name} adam against {peer.name}, paired: {impl.backend} {impl.name}")
            run.paired_peers.append(paired_peer_ratio(impl, peer, run.shapes[name], "adam", pairs, opts))


def _print_report(run: _Run) -> None:
    print("\n".join(report.header(run.opts, run.threads, run.versions, run.bandwidth, run.shapes,
                                  run.cache)))
    print()
    print("\n".join(run.agreement))
    print()
    print(report.format_table(run.rows))
    print()
    print(report.COLUMNS_NOTE)
    lines = report.format_rule_summary(run.rule_summary)
    if lines:
        print()
        print("\n".join(lines))
        print()
    lines = report.paired_lines(run.paired, run.paired_peers, run.paired_nested)
    if lines:
        print("\n".join(lines))
    for lines in (report.format_summary(run.summary), report.format_per_array(run.per_array)):
        if lines:
            print()
            print("\n".join(lines))
    for r in [r for r in run.rows if r.get("profile")]:
        print(f"\ncProfile, 3 steps, {r['backend']} {r['impl']} {r['shape']} {r['rule']} (by tottime):")
        print(r["profile"].rstrip())


def _write_json(run: _Run, elapsed: float, load: dict) -> None:
    shapes = run.shapes
    doc = {
        "args": {k: v for k, v in vars(run.opts).items() if k != "evictor"},
        "versions": run.versions,
        "machine": {"arch": platform.machine(), "cores": run.threads, "platform": platform.platform()},
        "bandwidth": run.bandwidth,
        "cache": run.cache,
        "bytes_per_param": {name: RULES[name].bytes_per_param for name in run.opts.rules},
        "bytes_model": {name: RULES[name].bytes_model for name in run.opts.rules},
        "hyperparameters": HYPERPARAMETERS,
        "rules": {name: repr(RULES[name].ours()) for name in run.opts.rules},
        "shapes": {n: {"tensors": shapes[n].n_tensors, "places": shapes[n].n_places,
                       "params": shapes[n].n_params, "layout": shapes[n].layout}
                   for n in run.opts.shapes},
        "agreement": run.agreement,
        "rows": run.rows,
        "paired_tie_ratios": run.paired,
        "paired_nested_ratios": run.paired_nested,
        "paired_peer_ratios": run.paired_peers,
        "summary": run.summary,
        "rule_summary": run.rule_summary,
        "per_array": run.per_array,
        "elapsed_s": elapsed,
        "load_average": load,
    }
    with open(run.opts.json, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    print(f"wrote {run.opts.json}")


def _run(opts) -> int:
    started = time.perf_counter()

    def progress(msg):
        print(f"[{time.perf_counter() - started:6.1f}s] {msg}", file=sys.stderr, flush=True)

    _fill_defaults(opts)
    run = _Run(opts, os.cpu_count() or 1, _versions(opts.backends), make_shapes(opts.quick))
    _warm_up_imports(opts.backends)
    load_start = _loadavg()
    progress("measuring memory bandwidth")
    run.bandwidth = measure_bandwidth(opts.bandwidth_mb, run.threads, 3 if opts.quick else 5)
    impls = [i for i in IMPLS if i.backend in opts.backends]
    opts.evictor = Evictor(opts.evict_mb, run.threads) if opts.cache != "warm" else None
    run.cache = report.cache_line(opts)
    try:
        _time_every_row(run, impls, progress)
        _time_pairs(run, impls, progress)
    finally:
        if opts.evictor is not None:
            opts.evictor.close()
        opts.evictor = None  # (its 64 MiB buffer let go)
    report.fill_ratios(run.rows, run.bandwidth["floor_gbs"])
    run.summary = report.summary(run.rows, run.paired, run.paired_peers, run.paired_nested)
    run.per_array = report.per_array(run.rows)
    run.rule_summary = report.rule_summary(run.rows)
    _print_report(run)
    elapsed = time.perf_counter() - started
    load_end = _loadavg()
    busy = max(load_start[0], load_end[0]) > run.threads + 0.5
    print(
        f"\ntotal time {elapsed:.0f} s; 1-minute load average {load_start[0]:.1f} at the start, "
        f"{load_end[0]:.1f} at the end, on {run.threads} cores"
        + ("  (the machine was busy with other work: timings are noisy)" if busy else "")
    )
    if opts.json:
        _write_json(run, elapsed, {"start": load_start, "end": load_end})
    return 0
