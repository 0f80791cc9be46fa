"""``DistShardIterDataPipe``: the ``.dist_shard()`` functional, the DataPipe front-end.

It keeps what torch's DataPipe protocol needs: the hooks torch's DataLoader calls
(``apply_sharding``, ``set_seed``, ``set_shuffle``), ``set_epoch`` and how it reaches
workers (``mailbox.py``), iteration, ``state_dict`` / ``load_state_dict``, ``len`` and
pickling. What it shares with the ``torchdata.nodes`` front-end lives below both, in
a :class:`~distshard.core.ShardCore` (``core.py``: the checked options, the epoch, the
loaded state, the state checks, the slot's run and the state it reports), over how a
source is read (``access.py``: it says what the pipe graph holds, ``graph.py`` finds
it), the slot (``context.py``), the run of an epoch (``engine.py`` over ``readers/``)
and the state (``state.py``). What torch's DataLoader did to the pipe is kept by a
:class:`~distshard.tracking.LoaderTrack` (``tracking.py``); what it is doing around
the pipe is read off the call stack by ``loaders.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterator, Sequence, TypeVar, cast

from torch.utils.data import functional_datapipe, get_worker_info
from torch.utils.data.datapipes.datapipe import IterDataPipe
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES

from . import context as _context
from . import frameworks, loaders
from .access import Access, UnitCounts, access_of, reader_of, unwrapped, whole_files
from .core import OptionsView, PlanModel, ShardCore
from .engine import SlotRun
from .errors import OptionError, OptionTypeError, SetupError
from .explaining import explain_model
from .graph import Pushdown, check_no_sharding, pipeline_of, plan_pushdown, upstream_pipes
from .options import check_epoch, check_flag, check_given
from .plan import CARRY, Even
from .protocol import sequence_length_varies, sequence_prefetch
from .readers import Reader
from .state import State
from .tracking import LoaderTrack
from .upstream import Upstream

T = TypeVar("T")

__all__ = ["DistShardIterDataPipe", "set_epoch", "shards_in"]

_END = object()


@functional_datapipe("dist_shard")
class DistShardIterDataPipe(OptionsView, IterDataPipe[T]):
    r"""Shard a stream exactly once over ranks × DataLoader workers (functional name: ``dist_shard``).

    Every copy of the pipeline (a *slot*: ``slot = rank * num_workers + worker_id``
    out of ``num_slots = world_size * num_workers``) keeps the elements at the
    positions ``p`` with ``p % num_slots == slot``, where ``p`` counts the elements
    of the incoming stream (their values are never looked at). Every element goes
    to exactly one slot.

    Upstream random pipes (anything with ``set_seed``, such as ``shuffle()``) are
    seeded identically on every slot from ``(seed, epoch)`` before each iteration,
    so the partition stays exact whatever each process's torch seed is.

    Reading once: when the stream comes from ``IterableWrapper`` over something
    with random access (a list, tuple, range, ``MapDataPipe``, tensor) a slot
    indexes its own positions instead of walking the stream (with the wrapper's
    default ``deepcopy=True`` only the yielded elements are copied, never the whole
    sequence). 1:1 ``.map()`` pipes right above the source are run by each slot
    on its own elements only (*pushdown*); ``filter``, ``batch``, ``shuffle`` and
    other pipes that may change the count or order are barriers that selection
    never crosses. Pass ``pushdown=False`` for maps with side effects that must
    see every element on every slot.

    Args:
        source_datapipe: the stream to shard (or, with ``expand``, the units).
        rank: this process's rank; give it with ``world_size``. By default they come
            from ``torch.distributed``, else from the ``RANK`` / ``WORLD_SIZE``
            environment (torchrun), else ``(0, 1)``.
        world_size: the number of ranks.
        even: ``None`` keeps every element (slot counts differ by at most one);
            ``"drop"`` makes every slot yield exactly ``N // num_slots`` (the last
            ``N % num_slots`` elements are dropped); ``"pad"`` makes every slot yield
            exactly ``ceil(N / num_slots)``, repeating elements from the start of the
            epoch; ``"carry"`` drops and repeats nothing: the epochs form one stream,
            every slot yields the same count each epoch and an epoch's tail (fewer
            than ``num_slots * multiple_of`` elements) opens the next epoch (random
            access or units with ``sizes`` only). Use ``"drop"``, ``"pad"`` or
            ``"carry"`` under DDP so that no rank waits in a collective for a batch
            that never comes.
        seed: base seed of upstream randomness and of ``shuffle=True``. ``None``
            means 0, or, under torch's DataLoader with ``torch.distributed``
            initialized (or a single rank), the seed the DataLoader shares with every
            worker and rank. Under ``even="carry"`` ``None`` always means 0: the
            epochs are one stream, and an epoch's tail is read in the next epoch (and
            by a resume) in the order its own epoch drew, which a loader's new seed
            every epoch would change.
        shuffle: visit the positions in a seeded pseudo-random permutation of
            ``[0, N)`` that changes with the epoch, identical on every slot and
            computed in O(1) memory, so a global shuffle still reads each element
            once. Needs random access (see above) or unit mode with ``sizes``.
        expand: unit mode: the stream holds units (files, shards, URLs) and
            ``expand(unit)`` returns the unit's elements, as a sequence (read by
            index: best) or an iterator (skipped with ``itertools.islice``). Units
            go whole to slots as far as they go round; the leftover units are split
            element-wise, each among at most ``ceil(num_slots / leftover)`` slots.
        sizes: unit mode: the element count of every unit, as a sequence aligned
            with the units, a mapping ``unit -> count`` or a callable. Makes the
            split exact and balanced (each slot reads a contiguous block of the
            element space), and enables ``even`` and ``shuffle=True`` in unit mode.
        pushdown: run 1:1 maps right above the source on the slot's own elements
            only (default); ``False`` runs them as written, on every element.
        mesh: in a model-parallel job, a ``DeviceMesh`` of the data-parallel
            dimensions (``world_mesh["dp"]``, or ``world_mesh["dp_replicate",
            "dp_shard"]``): the rank is this rank's row-major coordinate over them,
            the world size the product of their sizes, so ranks with the same
            coordinate (tensor, context and pipeline parallel peers) get identical
            elements in identical order. Exclusive with ``rank`` / ``world_size``.
            Every collective for the pipe runs over these ranks only.
        group: instead of ``mesh``, a ``ProcessGroup`` of the data-parallel ranks
            (Megatron's ``get_data_parallel_group()``): the rank in it and its size.
        multiple_of: with ``even="drop"``, round every slot's count down to a
            multiple of this (the batch size of a ``.batch()`` after the shard), so
            every batch is full, every rank runs the same number of steps, and
            ``len()`` of the batched pipeline (what Lightning stops at) is exact.
            With ``even="carry"`` the same, and what does not fill a round of whole
            batches opens the next epoch instead of being dropped.

    Example:
        >>> import distshard
        >>> from torch.utils.data.datapipes.iter import IterableWrapper
        >>> dp = IterableWrapper(["a", "b", "c", "d", "e"]).dist_shard(rank=1, world_size=2)
        >>> list(dp)
        ['b', 'd']
    """

    # torch's per-element iterator check asks hasattr(pipe, "_is_child_datapipe"); a
    # missing attribute goes through IterDataPipe.__getattr__ and a raised
    # AttributeError, about 1.5 us an element
    _is_child_datapipe = False

    def __init__(
        self,
        source_datapipe: IterDataPipe[T],
        *,
        rank: int | None = None,
        world_size: int | None = None,
        even: Even = None,
        seed: int | None = None,
        shuffle: bool = False,
        expand: Callable[[Any], Any] | None = None,
        sizes: Sequence[int] | Mapping[Any, int] | Callable[[Any], int] | None = None,
        pushdown: bool = True,
        multiple_of: int = 1,
        mesh: Any = None,
        group: Any = None,
    ) -> None:
        super().__init__()
        if not isinstance(source_datapipe, IterDataPipe):
            raise OptionTypeError(
                f"dist_shard needs an IterDataPipe source, got {type(source_datapipe).__name__}; "
                "wrap an iterable with torch.utils.data.datapipes.iter.IterableWrapper"
            )
        self.source_datapipe = source_datapipe
        options = check_given(locals())
        self.pushdown = check_flag("pushdown", pushdown)
        self._pushdown: Pushdown | None = None  # per process, never pickled
        # the whole files of a file source below 1:1 maps that cannot be read at random
        # (compressed files): they go whole to slots
        self._whole = None if options.expand is not None else whole_files(source_datapipe, below_maps=self.pushdown)
        # the options, epoch, loaded state and runs, shared with DistShardNode
        self.core = ShardCore(options, whole=self._whole is not None)
        self.core.check_access(
            Access(sequence=None if self.expand is not None else self.read_plan().sequence, whole=self._whole),
            source=type(source_datapipe).__name__,
            fix="IterableWrapper over a list/range/MapDataPipe with only .map() in between, a distshard "
            "file source or mix, or units with sizes=",
            shuffle_fix=", or shuffle upstream with .shuffle() and shuffle=False",
        )
        upstream = upstream_pipes(source_datapipe)  # one walk (it pickles every pipe's data), here
        check_no_sharding(source_datapipe, upstream)
        self._counts = UnitCounts(self.sizes)  # a sizes callable's answers, asked once per job
        if self.expand is not None and self._counts.computed:
            # before any DataLoader worker copies the pipe; a collective over the data group
            self._counts.ask_all(list(self.source_datapipe), options.group)
        self.loader_track = LoaderTrack()  # what torch's DataLoader did to this pipe
        self.upstream = Upstream(source_datapipe, upstream)  # the walk's identity and random pipes

    def __dir__(self) -> list[str]:
        # torch's error text for an exception raised while iterating lists the members
        # named like __init__'s parameters; "shuffle" is one, stored as global_shuffle,
        # and the name resolves to the .shuffle() functional, whose partial it printed
        return [name for name in super().__dir__() if name != "shuffle"]

    # -- the options (frozen in the core; see ShardCore.replace_options) -----------------
    @property
    def global_shuffle(self) -> bool:  # not "shuffle": that name is the .shuffle() functional
        return self.core.options.shuffle

    @property
    def whole_files(self) -> bool:
        """Whether the source is read as whole files (compressed files, each to one slot)."""
        return self._whole is not None

    def _can_shuffle(self) -> bool:
        if self.expand is not None:
            return self.sizes is not None
        return self.read_plan().sequence is not None

    # -- who am I ---------------------------------------------------------------
    def context(self) -> _context.ShardContext:
        """The :class:`~distshard.ShardContext` this pipe resolves to in this process."""
        return self.core.context(self.loader_track.sharding)

    # -- hooks torch's DataLoader calls ----------------------------------------
    def apply_sharding(
        self,
        num_of_instances: int,
        instance_id: int,
        sharding_group: SHARDING_PRIORITIES = SHARDING_PRIORITIES.DEFAULT,
    ) -> None:
        """Called by torch's DataLoader (and ``graph_settings.apply_sharding``).

        torch's DataLoader calls it on its own in every worker (and in the main
        process without workers) with the split it derives from torch.distributed;
        ``dist_shard`` resolves ranks and workers itself, so such calls change
        nothing. Any other call, e.g. ``graph_settings.apply_sharding(dp, 3, 1)``,
        is honoured as an explicit split: instance ``1`` of ``3`` (``DEFAULT``
        group), or the rank part (``DISTRIBUTED``) or the worker part
        (``MULTIPROCESSING``). Having this method also makes torch's own check
        raise when a ``sharding_filter`` sits in the same chain.
        """
        self.loader_track.sharded(num_of_instances, instance_id, sharding_group, self.core.captured)

    def set_seed(self, seed: int) -> "DistShardIterDataPipe[T]":
        """Called by torch's DataLoader with the seed it shares with all workers.

        Used as the base of upstream randomness only when ``seed`` was not given
        and the value is the same on every rank: with ``torch.distributed``
        initialized (the DataLoader broadcasts it) or a single rank.
        """
        self.loader_track.seeded(seed, _context.dist_rank_world() is not None or self.core.captured is not None)
        workers = loaders.starting_workers()
        if workers:
            self._before_workers(workers)
        return self

    def _before_workers(self, workers: int) -> None:
        """In the rank, before its DataLoader starts ``workers`` workers: the source
        learns the positions each of the rank's slots will read, so that it fetches
        once what they all need first (a stored index's entries: one request for the
        rank, not one per worker) and keeps it in the copies the workers get."""
        if self.expand is not None or self._whole is not None or self.loader_track.sharding:
            return
        if get_worker_info() is not None or sequence_prefetch(self.read_plan().sequence) is None:
            return  # (only a source that fetches something ahead: no other view is made here)
        ctx = self.context()
        self.core.prefetch_planned(self.reader(), ctx, self.base_seed(ctx), workers)

    def set_shuffle(self, shuffle: bool = True) -> "DistShardIterDataPipe[T]":
        """Called by torch's DataLoader with its ``shuffle=`` argument (when given).

        ``False`` turns ``shuffle=True`` off; ``True`` turns it on where the source
        allows random access (elsewhere upstream ``.shuffle()`` pipes, which the
        DataLoader turns on too, do the shuffling).
        """
        self.core.replace_options(shuffle=bool(shuffle) and self._can_shuffle())
        return self

    def set_epoch(self, epoch: int) -> "DistShardIterDataPipe[T]":
        """Set the epoch; upstream random pipes are seeded from ``(seed, epoch)``.

        Call it with the same value on every rank before each epoch, before the
        DataLoader creates the epoch's iterator (``for batch in loader``). It reaches
        the workers' copies of the pipe also with ``persistent_workers=True``: they
        take it when the epoch's iterator starts (see ``mailbox.py``), never in the
        middle of an epoch. A loaded state of another epoch is discarded (also when
        it is loaded later, as StatefulDataLoader does in its workers): a state
        resumes its own epoch only.
        """
        epoch = check_epoch(epoch)
        self.core.set_epoch(epoch)
        self.loader_track.epoch_set(epoch)  # posted to the workers, or, in a worker, known here
        return self

    def _take_loader_epoch(self, refuse: bool = True) -> bool:
        """When an iterator starts in a DataLoader worker: take the epoch ``set_epoch``
        set in the loader's process (see :meth:`LoaderTrack.take_loader_epoch`). Returns whether the
        iteration runs again an epoch whose loaded state a run here (or in another
        worker) resumed, which its first element refuses."""
        core = self.core
        return self.loader_track.take_loader_epoch(
            lambda: core.epoch, core.set_epoch, lambda: core.pending is not None, refuse
        )

    def _new_iterator(self) -> None:
        """A new iterator of the pipeline starts (``StatefulPipeline.__iter__``):
        what ``state_dict`` reports from now on is that iteration's. Refusals wait for
        the first element (StatefulDataLoader's workers do not survive an error here).
        An iteration that will be refused for running a resumed epoch again (a
        persistent worker's, started by StatefulDataLoader itself after a state saved
        at the epoch's end) yields nothing: the state stays the resumed run's, at its
        end, so that a merge of it carries only what is really left; a worker without
        that run (started afresh) cannot say where the epoch stands: its state refuses."""
        again = self._take_loader_epoch(refuse=False)
        core = self.core
        if not again:
            core.run = None
        self.loader_track.position_unknown = again and (core.run is None or core.run.epoch != core.epoch)

    def base_seed(self, ctx: _context.ShardContext | None = None) -> int:
        """The base seed of upstream randomness this copy uses (see ``seed``)."""
        return self.core.base_seed(lambda: self.loader_track.shared_seed(lambda: (ctx or self.context()).world_size))

    def _seed_upstream(self, base: int, epoch: int | None = None) -> None:
        """Seed the upstream random pipes for ``epoch`` (this pipe's by default)."""
        self.upstream.seed(self.source_datapipe, base, self.core.epoch if epoch is None else epoch)

    # -- how the source is read ---------------------------------------------------
    def read_plan(self) -> Pushdown:
        """How this pipe reads its source (see :class:`distshard.graph.Pushdown`)."""
        if self._pushdown is None:
            self._pushdown = plan_pushdown(self.source_datapipe, self.pushdown and self.expand is None)
        return self._pushdown

    def chain_identity(self) -> str:
        """A process-independent identity of the upstream graph (``upstream.chain_identity``)."""
        return self.upstream.identity

    def access(self) -> Access:
        """How the source reads (see :mod:`distshard.access`): random access to the
        base below the 1:1 maps, a stream of it, or the units. A random-access view is
        made afresh: one made by a source with randomness (a mix, a weighted_sample)
        may take its seeds when it is made, so it must be made after this epoch's
        seeding."""
        if self.expand is not None:
            return Access(stream=lambda: self.source_datapipe, identity=self.chain_identity())
        plan = self.read_plan()
        if plan.sequence is not None:
            fresh = access_of(plan.base)
            assert fresh is not None and fresh.random, "a base with random access keeps it"
            return fresh
        if self._whole is not None:
            return Access(whole=self._whole, identity=self.chain_identity())
        base = plan.base
        return Access(stream=lambda: unwrapped(base), name=type(base).__name__, identity=self.chain_identity())

    def reader(self) -> Reader:
        """The reader of this epoch's source (lists the units in unit mode)."""
        return reader_of(self.access(), self.expand, self.sizes, self._counts)

    # -- iteration ---------------------------------------------------------------
    def __iter__(self) -> Iterator[T]:
        refusal = self.loader_track.refusal or frameworks.refusal_for_iteration()
        if refusal is not None:
            raise SetupError(refusal)
        self._take_loader_epoch()
        self.loader_track.iteration_started()
        core = self.core
        ctx = self.context()
        resume = core.pending
        seed = core.run_seed(resume, self.base_seed(ctx))
        self._seed_upstream(seed)
        reader = self.reader()
        if resume is not None:
            core.check_against(resume, reader)
        carried = None  # even="carry": the readers of other epochs (their tails)
        if self.even == CARRY:
            carried = self.upstream.epoch_readers(self.source_datapipe, seed, core.epoch, self.reader)
        # raises before anything is consumed if the state is for another slot
        run = core.slot_run(reader, ctx, seed, resume, carried, keep=True)
        plan = self.read_plan() if self.expand is None else None
        elements = map(plan.apply, run) if plan is not None and plan.maps else iter(run)
        # the loaded state stays pending until the run shows it fits (a stream shorter
        # than the state claims raises at the first element, every time)
        first = next(elements, _END)
        core.resume = None
        if first is _END:
            return
        yield cast(T, first)
        yield from elements

    # -- state ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This copy's position in the epoch, as JSON-serialisable data.

        Taken between two elements it lets a fresh pipe continue exactly after the
        last element this one yielded. States of all slots can be merged with
        :func:`distshard.merge_states` to resume with other ranks or workers.
        """
        core = self.core
        known = core.pending is not None or (core.run is not None and core.run.epoch == core.epoch)
        self.loader_track.check_position_known(core.epoch, known)
        ctx = self.context()

        def fresh_run(pending: State | None) -> SlotRun:
            return core.slot_run(self.reader(), ctx, core.run_seed(pending, self.base_seed(ctx)), pending)

        return core.state(fresh_run if self._cheap_reader() else None, ctx)

    def load_state_dict(self, state: Any) -> None:
        """Continue from ``state`` at the next iteration: a slot's or a merged state, or
        anything holding them (a list of every slot's states, merged here; a
        ``StatefulPipeline`` or ``StatefulDataLoader`` state).

        The state resumes its own epoch: a fresh pipe takes the state's epoch; after
        ``set_epoch(e)`` a state of another epoch is discarded. A state taken after
        a slot's last element resumes with nothing left of that epoch for that slot.
        Under ``even="carry"`` a state also says where the epochs after its own begin
        (after an elastic resume their number alone no longer does): that stays with
        the pipe, also when the state's epoch is discarded for a later one; the slot
        states of one rank's workers (which resume them) leave only that here.
        Raises ``ValueError`` for a malformed state or one from another pipeline
        (other options, other data), leaving this pipe exactly as it was.
        """
        core = self.core

        def reader() -> Reader | None:
            return self.reader() if self._cheap_reader() else None

        if core.load_saved(state, reader, get_worker_info() is not None, seeded=False, carry_base=True):
            core.run = None
            self.loader_track.state_loaded(core.epoch)

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise ``ValueError`` (``StateMismatchError`` for another pipeline's) if
        ``state`` (a slot's or a merged state) does not come from this pipeline;
        nothing is loaded."""
        self.core.check_against(State.from_dict(state), self.reader() if self._cheap_reader() else None)

    def _cheap_reader(self) -> bool:
        """Whether building the reader reads no data (everything but listing units,
        which is cheap too unless sizes are computed from the files)."""
        return not (self.mode == "sized_units" and self._counts.computed)

    # -- length ------------------------------------------------------------------------
    def _total(self) -> int:
        """The number of positions ``dist_shard`` splits, if it can be known."""
        if self._whole is not None:
            raise TypeError(
                f"{type(self).__name__} over whole files (compressed) has no length: a slot's count "
                "is known only once its files are read"
            )
        if self.expand is not None:
            if self.sizes is None:
                raise TypeError(f"{type(self).__name__} in unit mode without sizes= has no length")
            return sum(self._counts(list(self.source_datapipe)))
        access = self.access()
        if access is not None and access.random and sequence_length_varies(access.sequence):
            self._seed_for_length()
        try:
            return len(self.source_datapipe)
        except TypeError:
            raise TypeError(
                f"{type(self).__name__} has no length: its source {type(self.source_datapipe).__name__} has none"
            ) from None

    def _seed_for_length(self) -> None:
        """A source whose length depends on the epoch's seeds (``pack(fit="best",
        shuffle_documents=True)``): seed it as this epoch's run will, or refuse to
        guess when that seed is the DataLoader's, known only as the epoch starts."""
        if self.seed is None and self.even != CARRY:
            raise TypeError(
                f"{type(self).__name__} over {type(self.source_datapipe).__name__} has no length before its epoch "
                "starts: the source's length depends on the epoch's seed (pack(fit='best', shuffle_documents=True) "
                "packs a new number of blocks every epoch), which is the DataLoader's when seed=None; pass "
                "dist_shard(seed=...) for a length known ahead"
            )
        self._seed_upstream(self.core.run_seed(self.core.pending, self.seed or 0))

    def __len__(self) -> int:
        """This worker's count inside a DataLoader worker; else this rank's count,
        over the workers of the DataLoader that iterates (or asks ``len()`` of)
        this pipe, or 1 if none did yet.

        After ``load_state_dict``: with a slot's own state (same ranks and workers),
        still that slot's whole share of the epoch, deliberately (as a
        StatefulDataLoader's ``len`` over a sampler), of which iteration yields only
        what is left: a trainer that restores its batch counter and stops at
        ``len(loader)`` (Lightning) then stops at the epoch's real end. With a merged
        state (``merge_states``, any ranks and workers): the new run's share of what
        was left."""
        refusal = frameworks.refusal_for_iteration()  # Accelerate's IterableDatasetShard asks len() too
        if refusal is not None:
            raise SetupError(refusal)
        total = self._total()
        ctx = self.context()
        if get_worker_info() is not None or self.loader_track.sharding:
            return self.core.share(total, ctx.slot, ctx.num_slots)
        workers = _context.loader_num_workers() or self.loader_track.workers or 1
        counts = self.core.rank_shares(total, ctx, workers)
        if workers > 1:
            loaders.check_batched_length(counts, DistShardIterDataPipe)
        return sum(counts)

    # -- seeing it -------------------------------------------------------------------
    def explain(self, pipeline: IterDataPipe | None = None) -> Any:
        """What this pipe will do here: context and where it came from, the plan
        (slots, counts, what ``even`` drops or repeats), how often elements are read
        and decoded as placed, and warnings with their fix. Pass the whole
        ``pipeline`` to also check what comes after ``dist_shard``
        (``distshard.explain(pipeline)`` does that for you).

        Returns a :class:`distshard.Explanation` (``print`` it, or let a notebook show it).

        Example:
            >>> print(IterableWrapper(range(10)).dist_shard(rank=0, world_size=2).explain())  # doctest: +SKIP
        """
        return explain_model(self.plan_model(), pipeline)

    def plan_model(self) -> PlanModel:
        """What this pipe will do here, as ``explain()`` reads it (see :class:`distshard.core.PlanModel`)."""
        ctx = self.context()
        try:
            total: int | None = self._total()
        except TypeError:
            total = None
        randoms = self.upstream.random_pipes(self.source_datapipe)
        return self.core.model(
            context=ctx,
            seed=self.base_seed(ctx),
            total=total,
            pushdown=self.pushdown,
            read_plan=self.read_plan(),
            reader=self.reader,
            random_pipes=randoms,
            source=self.source_datapipe,
            pipe=self,
            label=repr(self),
        )

    def _repr_html_(self) -> str:
        return self.explain()._repr_html_()

    def __repr__(self) -> str:
        extra = [] if self.pushdown else ["pushdown=False"]
        return self.core.describe(type(self).__name__, type(self.source_datapipe).__name__, extra)

    __str__ = __repr__

    # -- pickling ------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        # per-process caches (the core leaves out the progress of an iteration that ran
        # here, not in the copy, and captures the rank: ShardCore.__getstate__)
        state["_pushdown"] = None  # (and the upstream's random pipes: Upstream.__getstate__)
        if IterDataPipe.getstate_hook is not None:  # torch is walking the graph (graph.traverse_dps)
            if loaders.walk_for_seeds_or_sharding():
                # The DataLoader walks the graph to seed random pipes and apply sharding
                # (twice in every worker, at start-up). dist_shard seeds everything
                # upstream itself and refused upstream sharding at construction, so
                # those walks end here instead of pickling the upstream data (for
                # in-memory records most of a worker's start-up, and a copy-on-write
                # of every page they sit on); every other walk sees the whole graph.
                state.pop("source_datapipe", None)
            return IterDataPipe.getstate_hook(state)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def shards_in(pipeline: Any) -> list[DistShardIterDataPipe]:
    """Every ``dist_shard`` in ``pipeline`` (itself included), in traversal order.

    ``pipeline`` may be an ``IterDataPipe``, a :class:`distshard.StatefulPipeline`
    or anything holding the pipeline as ``.pipeline`` or ``.dataset`` (a DataLoader)."""
    pipeline = pipeline_of(pipeline)
    if pipeline is None:
        return []
    return [p for p in upstream_pipes(pipeline) if isinstance(p, DistShardIterDataPipe)]


def set_epoch(pipeline: Any, epoch: int) -> Any:
    """Call ``set_epoch(epoch)`` on every ``dist_shard`` in ``pipeline`` and return it,
    so a training loop need not keep a reference to the shard itself.

    ``pipeline``: an ``IterDataPipe``, a :class:`distshard.StatefulPipeline`, or a
    DataLoader over either.

    Example:
        >>> for epoch in range(epochs):  # doctest: +SKIP
        ...     distshard.set_epoch(pipeline, epoch)
        ...     for batch in DataLoader(pipeline, batch_size=None, num_workers=4): ...
    """
    shards = shards_in(pipeline)
    if not shards:
        raise OptionError(f"{type(pipeline).__name__} has no dist_shard upstream to set the epoch of")
    for shard in shards:
        shard.set_epoch(epoch)
    return pipeline
