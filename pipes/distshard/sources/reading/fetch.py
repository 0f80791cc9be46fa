"""Read-ahead: a slot's upcoming byte requests, fetched as few large ranges
ahead of use, under a byte budget, delivered in the order asked.

The formats never read: they name the byte spans a sample needs
(``Format.spans``) and parse the bytes they are handed (``Format.parse``).
:class:`ReadAhead` sits between: it pulls requests from the slot's positions
(pure arithmetic, so looking ahead is free) up to eight plans' bytes ahead (the
*lookahead*), and plans ranges for them with :func:`.extents.plan`, the one
planner of the bytes a slot reads ahead: per file, one range per plan over the
slot's upcoming spans there (in order or in the shuffled order it visits them),
reading through the windows between the ones it admits (the same slot's later
bytes, kept for the requests that need them) instead of a range per window. It
submits those ranges to the file's opener (remote: concurrent requests on the
client's event loop; a local file among remote ones: a ``pread`` when first
needed) and hands each request its bytes, in order, as soon as they are there.
Sources of local files only do not use it (``SourceSequence.distshard_read``
reads them exactly).

Ramp: a run starts small, as TCP's slow start does. Its first plan admits
``ReadOptions.first_range`` bytes of the first file only (the first request's
bytes asked first, so the first sample comes after one small request, not behind
a slot's whole share of a shared link), and nothing more is asked until its
first request is delivered (the first sample waits for its own round trip alone,
and a job's requests before its first sample stay one per reading slot); each
later plan admits twice as much, up to ``max_range``
(more when ``4 * window`` is larger), and is made once the window has room for
it (or fewer than two requests are ready); the bytes not delivered yet, in
flight or not, stay within a window of ``2 * first_range`` widened by every byte
delivered (so it about doubles per round trip while the link is the
bottleneck), and every byte held within the budget. Ranges are submitted in the
order of the first request that needs them.

Local cache: with ``ReadOptions.cache_dir`` every span of a remote file is
first looked up in :mod:`.cache`; one inside a stored range is read from local
disk when its request is delivered (it is not coalesced; until then its bytes
count against the window as held ones do, so an epoch served from the cache
does not pull the slot's whole share of requests ahead), and every range
fetched from the store is stored once its bytes are there.

Memory: the bytes of submitted ranges not yet released (a range is released
once every request it serves was delivered, the later ones it was read through
for included), the gaps they read through included, stay within
``ReadOptions.budget``: a plan adds only what fits. A plan reads through later
requests' bytes only while what is then held leaves the budget room for any
request of the lookahead alone, so the ranges kept for later never stop the next
request (else it coalesces its own spans only, as :func:`..coalesce.coalesce`
does). The one exception is a request whose own bytes exceed the budget: it is
read whole, alone (its spans exactly), once nothing ready is held. The peak is
recorded per process in :data:`STATS` (what ``benchmarks/bench_remote.py``
reports).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Protocol, Sequence

from ...forks import at_fork
from ..coalesce import Live, Range, coalesce
from ..read_options import ReadOptions
from ..transport.responses import Deferred
from . import extents
from .cache import BadEntry
from .extents import Upcoming

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
    __slots__ = ("range", "future", "users", "cache", "live", "credited")

    def __init__(self, rng: Range, future: Any, cache: FileCache | None = None, live: bool = True) -> None:
        self.range, self.future, self.users = rng, future, 0
        self.credited = 0  # its bytes delivered so far (the window grew by them)
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
                if not state.ready:
                    return
                request, views = state.next()
                state.delivered = True
                yield request.payload, views
        finally:
            state.close()


class _Entry:
    """A request pulled ahead: where each span's bytes come from (``None``: not
    known yet), how many are not, its spans' bytes and those found in the local cache."""

    __slots__ = ("request", "uses", "missing", "size", "hits")

    def __init__(self, request: Request, uses: list[_Use | None], missing: int, size: int) -> None:
        self.request, self.uses, self.missing, self.size = request, uses, missing, size
        self.hits: dict[int, _Held] | None = None  # span index -> its bytes from the local cache


_Use = tuple["_Held | None", int, int]  # (held range, from, to); None: an empty span


class _Run:
    """One :meth:`ReadAhead.run`: the requests pulled ahead (the lookahead), the
    ranges held, and the window (slow start) that bounds them."""

    def __init__(self, ahead: ReadAhead, source: Iterator[Request]) -> None:
        self.ahead = ahead
        self.source = source
        self.entries: deque[_Entry] = deque()  # pulled, in order; the first ``ready`` have every span
        self.ready = 0
        self.looked = 0  # span bytes of the entries past the ready ones
        self.live: Live[_Held] = Live()
        self.held = 0
        self.credited = 0  # bytes of the held ranges delivered already
        self.released = 0  # bytes delivered (and gaps of ranges let go): the window grows by them
        self.cached = 0  # bytes of spans from the local cache admitted, not delivered: they count as held
        self.plans = 0  # plans that submitted something: the batch doubles with each
        self.delivered = False  # a request was delivered (until then nothing is planned after the first plan)
        self.waiting: Request | None = None  # pulled before the first plan, of a file past the first
        self.exhausted = False
        self.caches: dict[int, FileCache | None] = {}
        self.confirmed: set[int] = set()  # files whose identity ``confirm`` accepted before their first hit
        self.hits: dict[tuple[int, int, int], _Held] = {}  # spans from the local cache, shared by their entries

    # -- the window ---------------------------------------------------------------------
    def limit(self) -> int:
        """The bytes that may be held now: the window, widened by what was
        delivered (slow start), within the budget."""
        return min(self.ahead.options.budget, 2 * self.ahead.first + self.released)

    def room(self) -> int:
        """What the next plan may add: the bytes not delivered yet (held, and cached
        ones admitted) within the window; every byte held within the budget."""
        return min(self.limit() - self.held + self.credited, self.ahead.options.budget - self.held) - self.cached

    def cap(self) -> int:
        """The most bytes the next plan admits: ``first``, doubling per plan."""
        return min(self.ahead.batch, self.ahead.first << min(self.plans, 62))

    def fill(self) -> None:
        """Plan ahead while the window has room (enough for half a plan,
        unless fewer than two requests are ready to deliver)."""
        self.look()
        if self.ready == 0 and self.entries:  # nothing to deliver: plan for the next request, whatever it costs
            self.plan(min(self.cap(), self.room()))
        # after the first plan (the first file's first bytes) nothing more until the first delivery
        while (self.delivered or self.plans == 0) and self.ready < len(self.entries):
            room = self.room()
            if room <= 0 or (room < max(1, min(self.cap(), self.limit())) and self.ready >= 2):
                break
            if not self.plan(min(room, self.cap())):
                break
            self.look()

    # -- the lookahead ------------------------------------------------------------------
    def look(self) -> None:
        """Pull requests ahead while their spans are within eight plans' bytes (the
        first plan: two, of the first file only; then nothing until the first delivery)."""
        if self.plans and not self.delivered:
            return
        horizon = min(self.ahead.options.budget, (8 if self.plans else 2) * self.cap())
        while len(self.entries) < self.ahead.MAX_PENDING and (self.looked < horizon or self.ready == len(self.entries)):
            request = self.pull()
            if request is None:
                break
            if self.plans == 0 and self.entries and request.file != self.entries[0].request.file:
                # the first plan ends with the first file: the first sample waits for its own
                # range only (nor for the next files' indexes, a request each when they are
                # stored entries)
                self.waiting = request
                break
            self.entries.append(self.entry(request))
        self.advance()

    def pull(self) -> Request | None:
        if self.waiting is not None:
            request, self.waiting = self.waiting, None
            return request
        if self.exhausted:
            return None
        try:
            return next(self.source)
        except StopIteration:
            self.exhausted = True
            return None

    def entry(self, request: Request) -> _Entry:
        uses: list[_Use | None] = []
        missing = size = 0
        hits: dict[int, _Held] = {}
        for i, (start, stop) in enumerate(request.spans):
            if stop <= start:
                uses.append((None, 0, 0))
                continue
            uses.append(None)
            missing += 1
            size += stop - start
            if self.ahead.caches is not None:
                key = (request.file, start, stop)
                hit = self.hits.get(key) or self.stored(*key)
                if hit is not None:
                    hits[i] = self.hits[key] = hit
        self.looked += size
        entry = _Entry(request, uses, missing, size)
        entry.hits = hits or None
        return entry

    def advance(self) -> None:
        """Count the entries whose every span is known as ready, in order."""
        entries = self.entries
        while self.ready < len(entries) and entries[self.ready].missing == 0:
            self.looked -= entries[self.ready].size
            self.ready += 1

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

        return _Held(Range(file, start, stop), Deferred(read), live=False)

    # -- planning -------------------------------------------------------------------------
    def gap(self, file: int) -> int:
        gaps = self.ahead.gaps
        return self.ahead.options.max_gap if gaps is None else gaps[file]

    def upcoming(self, entry: _Entry) -> Upcoming:
        """What ``entry`` still needs: its spans in no live range, and its cached bytes."""
        spans: list[tuple[int, int, int]] = []
        extra, file, hits = 0, entry.request.file, entry.hits
        for i, (span, use) in enumerate(zip(entry.request.spans, entry.uses, strict=True)):
            if use is not None:
                continue
            if hits is not None and i in hits:
                extra += span[1] - span[0]
            elif self.live.find(file, *span) is None:
                spans.append((file, *span))
        return Upcoming(spans, extra)

    def plan(self, room: int) -> bool:
        """Admit the next requests while the ranges they need fit in ``room`` bytes
        (:func:`.extents.plan`), submit those ranges and note where each admitted
        request's bytes come from. Reading through a later request's bytes (the
        hull of a file's admitted spans) only while what is held then leaves the
        budget room for any request of the lookahead alone, so that the ranges kept
        for later requests never stop the next one. With nothing ready the next
        request is admitted whatever its size: alone, its spans exactly."""
        options = self.ahead.options
        entries = list(itertools.islice(self.entries, self.ready, None))
        if not entries:
            return False
        upcoming = [self.upcoming(entry) for entry in entries]
        keep = options.budget - self.held - self.cached - max(entry.size for entry in entries)
        ranges: list[Range] = []
        admitted, through = 0, keep > 0
        if through:
            admitted, ranges = extents.plan(upcoming, min(room, keep), self.gap, self.live.of, options.max_range, True)
            through = admitted > 0
        if not admitted:
            admitted, ranges = extents.plan(upcoming, room, self.gap, self.live.of, options.max_range, False)
        if not admitted:
            if self.ready:
                return False
            admitted, ranges = 1, coalesce(upcoming[0].spans, options.max_range, 0)
        self.plans += 1
        for rng in ranges:
            self.hold(rng)
        for entry in entries[:admitted]:
            self.admit(entry)
        if through:  # the later requests whose bytes were read through keep them
            for entry in entries[admitted:]:
                self.resolve(entry)
        self.advance()
        return True

    def admit(self, entry: _Entry) -> None:
        """Note where every span of an admitted ``entry`` comes from."""
        if entry.hits is not None:
            for i, hit in entry.hits.items():
                start, stop = entry.request.spans[i]
                hit.users += 1
                self.cached += stop - start
                entry.uses[i] = (hit, 0, stop - start)
                entry.missing -= 1
            entry.hits = None
        self.resolve(entry)
        assert entry.missing == 0, entry.request.spans

    def resolve(self, entry: _Entry) -> None:
        """Note the spans of ``entry`` that live ranges hold (not those from the cache)."""
        file, hits = entry.request.file, entry.hits
        for i, (start, stop) in enumerate(entry.request.spans):
            if entry.uses[i] is not None or (hits is not None and i in hits):
                continue
            found = self.live.find(file, start, stop)
            if found is not None:
                found.users += 1
                entry.uses[i] = (found, start - found.range.start, stop - found.range.start)
                entry.missing -= 1

    # -- holding and delivering ---------------------------------------------------------------
    def hold(self, rng: Range) -> None:
        item = _Held(rng, self.ahead.open(rng.file).submit(rng.start, rng.stop), self.cache_of(rng.file))
        self.live.add(rng, item)
        self.held += rng.size
        with STATS.lock:
            STATS.ranges += 1
            STATS.bytes += rng.size
            STATS.held += rng.size
            STATS.peak_held = max(STATS.peak_held, STATS.held)

    def next(self) -> tuple[Request, list[memoryview]]:
        """The first ready request and its bytes; the ranges it held are let go."""
        entry = self.entries.popleft()
        self.ready -= 1
        uses = entry.uses
        views: list[memoryview] = []
        try:
            for use in uses:
                item, lo, hi = use  # type: ignore[misc]
                if item is None:
                    views.append(memoryview(b""))
                    continue
                data = item.future.result()
                if item.cache is not None:  # fetched: kept on local disk for later epochs
                    cache, item.cache = item.cache, None
                    cache.store(item.range.start, item.range.stop, data)
                views.append(memoryview(data)[lo:hi])
        finally:
            for use in uses:
                item = use[0]  # type: ignore[index]
                if item is None:
                    continue
                if item.live:
                    gain = min(use[2] - use[1], item.range.size - item.credited)  # type: ignore[index]
                    item.credited += gain
                    self.credited += gain
                    self.released += gain
                    self.release(item)
                else:
                    self.cached -= item.range.size
                    self.released += item.range.size
                    item.users -= 1
                    if item.users == 0:
                        self.hits.pop((item.range.file, item.range.start, item.range.stop), None)
        return entry.request, views

    def release(self, item: _Held) -> None:
        item.users -= 1
        if item.users == 0:
            self.live.remove(item.range)
            self.held -= item.range.size
            self.released += item.range.size - item.credited  # the gaps it read through
            self.credited -= item.credited
            with STATS.lock:
                STATS.held -= item.range.size

    def close(self) -> None:
        for item in self.live.values():
            item.future.cancel()
        with STATS.lock:
            STATS.held -= self.held
