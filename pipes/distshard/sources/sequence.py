"""The random-access view of a file source (:class:`SourceSequence`): ``len`` and
``seq[i]`` = the ``i``-th sample of plain iteration, its reads of many positions at once
(``distshard_read``, through the read-ahead of :mod:`.reading.fetch`), the order
``shuffle=True`` visits it in (``distshard_order``, see :mod:`.reading.order`), each file's
index checked against the count and identity the source was built with, and what a rank
fetches of the stored index for its workers before they start (``distshard_prefetch``).
Per process: open files and full indexes in small LRUs, forgotten in a forked child.
The pipe (``pipe.py``) makes it; it is the pipe's own part, above every room.
"""

from __future__ import annotations

import bisect
import itertools
import operator
import weakref
from collections.abc import Sequence
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Mapping

from ..errors import OptionError, SourceChangedError, SourceDataError
from ..forks import at_fork
from .formats.contract import Format
from .formats.file_index import FileIndex
from .formats.index_cache import load_cached, obtain
from .reading.cache import FileCache, range_cache
from .reading.confirm import confirm, listable, raise_verdict
from .reading.fetch import ReadAhead, Request
from .reading.order import FileOrder
from .reading.sample_requests import EntriesAhead, SampleRequest
from .stored.entry_packs import KeptEntries, PackedEntries, entry_range, fetch_ahead, fetch_first
from .stored.paged import PagedChunks, PagedRefs, Uniform, head_list, starts_of, summary_parts, urls_head
from .transport.files import DEFAULT_FILE_ACCESS, FileAccess, FileRef, identify, key_of
from .transport.lru import LRU
from .transport.urls import is_remote

__all__ = ["SourceSequence", "build_index", "count_error"]

# per process: open files, and the full indexes of the files read lately. An
# evicted handle is not closed here: a thread may still be reading through it,
# and a closed descriptor number can be reused by the next open; handles close
# themselves when the last reference goes.
_HANDLES: LRU[Any] = LRU(max_items=64)
_INDEXES: LRU[FileIndex] = LRU(max_items=4096, max_weight=1 << 24)


def build_index(
    fmt: Format,
    access: FileAccess,
    ref: FileRef,
    packed: PackedEntries | None = None,
    kept: Mapping[str, bytes] | None = None,
) -> FileIndex:
    """``ref``'s index: its stored entry if the identity came from a stored index
    (from ``kept``, the entries the rank fetched before its workers started, else
    with its chunk of ``packed``: see :mod:`.entry_packs`), else (or if the entry is not
    there) built from the file."""
    if ref.stored is not None:
        from .stored.manifest import fetch_entry

        index = fetch_entry(fmt.name, ref, access, packed, kept)
        if index is not None:
            return index
    return fmt.build_index(ref, access)


def _access_key(access: FileAccess) -> Any:
    """What a cached handle was opened with: a handle reads with its source's
    ``ReadOptions`` (retries, timeouts, concurrency), so a source never borrows
    another's handle to the same file made with other options."""
    from .transport.clients import frozen

    return access.options, frozen(access.storage_options or {})


_LOOKAHEAD = 64  # positions a slot looks ahead for the stored index entries it will need
_PREFETCH_POSITIONS = 1 << 14  # positions of each slot a rank looks at for the files its workers read
_CONFIRM_FILES = 1024  # files of each slot whose identities a rank confirms for its workers' cache hits


class SourceSequence(Sequence):
    """Random access to the samples of a list of files: ``seq[i]`` is exactly the
    ``i``-th sample that iterating the source yields.

    Holds only file names, identities and counts (picklable, no open file);
    each process opens files and loads per-file indexes lazily, keeping a few
    of each in small LRUs. A file that is no longer the one that was indexed
    raises ``ValueError`` instead of returning wrong bytes, and so does a file
    whose sample count is not the one declared (a wrong ``nsamples`` in a shard
    index), before any of its samples is yielded.
    """

    def __init__(
        self,
        fmt: Format,
        files: Sequence[tuple[FileRef, int]],
        access: FileAccess = DEFAULT_FILE_ACCESS,
        declared: Iterable[int] = (),
    ) -> None:
        self.fmt = fmt
        self.access = access
        self.refs, self.counts = summary_parts(files)  # (a version 3 stored index's: lazy, see .stored.paged)
        self.declared = frozenset(declared)  # files whose count came from a shard index
        self._starts = starts_of(self.counts)
        self._total = sum(self.counts)
        refs = self.refs
        self._remote = refs.remote() if isinstance(refs, PagedRefs) else tuple(is_remote(r.url) for r in refs)
        self._identified: dict[int, FileRef] = {}  # refs whose identity this process asked of the store
        self._open: dict[int, Any] = {}  # this process's handles, by file (see _handle)
        self._checked_indexes: dict[int, tuple[FileRef, FileIndex]] = {}  # this process's checked indexes, by file
        # stored index entries the rank fetched for its workers (pickled with it)
        self._fetched_entries = KeptEntries()
        self._verdicts: dict[int, tuple[str, str] | None] = {}  # files checked against the store (see confirm)
        self._chunks: PackedEntries | None = None  # see _packed
        _LIVE.add(self)  # a forked child forgets its handles and indexes (_forget_handles)

    #: dist_shard gives each slot a contiguous block of samples (whole stretches of
    #: few files: each file's bytes and row groups read about once), not a stride
    distshard_blocks = True

    #: what ``shuffle=True`` does (see :meth:`distshard_order`), for ``explain()``
    distshard_shuffle_kind = (
        "files in a permuted order, each file's windows (runs of samples of about "
        "ReadOptions.window bytes; Parquet row groups) in a permuted order, each "
        "window's samples in a seeded order: every slot reads the files it touches in "
        "big ranges and never another slot's bytes"
    )

    def distshard_identity(self) -> str:
        """What a checkpoint records of this data: format, files and their counts,
        and the shuffle order's version and window (the same in every process; a
        changed file changes its count or is refused when read)."""
        from ..readers.base import stable_digest

        return (
            f"{self.fmt.name}:{len(self.refs)} files:{self._total}:"
            f"{stable_digest(head_list(self.refs, urls_head(self.refs)), head_list(self.counts))}:"
            f"order=files/{self.access.options.token()}/{getattr(self.fmt, 'window_order', 'expand')}"
        )

    def __len__(self) -> int:
        return self._total

    def _locate(self, i: Any) -> tuple[int, int]:
        i = operator.index(i)
        if i < 0:
            i += self._total
        if not 0 <= i < self._total:
            raise IndexError(f"sample index {i} out of range for {self._total} samples")
        f = bisect.bisect_right(self._starts, i) - 1
        return f, i - self._starts[f]

    def __getitem__(self, i: Any) -> Any:
        """One sample, read on its own (``dist_shard`` reads many at once
        through :meth:`distshard_read`)."""
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._total))]
        return next(self._read_each([i]))

    def distshard_read(self, positions: Iterable[int], shuffled: bool = False) -> Iterator[Any]:
        """The samples at ``positions``, in that order: what ``dist_shard``'s
        reader calls. Remote files are read ahead of use as few large ranges (see
        :mod:`.fetch`); local files are read exactly, one ``pread`` per sample
        span (the page cache reads ahead; the read-ahead's bookkeeping would only
        cost CPU), a span read once while consecutive samples share it (a Parquet
        row group's column chunks)."""
        if not any(self._remote):
            yield from self._read_each(positions)
            return
        options = self.access.options
        remote = self._remote  # (all remote: None, each file's gap options.max_gap)
        gaps = None if isinstance(remote, Uniform) else [options.max_gap if r else 0 for r in remote]
        fetch = ReadAhead(options, self._handle, gaps, self._range_cache(), self.confirm)

        entries = EntriesAhead(self)

        def requests() -> Iterator[Request]:
            ahead = entries.ahead
            for position in positions:
                ahead.append(self._locate(position))
                if len(ahead) >= _LOOKAHEAD:
                    yield SampleRequest(self, *ahead.popleft(), entries)
            while ahead:
                yield SampleRequest(self, *ahead.popleft(), entries)

        for (f, j, ref, index), views in fetch.run(requests()):
            yield self.fmt.parse(self._handle(f), index, j, ref, views)

    def _range_cache(self) -> Callable[[int], FileCache | None] | None:
        """Where remote file ``f``'s fetched ranges are kept on local disk
        (``ReadOptions.cache_dir``; keyed by URL and the identity it was indexed
        with), or ``None`` without a cache."""
        options = self.access.options
        cache = range_cache(options.cache_dir, options.cache_bytes)
        if cache is None:
            return None

        def of(f: int) -> FileCache | None:
            if not self._remote[f]:
                return None
            ref = self.file_index(f)[0]
            return cache.file(key_of(ref.url), ref.size, ref.stamp)  # (an hf:// file: without its commit)

        return of

    def confirm(self, f: int) -> None:
        """Before remote file ``f``'s first range is served from the local cache in
        this process: raise unless the store still holds the version the cache is
        keyed by (see :mod:`.confirm`). An identity this job asked the store for is
        confirmed; one from a stored index is checked by a listing (S3: every file
        of its folder at once, or the verdicts the rank made before its workers
        started) or one identity request (elsewhere), once per process."""
        ref = self._identified.get(f) or self.refs[f]
        if ref.stored is None:
            return
        if f not in self._verdicts:
            self._verdicts.update(confirm(self.fmt, self.refs, [f], self.access))
        raise_verdict(self._verdicts[f])

    def _confirm_ahead(self, later: Callable[[], Iterable[Iterable[int]]]) -> None:
        """In a rank, before its workers start: the verdicts of the files its slots
        read (``later()``: each slot's files) that a listing confirms (S3), one
        listing per folder, kept for the workers; only when the local cache holds
        something (else nothing is hit, and the slots' files are not looked at)."""
        options = self.access.options
        cache = range_cache(options.cache_dir, options.cache_bytes)
        if cache is None or not cache.holds_any():
            return
        files = {
            f
            for files in later()
            for f in files
            if self._remote[f]
            and self.refs[f].stored is not None
            and listable(self.refs[f])
            and f not in self._verdicts
        }
        if files:
            self._verdicts.update(confirm(self.fmt, self.refs, files, self.access))

    def _read_each(self, positions: Iterable[int]) -> Iterator[Any]:
        last: tuple[int, list[tuple[int, int]], list[memoryview]] | None = None
        lo = hi = 0  # the positions of the file read last: its index and handle are at hand
        for position in positions:
            if type(position) is int and lo <= position < hi:
                j = position - lo
            else:
                f, j = self._locate(position)
                ref, index = self.file_index(f)
                handle = self._handle(f)
                lo, hi = self._starts[f], self._starts[f] + self.counts[f]
            spans = self.fmt.spans(index, j)
            if last is not None and last[0] == f and last[1] == spans:
                views = last[2]
            else:
                views = [memoryview(handle.read_at(start, stop - start)) for start, stop in spans]
                last = (f, spans, views)
            yield self.fmt.parse(handle, index, j, ref, views)

    def distshard_order(self, seed: int) -> FileOrder:
        """The permutation ``shuffle=True`` visits the samples in (see :mod:`.order`)."""
        return FileOrder(self.counts, seed, self._windows, getattr(self.fmt, "window_order", "expand"))

    def _windows(self, f: int) -> Sequence[int]:
        _, index = self.file_index(f)
        window = self.access.options.window
        found = index.derived.get(("windows", window))
        if found is None:
            found = index.derived[("windows", window)] = self.fmt.windows(index, window)
        return found

    def has_index(self, f: int) -> bool:
        """Whether file ``f``'s index is in this process already, or its stored entry
        (the rank fetched it before its workers started): no request to get it."""
        if f in self._checked_indexes:
            return True
        ref = self._identified.get(f) or self.refs[f]
        if ref.stored is not None and ref.stored in self._fetched_entries:
            return True
        return ref.size is not None and _INDEXES.get((self.fmt.name, key_of(ref.url), ref.size, ref.stamp)) is not None

    def file_index(self, f: int) -> tuple[FileRef, FileIndex]:
        """File ``f``'s identity and full index (per process: cached, or read
        from the index cache, or built), its count checked against the declared one."""
        known = self._checked_indexes.get(f)
        if known is not None:
            return known
        ref = self._identified.get(f) or self.refs[f]
        if ref.size is None:  # counted by a shard index: look at the file now
            ref = self._identified[f] = FileRef(ref.url, *identify(self.fmt, ref.url, self.access))
        key = (self.fmt.name, key_of(ref.url), ref.size, ref.stamp)
        index = _INDEXES.get(key)
        if index is None:
            index, _ = obtain(
                self.fmt.name,
                ref,
                partial(build_index, self.fmt, self.access, packed=self._packed(), kept=self._fetched_entries),
            )
            assert index is not None
            _INDEXES.put(key, index, index.weight())
        if index.count != self.counts[f]:
            raise count_error(ref.url, index.count, self.counts[f], f in self.declared)
        if len(self._checked_indexes) >= 64:  # the few files a slot is reading now
            self._checked_indexes.clear()
        self._checked_indexes[f] = (ref, index)
        return ref, index

    def distshard_prefetch(self, slots: Sequence[Iterator[int]]) -> None:
        """In a rank, before its DataLoader workers start (``slots``: the positions
        each of its slots will read, in order): fetch the stored index entries
        (``python -m distshard index``) of the file each reads first, with the rest
        of their chunks (:mod:`.entry_packs`: one range request each, all at once; one for
        all when they lie within ``packs.RANGE_BYTES`` of a pack, as a rank's
        contiguous blocks do), and keep them here: the workers get them with the
        sequence (forked or pickled) and ask no request for them. Nothing without a
        stored index, or when the first files' indexes are here or in the
        per-machine cache already. The entries are checked when they are loaded, as
        fetched ones are (a stale one: the file is indexed itself)."""
        heads = [(next(positions, None), positions) for positions in map(iter, slots)]
        firsts = [self._locate(first)[0] for first, _ in heads if first is not None]
        self._confirm_ahead(
            lambda: [self._files_read(itertools.chain((first,), rest)) for first, rest in heads if first is not None]
        )
        needed = [f for f in dict.fromkeys(firsts) if self._fetchable(f)]
        if needed:
            entries = [self.refs[f].stored for f in needed]
            wanted = [e for e in entries if e is not None]
            self._fetched_entries.keep(fetch_first(wanted, self._packed(), self.access), wanted)

    def _files_read(self, positions: Iterable[int]) -> list[int]:
        """The files a slot reading ``positions`` reads, in order (its first
        ``_PREFETCH_POSITIONS`` positions, at most ``_CONFIRM_FILES`` files)."""
        files: list[int] = []
        seen: set[int] = set()
        lo = hi = 0  # the positions of the file read last
        for position in itertools.islice(positions, _PREFETCH_POSITIONS):
            if lo <= position < hi:
                continue
            f = self._locate(position)[0]
            lo, hi = self._starts[f], self._starts[f] + self.counts[f]
            if f not in seen:
                if len(files) >= _CONFIRM_FILES:
                    break
                seen.add(f)
                files.append(f)
        return files

    def entries_ahead(self, files: Iterable[int]) -> None:
        """Begin fetching the stored entries of ``files`` (what a slot reads next) that
        no request has brought yet (see :func:`.entry_packs.fetch_ahead`)."""
        wanted = [self.refs[f].stored for f in files if self._fetchable(f)]
        if wanted:
            fetch_ahead([e for e in wanted if e is not None], self._packed(), self.access, self._fetched_entries)

    def _fetchable(self, f: int) -> bool:
        """Whether file ``f``'s index would come from a packed stored entry of a
        remote file's that is in none of this process's caches (nor on local disk)."""
        stored = self.refs[f].stored
        return (
            self._remote[f]
            and stored is not None
            and stored not in self._fetched_entries
            and entry_range(stored) is not None
            and not self.has_index(f)
            and load_cached(self.fmt.name, self.refs[f], header_only=True) is None
        )

    def _packed(self) -> PackedEntries:
        """The chunks this source's packed stored entries are fetched in (made once per process)."""
        if self._chunks is None:
            refs = self.refs
            self._chunks = (
                PagedChunks(refs.opened_index) if isinstance(refs, PagedRefs) else PackedEntries(r.stored for r in refs)
            )
        return self._chunks

    def sample_bytes(self) -> list[int]:
        """Every sample's stored bytes, in order, from the files' indexes (no sample
        is read): a tar sample's member bytes, a JSON line's bytes. What
        ``distshard.mix(..., cost="bytes")`` weighs by. ``ValueError`` for a format
        whose index has no bytes per sample (Parquet stores rows in row groups)."""
        out: list[int] = []
        for f in range(len(self.refs)):
            ref, index = self.file_index(f)
            arrays = index.arrays
            own = getattr(self.fmt, "sample_bytes", None)
            if own is not None:  # a format that knows its samples' bytes (tokens)
                out.extend(own(index))
            elif "first" in arrays and "length" in arrays:  # tar: sample i is members first[i] .. first[i + 1]
                first, lengths = arrays["first"], arrays["length"]
                out.extend(sum(lengths[first[i] : first[i + 1]]) for i in range(index.count))
            elif "length" in arrays:  # JSON lines: one line a sample
                out.extend(arrays["length"])
            else:
                raise OptionError(
                    f"{ref.url}: a {self.fmt.name} index has no stored bytes per sample; "
                    "give per-sample costs instead of cost='bytes'"
                )
        return out

    def forget_handles(self) -> None:
        """In a child made by fork: handles and indexes of its own."""
        self._open, self._checked_indexes = {}, {}

    def _handle(self, f: int) -> Any:
        handle = self._open.get(f)
        if handle is None:
            if len(self._open) >= 64:
                self._open.clear()
            handle = self._open[f] = self._shared_handle(f)
        return handle

    def _shared_handle(self, f: int) -> Any:
        from .transport.files import open_random

        ref = self._identified.get(f) or self.refs[f]
        if ref.size is None:
            ref = self.file_index(f)[0]
        # by the URL itself too: a handle reads the URL it was opened for (an hf:// file's commit)
        key = (key_of(ref.url), ref.url, ref.size, ref.stamp, ref.stored, _access_key(self.access))
        handle = _HANDLES.get(key)
        if handle is None:
            opener = getattr(self.fmt, "open_random", None) or open_random  # a format of paired files opens its data
            handle = _HANDLES.setdefault(key, opener(ref, self.access))
        return handle

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_identified"], state["_open"], state["_checked_indexes"] = {}, {}, {}
        state["_chunks"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        _LIVE.add(self)

    def __repr__(self) -> str:
        return f"SourceSequence({self.fmt.name}, files={len(self.refs)}, samples={self._total})"


_LIVE: "weakref.WeakSet[SourceSequence]" = weakref.WeakSet()  # this process's sequences


def _forget_handles() -> None:
    """In a forked child: every sequence opens its own files and reads its own indexes."""
    for sequence in list(_LIVE):
        sequence.forget_handles()


at_fork(_forget_handles)


def count_error(url: str, real: int, expected: int, declared: bool) -> ValueError:
    if declared:
        return SourceDataError(
            f"{url} holds {real} samples but the shard index given as index= says nsamples="
            f"{expected}: fix its nsamples (or drop index= to count the file)"
        )
    return SourceChangedError(
        f"{url} holds {real} samples but {expected} were counted when the source was built: "
        "the file changed; build the source again"
    )
