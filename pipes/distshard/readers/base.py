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

from typing import Any, Callable, Iterable, Iterator, Sequence

from ..digests import stable_digest

__all__ = ["Reader", "RandomAccessReader", "stable_digest"]


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

    def prefetch(self, slots: Sequence[Iterator[int]]) -> None:
        """Before a rank's DataLoader workers start: ``slots`` are the positions each
        of the rank's slots will read, in order (lazy: take only what is needed). A
        reader may fetch once here what the workers would each ask for, and keep it
        in what they get of it (see ``protocol.sequence_prefetch``). Nothing by default."""

    def order(self, seed: int) -> Callable[[int], int]:
        """The permutation ``shuffle=True`` visits positions in: a global one by default."""
        from ..plan import Permutation

        return Permutation(self.length(), seed)

    #: what ``order`` is, for ``explain()``
    shuffle_kind = "a global permutation of every position (each element read once)"
