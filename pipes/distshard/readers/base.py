"""The interface every reader implements.

A reader knows how to produce the elements at positions of one epoch's stream;
the engine decides which positions a slot reads. Three shapes exist:

* random access (:class:`RandomAccessReader`): ``length()`` is known before
  reading and ``read(positions)`` yields the elements at any positions;
* a stream (``StreamReader``): ``length()`` is ``None`` and ``stream()`` yields every
  element in order, for the engine to skip through;
* whole units (``WholeUnitsReader``): ``select(slot, num_slots, skip)`` does the
  whole-unit split itself (its positions are not known in advance).

``identity()`` is a short string that is the same in every process for the same
source and usually differs for another: it is recorded in checkpoint states (a state
from another source is refused) and salts the seeds, so that two branches of one
pipeline do not shuffle alike. It must never depend on ``id()``, ``hash()`` of
strings or default ``repr``s, which differ between processes.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, Iterable, Iterator

__all__ = ["Reader", "RandomAccessReader", "stable_digest"]

_PRIMITIVES = (type(None), bool, int, float, str, bytes)


def _stable_text(value: Any, budget: list[int]) -> str | None:
    """A process-independent text for primitives and containers of them, or None."""
    budget[0] -= 1
    if budget[0] < 0:
        return None
    if isinstance(value, _PRIMITIVES):
        text = repr(value)
        return text if len(text) <= 200 else f"{text[:200]}...{len(text)}"
    if isinstance(value, (list, tuple)):
        parts = [_stable_text(v, budget) for v in value[:8]]
        texts = [part for part in parts if part is not None]
        return None if len(texts) < len(parts) else f"{type(value).__name__}({len(value)}:{','.join(texts)})"
    if isinstance(value, dict):
        items = []
        for k, v in list(value.items())[:8]:
            kt, vt = _stable_text(k, budget), _stable_text(v, budget)
            if kt is None or vt is None:
                return None
            items.append(f"{kt}:{vt}")
        return "{" + ",".join(items) + "}"
    return None


def stable_digest(*values: Any) -> str:
    """An 8-hex-digit digest of values, using only what is the same in every
    process: primitives and small containers of them by value, anything else by
    its type's qualified name."""
    texts = []
    for value in values:
        text = _stable_text(value, [64])
        texts.append(text if text is not None else f"<{type(value).__module__}.{type(value).__qualname__}>")
    return f"{zlib.crc32('|'.join(texts).encode()):08x}"


class Reader:
    """Base of all readers; see the module docstring."""

    #: what a state records as its ``mode``: ``element``, ``units`` or ``sized_units``
    mode = "element"

    def length(self) -> int | None:
        """The number of positions of the epoch, when known before reading."""
        return None

    def identity(self) -> str:
        """A short, process-independent identity of the source (see module docstring)."""
        raise NotImplementedError

    def describe(self) -> str:
        """One line for ``explain()``: how a slot reads this source."""
        raise NotImplementedError


class RandomAccessReader(Reader):
    """A reader that can produce the element at any position of ``[0, length())``."""

    #: read contiguous blocks per slot (instead of a stride) when not shuffled:
    #: right for sources where neighbours share a unit (a file, a row group)
    prefers_blocks = False

    def length(self) -> int:
        raise NotImplementedError

    def read(self, positions: Iterable[int], shuffled: bool = False) -> Iterator[Any]:
        """The elements at ``positions``, in that order. ``shuffled`` says the
        positions come in a permuted order (for readers that cache by locality)."""
        raise NotImplementedError

    def order(self, seed: int) -> Callable[[int], int]:
        """The permutation ``shuffle=True`` visits positions in: a global one by default."""
        from ..plan import Permutation

        return Permutation(self.length(), seed)

    #: what ``order`` is, for ``explain()``
    shuffle_kind = "a global permutation of every position (each element read once)"
