"""A slot's sample requests to the read-ahead (:class:`SampleRequest`: the file known at once,
the spans and the file's index looked up when the read-ahead plans it) and the watcher that asks
the stored index entries of the files a slot reads next (:class:`EntriesAhead`), for the
random-access view of a file source (``sources/sequence.py``, which is a :class:`SampleSource`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from .fetch import Request

__all__ = ["EntriesAhead", "SampleRequest", "SampleSource"]


class SampleSource(Protocol):
    """What a request and the watcher ask of the sequence they read for."""

    fmt: Any

    def file_index(self, f: int) -> tuple[Any, Any]:
        """File ``f``'s identity and full index."""

    def entries_ahead(self, files: Iterable[int]) -> None:
        """Begin fetching the stored entries of ``files``."""


class SampleRequest(Request):
    """A sample's request to the read-ahead whose file is known at once and whose
    spans (and the file's index: a stored entry is a request) are looked up when the
    read-ahead plans it, so its first plan can end at the first file without asking
    for the next files' entries (see :class:`.fetch.ReadAhead`)."""

    __slots__ = ("_source", "_j", "_found", "_entries")

    def __init__(self, source: SampleSource, f: int, j: int, entries: EntriesAhead | None = None) -> None:
        self._source, self.file, self._j, self._entries = source, f, j, entries
        self._found: tuple[Any, Sequence[tuple[int, int]]] | None = None

    def _resolve(self) -> tuple[Any, Sequence[tuple[int, int]]]:
        if self._found is None:
            if self._entries is not None:
                self._entries.resolving(self.file)
            ref, index = self._source.file_index(self.file)
            spans = self._source.fmt.spans(index, self._j)
            self._found = ((self.file, self._j, ref, index), spans)
        return self._found

    @property
    def payload(self) -> Any:
        return self._resolve()[0]

    @property
    def spans(self) -> Sequence[tuple[int, int]]:  # type: ignore[override]
        return self._resolve()[1]


class EntriesAhead:
    """Asks, for a slot, the stored index entries (``python -m distshard index``) of
    the remote files it reads next, so that a slot over many small files does not
    wait a round trip per file while its read-ahead plans sample by sample: the
    requests go out at once (:func:`.entry_packs.fetch_ahead`, a chunk each, never twice),
    and a file's own lookup waits for its. Only files whose identity came from a
    stored index, once the read-ahead has moved past the first file (the first
    sample waits for nothing else); any other file's index is built from the file
    itself (the cold path), never in advance."""

    def __init__(self, source: SampleSource) -> None:
        self.source = source
        self.first: int | None = None  # the first file read: its entry is fetched alone
        self.last: int | None = None  # the file read last
        self.ahead: deque[tuple[int, int]] = deque()  # the positions a slot reads next
        self.seen: set[int] = set()  # the files looked at already

    def resolving(self, f: int) -> None:
        """The read-ahead plans a sample of file ``f``: once it moves past the first
        file, ask the entries of the files ahead."""
        if self.first is None:
            self.first = f
        elif f != self.first and f != self.last:
            files = [g for g in dict.fromkeys(g for g, _ in self.ahead) if g not in self.seen]
            self.seen.update(files)
            self.source.entries_ahead(files)
        self.last = f
