"""Stored index entries packed into a few objects, read by byte range.

``python -m distshard index`` writes the entries of many files into one object
(``entries-<build>-<n>.pack``: entries one after the other, each the bytes of
a per-machine cache entry, :func:`.index.dumps`, checked against the identity
it is loaded for), and the manifest names each file's pack and byte range. A
file's entry is then ``"<pack URL>#<start>-<stop>"`` (:func:`entry_range`).

One grouping rule and one table of entries in flight, for every way an entry is
fetched (a file's own lookup, a slot's read-ahead of the files it reads next,
the rank's fetch before its DataLoader workers start):

- **Chunks.** A source's entries in a pack are split once into *chunks*, from
  the pack's layout alone (:class:`PackedEntries`): in byte order, a chunk takes
  the next entry while its range stays within :data:`RANGE_BYTES` and the gap to
  it (entries of files that are not the source's) within :data:`GAP_BYTES`. An entry
  is always fetched with its whole chunk, in one range request, whoever asks
  first and whatever they read next: a process asks each chunk it touches once,
  and a slot that reads every file asks as many requests as there are chunks
  (about the entries' bytes over :data:`RANGE_BYTES`), whatever its order.
- **In flight.** The entries of a chunk being fetched are in :data:`_PENDING`
  until its answer is split (then :data:`_RAW` keeps them until they are asked
  for): a lookup of one waits for that request instead of making another, so
  the threads and the read-ahead of a process never ask an entry twice.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Collection
from typing import Any, Iterable, Sequence

from ...errors import SourceDataError, SourceMissingError
from ...forks import at_fork
from ..coalesce import Range, coalesce
from ..transport.files import FileAccess
from ..transport.lru import LRU

__all__ = [
    "GAP_BYTES",
    "PICKLED_BYTES",
    "RANGE_BYTES",
    "KeptEntries",
    "PackedEntries",
    "entry_range",
    "fetch_ahead",
    "fetch_first",
    "fetch_packed",
    "pack_entry",
    "read_range",
]

#: the most bytes of one pack fetched in one request (a chunk's range; one entry larger than this alone)
RANGE_BYTES = 1 << 20
#: bytes of entries of other files a chunk's range reads through, at most
GAP_BYTES = 64 << 10

log = logging.getLogger("distshard")

_ENTRY = re.compile(r"^(.*)#(\d+)-(\d+)$")
_RAW: LRU[bytes] = LRU(max_items=1 << 16, max_weight=64 << 20)  # entries fetched, not asked for yet, by entry
_LOCK = threading.Lock()
_PENDING: dict[str, "_Fetch"] = {}  # entries on their way, by entry


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) waits for no request of its parent's."""
    global _LOCK
    _LOCK = threading.Lock()
    _PENDING.clear()


at_fork(_after_fork_in_child)


def pack_entry(pack: str, start: int, stop: int) -> str:
    """How a file's entry in a pack is named (``FileRef.stored``)."""
    return f"{pack}#{start}-{stop}"


def entry_range(entry: str) -> tuple[str, int, int] | None:
    """``(pack URL, start, stop)`` of a packed entry, or ``None`` for an entry of
    its own (a stored index of format version 1)."""
    match = _ENTRY.match(entry)
    if match is None:
        return None
    return match.group(1), int(match.group(2)), int(match.group(3))


Member = tuple[str, int, int]  # an entry of a chunk: (entry, start, stop)


class PackedEntries:
    """The chunks a source's packed entries are fetched in (see the module
    docstring), from the entries alone (``entries``: each file's, or ``None``);
    computed once per process when an entry is first fetched."""

    def __init__(self, entries: Iterable[str | None]) -> None:
        self._entries = [e for e in entries if e is not None]
        self._chunks: dict[str, list[Member]] | None = None

    def chunk(self, entry: str) -> list[Member]:
        """The members of ``entry``'s chunk, in byte order (``entry`` alone if it is
        not one of the source's)."""
        if self._chunks is None:
            self._chunks = _chunks(self._entries)
        found = self._chunks.get(entry)
        if found is not None:
            return found
        placed = entry_range(entry)
        return [] if placed is None else [(entry, placed[1], placed[2])]

    def __getstate__(self) -> dict[str, Any]:  # (the chunks are computed again where they are needed)
        return {"_entries": self._entries, "_chunks": None}


def _chunks(entries: Iterable[str]) -> dict[str, list[Member]]:
    """Every packed entry's chunk: per pack, in byte order, the ranges
    :func:`..coalesce.coalesce` merges them into (at most
    :data:`RANGE_BYTES`, gaps of at most ``GAP_BYTES``; module docstring)."""
    packs: dict[str, int] = {}
    placed: list[tuple[int, int, int, str]] = []  # (pack, start, stop, entry)
    for entry in dict.fromkeys(entries):
        where = entry_range(entry)
        if where is not None:
            placed.append((packs.setdefault(where[0], len(packs)), where[1], where[2], entry))
    placed.sort()
    ranges = iter(coalesce([m[:3] for m in placed], RANGE_BYTES, GAP_BYTES))  # sorted, as placed is
    current = next(ranges, None)
    chunks: dict[Range, list[Member]] = {}
    out: dict[str, list[Member]] = {}
    for pack, start, stop, entry in placed:
        while current is not None and (current.file, current.stop) < (pack, stop):
            current = next(ranges, None)
        if current is not None and current.file == pack and current.covers(start, stop):
            out[entry] = chunks.setdefault(current, [])
        else:  # an empty entry no range holds: a chunk of its own
            out[entry] = []
        out[entry].append((entry, start, stop))
    return out


class _Fetch:
    """One range request of a pack for the members of a chunk not at hand yet.
    Its answer is split into :data:`_RAW` once (when it comes, or when it is first
    waited for); until then its members are in :data:`_PENDING`."""

    def __init__(self, pack: str, members: list[Member], access: FileAccess) -> None:
        self.pack, self.members = pack, members
        self.lo, self.hi = min(m[1] for m in members), max(m[2] for m in members)
        self.error: BaseException | None = None
        self._settled = False
        self._request = _submit_range(pack, self.lo, self.hi, access)

    def start(self) -> None:
        """Split the answer as soon as it comes (remote), or now (a local pack)."""
        future = getattr(self._request, "future", None)
        if future is None:
            self.settle()
        else:
            future.add_done_callback(lambda _: self.settle())

    def settle(self) -> None:
        """Wait for the answer and put its entries in :data:`_RAW` (its error in
        ``error``); its members leave :data:`_PENDING` either way."""
        if self._settled:
            return
        data: bytes | None = None
        try:
            data = bytes(self._request.result())
        except Exception as exc:  # noqa: BLE001 - the lookups that wait for it raise it or ask again
            self.error = exc
        with _LOCK:
            if self._settled:
                return
            self._settled = True
            for name, start, stop in self.members:
                if data is not None:
                    _RAW.put(name, data[start - self.lo : stop - self.lo], stop - start)
                if _PENDING.get(name) is self:
                    del _PENDING[name]


def _claim(entry: str, packed: PackedEntries | None, held: Collection[str]) -> list[Member] | None:
    """Under :data:`_LOCK`: the members of ``entry``'s chunk to fetch now (``entry``
    and those not in :data:`_RAW`, on their way or in ``held``), or ``None`` if
    ``entry`` itself is at hand or on its way."""
    if entry in _PENDING or _RAW.get(entry) is not None:
        return None
    chunk = packed.chunk(entry) if packed is not None else PackedEntries([entry]).chunk(entry)
    return [m for m in chunk if m[0] == entry or (m[0] not in held and m[0] not in _PENDING and _RAW.get(m[0]) is None)]


def _ask(
    entries: Iterable[str], packed: PackedEntries | None, access: FileAccess, held: Collection[str]
) -> list[_Fetch]:
    """Fetch the chunks of ``entries`` not at hand nor on their way, each once: the
    requests made (their members in :data:`_PENDING` now)."""
    from ..transport.urls import is_remote

    asked: list[_Fetch] = []
    for entry in entries:
        placed = entry_range(entry)
        if placed is None:
            continue
        if is_remote(placed[0]):
            access.client(placed[0])  # (made outside the lock: asking under it is then only a submission)
        with _LOCK:
            members = _claim(entry, packed, held)
            if not members:
                continue
            fetch = _Fetch(placed[0], members, access)
            for name, _, _ in members:
                _PENDING[name] = fetch
        asked.append(fetch)
    return asked


def fetch_packed(entry: str, packed: PackedEntries | None, access: FileAccess, held: Collection[str] = ()) -> bytes:
    """The bytes of a packed ``entry``: fetched already, on their way (waited for),
    or fetched now with the rest of its chunk (``packed``'s; one request); the
    entries of ``held`` are not fetched again. ``FileNotFoundError`` if the pack
    is not there."""
    assert entry_range(entry) is not None, entry
    while True:
        with _LOCK:
            kept = _RAW.pop(entry)
            pending = _PENDING.get(entry)
        if kept is not None:
            return kept
        own = pending is None
        if pending is None:
            asked = _ask([entry], packed, access, held)
            if not asked:
                continue  # (another thread asked for it meanwhile)
            pending = asked[0]
        pending.settle()
        if pending.error is not None:
            if own:  # the lookup's own request: its error is the lookup's
                raise pending.error
            # (a request made ahead for it failed: asked again, as without it)
            log.debug("the stored index entry %s did not come ahead (%s): asking it again", entry, pending.error)


def fetch_ahead(
    entries: Iterable[str], packed: PackedEntries | None, access: FileAccess, held: Collection[str] = ()
) -> None:
    """Begin fetching the chunks of ``entries`` (what a slot reads next) that are not
    at hand nor on their way; returns at once. A lookup of one waits for its
    request; one that fails is made again by the lookup (logged)."""
    for fetch in _ask(entries, packed, access, held):
        fetch.start()


def fetch_first(needed: Sequence[str], packed: PackedEntries | None, access: FileAccess) -> dict[str, bytes]:
    """The bytes of the packed entries ``needed`` and of the rest of their chunks, the
    chunks asked at once (one request each): what a rank fetches before its
    DataLoader workers start (see ``SourceSequence.distshard_prefetch``). A request
    that fails is left out (logged): its entries are fetched when they are read."""
    asked = _ask(needed, packed, access, ())
    for fetch in asked:
        fetch.settle()
        if fetch.error is not None and not isinstance(fetch.error, (OSError, ValueError)):
            raise fetch.error
        if fetch.error is not None:
            log.info(
                "the stored index entries in %s bytes [%d, %d) were not fetched ahead (%s): they are fetched when read",
                fetch.pack,
                fetch.lo,
                fetch.hi,
                fetch.error,
            )
    out: dict[str, bytes] = {}
    with _LOCK:
        for fetch in asked:
            for name, _, _ in fetch.members:
                data = _RAW.pop(name)
                if data is not None:
                    out[name] = data
    return out


#: the most bytes of kept entries a pickled sequence carries (a spawned worker's): past it, those of
#: the files its slots read first and the next ones, about as many bytes after each
PICKLED_BYTES = 256 << 10


class KeptEntries(dict):
    """The entries a rank fetched for its DataLoader workers before they start
    (:func:`fetch_first`: those of the files its slots read first, with the rest of
    their chunks). A forked worker inherits them all; a pickled one (spawn,
    forkserver) is sent them all while they are at most :data:`PICKLED_BYTES`,
    else the first files' and those that follow each in its pack, up to that many
    bytes in all (it fetches the others as it reads on)."""

    def __init__(self, items: Iterable[tuple[str, bytes]] = (), first: Iterable[str] = ()) -> None:
        super().__init__(items)
        self.first = list(dict.fromkeys(first))

    def keep(self, fetched: dict[str, bytes], first: Iterable[str]) -> None:
        """Keep ``fetched``, of which ``first`` are the entries the slots read first."""
        self.update(fetched)
        self.first = list(dict.fromkeys([*self.first, *(e for e in first if e in fetched)]))

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return KeptEntries, (list(self._pickled().items()), self.first)

    def _pickled(self) -> dict[str, bytes]:
        if sum(map(len, self.values())) <= PICKLED_BYTES or not self.first:
            return dict(self)
        ordered = sorted(self, key=lambda e: entry_range(e) or (e, 0, 0))
        where = {e: k for k, e in enumerate(ordered)}
        share = PICKLED_BYTES // len(self.first)
        out: dict[str, bytes] = {}
        for first in self.first:
            taken = 0
            for entry in ordered[where[first] :]:
                if entry != first and taken + len(self[entry]) > share:
                    break
                out[entry] = self[entry]
                taken += len(self[entry])
        return out


def _submit_range(url: str, start: int, stop: int, access: FileAccess) -> Any:
    """Bytes ``[start, stop)`` of the pack ``url``, asked now: remote, a request in
    flight (its ``result()``, and its ``future``); a local pack is read when its
    ``result()`` is first asked."""
    from ..transport.responses import Deferred
    from ..transport.urls import is_remote

    if is_remote(url):
        return access.client(url).submit_range(url, start, stop, None, None, access.options)
    return Deferred(lambda: _read_local(url, start, stop))


def read_range(url: str, start: int, stop: int, access: FileAccess) -> bytes:
    """Bytes ``[start, stop)`` of an object of the stored index, in one request now
    (a page of a version 3 manifest, :mod:`.paged`)."""
    return bytes(_submit_range(url, start, stop, access).result())


def _read_local(path: str, start: int, stop: int) -> bytes:
    """Bytes ``[start, stop)`` of a local pack."""
    from ..transport.files import local_path

    try:
        with open(local_path(path), "rb") as f:
            f.seek(start)
            data = f.read(stop - start)
    except (FileNotFoundError, NotADirectoryError):
        raise SourceMissingError(f"{path}: no such file (a pack of the stored index)") from None
    if len(data) != stop - start:
        raise SourceDataError(f"{path}: the pack ends before byte {stop}: rebuild the stored index")
    return data
