"""One plan of the read-ahead: which of a slot's next requests it admits, and the
ranges it fetches for them (pure arithmetic, no I/O; :mod:`.fetch` runs it).

The read-ahead knows the byte spans of a slot's next requests, in the order it
delivers them (the *lookahead*). Per file, those spans, merged while the gap
between two is at most the file's ``max_gap`` and holds no live range, make the
file's *extents*: runs of bytes the slot will read, with the small gaps (tar
headers) between them. Another slot's samples are never in one: between two
slots' bytes lies at least a shuffle window, and ``max_gap`` is below it.

:func:`plan` admits the longest run of next requests whose cost fits ``room``:

* *through* (``through=True``): per extent it touches, one range, the hull of the
  admitted spans in it (split at ``max_range``), whose cost is the hull's bytes.
  In order, the hull is the admitted spans themselves; shuffled (a file's windows
  in a permuted order), it reads through the windows between the ones admitted,
  bytes of the same slot's later requests, which the read-ahead keeps for them.
  So a file costs one range per plan, not one per window the shuffle visits.
* *exact* (``through=False``): the admitted spans coalesced as
  :func:`..coalesce.coalesce` does, bounded by :class:`..coalesce.Coverage`; no
  later request's bytes are kept for it (what the read-ahead falls back to when
  keeping them could leave too little of its budget for the next request).

Every admitted span lies whole inside one returned range; the ranges are
disjoint from each other and from ``live``, start and stop at span boundaries,
and their bytes add up to at most ``room``. Property-tested in
``tests/test_sources_extents.py``.
"""

from __future__ import annotations

import bisect
from typing import Callable, NamedTuple, Sequence

from ..coalesce import Coverage, Range, coalesce, live_between

__all__ = ["Upcoming", "first_use", "plan"]

Span = tuple[int, int, int]  # (file, start, stop)
Extent = tuple[int, int]  # (file, index of the extent among the file's)


class Upcoming(NamedTuple):
    """A request of the lookahead: the spans it still needs fetched (not empty, in
    no live range, not in the local cache) and the bytes it costs besides (its
    spans read from the local cache)."""

    spans: Sequence[Span]
    extra: int = 0


class _Limits(NamedTuple):
    gap: Callable[[int], int]  # a file's max_gap
    live: Callable[[int], Sequence[Range]]  # a file's live ranges
    max_range: int


def plan(
    upcoming: Sequence[Upcoming],
    room: int,
    gap: Callable[[int], int],
    live: Callable[[int], Sequence[Range]],
    max_range: int,
    through: bool,
) -> tuple[int, list[Range]]:
    """``(how many of the first requests of upcoming are admitted, the ranges to
    fetch for them)``, in the order of the first admitted request that needs
    each (see the module docstring)."""
    admitted, ranges = (_through if through else _exact)(upcoming, room, _Limits(gap, live, max_range))
    return admitted, sorted(ranges, key=first_use(upcoming[:admitted]))


def _extents(
    upcoming: Sequence[Upcoming], gap: Callable[[int], int], live: Callable[[int], Sequence[Range]]
) -> tuple[dict[Span, Extent], dict[int, list[list[tuple[int, int]]]]]:
    """Every span's extent, and each file's extents as sorted lists of spans."""
    by_file: dict[int, set[tuple[int, int]]] = {}
    for item in upcoming:
        for file, start, stop in item.spans:
            by_file.setdefault(file, set()).add((start, stop))
    where: dict[Span, Extent] = {}
    runs: dict[int, list[list[tuple[int, int]]]] = {}
    for file, spans in by_file.items():
        fetched = live(file)
        starts = [r.start for r in fetched]
        mine: list[list[tuple[int, int]]] = runs.setdefault(file, [])
        hi = -1
        for start, stop in sorted(spans):
            if not mine or (start >= hi and (start - hi > gap(file) or live_between(fetched, starts, hi, start))):
                mine.append([])
            mine[-1].append((start, stop))
            where[(file, start, stop)] = (file, len(mine) - 1)
            hi = max(hi, stop)
    return where, runs


def _through(upcoming: Sequence[Upcoming], room: int, limits: _Limits) -> tuple[int, list[Range]]:
    gap, live, max_range = limits
    where, runs = _extents(upcoming, gap, live)
    hulls: dict[Extent, tuple[int, int]] = {}
    cost = admitted = 0
    for item in upcoming:
        trial: dict[Extent, tuple[int, int]] = {}
        for span in item.spans:
            extent = where[span]
            lo, hi = trial.get(extent) or hulls.get(extent) or span[1:]
            trial[extent] = (min(lo, span[1]), max(hi, span[2]))
        grown = sum(hi - lo - _size(hulls.get(extent)) for extent, (lo, hi) in trial.items())
        if cost + item.extra + grown > room or (admitted and _partial(trial, hulls, runs, live, room - cost)):
            break
        hulls.update(trial)
        cost += item.extra + grown
        admitted += 1
    ranges: list[Range] = []
    left = room - cost
    for (file, at), (lo, hi) in hulls.items():
        run = runs[file][at]
        if left > 0:  # the room left widens the hull over the extent's next spans, then its previous ones
            lo, hi, left = _widen(run, lo, hi, left)
        inside = run[bisect.bisect_left(run, (lo, -1)) :]
        spans = [(file, a, b) for a, b in inside if b <= hi]
        ranges.extend(coalesce(spans, max_range, gap(file)))
    return admitted, ranges


def _widen(run: list[tuple[int, int]], lo: int, hi: int, left: int) -> tuple[int, int, int]:
    """Hull ``[lo, hi)`` of an extent's spans ``run`` widened by whole spans while
    its growth stays within ``left`` bytes: towards the nearer end of the extent
    first (a small hole left beside a fetched range would cost a request of its own)."""
    up_first = max(stop for _, stop in run) - hi <= lo - run[0][0]
    for up in (up_first, not up_first):
        if up:
            at = bisect.bisect_left(run, (hi, -1))
            while at < len(run) and max(hi, run[at][1]) - hi <= left:
                left -= max(hi, run[at][1]) - hi
                hi = max(hi, run[at][1])
                at += 1
        else:
            at = bisect.bisect_left(run, (lo, -1)) - 1
            while at >= 0 and lo - run[at][0] <= left:
                left -= lo - min(lo, run[at][0])
                lo = min(lo, run[at][0])
                at -= 1
    return lo, hi, left


def _partial(
    trial: dict[Extent, tuple[int, int]],
    hulls: dict[Extent, tuple[int, int]],
    runs: dict[int, list[list[tuple[int, int]]]],
    live: Callable[[int], Sequence[Range]],
    left: int,
) -> bool:
    """Whether a request would start a file nothing of which is held or planned yet
    with less room left than its extent: the next plan is better off starting it
    (a hull begun at a plan's end, in the middle of a shuffled file, leaves bytes
    on both sides of it, a range each)."""
    planned = {file for file, _ in hulls}
    for file, at in trial:
        if file not in planned and not live(file):
            run = runs[file][at]
            if max(stop for _, stop in run) - run[0][0] > left:
                return True
    return False


def _size(hull: tuple[int, int] | None) -> int:
    return 0 if hull is None else hull[1] - hull[0]


def _exact(upcoming: Sequence[Upcoming], room: int, limits: _Limits) -> tuple[int, list[Range]]:
    gap, live, max_range = limits
    coverage = Coverage()
    extra = admitted = 0
    for item in upcoming:
        mark = coverage.mark()
        for file, start, stop in item.spans:
            coverage.add(file, start, stop, gap(file))
        if coverage.total + extra + item.extra > room:
            coverage.undo(mark)
            break
        extra += item.extra
        admitted += 1
    by_gap: dict[int, list[Span]] = {}
    for item in upcoming[:admitted]:
        for span in item.spans:
            by_gap.setdefault(gap(span[0]), []).append(span)
    ranges: list[Range] = []
    for max_gap, spans in by_gap.items():
        files = {span[0] for span in spans}
        ranges.extend(coalesce(spans, max_range, max_gap, {f: live(f) for f in files}))
    return admitted, ranges


def first_use(batch: Sequence[Upcoming]) -> Callable[[Range], int]:
    """Order ranges by the first request of ``batch`` that needs them, so that
    the next delivery's bytes are asked for first (a range no request of it
    needs last)."""
    firsts: list[tuple[int, int, int]] = []
    for order, request in enumerate(batch):
        for file, start, _ in request.spans:
            firsts.append((file, start, order))
    firsts.sort()

    def key(rng: Range) -> int:
        at = bisect.bisect_left(firsts, (rng.file, rng.start, -1))
        best = len(batch)
        while at < len(firsts) and firsts[at][0] == rng.file and firsts[at][1] < rng.stop:
            best = min(best, firsts[at][2])
            at += 1
        return best

    return key
