"""Opening the files of a source: local paths directly, remote URLs through
:mod:`distshard.sources.remote` (fsspec).

Three ways to open a file:

- :func:`open_random`: a handle with ``read_at(offset, size)`` that reads exactly
  those bytes (``os.pread`` locally, one range request remotely) and checks that
  the file is still the one that was indexed;
- :func:`open_walk`: a file object whose ``read(n)`` reads exactly ``n`` bytes
  and whose ``seek`` reads nothing (to walk headers without touching the data);
- :func:`open_stream`: a buffered sequential reader, decompressed if the name
  says the file is compressed (``.gz``, ``.bz2``, ``.xz``, ``.zst``).
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
from dataclasses import dataclass
from typing import BinaryIO

from .urls import is_remote

__all__ = ["FileRef", "compression_of", "file_identity", "key_of", "open_random", "open_stream", "open_walk"]

_COMPRESSIONS = {".gz": "gzip", ".tgz": "gzip", ".bz2": "bz2", ".tbz2": "bz2", ".tbz": "bz2",
                 ".xz": "xz", ".txz": "xz", ".zst": "zstd", ".zstd": "zstd", ".tzst": "zstd"}
_MAGICS = {b"\x1f\x8b": "gzip", b"BZh": "bz2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}
STREAM_BUFFER = 1 << 20


@dataclass(frozen=True)
class FileRef:
    """A file of a source, with the identity it had when it was indexed.

    ``size`` and ``stamp`` (``st_mtime_ns`` locally; the ETag or modification
    time remotely) are ``None`` until the file has been looked at (counts given
    by a shard index do not need to open it)."""

    url: str
    size: int | None = None
    stamp: str | None = None


def key_of(url: str) -> str:
    """What names the file in the cache: its absolute path, or the URL."""
    if is_remote(url):
        return url
    return os.path.abspath(local_path(url))


def local_path(url: str) -> str:
    path = url[len("file://"):] if url.startswith("file://") else url
    return os.path.expanduser(path)


def compression_of(url: str) -> str | None:
    """The compression the file name announces (``"gzip"``, ...) or ``None``."""
    base = url.split("?", 1)[0].lower()
    for suffix, name in _COMPRESSIONS.items():
        if base.endswith(suffix):
            return name
    return None


def sniff_compression(head: bytes) -> str | None:
    """The compression whose magic number ``head`` starts with, if any."""
    for magic, name in _MAGICS.items():
        if head.startswith(magic):
            return name
    return None


def _missing(url: str) -> FileNotFoundError:
    return FileNotFoundError(f"{url}: no such file (named by the source's urls)")


def file_identity(url: str) -> tuple[int, str]:
    """``(size, stamp)`` of the file now (a ``stat``, or a metadata request remotely)."""
    if is_remote(url):
        from .remote import remote_identity

        return remote_identity(url)
    try:
        st = os.stat(local_path(url))
    except FileNotFoundError:
        raise _missing(url) from None
    return st.st_size, str(st.st_mtime_ns)


def check_identity(ref: FileRef, size: int, stamp: str, when: str = "read") -> None:
    """Raise ``ValueError`` if the file is no longer the one that was indexed."""
    if ref.size is not None and (ref.size != size or ref.stamp != stamp):
        raise ValueError(
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

    def check(self) -> None:
        check_identity(self.ref, *self.identity())

    def read_at(self, offset: int, size: int) -> bytes:
        self.check()
        data = os.pread(self.fd, size, offset)
        while len(data) < size:
            more = os.pread(self.fd, size - len(data), offset + len(data))
            if not more:
                raise ValueError(
                    f"{self.ref.url}: wanted bytes [{offset}, {offset + size}) but the file ends at byte "
                    f"{offset + len(data)} (truncated after indexing?)"
                )
            data += more
        return data

    def close(self) -> None:
        fd, self.fd = getattr(self, "fd", -1), -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except OSError:
            pass


def open_random(ref: FileRef) -> "LocalRandomFile":
    """A handle with ``read_at(offset, size)``, checked against ``ref``'s identity."""
    if is_remote(ref.url):
        from .remote import RemoteRandomFile

        return RemoteRandomFile(ref)  # type: ignore[return-value]
    return LocalRandomFile(ref)


def open_walk(ref: FileRef) -> BinaryIO:
    """An unbuffered reader (``read(n)`` reads ``n`` bytes, ``seek`` reads none),
    checked against ``ref``'s identity at open."""
    if is_remote(ref.url):
        from .remote import RemoteWalkFile

        return RemoteWalkFile(ref)  # type: ignore[return-value]
    try:
        raw = open(local_path(ref.url), "rb", buffering=0)  # noqa: SIM115 - closed by the caller
    except FileNotFoundError:
        raise _missing(ref.url) from None
    st = os.fstat(raw.fileno())
    try:
        check_identity(ref, st.st_size, str(st.st_mtime_ns), "index")
    except ValueError:
        raw.close()
        raise
    return raw  # type: ignore[return-value]


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
    return zstandard.ZstdDecompressor().stream_reader(raw)  # type: ignore[return-value]


class StreamFile:
    """A sequential reader that closes both the decompressor and the file below it."""

    def __init__(self, inner: BinaryIO, owner: BinaryIO | None = None) -> None:
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


def open_stream(url: str, compression: str | None = None) -> StreamFile:
    """A buffered sequential reader of ``url``'s (decompressed) bytes."""
    if is_remote(url):
        from .remote import open_remote_stream

        raw = open_remote_stream(url, STREAM_BUFFER)
    else:
        try:
            raw = open(local_path(url), "rb", buffering=STREAM_BUFFER)  # noqa: SIM115
        except FileNotFoundError:
            raise _missing(url) from None
    if compression is None:
        return StreamFile(raw)
    try:
        inner = io.BufferedReader(_decompressed(raw, compression, url), STREAM_BUFFER)  # type: ignore[arg-type]
    except BaseException:
        raw.close()
        raise
    return StreamFile(inner, raw)  # type: ignore[arg-type]
