"""``even="carry"``: the epochs as one stream, in range arithmetic.

Under ``even="carry"`` the epochs' own streams (each in its own order) are laid end to
end: the *global position* of position ``p`` of epoch ``e``'s stream is ``e * N + p``.
A *base* says where a run of epochs counts from: a :class:`Remaining` of global
positions ending in an open interval (the part of the concatenation not consumed yet)
and the epoch it opens, ``first``. The fresh base is ``[0, None)`` opening epoch 0, and
then epoch ``e`` takes global positions ``[U floor(eN / U), U floor((e+1)N / U))`` with
``U = num_slots * multiple_of`` (one round of whole batches): every slot yields
``multiple_of * (floor((e+1)N / U) - floor(eN / U))`` and the tail of fewer than ``U``
positions opens the next epoch. An elastic resume (a merged state) starts a new base
at its own epoch; a new layout then counts whole rounds of its own ``U`` from there.
"""

from __future__ import annotations

import itertools
from typing import Iterable, Iterator, Sequence

from ..errors import OptionError, StateMismatchError
from .remaining import LeftAfter, Remaining


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
