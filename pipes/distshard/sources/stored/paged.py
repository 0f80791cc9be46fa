"""A version 3 stored index read lazily (:mod:`.manifest3`): columns once, pages as reached.

A process opens a version 3 index from its head (``manifest.json``) and fetches:

- the **columns** (one request, or none when inline) the first time a count, a
  size or the page table is needed: every rank needs them to lay out an epoch;
- a **page** (one range request of the pages object) the first time one of its
  :data:`.manifest3.PAGE_SIZE` files is looked at (its URL, stamp or entry): a
  slot fetches the pages of the files it reads only.

Both are kept once per process (:class:`Opened`, by location and build) in plain
dicts, so a forked DataLoader worker inherits what its rank fetched (the pages are
not emptied at a fork); a pickled one (spawn) is sent only the head and where the
index is: :class:`PagedRefs` and :class:`ColumnArray` pickle as ``(location, head,
access)``, and the worker fetches its own columns and pages.

:class:`StoredSummary` is what a source built over exactly the files of such an
index holds: file k is the index's file k (their URLs' digest is the head's), no
page is fetched to match them, and its parts are lazy.
"""

from __future__ import annotations

import base64
import itertools
import json
import threading
from array import array
from collections.abc import Sequence
from typing import Any, Iterator, Mapping

from ...digests import ListHead, blake2b_hex
from ...errors import SourceDataError
from ...forks import at_fork
from ..transport.brace_list import BraceList, lazy_braceexpand
from ..transport.files import FileAccess, FileRef, key_of
from ..transport.urls import is_remote
from . import manifest3
from .entry_packs import Member, PackedEntries, pack_entry, read_range
from .manifest3 import Record, Stored, StoredFile, join, parent, resolve

__all__ = ["ColumnArray", "Opened", "PagedRefs", "Stored3", "StoredSummary", "Uniform", "forget", "opened"]

_LOCK = threading.RLock()
_OPENED: dict[tuple[str, str, Any], "Opened"] = {}  # this process's open indexes, by location and build
WHOLE_BYTES = 64 << 20  # of the pages object, one request when every page is read (a refresh, a match by URL)
MAX_PAGES = 4096  # pages a process keeps (2,097,152 files' records): past it, the oldest go


def _after_fork_in_child() -> None:
    """A forked child keeps what its parent fetched; it waits for no lock of the parent's."""
    global _LOCK
    _LOCK = threading.RLock()
    for index in _OPENED.values():
        index.lock = threading.RLock()


at_fork(_after_fork_in_child)


def opened(location: str, head: Mapping[str, Any], access: FileAccess) -> "Opened":
    """The version 3 index at ``location`` with this ``head``, opened once per process."""
    from ..transport.clients import frozen

    # (by how it is read too: another source's credentials never fetch this one's pages)
    how = (access.options, frozen(access.storage_options or {}))
    key = (location, head_digest(head), how)  # (a rebuild's head names other packs, maybe the same pages)
    with _LOCK:
        found = _OPENED.get(key)
        if found is None:
            found = _OPENED[key] = Opened(location, head, access)
        return found


def head_digest(head: Mapping[str, Any]) -> str:
    """What identifies a head: all of it (its root, packs, columns and pages)."""
    return blake2b_hex(json.dumps(head, sort_keys=True, separators=(",", ":")).encode("utf-8", "surrogatepass"), 16)


class Opened:
    """One version 3 index in this process: its head, its columns once fetched,
    the pages fetched (their records and the chunks of their entries)."""

    def __init__(self, location: str, head: Mapping[str, Any], access: FileAccess) -> None:
        self.location, self.head, self.access = location, dict(head), access
        self.files = int(head["files"])
        self.page_size = int(head["page_size"])
        self.where = join(location, manifest3.MANIFEST)
        self.lock = threading.RLock()
        self._columns: dict[str, array] | None = None
        self._pages: dict[int, tuple[list[FileRef], PackedEntries]] = {}
        self.page_of_entry: dict[str, int] = {}
        self.fetched: list[int] = []  # the pages this process fetched, in order (what the tests count)

    def __reduce__(self) -> tuple[Any, ...]:  # (pickled: where it is; opened again there)
        return _reopen, (self.location, self.head, self.access)

    def columns(self) -> dict[str, array]:
        """The columns, fetched once (or decoded from the head when inline)."""
        if self._columns is None:
            with self.lock:
                if self._columns is None:
                    spec = self.head["columns"]
                    if "data" in spec:
                        data = base64.b64decode(spec["data"])
                    else:
                        data = self._read_object(spec["object"], None)
                    self._columns = manifest3.decode_columns(self.where, self.head, data)
        return self._columns

    def column(self, name: str) -> "ColumnArray":
        found = self.columns().get(name)
        if found is None:
            raise SourceDataError(f"{self.where}: no column {name!r}: rebuild the index")
        out = ColumnArray(found.typecode)
        out.frombytes(found.tobytes())
        out.source = (self.location, self.head, self.access, name)
        return out

    def _read_object(self, name: str, span: tuple[int, int] | None) -> bytes:
        url = join(self.location, str(name))
        try:
            if span is None:
                return manifest3.read(url, self.access)
            return read_range(url, span[0], span[1], self.access)
        except FileNotFoundError:
            raise SourceDataError(
                f"{url}: not there, yet {self.where} names it (pruned while a job used it?): rebuild the index"
            ) from None

    def page(self, k: int) -> tuple[list[FileRef], PackedEntries]:
        """Page ``k``'s files (``FileRef``s with their entries) and the chunks of their
        entries, fetched the first time (one range request)."""
        found = self._pages.get(k)
        if found is not None:
            return found
        with self.lock:
            found = self._pages.get(k)
            if found is None:
                found = self._pages[k] = self._load_page(k)
                self.fetched.append(k)
                if len(self._pages) > MAX_PAGES:
                    self._forget(next(iter(self._pages)))
        return found

    def _forget(self, k: int) -> None:
        refs, _ = self._pages.pop(k)
        for ref in refs:
            if ref.stored is not None:
                self.page_of_entry.pop(ref.stored, None)

    def records(self, k: int) -> list[Record]:
        """Page ``k``'s records as written (fetched now: one range request, none inline)."""
        if not 0 <= k < int(self.head["pages"]["count"]):
            raise IndexError(k)
        spec = self.head["pages"]
        if "data" in spec:
            return manifest3.checked_page(self.where, k, spec["data"][k], self.page_size, self.files)
        columns = self.columns()
        at = columns["page_at"]
        data = self._read_object(spec["object"], (at[k], at[k + 1]))
        return manifest3.decode_page(self.where, k, data, columns["page_crc"][k], self.page_size, self.files)

    def every_page(self) -> Iterator[tuple[int, list[Record]]]:
        """Every page's records, in order, fetched in requests of up to
        :data:`WHOLE_BYTES` of consecutive pages (not one a page: a refresh of 10^6
        files reads its 1,954 pages in 2), each page checked against its CRC."""
        spec = self.head["pages"]
        count = int(spec["count"])
        if "data" in spec:
            yield from ((k, self.records(k)) for k in range(count))
            return
        columns = self.columns()
        at, crc = columns["page_at"], columns["page_crc"]
        k = 0
        while k < count:
            stop = k + 1
            while stop < count and at[stop + 1] - at[k] <= WHOLE_BYTES:
                stop += 1
            data = self._read_object(spec["object"], (at[k], at[stop]))
            for p in range(k, stop):
                page = data[at[p] - at[k] : at[p + 1] - at[k]]
                yield p, manifest3.decode_page(self.where, p, page, crc[p], self.page_size, self.files)
            k = stop

    def _load_page(self, k: int) -> tuple[list[FileRef], PackedEntries]:
        records = self.records(k)
        first = k * self.page_size
        sizes = self.columns()["size"]
        refs = [self._ref(record, sizes[first + j]) for j, record in enumerate(records)]
        for ref in refs:
            if ref.stored is not None:
                self.page_of_entry[ref.stored] = k
        return refs, PackedEntries(ref.stored for ref in refs)

    def _ref(self, record: Record, size: int) -> FileRef:
        url = resolve(self.location, record[0])
        if len(record) == 3:
            return FileRef(url, size, record[1], join(self.location, str(record[2]).rsplit("/", 1)[-1]))
        packs = self.head["packs"]
        if record[2] >= len(packs):
            raise SourceDataError(f"{self.where}: a file names pack {record[2]}, of {len(packs)}: rebuild the index")
        pack = join(self.location, str(packs[record[2]]).rsplit("/", 1)[-1])
        return FileRef(url, size, record[1], pack_entry(pack, record[3], record[3] + record[4]))

    def chunk(self, entry: str) -> list[Member]:
        """``entry``'s chunk: among the entries of its page (fetched already: its file was looked at)."""
        k = self.page_of_entry.get(entry)
        found = self._pages.get(k) if k is not None else None
        return (found[1] if found is not None else PackedEntries([entry])).chunk(entry)

    def ref(self, f: int) -> FileRef:
        return self.page(f // self.page_size)[0][f % self.page_size]

    def format_of(self, f: int) -> str:
        formats = self.head["formats"]
        column = self.columns().get("format")
        return str(formats[column[f] if column is not None else 0])

    def stored_files(self) -> dict[str, StoredFile]:
        """Every file as a :class:`.manifest3.StoredFile`, by ``key_of`` (every page
        fetched, in few requests: :meth:`every_page`)."""
        counts, sizes = self.columns()["count"], self.columns()["size"]
        out: dict[str, StoredFile] = {}
        for k, records in self.every_page():
            for f, record in enumerate(records, k * self.page_size):
                ref = self._ref(record, sizes[f])
                assert ref.size is not None and ref.stamp is not None and ref.stored is not None
                out[key_of(ref.url)] = StoredFile(
                    ref.url, self.format_of(f), counts[f], ref.size, ref.stamp, ref.stored
                )
        return out


def _reopen(location: str, head: Mapping[str, Any], access: FileAccess) -> Opened:
    return opened(location, head, access)


class ColumnArray(array):
    """A column of a version 3 index (an ``array``): pickled as where it comes from,
    fetched again (once per process) where it is unpickled."""

    source: tuple[str, Mapping[str, Any], FileAccess, str]

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return _column_again, self.source

    def __reduce__(self) -> tuple[Any, ...]:
        return _column_again, self.source


def _column_again(location: str, head: Mapping[str, Any], access: FileAccess, name: str) -> ColumnArray:
    return _reopen(location, head, access).column(name)


class StartsArray(array):
    """Each file's first position (prefix sums of a :class:`ColumnArray` of counts),
    pickled as its counts: computed again where it is unpickled."""

    counts: ColumnArray

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return starts_of, (self.counts,)

    def __reduce__(self) -> tuple[Any, ...]:
        return starts_of, (self.counts,)


def starts_of(counts: Sequence[int]) -> Sequence[int]:
    """Each file's first position: a list, or for a column a :class:`StartsArray`."""
    if not isinstance(counts, ColumnArray):
        return list(itertools.accumulate(counts, initial=0))[:-1]
    out = StartsArray("q")
    try:
        import numpy
    except ImportError:  # (an optional dependency: without it, a pass in Python)
        out.extend(itertools.accumulate(counts, initial=0))
        out.pop()
    else:
        sums = numpy.cumsum(numpy.frombuffer(counts, dtype=f"=u{counts.itemsize}"), dtype=numpy.int64)
        out.frombytes(b"\0" * 8 + sums[:-1].astype("=i8").tobytes() if len(counts) else b"")
    out.counts = counts
    return out


class Uniform(Sequence):
    """``n`` times the same value, as a sequence that takes no memory."""

    def __init__(self, value: Any, n: int) -> None:
        self.value, self.n = value, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self.value] * len(range(*i.indices(self.n)))
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return self.value

    def __iter__(self) -> Iterator[Any]:
        return itertools.repeat(self.value, self.n)


class PagedRefs(Sequence):
    """The files of a version 3 index as ``FileRef``s, a page fetched on first access;
    pickled as ``(location, head, access)``."""

    def __init__(self, index: Opened) -> None:
        self.opened_index = index

    def __len__(self) -> int:
        return self.opened_index.files

    def __getitem__(self, f: Any) -> Any:
        if isinstance(f, slice):
            return [self[k] for k in range(*f.indices(self.opened_index.files))]
        if f < 0:
            f += self.opened_index.files
        if not 0 <= f < self.opened_index.files:
            raise IndexError(f)
        return self.opened_index.ref(f)

    def __reduce__(self) -> tuple[Any, ...]:
        return _refs_again, (self.opened_index.location, self.opened_index.head, self.opened_index.access)

    def remote(self) -> Sequence[bool]:
        """Which files are remote: from the head alone when all are of one kind."""
        kind = self.opened_index.head.get("remote")
        if isinstance(kind, bool):
            return Uniform(kind, len(self))
        return [is_remote(ref.url) for ref in self]

    def first_urls(self) -> list[str]:
        """The first 8 files' URLs (from the head: no page)."""
        return [resolve(self.opened_index.location, name) for name in self.opened_index.head.get("first_names", [])]


def _refs_again(location: str, head: Mapping[str, Any], access: FileAccess) -> PagedRefs:
    return PagedRefs(_reopen(location, head, access))


class PagedChunks(PackedEntries):
    """The chunks entries are fetched in (:mod:`.entry_packs`), for a version 3 index:
    those of the entries of the page a file is in (so no page is fetched to make them)."""

    def __init__(self, index: Opened) -> None:
        super().__init__(())
        self.index = index

    def chunk(self, entry: str) -> list[Member]:
        return self.index.chunk(entry)

    def __getstate__(self) -> dict[str, Any]:
        return {"_entries": [], "_chunks": None, "index": self.index}


class StoredSummary(Sequence):
    """``(ref, count)`` of every file of a source that lists exactly the files of a
    version 3 index, lazily (see the module docstring); its parts pickle small."""

    def __init__(self, index: Opened) -> None:
        self.refs = PagedRefs(index)
        self.counts = index.column("count")

    def __len__(self) -> int:
        return len(self.counts)

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, slice):
            return [self[j] for j in range(*k.indices(len(self)))]
        return self.refs[k], self.counts[k]

    @property
    def urls(self) -> "PagedUrls":
        return PagedUrls(self.refs)


class PagedUrls(Sequence):
    """The URLs of :class:`PagedRefs` (what a source pickled for a spawned worker lists)."""

    def __init__(self, refs: PagedRefs) -> None:
        self.refs = refs

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, slice):
            return [ref.url for ref in self.refs[k]]
        return self.refs[k].url


class Stored3(Stored):
    """A version 3 stored index (:class:`.manifest3.Stored`): ``files`` fetches every
    page when first asked for (the command, a source over other files than the
    index's); a source over exactly its files uses :meth:`summary`."""

    def __init__(self, location: str, head: Mapping[str, Any], access: FileAccess) -> None:
        index = opened(location, head, access)
        root = head.get("root")
        super().__init__(location, _AllFiles(index), root if isinstance(root, str) else None, bool(head["relative"]))
        object.__setattr__(self, "index", index)

    index: Opened

    def summary(self, fmt: str, urls: Sequence[str]) -> StoredSummary | None:
        """The lazy summary of a source over ``urls`` in format ``fmt`` when they are
        exactly the index's files, in order, where it was written (else ``None``)."""
        head = self.index.head
        if len(urls) != self.index.files or head["formats"] not in ([fmt], []) or self.moved_from is not None:
            return None
        pattern = head.get("pattern")  # (the command's: the one brace pattern that names these files)
        same = False
        if isinstance(urls, BraceList) and isinstance(pattern, str):
            theirs = lazy_braceexpand(pattern)
            same = theirs is not None and theirs.key() == urls.key()  # the same list, compared as patterns
        return StoredSummary(self.index) if same or manifest3.names_digest(urls) == head["urls"] else None

    def entries_usable(self) -> bool:
        if self.moved_from is None:
            return True
        head = self.index.head
        if not head["md5_stamps"]:
            return False
        if not head["absolute"]:
            return parent(self.location).startswith(("s3://", "s3a://"))
        return super().entries_usable()


class _AllFiles(Mapping):
    """Every file of a version 3 index by ``key_of``, made on first use (every page)."""

    def __init__(self, index: Opened) -> None:
        self.index = index
        self._files: dict[str, StoredFile] | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return _AllFiles, (self.index,)

    def _all(self) -> dict[str, StoredFile]:
        if self._files is None:
            self._files = self.index.stored_files()
        return self._files

    def __getitem__(self, key: str) -> StoredFile:
        return self._all()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return self.index.files


def head_list(values: Sequence[Any], first: Sequence[Any] | None = None) -> list[Any] | ListHead:
    """What :func:`.digests.stable_digest` reads of a long list (its length and its
    first 8 items), without the list: ``first``, or the first 8 of ``values``."""
    items = list(first if first is not None else values[:8])
    if len(items) == len(values):
        return items
    return ListHead(items, len(values))


def urls_head(refs: Sequence[FileRef]) -> list[str]:
    """The first 8 files' URLs (of :class:`PagedRefs`: from the head, no page)."""
    return refs.first_urls() if isinstance(refs, PagedRefs) else [ref.url for ref in refs[:8]]


def summary_parts(files: Sequence[tuple[FileRef, int]]) -> tuple[Sequence[FileRef], Sequence[int]]:
    """A source's files and counts: a :class:`StoredSummary`'s lazy parts, or tuples."""
    if isinstance(files, StoredSummary):
        return files.refs, files.counts
    return tuple(ref for ref, _ in files), tuple(count for _, count in files)


def counts_of(files: Sequence[tuple[FileRef, int]]) -> list[int]:
    """Samples per file, without fetching a page."""
    return list(summary_parts(files)[1]) if isinstance(files, StoredSummary) else [c for _, c in files]


def forget() -> None:
    """Forget every index this process opened (what a test makes a fresh process of)."""
    with _LOCK:
        _OPENED.clear()
