"""Byte ranges: does any gradient reach into a parameter's memory? Asked of every step's arrays
by address (first byte, one past the last), so that it holds whatever buffer, storage or object
owns the memory (two `np.frombuffer` views of one buffer have unrelated `.base`s; two torch
storages may be made over the same bytes)."""

from __future__ import annotations

import numpy as np


class ByteRanges:
    """Ranges `[first, end)` of bytes (empty ones hold none), sorted once by their first byte,
    then asked of other ranges, one binary search each, whether they share a byte with one."""

    __slots__ = ("starts", "ends")

    def __init__(self, first, end):
        first, end = np.asarray(first, np.int64), np.asarray(end, np.int64)
        has_bytes = first < end
        order = np.argsort(first[has_bytes], kind="stable")
        self.starts = first[has_bytes][order]
        self.ends = np.maximum.accumulate(end[has_bytes][order])  # (each end the greatest so far)

    def overlap_one_another(self) -> bool:
        return bool((self.starts[1:] < self.ends[:-1]).any())

    def reached(self, first, end) -> np.ndarray:
        """For each range `[first[i], end[i])`: does it share a byte with one of these?"""
        first, end = np.asarray(first, np.int64), np.asarray(end, np.int64)
        if not len(self.starts):
            return np.zeros(len(first), bool)
        before = np.searchsorted(self.starts, end)  # the ranges that start before it ends
        return (first < end) & (before > 0) & (self.ends[np.maximum(before - 1, 0)] > first)
