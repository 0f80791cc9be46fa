"""Parquet: one dict per row (``pyarrow``, an optional extra).

The index is the footer's row-group row counts (no data read). Reading row
``i`` decodes its row group (only the selected ``columns``) and keeps the last
few decoded row groups of the process in a small LRU, so neighbouring rows cost
nothing more; the granularity of random access is the row group.
"""

from __future__ import annotations

import bisect
import os
from array import array
from typing import Any, Iterator, Sequence

from ._lru import LRU
from .files import FileRef, check_identity, key_of, local_path, open_walk
from .index import FileIndex
from .urls import is_remote

__all__ = ["ParquetFormat", "require_pyarrow"]

_ROW_GROUPS: LRU[list] = LRU(max_items=4, max_weight=1 << 20)


def require_pyarrow() -> Any:
    """``pyarrow.parquet``, or an ``ImportError`` that says how to install it."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            "distshard.parquet() needs pyarrow: `pip install distshard[parquet]` (or `pip install pyarrow`)"
        ) from None
    return pq


class ParquetHandle:
    """An open Parquet file; decoding a row group first checks that the file
    is still the one that was indexed."""

    def __init__(self, ref: FileRef) -> None:
        pq = require_pyarrow()
        self.ref = ref
        self.raw = open_walk(ref)  # checked against ref's identity at open
        try:
            self.file = pq.ParquetFile(self.raw)
        except Exception as exc:
            self.raw.close()
            raise ValueError(f"{ref.url}: not a readable Parquet file: {exc}") from None

    def check(self) -> None:
        if is_remote(self.ref.url):
            return  # checked at open: one metadata request per handle, not per read
        st = os.fstat(self.raw.fileno())
        check_identity(self.ref, st.st_size, str(st.st_mtime_ns))

    def close(self) -> None:
        self.raw.close()

    def __del__(self) -> None:
        raw = getattr(self, "raw", None)
        if raw is not None:
            raw.close()


def _check_columns(url: str, names: Sequence[str], columns: Sequence[str] | None) -> None:
    missing = [c for c in columns or () if c not in names]
    if missing:
        raise ValueError(f"{url}: no column {missing[0]!r} (columns: {', '.join(names)})")


class ParquetFormat:
    """The ``parquet`` format; ``columns`` selects the columns of every row."""

    name = "parquet"
    file_kind = "Parquet file"
    access = "random access by row group (decoded row groups kept in a small LRU)"

    def __init__(self, columns: Sequence[str] | None = None) -> None:
        if columns is not None:
            if isinstance(columns, str) or not all(isinstance(c, str) for c in columns):
                raise TypeError(f"columns must be a list of column names, got {columns!r}")
            columns = tuple(columns)
        self.columns = columns

    def compression(self, url: str) -> str | None:
        return None  # Parquet compresses inside the file: row groups stay addressable

    def stream(self, url: str) -> Iterator[dict[str, Any]]:
        """Every row of the file, in order."""
        pq = require_pyarrow()
        if is_remote(url):
            from .remote import open_remote_stream

            source: Any = open_remote_stream(url, 1 << 22)
        else:
            try:
                source = open(local_path(url), "rb")  # noqa: SIM115 - closed below
            except FileNotFoundError:
                raise FileNotFoundError(f"{url}: no such file (named by the source's urls)") from None
        try:
            try:
                file = pq.ParquetFile(source)
            except Exception as exc:
                raise ValueError(f"{url}: not a readable Parquet file: {exc}") from None
            columns = list(self.columns) if self.columns is not None else None
            _check_columns(url, file.schema_arrow.names, columns)
            for group in range(file.num_row_groups):
                yield from file.read_row_group(group, columns=columns).to_pylist()
        finally:
            source.close()

    def build_index(self, ref: FileRef) -> FileIndex:
        """The footer: rows per row group."""
        assert ref.size is not None and ref.stamp is not None
        handle = ParquetHandle(ref)
        try:
            meta = handle.file.metadata
            starts = array("q", [0])
            for group in range(meta.num_row_groups):
                starts.append(starts[-1] + meta.row_group(group).num_rows)
            names = list(handle.file.schema_arrow.names)
        finally:
            handle.close()
        return FileIndex(self.name, key_of(ref.url), ref.size, ref.stamp, starts[-1],
                         arrays={"starts": starts}, strings={"columns": names})

    def open(self, ref: FileRef) -> ParquetHandle:
        return ParquetHandle(ref)

    def read(self, handle: ParquetHandle, index: FileIndex, i: int, ref: FileRef) -> dict[str, Any]:
        """Row ``i``: its row group, decoded once per process while it stays in the LRU."""
        starts = index.arrays["starts"]
        group = bisect.bisect_right(starts, i) - 1
        cache_key = (key_of(ref.url), index.size, index.stamp, self.columns, group)
        rows = _ROW_GROUPS.get(cache_key)
        if rows is None:
            _check_columns(ref.url, index.strings["columns"], self.columns)
            handle.check()
            columns = list(self.columns) if self.columns is not None else None
            rows = handle.file.read_row_group(group, columns=columns).to_pylist()
            _ROW_GROUPS.put(cache_key, rows, weight=max(1, len(rows)))
        return dict(rows[i - starts[group]])
