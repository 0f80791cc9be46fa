"""Per-file indexes (sample count, per-sample byte ranges) and their cache.

An index is built once per job and cached under ``$DISTSHARD_CACHE`` (default
``~/.cache/distshard``) in ``index/<name>.<hash>.idx``, where the hash covers
the format, the file's absolute path or URL, its size and its ``mtime_ns`` (or
ETag remotely): a changed file gets a new cache entry and is never read with a
stale one. The same identity is stored inside and checked on load, and a
checksum covers the whole entry: a corrupt or foreign entry is ignored and
rebuilt. Writes are atomic (a temporary file, then ``os.replace``).

Concurrent builders (DataLoader workers, the ranks of a node) take a per-file
lock (``fcntl.flock`` on ``<entry>.lock``) and look at the cache again once they
hold it, so each file is indexed once and the others read the result. A builder
first goes over the files taking only the locks nobody holds (starting at a
place of its own), so concurrent builders index different files instead of
queueing on one; then it waits for the rest. Within a process several remote
files are indexed at once (threads: their time is spent waiting for ranges;
local files one after the other: their header walk is CPU). When
``torch.distributed`` is initialized, :func:`summarize_files` splits the files
across ranks, each rank indexes its share and the results (counts, identities
and the entries themselves, for nodes that share no file system) are exchanged
with ``all_gather_object``: a file's identity is asked once per job.

Entry layout: ``MAGIC``, the header's length and CRC-32 (4 bytes each, little
endian), the header (JSON: identity, count, array specs), then the body
(zlib-compressed arrays and string lists) whose BLAKE2b digest is in the
header. Reading only the count reads the header alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import struct
import sys
import tempfile
import time
import zlib
from array import array
from pathlib import Path
from typing import Any, Callable, Iterator

from ... import errors as _errors
from ...digests import blake2b_hex
from ...groups import DataGroup, job_ranks
from ...waits import WaitTimeout
from ..transport.files import FileRef, file_identity, key_of
from .file_index import FileIndex

__all__ = ["IndexLockTimeout", "cache_dir", "cache_path", "load_cached", "obtain", "summarize_files"]

VERSION = 2  # 2: tar drops WebDataset's __bad__ samples, Parquet records column chunk ranges
MAGIC = b"DSIDX\x00\x01\n"
_PREFIX = struct.Struct("<II")
_SHARE_LIMIT = 256 << 20  # entries larger than this in total are not exchanged between ranks


def cache_dir() -> Path:
    """``$DISTSHARD_CACHE/index`` (default ``~/.cache/distshard/index``)."""
    root = os.environ.get("DISTSHARD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "distshard")
    return Path(root) / "index"


def cache_path(fmt: str, ref: FileRef) -> Path:
    """The cache entry of ``ref`` (whose identity must be known) in format ``fmt``."""
    key = key_of(ref.url)
    digest = blake2b_hex(f"{VERSION}\0{fmt}\0{key}\0{ref.size}\0{ref.stamp}".encode("utf-8", "surrogatepass"), 16)
    name = re.sub(r"[^A-Za-z0-9._-]", "_", key.rstrip("/").rsplit("/", 1)[-1])[-60:]
    return cache_dir() / f"{name}.{fmt}.{digest}.idx"


def dumps(index: FileIndex) -> bytes:
    """The cache entry for ``index`` (complete)."""
    names = sorted(index.arrays)
    body = b"".join(index.arrays[n].tobytes() for n in names)
    body += json.dumps({k: index.strings[k] for k in sorted(index.strings)}, ensure_ascii=False).encode(
        "utf-8", "surrogatepass"
    )
    packed = zlib.compress(body, 6)
    header = json.dumps(
        {
            "version": VERSION,
            "format": index.format,
            "key": index.key,
            "size": index.size,
            "stamp": index.stamp,
            "count": index.count,
            "meta": index.meta,
            "byteorder": sys.byteorder,
            "arrays": [[n, index.arrays[n].typecode, len(index.arrays[n])] for n in names],
            "body_len": len(packed),
            "body_digest": blake2b_hex(packed, 16),
        },
        ensure_ascii=False,
    ).encode("utf-8", "surrogatepass")
    return MAGIC + _PREFIX.pack(len(header), zlib.crc32(header)) + header + packed


def _header(data: bytes, fmt: str, ref: FileRef, moved: bool = False) -> tuple[dict[str, Any], int] | None:
    """The header and where the body starts, or ``None`` if it is not ``ref``'s
    entry (``moved``: of ``ref``'s identity, whatever URL it was written for)."""
    start = len(MAGIC) + _PREFIX.size
    if len(data) < start or not data.startswith(MAGIC):
        return None
    length, crc = _PREFIX.unpack_from(data, len(MAGIC))
    raw = data[start : start + length]
    if len(raw) != length or zlib.crc32(raw) != crc:
        return None
    try:
        header = json.loads(raw.decode("utf-8", "surrogatepass"))
    except ValueError:
        return None
    expected = {
        "version": VERSION,
        "format": fmt,
        "key": header.get("key") if moved and isinstance(header, dict) else key_of(ref.url),
        "size": ref.size,
        "stamp": ref.stamp,
        "byteorder": sys.byteorder,
    }
    if not isinstance(header, dict) or any(header.get(k) != v for k, v in expected.items()):
        return None
    if not isinstance(header.get("count"), int) or header["count"] < 0:
        return None
    return header, start + length


def loads(data: bytes, fmt: str, ref: FileRef, header_only: bool = False, moved: bool = False) -> FileIndex | None:
    """The index in a cache entry, or ``None`` if it is corrupt or another file's.
    ``moved``: an entry of ``ref``'s size and stamp written for another URL is
    taken as ``ref``'s (a dataset copied with its stored index; see
    :func:`.manifest.identifies_content` for when that is sound)."""
    found = _header(data, fmt, ref, moved)
    if found is None:
        return None
    header, offset = found
    index = FileIndex(
        fmt,
        key_of(ref.url),
        header["size"],
        header["stamp"],
        header["count"],
        meta=dict(header.get("meta") or {}),
        complete=not header_only,
    )
    if header_only:
        return index
    packed = data[offset:]
    if len(packed) != header.get("body_len") or blake2b_hex(packed, 16) != header.get("body_digest"):
        return None
    try:
        body = zlib.decompress(packed)
        pos = 0
        for name, typecode, length in header["arrays"]:
            values = array(typecode)
            end = pos + length * values.itemsize
            values.frombytes(body[pos:end])
            if len(values) != length:
                return None
            index.arrays[name] = values
            pos = end
        index.strings = json.loads(body[pos:].decode("utf-8", "surrogatepass"))
    except (ValueError, TypeError, zlib.error, KeyError):
        return None
    return index


def _read_entry(path: Path, header_only: bool) -> bytes | None:
    try:
        with open(path, "rb", buffering=0) as f:
            if not header_only:
                return f.readall()
            head = f.read(len(MAGIC) + _PREFIX.size)
            if len(head) < len(MAGIC) + _PREFIX.size or not head.startswith(MAGIC):
                return None
            length, _ = _PREFIX.unpack_from(head, len(MAGIC))
            return head + f.read(length)
    except OSError:
        return None


def load_cached(fmt: str, ref: FileRef, header_only: bool = False) -> FileIndex | None:
    """The cached index of ``ref``, or ``None`` (missing, corrupt, another identity)."""
    data = _read_entry(cache_path(fmt, ref), header_only)
    return None if data is None else loads(data, fmt, ref, header_only)


def write_entry(path: Path, data: bytes) -> bool:
    """Write atomically (temporary file + ``os.replace``); ``False`` if the cache
    directory cannot be written (the index is then used without caching)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".idx")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError:
        return False
    return True


LOCK_WAIT = 1800.0  # seconds a builder waits for another one's index of a file, then raises


class IndexLockTimeout(WaitTimeout):
    """A builder waited past :data:`LOCK_WAIT` for another one holding a file's index lock."""


def _holder(fd: int) -> str:
    """Who holds the lock, as its holder wrote it (``pid N on host``)."""
    try:
        return os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
    except OSError:
        return "unknown"


@contextlib.contextmanager
def _locked(path: Path, wait: bool = True, what: str = "") -> Iterator[bool]:
    """An exclusive ``flock`` on ``<path>.lock``: yields whether it is held
    (``wait=False`` gives up at once if another builder holds it); no lock
    where that is impossible. A wait longer than :data:`LOCK_WAIT` raises
    :class:`IndexLockTimeout` naming the lock, ``what`` it guards and its holder
    (a lock dies with its holder's process, so a holder that keeps it that long is
    alive: still indexing, or stuck)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: concurrent builders may build twice, each writes atomically
        yield True
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError:
        yield True
        return
    try:
        started, pause = time.monotonic(), 0.01
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - started
                if not wait:
                    yield False
                    return
                if waited >= LOCK_WAIT:
                    raise IndexLockTimeout(
                        f"waited {waited:.0f} s for the index lock {path}.lock{' of ' + what if what else ''}, "
                        f"held by {_holder(fd)}: that process is still indexing the file or is stuck "
                        "holding the lock (a lock ends with its process: stop that process and retry)"
                    ) from None
                time.sleep(min(pause, LOCK_WAIT - waited))
                pause = min(pause * 2, 0.5)
        with contextlib.suppress(OSError):  # who holds it, for a waiter's message
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        yield True
    finally:
        os.close(fd)  # closing releases the lock


Builder = Callable[[FileRef], FileIndex]


def obtain(
    fmt: str, ref: FileRef, build: Builder, header_only: bool = False, wait: bool = True
) -> tuple[FileIndex | None, bytes | None]:
    """``ref``'s index from the cache, or built (once: under the file's lock) and
    cached. Returns the index and, when it was built here, its cache entry;
    ``(None, None)`` if ``wait=False`` and another builder holds the lock."""
    cached = load_cached(fmt, ref, header_only)
    if cached is not None:
        return cached, None
    path = cache_path(fmt, ref)
    with _locked(path, wait, ref.url) as held:
        if not held:
            return None, None
        cached = load_cached(fmt, ref, header_only)  # another process may have built it meanwhile
        if cached is not None:
            return cached, None
        index = build(ref)
        data = dumps(index)
        write_entry(path, data)
    return index, data


def _install(fmt: str, ref: FileRef, data: bytes) -> None:
    """Write an entry built by another rank, unless a valid one is already here."""
    if load_cached(fmt, ref, header_only=True) is None and loads(data, fmt, ref) is not None:
        write_entry(cache_path(fmt, ref), data)


def _threads(urls: list[str]) -> int:
    """Files indexed at once in one process: remote files wait on round trips;
    local ones are indexed one after the other (the header walk is CPU)."""
    from ..transport.urls import is_remote

    return min(len(urls), 16 if any(is_remote(u) for u in urls) else 1) or 1


def _summarize(
    fmt: str, urls: list[str], build: Builder, identify: Callable[[str], tuple[int, str]], start: int = 0
) -> list[tuple[FileRef, int, bytes | None]]:
    """``(ref, count, entry built here)`` per url, in order (remote files by
    several threads at once); files another builder is indexing are left for
    last (see the module docstring). ``start`` rotates where this builder begins."""
    from concurrent.futures import ThreadPoolExecutor

    if not urls:
        return []
    order = [(start + k) % len(urls) for k in range(len(urls))]
    out: list[tuple[FileRef, int, bytes | None] | None] = [None] * len(urls)
    refs: dict[int, FileRef] = {}

    def identified(k: int) -> None:
        refs[k] = FileRef(urls[k], *identify(urls[k]))

    def attempt(k: int, wait: bool) -> bool:
        index, built = obtain(fmt, refs[k], build, header_only=True, wait=wait)
        if index is None:
            return False
        out[k] = (refs[k], index.count, built)
        return True

    threads = _threads(urls)
    if threads == 1:  # local files: the header walk is CPU, threads would only contend
        for k in order:
            identified(k)
        busy = [k for k in order if not attempt(k, False)]
        for k in busy:
            attempt(k, True)
    else:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="distshard-index") as pool:
            list(pool.map(identified, order))
            busy = [k for k, done in zip(order, pool.map(lambda k: attempt(k, False), order), strict=True) if not done]
            list(pool.map(lambda k: attempt(k, True), busy))
    assert all(item is not None for item in out)
    return out  # type: ignore[return-value]


def _start_of(count: int) -> int:
    """Where a builder begins: DataLoader workers of one loader each start at
    another file."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    if info is None or not count:
        return 0
    return info.id * count // max(1, info.num_workers)


_ERRORS = {
    "FileNotFoundError": FileNotFoundError,
    "ValueError": ValueError,
    "ImportError": ImportError,
    "PermissionError": PermissionError,
    "TypeError": TypeError,
    "RemoteReadError": OSError,
    "RemoteReadTimeout": WaitTimeout,
    "IndexLockTimeout": IndexLockTimeout,
    "OSError": OSError,
    **{name: getattr(_errors, name) for name in _errors.__all__},  # every rank raises the same kind
}


def summarize_files(
    fmt: str,
    urls: list[str],
    build: Builder,
    collective: bool = False,
    identify: Callable[[str], tuple[int, str]] = file_identity,
    group: DataGroup | None = None,
) -> list[tuple[FileRef, int]]:
    """``(ref with identity, sample count)`` for every url, in order.

    With ``collective`` (and this process a rank of an initialized
    ``torch.distributed`` group of several), this is a collective call that every
    rank of ``group`` (the data group; default: every rank) must make: rank ``r``
    of it indexes files ``r, r + world, ...`` and the counts
    and new cache entries are exchanged with ``all_gather_object``; an error on
    any rank is raised on every rank. Otherwise every file is indexed here (or
    read from the cache), under its lock. ``identify(url)`` gives a file's
    ``(size, stamp)`` (a ``stat``, or one metadata request).
    """
    place = job_ranks(group) if collective else None
    if place is None:
        return [(ref, count) for ref, count, _ in _summarize(fmt, urls, build, identify, _start_of(len(urls)))]
    rank, world = place
    mine: list[tuple[int, str, int | None, str | None, int, bytes | None]] = []
    error: tuple[str, str] | None = None
    try:
        positions = list(range(rank, len(urls), world))
        for position, (ref, count, built) in zip(
            positions, _summarize(fmt, [urls[p] for p in positions], build, identify), strict=True
        ):
            if built is None:
                built = _read_entry(cache_path(fmt, ref), header_only=False)
            mine.append((position, ref.url, ref.size, ref.stamp, count, built))
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        error = (type(exc).__name__, str(exc))
    if sum(len(item[5] or b"") for item in mine) > _SHARE_LIMIT // world:
        mine = [item[:5] + (None,) for item in mine]
    from ...context import gather_objects

    gathered = gather_objects((mine, error), f"indexing {len(urls)} {fmt} files (each rank indexes its share)", group)
    for _, other_error in gathered:
        if other_error is not None:
            kind, message = other_error
            raise _ERRORS.get(kind, RuntimeError)(message)
    out: list[tuple[FileRef, int] | None] = [None] * len(urls)
    for source, (items, _) in enumerate(gathered):
        for position, url, size, stamp, count, data in items:
            ref = FileRef(url, size, stamp)
            out[position] = (ref, count)
            if source != rank and data is not None:
                _install(fmt, ref, data)
    assert all(item is not None for item in out)
    return out  # type: ignore[return-value]
