"""What is left of an epoch (resume, elastic resume): :class:`Remaining`, an ordered
set of positions as intervals, and what a run of each split leaves when its slots
consumed their first positions."""

from __future__ import annotations

from itertools import islice
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

from ..errors import OptionError, StateMismatchError
from .slots import Even, slot_count
from .splits import block_range, chunk_slot

T = TypeVar("T")

_END = object()


# -- what is left of an epoch (resume, elastic resume) ------------------------------------


class Remaining:
    """An ordered set of indices: disjoint, increasing ``[start, stop)`` intervals,
    the last of which may be open (``stop=None``: up to the end of the stream).

    An epoch starts as ``[0, None)``: every position. After an interrupted run the
    part not yet consumed is such a set, and the next run splits *it* among its
    slots exactly as a fresh run splits ``[0, N)``: the ``j``-th remaining index is
    the ``j``-th position of the new run.
    """

    __slots__ = ("intervals",)

    def __init__(self, intervals: Iterable[tuple[int, int | None]] = ((0, None),)) -> None:
        merged: list[tuple[int, int | None]] = []
        for start, stop in intervals:
            if stop is not None and stop <= start:
                continue
            if merged:
                last_start, last_stop = merged[-1]
                if last_stop is None or start < last_stop:
                    raise OptionError(f"intervals overlap or are out of order at [{start}, {stop})")
                if start == last_stop:
                    merged[-1] = (last_start, stop)
                    continue
            if start < 0:
                raise OptionError(f"interval [{start}, {stop}) starts below 0")
            merged.append((start, stop))
        self.intervals = merged

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Remaining) and self.intervals == other.intervals

    def __repr__(self) -> str:
        return f"Remaining({self.intervals})"

    @property
    def is_full(self) -> bool:
        return self.intervals == [(0, None)]

    def clip(self, total: int) -> "Remaining":
        """The same set with every index ``>= total`` removed (closes an open end)."""
        return Remaining(
            (start, total if stop is None or stop > total else stop) for start, stop in self.intervals if start < total
        )

    def length(self) -> int | None:
        """How many indices, or ``None`` if the last interval is open."""
        if self.intervals and self.intervals[-1][1] is None:
            return None
        return sum(stop - start for start, stop in self.intervals if stop is not None)

    def index(self, j: int) -> int:
        """The ``j``-th index of the set (0-based)."""
        for start, stop in self.intervals:
            if stop is None or j < stop - start:
                return start + j
            j -= stop - start
        raise IndexError("index beyond the remaining set")

    def indexer(self) -> Callable[[int], int]:
        """``index`` in O(log intervals) per call, for many calls."""
        if self.is_full:
            return int
        starts, firsts, j = [], [], 0
        for start, stop in self.intervals:
            starts.append(start)
            firsts.append(j)
            j += (stop - start) if stop is not None else 0
        import bisect

        def index(j: int) -> int:
            k = bisect.bisect_right(firsts, j) - 1
            return starts[k] + j - firsts[k]

        return index

    def stream(self, items: Iterable[T]) -> Iterator[T]:
        """The items of ``items`` at the indices of this set, in order (skipping in C)."""
        it = iter(items)
        if self.is_full:
            yield from it
            return
        position = 0
        for start, stop in self.intervals:
            if start > position and next(islice(it, start - position - 1, None), _END) is _END:
                return
            if stop is None:
                yield from it
                return
            yield from islice(it, stop - start)
            position = stop

    def compose(self, inner: "Remaining") -> "Remaining":
        """The indices of this set picked by ``inner``, which counts *within* this set."""
        out: list[tuple[int, int | None]] = []
        offsets = []  # (first j of interval, interval)
        j = 0
        for start, stop in self.intervals:
            offsets.append((j, start, stop))
            j += (stop - start) if stop is not None else 0
        for a, b in inner.intervals:
            for first, start, stop in offsets:
                length = None if stop is None else stop - start
                lo = max(a, first)
                hi = b if length is None else (first + length if b is None else min(b, first + length))
                if hi is not None and hi <= lo:
                    continue
                out.append((start + lo - first, None if hi is None else start + hi - first))
        return Remaining(out)

    def to_list(self) -> list[list[int | None]]:
        return [[start, stop] for start, stop in self.intervals]


MAX_BAND = 10_000_000  # positions a merge may list one by one between the slowest and fastest slot


def left_after_round_robin(taken: Sequence[int], num_slots: int) -> Remaining:
    """What is left when slot ``s`` of a round-robin split consumed its first
    ``taken[s]`` positions (counted within the set being split)."""
    if len(taken) != num_slots:
        raise OptionError(f"need one count per slot: {len(taken)} counts for {num_slots} slots")
    low, high = min(taken), max(taken)
    spread = sum(high - count for count in taken)
    if spread > MAX_BAND:
        raise StateMismatchError(
            f"the slots' counts differ by too much to merge ({spread} positions between the slowest "
            f"slot at {low} and the fastest at {high}): such states do not come from one run of one "
            "pipeline; merge the states every slot saved at the same step"
        )
    band = [(j, j + 1) for j in range(low * num_slots, high * num_slots) if j // num_slots >= taken[j % num_slots]]
    return Remaining(band + [(high * num_slots, None)])


def left_after_blocks(taken: Sequence[int], num_slots: int, total: int, even: Even, multiple: int = 1) -> Remaining:
    """What is left when slot ``s`` of a block split of ``total`` positions consumed
    the first ``taken[s]`` positions of its block (``drop``'s tail stays left)."""
    if len(taken) != num_slots:
        raise OptionError(f"need one count per slot: {len(taken)} counts for {num_slots} slots")
    pieces = []
    for slot, count in enumerate(taken):
        start, stop = block_range(slot, num_slots, total, even, multiple)
        pieces.append((start + count, stop))
    if even == "drop":
        pieces.append((num_slots * slot_count(0, num_slots, total, even, multiple), total))
    return Remaining(pieces)


def left_after_chunks(
    taken: Sequence[int], world_size: int, num_workers: int, total: int | None, multiple: int
) -> Remaining:
    """What is left when slot ``rank * num_workers + worker`` of a chunk-layout run
    over ``total`` positions consumed its first ``taken[slot]`` positions (the
    dropped tail stays left)."""
    num_slots = world_size * num_workers
    if len(taken) != num_slots:
        raise OptionError(f"need one count per slot: {len(taken)} counts for {num_slots} slots")
    chunks = None if total is None else total // multiple // num_slots
    done = [0] * num_slots  # per chunk-slot: consumed positions
    for slot, count in enumerate(taken):
        rank, worker = divmod(slot, num_workers)
        done[chunk_slot(rank, world_size, worker)] = count
    low = min(done) // multiple
    high = -(-max(done) // multiple)
    if chunks is not None:
        high = min(chunks, high)
    if (high - low) * num_slots > MAX_BAND:
        raise StateMismatchError(
            f"the slots' counts differ by too much to merge ({high - low} rounds of chunks between the "
            "slowest and the fastest slot): such states do not come from one run of one pipeline"
        )
    pieces: list[tuple[int, int | None]] = []
    for j in range(low, high):
        for c in range(num_slots):
            start = (j * num_slots + c) * multiple
            used = min(multiple, max(0, done[c] - j * multiple))
            if used < multiple:
                pieces.append((start + used, start + multiple))
    pieces.append((max(low, high) * num_slots * multiple, total))
    return Remaining(pieces)


LeftAfter = Callable[[Sequence[int], int], "Remaining"]  # (taken per slot, positions split) -> what is left
