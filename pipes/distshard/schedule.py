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
beyond it (weights like ``123.456789``) the schedule is simulated, keeping a saved
state every 4096 positions: walking it costs O(log n) a position, and reaching a
far position the first time costs the walk there.
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


class _Edf:
    """The schedule as a machine that can be stopped, copied and resumed: the
    source of each position, by earliest deadline among released jobs."""

    __slots__ = ("weights", "total", "position", "counts", "ready", "waiting")

    def __init__(self, weights: list[int]) -> None:
        self.weights, self.total, self.position = weights, sum(weights), 0
        self.counts = [0] * len(weights)
        self.ready = [(-(-self.total // w), i) for i, w in enumerate(weights)]  # job 0: deadline ceil(W / w)
        heapq.heapify(self.ready)
        self.waiting: list[tuple[int, int, int]] = []  # (release, deadline, source)

    def copy(self) -> "_Edf":
        other = _Edf.__new__(_Edf)
        other.weights, other.total, other.position = self.weights, self.total, self.position
        other.counts, other.ready, other.waiting = list(self.counts), list(self.ready), list(self.waiting)
        return other

    def step(self) -> tuple[int, int]:
        """``(source, k)`` of the next position."""
        position, ready, waiting = self.position, self.ready, self.waiting
        while waiting and waiting[0][0] <= position:
            _, deadline, source = heapq.heappop(waiting)
            heapq.heappush(ready, (deadline, source))
        deadline, source = heapq.heappop(ready)
        if deadline <= position:  # pragma: no cover - impossible for Pfair windows
            raise AssertionError(f"schedule missed a deadline at {position}")
        k = self.counts[source]
        self.counts[source] = k + 1
        w, total = self.weights[source], self.total
        release, deadline = (k + 1) * total // w, -(-(k + 2) * total // w)
        if release <= position + 1:
            heapq.heappush(ready, (deadline, source))
        else:
            heapq.heappush(waiting, (release, deadline, source))
        self.position = position + 1
        return source, k


def _edf(weights: list[int], steps: int | None) -> Iterator[int]:
    """The source of each of the first ``steps`` positions (all, if ``None``)."""
    machine = _Edf(weights)
    while steps is None or machine.position < steps:
        yield machine.step()[0]


class Schedule:
    """Which source each position of the mixed stream comes from (see module doc).

    ``source_at(p)`` -> ``(source, k)``: position ``p`` holds source ``source``'s
    ``k``-th pick; ``position_of(source, k)`` is its inverse; ``count_before(source, p)``
    counts the source's picks in ``[0, p)``; ``iterate(start)`` walks positions in order.
    """

    CHECKPOINT = 4096  # positions between saved states of an untabulated schedule

    def __init__(self, weights: Sequence[float]) -> None:
        self.weights = integer_weights(weights)
        self.period = sum(self.weights)
        self._table: list[int] | None = None
        self._saved: list[_Edf] = [_Edf(self.weights)]  # untabulated: states every CHECKPOINT
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

    def _machine_at(self, position: int) -> _Edf:
        """A simulation stopped at ``position`` (from the nearest saved state,
        saving states on the way: sequential use costs O(log n) a position)."""
        index = min(position // self.CHECKPOINT, len(self._saved) - 1)
        machine = self._saved[index].copy()
        while machine.position < position:
            machine.step()
            if machine.position % self.CHECKPOINT == 0 and machine.position // self.CHECKPOINT == len(self._saved):
                self._saved.append(machine.copy())
        return machine

    def source_at(self, position: int) -> tuple[int, int]:
        if self._table is None:
            return self._machine_at(position).step()
        q, r = divmod(position, self.period)
        source = self._table[r]
        return source, q * self.weights[source] + self._rank[r]

    def position_of(self, source: int, k: int) -> int:
        if self._table is None:
            # the k-th pick lies in its Pfair window, at most 1 before its ideal place
            low = max(0, k * self.period // self.weights[source] - 1)
            machine = self._machine_at(low)
            while True:
                s, j = machine.step()
                if s == source and j == k:
                    return machine.position - 1
        q, j = divmod(k, self.weights[source])
        return q * self.period + self._occurrences[source][j]

    def count_before(self, source: int, position: int) -> int:
        if self._table is None:
            return self._machine_at(position).counts[source]
        q, r = divmod(position, self.period)
        return q * self.weights[source] + bisect.bisect_left(self._occurrences[source], r)

    def iterate(self, start: int = 0) -> Iterator[tuple[int, int]]:
        """``(source, k)`` of positions ``start, start + 1, ...`` (endless)."""
        if self._table is None:
            machine = self._machine_at(start)
            while True:
                yield machine.step()
        position = start
        while True:
            yield self.source_at(position)
            position += 1
