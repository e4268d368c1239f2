"""A cold cache between timed steps: in training, the forward and backward passes between two
optimiser steps stream far more data through the caches than they hold, so a step finds little of
its parameters, gradients and state in cache. A bench that steps back to back keeps a model that
fits in the last-level cache (S3: 4 MiB of parameters, 16 MiB with Adam's gradients and state)
warm, which flatters it. `Evictor` does that other work between steps, outside the timed region:
every core reads and writes a buffer larger than the last-level cache."""

from __future__ import annotations

import glob
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

#: --cache: `auto` evicts between the steps of the S3 family (shapes whose working set fits in
#: the last-level cache), `cold` between the steps of every shape, `warm` never
CACHE_MODES = ("auto", "cold", "warm")
DEFAULT_EVICT_MIB = 64


def last_level_cache_bytes() -> int | None:
    """The size of the largest (highest-level) cache of CPU 0, from Linux's sysfs; None elsewhere."""
    best = (0, 0)
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(index, "level")) as f:
                level = int(f.read())
            with open(os.path.join(index, "size")) as f:
                text = f.read().strip()
        except (OSError, ValueError):
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
        try:
            size = int(text.rstrip("KMGkmg")) * unit
        except ValueError:
            continue
        best = max(best, (level, size))
    return best[1] or None


def evict_mib(requested: int | None) -> int:
    """The buffer's size: as asked, or the larger of 64 MiB and twice the last-level cache."""
    if requested is not None:
        return max(1, requested)
    llc = last_level_cache_bytes() or 0
    return max(DEFAULT_EVICT_MIB, -(-2 * llc // 2**20))


def is_cold(shape: str, mode: str) -> bool:
    """Whether the steps of `shape` are timed with a cold cache under `--cache mode`."""
    if mode == "auto":
        return shape.startswith("S3")
    return mode == "cold"


class Evictor:
    """`evictor()` reads and writes every cache line of a float32 buffer of `mib` MiB, one
    contiguous chunk per core, the first on the calling thread and the others on a thread pool
    (NumPy's ufuncs release the GIL), so that every core's private caches and the shared
    last-level cache hold the buffer afterwards, not what a step touched before."""

    def __init__(self, mib: int, threads: int | None = None):
        threads = max(1, threads or os.cpu_count() or 1)
        self.mib = mib
        self.threads = threads
        self._buffer = np.zeros(max(mib * 2**20 // 4, 1024), np.float32)
        n = self._buffer.size
        step = -(-n // threads)
        self._chunks = [self._buffer[lo : lo + step] for lo in range(0, n, step)]
        self._pool = ThreadPoolExecutor(max_workers=threads - 1) if threads > 1 else None

    def __call__(self) -> None:
        futures = [self._pool.submit(_touch, c) for c in self._chunks[1:]] if self._pool else []
        _touch(self._chunks[0])
        for f in futures:
            f.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def describe(self) -> str:
        return f"{self.mib} MiB read and written by {self.threads} thread{'s' * (self.threads > 1)}"


def _touch(chunk) -> None:
    np.add(chunk, np.float32(1), out=chunk)
