"""The mixing schedule: which source each position of a mixed stream comes from.

Pure arithmetic, no torch; property-tested in ``tests/test_schedule.py``. Every
schedule answers the same four questions: ``source_at(p)`` -> ``(source, k)``
(position ``p`` holds the source's ``k``-th pick), ``position_of(source, k)`` (its
inverse, ``None`` if that pick never comes), ``count_before(source, p)`` (the
source's picks in ``[0, p)``) and ``iterate(start)`` (the picks of ``start, start +
1, ...`` in order). Three kinds, built by :func:`make_schedule`:

:class:`Schedule` (weights over counts, one phase). Weights become exact integers
``w_i`` (decimal values as written: ``0.7`` is 7/10), ``W = sum(w)``. Source ``i``'s
``k``-th pick is a unit job with window ``[floor(k W / w_i), ceil((k + 1) W / w_i))``;
each position takes the released job with the earliest deadline (ties: the lower
source index). These are Pfair windows and earliest-deadline-first meets every
deadline on one processor, so in *every* prefix of ``p`` positions each source's
count ``c_i(p)`` satisfies ``|c_i(p) - p w_i / W| < 1`` (a low-discrepancy schedule,
not independent draws), whatever the number of sources and however unequal the
weights. A source of weight 0 never appears. The schedule repeats every ``W``
positions; when ``W`` is at most :data:`PERIOD_LIMIT` one period is tabulated and
every query is O(1) or O(log w); beyond it (weights like ``123.456789``) it is
simulated, keeping a saved state every 4096 positions.

:class:`PhasedSchedule` (``[(0, w0), (start1, w1), ...]``): positions from
``start_k`` on follow a fresh :class:`Schedule` of ``w_k``, so every prefix of a
phase *counted from its start* is within 1 of the phase's shares; picks are
numbered across phases (``k`` goes on where the source stopped), so a source
never repeats an element because a phase began. Queries cost O(log phases) more.

:class:`CostSchedule` (weights over per-element costs, with or without phases):
weights are shares of *cost* (tokens, bytes). Element ``k`` of source ``i`` costs
``costs[i][k % n_i]`` (passes repeat the costs). Within a phase, with ``C`` the
phase's cost so far, ``C_i`` source ``i``'s and ``s_i = w_i / W``, each position
takes, among the sources whose next element may start (``C_i / s_i <= C``), the one
whose next element would finish first (smallest ``(C_i + c) / s_i``; ties: the lower
index). That is WF²Q (worst-case fair weighted fair queueing, Bennett & Zhang 1996)
with every source always backlogged; it keeps every source, in every prefix, within
the largest element cost of its share of the prefix's cost: ``-c_max <= C_i - s_i C
<= c_max`` (better than the ``(sources - 1) c_max`` of largest-deficit-first). The
arithmetic is exact (:func:`exact_costs`: float costs scaled to integers by one power
of two), so the bound holds for every finite cost, ``1e306`` and subnormals alike. It
depends on the costs, so it is simulated once and tabulated compactly (a byte a
position plus the counts every 64 positions).
"""

from __future__ import annotations

import bisect
import heapq
import math
from array import array
from fractions import Fraction
from functools import reduce
from itertools import pairwise
from typing import Iterator, Sequence

from .errors import OptionError

__all__ = [
    "PERIOD_LIMIT",
    "CostSchedule",
    "PhasedSchedule",
    "Schedule",
    "exact_costs",
    "integer_weights",
    "make_schedule",
]

PERIOD_LIMIT = 1 << 20  # positions of a tabulated period (a few MB)


def integer_weights(weights: Sequence[float]) -> list[int]:
    """Exact non-negative integers in the proportions of ``weights`` (gcd 1; some positive)."""
    fractions = [Fraction(w) if isinstance(w, int) else Fraction(repr(float(w))) for w in weights]
    scale = reduce(lambda a, b: a * b // math.gcd(a, b), (f.denominator for f in fractions), 1)
    integers = [int(f * scale) for f in fractions]
    divisor = reduce(math.gcd, integers)
    if divisor <= 0 or min(integers) < 0:
        raise OptionError(f"weights {list(weights)} must be non-negative with at least one positive")
    return [w // divisor for w in integers]


class _Edf:
    """The schedule as a machine that can be stopped, copied and resumed: the
    source of each position, by earliest deadline among released jobs (over the
    sources of positive weight)."""

    __slots__ = ("weights", "total", "position", "counts", "ready", "waiting")

    def __init__(self, weights: list[int]) -> None:
        self.weights, self.total, self.position = weights, sum(weights), 0
        self.counts = [0] * len(weights)
        self.ready = [(-(-self.total // w), i) for i, w in enumerate(weights) if w]  # job 0: deadline ceil(W / w)
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
    """Which source each position comes from, by count weights (see module doc)."""

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

    def position_of(self, source: int, k: int) -> int | None:
        if not self.weights[source]:
            return None
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

    def first_reaching(self, counts: Sequence[int]) -> int | None:
        """The first position whose pick is pick ``counts[i]`` of its source ``i``
        (``None`` if none ever is): where ``stop="first_exhausted"`` ends. A pick
        never comes before its window opens, so sources that cannot be first are skipped."""
        total, weights = self.period, self.weights
        active = [i for i in range(len(counts)) if weights[i]]
        opens = sorted(active, key=lambda i: counts[i] * total // weights[i])
        end: int | None = None
        for i in opens:
            if end is not None and counts[i] * total // weights[i] >= end:
                break
            found = self.position_of(i, counts[i])
            assert found is not None
            end = found if end is None else min(end, found)
        return end

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


def _phase_of(starts: Sequence[int], position: int) -> int:
    return bisect.bisect_right(starts, position) - 1


class PhasedSchedule:
    """Count weights that change at given positions (see module doc): phase ``j``
    covers ``[starts[j], starts[j + 1])`` and follows ``Schedule(weights[j])``."""

    def __init__(self, phases: Sequence[tuple[int, Sequence[float]]]) -> None:
        self.starts = [start for start, _ in phases]
        if not self.starts or self.starts[0] != 0 or any(b <= a for a, b in pairwise(self.starts)):
            raise OptionError(f"phases must start at 0 and at increasing positions, got {self.starts}")
        self.phases = [Schedule(weights) for _, weights in phases]
        n = len(self.phases[0].weights)
        # picks of every source before each phase
        self.before: list[list[int]] = [[0] * n]
        for j, schedule in enumerate(self.phases[:-1]):
            length = self.starts[j + 1] - self.starts[j]
            self.before.append([b + schedule.count_before(i, length) for i, b in enumerate(self.before[-1])])

    def source_at(self, position: int) -> tuple[int, int]:
        j = _phase_of(self.starts, position)
        source, k = self.phases[j].source_at(position - self.starts[j])
        return source, self.before[j][source] + k

    def position_of(self, source: int, k: int) -> int | None:
        # the last phase whose first pick of the source is at most k holds the pick
        # (an earlier phase ends with more than k picks), unless it is the last phase
        # and gives the source nothing
        j = bisect.bisect_right([before[source] for before in self.before], k) - 1
        local = self.phases[j].position_of(source, k - self.before[j][source])
        return None if local is None else self.starts[j] + local

    def count_before(self, source: int, position: int) -> int:
        j = _phase_of(self.starts, position)
        return self.before[j][source] + self.phases[j].count_before(source, position - self.starts[j])

    def first_reaching(self, counts: Sequence[int]) -> int | None:
        found = [self.position_of(i, n) for i, n in enumerate(counts)]
        return min((p for p in found if p is not None), default=None)

    def iterate(self, start: int = 0) -> Iterator[tuple[int, int]]:
        j, position = _phase_of(self.starts, start), start
        while True:
            end = self.starts[j + 1] if j + 1 < len(self.starts) else None
            before = self.before[j]
            for source, k in self.phases[j].iterate(position - self.starts[j]):
                if position == end:
                    break
                yield source, before[source] + k
                position += 1
            j += 1


class CostSchedule:
    """Weights over per-element costs, with phases (see module doc).

    ``phases``: ``[(start, weights), ...]`` as for :class:`PhasedSchedule` (one phase
    ``[(0, weights)]`` without phases); ``costs[i]``: the cost of each element of
    source ``i`` (non-negative numbers, not all 0; ``[]`` for a source without
    elements, whose first pick then comes at once: the end of a ``first_exhausted`` mix). The schedule is simulated on
    demand, position by position, and tabulated.
    """

    BLOCK = 64  # positions between saved counts

    def __init__(self, phases: Sequence[tuple[int, Sequence[float]]], costs: Sequence[Sequence[float]]) -> None:
        self.starts = [start for start, _ in phases]
        if not self.starts or self.starts[0] != 0 or any(b <= a for a, b in pairwise(self.starts)):
            raise OptionError(f"phases must start at 0 and at increasing positions, got {self.starts}")
        self.weights = [integer_weights(weights) for _, weights in phases]
        n = len(costs)
        if any(len(w) != n for w in self.weights):
            raise OptionError("every phase needs one weight per source")
        for i, c in enumerate(costs):
            if c and (min(c) < 0 or not any(c)):
                raise OptionError(f"the costs of source {i} must be non-negative, and not all 0")
        self.costs = exact_costs(costs)  # a source without elements: []
        self._empty = [0]  # the costs of a source without elements: its first pick comes at once
        self.table = array("B" if n <= 256 else "H")
        self.marks = array("q")  # the counts of every source before each BLOCK-th position, n per block
        self.counts = [0] * n  # picks so far (numbered across phases)
        self._phase = -1
        self._enter_phase(0)

    def _enter_phase(self, j: int) -> None:
        self._phase = j
        weights = self.weights[j]
        self._active = [i for i, w in enumerate(weights) if w]
        self._w, self._total = weights, sum(weights)
        self._cost = 0  # the phase's cost so far, exact
        self._own = [0] * len(self.costs)  # each source's cost in this phase
        self._end = self.starts[j + 1] if j + 1 < len(self.starts) else None

    def _step(self) -> None:
        position = len(self.table)
        if position == self._end:
            self._enter_phase(self._phase + 1)
        if position % self.BLOCK == 0:
            self.marks.extend(self.counts)
        w, total, cost, own, costs, counts = self._w, self._total, self._cost, self._own, self.costs, self.counts
        best = -1
        best_finish = 0
        for i in self._active:
            if own[i] * total <= cost * w[i]:  # may start: C_i / s_i <= C
                c = costs[i] or self._empty
                finish = own[i] + c[counts[i] % len(c)]
                if best < 0 or finish * w[best] < best_finish * w[i]:
                    best, best_finish = i, finish
        if best < 0:  # pragma: no cover - in exact arithmetic the source furthest behind may always start
            raise AssertionError(f"no source may start at position {position}")
        self._cost = cost + best_finish - own[best]
        own[best] = best_finish
        counts[best] += 1
        self.table.append(best)

    def extend(self, length: int) -> None:
        """Simulate (and tabulate) the first ``length`` positions, if not yet."""
        while len(self.table) < length:
            self._step()

    _ensure = extend

    def source_at(self, position: int) -> tuple[int, int]:
        self._ensure(position + 1)
        source = self.table[position]
        return source, self.count_before(source, position)

    def count_before(self, source: int, position: int) -> int:
        self._ensure(position)
        block = position // self.BLOCK
        if block * self.BLOCK == len(self.table):  # position is the table's end, a block boundary
            return self.counts[source]
        n = len(self.costs)
        return self.marks[block * n + source] + self.table[block * self.BLOCK : position].count(source)

    def _never(self, source: int) -> bool:
        """The source has no weight from the current (last) phase on."""
        return self._end is None and not self._w[source]

    def position_of(self, source: int, k: int) -> int | None:
        while self.counts[source] <= k:
            if self._never(source):
                return None
            self._step()
        n = len(self.costs)
        blocks = len(self.marks) // n
        block = bisect.bisect_right(range(blocks), k, key=lambda b: self.marks[b * n + source]) - 1
        count = self.marks[block * n + source]
        for position in range(block * self.BLOCK, len(self.table)):
            if self.table[position] == source:
                if count == k:
                    return position
                count += 1
        raise AssertionError("unreachable: the pick was counted")  # pragma: no cover

    def first_reaching(self, counts: Sequence[int]) -> int | None:
        """Simulated up to the first position whose pick is pick ``counts[i]`` of its
        source (some source has weight in the last phase: it always comes)."""
        for position, (source, k) in enumerate(self.iterate(0)):
            if k == counts[source]:
                return position
        raise AssertionError("unreachable")  # pragma: no cover

    def iterate(self, start: int = 0) -> Iterator[tuple[int, int]]:
        counts = [self.count_before(i, start) for i in range(len(self.costs))]
        position = start
        while True:
            self._ensure(position + 1)
            source = self.table[position]
            yield source, counts[source]
            counts[source] += 1
            position += 1


def exact_costs(costs: Sequence[Sequence[float]]) -> list[list[int]]:
    """``costs`` as exact integers in the same proportions: integer costs as they are,
    and with float costs every cost times the one power of two that makes each float
    an integer (a float is ``m * 2**e``: no rounding, whatever the magnitudes). The
    schedule's arithmetic is then exact, so no sum overflows or rounds and the bound
    holds for every finite cost; float costs cost a few bigger integers, not a
    different schedule."""
    ratios = [[x.as_integer_ratio() if isinstance(x, float) else (x, 1) for x in c] for c in costs]
    scale = max((d for r in ratios for _, d in r), default=1)  # denominators are powers of two
    if scale == 1:
        return [[int(x) for x in c] for c in costs]
    return [[m * (scale // d) for m, d in r] for r in ratios]


def make_schedule(
    phases: Sequence[tuple[int, Sequence[float]]], costs: Sequence[Sequence[float]] | None = None
) -> Schedule | PhasedSchedule | CostSchedule:
    """The schedule of ``phases`` (``[(0, weights)]`` for fixed weights), over
    ``costs`` if given (see the module doc)."""
    if costs is not None:
        return CostSchedule(phases, costs)
    if len(phases) == 1:
        return Schedule(phases[0][1])
    return PhasedSchedule(phases)
