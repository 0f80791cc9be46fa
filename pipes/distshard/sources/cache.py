"""A local disk cache of fetched ranges, so that epochs after the first read
the store about once (``ReadOptions(cache_dir=..., cache_bytes=...)``).

The read-ahead (:mod:`.fetch`) asks it, below the parsing, for every span of a
remote file before it plans a range request: a span that lies inside a stored
range is read from local disk; the ranges it fetches are stored once their bytes
are there. Layout::

    cache_dir/<digest of (URL, size, stamp)>/<start>-<stop>     the bytes [start, stop)
    cache_dir/.ledger, cache_dir/.lock                          the total bytes stored

* **Never another version.** The directory is named by the URL *and* the
  file's identity as the source knows it (size and ETag / generation /
  modification time), so a rewritten file (a new identity) never finds the old
  bytes; a file whose identity names no version (no stamp) is not cached.
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
import os
import threading
import time
from typing import Any, Iterator

from ..digests import sha256_hex

__all__ = ["FileCache", "RangeCache", "range_cache"]

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: stores are not serialized across processes
    fcntl = None  # type: ignore[assignment]

#: a temporary file older than this was left by a process that died while writing
_STALE_TMP = 3600.0
#: the least time between two listings of a file's directory after a miss (another process may have stored)
_RELIST = 0.1


class FileCache:
    """The stored ranges of one version of one file (see the module docstring)."""

    def __init__(self, owner: "RangeCache", directory: str) -> None:
        self.owner = owner
        self.directory = directory
        self._starts: list[int] = []
        self._stops: list[int] = []
        self._listed: tuple[float, Any] | None = None  # (when, the directory's stat) of the last listing

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
        """Bytes ``[start, stop)`` from the stored range ``rng``; ``OSError`` if
        it is gone (evicted) or short."""
        path = os.path.join(self.directory, _name(*rng))
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            data = os.pread(fd, stop - start, start - rng[0])
            with contextlib.suppress(OSError):
                os.utime(fd if os.utime in os.supports_fd else path)  # recently used
        finally:
            os.close(fd)
        if len(data) != stop - start:
            raise OSError(f"{path}: a short cache entry")
        return data

    def store(self, start: int, stop: int, data: bytes | memoryview) -> None:
        """Keep bytes ``[start, stop)``: written whole, then renamed into place."""
        size = stop - start
        if size <= 0 or size > self.owner.limit or self._find(start, stop) is not None:
            return
        tmp = os.path.join(self.directory, f".tmp-{os.getpid()}-{threading.get_ident()}-{start}")
        try:
            os.makedirs(self.directory, exist_ok=True)
            with open(tmp, "wb") as out:
                out.write(data)
            with self.owner.locked():
                self.owner.make_room(size)
                os.replace(tmp, os.path.join(self.directory, _name(start, stop)))
                self.owner.grew(size)
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
            digest = sha256_hex("\0".join((url, str(size), stamp)).encode())[:40]
            found = self._files[key] = FileCache(self, os.path.join(self.root, digest))
        return found

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


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


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
