"""Coalescing byte requests into few large ranges (pure arithmetic, no I/O).

A slot about to read samples knows their byte spans ahead of use (from the
index). Object stores charge a round trip per request, so the read-ahead
(:mod:`.fetch`) turns the spans of its next few MiB of samples into as few
range requests as it can, the way fsspec's ``merge_offset_ranges`` and
obstore's ``get_ranges`` do:

* spans of one file are sorted and merged while the gap between two of them is
  at most ``max_gap`` bytes and the merged range stays within ``max_range``
  bytes;
* a span is never split: a sample is one span, so a sparse set of samples
  costs at most one range each, never one per tar member;
* ranges never overlap ``live`` ranges (bytes already fetched or in flight):
  a span inside one is served from it and costs nothing.

Everything here works on plain tuples and is property-tested
(``tests/test_sources_coalesce.py``).
"""

from __future__ import annotations

import bisect
from typing import Iterable, Mapping, NamedTuple, Sequence

__all__ = ["Range", "coalesce", "find_live"]


class Range(NamedTuple):
    """Bytes ``[start, stop)`` of file ``file``."""

    file: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    def covers(self, start: int, stop: int) -> bool:
        return self.start <= start and stop <= self.stop


def find_live(live: Sequence[Range], start: int, stop: int, starts: Sequence[int] | None = None) -> Range | None:
    """The range of ``live`` (one file's, sorted by start, disjoint) that holds
    ``[start, stop)`` whole, or ``None``."""
    keys = starts if starts is not None else [r.start for r in live]
    at = bisect.bisect_right(keys, start) - 1
    if at >= 0 and live[at].covers(start, stop):
        return live[at]
    return None


def coalesce(
    spans: Iterable[tuple[int, int, int]],
    max_range: int,
    max_gap: int,
    live: Mapping[int, Sequence[Range]] | None = None,
) -> list[Range]:
    """The ranges to fetch for ``spans`` (``(file, start, stop)``, in any order,
    duplicates allowed), sorted by ``(file, start)``.

    Every span lies whole inside exactly one returned range, or inside a range
    of ``live`` (``file -> ranges`` sorted by start and disjoint), in which case
    it needs nothing new. Two spans share a range only if the gap between them
    is at most ``max_gap`` and holds no live range, and a range is at most
    ``max_range`` bytes long unless it holds a single span (or overlapping
    spans) longer than that. Returned ranges are disjoint from each other and
    from ``live``.
    """
    if max_range < 1:
        raise ValueError(f"max_range={max_range} must be at least 1 byte")
    if max_gap < 0:
        raise ValueError(f"max_gap={max_gap} must be non-negative")
    live = live or {}
    by_file: dict[int, list[tuple[int, int]]] = {}
    for file, start, stop in spans:
        if stop < start or start < 0:
            raise ValueError(f"span [{start}, {stop}) of file {file} is not a byte range")
        if stop == start:
            continue
        by_file.setdefault(file, []).append((start, stop))
    out: list[Range] = []
    for file in sorted(by_file):
        mine = sorted(set(by_file[file]))
        fetched = list(live.get(file, ()))
        starts = [r.start for r in fetched]
        current: list[int] | None = None  # [start, stop] of the range being grown
        for start, stop in mine:
            if fetched and find_live(fetched, start, stop, starts) is not None:
                continue
            if current is not None:
                gap = start - current[1]
                merged = max(stop, current[1]) - current[0]
                overlapping = gap < 0
                if overlapping or (
                    gap <= max_gap and merged <= max_range and not _live_between(fetched, starts, current[1], start)
                ):
                    current[1] = max(current[1], stop)
                    continue
                out.append(Range(file, current[0], current[1]))
            current = [start, stop]
        if current is not None:
            out.append(Range(file, current[0], current[1]))
    return out


def _live_between(live: Sequence[Range], starts: Sequence[int], lo: int, hi: int) -> bool:
    """Whether a live range intersects the gap ``[lo, hi)``."""
    if not live or hi <= lo:
        return False
    at = bisect.bisect_left(starts, hi) - 1  # the last live range starting before hi
    return at >= 0 and live[at].stop > lo
