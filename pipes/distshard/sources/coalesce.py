"""The byte ranges every fetch ahead asks (pure arithmetic, no I/O), below every
room of ``sources/``: the read-ahead of a slot's samples (``reading/fetch.py``,
``reading/extents.py``), the chunks stored-index entries are fetched in
(``stored/entry_packs.py``) and a scan's ranges (``transport/files.py``'s
``ScanFile``, :class:`ScanRamp`) all choose their ranges here.

A slot about to read samples knows their byte spans ahead of use (from the
index). Object stores charge a round trip per request, so the read-ahead
(``reading/fetch.py``) turns the spans of its next few MiB of samples into as few
range requests as it can, the way fsspec's ``merge_offset_ranges`` and
obstore's ``get_ranges`` do:

* spans of one file are sorted and merged while the gap between two of them is
  at most ``max_gap`` bytes and the merged range stays within ``max_range``
  bytes;
* a span is never split: a sample is one span, so a sparse set of samples
  costs at most one range each, never one per tar member;
* ranges never overlap ``live`` ranges (bytes already fetched or in flight):
  a span inside one is served from it and costs nothing.

:class:`Coverage` bounds, as spans are added one by one, the bytes
:func:`coalesce` will fetch for them, gaps read through included: what the
read-ahead counts against its budget before it admits a request.

A scan (an index build walking tar headers, JSON lines, a Parquet footer)
knows no span ahead: each read's position follows from the bytes before it.
:class:`ScanRamp` chooses its ranges: ``max_range`` bytes at first and while it
reads on sequentially (the next range then asked ahead), 64 KiB after a seek
past what it holds, growing fourfold per sequential range back to
``max_range`` (so a tar of large members is walked header by header, not
member by member).

Everything here works on plain tuples and is property-tested
(``tests/test_sources_coalesce.py``).
"""

from __future__ import annotations

import bisect
from typing import Generic, Iterable, Iterator, Mapping, NamedTuple, Sequence, TypeVar

from ..errors import OptionError

__all__ = ["Coverage", "Live", "Range", "ScanRamp", "coalesce", "find_live", "live_between"]


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
    at = _live_index(live, start, stop, starts if starts is not None else [r.start for r in live])
    return live[at] if at >= 0 else None


def _live_index(live: Sequence[Range], start: int, stop: int, starts: Sequence[int]) -> int:
    at = bisect.bisect_right(starts, start) - 1
    return at if at >= 0 and live[at].covers(start, stop) else -1


T = TypeVar("T")


class Live(Generic[T]):
    """The ranges fetched or in flight, per file sorted by start and disjoint, each
    with a value (the read-ahead's holding of it): what :func:`coalesce` and
    :func:`.reading.extents.plan` take as ``live`` (``live.of(file)``)."""

    def __init__(self) -> None:
        self._ranges: dict[int, list[Range]] = {}
        self._starts: dict[int, list[int]] = {}
        self._values: dict[int, list[T]] = {}

    def add(self, rng: Range, value: T) -> None:
        starts = self._starts.setdefault(rng.file, [])
        at = bisect.bisect_left(starts, rng.start)
        starts.insert(at, rng.start)
        self._ranges.setdefault(rng.file, []).insert(at, rng)
        self._values.setdefault(rng.file, []).insert(at, value)

    def remove(self, rng: Range) -> None:
        at = bisect.bisect_left(self._starts[rng.file], rng.start)
        del self._starts[rng.file][at], self._ranges[rng.file][at], self._values[rng.file][at]

    def find(self, file: int, start: int, stop: int) -> T | None:
        """The value of the range holding ``[start, stop)`` of ``file`` whole, or ``None``."""
        ranges = self._ranges.get(file)
        if not ranges:
            return None
        at = _live_index(ranges, start, stop, self._starts[file])
        return self._values[file][at] if at >= 0 else None

    def of(self, file: int) -> Sequence[Range]:
        return self._ranges.get(file, ())

    def values(self) -> Iterator[T]:
        for values in self._values.values():
            yield from values

    def files(self) -> Mapping[int, Sequence[Range]]:
        return self._ranges


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
        raise OptionError(f"max_range={max_range} must be at least 1 byte")
    if max_gap < 0:
        raise OptionError(f"max_gap={max_gap} must be non-negative")
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
                    gap <= max_gap and merged <= max_range and not live_between(fetched, starts, current[1], start)
                ):
                    current[1] = max(current[1], stop)
                    continue
                out.append(Range(file, current[0], current[1]))
            current = [start, stop]
        if current is not None:
            out.append(Range(file, current[0], current[1]))
    return out


def live_between(live: Sequence[Range], starts: Sequence[int], lo: int, hi: int) -> bool:
    """Whether a live range intersects the gap ``[lo, hi)``."""
    if not live or hi <= lo:
        return False
    at = bisect.bisect_left(starts, hi) - 1  # the last live range starting before hi
    return at >= 0 and live[at].stop > lo


class Coverage:
    """The bytes :func:`coalesce` can fetch for a growing set of spans, bounded
    from above as they are added (``total``), gaps read through included.

    Per file it keeps the spans' union with every gap of at most ``max_gap``
    bytes filled: a range of :func:`coalesce` only reads through such gaps, so
    it lies inside one of these intervals, and its ranges, disjoint, add up to
    at most ``total`` (``max_range`` and live ranges only split them further).
    :meth:`undo` takes spans back to a :meth:`mark`, so a request that does not
    fit can be tried and withdrawn.
    """

    def __init__(self) -> None:
        self.total = 0
        self._starts: dict[int, list[int]] = {}
        self._stops: dict[int, list[int]] = {}
        self._undo: list[tuple[int, int, list[int], list[int], int]] = []

    def add(self, file: int, start: int, stop: int, max_gap: int) -> int:
        """Add span ``[start, stop)`` of ``file`` (its gaps up to ``max_gap`` bytes
        filled); returns how much ``total`` grew."""
        starts = self._starts.setdefault(file, [])
        stops = self._stops.setdefault(file, [])
        lo = bisect.bisect_left(stops, start - max_gap)  # the first interval reaching the span's gap
        hi = bisect.bisect_right(starts, stop + max_gap)  # past the last one it reaches
        old_starts, old_stops = starts[lo:hi], stops[lo:hi]
        new_start = min(start, old_starts[0]) if old_starts else start
        new_stop = max(stop, old_stops[-1]) if old_stops else stop
        growth = (new_stop - new_start) - sum(b - a for a, b in zip(old_starts, old_stops, strict=True))
        starts[lo:hi], stops[lo:hi] = [new_start], [new_stop]
        self._undo.append((file, lo, old_starts, old_stops, growth))
        self.total += growth
        return growth

    def undo(self, mark: int) -> None:
        """Take back every span added since :meth:`mark` returned ``mark``."""
        while len(self._undo) > mark:
            file, lo, old_starts, old_stops, growth = self._undo.pop()
            self._starts[file][lo : lo + 1] = old_starts
            self._stops[file][lo : lo + 1] = old_stops
            self.total -= growth

    def mark(self) -> int:
        """A mark for :meth:`undo` that takes back whatever is added from now on."""
        return len(self._undo)


class ScanRamp:
    """The ranges a scan of one ``size``-byte file asks (module docstring).

    :meth:`next` is the range to fetch for a read of ``[pos, wanted_end)`` that
    what the scan holds does not serve (``held_end``: where the range it read
    last ends, or ``None`` before its first); :meth:`ahead` is the range to ask
    ahead once the one ending at ``end`` is there, or ``None``.
    """

    SMALL = 64 << 10

    def __init__(self, size: int, largest: int) -> None:
        if largest < 1:
            raise OptionError(f"max_range={largest} must be at least 1 byte")
        self.size = size
        self.largest = largest
        self.chunk = largest

    def next(self, pos: int, wanted_end: int, held_end: int | None) -> Range:
        if held_end is not None:
            self.chunk = min(self.largest, self.chunk * 4) if pos == held_end else self.SMALL
        return Range(0, pos, min(self.size, max(wanted_end, pos + self.chunk)))

    def ahead(self, end: int) -> Range | None:
        if self.chunk < self.largest or end >= self.size:
            return None
        return Range(0, end, min(self.size, end + self.chunk))
