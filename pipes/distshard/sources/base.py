"""The file source pipe and its random-access view.

:class:`FileSourceIterDataPipe` is an ordinary ``IterDataPipe``: iterated alone
it streams every file from start to end and yields every sample in file order.
For ``dist_shard`` it speaks a small protocol:

- ``__distshard_sequence__()``: a :class:`SourceSequence` (``len`` and
  ``seq[i]`` = the ``i``-th sample of plain iteration, reading only that
  sample's bytes), or ``None`` when some file cannot be read at random
  (compressed);
- ``__distshard_units__()``: ``(files, expand)`` where ``expand(file)`` streams
  one file's samples, for whole-file hand-out when there is no random access;
- ``describe()``: one line for ``explain()``.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Sequence
from typing import Any, Callable, Iterator, Protocol

from torch.utils.data.datapipes.datapipe import IterDataPipe

from ._lru import LRU
from .files import FileRef, file_identity, key_of
from .index import FileIndex, _collective, obtain, summarize_files

__all__ = ["FileSourceIterDataPipe", "Format", "SourceSequence", "StreamFile"]


class Format(Protocol):
    """What a file format provides (see ``tar.py``, ``jsonl.py``, ``parquet.py``)."""

    name: str
    file_kind: str
    access: str

    def compression(self, url: str) -> str | None: ...

    def stream(self, url: str) -> Iterator[Any]: ...

    def build_index(self, ref: FileRef) -> FileIndex: ...

    def open(self, ref: FileRef) -> Any: ...

    def read(self, handle: Any, index: FileIndex, i: int, ref: FileRef) -> Any: ...


# per process: open files, and the full indexes of the files read lately. An
# evicted handle is not closed here: a thread may still be reading through it,
# and a closed descriptor number can be reused by the next open; handles close
# themselves when the last reference goes.
_HANDLES: LRU[Any] = LRU(max_items=32)
_INDEXES: LRU[FileIndex] = LRU(max_items=4096, max_weight=1 << 24)


class StreamFile:
    """``expand`` for whole-file hand-out: ``StreamFile(fmt)(url)`` yields the
    samples of one file in order (picklable)."""

    def __init__(self, fmt: Format) -> None:
        self.fmt = fmt

    def __call__(self, url: str) -> Iterator[Any]:
        return self.fmt.stream(url)

    def __repr__(self) -> str:
        return f"StreamFile({self.fmt.name})"


class SourceSequence(Sequence):
    """Random access to the samples of a list of files: ``seq[i]`` is exactly the
    ``i``-th sample that iterating the source yields.

    Holds only file names, identities and counts (picklable, no open file);
    each process opens files and loads per-file indexes lazily, keeping a few
    of each in small LRUs. A file whose size or modification time differs from
    when it was indexed raises ``ValueError`` instead of returning wrong bytes.
    """

    def __init__(self, fmt: Format, files: list[tuple[FileRef, int]]) -> None:
        self.fmt = fmt
        self.refs = tuple(ref for ref, _ in files)
        self.counts = tuple(count for _, count in files)
        starts, total = [], 0
        for count in self.counts:
            starts.append(total)
            total += count
        self._starts = starts
        self._total = total
        self._resolved: dict[int, FileRef] = {}

    #: dist_shard gives each slot a contiguous block of samples (whole stretches of
    #: few files: each file's bytes and row groups read about once), not a stride
    distshard_blocks = True

    def distshard_identity(self) -> str:
        """What a checkpoint records of this data: format, files and their counts
        (the same in every process; a changed file changes its count or is refused
        when read)."""
        from ..readers.base import stable_digest

        return (f"{self.fmt.name}:{len(self.refs)} files:{self._total}:"
                f"{stable_digest([ref.url for ref in self.refs], list(self.counts))}")

    def __len__(self) -> int:
        return self._total

    def __getitem__(self, i: Any) -> Any:  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._total))]
        i = operator.index(i)
        if i < 0:
            i += self._total
        if not 0 <= i < self._total:
            raise IndexError(f"sample index {i} out of range for {self._total} samples")
        f = bisect.bisect_right(self._starts, i) - 1
        ref, index = self._file(f)
        key = (self.fmt.name, key_of(ref.url), ref.size, ref.stamp)
        handle = _HANDLES.get(key)
        if handle is None:
            handle = _HANDLES.setdefault(key, self.fmt.open(ref))
        return self.fmt.read(handle, index, i - self._starts[f], ref)

    def _file(self, f: int) -> tuple[FileRef, FileIndex]:
        ref = self._resolved.get(f) or self.refs[f]
        if ref.size is None:  # counted by a shard index: look at the file now
            ref = self._resolved[f] = FileRef(ref.url, *file_identity(ref.url))
        key = (self.fmt.name, key_of(ref.url), ref.size, ref.stamp)
        index = _INDEXES.get(key)
        if index is None:
            index, _ = obtain(self.fmt.name, ref, self.fmt.build_index)
            if index.count != self.counts[f]:
                raise ValueError(
                    f"{ref.url} holds {index.count} samples but {self.counts[f]} were expected "
                    "(from the shard index given as index=, or the file changed): fix or drop the shard index")
            _INDEXES.put(key, index, index.weight())
        return ref, index

    def sample_bytes(self) -> list[int]:
        """Every sample's stored bytes, in order, from the files' indexes (no sample
        is read): a tar sample's member bytes, a JSON line's bytes. What
        ``distshard.mix(..., cost="bytes")`` weighs by. ``ValueError`` for a format
        whose index has no bytes per sample (Parquet stores rows in row groups)."""
        out: list[int] = []
        for f in range(len(self.refs)):
            ref, index = self._file(f)
            arrays = index.arrays
            if "first" in arrays and "length" in arrays:  # tar: sample i is members first[i] .. first[i + 1]
                first, lengths = arrays["first"], arrays["length"]
                out.extend(sum(lengths[first[i]:first[i + 1]]) for i in range(index.count))
            elif "length" in arrays:  # JSON lines: one line a sample
                out.extend(arrays["length"])
            else:
                raise ValueError(f"{ref.url}: a {self.fmt.name} index has no stored bytes per sample; "
                                 "give per-sample costs instead of cost='bytes'")
        return out

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_resolved"] = {}
        return state

    def __repr__(self) -> str:
        return f"SourceSequence({self.fmt.name}, files={len(self.refs)}, samples={self._total})"


class FileSourceIterDataPipe(IterDataPipe):
    """Samples of a list of files in one format (made by :func:`distshard.webdataset`,
    :func:`distshard.jsonl` or :func:`distshard.parquet`).

    Iterated alone it yields every sample of every file, in order. ``.dist_shard()``
    reads it at random by position through ``__distshard_sequence__``.

    Args:
        fmt: the format (``TarFormat()``, ``JsonlFormat()``, ``ParquetFormat(columns)``).
        urls: the files, in order.
        counts: known sample counts by file (from a shard index); such files are
            not opened to count them.
    """

    def __init__(self, fmt: Format, urls: list[str], counts: dict[str, int] | None = None) -> None:
        self.fmt = fmt
        self.urls = list(urls)
        self.declared = dict(counts or {})
        self._summary: list[tuple[FileRef, int]] | None = None
        self._sequence: SourceSequence | None = None
        if _collective() is not None:
            # Built on every rank (as the whole pipeline is): the one place where the
            # index build is split across ranks. Later, lazy calls (len, explain,
            # dist_shard) never make collectives, so calling them on one rank cannot hang.
            self.prepare(collective=True)

    def __iter__(self) -> Iterator[Any]:
        for url in self.urls:
            yield from self.fmt.stream(url)

    # -- the index ------------------------------------------------------------------
    @property
    def random_access(self) -> bool:
        """Whether every file can be read at random (none is compressed)."""
        return not any(self.fmt.compression(url) for url in self.urls)

    def prepare(self, collective: bool = False) -> list[tuple[FileRef, int]]:
        """Index the files (or read their cached indexes) once, and remember the
        counts; returns ``(file, count)`` per file.

        ``collective=True`` (what construction does when ``torch.distributed`` is
        initialized) is a collective every rank must make: the files are split
        across ranks, each indexes its share and they exchange the results.
        Otherwise every file is indexed here or read from the cache, each under a
        lock, so concurrent processes index a file once.
        """
        if self._summary is None:
            declared = {key_of(url): n for url, n in self.declared.items()}
            todo = [url for url in self.urls if key_of(url) not in declared]
            found = dict(zip(todo, summarize_files(self.fmt.name, todo, self.fmt.build_index, collective)))
            self._summary = [found.get(url) or (FileRef(url), declared[key_of(url)]) for url in self.urls]
        return self._summary

    def counts(self) -> list[int]:
        """Samples per file (from the index; a compressed file is streamed once to count)."""
        return [count for _, count in self.prepare()]

    def __len__(self) -> int:
        return sum(self.counts())

    # -- the protocol with dist_shard --------------------------------------------------
    def __distshard_sequence__(self) -> SourceSequence | None:
        """The random-access view of the samples, or ``None`` when a file is compressed.

        The first call indexes the files unless construction did (see
        :meth:`prepare`); the view is kept, and travels with the pipe when it is
        pickled into DataLoader workers.
        """
        if not self.random_access:
            return None
        if self._sequence is None:
            self._sequence = SourceSequence(self.fmt, self.prepare())
        return self._sequence

    def __distshard_units__(self) -> tuple[list[str], Callable[[str], Iterator[Any]]]:
        """``(files, expand)``: whole files to hand to slots; ``expand(file)``
        streams the samples of one file in order."""
        return list(self.urls), StreamFile(self.fmt)

    def describe(self) -> str:
        """One line for ``explain()``: format, files, samples, how it is read."""
        n = len(self.urls)
        text = f"{self.fmt.name}: {n} {self.fmt.file_kind}{'' if n == 1 else 's'}"
        if self._summary is not None:
            text += f", {sum(c for _, c in self._summary):,} samples"
        if self.random_access:
            return f"{text}, {self.fmt.access}"
        compressed = sum(1 for url in self.urls if self.fmt.compression(url))
        which = "" if compressed == n else f" ({compressed} of {n} files compressed)"
        return f"{text}, whole-file streaming (compressed){which}"

    def __repr__(self) -> str:
        first = self.urls[0] if self.urls else ""
        more = f" +{len(self.urls) - 1} more" if len(self.urls) > 1 else ""
        return f"{type(self).__name__}({first!r}{more})"
