"""Running one row of the bench (check, time, memory), and timing two runners in alternation.

Every step a runner takes is preceded by its `prepare` (new gradient tensors, for the rows that
step as a training loop does), and every timed step by the cache eviction when the shape is timed
cold (`cache`): both outside the timed region."""

from __future__ import annotations

import cProfile
import gc
import io
import pstats
import statistics
import time
import traceback
from typing import Any

import optimisers as opt

from .cache import is_cold
from .implementations import Impl, Runner
from .memory import rss_extra, tracemalloc_extra
from .models import CHECK_STEPS, Data, Shape, make_data
from .rules import RULES, checked_as


def evictor_for(opts, shape: str):
    """The cache eviction to run before each timed step of `shape`, or None (a warm cache)."""
    evictor = getattr(opts, "evictor", None)
    if evictor is None or not is_cold(shape, getattr(opts, "cache", "auto")):
        return None
    return evictor


def _untimed(runner: Runner, evict=None) -> None:
    """What comes before a step and is not timed: the runner's `prepare`, then the eviction."""
    if runner.prepare is not None:
        runner.prepare()
    if evict is not None:
        evict()


def _timed(runner: Runner, evict=None) -> float:
    """Seconds of one step of `runner`, after its untimed preparation."""
    _untimed(runner, evict)
    t = time.perf_counter()
    runner.step()
    return time.perf_counter() - t


def _error_line(e: Exception) -> str:
    return (f"{type(e).__name__}: {e}".splitlines() or [type(e).__name__])[0][:300]


def _step_times(runner: Runner, repeats: int, warmup: int, quick: bool, est: float,
                evict=None) -> list[float]:
    """Seconds of `repeats` steps, each timed alone; fast steps take more repeats, slow ones fewer."""
    if warmup:
        est = sum(_timed(runner, evict) for _ in range(warmup)) / warmup
    budget = 0.1 if quick else 0.25
    if est * repeats < budget:  # fast steps: more repeats for a steadier median
        repeats = min(50, max(repeats, int(budget / max(est, 1e-6))))
    elif quick and est > 0.15:  # slow steps in --quick: fewer
        repeats = min(repeats, 3)
    elif est > 0.5:  # slow steps: the minimum of 5
        repeats = min(repeats, 5)
    return [_timed(runner, evict) for _ in range(repeats)]


def _profile(runner: Runner, n: int, top: int) -> str:
    prof = cProfile.Profile()
    for _ in range(n):
        _untimed(runner)
        prof.enable()
        runner.step()
        prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.strip_dirs().sort_stats("tottime").print_stats(top)
    text = out.getvalue()
    start = text.find("   ncalls")
    return text[start:] if start >= 0 else text


def _skip_reason(impl: Impl, shape: Shape, rule: str, opts, compile_seen: dict) -> str | None:
    """Why a JAX row is skipped: a compile of the same library on this shape and rule took too
    long. (Per rule: with `--rules all`, one rule's long compile must not hide the rows of every
    rule after it.)"""
    if impl.jit_key is None:
        return None
    prior = compile_seen.get((impl.jit_key, shape.name, rule))
    if prior is None or prior[1] <= opts.compile_limit:
        return None
    return (f"{prior[0]} compile on {shape.name} took {prior[1]:.0f} s > --compile-limit "
            f"{opts.compile_limit:g} s")


def _absent_reason(impl: Impl, shape: Shape, rule: str) -> str | None:
    """Why this row cannot run: the rule cannot take the shape, or this library lacks the rule."""
    return RULES[rule].shapes(shape) or impl.absent(RULES[rule])


def _check(runner: Runner, ref: list | None, rule: str, row: dict) -> float:
    """Run the check steps, record agreement with the reference (when the rule has one) by the
    check of entry `rule` (`rules.checked_as`); returns the last step's seconds.
    `row["first_extra_s"]`: what the first step took more than the last (our rows: compiling the
    rule's kernel, where it was not on disk yet; torchao's: torch.compile)."""
    est = first = 0.0
    for k in range(CHECK_STEPS):
        est = _timed(runner)
        first = est if k == 0 else first
    row["first_extra_s"] = max(0.0, first - est)
    got, ties = runner.fetch()
    if ref is None:
        if ties is not None:
            row["ties"] = ties
        return est
    ok, worst = RULES[rule].agreement(got, ref)
    row["agree"] = ok and ties != "TIES BROKEN"
    row["max_abs_err"] = worst
    if ties is not None:
        row["ties"] = ties
    return est


def _time_row(runner: Runner, est: float, opts, row: dict, evict=None) -> None:
    # the check steps warm up too; slow rows (a second per step) take no more
    warmup = opts.warmup if est < 0.25 else 0
    times = _step_times(runner, opts.repeats, warmup, opts.quick, est, evict)
    row["repeats"] = len(times)
    row["times_ms"] = [t * 1e3 for t in times]
    row["median_ms"] = statistics.median(times) * 1e3
    row["min_ms"] = min(times) * 1e3
    row["max_ms"] = max(times) * 1e3
    row["ns_per_param"] = row["median_ms"] * 1e6 / row["params"]


def _measure(impl: Impl, data: Data, rule: str, ref: list | None, opts, compile_seen: dict,
             row: dict) -> None:
    runner = impl.make(data, rule)
    if runner.note is not None:
        row["note"] = runner.note
    if runner.compile_s is not None:
        row["compile_s"] = runner.compile_s
        compile_seen[(impl.jit_key, data.shape.name, rule)] = (f"{impl.name} {rule}", runner.compile_s)
    if runner.setup_s is not None:
        row["setup_ms"] = runner.setup_s * 1e3
    checked = checked_as(rule, impl)
    if checked != rule:
        row["checked_as"] = checked
    est = _check(runner, ref, checked, row)
    if (impl.ours or impl.first_step_compiles) and "compile_s" not in row:
        row["compile_s"] = row["first_extra_s"]  # numba's kernels, torch.compile: at the first step
    if impl.ours and impl.backend != "jax":  # (JAX's rows are all jitted)
        row["eager"] = not opt.compiles(RULES[rule].ours())
    if runner.state_bytes is not None:
        row["state_bytes_per_param"] = runner.state_bytes() / data.shape.n_params
    evict = evictor_for(opts, data.shape.name)
    row["cache"] = "warm" if evict is None else "cold"
    _time_row(runner, est, opts, row, evict)
    if opts.rss_ok:
        _untimed(runner)  # (new gradients are the training loop's memory, not the step's)
        row["extra_bytes_rss"] = rss_extra(runner.step)
    if opts.profile and impl.ours:
        row["profile"] = _profile(runner, 3, opts.profile)
    del runner  # the tracemalloc copy below is built without this one alive
    if impl.tracemalloc:
        row["extra_bytes_tracemalloc"] = tracemalloc_extra(lambda d: impl.make(d, rule), data)


def _add_extra_memory(row: dict, shape: Shape) -> None:
    extra = row.get("extra_bytes_tracemalloc", row.get("extra_bytes_rss"))
    if extra is not None:
        row["extra_bytes"] = extra
        row["extra_method"] = "tracemalloc" if "extra_bytes_tracemalloc" in row else "rss-hwm"
        row["extra_x_params"] = extra / (4 * shape.n_params)


def run_row(impl: Impl, data: Data, rule: str, ref: list | None, opts, compile_seen: dict) -> dict:
    """One implementation on one shape and rule: checked against `ref` (None: unchecked), timed,
    memory measured. A row that cannot run says why (`absent`); a row that raises is reported
    (`error`, `traceback`), not fatal."""
    shape = data.shape
    row: dict[str, Any] = {"backend": impl.backend, "impl": impl.name, "shape": shape.name, "rule": rule,
                           "tensors": shape.n_tensors, "params": shape.n_params}
    absent = _absent_reason(impl, shape, rule)
    if absent is not None:
        row["absent"] = absent
        return row
    skipped = _skip_reason(impl, shape, rule, opts, compile_seen)
    if skipped is not None:
        row["skipped"] = skipped
        return row
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        _measure(impl, data, rule, ref, opts, compile_seen, row)
    except Exception as e:
        row["error"] = _error_line(e)
        row["traceback"] = traceback.format_exc()
    finally:
        gc.collect()
        row["row_wall_s"] = time.perf_counter() - wall
        row["row_cpu_s"] = time.process_time() - cpu
    _add_extra_memory(row, shape)
    return row


# --- paired ratios -------------------------------------------------------------------------------


def _alternate(first: Runner, second: Runner, pairs: int, evict=None) -> tuple[float, float, float]:
    """Step two runners in alternation (which goes first alternates too): `(median of the
    per-pair ratios second/first, median ms of first, median ms of second)`. On a shared machine
    two rows timed a minute apart differ by more than a few percent, so the ratios that compare
    `optimisers` with its peer are also measured this way. `evict` (the cold cache) runs before
    every timed step, outside the timing."""
    runners = (first, second)
    for _ in range(2):
        _timed(first)
        _timed(second)
    times: tuple[list, list] = ([], [])
    for k in range(pairs):
        for which in ((0, 1) if k % 2 == 0 else (1, 0)):
            times[which].append(_timed(runners[which], evict))
    ratios = [b / a for a, b in zip(*times)]
    return statistics.median(ratios), statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3


def _paired(result: dict, make_first, make_second, pairs: int, names: tuple[str, str], evict=None) -> dict:
    """`result` with the paired ratio second/first and each side's median ms under `names`."""
    first = second = None
    try:
        first, second = make_first(), make_second()
        ratio, first_ms, second_ms = _alternate(first, second, pairs, evict)
        result.update({"pairs": pairs, "ratio_median": ratio, names[0]: first_ms, names[1]: second_ms})
        result["cache"] = "warm" if evict is None else "cold"
    except Exception as e:  # reported, not fatal
        result["error"] = _error_line(e)
    finally:
        first = second = None
        gc.collect()
    return result


def paired_tie_ratio(impl: Impl, shapes: dict, rule: str, pairs: int, opts=None) -> dict:
    """S2-tied against S2 for one implementation, timed in alternation."""
    return _paired(
        {"backend": impl.backend, "impl": impl.name, "rule": rule},
        lambda: impl.make(make_data(shapes["S2"]), rule),
        lambda: impl.make(make_data(shapes["S2-tied"]), rule),
        pairs,
        ("plain_ms", "tied_ms"),
        evictor_for(opts, "S2"),
    )


def paired_nested_ratio(impl: Impl, shapes: dict, rule: str, pairs: int, opts=None) -> dict:
    """S3-nested against S3 (the same arrays as a flat list) for one implementation, timed in
    alternation."""
    return _paired(
        {"backend": impl.backend, "impl": impl.name, "rule": rule},
        lambda: impl.make(make_data(shapes["S3"]), rule),
        lambda: impl.make(make_data(shapes["S3-nested"]), rule),
        pairs,
        ("flat_ms", "nested_ms"),
        evictor_for(opts, "S3-nested"),
    )


def paired_peer_ratio(impl: Impl, peer: Impl, shape: Shape, rule: str, pairs: int, opts=None) -> dict:
    """One implementation against its peer on one shape, timed in alternation."""
    data = make_data(shape)
    return _paired(
        {"backend": impl.backend, "impl": impl.name, "peer": peer.name, "shape": shape.name, "rule": rule},
        lambda: peer.make(data, rule),
        lambda: impl.make(data, rule),
        pairs,
        ("peer_ms", "ours_ms"),
        evictor_for(opts, shape.name),
    )
