"""Runs the plan: one slot's share of one epoch, read through a reader, resumed
from a state, and the state it reports. The DataPipe and the ``torchdata.nodes``
front-ends both execute their epochs here; neither knows how positions are laid
out or how a source is read.

A run splits a set of *visit indices* (``remaining``: all of ``[0, N)`` in a fresh
epoch, what nobody consumed after an elastic resume) among the slots:

* ``stride`` layout: the ``j``-th remaining index goes to slot ``j % num_slots``
  (streams, sequences);
* ``blocks`` layout: slot ``s`` gets a contiguous block (readers whose neighbours
  share a unit or a file: units with sizes, file sources), shuffled or not;
* ``units``: whole units, decided by the reader (units without sizes).

With ``shuffle=True`` a visit index ``v`` reads position ``order(v)`` of a seeded
permutation of ``[0, N)``; ``remaining`` and ``taken`` are always counted in visit
indices, so states merge the same way shuffled or not.

Under ``even="carry"`` the run splits a *window* of the epochs' concatenated streams
instead (``plan.carry_window``: what epoch ``e`` takes of a base, which may begin with
the tail of epoch ``e - 1``); a global position ``g`` is visit index ``g % N`` of epoch
``g // N``'s stream, read through that epoch's reader (``epoch_reader``: the front-end
builds a reader seeded for another epoch) and in that epoch's shuffle order.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

from .context import ShardContext
from .digests import mix_seed, salt
from .errors import StateMismatchError, UnsupportedError
from .layouts import Layout, choose
from .plan import (
    CARRY,
    Even,
    Remaining,
    carry_reads,
    carry_share,
    carry_window,
    slot_count,
)
from .readers import RandomAccessReader, Reader, StreamReader, WholeFilesReader, WholeUnitsReader
from .state import FRESH_CARRY, State, as_state, check_slot

Resume = State | Mapping[str, Any]  # a validated state, typed or on the wire

__all__ = ["SlotRun", "carry_run_base", "layout_for", "layout_of", "salt_of", "shuffle_order", "remaining_share"]

EpochReader = Callable[[int], RandomAccessReader]  # the reader of another epoch's stream (carry)


def salt_of(reader: Reader) -> int:
    """A per-source number mixed into seeds, so that two branches of one pipeline
    over different sources do not shuffle alike (same in every process)."""
    return salt(reader.identity())


def shuffle_order(reader: RandomAccessReader, seed: int, epoch: int) -> Callable[[int], int]:
    """The permutation ``shuffle=True`` visits ``reader``'s positions in."""
    return reader.order(mix_seed(seed, epoch, 0x5EED, salt_of(reader)))


def layout_for(reader: Reader, multiple: int = 1) -> Layout:
    """How a run lays its positions out over slots (``layouts.choose``): ``units``
    (whole units), ``blocks`` (readers whose neighbours share a unit or a file:
    contiguous blocks, shuffled or not, so a merged state stays one interval per
    slot), ``chunks`` (``multiple_of`` > 1: whole batches in the order the DataLoader
    takes them, see ``plan.chunk_slot``), ``stride``."""
    blocks = isinstance(reader, RandomAccessReader) and reader.prefers_blocks
    return choose(isinstance(reader, WholeUnitsReader), blocks, multiple)


def layout_of(reader: Reader, shuffle: bool, multiple: int = 1) -> str:
    """The name of :func:`layout_for`'s layout (what a state records)."""
    return layout_for(reader, multiple).name


def carry_run_base(resume: Resume | None, carry: tuple[list, int] | None, epoch: int) -> tuple[Remaining, int]:
    """The base a carry run of ``epoch`` splits: the resumed state's, else the one the
    pipe keeps (``carry``, from an earlier state), else the fresh one; a base that
    opens a later epoch than ``epoch`` does not apply to it (then: fresh)."""
    if resume is not None:
        found = as_state(resume)
        assert found.carry_from is not None, "a carry state's"
        return found.remaining, found.carry_from
    pairs, first = carry if carry is not None and carry[1] <= epoch else FRESH_CARRY
    return Remaining((a, b) for a, b in pairs), first


def remaining_share(
    reader_length: int | None,
    resume: Resume | None,
    slot: int,
    num_slots: int,
    even: Even,
    multiple: int = 1,
    carry: tuple[list, int] | None = None,
    epoch: int = 0,
) -> int:
    """How many elements ``slot`` yields over the run that ``resume`` belongs to
    (``None``: a fresh epoch); needs a known length.

    Like a StatefulDataLoader's ``len`` (the sampler's, whatever was consumed), a
    slot's own state counts the run's whole share: a trainer that restores its
    batch counter and compares it with ``len(loader)`` (Lightning) then sees the
    same epoch. A merged state starts a new run over what is left: its share of that.
    """
    if reader_length is None:
        raise TypeError("the share of a stream is not known before reading it")
    if even == CARRY:
        base, first = carry_run_base(resume, carry, epoch)
        return 0 if first > epoch else carry_share(base, first, epoch, reader_length, num_slots, multiple)
    count: int | None = reader_length
    if resume is not None:
        count = as_state(resume).remaining.clip(reader_length).length()
    assert count is not None  # clipped to the length: finite
    return slot_count(slot, num_slots, count, even, multiple)


def _where(ctx: ShardContext) -> str:
    return f"rank {ctx.rank} of {ctx.world_size}, worker {ctx.worker_id} of {ctx.num_workers}"


class SlotRun:
    """One slot's iteration of one epoch: iterate it for the elements; ``state()``
    is where it is. ``resume`` is a validated state of the same epoch (a slot's own
    state or a merged one) or ``None``."""

    def __init__(
        self,
        reader: Reader,
        *,
        ctx: ShardContext,
        even: Even,
        shuffle: bool,
        epoch: int,
        seed: int,
        resume: Resume | None = None,
        multiple: int = 1,
        carry: tuple[list, int] | None = None,
        epoch_reader: EpochReader | None = None,
    ) -> None:
        self.reader, self.ctx, self.even, self.shuffle = reader, ctx, even, shuffle
        self.epoch_reader = epoch_reader
        self.multiple = multiple
        self.epoch, self.seed = epoch, seed
        self.layout = layout_for(reader, multiple)
        self.length = reader.length()
        self.identity = reader.identity()
        self.remaining = Remaining()
        self.taken = 0
        self.finished = False
        self.count: int | None = None  # visit indices this run splits, when known
        self.carry_from: int | None = None
        found = None if resume is None else as_state(resume)
        if found is not None:
            self.remaining = found.remaining
            if found.is_slot:
                check_slot(found, ctx.slot, ctx.num_slots, _where(ctx))
                self.taken, self.finished = found.taken, found.finished
        if even == CARRY:
            self.remaining, self.carry_from = carry_run_base(found, carry, epoch)
            if self.carry_from > epoch:  # a state taken once its epoch was over: nothing left of it
                self.finished = True
            elif self.length is not None:
                lo, hi = carry_window(self.remaining, self.carry_from, epoch, self.length, ctx.num_slots * multiple)
                self.count = hi - lo
        elif self.length is not None:
            self.count = self.remaining.clip(self.length).length()

    def state(self) -> dict[str, Any]:
        """Where the run is, on the wire (what ``state_dict()`` reports)."""
        return self.snapshot().to_dict()

    def snapshot(self) -> State:
        """Where the run is, typed."""
        return State(
            epoch=self.epoch,
            mode=self.reader.mode,
            even=self.even,
            seed=self.seed,
            layout=self.layout,
            shuffle=self.shuffle,
            length=self.length,
            source=self.identity,
            remaining=self.remaining,
            total=self.count,
            multiple_of=self.multiple,
            workers=self.ctx.num_workers,
            num_slots=self.ctx.num_slots,
            slot=self.ctx.slot,
            taken=self.taken,
            finished=self.finished,
            carry_from=self.carry_from,
            whole_files=isinstance(self.reader, WholeFilesReader),
            replica=(self.ctx.slot, self.ctx.num_slots) if self.ctx.group is not None else None,
        )

    def __iter__(self) -> Iterator[Any]:
        if not self.finished:
            for element in self._select():
                self.taken += 1
                yield element
        self.finished = True

    # -- the three shapes of reader ------------------------------------------------
    def _select(self) -> Iterator[Any]:
        ctx, reader = self.ctx, self.reader
        if isinstance(reader, WholeUnitsReader):
            refusal = self.layout.refuse_resume(isinstance(reader, WholeFilesReader))
            if not self.remaining.is_full and refusal is not None:
                raise refusal
            return reader.select(ctx.slot, ctx.num_slots, self.taken)
        if isinstance(reader, RandomAccessReader):
            return self._read_carry(reader) if self.even == CARRY else self._read_positions(reader)
        assert isinstance(reader, StreamReader)
        stream = self.remaining.stream(reader.stream())
        return self.layout.select(stream, ctx, self.even, self.multiple, self.taken)

    def _read_positions(self, reader: RandomAccessReader) -> Iterator[Any]:
        positions = self._positions(reader)
        check = getattr(reader, "check_empty_units", None)
        if (
            check is not None
            and self.ctx.slot == 0
            and self.taken == 0
            and self.remaining.clip(reader.length()).is_full
        ):
            check()
        return reader.read(positions, shuffled=self.shuffle)

    def planned_positions(self) -> Iterator[int] | None:
        """The positions this run will read, in order, computed without reading
        (what a rank tells its source before its DataLoader workers start, see
        ``RandomAccessReader.prefetch``), or ``None`` where they are not known
        without reading: a finished run, a stream or whole units, ``even="carry"``,
        and ``shuffle=True`` (a source's order may need its index to say them)."""
        reader = self.reader
        if self.finished or self.shuffle or self.even == CARRY or not isinstance(reader, RandomAccessReader):
            return None
        return self._positions(reader)

    def _positions(self, reader: RandomAccessReader) -> Iterator[int]:
        """The positions this slot reads, in order (checking the loaded state)."""
        ctx, length = self.ctx, reader.length()
        for start, stop in self.remaining.intervals:
            if (stop if stop is not None else start) > length:
                raise StateMismatchError(
                    f"the loaded state's remaining positions reach {stop if stop is not None else start}, "
                    f"beyond this epoch's {length} elements: it comes from other data or was altered"
                )
        remaining = self.remaining.clip(length)
        count = remaining.length()
        assert count is not None
        self.count = count
        share = slot_count(ctx.slot, ctx.num_slots, count, self.even, self.multiple)
        if self.taken > share:
            raise StateMismatchError(
                f"the loaded state says slot {ctx.slot} of {ctx.num_slots} yielded {self.taken} "
                f"elements, but its share of the {count} remaining is {share}: it comes from other "
                "data or was altered"
            )
        positions = self.layout.positions(ctx, count, self.even, self.multiple, self.taken)
        if remaining != Remaining([(0, length)]):
            positions = map(remaining.indexer(), positions)
        if self.shuffle:
            positions = map(shuffle_order(reader, self.seed, self.epoch), positions)
        return positions

    def _read_carry(self, reader: RandomAccessReader) -> Iterator[Any]:
        """This slot's share of the epoch's window: whole rounds of the epochs' one
        stream, the tail of the epoch before first, each epoch read through its own
        reader and in its own shuffle order."""
        ctx, length = self.ctx, reader.length()
        assert self.carry_from is not None, "a carry run knows the epoch its stream starts at"
        lo, hi = carry_window(self.remaining, self.carry_from, self.epoch, length, ctx.num_slots * self.multiple)
        share = (hi - lo) // ctx.num_slots
        if self.taken > share:
            raise StateMismatchError(
                f"the loaded state says slot {ctx.slot} of {ctx.num_slots} yielded {self.taken} elements, but "
                f"every slot's share of epoch {self.epoch} is {share}: it comes from other data or was altered"
            )
        window = self.remaining.compose(Remaining([(lo, hi)]))
        runs = self.layout.runs(ctx, hi - lo, self.multiple, self.taken)
        check = getattr(reader, "check_empty_units", None)
        if check is not None and ctx.slot == 0 and self.taken == 0:
            check()
        for epoch, positions in carry_reads(window, length, runs):
            source = reader if epoch == self.epoch or self.epoch_reader is None else self.epoch_reader(epoch)
            if source.length() != length:
                raise UnsupportedError(
                    f"epoch {epoch}'s stream has {source.length()} elements and epoch "
                    f"{self.epoch}'s {length}: even='carry' needs the same length every epoch"
                )
            if self.shuffle:
                positions = map(shuffle_order(source, self.seed, epoch), positions)
            yield from source.read(positions, shuffled=self.shuffle)
