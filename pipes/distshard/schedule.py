"""The mixing schedule: which source each position of a mixed stream comes from.

Pure arithmetic, no torch; property-tested in ``tests/test_schedule.py``.

Weights become exact integers ``w_i`` (decimal values as written: ``0.7`` is 7/10),
``W = sum(w)``. Source ``i``'s ``k``-th pick is a unit job with window
``[floor(k W / w_i), ceil((k + 1) W / w_i))``; each position takes the released
job with the earliest deadline (ties: the lower source index). These are Pfair
windows and earliest-deadline-first meets every deadline on one processor, so in
*every* prefix of ``p`` positions each source's count ``c_i(p)`` satisfies
``|c_i(p) - p w_i / W| < 1`` (a low-discrepancy schedule, not independent draws),
whatever the number of sources and however unequal the weights.

The schedule repeats every ``W`` positions (after ``W`` positions every source has
exactly ``w_i`` picks and every window starts afresh). When ``W`` is at most
:data:`PERIOD_LIMIT` one period is tabulated and every query is O(1) or O(log w);
beyond it the schedule is simulated from the start (O(p log n) to reach ``p``).
"""

from __future__ import annotations

import bisect
import heapq
import math
from fractions import Fraction
from functools import reduce
from typing import Iterator, Sequence

__all__ = ["PERIOD_LIMIT", "Schedule", "integer_weights"]

PERIOD_LIMIT = 1 << 20  # positions of a tabulated period (a few MB)


def integer_weights(weights: Sequence[float]) -> list[int]:
    """Exact positive integers in the proportions of ``weights`` (gcd 1)."""
    fractions = [Fraction(w) if isinstance(w, int) else Fraction(repr(float(w))) for w in weights]
    scale = reduce(lambda a, b: a * b // math.gcd(a, b), (f.denominator for f in fractions), 1)
    integers = [int(f * scale) for f in fractions]
    divisor = reduce(math.gcd, integers)
    return [w // divisor for w in integers]


def _edf(weights: list[int], steps: int | None) -> Iterator[int]:
    """The source of each position, by earliest deadline among released jobs."""
    total = sum(weights)
    ready = [(-(-total // w), i) for i, w in enumerate(weights)]  # job 0: deadline ceil(W / w)
    heapq.heapify(ready)
    waiting: list[tuple[int, int, int]] = []  # (release, deadline, source)
    counts = [0] * len(weights)
    position = 0
    while steps is None or position < steps:
        while waiting and waiting[0][0] <= position:
            _, deadline, source = heapq.heappop(waiting)
            heapq.heappush(ready, (deadline, source))
        deadline, source = heapq.heappop(ready)
        if deadline <= position:  # pragma: no cover - impossible for Pfair windows
            raise AssertionError(f"schedule missed a deadline at {position}")
        yield source
        counts[source] += 1
        k, w = counts[source], weights[source]
        release, deadline = k * total // w, -(-(k + 1) * total // w)
        if release <= position + 1:
            heapq.heappush(ready, (deadline, source))
        else:
            heapq.heappush(waiting, (release, deadline, source))
        position += 1


class Schedule:
    """Which source each position of the mixed stream comes from (see module doc).

    ``source_at(p)`` -> ``(source, k)``: position ``p`` holds source ``source``'s
    ``k``-th pick; ``position_of(source, k)`` is its inverse; ``count_before(source, p)``
    counts the source's picks in ``[0, p)``; ``iterate(start)`` walks positions in order.
    """

    def __init__(self, weights: Sequence[float]) -> None:
        self.weights = integer_weights(weights)
        self.period = sum(self.weights)
        self._table: list[int] | None = None
        if self.period <= PERIOD_LIMIT:
            table = list(_edf(self.weights, self.period))
            self._table = table
            self._occurrences: list[list[int]] = [[] for _ in self.weights]
            self._rank: list[int] = []
            for position, source in enumerate(table):
                self._rank.append(len(self._occurrences[source]))
                self._occurrences[source].append(position)

    @property
    def tabulated(self) -> bool:
        return self._table is not None

    def source_at(self, position: int) -> tuple[int, int]:
        if self._table is None:
            counts = [0] * len(self.weights)
            for p, source in enumerate(_edf(self.weights, position + 1)):
                if p == position:
                    return source, counts[source]
                counts[source] += 1
        q, r = divmod(position, self.period)
        source = self._table[r]  # type: ignore[index]
        return source, q * self.weights[source] + self._rank[r]

    def position_of(self, source: int, k: int) -> int:
        w = self.weights[source]
        if self._table is None:
            seen = 0
            for p, s in enumerate(_edf(self.weights, None)):
                if s == source:
                    if seen == k:
                        return p
                    seen += 1
        q, j = divmod(k, w)
        return q * self.period + self._occurrences[source][j]

    def count_before(self, source: int, position: int) -> int:
        if self._table is None:
            return sum(1 for s in _edf(self.weights, position) if s == source)
        q, r = divmod(position, self.period)
        return q * self.weights[source] + bisect.bisect_left(self._occurrences[source], r)

    def iterate(self, start: int = 0) -> Iterator[tuple[int, int]]:
        """``(source, k)`` of positions ``start, start + 1, ...`` (endless)."""
        if self._table is None:
            counts = [0] * len(self.weights)
            for p, source in enumerate(_edf(self.weights, None)):
                if p >= start:
                    yield source, counts[source]
                counts[source] += 1
        position = start
        while True:
            yield self.source_at(position)
            position += 1
