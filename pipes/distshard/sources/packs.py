"""Stored index entries packed into a few objects, read by byte range.

``python -m distshard index`` writes the entries of many files into one object
(``entries-<build>-<n>.pack``: entries one after the other, each the bytes of
a per-machine cache entry, :func:`.index.dumps`, checked against the identity
it is loaded for), and the manifest names each file's pack and byte range. A
file's entry is then ``"<pack URL>#<start>-<stop>"`` (:func:`entry_range`).

A slot that needs a file's entry fetches, in the same range request, the
entries of the files it reads next that lie in the same pack (up to
:data:`RANGE_BYTES`), so a job pays about one request per data file plus a
few for the entries, whatever the number of shards. The entries that came
along are kept in this process (:data:`_RAW`) until they are asked for;
concurrent threads that want an entry on its way wait for that request instead
of making another.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from concurrent.futures import Future
from typing import Callable, Sequence

from ..errors import SourceDataError, SourceMissingError
from ._lru import LRU
from .files import FileAccess

__all__ = ["RANGE_BYTES", "entry_range", "fetch_first", "fetch_packed", "pack_entry"]

#: the most bytes of one pack fetched in one request for the entries a slot reads next
RANGE_BYTES = 1 << 20
_GAP = 64 << 10  # entries of files a slot skips, fetched along while the gap is at most this

log = logging.getLogger("distshard")

_ENTRY = re.compile(r"^(.*)#(\d+)-(\d+)$")
_RAW: LRU[bytes] = LRU(max_items=1 << 16, max_weight=64 << 20)  # entries fetched along, by entry
_LOCK = threading.Lock()
_PENDING: dict[str, Future] = {}  # entries on their way, by entry


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) waits for no request of its parent's."""
    global _LOCK
    _LOCK = threading.Lock()
    _PENDING.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


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


def _group(entry: str, following: Sequence[str]) -> tuple[str, int, int, list[tuple[str, int, int]]]:
    """The range of ``entry``'s pack to fetch: ``entry`` and the entries of
    ``following`` (in the order they are read) in the same pack, while the range
    stays within :data:`RANGE_BYTES` and its gaps within :data:`_GAP`."""
    found = entry_range(entry)
    assert found is not None
    pack, lo, hi = found
    members = [(entry, lo, hi)]
    for other in following:
        more = entry_range(other)
        if more is None or more[0] != pack or other in _PENDING or _RAW.get(other) is not None:
            continue
        start, stop = more[1], more[2]
        new_lo, new_hi = min(lo, start), max(hi, stop)
        if new_hi - new_lo > RANGE_BYTES:
            break
        if start >= hi + _GAP or stop <= lo - _GAP:
            continue
        lo, hi = new_lo, new_hi
        members.append((other, start, stop))
    return pack, lo, hi, members


def fetch_packed(entry: str, following: Sequence[str], access: FileAccess) -> bytes:
    """The bytes of a packed ``entry``: kept from an earlier range, on their way,
    or fetched now with the entries of ``following`` beside it (one request).
    ``FileNotFoundError`` if the pack is not there."""
    while True:
        with _LOCK:
            kept = _RAW.pop(entry)
            if kept is not None:
                return kept
            pending = _PENDING.get(entry)
            if pending is None:
                pack, lo, hi, members = _group(entry, following)
                mine: Future = Future()
                for name, _, _ in members:
                    _PENDING[name] = mine
                break
        pending.result()  # another thread's request: its entries are kept now, or its error is raised
    try:
        data = _read_range(pack, lo, hi, access)
        out = b""
        with _LOCK:
            for name, start, stop in members:
                piece = data[start - lo : stop - lo]
                if name == entry:
                    out = piece
                else:
                    _RAW.put(name, piece, len(piece))
        mine.set_result(None)
        return out
    except BaseException as exc:
        mine.set_exception(exc)
        raise
    finally:
        with _LOCK:
            for name, _, _ in members:
                if _PENDING.get(name) is mine:
                    del _PENDING[name]


def fetch_first(needed: Sequence[str], more: Sequence[str], access: FileAccess) -> dict[str, bytes]:
    """The bytes of the packed entries ``needed`` and of those of ``more`` (in that
    order of preference) that lie in the same ranges: ``needed`` grouped into as
    few ranges of at most :data:`RANGE_BYTES` of their packs as they go (one when
    they are that close), each widened by the entries of ``more`` it can take while
    it stays within :data:`RANGE_BYTES` and its gaps within :data:`_GAP`; the
    ranges asked at once. What a rank fetches before its DataLoader workers start
    (see ``SourceSequence.distshard_prefetch``). A range that fails is left out
    (logged): the entries it held are fetched when they are read, as without it."""
    groups: list[tuple[str, int, int, list[tuple[str, int, int]]]] = []
    placed = set()
    for entry in sorted(set(needed), key=lambda e: entry_range(e) or ("", 0, 0)):
        found = entry_range(entry)
        if found is None:
            continue
        pack, start, stop = found
        last = groups[-1] if groups else None
        if last is not None and last[0] == pack and max(last[2], stop) - last[1] <= RANGE_BYTES:
            groups[-1] = (pack, last[1], max(last[2], stop), [*last[3], (entry, start, stop)])
        else:
            groups.append((pack, start, stop, [(entry, start, stop)]))
        placed.add(entry)
    for other in more:
        found = entry_range(other)
        if found is None or other in placed:
            continue
        pack, start, stop = found
        for k, (where, lo, hi, members) in enumerate(groups):
            if (
                where == pack
                and max(hi, stop) - min(lo, start) <= RANGE_BYTES
                and lo - _GAP < stop
                and start < hi + _GAP
            ):
                groups[k] = (where, min(lo, start), max(hi, stop), [*members, (other, start, stop)])
                placed.add(other)
                break
    asked = [(group, _submit_range(group[0], group[1], group[2], access)) for group in groups]
    out: dict[str, bytes] = {}
    for (pack, lo, hi, members), pending in asked:
        try:
            data = pending()
        except (OSError, ValueError) as exc:
            log.info(
                "the stored index entries in %s bytes [%d, %d) were not fetched ahead (%s): they are fetched when read",
                pack,
                lo,
                hi,
                exc,
            )
            continue
        for name, start, stop in members:
            out[name] = data[start - lo : stop - lo]
    return out


def _submit_range(url: str, start: int, stop: int, access: FileAccess) -> Callable[[], bytes]:
    """``_read_range`` asked now (remote: in flight while others are asked), its bytes when called."""
    from .urls import is_remote

    if is_remote(url):
        pending = access.client(url).submit_range(url, start, stop, None, None, access.options)
        return lambda: bytes(pending.result())
    return lambda: _read_range(url, start, stop, access)


def _read_range(url: str, start: int, stop: int, access: FileAccess) -> bytes:
    from .urls import is_remote

    if is_remote(url):
        client = access.client(url)
        return bytes(client.submit_range(url, start, stop, None, None, access.options).result())
    from .files import local_path

    try:
        with open(local_path(url), "rb") as f:
            f.seek(start)
            data = f.read(stop - start)
    except (FileNotFoundError, NotADirectoryError):
        raise SourceMissingError(f"{url}: no such file (a pack of the stored index)") from None
    if len(data) != stop - start:
        raise SourceDataError(f"{url}: the pack ends before byte {stop}: rebuild the stored index")
    return data
