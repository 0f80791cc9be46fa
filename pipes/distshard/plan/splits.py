"""The other ways to split a run of positions: whole batches in the order a DataLoader
consumes them (chunks), contiguous blocks (units with known sizes), the leftover units
of a stream of units without sizes, and a slot's ``even="drop"`` positions as ranges."""

from __future__ import annotations

import itertools
from typing import Iterable, Iterator, TypeVar

from .slots import Even, StreamTooShort, select_stream, slot_count

T = TypeVar("T")


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


# -- a slot's positions under even="drop", as ranges (the carry runs read them) --------------


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
