"""Parquet: one dict per row (``pyarrow``, an optional extra).

The index is the footer: rows per row group, the byte range of every column
chunk, and the footer itself (so a worker never asks the store for it). Reading
row ``i`` needs the column chunks of its row group (the selected ``columns``
only): the read-ahead fetches them like any other span, and parsing decodes the
row group from those bytes once (``pyarrow`` reads nothing else: it is handed
the footer and an in-memory view of the chunks), keeping the last few decoded
row groups of the process. With ``shuffle=True`` a file source keeps a row
group's rows together (see ``order.py``), so each row group is decoded about
once per slot that reads from it.

A remote file's identity and footer come from one request: a suffix GET of its
last :data:`TAIL` bytes (:meth:`ParquetFormat.identity`), whose answer gives
the size and version and whose body almost always holds the whole footer, kept
until the index is built; only a longer footer costs a second range, checked
against that identity. A store that does not answer suffix ranges is asked as
before (a HEAD, then the footer's range).
"""

from __future__ import annotations

import bisect
import io
import struct
import threading
from array import array
from typing import Any, Iterator, Sequence

from ...errors import OptionError, OptionTypeError, SourceDataError, SourceMissingError
from ...forks import at_fork
from ..transport.files import (
    DEFAULT_FILE_ACCESS,
    FileAccess,
    FileRef,
    file_identity,
    key_of,
    local_path,
    open_random,
    open_scan,
    open_stream,
)
from ..transport.lru import LRU
from ..transport.urls import is_remote
from .file_index import FileIndex

__all__ = ["TAIL", "ParquetFormat", "decodes", "require_pyarrow"]

#: the bytes of a remote file's end asked with its identity (pyarrow reads as many for a footer)
TAIL = 64 << 10

_ROW_GROUPS: LRU[list] = LRU(max_items=4, max_weight=1 << 20)
_METADATA: LRU[Any] = LRU(max_items=64)
# remote files' footers learnt with their identity, by (URL, size, stamp), until their index is built
_TAILS: LRU[bytes] = LRU(max_items=1 << 16, max_weight=64 << 20)
_DECODES = [0]  # row groups decoded by this process (what the tests count)
_DECODES_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    global _DECODES_LOCK
    _DECODES_LOCK = threading.Lock()  # another thread of the parent may have held it at the fork


at_fork(_after_fork_in_child)


def decodes() -> int:
    """Row groups this process decoded so far."""
    return _DECODES[0]


def require_pyarrow() -> Any:
    """``pyarrow.parquet``, or an ``ImportError`` that says how to install it."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            "distshard.parquet() needs pyarrow: `pip install distshard[parquet]` (or `pip install pyarrow`)"
        ) from None
    return pq


def _check_columns(url: str, names: Sequence[str], columns: Sequence[str] | None) -> None:
    missing = [c for c in columns or () if c not in names]
    if missing:
        raise OptionError(f"{url}: no column {missing[0]!r} (columns: {', '.join(names)})")


class _Chunks(io.RawIOBase):
    """A read-only file of ``size`` bytes of which only ``pieces`` (``offset ->
    bytes``) are present: what pyarrow decodes one row group from. A read of
    anything else goes to ``fallback`` (never happens when the index is right)."""

    def __init__(self, size: int, pieces: list[tuple[int, memoryview]], fallback: Any) -> None:
        super().__init__()
        self.size = size
        self.pieces = sorted(pieces, key=lambda p: p[0])
        self.starts = [p[0] for p in self.pieces]
        self.fallback = fallback
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: 0, 1: self.pos, 2: self.size}[whence] + offset
        return self.pos

    def read(self, n: int | None = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        out = self._from_pieces(self.pos, end)
        if out is None:
            out = self.fallback.read_at(self.pos, end - self.pos) if end > self.pos else b""
        self.pos = end
        return out

    def _from_pieces(self, pos: int, end: int) -> bytes | None:
        """Bytes ``[pos, end)`` from the pieces, also across adjacent ones
        (pyarrow reads a row group's neighbouring column chunks at once), or
        ``None`` if some of them are not there."""
        at = bisect.bisect_right(self.starts, pos) - 1
        parts: list[memoryview] = []
        while pos < end:
            if at < 0 or at >= len(self.pieces):
                return None
            start, data = self.pieces[at]
            if not start <= pos < start + len(data):
                return None
            take = min(end, start + len(data))
            parts.append(data[pos - start : take - start])
            pos = take
            at += 1
        return b"".join(parts)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def _footer_of(tail: bytes) -> bytes:
    """What is kept of a file's last bytes: its footer (metadata, length, magic)
    when they hold it whole, else all of them."""
    if len(tail) >= 8 and tail[-4:] == b"PAR1":
        (length,) = struct.unpack("<I", tail[-8:-4])
        if length + 8 <= len(tail):
            return tail[-(length + 8) :]
    return tail


def _footer(ref: FileRef, access: FileAccess, tail: bytes) -> bytes:
    """The footer from the file's last bytes (``tail``, learnt with its identity);
    a footer longer than them costs one range for the rest, checked against the
    identity they came with (``If-Match``, the size)."""
    assert ref.size is not None
    if len(tail) < 8 or tail[-4:] != b"PAR1":
        raise SourceDataError(f"{ref.url}: not a readable Parquet file: it does not end with a Parquet footer (PAR1)")
    (length,) = struct.unpack("<I", tail[-8:-4])
    need = length + 8
    if need > ref.size:
        raise SourceDataError(
            f"{ref.url}: not a readable Parquet file: its footer says {length} bytes of metadata in a file of {ref.size}"
        )
    if need > len(tail):
        tail = open_random(ref, access).read_at(ref.size - need, need - len(tail)) + tail
    return tail[-need:]


class ParquetFormat:
    """The ``parquet`` format; ``columns`` selects the columns of every row."""

    name = "parquet"
    file_kind = "Parquet file"
    window_order = "permute"  # a row group is fetched whole: its rows may come in any order
    access = "random access by row group (its column chunks read, decoded once while its rows are read)"

    def __init__(self, columns: Sequence[str] | None = None) -> None:
        if columns is not None:
            if isinstance(columns, str) or not all(isinstance(c, str) for c in columns):
                raise OptionTypeError(f"columns must be a list of column names, got {columns!r}")
            columns = tuple(columns)
        self.columns = columns

    def compression(self, url: str) -> str | None:
        return None  # Parquet compresses inside the file: row groups stay addressable

    def stream(self, url: str, access: FileAccess = DEFAULT_FILE_ACCESS) -> Iterator[dict[str, Any]]:
        """Every row of the file, in order."""
        pq = require_pyarrow()
        if is_remote(url):
            source: Any = open_stream(url, None, access).inner
        else:
            try:
                source = open(local_path(url), "rb")  # noqa: SIM115 - closed below
            except FileNotFoundError:
                raise SourceMissingError(f"{url}: no such file (named by the source's urls)") from None
        try:
            try:
                file = pq.ParquetFile(source)
            except Exception as exc:
                raise SourceDataError(f"{url}: not a readable Parquet file: {exc}") from None
            columns = list(self.columns) if self.columns is not None else None
            _check_columns(url, file.schema_arrow.names, columns)
            for group in range(file.num_row_groups):
                yield from file.read_row_group(group, columns=columns).to_pylist()
        finally:
            source.close()

    def identity(self, url: str, access: FileAccess = DEFAULT_FILE_ACCESS) -> tuple[int, str]:
        """``(size, stamp)`` of the file now: locally a ``stat``; remotely one suffix
        GET (the client's ``tail``) whose answer gives the identity and whose body,
        the file's last :data:`TAIL` bytes, is kept (its footer) for :meth:`build_index`."""
        if not is_remote(url):
            return file_identity(url, access)
        size, stamp, tail = access.client(url).tail(url, TAIL, access.options)
        if tail:
            kept = _footer_of(tail)
            _TAILS.put((url, size, stamp), kept, weight=len(kept))
        return size, stamp

    def build_index(self, ref: FileRef, access: FileAccess = DEFAULT_FILE_ACCESS) -> FileIndex:
        """The footer: rows per row group, column chunk ranges, the footer bytes."""
        assert ref.size is not None and ref.stamp is not None
        pq = require_pyarrow()
        tail = _TAILS.pop((ref.url, ref.size, ref.stamp)) if is_remote(ref.url) else None
        if tail is not None:  # the footer came with the identity (see identity)
            import pyarrow as pa

            data = _footer(ref, access, tail)
            try:
                meta = pq.read_metadata(pa.BufferReader(data))
                names = list(meta.schema.to_arrow_schema().names)
            except Exception as exc:
                raise SourceDataError(f"{ref.url}: not a readable Parquet file: {exc}") from None
            footer = array("B", data)
        else:
            scan = open_scan(ref, access)
            try:
                try:
                    file = pq.ParquetFile(scan)
                except Exception as exc:
                    raise SourceDataError(f"{ref.url}: not a readable Parquet file: {exc}") from None
                meta = file.metadata
                names = list(file.schema_arrow.names)
                scan.seek(ref.size - 8)
                end = scan.read(8)
                (length,) = struct.unpack("<I", end[:4])
                scan.seek(ref.size - 8 - length)
                footer = array("B", scan.read(length + 8))
            finally:
                scan.close()
        starts = array("q", [0])
        chunk_start, chunk_size = array("q"), array("q")
        leaves = (
            [meta.row_group(0).column(c).path_in_schema for c in range(meta.num_columns)] if meta.num_row_groups else []
        )
        for group in range(meta.num_row_groups):
            rg = meta.row_group(group)
            starts.append(starts[-1] + rg.num_rows)
            for c in range(rg.num_columns):
                chunk = rg.column(c)
                begin = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
                chunk_start.append(begin)
                chunk_size.append(chunk.total_compressed_size)
        return FileIndex(
            self.name,
            key_of(ref.url),
            ref.size,
            ref.stamp,
            starts[-1],
            arrays={"starts": starts, "chunk_start": chunk_start, "chunk_size": chunk_size, "footer": footer},
            strings={"columns": names, "leaves": leaves},
        )

    # -- random access ------------------------------------------------------------------------
    def _leaves(self, index: FileIndex) -> list[int]:
        """The leaf columns the selected ``columns`` read."""
        found = index.derived.get(("leaves", self.columns))
        if found is None:
            leaves = index.strings["leaves"]
            if self.columns is None:
                found = list(range(len(leaves)))
            else:
                found = [
                    k
                    for k, path in enumerate(leaves)
                    if any(path == c or path.startswith(c + ".") for c in self.columns)
                ]
            index.derived[("leaves", self.columns)] = found
        return found

    def _group(self, index: FileIndex, i: int) -> int:
        return bisect.bisect_right(index.arrays["starts"], i) - 1

    def spans(self, index: FileIndex, i: int) -> list[tuple[int, int]]:
        """Row ``i``: the column chunks of its row group (the selected columns)."""
        group = self._group(index, i)
        width = len(index.strings["leaves"])
        starts, sizes = index.arrays["chunk_start"], index.arrays["chunk_size"]
        return [
            (starts[group * width + k], starts[group * width + k] + sizes[group * width + k])
            for k in self._leaves(index)
        ]

    def parse(self, handle: Any, index: FileIndex, i: int, ref: FileRef, views: list[memoryview]) -> dict[str, Any]:
        """Row ``i``: its row group, decoded once per process while it stays in the LRU."""
        starts = index.arrays["starts"]
        group = self._group(index, i)
        cache_key = (key_of(ref.url), index.size, index.stamp, self.columns, group)
        rows = _ROW_GROUPS.get(cache_key)
        if rows is None:
            _check_columns(ref.url, index.strings["columns"], self.columns)
            pq = require_pyarrow()
            pieces = [(start, view) for (start, _), view in zip(self.spans(index, i), views, strict=True)]
            file = pq.ParquetFile(_Chunks(index.size, pieces, handle), metadata=self._metadata(index, ref))
            columns = list(self.columns) if self.columns is not None else None
            rows = file.read_row_group(group, columns=columns).to_pylist()
            with _DECODES_LOCK:
                _DECODES[0] += 1
            _ROW_GROUPS.put(cache_key, rows, weight=max(1, len(rows)))
        return dict(rows[i - starts[group]])

    def _metadata(self, index: FileIndex, ref: FileRef) -> Any:
        key = (key_of(ref.url), index.size, index.stamp)
        meta = _METADATA.get(key)
        if meta is None:
            import pyarrow as pa

            pq = require_pyarrow()
            meta = _METADATA.put(key, pq.read_metadata(pa.BufferReader(index.arrays["footer"].tobytes())))
        return meta

    def windows(self, index: FileIndex, window: int) -> Sequence[int]:
        """Shuffle windows: the row groups (each decoded once per slot that reads it)."""
        return index.arrays["starts"]

    def sample_sizes(self, index: FileIndex) -> list[int]:
        """Stored bytes per row: its row group's selected column chunks, spread
        evenly over the rows (Parquet stores no size per row)."""
        starts = index.arrays["starts"]
        out: list[int] = []
        for group in range(len(starts) - 1):
            rows = starts[group + 1] - starts[group]
            if not rows:
                continue
            total = sum(stop - start for start, stop in self.spans(index, starts[group]))
            share, extra = divmod(total, rows)
            out.extend(share + (1 if k < extra else 0) for k in range(rows))
        return out
