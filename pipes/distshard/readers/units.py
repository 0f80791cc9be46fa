"""Unit mode readers: the stream holds units (files, shards, URLs) and
``expand(unit)`` gives a unit's elements.

Without ``sizes`` a slot reads the unit stream (cheap: paths) in rounds of
``num_slots`` units and expands only the unit of each whole round that is its own;
the units of the last, incomplete round are split element-wise, each among at
most ``ceil(num_slots / leftover)`` slots (``plan.leftover_share``).

With ``sizes`` the global element index space is known, so the split is exact
and balanced: each slot owns a contiguous block of it (``plan.block_range``) and
reads just the units its block covers, or, with ``shuffle=True``, the positions
of a seeded permutation of it.

When ``expand`` returns a sequence (``__len__`` + ``__getitem__``) a slot indexes
its elements; when it returns an iterator, a slot that starts inside a unit skips
with ``itertools.islice`` (decoding only what the iterator itself forces).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Mapping
from itertools import islice
from typing import Any, Callable, Iterable, Iterator, Sequence

from ..errors import OptionError, OptionTypeError, SourceDataError
from ..plan import UnitOrder, leftover_share
from .base import RandomAccessReader, Reader, stable_digest

Expand = Callable[[Any], Any]
Sizes = Sequence[int] | Mapping[Any, int] | Callable[[Any], int]

__all__ = [
    "SizedUnitsReader",
    "WholeFilesReader",
    "WholeUnitsReader",
    "check_sizes",
    "unit_sizes",
    "iterate_whole_units",
    "iterate_sized_units",
]


def _is_sequence(value: Any) -> bool:
    return hasattr(value, "__len__") and hasattr(value, "__getitem__") and not isinstance(value, Mapping)


def check_sizes(sizes: object) -> Sizes | None:
    """Validate the ``sizes`` argument at construction (types and sign of a sequence)."""
    if sizes is None or callable(sizes) or isinstance(sizes, Mapping):
        return sizes  # a callable or a mapping: its counts are checked per unit
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Iterable) or not _is_sequence(sizes):
        raise OptionTypeError(
            f"sizes={sizes!r} must be a sequence of per-unit element counts aligned with "
            "the units, a mapping unit -> count, or a callable unit -> count"
        )
    return [_check_size(size, f"sizes[{index}]") for index, size in enumerate(sizes)]


def _check_size(size: object, where: str) -> int:
    if isinstance(size, bool) or not isinstance(size, int):
        raise OptionTypeError(f"{where}={size!r} must be an int element count")
    if size < 0:
        raise OptionError(f"{where}={size} is negative; a unit holds 0 or more elements")
    return size


def unit_sizes(units: list, sizes: Sizes) -> list[int]:
    """The element count of every unit, checked against ``units``."""
    if isinstance(sizes, Mapping):
        missing = [u for u in units if u not in sizes]
        if missing:
            raise OptionError(f"sizes has no entry for unit {missing[0]!r}; give every unit a count")
        return [_check_size(sizes[u], f"sizes[{u!r}]") for u in units]
    if callable(sizes):
        return [_check_size(sizes(u), f"sizes({u!r})") for u in units]
    if len(sizes) != len(units):
        raise OptionError(
            f"sizes has {len(sizes)} entries but the stream has {len(units)} units; give one "
            "count per unit, in the order the units reach dist_shard (or a callable unit -> count)"
        )
    return list(sizes)


def _mismatch(unit: Any, got: str, size: int) -> ValueError:
    return SourceDataError(
        f"unit {unit!r} has {got} elements but sizes says {size}; fix sizes for this unit "
        "(sizes must count exactly what expand(unit) yields)"
    )


def _expand(expand: Expand, unit: Any) -> Any:
    """``expand(unit)`` as a sequence (kept) or an iterator; a ``TypeError`` naming
    the unit if it returned something that is neither."""
    got = expand(unit)
    if _is_sequence(got):
        return got
    try:
        return iter(got)
    except TypeError:
        raise OptionTypeError(
            f"expand({unit!r}) returned {type(got).__name__}, which is not iterable; expand "
            "must return the unit's elements, as a sequence (best) or an iterator"
        ) from None


def _elements(expand: Expand, unit: Any, start: int, stop: int | None, size: int | None) -> Iterator[Any]:
    """Elements ``[start, stop)`` of ``expand(unit)``; with ``size``, check the unit
    has exactly that many (never yielding past ``size``)."""
    got = _expand(expand, unit)
    if _is_sequence(got):
        if size is not None and len(got) != size:
            raise _mismatch(unit, str(len(got)), size)
        for index in range(start, len(got) if stop is None else stop):
            yield got[index]
        return
    end = size if stop is None else stop
    count = start
    for element in islice(got, start, end):
        count += 1
        yield element
    if size is not None:
        if count < end:  # type: ignore[operator]
            raise _mismatch(unit, f"only {count}", size)
        if end == size and next(got, _NOTHING) is not _NOTHING:
            raise _mismatch(unit, f"more than {size}", size)


_NOTHING = object()


def _strided(expand: Expand, unit: Any, first: int, step: int) -> Iterator[Any]:
    """Elements ``first, first + step, ...`` of ``expand(unit)``."""
    got = _expand(expand, unit)
    if _is_sequence(got):
        for index in range(first, len(got), step):
            yield got[index]
    else:
        yield from islice(got, first, None, step)


def iterate_whole_units(
    units: Iterable[Any], expand: Expand, slot: int, num_slots: int, skip: int = 0
) -> Iterator[Any]:
    """Unit mode without sizes; ``skip`` resumes after the slot's first ``skip``
    elements (whole units it owns are skipped by length when ``expand`` returns a
    sequence, never decoded).

    Holds at most ``num_slots`` units (not elements) while it looks for the end
    of a round.
    """
    buffer: list[Any] = []
    for unit in units:
        buffer.append(unit)
        if len(buffer) == num_slots:
            got = _expand(expand, buffer[slot])
            buffer = []
            if _is_sequence(got):
                if skip >= len(got):
                    skip -= len(got)
                    continue
                yield from (got[i] for i in range(skip, len(got)))
                skip = 0
            else:
                for element in got:
                    if skip:
                        skip -= 1
                    else:
                        yield element
    if buffer:
        index, offset, step = leftover_share(slot, num_slots, len(buffer))
        yield from islice(_strided(expand, buffer[index], offset, step), skip, None)


def _runs(positions: Iterable[int]) -> Iterator[tuple[int, int]]:
    """Group increasing consecutive positions into ``[start, stop)`` runs."""
    start = stop = None
    for position in positions:
        if position == stop:
            stop += 1
            continue
        if start is not None:
            yield start, stop  # type: ignore[misc]
        start, stop = position, position + 1
    if start is not None:
        yield start, stop  # type: ignore[misc]


def iterate_sized_units(
    units: list,
    sizes: list[int],
    expand: Expand,
    positions: Iterable[int],
    shuffled: bool,
) -> Iterator[Any]:
    """Unit mode with sizes: the elements at ``positions`` of the global element
    index space (the units' elements laid end to end).

    Unshuffled, the positions form a contiguous block (plus, for ``even="pad"``, one
    repeated element), read unit range by unit range. ``shuffled`` positions come in
    any order and are read one by one from a sequence-returning ``expand``, keeping
    the 16 most recently used units expanded.
    """
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)

    def locate(position: int) -> int:
        return bisect.bisect_right(offsets, position) - 1

    if shuffled:
        cache: OrderedDict[int, Any] = OrderedDict()
        for position in positions:
            unit = locate(position)
            if unit not in cache:
                got = _expand(expand, units[unit])
                if not _is_sequence(got):
                    raise OptionTypeError(
                        f"expand({units[unit]!r}) returned {type(got).__name__}, not a sequence; "
                        "shuffle=True in unit mode reads single elements, so expand must return "
                        "something with __len__ and __getitem__ (or use shuffle=False)"
                    )
                if len(got) != sizes[unit]:
                    raise _mismatch(units[unit], str(len(got)), sizes[unit])
                cache[unit] = got
                if len(cache) > 16:
                    cache.popitem(last=False)
            else:
                cache.move_to_end(unit)
            yield cache[unit][position - offsets[unit]]
        return

    for start, stop in _runs(positions):
        unit = locate(start)
        while unit < len(units) and offsets[unit] < stop:
            lo = max(start, offsets[unit]) - offsets[unit]
            hi = min(stop, offsets[unit + 1]) - offsets[unit]
            if hi > lo:
                yield from _elements(expand, units[unit], lo, hi, sizes[unit])
            unit += 1


class WholeUnitsReader(Reader):
    """Units without sizes: whole units by rounds, the leftover split element-wise.

    ``open_units()`` returns a fresh iterable of the units (cheap: paths)."""

    mode = "units"

    def __init__(self, open_units: Callable[[], Iterable[Any]], expand: Expand, identity: str) -> None:
        self._open_units = open_units
        self.expand = expand
        self._identity = identity

    def identity(self) -> str:
        return self._identity

    def describe(self) -> str:
        return (
            "units without sizes: whole units go to slots round by round; the leftover units "
            "are split element-wise among a few slots"
        )

    def select(self, slot: int, num_slots: int, skip: int) -> Iterator[Any]:
        return iterate_whole_units(self._open_units(), self.expand, slot, num_slots, skip)


class WholeFilesReader(WholeUnitsReader):
    """Units that can only be streamed whole (compressed files): slot ``s`` of
    ``S`` streams units ``s, s + S, ...``, so each unit is read (decompressed)
    once over the cluster and none is split; slot counts differ, and ``even``
    and ``shuffle=True`` do not apply. ``skip`` resumes by streaming past what
    the slot yielded."""

    def __init__(
        self, open_units: Callable[[], Iterable[Any]], expand: Expand, identity: str, description: str = ""
    ) -> None:
        super().__init__(open_units, expand, identity)
        self.description = description

    def describe(self) -> str:
        return self.description or (
            "whole units only: slot s streams units s, s + num_slots, ..., each read "
            "once over the cluster (slot counts differ)"
        )

    def select(self, slot: int, num_slots: int, skip: int) -> Iterator[Any]:
        def elements() -> Iterator[Any]:
            for unit in islice(self._open_units(), slot, None, num_slots):
                yield from _expand(self.expand, unit)

        return islice(elements(), skip, None)


class SizedUnitsReader(RandomAccessReader):
    """Units with per-unit element counts: random access into the element space."""

    mode = "sized_units"
    prefers_blocks = True

    def __init__(self, units: list, sizes: list[int], expand: Expand) -> None:
        self.units = units
        self.sizes = sizes
        self.expand = expand
        self._total = sum(sizes)

    def length(self) -> int:
        return self._total

    def identity(self) -> str:
        return f"sized_units:{len(self.units)}:{self._total}:{stable_digest(self.units, self.sizes)}"

    def describe(self) -> str:
        return (
            f"{len(self.units)} units with sizes ({self._total} elements): each slot reads a "
            "contiguous block of the element space, touching only the units it covers"
        )

    shuffle_kind = (
        "units in a permuted order, each unit's elements in a permuted order: every slot "
        "expands each of its units about once"
    )

    def order(self, seed: int) -> UnitOrder:
        return UnitOrder(self.sizes, seed)

    def read(self, positions: Iterable[int], shuffled: bool = False) -> Iterator[Any]:
        return iterate_sized_units(self.units, self.sizes, self.expand, positions, shuffled)

    def check_empty_units(self) -> None:
        """Check that units declared empty are (no slot's block reads them)."""
        for unit, size in zip(self.units, self.sizes, strict=True):
            if size == 0:
                for _ in _elements(self.expand, unit, 0, None, 0):
                    pass
