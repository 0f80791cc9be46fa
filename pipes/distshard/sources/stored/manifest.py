"""The stored index: per-file entries and a manifest, written once beside the data.

``python -m distshard index URLS`` (see :mod:`.indexing`) writes, by default into
a ``.distshard/`` folder beside the first file (or where ``--out`` says: a local
folder or any fsspec URL):

- the files' entries, packed a few thousand to an object
  (``entries-<build>-<n>.pack``, see :mod:`.packs`): each the same bytes as an
  entry of the per-machine cache (:mod:`.index`: identity, count, arrays,
  checksums), so an entry is checked against the identity it is loaded for;
- ``manifest.json``: ``{"format": "distshard-index", "version": 2, "root",
  "packs": [name, ...], "files": [{"url", "format", "count", "size", "stamp",
  "pack", "at", "len"}, ...]}``, where ``root`` is the folder it was written for
  (read elsewhere, a copy: see :meth:`Stored.moved_from`; entries are then
  matched by size and a stamp that identifies the bytes, an S3 ETag, and
  otherwise not used), ``stamp`` is the file's version when it was
  indexed (a strong or weak ETag, an S3 ETag, a generation, an mtime), ``url``
  is relative to the folder that holds ``.distshard/`` when the file is in it,
  and ``pack``, ``at``, ``len`` say where its entry is (an index into
  ``packs``, the byte offset and length).

Version 1 (one object per entry: ``"entry": name`` instead of ``pack``, ``at``,
``len``) is still read, and a version 2 manifest may list such entries (files
an earlier build indexed and a later one kept).

A source finds the manifest by itself (one request: ``.distshard/manifest.json``
beside its first file) or through ``index=``. Then a job asks no metadata per
file: counts and identities come from the manifest, every range response is
checked against them (:mod:`.remote`), and a slot fetches the entries of the
files it reads only, those of the next files it reads in the same request
(:mod:`.packs`; then the per-machine cache).
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from ...digests import blake2b_hex
from ...errors import SourceDataError, SourceMissingError
from ..transport.files import DEFAULT_FILE_ACCESS, FileAccess, FileRef, key_of, local_path
from ..transport.responses import MissingBucketError, index_command
from ..transport.urls import is_remote

if TYPE_CHECKING:
    from ..formats.file_index import FileIndex
    from .entry_packs import PackedEntries

__all__ = ["FOLDER", "MANIFEST", "Stored", "StoredFile", "default_location", "find", "load"]

log = logging.getLogger("distshard")

FOLDER = ".distshard"
MANIFEST = "manifest.json"
FORMAT = "distshard-index"
VERSION = 2
READS = (1, 2)  # manifest versions this distshard reads


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


def default_location(urls: Iterable[str]) -> str:
    """``.distshard/`` beside the first file."""
    return join(parent(next(iter(urls))), FOLDER)


def entry_name(fmt: str, name: str) -> str:
    """The entry of the file ``name`` (as the manifest lists it) in format ``fmt``."""
    digest = blake2b_hex(f"{fmt}\0{name}".encode("utf-8", "surrogatepass"), 8)
    base = re.sub(r"[^A-Za-z0-9._-]", "_", name.rstrip("/").rsplit("/", 1)[-1])[-60:]
    return f"{base}.{fmt}.{digest}.idx"


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


def resolve(location: str, name: str) -> str:
    """The URL or path of a file the manifest at ``location`` lists as ``name``."""
    if is_remote(name) or os.path.isabs(name):
        return name
    return join(parent(location), name)


def read(url: str, access: FileAccess = DEFAULT_FILE_ACCESS) -> bytes:
    """A small file in one request (remote: a GET, no metadata request);
    ``FileNotFoundError`` if it is not there."""
    if is_remote(url):
        return access.client(url).fetch(url, access.options)
    with open(local_path(url), "rb") as f:
        return f.read()


def write(url: str, data: bytes, access: FileAccess = DEFAULT_FILE_ACCESS) -> None:
    """Write a small file whole (locally atomically)."""
    if is_remote(url):
        access.client(url).put(url, data)
        return
    from pathlib import Path

    from ..formats.index_cache import write_entry

    if not write_entry(Path(local_path(url)), data):
        raise PermissionError(f"cannot write {url}: give --out a folder you can write")


def dumps(location: str, files: list[StoredFile]) -> bytes:
    """The manifest at ``location`` listing ``files`` (entries packed or of their own)."""
    from .entry_packs import entry_range

    packs: dict[str, int] = {}
    listed = []
    for f in files:
        item: dict[str, Any] = {
            "url": listed_name(location, f.url),
            "format": f.format,
            "count": f.count,
            "size": f.size,
            "stamp": f.stamp,
        }
        packed = entry_range(f.entry)
        if packed is None:
            item["entry"] = posixpath.basename(f.entry)
        else:
            pack, start, stop = packed
            item.update(pack=packs.setdefault(posixpath.basename(pack), len(packs)), at=start, len=stop - start)
        listed.append(item)
    head = {"format": FORMAT, "version": VERSION, "root": parent(location), "packs": list(packs)}
    return (
        json.dumps({**head, "files": listed}, separators=(",", ":")).replace('},{"url"', '},\n{"url"').encode("utf-8")
    )


def parse(location: str, data: bytes) -> Stored:
    """The manifest's files; ``ValueError`` naming ``location`` if it is not one."""
    from .entry_packs import pack_entry

    where = join(location, MANIFEST)
    try:
        raw: Any = json.loads(data.decode("utf-8"))
    except ValueError as exc:
        raise SourceDataError(f"{where}: not a distshard index manifest (not JSON: {exc})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise SourceDataError(f'{where}: not a distshard index manifest (no "format": "{FORMAT}")')
    if raw.get("version") not in READS:
        raise SourceDataError(
            f"{where}: manifest version {raw.get('version')!r}, this distshard reads "
            f"{' and '.join(map(str, READS))}: rebuild it with {index_command(location)}"
        )
    packs = raw.get("packs") or []
    files: dict[str, StoredFile] = {}
    relative = False
    for position, item in enumerate(raw.get("files") or []):
        try:
            name = str(item["url"])
            relative = relative or not (is_remote(name) or os.path.isabs(name))
            url = resolve(location, name)
            if "entry" in item:
                entry = join(location, posixpath.basename(str(item["entry"])))
            else:
                pack = join(location, posixpath.basename(str(packs[_count(item["pack"])])))
                at = _count(item["at"])
                entry = pack_entry(pack, at, at + _count(item["len"]))
            stored = StoredFile(
                url, str(item["format"]), _count(item["count"]), _count(item["size"]), str(item["stamp"]), entry
            )
        except (KeyError, TypeError, ValueError, IndexError):
            raise SourceDataError(f"{where}: files[{position}] is malformed: {item!r}") from None
        files[key_of(url)] = stored
    root = raw.get("root")
    return Stored(location, files, root if isinstance(root, str) else None, relative)


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(value)
    return value


def location_of(index: str) -> str:
    """The folder of a stored index given as its folder or its ``manifest.json``."""
    text = index.rstrip("/")
    return parent(text) if text.endswith("/" + MANIFEST) or text == MANIFEST else text


def load(location: str, access: FileAccess = DEFAULT_FILE_ACCESS) -> Stored | None:
    """The stored index at ``location`` (one request), or ``None`` if there is none
    (a missing bucket raises: nothing can be stored there)."""
    try:
        data = read(join(location, MANIFEST), access)
    except MissingBucketError:
        raise
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    return parse(location, data)


def find(urls: list[str], access: FileAccess = DEFAULT_FILE_ACCESS) -> Stored | None:
    """The stored index beside the first of ``urls`` (one request), or ``None``.
    A store that refuses the request (no permission) counts as none."""
    if not urls or "?" in urls[0]:  # (a signed URL: nothing is beside it)
        return None
    location = default_location(urls)
    try:
        data = read(join(location, MANIFEST), access)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    except (OSError, ValueError) as exc:  # denied, or a store that answers oddly: as before, without it
        log.info("no stored index readable at %s (%s: %s)", location, type(exc).__name__, exc)
        return None
    return parse(location, data)


def known_files(
    fmt: str, urls: list[str], location: str | None, access: FileAccess = DEFAULT_FILE_ACCESS
) -> tuple[Stored | None, dict[str, tuple[FileRef, int]]]:
    """The stored index (at ``location``, else beside the first file: one
    request) and ``{url: (ref, count)}`` for the ``urls`` it lists in format
    ``fmt``; each ref carries its identity and its entry (``ref.stored``)."""
    if not urls:
        return None, {}
    stored = load(location, access) if location is not None else find(urls, access)
    if location is not None and stored is None:
        raise SourceMissingError(f"no stored index at {location} ({join(location, MANIFEST)} is not there)")
    found: dict[str, tuple[FileRef, int]] = {}
    if stored is not None:
        for url in urls:
            item = stored.get(url)
            if item is not None and item.format == fmt:
                found[url] = (FileRef(url, item.size, item.stamp, item.entry), item.count)
    return stored, found


def fetch_entry(
    fmt: str,
    ref: FileRef,
    access: FileAccess = DEFAULT_FILE_ACCESS,
    packed: PackedEntries | None = None,
    kept: Mapping[str, bytes] | None = None,
) -> FileIndex | None:
    """``ref``'s index from its stored entry, or ``None`` if the entry is not
    there or not of that identity (the file is then indexed itself). An entry in
    ``kept`` (fetched by the rank before its workers started) takes no request; a
    packed one comes with its chunk (``packed``'s, less the entries kept; see
    :mod:`.packs`): fetched already, on its way, or in one range request now.
    Either way it is checked against ``ref`` when loaded."""
    from ..formats.index_cache import loads
    from .entry_packs import entry_range, fetch_packed

    assert ref.stored is not None
    kept = kept or {}
    try:
        if ref.stored in kept:
            data = kept[ref.stored]
        elif entry_range(ref.stored) is None:
            data = read(ref.stored, access)
        else:
            data = fetch_packed(ref.stored, packed, access, kept)
    except FileNotFoundError:
        log.info("the stored index entry %s is not there: indexing %s itself", ref.stored, ref.url)
        return None
    index = loads(data, fmt, ref)
    if index is not None:
        return index
    moved = loads(data, fmt, ref, moved=True)  # of this size and stamp, written for another URL
    if moved is None:
        log.info("the stored index entry %s is not %s's (another version?): indexing it itself", ref.stored, ref.url)
        return None
    if identifies_content(ref.url, ref.stamp or ""):
        return moved
    warn_moved(ref.stored.split("#", 1)[0].rsplit("/", 1)[0], None)
    return None


_WARNED: set[str] = set()  # stored indexes found moved, warned about once per process


def warn_moved(location: str, root: str | None) -> None:
    """The WARNING of :func:`moved_words`, once per process and stored index."""
    if location not in _WARNED:
        _WARNED.add(location)
        log.warning(moved_words(location, root))


def moved_words(location: str, root: str | None) -> str:
    """What a moved stored index whose entries cannot serve the files means
    (``root``: where it was written for, if the manifest says)."""
    where = f"the files at {root}" if root else "files at another place"
    return (
        f"the stored index at {location} was written for {where} (a copy of the dataset?): its "
        "entries name those files, and these files' stamps (mtimes, HTTP ETags) do not identify their bytes, "
        f"so each job indexes them itself; `python -m distshard index {location}` rebuilds it for them"
    )
