"""The core below both front-ends: one shard's options, epoch, loaded state and runs.

``datapipe.py`` (``DistShardIterDataPipe``) and ``nodes.py`` (``DistShardNode``) only
translate their protocols (torch's DataPipe hooks and iteration; ``torchdata.nodes``'
``next`` / ``get_state`` / ``reset``) onto a :class:`ShardCore`, which owns what they
share: the checked options (a frozen :class:`~distshard.options.ShardOptions`, replaced
whole, never changed), the epoch and whether it was set, the loaded state waiting for
its epoch, ``even="carry"``'s base, the checks of a state against this shard, building
a slot's :class:`~distshard.engine.SlotRun`, the state it reports, the rank captured
when it is pickled, and its ``repr``. :class:`PlanModel` is what ``explain()`` reads.

Every front-end loads through one call, :meth:`ShardCore.load_saved`: what the user
saved (a slot's state, a list of them, a loader's state) is parsed once into a typed
:class:`~distshard.state.State` (``saved.py``), merged typed when it holds several, and
loaded. The front-ends read a state's fields through the typed state only: the core
keeps a loaded state typed (``resume``, ``pending``), so the wire format is read in one
place, ``State.from_dict``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from . import context as _context
from .access import Access, check_access, mode_of
from .engine import SlotRun, remaining_share
from .errors import OptionTypeError, StateMismatchError
from .graph import Pushdown
from .options import ShardOptions, check_flag, check_seed
from .plan import CARRY, check_multiple
from .protocol import sequence_length_varies
from .readers import RandomAccessReader, Reader
from .saved import Saved
from .state import State, as_state, carry_base_after, check_carry_load, check_fits

__all__ = ["OptionsView", "PlanModel", "ShardCore"]

StateDict = dict[str, Any]  # a state on the wire, as users see it

# -- the state as the front-ends read it: typed (state.State), never by key ------------


def _run_of(state: State) -> tuple[Any, ...]:
    """What every slot state of one run shares (``load_carry_base``)."""
    return (state.epoch, repr(state.remaining.to_list()), state.carry_from, state.num_slots, state.multiple_of)


# -- what explain() reads ------------------------------------------------------------


@dataclass(frozen=True)
class PlanModel:
    """What a shard will do here, as ``explain()`` reads it: the resolved context, the
    options (``given_seed``: the ``seed=`` given), the epoch, the state loaded for it
    and ``even="carry"``'s base, the number of positions (``None`` when unknown), how
    the source is read (``read_plan``, ``reader``), the upstream random pipes and the
    seed of this epoch's run (``seed``)."""

    context: _context.ShardContext
    even: Any
    shuffle: bool
    multiple_of: int
    sizes: Any
    given_seed: int | None
    mode: str
    epoch: int
    seed: int
    total: int | None
    pending: State | None
    carry: tuple[list, int] | None
    whole_files: bool
    pushdown: bool
    read_plan: Pushdown
    reader: Callable[[], Reader]
    random_pipes: list
    source: Any
    pipe: Any  # the front-end this model describes
    label: str


class OptionsView:
    """The options and epoch a front-end shows, read from its ``core`` (frozen there:
    see :meth:`ShardCore.replace_options`)."""

    core: ShardCore

    @property
    def even(self) -> Any:
        return self.core.options.even

    @property
    def seed(self) -> int | None:
        return self.core.options.seed

    @property
    def multiple_of(self) -> int:
        return self.core.options.multiple_of

    @property
    def expand(self) -> Callable[[Any], Any] | None:
        return self.core.options.expand

    @property
    def sizes(self) -> Any:
        return self.core.options.sizes

    @property
    def mode(self) -> str:
        """``element``, ``units`` (expand without sizes, or whole files) or ``sized_units``."""
        return self.core.mode

    @property
    def epoch(self) -> int:
        return self.core.epoch


# -- the core ------------------------------------------------------------------------


class ShardCore:
    """One shard's options, epoch, loaded state and runs (see the module doc).
    ``whole``: the source is read as whole files; ``what`` names the front-end in
    the errors of a state that does not fit."""

    def __init__(self, options: ShardOptions, *, whole: bool = False, what: str = "dist_shard") -> None:
        self.options = options
        self.whole = whole
        self.what = what
        self.epoch = 0
        self.epoch_set = False  # set_epoch was called: a loaded state of another epoch is void
        self.resume: State | None = None  # a loaded state (validated, typed), for its epoch's next run
        self.carry: tuple[list, int] | None = None  # even="carry": the base a loaded state moved epochs to
        self.run: SlotRun | None = None  # the current run, never pickled
        self.captured: tuple[int, int] | None = None  # (rank, world_size) of the pickling process

    def context(self, sharding: Mapping[Any, tuple[int, int]] | None = None) -> _context.ShardContext:
        """The slot this shard resolves to in this process (``sharding``: a split
        ``apply_sharding`` gave by hand, see ``tracking.py``)."""
        options = self.options
        if sharding:
            return _context.sharded_context(sharding, options.explicit, self.captured, options.group)
        return _context.current_context(
            *(options.explicit or (None, None)), _captured=self.captured, _group=options.group
        )

    # -- options ----------------------------------------------------------------------
    def replace_options(self, **changes: Any) -> ShardOptions:
        """Swap in a copy of the options with ``changes`` (``shuffle``, ``multiple_of``,
        ``seed``), checked as at construction; the options object itself never changes."""
        checked: dict[str, Any] = {}
        for name, value in changes.items():
            if name == "shuffle":
                checked[name] = check_flag("shuffle", value)
            elif name == "multiple_of":
                checked[name] = check_multiple(value, self.options.even)
            elif name == "seed":
                checked[name] = check_seed(value)
            else:
                raise OptionTypeError(f"replace_options() cannot change {name!r}: build a new shard instead")
        self.options = dataclasses.replace(self.options, **checked)
        return self.options

    @property
    def mode(self) -> str:
        """``element``, ``units`` (expand without sizes, or whole files) or ``sized_units``."""
        return mode_of(self.options.expand, self.options.sizes, self.whole)

    @property
    def state_seed(self) -> int | None:
        """The seed a state of this shard records (under ``even="carry"`` ``None`` is 0)."""
        options = self.options
        return 0 if options.seed is None and options.even == CARRY else options.seed

    def check_access(self, access: Access, *, source: str, fix: str, shuffle_fix: str) -> None:
        """Refuse options the source cannot be read for (see ``access.check_access``)."""
        options = self.options
        check_access(
            access,
            even=options.even,
            shuffle=options.shuffle,
            expand=options.expand,
            source=source,
            fix=fix,
            shuffle_fix=shuffle_fix,
        )

    # -- epoch and loaded state -----------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Set the epoch (checked); a loaded state of another epoch is discarded."""
        if self.resume is not None and self.resume.epoch != epoch:
            self.resume = None
        self.epoch, self.epoch_set = epoch, True

    @property
    def pending(self) -> State | None:
        """The loaded state the next run resumes, if it is of this epoch."""
        resume = self.resume
        return resume if resume is not None and resume.epoch == self.epoch else None

    def check_against(self, found: State | StateDict, reader: Reader | None, seeded: bool = True) -> None:
        """Raise ``ValueError`` if ``found`` does not come from a shard like this one
        (and, given ``reader``, from its data). A source whose length changes with the
        epoch's seeds (``distshard_length_varies``) is checked for its length only once
        ``seeded`` for the run (at the first element)."""
        options = self.options
        varies = reader is not None and sequence_length_varies(getattr(reader, "sequence", None))
        check_fits(
            found,
            mode=self.mode,
            shuffle=options.shuffle,
            even=options.even,
            multiple_of=options.multiple_of,
            seed=self.state_seed,
            length=reader.length() if reader is not None and (seeded or not varies) else None,
            source=reader.identity() if reader is not None else None,
            what=self.what,
        )

    def check_carry(self, found: State | StateDict, in_worker: bool) -> None:
        """``even="carry"``: refuse a state whose epoch boundaries this shard lacks."""
        if self.options.even == CARRY:
            check_carry_load(found, self.carry, in_worker)

    def load(self, state: State | StateDict, reader: Reader | None, in_worker: bool, seeded: bool = True) -> bool:
        """Load the validated state (typed or on the wire; checked against ``reader``
        when given) for its epoch's next run; ``False`` if it is void (``set_epoch``
        set another epoch). Under carry, the epoch boundaries it holds stay, unless
        set_epoch already moved past its epoch. Raises, leaving the core unchanged, if
        it does not fit."""
        found = as_state(state)
        self.check_against(found, reader, seeded)
        self.check_carry(found, in_worker)
        if self.options.even == CARRY and not (self.epoch_set and found.epoch > self.epoch):
            self.carry = carry_base_after(found)
        if self.epoch_set and found.epoch != self.epoch:
            return False  # a state of another epoch than the one set: void
        self.epoch, self.resume = found.epoch, found
        return True

    def load_saved(
        self,
        saved: object,
        reader: Callable[[], Reader | None],
        in_worker: bool,
        *,
        seeded: bool = True,
        carry_base: bool = False,
        node_source: bool = False,
    ) -> bool:
        """The one load path of every front-end: what a user saved (a slot's or merged
        state, a list of them, a ``StatefulPipeline`` or ``StatefulDataLoader`` state:
        see ``saved.py``) parsed once into a typed state, merged when it holds several,
        checked (against ``reader()``'s data when it gives one) and loaded for its
        epoch's next run (:meth:`load`). ``carry_base``: under ``even="carry"`` slot
        states that do not cover their run's slots (one rank's ``StatefulDataLoader``
        state, whose workers resume them) keep only where the later epochs begin
        (:meth:`load_carry_base`); ``node_source``: see ``Saved.state``. Returns
        whether a state now waits for its run; raises, leaving the core unchanged, if
        what was saved does not fit."""
        found = Saved.of(saved)
        if carry_base and self.options.even == CARRY and found.some_slots_of_a_carry_run():
            self.load_carry_base(found.states)
            return False
        return self.load(found.state(node_source), reader(), in_worker, seeded)

    def load_carry_base(self, found: Sequence[State]) -> None:
        """``even="carry"``: keep where the epochs after ``found``' begin (the slot
        states of one run). ``ValueError`` if they are not one run's."""
        runs = {_run_of(s) for s in found}
        if self.options.even != CARRY or len(runs) != 1 or any(not s.is_slot for s in found):
            raise StateMismatchError("load_carry_base takes the slot states of one run of a dist_shard(even='carry')")
        for state in found:
            self.check_against(state, None)
        self.carry = carry_base_after(found[0])

    def resumed(self, state: State) -> None:
        """A run resumed ``state``: take its epoch, and under carry its epoch boundaries."""
        self.epoch = state.epoch
        if self.options.even == CARRY:
            self.carry = carry_base_after(state)

    def next_epoch(self) -> None:
        self.epoch += 1

    # -- runs -----------------------------------------------------------------------------
    def run_seed(self, resume: State | None, base: int) -> int:
        """The seed of a run: the resumed state's, else ``base``."""
        seed = resume.seed if resume is not None else None
        return seed if seed is not None else base

    def base_seed(self, shared: Callable[[], int | None]) -> int:
        """The base seed of a run that resumes nothing: ``seed=``, else 0 under
        ``even="carry"``, else the loader's seed (``shared()``: one every rank has) or 0."""
        if self.options.seed is not None:
            return self.options.seed
        if self.options.even == CARRY:
            # the epochs form one stream: whoever reads an epoch's positions (its carried
            # tail in the next epoch, a resume, an elastic resume) must order them by the
            # same seed, and the DataLoader hands over a new one every epoch
            return 0
        found = shared()
        return 0 if found is None else found

    def slot_run(
        self,
        reader: Reader,
        ctx: _context.ShardContext,
        seed: int,
        resume: State | None,
        epoch_reader: Callable[[int], RandomAccessReader] | None = None,
        *,
        keep: bool = False,
    ) -> SlotRun:
        """The run of ``reader`` for the slot ``ctx`` in the current epoch; ``keep``: the
        current run, which the state reports from now on."""
        options = self.options
        run = SlotRun(
            reader,
            ctx=ctx,
            even=options.even,
            shuffle=options.shuffle,
            epoch=self.epoch,
            seed=seed,
            resume=resume,
            multiple=options.multiple_of,
            carry=self.carry,
            epoch_reader=epoch_reader,
        )
        if keep:
            self.run = run
        return run

    def planned_positions(
        self, reader: Reader, ctx: _context.ShardContext, seed: int, resume: State | None, workers: int
    ) -> list[Iterator[int]] | None:
        """The positions each of ``workers`` slots of ``ctx``'s rank will read in the
        current epoch, in order and computed without reading (lazy), or ``None`` when
        one is not known without reading (``SlotRun.planned_positions``) or the loaded
        state cannot be resumed there (the worker that runs it refuses it itself)."""
        found: list[Iterator[int]] = []
        for worker in range(workers):
            place = _context.ShardContext(ctx.rank, ctx.world_size, worker, workers, ctx.source)
            try:
                positions = self.slot_run(reader, place, seed, resume).planned_positions()
            except ValueError:
                return None
            if positions is None:
                return None
            found.append(positions)
        return found

    def prefetch_planned(self, reader: Reader, ctx: _context.ShardContext, base: int, workers: int) -> None:
        """Before a rank's DataLoader starts ``workers`` workers: ``reader`` (random
        access) learns the positions each of its slots will read this epoch, so that
        it fetches once what they all need first."""
        if not isinstance(reader, RandomAccessReader):
            return
        resume = self.pending
        slots = self.planned_positions(reader, ctx, self.run_seed(resume, base), resume, workers)
        if slots is not None:
            reader.prefetch(slots)

    def run_state(self) -> StateDict:
        """The state of the current run."""
        assert self.run is not None, "a run was started"
        return self.run.state()

    def state(self, fresh_run: Callable[[State | None], SlotRun] | None, ctx: _context.ShardContext) -> StateDict:
        """Where this shard is: its current run's state if of this epoch; else, under
        carry, that of the run ``fresh_run`` would start here (a state says where its
        run's epoch ends, which depends on the slot count; ``None``: building it would
        read data); else the loaded state, or a fresh one, as the copy ``ctx`` reports
        it (a data group's copy says which: see ``State.replica``)."""
        run = self.run
        if run is not None and run.epoch == self.epoch:
            return run.state()
        pending = self.pending
        if self.options.even == CARRY and (pending is None or not pending.is_slot) and fresh_run is not None:
            return fresh_run(pending).state()
        found = pending if pending is not None else State.fresh(self.epoch, self.mode, self.options.even, self.carry)
        if ctx.group is not None:  # a slot state is its own slot's copy; any other, this copy's
            copy_of = (ctx.slot, ctx.num_slots)
            if found.slot is not None and found.num_slots is not None:
                copy_of = (found.slot, found.num_slots)
            found = dataclasses.replace(found, replica=copy_of)
        return found.to_dict()

    def share(self, total: int, slot: int, num_slots: int) -> int:
        """What ``slot`` of ``num_slots`` yields of ``total`` positions this epoch,
        after the loaded state (another slot's state counts as none: that copy
        refuses it when iterated)."""
        resume = self.pending
        if resume is not None and resume.is_slot and resume.slot != slot:
            resume = None
        options = self.options
        return remaining_share(
            total, resume, slot, num_slots, options.even, options.multiple_of, self.carry, self.epoch
        )

    def rank_shares(self, total: int, ctx: _context.ShardContext, workers: int) -> list[int]:
        """:meth:`share` of each of ``workers`` slots of ``ctx``'s rank."""
        num_slots, first = ctx.world_size * workers, ctx.rank * workers
        return [self.share(total, slot, num_slots) for slot in range(first, first + workers)]

    def model(self, **found: Any) -> PlanModel:
        """The :class:`PlanModel` of this shard, with what its front-end ``found``."""
        options = self.options
        return PlanModel(
            even=options.even,
            shuffle=options.shuffle,
            multiple_of=options.multiple_of,
            sizes=options.sizes,
            given_seed=options.seed,
            mode=self.mode,
            epoch=self.epoch,
            pending=self.pending,
            carry=self.carry,
            whole_files=self.whole,
            **found,
        )

    # -- pickling and repr ----------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        # the progress of a run that went on here, not in the copy; and the rank of
        # this process, which DataLoader workers started by spawn / forkserver lack
        state = dict(self.__dict__)
        state["run"] = None
        found = _context.dist_rank_world()
        if found is not None:
            state["captured"] = found
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.captured is not None:
            _context.note_captured(self.captured)

    def describe(self, front: str, source: str, extra: Sequence[str] = ()) -> str:
        """The ``repr`` of a front-end ``front`` over ``source``: the options given."""
        options = self.options
        shown = [f"even={options.even!r}"]
        if options.explicit is not None:
            shown.append(f"rank={options.explicit[0]}, world_size={options.explicit[1]}")
        if options.group is not None:
            shown.append(f"{options.group.kind}=<{options.group.describe()}>")
        if options.seed is not None:
            shown.append(f"seed={options.seed}")
        if options.shuffle:
            shown.append("shuffle=True")
        if options.expand is not None:
            shown.append(f"expand={getattr(options.expand, '__name__', options.expand)!r}")
            shown.append(f"sizes={'given' if options.sizes is not None else None}")
        shown.extend(extra)
        if options.multiple_of != 1:
            shown.append(f"multiple_of={options.multiple_of}")
        return f"{front}({source}, {', '.join(shown)})"
