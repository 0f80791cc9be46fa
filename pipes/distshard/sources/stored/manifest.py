"""The stored index: per-file entries and a manifest, written once beside the data.

``python -m distshard index URLS`` (see :mod:`.indexing`) writes, by default into
a ``.distshard/`` folder beside the first file (or where ``--out`` says: a local
folder or any fsspec URL):

- the files' entries, packed a few thousand to an object
  (``entries-<build>-<n>.pack``, see :mod:`.entry_packs`): each the same bytes as an
  entry of the per-machine cache (:mod:`.index_cache`: identity, count, arrays,
  checksums), so an entry is checked against the identity it is loaded for;
- ``manifest.json``, of format version 3 (:mod:`.manifest3`: a small head, the
  columns every rank reads, pages of files read as a slot reaches them, all in
  the one object for a small dataset; :mod:`.paged` reads it). Version 2, which
  :func:`dumps` writes and which is still read (``python -m distshard index
  PATH/.distshard`` upgrades it in place), lists every file in it:
  ``{"format": "distshard-index", "version": 2, "root",
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
(:mod:`.entry_packs`; then the per-machine cache).
"""

from __future__ import annotations

import json
import logging
import posixpath
import re
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from ...digests import blake2b_hex
from ...errors import SourceDataError, SourceMissingError
from ..transport.files import DEFAULT_FILE_ACCESS, FileAccess, FileRef, key_of, local_path
from ..transport.responses import READ_ONLY, MissingBucketError, index_command
from ..transport.urls import first_remote, is_remote
from .manifest3 import (
    MANIFEST,
    Encoded,
    Stored,
    StoredFile,
    encode,
    identifies_content,
    is_relative,
    join,
    listed_name,
    parent,
    read,
    resolve,
)
from .paged import Stored3, StoredSummary

if TYPE_CHECKING:
    from ..formats.file_index import FileIndex
    from .entry_packs import PackedEntries

__all__ = [
    "FOLDER",
    "MANIFEST",
    "Stored",
    "StoredFile",
    "default_location",
    "encode3",
    "find",
    "identifies_content",
    "join",
    "listed_name",
    "load",
    "parent",
    "read",
    "resolve",
    "source_files",
]

log = logging.getLogger("distshard")

FOLDER = ".distshard"
FORMAT = "distshard-index"
VERSION = 3  # what the command writes (:mod:`.manifest3`); :func:`dumps` writes version 2
READS = (1, 2, 3)  # manifest versions this distshard reads


def default_location(urls: Iterable[str]) -> str:
    """``.distshard/`` beside the first file."""
    return join(parent(next(iter(urls))), FOLDER)


def entry_name(fmt: str, name: str) -> str:
    """The entry of the file ``name`` (as the manifest lists it) in format ``fmt``."""
    digest = blake2b_hex(f"{fmt}\0{name}".encode("utf-8", "surrogatepass"), 8)
    base = re.sub(r"[^A-Za-z0-9._-]", "_", name.rstrip("/").rsplit("/", 1)[-1])[-60:]
    return f"{base}.{fmt}.{digest}.idx"


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
    """The version 2 manifest at ``location`` listing ``files`` (entries packed or of their own)."""
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
    head = {"format": FORMAT, "version": 2, "root": parent(location), "packs": list(packs)}
    return (
        json.dumps({**head, "files": listed}, separators=(",", ":")).replace('},{"url"', '},\n{"url"').encode("utf-8")
    )


def encode3(location: str, files: Sequence[StoredFile], build: str) -> Encoded:
    """The version 3 manifest at ``location`` listing ``files`` (:mod:`.manifest3`;
    ``build`` names the objects beside it)."""
    from .entry_packs import entry_range

    packs: dict[str, int] = {}
    records: list[tuple[Any, ...]] = []
    for f in files:
        name = listed_name(location, f.url)
        packed = entry_range(f.entry)
        if packed is None:
            records.append((name, f.stamp, posixpath.basename(f.entry)))
        else:
            pack, start, stop = packed
            records.append((name, f.stamp, packs.setdefault(posixpath.basename(pack), len(packs)), start, stop - start))
    return encode(parent(location), build, files, records, list(packs))


def parse(location: str, data: bytes, access: FileAccess = DEFAULT_FILE_ACCESS) -> Stored:
    """The manifest's files (version 3: read lazily, :mod:`.paged`); ``ValueError``
    naming ``location`` if it is not one."""
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
    if raw["version"] == 3:
        from .manifest3 import check_head
        from .paged import Stored3

        check_head(where, raw)
        return Stored3(location, raw, access)
    packs = raw.get("packs") or []
    files: dict[str, StoredFile] = {}
    relative = False
    for position, item in enumerate(raw.get("files") or []):
        try:
            name = str(item["url"])
            relative = relative or is_relative(name)
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


def listing(location: str, access: FileAccess = DEFAULT_FILE_ACCESS) -> dict[str, Any]:
    """The manifest at ``location`` as version 2 spells it, whatever its version (a
    version 3 one with every file listed in ``"files"``, its head's other keys
    kept): what a tool or a test reads of it."""
    raw: dict[str, Any] = json.loads(read(join(location, MANIFEST), access))
    if raw.get("version") != 3:
        return raw
    from .paged import opened

    index = opened(location, raw, access)
    columns = index.columns()
    files: list[dict[str, Any]] = []
    for k in range(int(raw["pages"]["count"])):
        for record in index.records(k):
            f = len(files)
            item: dict[str, Any] = {"url": record[0], "format": index.format_of(f), "count": columns["count"][f]}
            item.update(size=columns["size"][f], stamp=record[1])
            if len(record) == 3:
                item["entry"] = record[2]
            else:
                item.update(pack=record[2], at=record[3], len=record[4])
            files.append(item)
    return {**raw, "files": files}


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
    return parse(location, data, access)


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
    return parse(location, data, access)


def source_files(
    fmt: str,
    urls: Sequence[str],
    declared: Mapping[str, int],
    location: str | None,
    access: FileAccess = DEFAULT_FILE_ACCESS,
) -> tuple[Stored | None, dict[str, tuple[FileRef, int]], StoredSummary | None]:
    """What a source over ``urls`` in format ``fmt`` takes from the stored index (at
    ``location``, else beside the first file: one request): ``(index, {url: (ref,
    count)} for the files it lists, None)``, each ref carrying its identity and its
    entry (``ref.stored``); or, when ``urls`` are exactly the files of a version 3
    index (and none is counted by a shard index, ``declared``: by ``key_of``),
    ``(index, {}, its lazy summary)``: no page fetched, no call per file."""
    wanted = [url for url in urls if key_of(url) not in declared] if declared else urls
    if not wanted:
        return None, {}, None
    stored = load(location, access) if location is not None else find(list(wanted[:1]), access)
    if location is not None and stored is None:
        raise SourceMissingError(f"no stored index at {location} ({join(location, MANIFEST)} is not there)")
    if stored is None:
        return None, {}, None
    if not stored.entries_usable():
        warn_moved(stored.location, stored.moved_from)
    whole = stored.summary(fmt, urls) if isinstance(stored, Stored3) and not declared else None
    if whole is not None:
        return stored, {}, whole
    found: dict[str, tuple[FileRef, int]] = {}
    for url in wanted:
        item = stored.get(url)
        if item is not None and item.format == fmt:
            found[url] = (FileRef(url, item.size, item.stamp, item.entry), item.count)
    return stored, found, None


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
    :mod:`.entry_packs`): fetched already, on its way, or in one range request now.
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


def stored_hint(stored: Stored | None, indexed_here: int, urls: Sequence[str], location: str | None) -> str | None:
    """What would make a source's next start fast, when it indexed ``indexed_here``
    of its files itself (``None`` otherwise; the per-machine cache is enough for
    local files)."""
    if not indexed_here or first_remote(urls) is None:
        return None
    if stored is not None:
        return (
            f"the stored index at {stored.location} lacks {indexed_here} of these files; "
            f"to add them: {index_command(stored.location, refresh=False)}"
        )
    where = location or default_location(urls)
    if where.split("://", 1)[0].lower() in READ_ONLY:  # (nothing can be written beside the files)
        return f"no stored index at {where}: {index_command(where, refresh=False)} would make the next start fast"
    return f"no stored index at {where}: `python -m distshard index URLS` would make the next start fast"


def moved_describe(stored: Stored) -> str:
    """What ``describe()`` says of a stored index read elsewhere than it was written for."""
    if stored.moved_from is None:
        return ""
    if stored.entries_usable():
        return f" (written for {stored.moved_from}: its entries matched by size and S3 ETag)"
    return f", but {moved_words(stored.location, stored.moved_from)}"
