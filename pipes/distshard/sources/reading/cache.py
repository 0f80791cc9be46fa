"""A local disk cache of fetched ranges, so that epochs after the first read
the store about once (``ReadOptions(cache_dir=..., cache_bytes=...)``).

The read-ahead (:mod:`.fetch`) asks it, below the parsing, for every span of a
remote file before it plans a range request: a span that lies inside a stored
range is read from local disk; the ranges it fetches are stored once their bytes
are there. Layout::

    cache_dir/<digest of (URL, size, stamp)>/<start>-<stop>     the bytes [start, stop), checksummed
    cache_dir/.ledger, cache_dir/.lock                          the total bytes stored

* **Never another version.** The directory is named by the URL *and* the
  file's identity as the source knows it (size and ETag / generation /
  modification time), so a rewritten file (a new identity) never finds the old
  bytes; a file whose identity names no version (no stamp) is not cached. That
  the identity is still the store's is the source's to confirm before it serves
  a hit (see ``SourceSequence`` and :mod:`.confirm`).
* **Checksummed.** An entry is a header (:data:`MAGIC`, the chunk size, the
  CRC-32 of every :data:`CHUNK` bytes of the range, the header's own CRC-32)
  followed by the bytes, written in one file and renamed into place, so the
  checksums are atomic with the bytes. A process verifies an entry's header when
  it first opens it and each chunk the first time it reads from it (per inode: a
  range stored again is verified again), so an epoch served from the cache checks
  every byte it serves once per process and reads each chunk at most once more.
  A damaged entry (bytes changed in place, truncated, a foreign header) raises
  :class:`BadEntry` and is dropped (unlinked, the ledger corrected, a WARNING
  logged); the caller fetches the range again and stores it (:meth:`FileCache.refill`).
* **Atomic, shared.** A range is written to a temporary file and renamed into
  place: a reader sees a whole range or none. Plain files, so the workers and
  the ranks of a node share them; two processes storing the same range write
  the same bytes, the last rename wins.
* **Least recently used evicted past ``cache_bytes``.** A read touches the
  range's modification time; a store takes the node-wide lock (``flock``),
  and when the ledger says the new range would pass the limit it counts the
  cache again and removes the least recently used ranges down to 90 % of it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import time
from typing import Any, Callable, Iterator

from ...digests import crc32_of, sha256_hex
from ...forks import at_fork

__all__ = ["BadEntry", "FileCache", "RangeCache", "range_cache"]

log = logging.getLogger("distshard")

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: stores are not serialized across processes
    fcntl = None  # type: ignore[assignment]

#: a temporary file older than this was left by a process that died while writing
_STALE_TMP = 3600.0
#: the least time between two listings of a file's directory after a miss (another process may have stored)
_RELIST = 0.1
#: what starts an entry of this layout (its directory's name covers the layout too)
MAGIC = b"DSRANGE\x02"
#: bytes per checksum: a first read verifies the chunks it touches, whole
CHUNK = 64 << 10
LAYOUT = "checksummed/2"  # in every directory's name: entries of an earlier layout are never read
_HEAD = struct.Struct("<8sII")  # magic, chunk size, number of chunks; then a CRC-32 per chunk, then the header's


class BadEntry(Exception):
    """A stored range whose bytes or header fail their checksums (or are short)."""


def _chunks(size: int) -> int:
    return -(-size // CHUNK)


def header_bytes(size: int) -> int:
    """The header's bytes before the data of a ``size``-byte range."""
    return _HEAD.size + 4 * _chunks(size) + 4


def encode(data: bytes | memoryview) -> bytes:
    """The header of an entry holding ``data``: its chunks' CRC-32s, then its own."""
    view = memoryview(data)
    crcs = [crc32_of(view[at : at + CHUNK]) for at in range(0, len(view), CHUNK)]
    head = _HEAD.pack(MAGIC, CHUNK, len(crcs)) + struct.pack(f"<{len(crcs)}I", *crcs)
    return head + struct.pack("<I", crc32_of(head))


class _Checked:
    """What a process learnt of one entry file (one inode): its chunks' CRC-32s
    and which of them it verified already."""

    __slots__ = ("inode", "size", "crcs", "good", "offset")

    def __init__(self, inode: tuple[int, int], size: int, crcs: tuple[int, ...], offset: int) -> None:
        self.inode, self.size, self.crcs, self.offset = inode, size, crcs, offset
        self.good = bytearray(len(crcs))

    @classmethod
    def open(cls, fd: int, st: os.stat_result, size: int) -> "_Checked":
        """The header of the entry of a ``size``-byte range, checked."""
        want = header_bytes(size)
        if st.st_size != want + size:
            raise BadEntry(f"{st.st_size} bytes where {want + size} belong (truncated?)")
        head = os.pread(fd, want, 0)
        if len(head) != want:
            raise BadEntry(f"a header of {len(head)} of its {want} bytes")
        magic, chunk, n = _HEAD.unpack_from(head)
        if magic != MAGIC or chunk != CHUNK or n != _chunks(size):
            raise BadEntry("not an entry of this layout")
        if crc32_of(head[: want - 4]) != struct.unpack_from("<I", head, want - 4)[0]:
            raise BadEntry("its header fails its checksum")
        return cls((st.st_dev, st.st_ino), size, struct.unpack_from(f"<{n}I", head, _HEAD.size), want)

    def read(self, fd: int, at: int, size: int) -> bytes:
        """``size`` bytes at ``at`` of the range; the chunks they touch are
        verified (read whole) the first time only."""
        first, last = at // CHUNK, (at + size - 1) // CHUNK
        if all(self.good[first : last + 1]):
            return os.pread(fd, size, self.offset + at)
        lo, hi = first * CHUNK, min((last + 1) * CHUNK, self.size)
        view = memoryview(os.pread(fd, hi - lo, self.offset + lo))
        if len(view) != hi - lo:
            raise BadEntry(f"bytes [{lo}, {hi}) of it are short")
        for k in range(first, last + 1):
            piece = view[(k - first) * CHUNK : (k - first + 1) * CHUNK]
            if not self.good[k] and crc32_of(piece) != self.crcs[k]:
                raise BadEntry(f"bytes [{k * CHUNK}, {k * CHUNK + len(piece)}) of it fail their checksum")
            self.good[k] = 1
        return bytes(view[at - lo : at - lo + size])


class FileCache:
    """The stored ranges of one version of one file (see the module docstring)."""

    def __init__(self, owner: "RangeCache", directory: str, url: str = "") -> None:
        self.owner = owner
        self.directory = directory
        self.url = url
        self._starts: list[int] = []
        self._stops: list[int] = []
        self._listed: tuple[float, Any] | None = None  # (when, the directory's stat) of the last listing
        self._checked: dict[tuple[int, int], _Checked] = {}  # what this process verified, by range
        self._refilling = threading.Lock()

    def find(self, start: int, stop: int) -> tuple[int, int] | None:
        """A stored range ``(a, b)`` holding ``[start, stop)`` whole, or ``None``."""
        found = self._find(start, stop)
        if found is None and self._stale():
            self._list()
            found = self._find(start, stop)
        return found

    def _find(self, start: int, stop: int) -> tuple[int, int] | None:
        import bisect

        at = bisect.bisect_right(self._starts, start) - 1
        if at >= 0 and self._stops[at] >= stop:
            return self._starts[at], self._stops[at]
        return None

    def _stale(self) -> bool:
        if self._listed is None:
            return True
        when, seen = self._listed
        if time.monotonic() - when < _RELIST:
            return False
        try:
            st = os.stat(self.directory)
        except OSError:
            return seen is not None
        return seen is None or (st.st_mtime_ns, st.st_ino, st.st_nlink) != seen

    def _list(self) -> None:
        ranges: list[tuple[int, int]] = []
        seen: Any = None
        try:
            st = os.stat(self.directory)
            seen = (st.st_mtime_ns, st.st_ino, st.st_nlink)
            for name in os.listdir(self.directory):
                parsed = _parse(name)
                if parsed is not None:
                    ranges.append(parsed)
        except OSError:
            pass
        ranges.sort()
        self._starts, self._stops = [], []
        for a, b in ranges:  # keep the widest of overlapping ranges that start first
            if self._stops and b <= self._stops[-1]:
                continue
            self._starts.append(a)
            self._stops.append(b)
        self._listed = (time.monotonic(), seen)

    def read(self, rng: tuple[int, int], start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` from the stored range ``rng``, verified (see the
        module docstring); ``OSError`` if it is gone (evicted), :class:`BadEntry`
        (after dropping it) if it is damaged."""
        path = os.path.join(self.directory, _name(*rng))
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(fd)
            checked = self._checked.get(rng)
            try:
                if checked is None or checked.inode != (st.st_dev, st.st_ino):
                    checked = self._checked[rng] = _Checked.open(fd, st, rng[1] - rng[0])
                data = checked.read(fd, start - rng[0], stop - start)
            except BadEntry as exc:
                self.drop(rng, path, st, str(exc))
                raise
            with contextlib.suppress(OSError):
                os.utime(fd if os.utime in os.supports_fd else path)  # recently used
        finally:
            os.close(fd)
        return data

    def drop(self, rng: tuple[int, int], path: str, st: os.stat_result, why: str) -> None:
        """Remove a damaged entry (the file ``st`` describes, unless another
        process replaced it since) and correct the ledger; logged."""
        self._checked.pop(rng, None)
        self._forget(*rng)
        with self.owner.locked():
            try:
                now = os.stat(path)
            except OSError:
                return
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                with contextlib.suppress(OSError):
                    os.unlink(path)
                self.owner.recount()
        log.warning(
            "the local cache entry %s (bytes [%d, %d) of %s) is damaged: %s; dropped, fetched again from the store",
            path,
            rng[0],
            rng[1],
            self.url or "a remote file",
            why,
        )

    def refill(self, rng: tuple[int, int], fetch: Callable[[], bytes]) -> bytes:
        """The bytes of range ``rng`` after its entry was found damaged: fetched
        again (``fetch()``) and stored in its place, once, however many spans of
        it were about to be read from it."""
        with self._refilling:
            with contextlib.suppress(OSError, BadEntry):
                if self._find(*rng) == rng:  # refilled meanwhile
                    return self.read(rng, *rng)
            data = fetch()
            self.store(rng[0], rng[1], data)
            return data

    def _forget(self, start: int, stop: int) -> None:
        import bisect

        at = bisect.bisect_left(self._starts, start)
        if at < len(self._starts) and (self._starts[at], self._stops[at]) == (start, stop):
            del self._starts[at], self._stops[at]

    def store(self, start: int, stop: int, data: bytes | memoryview) -> None:
        """Keep bytes ``[start, stop)``: written whole with their checksums, then
        renamed into place."""
        size = stop - start
        if size <= 0 or size > self.owner.limit or self._find(start, stop) is not None:
            return
        tmp = os.path.join(self.directory, f".tmp-{os.getpid()}-{threading.get_ident()}-{start}")
        head = encode(data)
        try:
            os.makedirs(self.directory, exist_ok=True)
            with open(tmp, "wb") as out:
                out.write(head)
                out.write(data)
            with self.owner.locked():
                self.owner.make_room(len(head) + size)
                os.replace(tmp, os.path.join(self.directory, _name(start, stop)))
                self.owner.grew(len(head) + size)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return
        import bisect

        at = bisect.bisect_left(self._starts, start)
        self._starts.insert(at, start)
        self._stops.insert(at, stop)


class RangeCache:
    """The cache under ``root``, at most ``limit`` bytes (see the module docstring)."""

    def __init__(self, root: str, limit: int) -> None:
        self.root = root
        self.limit = limit
        self._files: dict[tuple[str, int, str], FileCache] = {}
        self._counted = False  # whether this process counted the cache since it started

    def file(self, url: str, size: int | None, stamp: str | None) -> FileCache | None:
        """The ranges stored for this version of ``url``, or ``None`` if its
        identity names no version (nothing is cached for it)."""
        if size is None or not stamp:
            return None
        key = (url, size, stamp)
        found = self._files.get(key)
        if found is None:
            digest = sha256_hex("\0".join((LAYOUT, url, str(size), stamp)).encode())[:40]
            found = self._files[key] = FileCache(self, os.path.join(self.root, digest), url)
        return found

    def holds_any(self) -> bool:
        """Whether anything is stored (a file's directory is there)."""
        try:
            with os.scandir(self.root) as entries:
                return any(entry.is_dir(follow_symlinks=False) for entry in entries)
        except OSError:
            return False

    # -- the ledger: the bytes stored, under the node-wide lock ------------------------------
    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        os.makedirs(self.root, exist_ok=True)
        fd = os.open(os.path.join(self.root, ".lock"), os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _ledger(self) -> int | None:
        try:
            with open(os.path.join(self.root, ".ledger"), encoding="ascii") as f:
                return int(f.read().strip() or "x")
        except (OSError, ValueError):
            return None

    def _write_ledger(self, total: int) -> None:
        path = os.path.join(self.root, ".ledger")
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w", encoding="ascii") as f:
            f.write(str(total))
        os.replace(tmp, path)

    def make_room(self, size: int) -> None:
        """Under the lock: evict the least recently used ranges if ``size`` more
        bytes would pass the limit (counting the cache again first)."""
        total = self._ledger()
        if total is None or not self._counted or total + size > self.limit:
            total = self._evict(size)
            self._counted = True
            self._write_ledger(total)

    def grew(self, size: int) -> None:
        self._write_ledger((self._ledger() or 0) + size)

    def recount(self) -> None:
        """Under the lock: the ledger counted again (after a damaged entry was
        dropped, whose size the ledger may not know: rare, so counted whole)."""
        self._write_ledger(self._evict(0))
        self._counted = True

    def _evict(self, size: int) -> int:
        """Count what is stored; remove the least recently used ranges until
        ``size`` more bytes leave it at most 90 % of the limit (or the limit).
        Returns the bytes left."""
        entries: list[tuple[int, int, str]] = []  # (last use, bytes, path)
        total = 0
        now = time.time()
        with contextlib.suppress(OSError):
            for folder in os.scandir(self.root):
                if not folder.is_dir(follow_symlinks=False):
                    continue
                with contextlib.suppress(OSError):
                    for entry in os.scandir(folder.path):
                        st = entry.stat(follow_symlinks=False)
                        if entry.name.startswith(".tmp-"):
                            if now - st.st_mtime > _STALE_TMP:
                                with contextlib.suppress(OSError):
                                    os.unlink(entry.path)
                            continue
                        if _parse(entry.name) is None:
                            continue
                        entries.append((st.st_mtime_ns, st.st_size, entry.path))
                        total += st.st_size
        if total + size <= self.limit:
            return total
        target = min(int(self.limit * 0.9), self.limit - size)
        entries.sort()
        for _, bytes_, path in entries:
            if total + size <= target:
                break
            with contextlib.suppress(OSError):
                os.unlink(path)
                total -= bytes_
        return total


def _name(start: int, stop: int) -> str:
    return f"{start}-{stop}"


def _parse(name: str) -> tuple[int, int] | None:
    a, sep, b = name.partition("-")
    if not sep or not a.isdigit() or not b.isdigit():
        return None
    start, stop = int(a), int(b)
    return (start, stop) if stop > start else None


_CACHES: dict[tuple[str, int], RangeCache] = {}
_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    global _LOCK
    _LOCK = threading.Lock()


at_fork(_after_fork_in_child)


def range_cache(root: str | None, limit: int) -> RangeCache | None:
    """This process's :class:`RangeCache` of ``root`` (``None``: no cache)."""
    if root is None:
        return None
    key = (os.path.abspath(os.path.expanduser(root)), limit)
    with _LOCK:
        found = _CACHES.get(key)
        if found is None:
            found = _CACHES[key] = RangeCache(key[0], limit)
        return found
