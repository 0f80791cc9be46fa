"""How a run lays its positions out over slots: one object per layout, in one
registry keyed by the name a state stores (``stride``, ``blocks``, ``chunks``,
``units``).

A layout knows a slot's positions (and how a stream is selected for it), its runs
under ``even="drop"`` rounds (``even="carry"``), what is left when every slot
consumed part of its share (the merge), which position ``even="pad"`` repeats, and
its lines in ``explain()``. The engine, the merge and ``explain()`` ask the object;
nobody else compares layout names. Pure arithmetic over ``plan/``: no torch.

A new layout joins by subclassing :class:`Layout`, giving it a ``name`` and
registering it in :data:`LAYOUTS` (CONTRIBUTING.md, "A new layout").
"""

from __future__ import annotations

from typing import Any, ClassVar, Iterable, Iterator, Protocol, Sequence

from .errors import OptionError, UnsupportedError
from .plan import (
    Even,
    Remaining,
    block_positions,
    block_range,
    block_runs,
    chunk_positions,
    chunk_runs,
    left_after_blocks,
    left_after_chunks,
    left_after_round_robin,
    pad_position,
    select_chunks,
    select_stream,
    slot_positions,
    stride_runs,
)

__all__ = ["LAYOUTS", "Layout", "Place", "choose", "invalid_state", "layout_named"]


class Place(Protocol):
    """Where a slot sits (``ShardContext`` is one)."""

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def worker_id(self) -> int: ...
    @property
    def num_workers(self) -> int: ...
    @property
    def slot(self) -> int: ...
    @property
    def num_slots(self) -> int: ...


def invalid_state(why: str) -> OptionError:
    """The error of a malformed state (``ValueError``)."""
    return OptionError(f"not a valid distshard state: {why}")


class Layout:
    """A way of laying the positions of a run out over its slots (the stride one)."""

    name: ClassVar[str] = "stride"
    noun: ClassVar[str] = "stride"  # as in "a state in stride layout"
    positional: ClassVar[bool] = True  # a slot's elements are positions the engine computes
    carries: ClassVar[bool] = True  # usable under even="carry" (rounds of the epochs' stream)
    needs_workers: ClassVar[bool] = False  # a state must record its run's workers

    def positions(self, at: Place, count: int, even: Even, multiple: int, skip: int) -> Iterator[int]:
        """The visit indices of ``[0, count)`` slot ``at`` yields, padding included,
        without its first ``skip``."""
        return slot_positions(at.slot, at.num_slots, count, even, skip, multiple)

    def select(self, stream: Iterable[Any], at: Place, even: Even, multiple: int, skip: int) -> Iterator[Any]:
        """Slot ``at``'s elements of a stream (length unknown), without its first ``skip``."""
        return select_stream(stream, at.slot, at.num_slots, even, skip)

    def runs(self, at: Place, total: int, multiple: int, skip: int) -> Iterator[range]:
        """Slot ``at``'s positions of ``[0, total)`` in ``even="drop"`` rounds, as ranges."""
        return stride_runs(at.rank, at.world_size, at.worker_id, at.num_workers, total, multiple, skip)

    def left_after(
        self, taken: Sequence[int], num_slots: int, workers: int | None, count: int | None, even: Even, multiple: int
    ) -> Remaining:
        """What a run of ``num_slots`` slots over ``count`` visit indices leaves when
        slot ``s`` consumed the first ``taken[s]`` of its share (counted within the run)."""
        return left_after_round_robin(taken, num_slots)

    def refuse_merge(self, whole_files: bool) -> UnsupportedError | None:
        """Why the states of a run in this layout cannot be merged for another run
        (``None``: they can)."""
        return None

    def refuse_resume(self, whole_files: bool) -> UnsupportedError | None:
        """Why a merged state cannot be resumed in this layout (``None``: it can)."""
        return None

    def pad_position(self, slot: int, num_slots: int, total: int) -> int | None:
        """The visit index ``even="pad"`` repeats in ``slot`` (``None``: none)."""
        return pad_position(slot, num_slots, total)

    def explain(self, at: Place, total: int, even: Even, multiple: int, shuffled: bool) -> list[str]:
        """The layout's lines in ``explain()``."""
        order = " of the permuted order" if shuffled else ""
        return [f"layout: stride: the j-th position{order} goes to slot j % {at.num_slots}"]


class Blocks(Layout):
    """A contiguous block per slot (readers whose neighbours share a unit or a file),
    shuffled or not, so a merged state stays one interval per slot."""

    name, noun = "blocks", "block"

    def positions(self, at: Place, count: int, even: Even, multiple: int, skip: int) -> Iterator[int]:
        return block_positions(at.slot, at.num_slots, count, even, skip, multiple)

    def runs(self, at: Place, total: int, multiple: int, skip: int) -> Iterator[range]:
        return block_runs(at.rank, at.world_size, at.worker_id, at.num_workers, total, multiple, skip)

    def left_after(
        self, taken: Sequence[int], num_slots: int, workers: int | None, count: int | None, even: Even, multiple: int
    ) -> Remaining:
        if count is None:
            raise invalid_state(f"a state in {self.noun} layout must record total")
        return left_after_blocks(taken, num_slots, count, even, multiple)

    def pad_position(self, slot: int, num_slots: int, total: int) -> int | None:
        start, stop = block_range(slot, num_slots, total, "pad")
        if not total or total % num_slots == 0 or slot < total % num_slots:
            return None
        return start if stop > start else slot % total

    def explain(self, at: Place, total: int, even: Even, multiple: int, shuffled: bool) -> list[str]:
        start, stop = block_range(at.slot, at.num_slots, total, even, multiple)
        return [
            "layout: a contiguous block per slot" + (" of the permuted order" if shuffled else ""),
            f"this slot reads the contiguous {'visit' if shuffled else 'element'} block [{start}, {stop})",
        ]


class Chunks(Layout):
    """Whole batches (``multiple_of`` > 1) in the order the DataLoader takes them:
    chunk ``c`` goes to rank ``c % world_size``, worker ``(c // world_size) % workers``
    (``plan.chunk_slot``)."""

    name, noun = "chunks", "chunk"
    needs_workers = True

    def positions(self, at: Place, count: int, even: Even, multiple: int, skip: int) -> Iterator[int]:
        return chunk_positions(at.rank, at.world_size, at.worker_id, at.num_workers, count, multiple, skip)

    def select(self, stream: Iterable[Any], at: Place, even: Even, multiple: int, skip: int) -> Iterator[Any]:
        return select_chunks(stream, at.rank, at.world_size, at.worker_id, at.num_workers, multiple, skip)

    def runs(self, at: Place, total: int, multiple: int, skip: int) -> Iterator[range]:
        return chunk_runs(at.rank, at.world_size, at.worker_id, at.num_workers, total, multiple, skip)

    def left_after(
        self, taken: Sequence[int], num_slots: int, workers: int | None, count: int | None, even: Even, multiple: int
    ) -> Remaining:
        if workers is None or num_slots % workers:
            raise invalid_state(f"workers={workers} does not divide num_slots={num_slots}")
        return left_after_chunks(taken, num_slots // workers, workers, count, multiple)

    def explain(self, at: Place, total: int, even: Even, multiple: int, shuffled: bool) -> list[str]:
        order = " of the permuted order" if shuffled else ""
        world, workers = at.world_size, at.num_workers
        return [
            f"layout: whole batches of {multiple}: chunk c (the positions{order} [c*{multiple}, "
            f"(c+1)*{multiple})) goes to rank c % {world}, worker (c // {world}) % {workers}, "
            "so the ranks' batches of one step are consecutive positions"
        ]


class Units(Layout):
    """Whole units (units without sizes, whole compressed files): the reader decides
    which unit a slot reads; nobody knows where a slot's elements sit, so a merged
    state of such a run cannot be resumed by another layout."""

    name, noun = "units", "unit"
    positional = False
    carries = False

    def positions(self, at: Place, count: int, even: Even, multiple: int, skip: int) -> Iterator[int]:
        raise UnsupportedError("whole units have no positions: their reader selects a slot's units")

    def runs(self, at: Place, total: int, multiple: int, skip: int) -> Iterator[range]:
        raise UnsupportedError("even='carry' has no units layout")

    def left_after(
        self, taken: Sequence[int], num_slots: int, workers: int | None, count: int | None, even: Even, multiple: int
    ) -> Remaining:
        raise self.refuse_merge(whole_files=False)

    def refuse_merge(self, whole_files: bool) -> UnsupportedError:
        if whole_files:
            return UnsupportedError(
                "elastic resume over compressed files cannot be done: a slot's samples are known only by "
                "decompressing its files; resume with the same ranks and workers, or decompress the files"
            )
        return UnsupportedError(
            "elastic resume in unit mode needs sizes= (without them nobody knows where a "
            "slot's elements sit); resume with the same ranks and workers, or pass sizes="
        )

    def refuse_resume(self, whole_files: bool) -> UnsupportedError:
        if whole_files:
            return UnsupportedError(
                "a merged state cannot be resumed over compressed files (each streamed whole): "
                "resume with the same ranks and workers, or decompress the files"
            )
        return UnsupportedError("a merged state cannot be resumed in unit mode without sizes=")

    def explain(self, at: Place, total: int, even: Even, multiple: int, shuffled: bool) -> list[str]:
        return [
            "layout: whole units as far as they go round; the leftover units split element-wise, each among "
            f"at most ceil({at.num_slots} / leftover units) slots"
        ]


STRIDE, BLOCKS, CHUNKS, UNITS = Layout(), Blocks(), Chunks(), Units()
LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (STRIDE, BLOCKS, UNITS, CHUNKS)}


def layout_named(name: str) -> Layout:
    """The layout a state names (``OptionError`` for a name no layout has)."""
    try:
        return LAYOUTS[name]
    except (KeyError, TypeError):
        raise invalid_state(f"layout={name!r} is not one of {tuple(LAYOUTS)}") from None


def choose(whole_units: bool, prefers_blocks: bool, multiple: int) -> Layout:
    """The layout of a run: ``units`` for a reader of whole units, ``blocks`` for a
    random-access reader whose neighbours share a unit or a file, ``chunks`` with
    ``multiple_of`` > 1, else ``stride``."""
    if whole_units:
        return UNITS
    if prefers_blocks:
        return BLOCKS
    return CHUNKS if multiple > 1 else STRIDE
