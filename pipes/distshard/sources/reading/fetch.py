"""Read-ahead: a slot's upcoming byte requests, fetched as few large ranges
ahead of use, under a byte budget, delivered in the order asked.

The formats never read: they name the byte spans a sample needs
(``Format.spans``) and parse the bytes they are handed (``Format.parse``).
:class:`ReadAhead` sits between: it pulls requests from the slot's positions
(pure arithmetic, so looking ahead is free), coalesces the spans of the next
batch of them into ranges (:func:`.coalesce.coalesce`), submits those ranges to
the file's opener (remote: concurrent requests on the client's event loop; a
local file among remote ones: a ``pread`` when first needed) and hands each
request its bytes, in order, as soon as they are there. Sources of local files
only do not use it (``SourceSequence.distshard_read`` reads them exactly).

Ramp: a run starts small, as TCP's slow start does. Its first plan admits
``ReadOptions.first_range`` bytes of the first file only (the first request's
bytes asked first, so the first sample comes after one small request, not behind
a slot's whole share of a shared link), and nothing more is asked until its
first request is delivered (the first sample waits for its own round trip alone,
and a job's requests before its first sample stay one per reading slot); each
later plan admits twice as much, up to ``max_range``
(more when ``4 * window`` is larger); and the bytes held, in flight or not, stay
within a window of ``2 * first_range`` widened by every byte delivered (so it
about doubles per round trip while the link is the bottleneck), up to the
budget. Ranges are submitted in the order of the first request that needs them.

Local cache: with ``ReadOptions.cache_dir`` every span of a remote file is
first looked up in :mod:`.cache`; one inside a stored range is read from local
disk when its request is delivered (it is not coalesced; until then its bytes
count against the window as held ones do, so an epoch served from the cache
does not pull the slot's whole share of requests ahead), and every range
fetched from the store is stored once its bytes are there.

Memory: the bytes of submitted ranges not yet released (a range is released
once every request it serves was delivered), the gaps they read through
included, stay within ``ReadOptions.budget``: a request is admitted only when a
bound of the ranges it adds (:class:`.coalesce.Coverage`) fits. The one
exception is a request whose own bytes exceed the budget: it is read whole,
alone (its spans exactly), once nothing else is held. The peak is
recorded per process in :data:`STATS` (what ``benchmarks/bench_remote.py``
reports).
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Protocol, Sequence

from ...forks import at_fork
from ..read_options import ReadOptions
from .cache import BadEntry
from .coalesce import Coverage, Range, coalesce

if TYPE_CHECKING:
    from .cache import FileCache

__all__ = ["Opened", "ReadAhead", "Request", "STATS", "reset_stats"]


class Opened(Protocol):
    """An open file the read-ahead reads ranges of: ``submit`` returns a
    future-like object (``result()``, ``cancel()``) of the bytes."""

    def submit(self, start: int, stop: int) -> Any: ...


class Request:
    """One delivery: ``spans`` (``(start, stop)`` of file ``file``) and what the
    caller wants back with the bytes (``payload``)."""

    __slots__ = ("payload", "file", "spans")

    def __init__(self, payload: Any, file: int, spans: Sequence[tuple[int, int]]) -> None:
        self.payload, self.file, self.spans = payload, file, spans


class _Held:
    __slots__ = ("range", "future", "users", "cache", "live")

    def __init__(self, rng: Range, future: Any, cache: FileCache | None = None, live: bool = True) -> None:
        self.range, self.future, self.users = rng, future, 0
        self.cache = cache  # where its bytes are stored once they are there
        self.live = live  # False: a span read from the local cache (not held, not coalesced)


@dataclass
class Stats:
    """Per-process counters of the read-ahead (summed over its runs)."""

    ranges: int = 0
    bytes: int = 0
    cached: int = 0  # bytes of spans found in the local cache (not fetched)
    peak_held: int = 0
    held: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def as_dict(self) -> dict[str, int]:
        return {"ranges": self.ranges, "bytes": self.bytes, "cached": self.cached, "peak_held": self.peak_held}


STATS = Stats()


def reset_stats() -> None:
    global STATS
    STATS = Stats()


at_fork(reset_stats)


class _Deferred:
    """A future-like read that runs when its result is first asked for (local
    files: no thread, one ``pread`` per range at the moment it is needed)."""

    __slots__ = ("_read", "_value", "_error")

    def __init__(self, read: Callable[[], bytes]) -> None:
        self._read: Callable[[], bytes] | None = read
        self._value: bytes | None = None
        self._error: BaseException | None = None

    def result(self, timeout: float | None = None) -> bytes:
        read, self._read = self._read, None
        if read is not None:
            try:
                self._value = read()
            except BaseException as exc:  # noqa: BLE001 - raised to every caller
                self._error = exc
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def cancel(self) -> bool:
        self._read = None
        return True


def deferred(read: Callable[[], bytes]) -> Any:
    """A future-like object (``result()``, ``cancel()``) that reads on first use."""
    return _Deferred(read)


class ReadAhead:
    """Runs requests ahead of use (see the module docstring).

    ``open(file)`` returns the :class:`Opened` of a file id; ``options`` gives
    the budget, the coalescing limits (``max_range``; ``max_gap`` unless
    ``gaps[file]`` overrides it: local files pass 0, so a slot reads exactly its
    samples' bytes) and how far to pull requests ahead. ``caches(file)`` is the
    file's local cache (or ``None``), and ``confirm(file)``, called before a
    file's first span is served from it, raises if the store no longer holds the
    version the cache is keyed by.
    """

    #: the most requests pulled ahead of delivery (each costs a small tuple)
    MAX_PENDING = 1 << 16

    def __init__(
        self,
        options: ReadOptions,
        open: Callable[[int], Opened],
        gaps: Sequence[int] | None = None,
        caches: Callable[[int], FileCache | None] | None = None,
        confirm: Callable[[int], None] | None = None,
    ) -> None:
        self.options = options
        self.open = open
        self.gaps = gaps
        self.caches = caches
        self.confirm = confirm
        self.batch = min(options.budget, max(options.max_range, 4 * options.window))
        self.first = max(1, min(options.first_range, self.batch))

    def run(self, requests: Iterable[Request]) -> Iterator[tuple[Any, list[memoryview]]]:
        """``(payload, [bytes of each span])`` for every request, in order."""
        state = _Run(self, iter(requests))
        try:
            while True:
                state.fill()
                if not state.pending:
                    return
                request, uses = state.pending.popleft()
                views = state.deliver(uses)
                state.delivered = True
                yield request.payload, views
        finally:
            state.close()

    @staticmethod
    def _live(
        live: dict[int, list[_Held]], starts: dict[int, list[int]], file: int, start: int, stop: int
    ) -> _Held | None:
        items = live.get(file)
        if not items:
            return None
        at = bisect.bisect_right(starts[file], start) - 1
        return items[at] if at >= 0 and items[at].range.covers(start, stop) else None


class _Run:
    """One :meth:`ReadAhead.run`: the requests pulled and planned, the ranges held,
    and the window (slow start) that bounds them."""

    def __init__(self, ahead: ReadAhead, source: Iterator[Request]) -> None:
        self.ahead = ahead
        self.source = source
        self.pending: deque[tuple[Request, list[tuple[_Held | None, int, int]]]] = deque()  # None: an empty span
        self.live: dict[int, list[_Held]] = {}
        self.starts: dict[int, list[int]] = {}
        self.held = 0
        self.released = 0  # bytes of ranges delivered and let go: the window grows by them
        self.cached = 0  # bytes of spans from the local cache planned, not delivered: they count as held
        self.plans = 0  # plans that submitted something: the batch doubles with each
        self.delivered = False  # a request was delivered (until then nothing is planned after the first plan)
        self.waiting: list[Request] = []  # pulled from the source, not admitted yet (at most one)
        self.local: dict[tuple[int, int, int], _Held] = {}  # spans of the plan being made found in the local cache
        self.exhausted = False
        self.caches: dict[int, FileCache | None] = {}
        self.confirmed: set[int] = set()  # files whose identity ``confirm`` accepted before their first hit

    # -- the window ---------------------------------------------------------------------
    def limit(self) -> int:
        """The bytes that may be held now: the window, widened by what was
        delivered (slow start), within the budget."""
        return min(self.ahead.options.budget, 2 * self.ahead.first + self.released)

    def cap(self) -> int:
        """The most bytes the next plan admits: ``first``, doubling per plan."""
        return min(self.ahead.batch, self.ahead.first << min(self.plans, 62))

    def fill(self) -> None:
        """Plan ahead while the window has room (enough for half a plan,
        unless fewer than two requests are left to deliver)."""
        if not self.pending:
            self.plan(min(self.cap(), self.limit()))  # nothing is held
        # after the first plan (the first file's first bytes) nothing more until the first delivery
        while (
            (self.delivered or self.plans == 0)
            and (self.waiting or not self.exhausted)
            and len(self.pending) < self.ahead.MAX_PENDING
        ):
            room = self.limit() - self.held - self.cached
            if room <= 0 or (room < max(1, min(self.cap(), self.limit()) // 2) and len(self.pending) >= 2):
                break
            before = len(self.pending)
            self.plan(min(room, self.cap()))
            if len(self.pending) == before:
                break

    # -- the local cache ----------------------------------------------------------------
    def cache_of(self, file: int) -> FileCache | None:
        if self.ahead.caches is None:
            return None
        if file not in self.caches:
            self.caches[file] = self.ahead.caches(file)
        return self.caches[file]

    def stored(self, file: int, start: int, stop: int) -> _Held | None:
        """A span read from the local cache instead of the store, if it is there."""
        cache = self.cache_of(file)
        found = cache.find(start, stop) if cache is not None else None
        if cache is None or found is None:
            return None
        if file not in self.confirmed:  # its first hit: the store must still hold that version
            if self.ahead.confirm is not None:
                self.ahead.confirm(file)
            self.confirmed.add(file)
        with STATS.lock:
            STATS.cached += stop - start
        open_file = self.ahead.open

        def read() -> bytes:
            try:
                return cache.read(found, start, stop)
            except BadEntry:  # damaged (and dropped): the range fetched again and stored in its place
                whole = cache.refill(found, lambda: bytes(open_file(file).submit(*found).result()))
                return whole[start - found[0] : stop - found[0]]
            except OSError:  # evicted since: from the store after all
                return bytes(open_file(file).submit(start, stop).result())

        return _Held(Range(file, start, stop), _Deferred(read), live=False)

    # -- admitting requests ---------------------------------------------------------------
    def pull(self) -> Request | None:
        if self.waiting:
            return self.waiting.pop()
        if self.exhausted:
            return None
        try:
            return next(self.source)
        except StopIteration:
            self.exhausted = True
            return None

    def plan(self, room: int) -> None:
        """Admit the next requests while the ranges they need (the gaps read
        through included, bounded by :class:`.coalesce.Coverage`) fit in
        ``room`` bytes, and submit those ranges. With nothing held the next
        request is admitted whatever its size: alone, its spans exactly."""
        batch, alone = self.admit(room)
        if batch:
            self.submit(self.ranges(batch, alone), batch)

    def admit(self, room: int) -> tuple[list[Request], bool]:
        """``(the requests admitted, whether the one admitted is alone and too large)``."""
        batch: list[Request] = []
        coverage = Coverage()
        hits = 0  # bytes of the batch's spans found in the local cache
        while len(self.pending) + len(batch) < self.ahead.MAX_PENDING:
            request = self.pull()
            if request is None:
                break
            if self.plans == 0 and batch and request.file != batch[0].file:
                # the first plan ends with the first file: the first sample waits for its
                # own range only (nor for the next files' indexes, a request each when
                # they are stored entries)
                self.waiting.append(request)
                break
            mark = coverage.mark()
            more = self.cover(request, coverage)
            if coverage.total + hits + more <= room:
                batch.append(request)
                hits += more
                continue
            coverage.undo(mark)
            if not batch and self.held == 0:
                return [request], True
            self.waiting.append(request)
            break
        return batch, False

    def cover(self, request: Request, coverage: Coverage) -> int:
        """Add to ``coverage`` what ``request`` needs fetched; the bytes of its spans
        found in the local cache (noted in ``local``)."""
        ahead, local = self.ahead, self.local
        options, gaps = ahead.options, ahead.gaps
        hits = 0
        gap = options.max_gap if gaps is None else gaps[request.file]
        for start, stop in request.spans:
            if (
                stop > start
                and ahead._live(self.live, self.starts, request.file, start, stop) is None
                and (ahead.caches is None or (request.file, start, stop) not in local)
            ):
                if ahead.caches is not None and (hit := self.stored(request.file, start, stop)) is not None:
                    local[(request.file, start, stop)] = hit
                    hits += stop - start
                    continue
                coverage.add(request.file, start, stop, gap)
            elif stop > start and ahead.caches is not None and (request.file, start, stop) in local:
                hits += stop - start
        return hits

    def ranges(self, batch: list[Request], alone: bool) -> list[Range]:
        """The ranges to fetch for ``batch``: its spans not in the local cache,
        coalesced by the gap of their file (none for a request admitted alone)."""
        options, gaps = self.ahead.options, self.ahead.gaps
        by_gap: dict[int, list[tuple[int, int, int]]] = {}
        for request in batch:
            gap = 0 if alone else options.max_gap if gaps is None else gaps[request.file]
            for start, stop in request.spans:
                if stop > start and (request.file, start, stop) not in self.local:
                    by_gap.setdefault(gap, []).append((request.file, start, stop))
        ranges: list[Range] = []
        for gap, spans in by_gap.items():
            ranges.extend(
                coalesce(
                    spans,
                    options.max_range,
                    gap,
                    {f: [h.range for h in self.live[f]] for f in {s[0] for s in spans} if f in self.live},
                )
            )
        return ranges

    # -- holding and delivering ---------------------------------------------------------------
    def submit(self, ranges: list[Range], batch: list[Request]) -> None:
        """Ask for ``ranges`` (the next delivery's first) and queue ``batch``."""
        self.plans += 1
        for rng in sorted(ranges, key=_first_use(batch)):
            self.hold(rng)
        for request in batch:
            self.pending.append((request, self.uses(request)))
        self.local.clear()  # (a request left waiting looks its spans up again)

    def hold(self, rng: Range) -> None:
        item = _Held(rng, self.ahead.open(rng.file).submit(rng.start, rng.stop), self.cache_of(rng.file))
        at = bisect.bisect_left(self.starts.setdefault(rng.file, []), rng.start)
        self.starts[rng.file].insert(at, rng.start)
        self.live.setdefault(rng.file, []).insert(at, item)
        self.held += rng.size
        with STATS.lock:
            STATS.ranges += 1
            STATS.bytes += rng.size
            STATS.held += rng.size
            STATS.peak_held = max(STATS.peak_held, STATS.held)

    def uses(self, request: Request) -> list[tuple[_Held | None, int, int]]:
        """Where each span of ``request`` comes from: ``(held range, from, to)``."""
        uses: list[tuple[_Held | None, int, int]] = []
        for start, stop in request.spans:
            if stop <= start:
                uses.append((None, 0, 0))
                continue
            hit = self.local.get((request.file, start, stop)) if self.local else None
            if hit is not None:
                hit.users += 1
                self.cached += stop - start
                uses.append((hit, 0, stop - start))
                continue
            found = self.ahead._live(self.live, self.starts, request.file, start, stop)
            assert found is not None, (request.file, start, stop)
            found.users += 1
            uses.append((found, start - found.range.start, stop - found.range.start))
        return uses

    def deliver(self, uses: list[tuple[_Held | None, int, int]]) -> list[memoryview]:
        """The bytes of a request's spans; the ranges it held are let go."""
        views: list[memoryview] = []
        try:
            for item, lo, hi in uses:
                if item is None:
                    views.append(memoryview(b""))
                    continue
                data = item.future.result()
                if item.cache is not None:  # fetched: kept on local disk for later epochs
                    cache, item.cache = item.cache, None
                    cache.store(item.range.start, item.range.stop, data)
                views.append(memoryview(data)[lo:hi])
        finally:
            for item, _, _ in uses:
                if item is None:
                    continue
                if item.live:
                    self.release(item)
                else:
                    self.cached -= item.range.size
                    self.released += item.range.size
        return views

    def release(self, item: _Held) -> None:
        item.users -= 1
        if item.users == 0:
            rng = item.range
            index = bisect.bisect_left(self.starts[rng.file], rng.start)
            del self.live[rng.file][index], self.starts[rng.file][index]
            self.held -= rng.size
            self.released += rng.size
            with STATS.lock:
                STATS.held -= rng.size

    def close(self) -> None:
        for items in self.live.values():
            for item in items:
                item.future.cancel()
        with STATS.lock:
            STATS.held -= self.held


def _first_use(batch: list[Request]) -> Callable[[Range], int]:
    """Order ranges by the first request that needs them, so that the next
    delivery's bytes are asked for first."""
    firsts: list[tuple[int, int, int]] = []
    for order, request in enumerate(batch):
        for start, _ in request.spans:
            firsts.append((request.file, start, order))
    firsts.sort()

    def key(rng: Range) -> int:
        at = bisect.bisect_left(firsts, (rng.file, rng.start, -1))
        best = len(batch)
        while at < len(firsts) and firsts[at][0] == rng.file and firsts[at][1] < rng.stop:
            best = min(best, firsts[at][2])
            at += 1
        return best

    return key
