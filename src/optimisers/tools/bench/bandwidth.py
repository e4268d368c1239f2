"""The memory-bandwidth floor a step is compared with, measured with NumPy in the same run."""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

KERNELS = ("copy", "triad", "update")
_BLOCK = 131072  # elements per pass of a two-pass kernel (512 KiB), so that the passes meet in cache


def _kernels(n: int) -> dict:
    """`name -> (chunk function (lo, hi), bytes counted per run over all n elements)`."""
    a = np.ones(n, np.float32)
    b = np.full(n, 2.0, np.float32)
    c = np.full(n, 0.5, np.float32)
    s = np.float32(1e-3)

    def copy_chunk(lo, hi):
        np.copyto(b[lo:hi], a[lo:hi])

    def triad_chunk(lo, hi):
        for i in range(lo, hi, _BLOCK):
            j = min(i + _BLOCK, hi)
            np.multiply(c[i:j], s, out=a[i:j])
            np.add(a[i:j], b[i:j], out=a[i:j])

    def update_chunk(lo, hi):
        tmp = np.empty(min(_BLOCK, hi - lo), np.float32)
        for i in range(lo, hi, _BLOCK):
            j = min(i + _BLOCK, hi)
            t = tmp[: j - i]
            np.multiply(c[i:j], s, out=t)
            np.add(a[i:j], t, out=a[i:j])

    return {"copy": (copy_chunk, 8 * n), "triad": (triad_chunk, 12 * n), "update": (update_chunk, 12 * n)}


def _chunks(n: int, k: int) -> list[tuple[int, int]]:
    """`k` contiguous (lo, hi) ranges covering 0..n, each a multiple of 1024 elements long."""
    step = -(-n // k)
    step = -(-step // 1024) * 1024
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


def _seconds(fn, n: int, chunks: list, pool, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats + 1):  # the first pass warms the pages and the threads
        t0 = time.perf_counter()
        if len(chunks) == 1:
            fn(0, n)
        else:
            list(pool.map(lambda lh: fn(*lh), chunks))
        times.append(time.perf_counter() - t0)
    return times[1:]


def measure_bandwidth(mb: int, threads: int, repeats: int, kernels=KERNELS, one_thread=True) -> dict:
    """Memory bandwidth with NumPy over float32 arrays of `mb` MiB each, one contiguous chunk per
    thread (NumPy ufuncs release the GIL), bytes counted as STREAM counts them:

    - copy `b = a` (8 bytes/element) and triad `a = b + s*c` (12): STREAM's kernels, for reference.
      Their destination is written without being read, so the hardware also reads it first
      (write-allocate), traffic that is not counted: they understate what the memory delivers.
    - update `a += s*b` (12 bytes/element): every array written is read first, as in an optimiser
      step, so the counted bytes are the real traffic. The floor uses this one."""
    n = max(mb * 2**20 // 4, 1 << 16)
    table = _kernels(n)
    result = {"array_mib": round(n * 4 / 2**20, 1), "threads": threads, "repeats": repeats}
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for k in sorted({1, threads} if one_thread else {threads}):
            chunks = _chunks(n, k)
            for name in kernels:
                fn, nbytes = table[name]
                times = _seconds(fn, n, chunks, pool, repeats)
                key = f"{name}_{k}t" if k != threads else name
                result[key + "_gbs_median"] = nbytes / statistics.median(times) / 1e9
                result[key + "_gbs_best"] = nbytes / min(times) / 1e9
    if "update_gbs_best" in result:
        result["floor_gbs"] = result["update_gbs_best"]
    return result
