"""Remote files (``s3://``, ``gs://``, ``http(s)://``, ...) through fsspec.

Every read is a range read (``fs.cat_file(path, start, end)``), so reading a
sample transfers its own bytes only, and walking a tar's headers transfers the
headers only. fsspec is an optional extra: ``pip install distshard[remote]``
(plus the filesystem's own package: ``s3fs``, ``gcsfs``; ``http(s)`` needs
``aiohttp``).
"""

from __future__ import annotations

import io
from typing import Any, BinaryIO

from .files import FileRef, check_identity

__all__ = ["RemoteRandomFile", "RemoteWalkFile", "filesystem", "glob_remote", "open_remote_stream",
           "remote_identity"]

_STAMP_FIELDS = ("ETag", "etag", "generation", "mtime", "LastModified", "last_modified", "updated",
                 "Last-Modified", "md5Hash", "Content-MD5")


def filesystem(url: str) -> tuple[Any, str]:
    """``(fs, path)`` for ``url``; a clear ``ImportError`` when fsspec is missing."""
    try:
        import fsspec.core
    except ImportError:
        raise ImportError(
            f"reading the remote URL {url!r} needs fsspec: `pip install distshard[remote]` "
            "(plus the filesystem's package: s3fs for s3://, gcsfs for gs://, aiohttp for http(s)://)"
        ) from None
    return fsspec.core.url_to_fs(url)


def remote_identity(url: str) -> tuple[int, str]:
    """``(size, stamp)``: the size and the first version marker the store reports
    (ETag, generation, modification time)."""
    fs, path = filesystem(url)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{url}: no such file (named by the source's urls)") from None
    size = info.get("size")
    if size is None:
        raise ValueError(f"{url}: the server does not report the file's size; random access needs it")
    stamp = next((str(info[name]) for name in _STAMP_FIELDS if info.get(name)), "")
    return int(size), stamp


class RemoteRandomFile:
    """``read_at(offset, size)``: one range request per call. The identity is
    checked once, when the handle is opened."""

    def __init__(self, ref: FileRef) -> None:
        self.ref = ref
        self.fs, self.path = filesystem(ref.url)
        check_identity(ref, *remote_identity(ref.url))

    def read_at(self, offset: int, size: int) -> bytes:
        if size == 0:
            return b""
        data = self.fs.cat_file(self.path, start=offset, end=offset + size)
        if len(data) != size:
            raise ValueError(
                f"{self.ref.url}: asked for bytes [{offset}, {offset + size}) and got {len(data)} bytes "
                "(the file is shorter than indexed, or the server ignores range requests)"
            )
        return data

    def read_ranges(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Several ``(offset, size)`` ranges, fetched concurrently where fsspec can."""
        wanted = [(o, n) for o, n in ranges if n]
        if len(wanted) <= 1:
            return [self.read_at(o, n) for o, n in ranges]
        got = iter(self.fs.cat_ranges([self.path] * len(wanted), [o for o, _ in wanted],
                                      [o + n for o, n in wanted]))
        out = []
        for offset, size in ranges:
            data = next(got) if size else b""
            if isinstance(data, BaseException):
                raise data
            if len(data) != size:
                raise ValueError(f"{self.ref.url}: asked for bytes [{offset}, {offset + size}) and got {len(data)}")
            out.append(data)
        return out

    def close(self) -> None:
        pass


class RemoteWalkFile(io.RawIOBase):
    """A read-only, seekable file whose ``read(n)`` is one range request of ``n``
    bytes and whose ``seek`` transfers nothing: walking tar headers this way
    transfers 512 bytes per member."""

    def __init__(self, ref: FileRef) -> None:
        super().__init__()
        self.handle = RemoteRandomFile(ref)
        self.size = ref.size if ref.size is not None else remote_identity(ref.url)[0]
        self.pos = 0

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

    def read(self, size: int = -1) -> bytes:
        end = self.size if size is None or size < 0 else min(self.size, self.pos + size)
        if end <= self.pos:
            return b""
        data = self.handle.read_at(self.pos, end - self.pos)
        self.pos = end
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def open_remote_stream(url: str, block_size: int) -> BinaryIO:
    """A sequential reader fetching ``block_size`` bytes per request."""
    fs, path = filesystem(url)
    try:
        return fs.open(path, "rb", block_size=block_size, cache_type="readahead")
    except FileNotFoundError:
        raise FileNotFoundError(f"{url}: no such file (named by the source's urls)") from None


def glob_remote(pattern: str) -> list[str]:
    """The URLs matching a remote glob, sorted."""
    fs, path = filesystem(pattern)
    return sorted(fs.unstrip_protocol(p) for p in fs.glob(path))
