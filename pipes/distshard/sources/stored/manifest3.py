"""The stored index's manifest, format version 3: a small head, binary columns, pages.

Version 2 (:mod:`.manifest`) lists every file in ``manifest.json``: 155 bytes a
file of JSON that every rank fetched and parsed whole (198 MB at 10^6 files).
Version 3 splits it by who needs what:

- ``manifest.json``, the **head** (a few hundred bytes): ``{"format":
  "distshard-index", "version": 3, "root", "files": n, "samples", "names"`` (the
  dataset's identity: a digest of the files' names in order, as listed),
  ``"urls"`` (a digest of their URLs in order, as resolved where it was written:
  a source listing exactly these files maps file k to file k without a page),
  ``"pattern"`` (the one-range brace pattern that names exactly those URLs, or
  ``null``: a source given that pattern matches without making its URLs),
  ``"formats"``, ``"packs"``, ``"relative"`` / ``"absolute"`` (whether some names
  are relative to the root / absolute), ``"md5_stamps"`` (every stamp an S3
  MD5 ETag), ``"remote"`` (every file remote, ``true``, or local, ``false``;
  ``null`` when mixed), ``"first_names"`` (the first 8 names: what a checkpoint's
  identity of the source reads), ``"page_size"``, ``"columns"`` and ``"pages"``;
- the **columns** (``columns-<build>.bin``, fetched whole by every rank): what
  every rank needs of every file to lay out an epoch, fixed-width little-endian
  arrays of a few bytes a file, described in the head (``"columns": {"object",
  "bytes", "blake2b", "fields": [{"name", "type", "at", "n"}, ...]}``, ``type``
  ``u1`` / ``u2`` / ``u4`` / ``u8``, the narrowest that holds the column):
  ``count`` (samples), ``size`` (bytes), ``format`` (an index into
  ``"formats"``, only when there are several), and the page table: ``page_at``
  (each page's byte offset in the pages object, and its end) and ``page_crc``
  (each page's CRC-32);
- the **pages** (``pages-<build>.bin``, one range request each): what only the
  files a slot reads need, :data:`PAGE_SIZE` files a page, each page the UTF-8
  JSON ``{"first": k, "files": [[name, stamp, pack, at, len] | [name, stamp,
  entry], ...]}`` (``pack`` an index into ``"packs"``; a file with an entry of its
  own, from version 1, names it).

A manifest whose whole (head, columns and pages) is at most :data:`INLINE_BYTES`
keeps it in the one object: ``"columns": {"data": base64, ...}`` and ``"pages":
{"data": [page, ...]}``, so a small dataset still costs one request.

This module is the format alone (and how a manifest names files: :func:`listed_name`,
:func:`resolve`); :mod:`.paged` reads it lazily, :mod:`.manifest` dispatches on
the version.
"""

from __future__ import annotations

import base64
import json
import os
import posixpath
import re
import sys
import zlib
from array import array
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from ...digests import blake2b_hex
from ...errors import SourceDataError
from ..transport.brace_list import pattern_of
from ..transport.files import DEFAULT_FILE_ACCESS, FileAccess, key_of, local_path
from ..transport.urls import is_remote

__all__ = [
    "INLINE_BYTES",
    "PAGE_SIZE",
    "Encoded",
    "Record",
    "Stored",
    "StoredFile",
    "decode_columns",
    "decode_page",
    "encode",
    "names_digest",
]

FORMAT = "distshard-index"
MANIFEST = "manifest.json"
VERSION = 3
PAGE_SIZE = 512  # files a page
INLINE_BYTES = 256 << 10  # a manifest at most this big keeps its columns and pages inline
_TYPES = {1: "B", 2: "H", 4: "I", 8: "Q"}  # bytes -> array typecode (unsigned)
for _width, _code in _TYPES.items():
    assert array(_code).itemsize == _width, (_width, _code)  # (the platforms torch runs on)


@dataclass(frozen=True)
class StoredFile:
    """One file of a stored index: its URL, format, count, identity and entry's URL."""

    url: str
    format: str
    count: int
    size: int
    stamp: str
    entry: str


@dataclass(frozen=True)
class Stored:
    """A stored index: where it is, its files by :func:`.files.key_of`, and the
    folder its manifest was written for (``root``; ``None`` from a manifest that
    does not say)."""

    location: str
    files: Mapping[str, StoredFile]
    root: str | None = None
    relative: bool = False  # some files are named relative to the root (so they move with it)

    def get(self, url: str) -> StoredFile | None:
        return self.files.get(key_of(url))

    @property
    def moved_from(self) -> str | None:
        """The folder the index was written for when it is read elsewhere now (a
        dataset copied with its ``.distshard/``): its entries name the files there."""
        if not self.relative or self.root is None or self.root == parent(self.location):
            return None  # (files named by their URLs or absolute paths are where they were)
        return self.root

    def entries_usable(self) -> bool:
        """Whether the entries serve the files where they are now: not moved, or
        every file's stamp identifies its bytes (:func:`identifies_content`)."""
        return self.moved_from is None or all(identifies_content(f.url, f.stamp) for f in self.files.values())


_S3_MD5 = re.compile(r'^"[0-9a-f]{32}(-[0-9]+)?"$')


def identifies_content(url: str, stamp: str) -> bool:
    """Whether ``stamp`` names the bytes themselves, so that an entry written for a
    file at one URL serves a file of the same size and stamp at another: an S3
    ETag (the MD5 of the bytes, or of the parts' MD5s and their count; a copy has
    the same). Not an mtime (a copy may keep it with other bytes), an HTTP ETag (a
    server may make it of the mtime and size) or a generation (a counter)."""
    return url.startswith(("s3://", "s3a://")) and _S3_MD5.match(stamp) is not None


def md5_stamp(stamp: str) -> bool:
    """Whether ``stamp`` has the form of an S3 MD5 ETag (see :func:`identifies_content`)."""
    return _S3_MD5.match(stamp) is not None


def join(location: str, name: str) -> str:
    """``name`` inside the folder ``location`` (a URL or a local path)."""
    if is_remote(location):
        return location.rstrip("/") + "/" + name
    return os.path.join(location, name)


def parent(url: str) -> str:
    """The folder a file or folder is in."""
    if is_remote(url):
        return posixpath.dirname(url.rstrip("/"))
    return os.path.dirname(os.path.abspath(local_path(url)))


def listed_name(location: str, url: str) -> str:
    """How the manifest at ``location`` names ``url``: relative to the folder that
    holds ``location`` when the file is in it, else the URL or absolute path."""
    root = parent(location)
    if is_remote(url) != is_remote(root):
        return url
    if is_remote(url):
        return url[len(root) + 1 :] if url.startswith(root.rstrip("/") + "/") else url
    path = os.path.abspath(local_path(url))
    relative = os.path.relpath(path, root)
    return path if relative.startswith("..") else relative.replace(os.sep, "/")


def is_relative(name: str) -> bool:
    """Whether a listed name is relative to the root (else a URL or an absolute path)."""
    return not (is_remote(name) or os.path.isabs(name))


def resolve(location: str, name: str) -> str:
    """The URL or path of a file the manifest at ``location`` lists as ``name``."""
    if not is_relative(name):
        return name
    return join(parent(location), name)


def read(url: str, access: FileAccess = DEFAULT_FILE_ACCESS) -> bytes:
    """A small file in one request (remote: a GET, no metadata request);
    ``FileNotFoundError`` if it is not there."""
    if is_remote(url):
        return access.client(url).fetch(url, access.options)
    with open(local_path(url), "rb") as f:
        return f.read()


def names_digest(names: Iterable[str]) -> str:
    """The dataset's identity in a version 3 head: the files' names, in order, as listed."""
    return blake2b_hex("\n".join(names).encode("utf-8", "surrogatepass"), 16)


Record = tuple  # a page's file: (name, stamp, pack, at, len) or (name, stamp, entry)


@dataclass(frozen=True)
class Encoded:
    """A version 3 manifest as written: the head's bytes and the objects beside it
    (``{name: bytes}``: the columns and the pages; none when inline)."""

    head: bytes
    objects: dict[str, bytes]


def _narrowest(values: Sequence[int]) -> int:
    top = max(values, default=0)
    return next(width for width in (1, 2, 4, 8) if top < 1 << (8 * width))


def _column(values: Sequence[int]) -> tuple[str, bytes]:
    width = _narrowest(values)
    data = array(_TYPES[width], values)
    if sys.byteorder != "little":
        data.byteswap()
    return f"u{width}", data.tobytes()


def _pages(records: Sequence[Record]) -> list[bytes]:
    out = []
    for first in range(0, len(records), PAGE_SIZE):
        page = {"first": first, "files": [list(r) for r in records[first : first + PAGE_SIZE]]}
        out.append(json.dumps(page, separators=(",", ":")).encode("utf-8", "surrogatepass"))
    return out


def encode(root: str, build: str, files: Sequence[StoredFile], records: Sequence[Record], packs: list[str]) -> Encoded:
    """The version 3 manifest of ``files`` (``records``: each file's page record,
    names as listed; ``root``: the folder the names are relative to; ``build``:
    what names the objects beside it)."""
    formats = list(dict.fromkeys(f.format for f in files))
    pages = _pages(records)
    at = [0]
    for page in pages:
        at.append(at[-1] + len(page))
    columns: dict[str, Sequence[int]] = {"count": [f.count for f in files], "size": [f.size for f in files]}
    if len(formats) > 1:
        columns["format"] = [formats.index(f.format) for f in files]
    columns["page_at"], columns["page_crc"] = at, [zlib.crc32(page) for page in pages]
    fields, blobs, offset = [], [], 0
    for name, values in columns.items():
        kind, data = _column(values)
        fields.append({"name": name, "type": kind, "at": offset, "n": len(values)})
        blobs.append(data)
        offset += len(data)
    column_bytes = b"".join(blobs)
    names = [r[0] for r in records]
    head: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "root": root,
        "files": len(files),
        "samples": sum(f.count for f in files),
        "names": names_digest(names),
        "urls": names_digest(f.url for f in files),
        "pattern": pattern_of([f.url for f in files]),
        "formats": formats,
        "packs": packs,
        "relative": any(is_relative(n) for n in names),
        "absolute": not all(is_relative(n) for n in names),
        "md5_stamps": all(md5_stamp(f.stamp) for f in files),
        "remote": _one_kind([is_remote(f.url) for f in files]),
        "first_names": names[:8],
        "page_size": PAGE_SIZE,
        "columns": {"bytes": len(column_bytes), "blake2b": blake2b_hex(column_bytes, 16), "fields": fields},
        "pages": {"count": len(pages), "bytes": at[-1]},
    }
    if len(column_bytes) + at[-1] + 1024 <= INLINE_BYTES:
        head["columns"]["data"] = base64.b64encode(column_bytes).decode("ascii")
        head["pages"]["data"] = [json.loads(page) for page in pages]
        return Encoded(_dumps(head), {})
    head["columns"]["object"] = f"columns-{build}.bin"
    head["pages"]["object"] = f"pages-{build}.bin"
    return Encoded(_dumps(head), {head["columns"]["object"]: column_bytes, head["pages"]["object"]: b"".join(pages)})


def _one_kind(flags: list[bool]) -> bool | None:
    """The one value of ``flags`` (``None`` when they differ)."""
    return flags[0] if flags and all(x == flags[0] for x in flags) else (None if flags else False)


def _dumps(head: Mapping[str, Any]) -> bytes:
    return json.dumps(head, separators=(",", ":")).encode("utf-8", "surrogatepass")


def check_head(where: str, head: Mapping[str, Any]) -> None:
    """``SourceDataError`` naming ``where`` unless ``head`` is a well-formed version 3 head."""
    try:
        ok = (
            all(isinstance(head[k], int) and head[k] >= 0 for k in ("files", "samples", "page_size"))
            and head["page_size"] > 0
            and isinstance(head["names"], str)
            and all(isinstance(x, str) for x in head["formats"])
            and all(isinstance(x, str) for x in head["packs"])
            and isinstance(head["columns"]["fields"], list)
            and isinstance(head["pages"]["count"], int)
        )
    except (KeyError, TypeError):
        ok = False
    if not ok:
        raise SourceDataError(f"{where}: a version 3 manifest whose head is malformed: rebuild it")


def decode_columns(where: str, head: Mapping[str, Any], data: bytes) -> dict[str, array]:
    """The columns of ``head`` from their bytes (``data``), checked against the head."""
    columns = head["columns"]
    if len(data) != columns["bytes"] or blake2b_hex(data, 16) != columns["blake2b"]:
        raise SourceDataError(f"{where}: not the columns its manifest names (another build?): rebuild the index")
    out: dict[str, array] = {}
    for field in columns["fields"]:
        width = int(str(field["type"])[1:])
        start, n = int(field["at"]), int(field["n"])
        values = array(_TYPES[width])
        values.frombytes(data[start : start + n * width])
        if sys.byteorder != "little":
            values.byteswap()
        if len(values) != n:
            raise SourceDataError(f"{where}: the column {field['name']!r} is cut short: rebuild the index")
        out[str(field["name"])] = values
    return out


def decode_page(where: str, k: int, data: bytes, crc: int, page_size: int, files: int) -> list[Record]:
    """Page ``k``'s records from its bytes, checked (its CRC-32, its first file, its length)."""
    try:
        if zlib.crc32(data) != crc:
            raise ValueError("CRC-32")
        page = json.loads(data.decode("utf-8", "surrogatepass"))
    except ValueError as exc:
        raise SourceDataError(f"{where}: page {k} is malformed ({exc}): rebuild the index") from None
    return checked_page(where, k, page, page_size, files)


def checked_page(where: str, k: int, page: Any, page_size: int, files: int) -> list[Record]:
    """Page ``k``'s records from its JSON value, checked (its first file, its length, each record)."""
    try:
        return _records(page, k, page_size, files)
    except (ValueError, TypeError, KeyError) as exc:
        raise SourceDataError(f"{where}: page {k} is malformed ({exc}): rebuild the index") from None


def _records(page: Any, k: int, page_size: int, files: int) -> list[Record]:
    records = page["files"]
    if page["first"] != k * page_size or len(records) != min(page_size, files - k * page_size):
        raise ValueError("not the page its place names")
    out = []
    for r in records:
        strings = 3 if isinstance(r, list) and len(r) == 3 else 2  # (name, stamp[, entry])
        if not isinstance(r, list) or len(r) not in (3, 5) or not all(isinstance(x, str) for x in r[:strings]):
            raise ValueError(f"record {r!r}")
        if len(r) == 5 and not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in r[2:]):
            raise ValueError(f"record {r!r}")
        out.append(tuple(r))
    return out
