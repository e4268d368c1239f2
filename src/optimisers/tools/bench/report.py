"""What the bench prints: the header (machine, bandwidth, shapes), the agreement lines, the table,
the paired ratios, and a summary of `optimisers` against its peers."""

from __future__ import annotations

import platform

from .bandwidth import KERNELS
from .cache import is_cold
from .implementations import BEST_PEER, FALLBACK_PEER, IMPLS
from .models import CHECK_STEPS
from .rules import RULES

# the main rows
OURS = {impl.backend: impl.name for impl in IMPLS if impl.ours and not impl.flat and not impl.module_grads}
OURS_FLAT = [(impl.backend, impl.name) for impl in IMPLS if impl.ours and impl.flat]  # (torch: two)
# stepped with optimisers.grads(module) and new gradient tensors every step
OURS_GRADS = [(impl.backend, impl.name) for impl in IMPLS if impl.module_grads]
# the rows whose model is the tree (not a drop-in, which takes a list of parameters)
SEES_NESTING = {(impl.backend, impl.name) for impl in IMPLS if impl.sees_nesting}
_SHORT_PEER = {"torch.optim fused": "torch fused", "optax jit+donate": "optax j+d",
               "naive NumPy loop": "naive np"}


def cache_line(opts) -> str:
    """How the caches are treated between timed steps, by shape."""
    evictor = getattr(opts, "evictor", None)
    if evictor is None:
        return "cache: warm (steps timed back to back) for every shape"
    names = [n for n in opts.shapes if is_cold(n, opts.cache)]
    if not names:
        return "cache: warm (steps timed back to back) for the shapes of this run"
    cold = "every shape" if opts.cache == "cold" else ", ".join(names)
    line = (f"cache: cold for {cold}: before each timed step (untimed) {evictor.describe()}, as the "
            "forward and backward passes between two steps of training evict what a step touched")
    if len(names) < len(opts.shapes):
        line += "; warm (back to back) for the others"
    return line


def header(opts, threads: int, versions: dict, bw: dict, shapes: dict, cache: str = "") -> list[str]:
    """The machine, the versions, the bandwidth measurements and the shapes with their floors."""
    floor, samples = bw["floor_gbs"], bw["floor_samples_gbs"]
    out = [
        f"optimisers bench{' --quick' if opts.quick else ''}: {platform.machine()}, {threads} cores, "
        + ", ".join(f"{k} {v}" for k, v in versions.items()),
        "",
        f"Bandwidth ({bw['array_mib']} MiB float32 arrays, {threads} threads, median/best of "
        f"{bw['repeats']}):",
        "  " + "   ".join(
            f"{k} {bw[k + '_gbs_median']:5.1f} / {bw[k + '_gbs_best']:5.1f}" for k in KERNELS
        ) + " GB/s",
    ]
    if threads != 1:
        out.append("  1 thread: " + ", ".join(
            f"{k} {bw[k + '_1t_gbs_median']:.1f} / {bw[k + '_1t_gbs_best']:.1f}" for k in KERNELS
        ) + " GB/s")
    out.append(
        f"  floor bandwidth = {floor:.1f} GB/s: the best in-place update a += s*b with all threads, "
        f"measured at the start and after each shape ({', '.join(f'{x:.1f}' for x in samples)})"
    )
    out.append("  (copy and triad also pay uncounted write-allocate reads; an optimiser step does not)")
    out.append("  bytes per float32 parameter per step:")
    out += [f"    {k}: {RULES[k].bytes_model}" for k in opts.rules]
    for name in opts.shapes:
        s = shapes[name]
        floors = ", ".join(f"{rule} {_floor_ms(rule, s.n_params, floor)}" for rule in opts.rules)
        out.append(f"  {name:9} {s.n_tensors:5d} tensors, {s.n_places:5d} places, {s.n_params:>10,} "
                   f"params ({s.layout}); floor: {floors}")
    if cache:
        out.append(cache)
    return out


def _floor_ms(rule: str, n_params: int, floor_gbs: float) -> str:
    per_param = RULES[rule].bytes_per_param
    return "—" if per_param is None else f"{per_param * n_params / floor_gbs / 1e6:.2f} ms"


def agreement_line(shape: str, rule: str, group: list) -> str:
    """How many rows of one (shape, rule) agree with the float64 reference, and the largest error."""
    ran = [r for r in group if "absent" not in r]
    if not ran and group:
        return f"check {shape} {rule}: not run ({group[0]['absent']})"
    if RULES[rule].naive is None:
        return f"check {shape} {rule}: not checked (no naive formula, the float64 reference, in the table)"
    checked = [r for r in group if "agree" in r]
    bad = [r for r in checked if not r["agree"]]
    worst = max(checked, key=lambda r: r["max_abs_err"], default=None)
    line = (
        f"check {shape} {rule}: {len(checked) - len(bad)}/{len(checked)} implementations "
        f"agree with the float64 reference after {CHECK_STEPS} steps ({RULES[rule].describe_check()})"
    )
    anchors = sorted({r["checked_as"] for r in checked if "checked_as" in r})
    if anchors:  # a low-bit entry's float32 rows
        line += "; the float32 rows against " + ", ".join(
            f"{a}'s ({RULES[a].describe_check()})" for a in anchors)
    if worst is not None:
        line += f"; largest |err| {worst['max_abs_err']:.1e} ({worst['backend']} {worst['impl']})"
    if bad:
        line += "; DISAGREE: " + ", ".join(
            f"{r['backend']} {r['impl']} ({r.get('ties') or format(r['max_abs_err'], '.1e')})" for r in bad
        )
    failed = [r for r in group if "error" in r]  # not counted above: say so, lest k/k read as all
    if failed:
        line += "; FAILED (error, see the table): " + ", ".join(f"{r['backend']} {r['impl']}" for r in failed)
    return line


def fill_ratios(rows: list, floor_gbs: float | None) -> None:
    """Add each row's floor (`floor_ms`, `x_floor`) and its ratio to its peer (`peer`, `x_peer`)."""
    by = {(r["backend"], r["impl"], r["shape"], r["rule"]): r for r in rows}
    for r in rows:
        per_param = RULES[r["rule"]].bytes_per_param
        if floor_gbs and per_param is not None:
            r["floor_ms"] = per_param * r["params"] / (floor_gbs * 1e9) * 1e3
            if "median_ms" in r:
                r["x_floor"] = r["median_ms"] / r["floor_ms"]
                r["x_floor_min"] = r["min_ms"] / r["floor_ms"]
        if "median_ms" not in r:
            continue
        # (the torch rows have no fallback: before rules without a torch peer, a missing fused row
        # never reached the second, absent, one)
        for backend, name in [BEST_PEER[r["backend"]], *[FALLBACK_PEER[b] for b in [r["backend"]]
                                                          if b in FALLBACK_PEER]]:
            peer = by.get((backend, name, r["shape"], r["rule"]))
            if peer is not None and "median_ms" in peer:
                r["peer"] = name
                r["x_peer"] = r["median_ms"] / peer["median_ms"]
                r["x_peer_min"] = r["min_ms"] / peer["min_ms"]
                if "compile_s" in r and "compile_s" in peer:
                    r["x_peer_compile"] = r["compile_s"] / peer["compile_s"]
                break


def _fmt(value, spec, width):
    return (format(value, spec) if value is not None else "-").rjust(width)


IMPL_WIDTH, SHAPE_WIDTH = 34, 9


def _table_line(r: dict, rule_width: int = 8) -> str:
    lead = f"{r['backend']:7} {r['impl']:{IMPL_WIDTH}} {r['shape']:{SHAPE_WIDTH}} {r['rule']:{rule_width}} "
    if "median_ms" not in r:
        if "absent" in r:
            why = f"— ({r['absent']})"
        elif "skipped" in r:
            why = f"skipped ({r['skipped']})"
        else:
            why = f"n/a (error: {r.get('error')})"
        return lead + why[:110]
    extra = r.get("extra_bytes")
    method = {"tracemalloc": "t", "rss-hwm": "r"}.get(r.get("extra_method"), "")
    if "agree" not in r:
        agree = "unchecked"
    else:
        agree = "ok" if r["agree"] else f"DIFF {r['max_abs_err']:.1e}"
    if r.get("ties"):
        agree += ", " + r["ties"]
    if r.get("note"):
        agree += f" ({r['note']})"
    if r.get("cache") == "cold":
        agree += ", cold"
    return (
        lead
        + f"{r['median_ms']:8.2f} {r['min_ms']:8.2f} {r['max_ms']:8.2f} {r['repeats']:3d} "
        + _fmt(r.get("x_floor"), ".2f", 7) + " "
        + _fmt(r.get("x_peer"), ".2f", 6) + " "
        + f"{_SHORT_PEER.get(r.get('peer'), r.get('peer') or '-'):11} "
        + ("eager".rjust(8) if r.get("eager") else _fmt(r.get("compile_s"), ".2f", 8)) + " "
        + _fmt(r.get("setup_ms"), ".1f", 7) + " "
        + (_fmt(extra / 2**20, ".1f", 7) + method if extra is not None else _fmt(None, "", 8)) + " "
        + _fmt(r.get("extra_x_params"), ".2f", 6) + " "
        + _fmt(r.get("state_bytes_per_param"), ".2f", 6) + " "
        + _fmt(r.get("ns_per_param"), ".2f", 7) + " "
        + agree
    )


def format_table(rows: list) -> str:
    w = max([8] + [len(r["rule"]) for r in rows])
    iw, sw = IMPL_WIDTH, SHAPE_WIDTH
    head = (
        f"{'backend':7} {'impl':{iw}} {'shape':{sw}} {'rule':{w}} {'median':>8} {'min':>8} {'max':>8} "
        f"{'n':>3} {'xfloor':>7} {'xpeer':>6} {'peer':11} {'compile':>8} {'setup':>7} "
        f"{'extraMB':>8} {'xparam':>6} {'state':>6} {'ns':>7} agree"
    )
    units = (
        f"{'':7} {'':{iw}} {'':{sw}} {'':{w}} {'ms':>8} {'ms':>8} {'ms':>8} {'':>3} {'':>7} {'':>6} {'':11} "
        f"{'s':>8} {'ms':>7} {'':>8} {'':>6} {'B/par':>6} {'/param':>7}"
    )
    lines = [head, units.rstrip(), "-" * len(head)]
    last = None
    for r in rows:
        group = (r["shape"], r["rule"])
        if last is not None and group != last:
            lines.append("")
        last = group
        lines.append(_table_line(r, w))
    return "\n".join(lines)


COLUMNS_NOTE = (
    "xfloor: median / (bytes per param x params / floor bandwidth). xpeer: median / the peer's "
    "median (same shape and rule). extraMB: peak memory above the step's start, t = tracemalloc "
    "(NumPy allocations), r = RSS high-water mark; xparam: extraMB / parameter bytes. setup: "
    "median of 3 calls of setup on the model. cold: the caches evicted before each timed step "
    "(see the cache line above). compile: a JAX row's jit, torchao's torch.compile, or what our "
    "first step took more than the last (numba's kernels); eager: a NumPy or PyTorch row of ours "
    "whose rule the compiled way cannot trace (`optimisers.compiles`), so it runs "
    "the eager step. state: bytes of the optimiser's state arrays per parameter (step counters "
    "left out). ns/param: median / parameters."
)


def format_paired(title: str, results: list, label, detail) -> list[str]:
    """Lines for a list of paired results; `label(p)` names one, `detail(p)` its medians."""
    if not results:
        return []
    lines = [f"{title}, paired (the two stepped in alternation, median of the per-pair ratios; "
             "medians in ms):"]
    for p in results:
        what = f"  {label(p)}:"
        if "error" in p:
            lines.append(f"{what} n/a: {p['error']}")
        else:
            lines.append(f"{what} {p['ratio_median']:.3f}  ({detail(p)}, {p['pairs']} pairs)")
    return lines


def _cache_note(p: dict) -> str:
    return ", cold" if p.get("cache") == "cold" else ""


def paired_lines(paired: list, paired_peers: list, paired_nested: list = ()) -> list[str]:
    return format_paired(
        "S2-tied / S2", paired,
        lambda p: f"{p['backend']:7} {p['impl']:{IMPL_WIDTH}} {p['rule']:9}",
        lambda p: f"S2 {p['plain_ms']:.2f}, S2-tied {p['tied_ms']:.2f}{_cache_note(p)}",
    ) + format_paired(
        "nested S3 / S3", list(paired_nested),
        lambda p: f"{p['backend']:7} {p['impl']:{IMPL_WIDTH}} {p['rule']:9}",
        lambda p: f"S3 {p['flat_ms']:.2f}, S3-nested {p['nested_ms']:.2f}{_cache_note(p)}",
    ) + format_paired(
        "optimisers / peer", paired_peers,
        lambda p: f"{p['backend']:7} {p['shape']:7} {p['impl']} / {p['peer']}",
        lambda p: f"ours {p['ours_ms']:.2f}, peer {p['peer_ms']:.2f}{_cache_note(p)}",
    )


# --- the summary -------------------------------------------------------------------------------


def _against_peers(by: dict, paired_peers: list) -> list[dict]:
    """Adam: each `optimisers` row over its peer's, the paired ratio where there is one."""
    pair = {(p["backend"], p["shape"]): p for p in paired_peers if "ratio_median" in p}
    out = []
    for backend, impl in [*OURS.items(), *OURS_FLAT]:
        for shape in ("S1", "S2", "S3", "S3-nested"):
            r = by.get((backend, impl, shape, "adam"))
            if r is None or "x_peer" not in r:
                continue
            p = pair.get((backend, shape)) if r["peer"] == BEST_PEER[backend][1] else None
            p = p if p is not None and p.get("impl") == impl else None
            out.append({"what": f"{backend} {shape}: {impl} / {r['peer']}",
                        "ratio": p["ratio_median"] if p else r["x_peer"],
                        "ratio_of_minimums": None if p else r["x_peer_min"], "paired": p is not None})
    return out


def _tied_over_untied(by: dict, paired: list) -> list[dict]:
    """Adam: each `optimisers` implementation on S2-tied over S2, the paired ratio where there is
    one; for the row stepped with `optimisers.grads(module)`, "S2-tied (opt.grads) / S2"."""
    pair = {(p["backend"], p["impl"]): p for p in paired if p["rule"] == "adam" and "ratio_median" in p}
    out = []
    for backend, impl in [*OURS.items(), *OURS_GRADS]:
        tied, plain = by.get((backend, impl, "S2-tied", "adam")), by.get((backend, impl, "S2", "adam"))
        how = " (opt.grads)" if (backend, impl) in OURS_GRADS else ""
        what = f"{backend} S2-tied{how} / S2: {impl}"
        if (backend, impl) in pair:
            out.append({"what": what, "ratio": pair[backend, impl]["ratio_median"], "ratio_of_minimums": None,
                        "paired": True})
        elif tied and plain:
            out.append({"what": what, "ratio": tied["median_ms"] / plain["median_ms"],
                        "ratio_of_minimums": tied["min_ms"] / plain["min_ms"], "paired": False})
    return out


def _nested_over_flat(by: dict, paired_nested: list) -> list[dict]:
    """Adam: each `optimisers` implementation on S3-nested over S3 (the same arrays as a flat
    list), the paired ratio where there is one."""
    pair = {(p["backend"], p["impl"]): p for p in paired_nested
            if p["rule"] == "adam" and "ratio_median" in p}
    out = []
    for backend, impl in [k for k in [*OURS.items(), *OURS_GRADS, *OURS_FLAT] if k in SEES_NESTING]:
        nested, flat = by.get((backend, impl, "S3-nested", "adam")), by.get((backend, impl, "S3", "adam"))
        what = f"{backend} nested S3 / S3: {impl}"
        if (backend, impl) in pair:
            out.append({"what": what, "ratio": pair[backend, impl]["ratio_median"], "ratio_of_minimums": None,
                        "paired": True})
        elif nested and flat:
            out.append({"what": what, "ratio": nested["median_ms"] / flat["median_ms"],
                        "ratio_of_minimums": nested["min_ms"] / flat["min_ms"], "paired": False})
    return out


def summary(rows: list, paired: list = (), paired_peers: list = (), paired_nested: list = ()) -> list[dict]:
    """The Adam ratios a reader looks for first: `optimisers` over torch.optim fused / optax
    jit+donate (the naive NumPy loop where torch did not run) per shape, a tied model over the
    same model untied, and S3 nested over S3 as a flat list. Each entry: `what`, `ratio` (of
    medians, or the paired median), `ratio_of_minimums` (unpaired only) and `paired`."""
    by = {(r["backend"], r["impl"], r["shape"], r["rule"]): r for r in rows
          if r["rule"] == "adam" and "median_ms" in r}
    return (_against_peers(by, paired_peers) + _tied_over_untied(by, paired)
            + _nested_over_flat(by, paired_nested))


def per_array(rows: list) -> list[dict]:
    """Adam: what each of S3's arrays costs beyond its elements, for each `optimisers` row run on
    S3 (and S3-nested) and S3-one (the same elements as one vector): `us_per_array` = (S3 -
    S3-one) / S3's arrays, in µs per array per step, and `x_one` = S3 / S3-one; `cache` says
    whether the rows were timed with a cold cache (the default for the S3 family)."""
    by = {(r["backend"], r["impl"], r["shape"]): r for r in rows if r["rule"] == "adam" and "median_ms" in r}
    out = []
    for backend, impl in [*OURS.items(), *OURS_GRADS, *OURS_FLAT]:
        one = by.get((backend, impl, "S3-one"))
        for shape in ("S3", "S3-nested"):
            many = by.get((backend, impl, shape))
            if many and one:
                extra_ms = many["median_ms"] - one["median_ms"]
                cold = many.get("cache") == "cold" and one.get("cache") == "cold"
                out.append({"backend": backend, "impl": impl, "shape": shape,
                            "us_per_array": extra_ms * 1e3 / many["tensors"],
                            "x_one": many["median_ms"] / one["median_ms"], "one_ms": one["median_ms"],
                            "cache": "cold" if cold else "warm"})
    return out


def format_per_array(entries: list) -> list[str]:
    if not entries:
        return []
    lines = ["Per-array overhead, Adam: (S3 - S3-one) / S3's arrays, and S3 over its elements as one "
             "vector (S3-one); the same for S3-nested:"]
    lines += [f"  {e['backend']:7} {e['impl']:{IMPL_WIDTH}} {e['shape']:9} {e['us_per_array']:7.3f} µs per "
              f"array per step   {e['x_one']:6.2f}x one vector ({e['one_ms']:.2f} ms, {e['cache']} cache)"
              for e in entries]
    return lines


def format_summary(entries: list) -> list[str]:
    if not entries:
        return []
    lines = ["Adam, optimisers against the peers (ratio of medians [of minimums], or the paired median; "
             "below 1 is faster):"]
    for e in entries:
        by_min = f"[{e['ratio_of_minimums']:.3g}]" if e["ratio_of_minimums"] is not None else ""
        lines.append(f"  {e['what']:66} {e['ratio']:7.3g} {by_min:>8}{'  (paired)' if e['paired'] else ''}")
    return lines


# --- per rule: the line the README quotes ------------------------------------------------------

OURS_ROWS = {(impl.backend, impl.name) for impl in IMPLS if impl.ours}
# how the rule summary names our fastest row (the plain `update_` row goes unnamed)
_SHORT_OURS = {"optimisers update_": "", "optimisers jit+donate": "",
               "optimisers update_, flat views": "flat", "optimisers update_, flatten_": "flat",
               "optimisers drop-in, flatten_": "flat drop-in",
               "optimisers update_, opt.grads": "opt.grads", "optimisers jit+donate, flat vector": "flat"}
_BACKEND_TITLES = {"numpy": "NumPy", "torch": "PyTorch", "jax": "JAX"}
_SUMMARY_PEER = {**_SHORT_PEER, "torch.optim foreach=False": "torch loop",
                 "torch.optim foreach=True": "torch foreach"}
NAIVE = ("numpy", "naive NumPy loop")


def _fastest(rows: list) -> dict | None:
    return min(rows, key=lambda r: r["median_ms"], default=None)


def rule_summary(rows: list) -> list[dict]:
    """Per rule, shape and backend: our fastest row there (`ours`, its `ours_ms` and `x_floor`),
    and the fastest peer of that backend's library (every torch.optim variant, or the other
    package's class, for NumPy and PyTorch, both on the same CPU; optax for JAX), with
    `x_peer` = our median over its; where no library has the rule, the naive NumPy loop on the
    CPU backends (`peer` says which). Rows that did not run, or disagree with the reference, are
    left out: a fast wrong row is no result."""
    ran = [r for r in rows if "median_ms" in r and r.get("agree", True)]
    out = []
    for rule in dict.fromkeys(r["rule"] for r in ran):
        for shape in dict.fromkeys(r["shape"] for r in ran if r["rule"] == rule):
            here = [r for r in ran if r["rule"] == rule and r["shape"] == shape]
            for backend in dict.fromkeys(r["backend"] for r in here):
                ours = _fastest([r for r in here if r["backend"] == backend
                                 and (r["backend"], r["impl"]) in OURS_ROWS])
                if ours is None:
                    continue
                library = BEST_PEER[backend][0]
                peer = _fastest([r for r in here if r["backend"] == library
                                 and (r["backend"], r["impl"]) not in OURS_ROWS
                                 and (r["backend"], r["impl"]) != NAIVE])
                if peer is None and backend in ("numpy", "torch"):
                    peer = _fastest([r for r in here if (r["backend"], r["impl"]) == NAIVE])
                out.append({
                    "rule": rule, "shape": shape, "backend": backend, "ours": ours["impl"],
                    "ours_ms": ours["median_ms"], "x_floor": ours.get("x_floor"),
                    "peer": None if peer is None else (peer.get("note") or peer["impl"]),
                    "peer_ms": None if peer is None else peer["median_ms"],
                    "x_peer": None if peer is None else ours["median_ms"] / peer["median_ms"],
                })
    return out


def _summary_cell(e: dict | None) -> str:
    if e is None:
        return ""
    floor = "no floor" if e["x_floor"] is None else f"{e['x_floor']:.2f}× floor"
    peer = "no peer" if e["peer"] is None else f"{e['x_peer']:.2f}× {_SUMMARY_PEER.get(e['peer'], e['peer'])}"
    which = _SHORT_OURS.get(e["ours"], e["ours"])
    return f"{floor}, {peer}" + (f" ({which})" if which else "")


def format_rule_summary(entries: list) -> list[str]:
    """The rule summary as a Markdown table, one line per rule and shape, a column per backend."""
    if not entries:
        return []
    backends = list(dict.fromkeys(e["backend"] for e in entries))
    cells = {(e["rule"], e["shape"], e["backend"]): e for e in entries}
    lines = ["Per rule: our fastest row on each backend (named where it is not `update_`), its median "
             "over the bandwidth floor and over the fastest peer's (torch.optim's variants or another "
             "package's class for NumPy and PyTorch, optax for JAX; the naive NumPy loop where no "
             "library has the rule):",
             "",
             "| rule | shape | " + " | ".join(_BACKEND_TITLES.get(b, b) for b in backends) + " |",
             "|---|---|" + "---|" * len(backends)]
    for rule, shape in dict.fromkeys((e["rule"], e["shape"]) for e in entries):
        row = [_summary_cell(cells.get((rule, shape, b))) for b in backends]
        lines.append(f"| {rule} | {shape} | " + " | ".join(row) + " |")
    return lines
