"""Random access by index: lists, tuples, ranges, tensors, numpy arrays, HF
``datasets.Dataset``, ``distshard.positional(...)`` and file sources with an index."""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable, Iterable, Iterator, Sequence

from ..protocol import (
    sequence_blocks,
    sequence_description,
    sequence_identity,
    sequence_order,
    sequence_prefetch,
    sequence_reader,
    sequence_shuffle_kind,
)
from .base import RandomAccessReader, stable_digest

__all__ = ["SequenceReader", "DEEPCOPY_WARNING", "ElementCopier"]

DEEPCOPY_WARNING = (
    "The input iterable can not be deepcopied, please be aware of in-place modification would affect source data."
)

# types that copy.deepcopy returns as they are
_ATOMIC = frozenset({type(None), bool, int, float, complex, str, bytes})


def _deepcopy(element: Any) -> Any:
    """``copy.deepcopy(element)``, without its per-object bookkeeping for the common
    shapes of records (about 10x faster): an atomic value is returned as is, and a
    plain dict, list or tuple of atomic values is copied one level (which is all
    deepcopy does to it). Anything else goes to ``copy.deepcopy``."""
    kind = type(element)
    if kind in _ATOMIC:
        return element
    if kind is dict:
        if _ATOMIC.issuperset(map(type, element.values())) and _ATOMIC.issuperset(map(type, element)):
            return dict(element)
    elif kind is tuple or kind is list:
        if _ATOMIC.issuperset(map(type, element)):
            return element if kind is tuple else list(element)
    return copy.deepcopy(element)


class ElementCopier:
    """Deep-copies an element (see ``_deepcopy``); one that cannot be copied is
    returned as is, with torch's ``IterableWrapper`` warning, once per copier."""

    __slots__ = ("warned",)

    def __init__(self) -> None:
        self.warned = False

    def __call__(self, element: Any) -> Any:
        try:
            return _deepcopy(element)
        except TypeError:
            if not self.warned:
                warnings.warn(DEEPCOPY_WARNING, stacklevel=3)
                self.warned = True
            return element


class SequenceReader(RandomAccessReader):
    """Reads ``sequence[p]`` for each position ``p``.

    ``copy_elements`` deep-copies each element read, as ``IterableWrapper(deepcopy=True)``
    copies its whole iterable (here only what a slot yields is copied).

    A sequence may read many positions at once and choose its shuffle order
    (distshard's file sources do, to read ahead in large ranges):
    ``sequence.distshard_read(positions, shuffled)`` is then called with the
    whole iterator of a slot's positions instead of one ``[]`` per position, and
    ``sequence.distshard_order(seed)`` gives the permutation ``shuffle=True``
    visits (``sequence.distshard_shuffle_kind`` says what it is).
    """

    def __init__(self, sequence: Any, copy_elements: bool = False) -> None:
        self.sequence = sequence
        self.copy_elements = copy_elements
        # sources whose neighbours share a file (distshard's file sources) ask for blocks
        self.prefers_blocks = sequence_blocks(sequence)
        kind = sequence_shuffle_kind(sequence)
        if kind is not None:
            self.shuffle_kind = kind

    def length(self) -> int:
        return len(self.sequence)

    def identity(self) -> str:
        sequence = self.sequence
        own = sequence_identity(sequence)
        if own is not None:
            return own
        n = len(sequence)
        sample: tuple = ()
        if type(sequence) in (list, tuple, range) and n:  # builtins only: indexing them reads nothing
            sample = (sequence[0], sequence[n // 2], sequence[-1])
        return f"sequence:{type(sequence).__qualname__}:{n}:{stable_digest(*sample)}"

    def describe(self) -> str:
        what = sequence_description(self.sequence)
        if what is None:
            what = f"{type(self.sequence).__name__} of {len(self.sequence)}"
        return f"random access into {what}: each slot indexes its own positions (read once, O(1) to resume)"

    def order(self, seed: int) -> Callable[[int], int]:
        own = sequence_order(self.sequence, seed)
        return own if own is not None else super().order(seed)

    def prefetch(self, slots: Sequence[Iterator[int]]) -> None:
        own = sequence_prefetch(self.sequence)
        if own is not None:
            own(slots)

    def read(self, positions: Iterable[int], shuffled: bool = False) -> Iterator[Any]:
        many = sequence_reader(self.sequence)
        if many is not None and not self.copy_elements:
            return many(positions, shuffled)
        return self._read_each(positions)

    def _read_each(self, positions: Iterable[int]) -> Iterator[Any]:
        sequence = self.sequence
        if not self.copy_elements:
            for position in positions:
                yield sequence[position]
            return
        copied = ElementCopier()
        for position in positions:
            yield copied(sequence[position])
