"""Which slot owns which position and how many each yields under every ``even`` mode,
what ``"pad"`` repeats, and the streaming selector that does all of this without knowing
the stream length (the stride layout: slot ``s`` owns position ``s`` of every round)."""

from __future__ import annotations

import itertools
from collections import deque
from itertools import islice
from typing import Any, Iterable, Iterator, Literal, TypeVar

from ..errors import DistshardError, OptionError, OptionTypeError

T = TypeVar("T")

Even = Literal["drop", "pad", "carry"] | None
EVEN_MODES: tuple[Even, ...] = (None, "drop", "pad")  # the modes that keep each epoch to itself
CARRY: Literal["carry"] = "carry"  # the epochs form one stream (see carry.py)
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
