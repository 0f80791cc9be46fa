"""What a file format provides (:class:`Format`): the contract ``tar.py``, ``jsonl.py``,
``parquet.py`` and ``megatron.py`` offer the file source (``sources/pipe.py``) and its
random-access view (``sources/sequence.py``). A format never reads: it names the byte spans of
a sample (``spans``) and parses the bytes it is handed (``parse``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Iterator, Protocol

from ..transport.files import FileAccess, FileRef
from .file_index import FileIndex

__all__ = ["Format"]


class Format(Protocol):
    """What a file format provides (see ``tar.py``, ``jsonl.py``, ``parquet.py``)."""

    name: str
    file_kind: str
    access: str

    def compression(self, url: str) -> str | None: ...

    def stream(self, url: str, access: FileAccess) -> Iterator[Any]: ...

    def build_index(self, ref: FileRef, access: FileAccess) -> FileIndex: ...

    def spans(self, index: FileIndex, i: int) -> list[tuple[int, int]]: ...

    def parse(self, handle: Any, index: FileIndex, i: int, ref: FileRef, views: list[memoryview]) -> Any: ...

    def windows(self, index: FileIndex, window: int) -> Sequence[int]: ...

    def sample_sizes(self, index: FileIndex) -> Sequence[int]: ...
