"""Sets of an epoch's row positions as sorted, disjoint [start, stop) intervals, and such a set as one sequence.

A loader state records what the job has consumed of an epoch this way (O(intervals), not O(rows)), and a resume
deals what is left of it (`EpochLayout`).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

Intervals = list[tuple[int, int]]


def normalize(intervals: Iterable) -> Intervals:
    """Sorted, merged, non-empty intervals."""
    out: Intervals = []
    for a, b in sorted((int(a), int(b)) for a, b in intervals if int(b) > int(a)):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def complement(intervals: Intervals, n: int) -> Intervals:
    """[0, n) minus normalized `intervals`."""
    out, at = [], 0
    for a, b in intervals:
        if a > at:
            out.append((at, min(a, n)))
        at = max(at, b)
    if at < n:
        out.append((at, n))
    return [(a, b) for a, b in out if b > a]


class PositionSequence:
    """The positions of normalized intervals as one sequence: index i -> its i-th position."""

    def __init__(self, intervals: Intervals) -> None:
        self.intervals = intervals
        self.starts = np.array([a for a, _ in intervals], dtype=np.int64)
        lengths = np.array([b - a for a, b in intervals], dtype=np.int64)
        self.cum = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.size = int(self.cum[-1])

    def at(self, index: np.ndarray) -> np.ndarray:
        """Positions of indices (each in [0, size))."""
        k = np.searchsorted(self.cum, index, side="right") - 1
        return self.starts[k] + index - self.cum[k]

    def spans(self, a: int, b: int) -> Intervals:
        """The positions of indices [a, b) as intervals."""
        a, b = max(int(a), 0), min(int(b), self.size)
        out: Intervals = []
        k = int(np.searchsorted(self.cum, a, side="right") - 1) if a < b else 0
        while a < b:
            take = min(b, int(self.cum[k + 1]))
            out.append((int(self.starts[k] + a - self.cum[k]), int(self.starts[k] + take - self.cum[k])))
            a, k = take, k + 1
        return out
