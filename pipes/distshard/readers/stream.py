"""A stream: anything iterable, walked by every slot, which skips what is not its
own with ``itertools.islice`` (in C) and decodes nothing it skips."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

from .base import Reader

__all__ = ["StreamReader"]


class StreamReader(Reader):
    """``open()`` returns a fresh iterable of the epoch's elements, in order."""

    def __init__(self, open: Callable[[], Iterable[Any]], name: str, identity: str) -> None:
        self._open = open
        self.name = name
        self._identity = identity

    def stream(self) -> Iterator[Any]:
        return iter(self._open())

    def identity(self) -> str:
        return self._identity

    def describe(self) -> str:
        return (
            f"stream: every slot walks {self.name} and keeps its own positions "
            "(skipping in C, decoding only what it keeps)"
        )
