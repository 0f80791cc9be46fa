"""Opening the files of a source: local paths directly, remote URLs through
:mod:`distshard.sources.transport.remote` (fsspec).

Three ways to open a file:

- :func:`open_random`: a handle with ``read_at(offset, size)`` and
  ``submit(start, stop)`` (a future of the bytes, for the read-ahead) that reads
  exactly those bytes (``os.pread`` locally, a range request remotely) and checks
  that the file is still the one that was indexed: locally with an ``fstat`` per
  read, remotely on every response (see :mod:`.remote`), never with a metadata
  request of its own;
- :func:`open_scan`: a seekable file object for building an index: locally its
  ``read(n)`` is one ``pread`` of ``n`` bytes and ``seek`` reads nothing (a tar's
  header walk reads the headers, not the payloads; kernel read-ahead is turned
  off for it); remotely it reads large ranges (``ReadOptions.max_range``) and
  serves the small reads from them, so a cold index never costs a round trip per
  header;
- :func:`open_stream`: a buffered sequential reader, decompressed if the name
  says the file is compressed (``.gz``, ``.bz2``, ``.xz``, ``.zst``).

Every function takes an :class:`FileAccess`: the source's ``ReadOptions`` and
``storage_options`` (handed to fsspec).
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import re
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Mapping, Sequence

from ...errors import SourceChangedError, SourceMissingError
from ..coalesce import Range, ScanRamp
from ..read_options import ReadOptions
from .brace_list import BraceList
from .contract import Transport
from .pins import unpinned
from .responses import Deferred
from .urls import is_remote

__all__ = [
    "FileAccess",
    "FileRef",
    "compression_of",
    "file_identity",
    "identify",
    "key_of",
    "open_random",
    "open_scan",
    "open_stream",
]

_COMPRESSIONS = {
    ".gz": "gzip",
    ".tgz": "gzip",
    ".bz2": "bz2",
    ".tbz2": "bz2",
    ".tbz": "bz2",
    ".xz": "xz",
    ".txz": "xz",
    ".zst": "zstd",
    ".zstd": "zstd",
    ".tzst": "zstd",
}
_MAGICS = {b"\x1f\x8b": "gzip", b"BZh": "bz2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}
STREAM_BUFFER = 1 << 20


@dataclass(frozen=True)
class FileRef:
    """A file of a source, with the identity it had when it was indexed.

    ``size`` and ``stamp`` (``st_mtime_ns`` locally; the ETag, generation or
    modification time remotely) are ``None`` until the file has been looked at
    (counts given by a shard index do not need to open it)."""

    url: str
    size: int | None = None
    stamp: str | None = None
    stored: str | None = None  # the stored index the identity came from (``python -m distshard index``)


@dataclass(frozen=True, eq=False)
class FileAccess:
    """How a source reaches its files: read options and fsspec's ``storage_options``."""

    options: ReadOptions = field(default_factory=ReadOptions)
    storage_options: Mapping[str, Any] | None = None

    def client(self, url: str) -> Transport:
        from .clients import client_for

        return client_for(url, self.storage_options)


DEFAULT_FILE_ACCESS = FileAccess()


def key_of(url: str) -> str:
    """What names the file in the cache: its absolute path, or the URL (an
    ``hf://`` URL without the commit it was pinned to: its stamp names the bytes)."""
    if is_remote(url):
        return unpinned(url)
    return os.path.abspath(local_path(url))


def local_path(url: str) -> str:
    path = url[len("file://") :] if url.startswith("file://") else url
    return os.path.expanduser(path)


def compression_of(url: str) -> str | None:
    """The compression the file name announces (``"gzip"``, ...) or ``None``."""
    base = url.split("?", 1)[0].lower()
    for suffix, name in _COMPRESSIONS.items():
        if base.endswith(suffix):
            return name
    return None


assert all(suffix.startswith(".") for suffix in _COMPRESSIONS)
assert all(suffix.count(".") == 1 for suffix in _COMPRESSIONS)  # (so a name's last ".part" decides)
_NAMED_COMPRESSED = re.compile(  # (a name's end: before the next name, or its query)
    r"\.(?:" + "|".join(re.escape(suffix[1:]) for suffix in _COMPRESSIONS) + ")[\n?]", re.IGNORECASE
)


def any_compressed(urls: Sequence[str]) -> bool:
    """Whether :func:`compression_of` names a compression for any of ``urls``,
    without a call per URL when none does (a search of them joined); of a brace
    pattern whose literal end holds a dot (``".tar"``), from that end alone."""
    if isinstance(urls, BraceList) and "?" not in urls.pattern and "." in urls.tail():
        return compression_of(urls.tail()) is not None  # (every URL's last ".suffix" is the tail's)
    if _NAMED_COMPRESSED.search("\n".join(urls) + "\n") is None:
        return False
    return any(compression_of(url) is not None for url in urls)


def sniff_compression(head: bytes) -> str | None:
    """The compression whose magic number ``head`` starts with, if any."""
    for magic, name in _MAGICS.items():
        if head.startswith(magic):
            return name
    return None


def _missing(url: str) -> FileNotFoundError:
    return SourceMissingError(f"{url}: no such file (named by the source's urls)")


def file_identity(url: str, access: FileAccess = DEFAULT_FILE_ACCESS) -> tuple[int, str]:
    """``(size, stamp)`` of the file now (a ``stat``, or one metadata request remotely)."""
    if is_remote(url):
        return access.client(url).identity(url, access.options)
    try:
        st = os.stat(local_path(url))
    except FileNotFoundError:
        raise _missing(url) from None
    return st.st_size, str(st.st_mtime_ns)


def identify(fmt: Any, url: str, access: FileAccess = DEFAULT_FILE_ACCESS) -> tuple[int, str]:
    """``(size, stamp)`` of a file of ``fmt`` now: :func:`file_identity`, or the
    format's own ``identity(url, access)`` when it has one (tokens: a ``.bin`` and
    its ``.idx`` make one unit; Parquet: a remote file's identity and footer in one
    suffix GET)."""
    own = getattr(fmt, "identity", None)
    return own(url, access) if own is not None else file_identity(url, access)


def check_identity(ref: FileRef, size: int, stamp: str, when: str = "read") -> None:
    """Raise ``ValueError`` if the file is no longer the one that was indexed."""
    if ref.size is not None and (ref.size != size or ref.stamp != stamp):
        if ref.stored is not None:
            from .responses import changed_error

            raise changed_error(ref.url, f"size {ref.size} -> {size}, stamp {ref.stamp} -> {stamp}", ref.stored)
        raise SourceChangedError(
            f"{ref.url} changed after it was indexed (size {ref.size} -> {size}, "
            f"stamp {ref.stamp} -> {stamp}); refusing to {when} it with a stale index: "
            "build the source again (the index is rebuilt for the new file)"
        )


class LocalRandomFile:
    """``read_at`` with ``os.pread`` on one open descriptor; every read checks
    (``fstat``, a microsecond) that the file was not rewritten in place."""

    def __init__(self, ref: FileRef) -> None:
        self.ref = ref
        try:
            self.fd = os.open(local_path(ref.url), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise _missing(ref.url) from None
        self.check()

    def identity(self) -> tuple[int, str]:
        st = os.fstat(self.fd)
        return st.st_size, str(st.st_mtime_ns)

    def check(self, when: str = "read") -> None:
        check_identity(self.ref, *self.identity(), when)

    def fileno(self) -> int:
        return self.fd

    def read_at(self, offset: int, size: int, checked: bool = True) -> bytes:
        if checked:  # check() inlined for its common outcome (it runs once a sample read)
            ref, st = self.ref, os.fstat(self.fd)
            if ref.size is not None and (st.st_size != ref.size or str(st.st_mtime_ns) != ref.stamp):
                check_identity(ref, st.st_size, str(st.st_mtime_ns))
        data = os.pread(self.fd, size, offset)
        while len(data) < size:
            more = os.pread(self.fd, size - len(data), offset + len(data))
            if not more:
                raise SourceChangedError(
                    f"{self.ref.url}: wanted bytes [{offset}, {offset + size}) but the file ends at byte "
                    f"{offset + len(data)} (truncated after indexing?)"
                )
            data += more
        return data

    def submit(self, start: int, stop: int) -> Any:
        """A future-like object whose ``result()`` reads the bytes (when first asked)."""
        return Deferred(lambda: self.read_at(start, stop - start))

    def close(self) -> None:
        fd, self.fd = getattr(self, "fd", -1), -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except OSError:
            pass


class RemoteRandomFile:
    """Range reads of one remote file through this process's client, every
    response checked against the indexed identity (no metadata request)."""

    def __init__(self, ref: FileRef, access: FileAccess) -> None:
        self.ref = ref
        self.access = access
        self.client = access.client(ref.url)

    def read_at(self, offset: int, size: int) -> bytes:
        return self.submit(offset, offset + size).result()

    def submit(self, start: int, stop: int) -> Any:
        """A future-like object (``result()``, ``cancel()``) of the bytes."""
        ref = self.ref
        return self.client.submit_range(ref.url, start, stop, ref.size, ref.stamp, self.access.options, ref.stored)

    def close(self) -> None:
        pass


def open_random(ref: FileRef, access: FileAccess = DEFAULT_FILE_ACCESS) -> LocalRandomFile | RemoteRandomFile:
    """A handle with ``read_at(offset, size)`` and ``submit(start, stop)``, checked
    against ``ref``'s identity."""
    if is_remote(ref.url):
        return RemoteRandomFile(ref, access)
    return LocalRandomFile(ref)


class ScanFile(io.RawIOBase):
    """A seekable reader for building indexes (see :func:`open_scan`).

    Locally ``read(n)`` is one ``pread`` of ``n`` bytes. Remotely reads are
    served from the last range fetched, the ranges chosen by
    :class:`..coalesce.ScanRamp`: ``max_range`` bytes at the read position (the
    next one fetched ahead while a scan goes on sequentially); a seek past them
    makes the next fetch small (64 KiB, growing on sequential reads), so a tar
    of large members is walked header by header."""

    def __init__(self, handle: LocalRandomFile | RemoteRandomFile, size: int, options: ReadOptions) -> None:
        super().__init__()
        self.handle = handle
        self.size = size
        self.pos = 0
        self.remote = isinstance(handle, RemoteRandomFile)
        self.ramp = ScanRamp(size, options.max_range)
        self.buffer = b""
        self.buffer_at = 0
        self.ahead: tuple[Range, Any] | None = None  # the range asked ahead, and its answer
        self.requests = 0
        if not self.remote:
            try:
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_RANDOM)  # type: ignore[union-attr]
            except (AttributeError, OSError):
                pass

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def read_block(self, position: int, size: int = 512) -> bytes:
        """``size`` bytes at ``position`` (fewer at the end); the position moves past them."""
        if not self.remote:
            end = min(self.size, position + size)
            data = os.pread(self.handle.fd, end - position, position) if end > position else b""  # type: ignore
            if len(data) != max(0, end - position):
                data = self.handle.read_at(position, end - position, checked=False)  # type: ignore[call-arg]
            self.pos = end if end > position else position
            return data
        self.pos = position
        return self.read(size)

    def read(self, size: int | None = -1) -> bytes:
        end = self.size if size is None or size < 0 else min(self.size, self.pos + size)
        if end <= self.pos:
            return b""
        if not self.remote:  # the identity is checked when the scan opens and when it closes
            data = self.handle.read_at(self.pos, end - self.pos, checked=False)  # type: ignore[call-arg]
            self.pos = end
            return data
        out = []
        while self.pos < end:
            if not (self.buffer_at <= self.pos < self.buffer_at + len(self.buffer)):
                self._fill(end)
            start = self.pos - self.buffer_at
            piece = self.buffer[start : start + (end - self.pos)]
            out.append(piece)
            self.pos += len(piece)
        return b"".join(out)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        return self.read(-1)

    def _fill(self, wanted_end: int) -> None:
        """Fetch the range :class:`.ScanRamp` chooses for ``[pos, wanted_end)``, or
        take the one asked ahead if it holds them; then ask the next one ahead."""
        held_end = self.buffer_at + len(self.buffer) if self.buffer else None
        rng = self.ramp.next(self.pos, wanted_end, held_end)
        if self.ahead is not None and self.ahead[0].covers(self.pos, wanted_end):
            rng, future = self.ahead
        else:
            if self.ahead is not None:
                self.ahead[1].cancel()
            future = self.handle.submit(rng.start, rng.stop)
            self.requests += 1
        self.ahead = None
        self.buffer, self.buffer_at = future.result(), rng.start
        nxt = self.ramp.ahead(rng.start + len(self.buffer))
        if nxt is not None:  # a long sequential scan: fetch the next range now
            self.ahead = (nxt, self.handle.submit(nxt.start, nxt.stop))
            self.requests += 1

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead[1].cancel()
            self.ahead = None
        if not self.remote and not self.closed:
            try:
                self.handle.check("index")  # type: ignore[union-attr]
            finally:
                super().close()
                self.handle.close()
            return
        super().close()


def open_scan(ref: FileRef, access: FileAccess = DEFAULT_FILE_ACCESS) -> ScanFile:
    """A seekable reader for building ``ref``'s index (see :class:`ScanFile`),
    checked against ``ref``'s identity (locally when it opens and closes,
    remotely on every response)."""
    assert ref.size is not None
    return ScanFile(open_random(ref, access), ref.size, access.options)


def _decompressed(raw: BinaryIO, compression: str, url: str) -> BinaryIO:
    if compression == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    if compression == "bz2":
        return bz2.BZ2File(raw, mode="rb")  # type: ignore[return-value]
    if compression == "xz":
        return lzma.LZMAFile(raw, mode="rb")  # type: ignore[return-value]
    try:
        import zstandard
    except ImportError:
        raise ImportError(f"{url} is zstd-compressed: reading it needs `pip install zstandard`") from None
    return zstandard.ZstdDecompressor().stream_reader(raw)


class StreamFile:
    """A sequential reader that closes both the decompressor and the file below it."""

    def __init__(self, inner: BinaryIO, owner: Any = None) -> None:
        self.inner = inner
        self.owner = owner

    def read(self, size: int = -1) -> bytes:
        return self.inner.read(size)

    def readline(self, size: int = -1) -> bytes:
        return self.inner.readline(size)

    def __iter__(self) -> "StreamFile":
        return self

    def __next__(self) -> bytes:
        line = self.inner.readline()
        if not line:
            raise StopIteration
        return line

    def tell(self) -> int:
        return self.inner.tell()

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            if self.owner is not None:
                self.owner.close()

    def __enter__(self) -> "StreamFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_stream(url: str, compression: str | None = None, access: FileAccess = DEFAULT_FILE_ACCESS) -> StreamFile:
    """A buffered sequential reader of ``url``'s (decompressed) bytes. Remotely:
    one metadata request, then large range requests (the next one fetched
    ahead), each checked against that identity and retried."""
    if is_remote(url):
        ref = FileRef(url, *file_identity(url, access))
        raw: Any = io.BufferedReader(open_scan(ref, access), STREAM_BUFFER)
    else:
        try:
            raw = open(local_path(url), "rb", buffering=STREAM_BUFFER)  # noqa: SIM115
        except FileNotFoundError:
            raise _missing(url) from None
    if compression is None:
        return StreamFile(raw)
    try:
        inner = io.BufferedReader(_decompressed(raw, compression, url), STREAM_BUFFER)  # type: ignore[type-var]  # a raw stream
    except BaseException:
        raw.close()
        raise
    return StreamFile(inner, raw)
