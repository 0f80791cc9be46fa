"""Pure arithmetic of the partition: which slot owns which position, how many
elements each slot yields under every ``even`` mode, what ``"pad"`` repeats, and
the streaming selector that does all of this without knowing the stream length.

Nothing here imports torch; everything is property-tested in ``tests/test_plan.py``.

Terms
-----
*position*
    The 0-based index of an element in the stream that reaches ``dist_shard``
    (never its value).
*slot*
    One of the ``num_slots = world_size * num_workers`` copies of the pipeline;
    ``slot = rank * num_workers + worker_id``.
*round*
    Positions ``[q * num_slots, (q + 1) * num_slots)``; slot ``s`` owns the
    position ``q * num_slots + s`` of every round.
"""

from __future__ import annotations

import itertools
from collections import deque
from itertools import islice
from typing import Any, Callable, Iterable, Iterator, Literal, Sequence, TypeVar

from .digests import mix_seed
from .errors import DistshardError, OptionError, OptionTypeError, StateMismatchError

T = TypeVar("T")

Even = Literal["drop", "pad", "carry"] | None
EVEN_MODES: tuple[Even, ...] = (None, "drop", "pad")  # the modes that keep each epoch to itself
CARRY: Literal["carry"] = "carry"  # the epochs form one stream (see "carry" below)
ALL_EVEN_MODES: tuple[Even, ...] = (*EVEN_MODES, CARRY)

_END = object()


def check_even(even: object) -> Even:
    """Return ``even`` if it is a known mode, else raise ``ValueError`` naming it."""
    if even is None or (isinstance(even, str) and even in ("drop", "pad", CARRY)):
        return even  # type: ignore[return-value]
    raise OptionError(
        f"even={even!r} is not a known mode; use even=None (keep every element, slot "
        "counts differ by at most 1), even='drop' (every slot yields N // S, the last "
        "N % S elements are dropped), even='pad' (every slot yields ceil(N / S), "
        "repeating a few elements from the start of the epoch) or even='carry' (every slot "
        "yields the same count, an epoch's tail opens the next epoch: nothing dropped or repeated)"
    )


def check_multiple(multiple_of: object, even: Even) -> int:
    """Validate ``multiple_of`` (an int >= 1; above 1 only with ``even="drop"`` or
    ``"carry"``)."""
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, int):
        raise OptionTypeError(f"multiple_of={multiple_of!r} must be an int (the batch size after the shard)")
    if multiple_of < 1:
        raise OptionError(f"multiple_of={multiple_of} must be at least 1")
    if multiple_of > 1 and even not in ("drop", CARRY):
        raise OptionError(
            f"multiple_of={multiple_of} needs even='drop' or even='carry' (got even={even!r}): it makes "
            "every slot's count a multiple of the batch size, dropping the rest ('drop') or carrying it "
            "into the next epoch ('carry')"
        )
    return multiple_of


def slot_of(position: int, num_slots: int) -> int:
    """The slot that owns ``position``."""
    return position % num_slots


def slot_count(slot: int, num_slots: int, total: int, even: Even, multiple: int = 1) -> int:
    """How many elements ``slot`` yields from a stream of ``total`` elements;
    ``even="drop"`` with ``multiple`` rounds that down to a multiple of it."""
    if even == "drop":
        return total // num_slots // multiple * multiple
    if even == "pad":
        return -(-total // num_slots)
    return total // num_slots + (1 if slot < total % num_slots else 0)


def dropped_count(num_slots: int, total: int, even: Even, multiple: int = 1) -> int:
    """How many elements of the stream no slot yields (only ``even="drop"`` drops)."""
    return total - num_slots * slot_count(0, num_slots, total, even, multiple) if even == "drop" else 0


def pad_position(slot: int, num_slots: int, total: int) -> int | None:
    """The position ``slot`` repeats at the end of the epoch under ``even="pad"``.

    ``None`` when the slot needs no padding. When the stream is at least one
    round long, a slot pads with its own first element (so a slot holds a single
    element for it); in the degenerate case ``total < num_slots`` a slot that owns
    nothing repeats position ``slot % total``. Either way fewer than ``num_slots``
    elements are repeated in total.
    """
    rest = total % num_slots
    if total == 0 or rest == 0 or slot < rest:
        return None
    return slot if total >= num_slots else slot % total


def padded_count(num_slots: int, total: int, even: Even) -> int:
    """How many repeated elements ``even="pad"`` adds over all slots."""
    if even != "pad" or total == 0 or total % num_slots == 0:
        return 0
    return num_slots - total % num_slots


def slot_positions(
    slot: int, num_slots: int, total: int, even: Even, skip: int = 0, multiple: int = 1
) -> Iterator[int]:
    """The positions ``slot`` yields, in order, when the stream length is known;
    ``skip`` drops the first ``skip`` of them in O(1)."""
    own = slot_count(slot, num_slots, total, even if even == "drop" else None, multiple)
    yield from range(slot, slot + own * num_slots, num_slots)[skip:]
    if even == "pad" and skip <= own:
        pad = pad_position(slot, num_slots, total)
        if pad is not None:
            yield pad


def _nth(it: Iterator[T], skip: int) -> T | object:
    """Skip ``skip`` items of ``it`` and return the next one, or ``_END``."""
    if skip == 0:
        return next(it, _END)
    return next(islice(it, skip, skip + 1), _END)


def _advance(it: Iterator[T], count: int) -> tuple[int, Any]:
    """Consume up to ``count`` items of ``it`` (in C); return how many there were
    and the last one (``_END`` if none)."""
    if count <= 0:
        return 0, _END
    last = deque(zip(islice(it, count), itertools.count(1)), maxlen=1)
    if not last:
        return 0, _END
    element, consumed = last[0]
    return consumed, element


class StreamTooShort(DistshardError, ValueError):
    """A resumed slot's state claims more of the stream than the stream holds."""


def _too_short(slot: int, num_slots: int, taken: int, seen: int) -> StreamTooShort:
    return StreamTooShort(
        f"the state says slot {slot} of {num_slots} already yielded {taken} elements, but the "
        f"stream it resumes holds {f'only {seen}' if seen >= 0 else 'fewer'} elements where that slot's share lies: the state "
        "comes from other data or was altered; resume from a state this pipeline saved"
    )


def select_stream(items: Iterable[T], slot: int, num_slots: int, even: Even, skip_rounds: int = 0) -> Iterator[T]:
    """Yield ``slot``'s share of ``items`` without knowing how many there are.

    Yields exactly what ``slot_positions`` would pick. Skipping is done by
    ``itertools.islice`` in C, so the Python work is a constant per round of
    ``num_slots`` elements. Memory: ``even=None`` and ``"drop"`` hold one element;
    ``"pad"`` holds one element (the slot's first, to repeat) plus, only while the
    stream is shorter than ``slot + 1`` elements, the up to ``slot`` elements
    before it (the degenerate case ``N < num_slots``, where a slot that owns
    nothing must repeat an earlier element).

    ``skip_rounds=k`` resumes after the slot's first ``k`` yielded elements: the
    first ``k`` rounds are skipped unread (but for the element ``"pad"`` may have to
    repeat), and the stream must hold them: if it ends before the slot's ``k``-th
    element (or, under ``"pad"``, before the round where the slot padded), the
    state does not belong to this stream and :class:`StreamTooShort` is raised
    before anything is yielded.
    """
    it = iter(items)
    if skip_rounds == 0:
        yield from _select_fresh(it, slot, num_slots, even)
        return
    done, pad = _skip_consumed(it, slot, num_slots, even, skip_rounds)
    if not done:
        yield from _select_after(it, pad, slot, num_slots, even)


def _select_fresh(it: Iterator[T], slot: int, num_slots: int, even: Even) -> Iterator[T]:
    """``select_stream`` from the start of the stream."""
    pad: Any = _END
    if even is None:
        yield from islice(it, slot, None, num_slots)
        return
    if even == "pad":
        head = list(islice(it, slot))
        mine = next(it, _END)
        if mine is _END:
            if head:  # degenerate N < num_slots: repeat an earlier element
                yield head[slot % len(head)]
            return
        del head
        pad = mine
    else:
        mine = _nth(it, slot)
        if mine is _END:
            return
    yield from _rounds(it, mine, pad, slot, num_slots, even)


def _skip_consumed(it: Iterator[Any], slot: int, num_slots: int, even: Even, k: int) -> tuple[bool, Any]:
    """Skip the slot's first ``k`` rounds (``k >= 1``) of ``select_stream``, up to right
    after its ``k``-th element; ``(done, pad)``: ``done`` when the slot has nothing
    left, ``pad`` the element ``"pad"`` repeats (its first). :class:`StreamTooShort`
    if the stream lacks what the slot yielded."""
    pad: Any = _END
    if even == "pad":
        seen, pad = _advance(it, slot + 1)
        if seen < slot + 1:
            if k == 1 and seen > 0:
                return True, pad  # N < num_slots: this slot repeated an earlier element, and is done
            raise _too_short(slot, num_slots, k, seen)
        if k > 1:
            more, _ = _advance(it, (k - 1) * num_slots)
            if more < (k - 1) * num_slots:
                seen += more
                if seen > (k - 1) * num_slots:
                    return True, pad  # the last round lacked this slot's element: it yielded its pad
                raise _too_short(slot, num_slots, k, seen)
    else:
        want = (k - 1) * num_slots + slot + 1
        seen, _ = _advance(it, want)
        if seen < want:
            raise _too_short(slot, num_slots, k, seen)
    return False, pad


def _select_after(it: Iterator[T], pad: Any, slot: int, num_slots: int, even: Even) -> Iterator[T]:
    """``select_stream`` from right after the slot's element at ``(k - 1) * num_slots + slot``."""
    if even is None:
        yield from islice(it, num_slots - 1, None, num_slots)
        return
    after = num_slots - 1 - slot
    if after and _nth(it, after - 1) is _END:
        return  # the stream ended inside the round of the last element yielded
    start = next(it, _END)
    if start is _END:
        return  # it ended on the boundary of the consumed rounds
    mine = start if slot == 0 else _nth(it, slot - 1)
    if mine is _END:
        if even == "pad":
            yield pad
        return
    yield from _rounds(it, mine, pad, slot, num_slots, even)


def _rounds(it: Iterator[T], mine: Any, pad: Any, slot: int, num_slots: int, even: Even) -> Iterator[T]:
    """The round loop of ``select_stream``, from the slot's element ``mine``."""
    after = num_slots - 1 - slot  # elements of a round that come after ours
    while True:
        # ``mine`` sits at q * S + slot; its round is complete iff q * S + S - 1 exists.
        if after and _nth(it, after - 1) is _END:
            if even == "pad":
                yield mine
            return
        yield mine
        start = next(it, _END)
        if start is _END:
            return  # the stream ended on a round boundary
        mine = start if slot == 0 else _nth(it, slot - 1)
        if mine is _END:
            if even == "pad":
                yield pad
            return


# -- chunks: whole batches in the order a DataLoader consumes them -----------------------


def chunk_slot(rank: int, world_size: int, worker_id: int) -> int:
    """The slot number of ``(rank, worker)`` in chunk layout (worker-major).

    torch's DataLoader takes a rank's batches from its workers in turn (step ``t``
    from worker ``t % K``). Giving chunk ``c`` of ``multiple`` positions to rank
    ``c % W`` and worker ``(c // W) % K``, that is to chunk-slot
    ``worker * W + rank`` of a round-robin over chunks, makes the batches all ranks
    train at one step the consecutive positions ``[t W b, (t + 1) W b)``: a mixed
    stream keeps its proportions per training step, not only per global window."""
    return worker_id * world_size + rank


def chunk_runs(
    rank: int, world_size: int, worker_id: int, num_workers: int, total: int, multiple: int, skip: int = 0
) -> Iterator[range]:
    """The positions a slot yields in chunk layout (``even="drop"``: whole rounds of
    chunks only), one range per chunk, skipping the first ``skip`` in O(1)."""
    num_slots = world_size * num_workers
    chunks = total // multiple // num_slots  # per slot
    first = chunk_slot(rank, world_size, worker_id)
    j, i = divmod(skip, multiple)
    while j < chunks:
        start = ((j * num_slots) + first) * multiple
        yield range(start + i, start + multiple)
        j, i = j + 1, 0


def chunk_positions(
    rank: int, world_size: int, worker_id: int, num_workers: int, total: int, multiple: int, skip: int = 0
) -> Iterator[int]:
    """:func:`chunk_runs`, position by position."""
    return itertools.chain.from_iterable(chunk_runs(rank, world_size, worker_id, num_workers, total, multiple, skip))


def select_chunks(
    items: Iterable[T], rank: int, world_size: int, worker_id: int, num_workers: int, multiple: int, skip: int = 0
) -> Iterator[T]:
    """:func:`chunk_positions` on a stream of unknown length: chunks of ``multiple``
    elements split round-robin over the chunk-slots, complete rounds only."""
    it = iter(items)
    chunks = zip(*([it] * multiple), strict=False)  # whole chunks; an incomplete last one is in the dropped tail
    skipped, into = divmod(skip, multiple)
    first = True
    for chunk in select_stream(
        chunks, chunk_slot(rank, world_size, worker_id), world_size * num_workers, "drop", skipped
    ):
        yield from (chunk[into:] if first else chunk)
        first = False
    if first and into:
        raise StreamTooShort(
            f"the state says this slot already yielded {skip} elements, in the middle of a chunk "
            "the stream does not hold: the state comes from other data or was altered"
        )


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


# -- contiguous blocks (unit mode with known sizes) ---------------------------------


def block_range(slot: int, num_slots: int, total: int, even: Even, multiple: int = 1) -> tuple[int, int]:
    """The contiguous positions ``[start, stop)`` ``slot`` owns in block layout.

    Used when the total is known up front (unit mode with ``sizes``), so that a
    slot reads one run of neighbouring elements and touches as few units as
    possible. ``even="drop"`` gives every slot ``total // num_slots`` and leaves the
    last ``total % num_slots`` positions out; otherwise the first
    ``total % num_slots`` slots get one more.
    """
    base, rest = divmod(total, num_slots)
    if even == "drop":
        base = base // multiple * multiple
        return slot * base, (slot + 1) * base
    start = slot * base + min(slot, rest)
    return start, start + base + (1 if slot < rest else 0)


def block_positions(
    slot: int, num_slots: int, total: int, even: Even, skip: int = 0, multiple: int = 1
) -> Iterator[int]:
    """The positions ``slot`` yields in block layout, padding included; ``skip``
    drops the first ``skip`` of them in O(1)."""
    start, stop = block_range(slot, num_slots, total, even, multiple)
    yield from range(start + skip, stop)
    if even == "pad" and total and total % num_slots and slot >= total % num_slots and skip <= stop - start:
        yield start if stop > start else slot % total


# -- units without sizes: whole rounds, then the leftover split ------------------------


def leftover_share(slot: int, num_slots: int, leftover: int) -> tuple[int, int, int]:
    """Which leftover unit ``slot`` helps read, and how.

    When the stream of units ends with ``leftover`` (``0 < leftover < num_slots``)
    units that do not make a whole round, the slots are cut into ``leftover``
    contiguous groups of ``floor`` or ``ceil(num_slots / leftover)`` slots; group
    ``j`` splits leftover unit ``j`` element-wise. Returns ``(j, index in the
    group, group size)``: the slot keeps elements ``index, index + size, ...`` of
    unit ``j``.
    """
    group = slot * leftover // num_slots
    first = -(-group * num_slots // leftover)
    after = -(-(group + 1) * num_slots // leftover)
    return group, slot - first, after - first


# -- a permutation of [0, n) in O(1) memory ---------------------------------------------


class Permutation:
    """A seeded pseudo-random bijection of ``[0, n)``, computed per index.

    A balanced Feistel network on the smallest even number of bits that covers
    ``n`` (so the domain is less than ``4 n``), made a bijection of ``[0, n)`` by
    cycle walking: an index whose image falls outside is mapped again until it
    lands inside (fewer than 4 steps on average). Memory is O(1) whatever ``n``.
    """

    ROUNDS = 4

    def __init__(self, n: int, seed: int) -> None:
        if n < 0:
            raise OptionError(f"n={n} must be non-negative")
        self.n = n
        bits = max(2, (max(n - 1, 1)).bit_length())
        bits += bits % 2
        self.half = bits // 2
        self.mask = (1 << self.half) - 1
        self.keys = [mix_seed(seed, r) for r in range(self.ROUNDS)]

    def _round(self, value: int, key: int) -> int:
        z = (value * 0x9E3779B97F4A7C15 + key) & 0xFFFFFFFFFFFFFFFF
        z ^= z >> 29
        z = (z * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        return (z ^ (z >> 32)) & self.mask

    def _encrypt(self, value: int) -> int:
        left, right = value >> self.half, value & self.mask
        for key in self.keys:
            left, right = right, left ^ self._round(right, key)
        return (left << self.half) | right

    def __call__(self, index: int) -> int:
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} is outside [0, {self.n})")
        value = self._encrypt(index)
        while value >= self.n:
            value = self._encrypt(value)
        return value

    def __len__(self) -> int:
        return self.n


class UnitOrder:
    """A seeded permutation of ``[0, sum(sizes))`` that keeps units together: the
    units in a permuted order, each unit's elements in a permuted order of their
    own. A run of consecutive visit indices touches one or two units, so a slot
    reading a block of them expands each unit about once (a global permutation
    would touch a different unit for nearly every element). Memory: O(units).
    """

    def __init__(self, sizes: Sequence[int], seed: int) -> None:
        import bisect

        self._bisect = bisect.bisect_right
        units = Permutation(len(sizes), mix_seed(seed, 1))
        self.order = [units(k) for k in range(len(sizes))]
        self.sizes = list(sizes)
        self.offsets = [0]
        for size in sizes:
            self.offsets.append(self.offsets[-1] + size)
        self.starts = [0]
        for unit in self.order:
            self.starts.append(self.starts[-1] + sizes[unit])
        self.seed = seed
        self._inner: tuple[int, Permutation] | None = None

    def __len__(self) -> int:
        return self.starts[-1]

    def __call__(self, index: int) -> int:
        if not 0 <= index < self.starts[-1]:
            raise IndexError(f"index {index} is outside [0, {self.starts[-1]})")
        k = self._bisect(self.starts, index) - 1
        unit = self.order[k]
        if self._inner is None or self._inner[0] != unit:
            self._inner = (unit, Permutation(self.sizes[unit], mix_seed(self.seed, 2, unit)))
        return self.offsets[unit] + self._inner[1](index - self.starts[k])


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
            if start > position and _nth(it, start - position - 1) is _END:
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


# -- carry: the epochs as one stream ---------------------------------------------------------
#
# Under ``even="carry"`` the epochs' own streams (each in its own order) are laid end to
# end: the *global position* of position ``p`` of epoch ``e``'s stream is ``e * N + p``.
# A *base* says where a run of epochs counts from: a :class:`Remaining` of global
# positions ending in an open interval (the part of the concatenation not consumed yet)
# and the epoch it opens, ``first``. The fresh base is ``[0, None)`` opening epoch 0, and
# then epoch ``e`` takes global positions ``[U floor(eN / U), U floor((e+1)N / U))`` with
# ``U = num_slots * multiple_of`` (one round of whole batches): every slot yields
# ``multiple_of * (floor((e+1)N / U) - floor(eN / U))`` and the tail of fewer than ``U``
# positions opens the next epoch. An elastic resume (a merged state) starts a new base
# at its own epoch; a new layout then counts whole rounds of its own ``U`` from there.


def carry_consumed(base: Remaining) -> int:
    """How many global positions below the base's open end are not in it (``Q``): its
    ``j``-th position for ``j >= len(finite part)`` is ``Q + j``."""
    start, stop = base.intervals[-1] if base.intervals else (0, 0)
    if stop is not None:
        raise OptionError(f"a carry base must end in an open interval, got {base}")
    return start - sum(b - a for a, b in base.intervals[:-1] if b is not None)


def carry_end(base: Remaining, epoch: int, length: int, unit: int) -> int:
    """The base index where ``epoch`` ends: as many whole rounds of ``unit`` as fit
    before the end of ``epoch``'s own stream (global position ``(epoch + 1) * length``)."""
    return max(0, ((epoch + 1) * length - carry_consumed(base)) // unit * unit)


def carry_window(base: Remaining, first: int, epoch: int, length: int, unit: int) -> tuple[int, int]:
    """The base indices ``[lo, hi)`` epoch ``epoch`` takes (a multiple of ``unit``).

    Defined by the epoch alone: the epoch the base opens starts at index 0, every later
    one where the one before it ends, in O(1)."""
    if epoch < first:
        raise OptionError(f"epoch {epoch} comes before epoch {first}, where this carry base starts")
    lo = 0 if epoch == first else carry_end(base, epoch - 1, length, unit)
    return lo, max(lo, carry_end(base, epoch, length, unit))


def carry_share(base: Remaining, first: int, epoch: int, length: int, num_slots: int, multiple: int = 1) -> int:
    """What every slot yields in ``epoch``."""
    lo, hi = carry_window(base, first, epoch, length, num_slots * multiple)
    return (hi - lo) // num_slots


def carry_after(base: Remaining, first: int, epoch: int, length: int, unit: int) -> Remaining:
    """The base that opens epoch ``epoch + 1`` once ``epoch`` ran with rounds of ``unit``."""
    _, hi = carry_window(base, first, epoch, length, unit)
    return base.compose(Remaining([(hi, None)]))


def stride_runs(
    rank: int, world_size: int, worker_id: int, num_workers: int, total: int, multiple: int = 1, skip: int = 0
) -> Iterator[range]:
    """The positions of ``[0, total)`` a slot yields under ``even="drop"`` in stride
    layout (every ``num_slots``-th), as one range, skipping the first ``skip``."""
    num_slots = world_size * num_workers
    slot = rank * num_workers + worker_id
    own = slot_count(slot, num_slots, total, "drop", multiple)
    yield range(slot, slot + own * num_slots, num_slots)[skip:]


def block_runs(
    rank: int, world_size: int, worker_id: int, num_workers: int, total: int, multiple: int = 1, skip: int = 0
) -> Iterator[range]:
    """The positions of ``[0, total)`` a slot yields under ``even="drop"`` in block
    layout (its contiguous block), as one range, skipping the first ``skip``."""
    start, stop = block_range(rank * num_workers + worker_id, world_size * num_workers, total, "drop", multiple)
    yield range(start + skip, stop)


LeftAfter = Callable[[Sequence[int], int], "Remaining"]  # (taken per slot, positions split) -> what is left


def carry_reads(window: Remaining, length: int, runs: Iterable[range]) -> Iterator[tuple[int, Iterator[int]]]:
    """Where a slot's ``runs`` of window indices lie in the epochs' streams:
    ``(epoch, positions in that epoch's stream)`` in order, one item per epoch met.

    ``window`` is the finite set of global positions the run splits (its ``j``-th
    position is window index ``j``). Everything is range arithmetic: O(intervals) per
    run, nothing per element. Consume each item's positions before asking for the next.
    """
    import bisect

    pieces: list[tuple[int, int, int]] = []  # (first window index, start, stop)
    j = 0
    for start, stop in window.intervals:
        if stop is None:
            raise OptionError("a carry window is finite")
        pieces.append((j, start, stop))
        j += stop - start
    firsts = [first for first, _, _ in pieces]

    def split(runs: Iterable[range]) -> Iterator[tuple[int, range]]:
        for run in runs:
            if not run:
                continue
            k = max(0, bisect.bisect_right(firsts, run[0]) - 1)
            while k < len(pieces) and pieces[k][0] <= run[-1]:
                first, start, stop = pieces[k]
                part = run[bisect.bisect_left(run, first) : bisect.bisect_left(run, first + stop - start)]
                shift = start - first
                positions = range(part.start + shift, part.stop + shift, part.step)
                while positions:
                    epoch = positions[0] // length
                    cut = bisect.bisect_left(positions, (epoch + 1) * length)
                    here = positions[:cut]
                    yield epoch, range(here.start - epoch * length, here.stop - epoch * length, here.step)
                    positions = positions[cut:]
                k += 1

    for epoch, group in itertools.groupby(split(runs), key=lambda item: item[0]):
        yield epoch, itertools.chain.from_iterable(positions for _, positions in group)


def carry_left(
    base: Remaining,
    first: int,
    epoch: int,
    length: int,
    left_after: LeftAfter,
    taken: Sequence[int],
    world_size: int,
    num_workers: int,
    multiple: int = 1,
) -> tuple[Remaining, int, bool]:
    """What is left when slot ``rank * num_workers + worker`` of a carry run of
    ``epoch`` over ``base`` consumed its first ``taken[slot]`` positions.

    ``left_after`` says what a run leaves: a function of ``(taken, positions split)``
    (the run's layout's ``left_after``, ``layouts.py``).
    Returns ``(base, first, finished)``: when every slot yielded its whole share the
    epoch is over and the result is the base opening ``epoch + 1`` (the tail it
    carries included); otherwise a base opening ``epoch`` that holds the positions
    no slot yielded, then the tail and everything after it (the next run, with any
    layout, takes as many whole rounds of its own as fit before the epoch's end)."""
    num_slots = world_size * num_workers
    if len(taken) != num_slots:
        raise OptionError(f"need one count per slot: {len(taken)} counts for {num_slots} slots")
    if first > epoch:  # a run of a state taken after its epoch ended: nothing was left to take
        return base, first, True
    unit = num_slots * multiple
    lo, hi = carry_window(base, first, epoch, length, unit)
    count = hi - lo
    share = count // num_slots
    over = [slot for slot, took in enumerate(taken) if took > share]
    if over:
        raise StateMismatchError(
            f"slot {over[0]}'s state says it yielded {taken[over[0]]} elements, but every slot's share of "
            f"epoch {epoch} is {share}: the state was altered or comes from another run"
        )
    if all(took == share for took in taken):
        return base.compose(Remaining([(hi, None)])), epoch + 1, True
    inner = left_after(taken, count)
    pieces = [(lo + a, lo + b) for a, b in inner.clip(count).intervals]  # type: ignore[operator]
    return base.compose(Remaining([*pieces, (hi, None)])), epoch, False


def carry_summary(base: Remaining, first: int, epoch: int, length: int, unit: int) -> tuple[int, dict[int, int], int]:
    """What epoch ``epoch`` takes and leaves, for ``explain()``: ``(positions it takes,
    {earlier epoch: how many of its elements it takes}, how many of its own elements it
    leaves to the next epoch)``."""
    lo, hi = carry_window(base, first, epoch, length, unit)
    earlier: dict[int, int] = {}
    for start, stop in base.compose(Remaining([(lo, hi)])).intervals:
        assert stop is not None  # a composition with a finite window is finite
        for e in range(start // length if length else 0, min(epoch, -(-stop // length) if length else 0)):
            inside = min(stop, (e + 1) * length) - max(start, e * length)
            if inside > 0:
                earlier[e] = earlier.get(e, 0) + inside
    below_end = (epoch + 1) * length - carry_consumed(base)  # base positions before the epoch's end
    return hi - lo, earlier, max(0, below_end - hi)
