"""The file source pipe (its random-access view is ``sequence.py``'s).

:class:`FileSourceIterDataPipe` is an ordinary ``IterDataPipe``: iterated alone
it streams every file from start to end and yields every sample in file order.
For ``dist_shard`` it speaks a small protocol:

- ``__distshard_sequence__()``: a :class:`.sequence.SourceSequence` (``len`` and
  ``seq[i]`` = the ``i``-th sample of plain iteration), or ``None`` when some
  file cannot be read at random (compressed). The sequence also reads a whole
  iterator of positions at once (``distshard_read``, through the read-ahead of
  :mod:`.reading.fetch`) and gives the order ``shuffle=True`` visits it in
  (``distshard_order``: files, windows, samples; see :mod:`.reading.order`);
- ``__distshard_units__()``: ``(files, expand)`` where ``expand(file)`` streams
  one file's samples: compressed files go whole to slots, each decompressed once;
- ``describe()``: one line for ``explain()``.

Formats (``tar.py``, ``jsonl.py``, ``parquet.py``, ``megatron.py``; their contract is
:class:`.formats.contract.Format`) never read:
they name the byte spans of a sample (``spans``) and parse the bytes they are
handed (``parse``). A format whose unit is several files (``megatron.py``: a
``.bin`` and its ``.idx``, named by their prefix) also gives the unit's
identity (``identity``) and opens the file its spans are in (``open_random``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from functools import partial
from typing import Any, Callable, Iterator, Mapping

from torch.utils.data.datapipes.datapipe import IterDataPipe

from ..errors import OptionTypeError
from ..groups import DataGroup, job_ranks
from .formats.contract import Format
from .formats.index_cache import load_cached, summarize_files
from .read_options import ReadOptions
from .sequence import SourceSequence, build_index, count_error
from .stored.manifest import Stored
from .stored.paged import StoredSummary, counts_of
from .transport.brace_list import BraceList
from .transport.files import DEFAULT_FILE_ACCESS, FileAccess, FileRef, check_identity, identify, key_of, local_path
from .transport.urls import first_remote, is_remote

__all__ = ["FileSourceIterDataPipe", "Format", "SourceSequence", "FileSamples"]

log = logging.getLogger("distshard")


class FileSamples:
    """``expand`` for whole-file hand-out: ``FileSamples(fmt)(url)`` yields the
    samples of one file in order (picklable)."""

    def __init__(self, fmt: Format, access: FileAccess = DEFAULT_FILE_ACCESS) -> None:
        self.fmt = fmt
        self.access = access

    def __call__(self, url: str) -> Iterator[Any]:
        return self.fmt.stream(url, self.access)

    def __repr__(self) -> str:
        return f"FileSamples({self.fmt.name})"


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
        storage_options: handed to fsspec for remote URLs (endpoint, credentials, ...).
        read_options: read-ahead, coalescing, shuffle window and retries
            (:class:`distshard.sources.ReadOptions`).
        stored: the folder of a stored index (``python -m distshard index``);
            ``None`` looks for ``.distshard/`` beside the first file.
        data_group: the data group (``mesh=`` / ``group=`` of the public
            functions, see ``groups.py``) the index build is split over; ``None``:
            every rank.
    """

    def __init__(
        self,
        fmt: Format,
        urls: Sequence[str],
        counts: dict[str, int] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        read_options: ReadOptions | None = None,
        stored: str | None = None,
        data_group: DataGroup | None = None,
    ) -> None:
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise OptionTypeError(
                f"storage_options must be a dict of fsspec options, got {type(storage_options).__name__}"
            )
        if read_options is not None and not isinstance(read_options, ReadOptions):
            raise OptionTypeError(
                f"read_options must be a distshard.sources.ReadOptions, got {type(read_options).__name__}"
            )
        self.fmt = fmt
        self.urls: Sequence[str] = urls if isinstance(urls, BraceList) else list(urls)  # (a pattern's stays lazy)
        self.declared = dict(counts or {})
        self.access = FileAccess(read_options or ReadOptions(), dict(storage_options) if storage_options else None)
        self._summary: Sequence[tuple[FileRef, int]] | None = None
        self._sequence: SourceSequence | None = None
        self.stored_location = stored
        self._stored: Stored | None = None  # the stored index found (after prepare)
        self._indexed_here = 0  # files prepare indexed itself (no stored index had them)
        self.data_group = data_group  # the ranks the index build is split over (None: every rank)
        remote = first_remote(self.urls)
        if job_ranks(data_group) is not None:
            # Built on every rank of the data group (as the whole pipeline is): the one place
            # where the index build is split across ranks. Later, lazy calls (len, explain,
            # dist_shard) never make collectives, so calling them on one rank cannot hang.
            self.prepare(collective=True)
        elif remote is not None:  # its first request comes later (dist_shard, len, iter): start the client now
            from .transport.clients import warm_up

            warm_up(remote, storage_options)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a spawned worker): over a version 3 index's files, its head, not its files."""
        state = dict(self.__dict__)
        if isinstance(self._summary, StoredSummary):
            state["urls"] = self._summary.urls
        return state

    def __iter__(self) -> Iterator[Any]:
        """Every sample of every file, in order. Once the source knows its files
        (``len()``, ``dist_shard``, built under ``torch.distributed``), each file is
        first checked against the identity it was counted with (a ``stat``; a
        metadata request remotely), as the sharded path checks it: a changed file
        raises before any of its samples, and a file that yields another count
        than ``len()`` counted raises at its end."""
        summary = self._summary
        for k, url in enumerate(self.urls):
            if summary is None:
                yield from self.fmt.stream(url, self.access)
                continue
            ref, count = summary[k]
            if ref.size is not None:
                check_identity(ref, *identify(self.fmt, url, self.access), "iterate")
            n = 0
            for n, sample in enumerate(self.fmt.stream(url, self.access), 1):  # noqa: B007 - counted
                yield sample
            if n != count:
                raise count_error(url, n, count, key_of(url) in {key_of(u) for u in self.declared})

    # -- the index ------------------------------------------------------------------
    @property
    def random_access(self) -> bool:
        """Whether every file can be read at random (none is compressed: never one a stored index lists)."""
        if isinstance(self._summary, StoredSummary):
            return True
        batch = getattr(self.fmt, "any_compressed", None)  # (a search of every name at once)
        return not (batch(self.urls) if batch is not None else any(map(self.fmt.compression, self.urls)))

    def prepare(self, collective: bool = False) -> Sequence[tuple[FileRef, int]]:
        """Index the files (or read their cached indexes) once, and remember the
        counts and identities; returns ``(file, count)`` per file.

        ``collective=True`` (what construction does when ``torch.distributed`` is
        initialized) is a collective every rank of the data group must make: the
        files are split across its ranks, each indexes its share and they exchange
        the results.
        Otherwise every file is indexed here or read from the cache, each under a
        lock, so concurrent processes index a file once. Either way a file's
        identity is asked here only, once per job: it travels with the pipe into
        the DataLoader workers, which check every response against it.
        """
        if self._summary is None:
            from .stored.manifest import source_files

            declared = {key_of(url): n for url, n in self.declared.items()}
            self._stored, found, whole = source_files(
                self.fmt.name, self.urls, declared, self.stored_location, self.access
            )
            if whole is not None:  # exactly a version 3 index's files: lazily (see .stored.paged)
                self._summary = whole
                return whole
            todo = [url for url in self.urls if key_of(url) not in declared and url not in found]
            started = time.monotonic()
            found.update(
                zip(
                    todo,
                    summarize_files(
                        self.fmt.name,
                        todo,
                        partial(build_index, self.fmt, self.access),
                        collective,
                        identify=partial(identify, self.fmt, access=self.access),
                        group=self.data_group,
                    ),
                    strict=True,
                )
            )
            self._indexed_here = len(todo)
            if todo:
                log.info(
                    "indexed %d %s files in %.1f s (%s)",
                    len(todo),
                    self.fmt.name,
                    time.monotonic() - started,
                    self.stored_hint() or f"{len(found) - len(todo)} from the stored index",
                )
            self._summary = [
                found.get(url) or (self._declared_ref(url, declared[key_of(url)]), declared[key_of(url)])
                for url in self.urls
            ]
        return self._summary

    def stored_hint(self) -> str | None:
        """What would make the next start fast, when files were indexed here
        without a stored index (``None`` otherwise)."""
        from .stored.manifest import stored_hint

        return stored_hint(self._stored, self._indexed_here, self.urls, self.stored_location)

    def _declared_ref(self, url: str, count: int) -> FileRef:
        """A file counted by a shard index. Local files are looked at (a ``stat``,
        not an open): one already indexed in the cache is checked against the
        declared count now."""
        if is_remote(url) or self.fmt.compression(url):
            return FileRef(url)
        try:
            st = os.stat(local_path(url))
        except OSError:
            return FileRef(url)  # reported when it is read
        ref = FileRef(url, st.st_size, str(st.st_mtime_ns))
        cached = load_cached(self.fmt.name, ref, header_only=True)
        if cached is not None and cached.count != count:
            raise count_error(url, cached.count, count, declared=True)
        return ref

    def counts(self) -> list[int]:
        """Samples per file (from the index; a compressed file is streamed once to count)."""
        return counts_of(self.prepare())

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
            summary = self.prepare()
            declared = {key_of(url) for url in self.declared}
            self._sequence = SourceSequence(
                self.fmt,
                summary,
                self.access,
                [f for f, u in enumerate(self.urls) if key_of(u) in declared] if declared else (),
            )
        return self._sequence

    def __distshard_units__(self) -> tuple[list[str], Callable[[str], Iterator[Any]]]:
        """``(files, expand)``: whole files to hand to slots; ``expand(file)``
        streams the samples of one file in order."""
        return list(self.urls), FileSamples(self.fmt, self.access)

    def describe(self) -> str:
        """One line for ``explain()``: format, files, samples, how it is read."""
        n = len(self.urls)
        text = f"{self.fmt.name}: {n} {self.fmt.file_kind}{'' if n == 1 else 's'}"
        if self._summary is not None:
            text += f", {sum(counts_of(self._summary)):,} samples"
        if self.random_access:
            text = f"{text}, {self.fmt.access}, read ahead in ranges of up to {self.access.options.max_range >> 20} MiB"
            hint = self.stored_hint()
            if self._stored is not None:
                from .stored.manifest import moved_describe

                text += f"; index stored at {self._stored.location}{moved_describe(self._stored)}"
            remote = first_remote(self.urls)
            if remote is not None:
                from .transport.clients import s3_client_choice

                client = s3_client_choice(remote, self.access.storage_options)
                text += f"; {client}" if client else ""
            return text if hint is None else f"{text}; {hint}"
        compressed = sum(1 for url in self.urls if self.fmt.compression(url))
        which = "" if compressed == n else f" ({compressed} of {n} files compressed)"
        return (
            f"{text}, whole-file streaming (compressed){which}: no random access, so each file goes whole "
            "to one slot (file k to slot k mod num_slots) and is decompressed once; slot counts differ; "
            "even= and shuffle=True are refused"
        )

    def __repr__(self) -> str:
        first = self.urls[0] if self.urls else ""
        more = f" +{len(self.urls) - 1} more" if len(self.urls) > 1 else ""
        return f"{type(self).__name__}({first!r}{more})"
