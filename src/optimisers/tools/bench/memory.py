"""Peak memory of one step above what was held before it: the RSS high-water mark (Linux), and
tracemalloc for NumPy rows (NumPy reports its array allocations to tracemalloc)."""

from __future__ import annotations

import ctypes
import gc
import tracemalloc

try:
    _LIBC = ctypes.CDLL("libc.so.6")
except OSError:  # pragma: no cover - not glibc
    _LIBC = None


def _proc_status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def can_reset_hwm() -> bool:
    """Whether this system lets the process reset its RSS high-water mark (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return "VmHWM" in _proc_status()
    except OSError:
        return False


def rss_extra(step) -> int | None:
    """Peak resident memory during `step()` above the resident memory before it: free heap pages
    are handed back first (malloc_trim), the kernel's high-water mark is reset to the current RSS
    (/proc/self/clear_refs, Linux >= 4.0), and VmHWM is read after the step."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    before = _proc_status()["VmRSS"]
    step()
    return max(0, _proc_status()["VmHWM"] - before)


def tracemalloc_extra(make_runner, data) -> int:
    """Peak NumPy (and Python) allocation during one step above what is allocated before it. The
    runner is built with tracing on, so memory freed during the step is credited."""
    gc.collect()
    tracemalloc.start()
    try:
        runner = make_runner(data)
        prepare = getattr(runner, "prepare", None) or (lambda: None)  # the training loop's, untraced
        prepare()
        for _ in range(2):  # a first step may allocate lazily, a second compile its route's walk
            runner.step()  # (`engine.replay`): once, not each step
            prepare()
        gc.collect()
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        runner.step()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return max(0, peak - before)
