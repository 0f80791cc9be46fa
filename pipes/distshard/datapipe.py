"""``DistShardIterDataPipe``: the ``.dist_shard()`` functional.

This module is the DataPipe front-end: it finds how to read the source in the
pipe graph (``graph.py``), seeds upstream random pipes, resolves the slot
(``context.py``) and hands one epoch to the engine (``engine.py``), which runs
the plan over a reader (``readers/``). State format and merging live in
``state.py``.
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, TypeVar

from torch.utils.data import get_worker_info
from torch.utils.data.datapipes._decorator import functional_datapipe
from torch.utils.data.datapipes.datapipe import IterDataPipe
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torch.utils.data.datapipes.iter.callable import MapperIterDataPipe
from torch.utils.data.datapipes.iter.utils import IterableWrapperIterDataPipe

from . import context as _context
from . import frameworks
from .engine import SlotRun, remaining_share
from .graph import Pushdown, check_no_sharding, pipeline_of, plan_pushdown, random_pipes, upstream_pipes
from .plan import Even, check_even, check_multiple, mix_seed
from .readers import (
    Reader,
    SequenceReader,
    SizedUnitsReader,
    StreamReader,
    WholeFilesReader,
    WholeUnitsReader,
    check_sizes,
    stable_digest,
    unit_sizes,
)
from .readers.sequence import DEEPCOPY_WARNING
from .state import check_fits, fresh_state, validate_state

if TYPE_CHECKING:
    from .explaining import Explanation

T = TypeVar("T")

__all__ = ["DistShardIterDataPipe", "set_epoch", "shards_in"]

_END = object()


def _check_seed(name: str, value: object, *, allow_none: bool) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} must be an int (got {type(value).__name__})")
    if value < 0:
        raise ValueError(f"{name}={value} must be non-negative")
    return value


@functional_datapipe("dist_shard")
class DistShardIterDataPipe(IterDataPipe[T]):
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
            epoch. Use ``"drop"`` or ``"pad"`` under DDP so that no rank waits in a
            collective for a batch that never comes.
        seed: base seed of upstream randomness and of ``shuffle=True``. ``None``
            means 0, or, under torch's DataLoader with ``torch.distributed``
            initialized (or a single rank), the seed the DataLoader shares with every
            worker and rank.
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
        multiple_of: with ``even="drop"``, round every slot's count down to a
            multiple of this (the batch size of a ``.batch()`` after the shard), so
            every batch is full, every rank runs the same number of steps, and
            ``len()`` of the batched pipeline (what Lightning stops at) is exact.

    Example:
        >>> import distshard
        >>> from torch.utils.data.datapipes.iter import IterableWrapper
        >>> dp = IterableWrapper(["a", "b", "c", "d", "e"]).dist_shard(rank=1, world_size=2)
        >>> list(dp)
        ['b', 'd']
    """

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
    ) -> None:
        super().__init__()
        if not isinstance(source_datapipe, IterDataPipe):
            raise TypeError(
                f"dist_shard needs an IterDataPipe source, got {type(source_datapipe).__name__}; "
                "wrap an iterable with torch.utils.data.datapipes.iter.IterableWrapper"
            )
        self.source_datapipe = source_datapipe
        self._explicit = _context.check_explicit(rank, world_size)
        self.even = check_even(even)
        self.seed = _check_seed("seed", seed, allow_none=True)
        if not isinstance(shuffle, bool):
            raise TypeError(f"shuffle={shuffle!r} must be True or False")
        if not isinstance(pushdown, bool):
            raise TypeError(f"pushdown={pushdown!r} must be True or False")
        if expand is not None and not callable(expand):
            raise TypeError(f"expand={expand!r} must be a callable unit -> elements")
        self.multiple_of = check_multiple(multiple_of, self.even)
        self.global_shuffle = shuffle  # not "shuffle": that name is the .shuffle() functional
        self.pushdown = pushdown
        self.expand = expand
        self.sizes = check_sizes(sizes)
        if self.sizes is not None and expand is None:
            raise ValueError("sizes= counts the elements of each unit and needs expand=; "
                             "pass expand=fn that yields a unit's elements, or drop sizes=")
        if expand is not None and self.sizes is None and (self.even is not None or shuffle):
            what = f"even={self.even!r}" if self.even is not None else "shuffle=True"
            raise ValueError(
                f"{what} with expand= needs sizes= (the element count of each unit): without "
                "them no slot knows how many elements the others get. Pass sizes=, or use "
                "even=None and shuffle upstream with .shuffle()"
            )
        self._pushdown: Pushdown | None = None  # per process, never pickled
        self._whole_files = self._streams_whole_files()
        if self._whole_files and (self.even is not None or shuffle):
            raise ValueError(
                f"{'shuffle=True' if shuffle else f'even={self.even!r}'} needs random access, but "
                f"{self.read_plan().base.describe()}. Decompress the files to read them at random, or "
                "use even=None and shuffle=False (end DDP loops with distshard.stop_together(); a "
                ".shuffle(buffer) after dist_shard mixes what a slot reads)")
        if shuffle and not self._can_shuffle():
            raise ValueError(
                f"shuffle=True needs random access to the stream, but it comes from "
                f"{type(source_datapipe).__name__}: use IterableWrapper over a list/range/"
                "MapDataPipe with only .map() in between, unit mode with sizes=, or shuffle "
                "upstream with .shuffle() and shuffle=False"
            )
        if self._explicit is None:
            # Surface a malformed RANK / WORLD_SIZE now rather than in a worker.
            _context.check_environment()
        check_no_sharding(source_datapipe)
        self._sizes_cache: dict[Any, int] = {}  # a sizes callable's answers, asked once per job
        if callable(self.sizes) and not isinstance(self.sizes, Mapping):
            self._count_units()  # before any DataLoader worker copies the pipe
        self._epoch = 0
        self._epoch_set = False  # set_epoch was called: a loaded state of another epoch is void
        self._captured: tuple[int, int] | None = None
        self._loader_seed: int | None = None
        self._loader_seed_shared = False
        self._loader_workers: int | None = None  # workers of the last DataLoader iterating us
        self._sharding: dict[SHARDING_PRIORITIES, tuple[int, int]] = {}  # apply_sharding overrides
        self._chain: str | None = None  # identity of the upstream graph, computed once
        self._refusal: str | None = None  # why the loader iterating us would lose data
        self._random_pipes: list | None = None  # per process, never pickled
        self._pushdown: Pushdown | None = None  # per process, never pickled
        self._resume: dict[str, Any] | None = None  # a loaded state, applied by the next iteration
        self._progress: SlotRun | None = None  # the current iteration

    def _streams_whole_files(self) -> bool:
        """Whether the source is a file source that cannot be read at random
        (compressed files): its files then go whole to slots. Finding out indexes
        a file source once, here (its identities travel to the DataLoader workers)."""
        if self.expand is not None:
            return False
        base = self.source_datapipe
        while self.pushdown and isinstance(base, MapperIterDataPipe):
            base = base.datapipe
        if not hasattr(type(base), "__distshard_units__"):
            return False
        return self.read_plan().sequence is None

    def _can_shuffle(self) -> bool:
        if self.expand is not None:
            return self.sizes is not None
        return plan_pushdown(self.source_datapipe, self.pushdown).sequence is not None

    # -- who am I ---------------------------------------------------------------
    def context(self) -> _context.ShardContext:
        """The :class:`~distshard.ShardContext` this pipe resolves to in this process."""
        if self._sharding:
            return self._override_context()
        return _context.current_context(*(self._explicit or (None, None)), _captured=self._captured)

    def _override_context(self) -> _context.ShardContext:
        """The context when ``apply_sharding`` was called with values of its own
        (not the DataLoader's automatic call): honoured as an explicit split."""
        info = get_worker_info()
        default = self._sharding.get(SHARDING_PRIORITIES.DEFAULT)
        if default is not None:
            if len(self._sharding) > 1:
                raise RuntimeError("apply_sharding was called with the DEFAULT group and another "
                                   "group on this dist_shard: use one or the other")
            if info is not None:
                raise RuntimeError(
                    f"apply_sharding({default[0]}, {default[1]}) was called on this dist_shard, and it "
                    f"also runs in DataLoader worker {info.id} of {info.num_workers}: it cannot honour "
                    "both splits. Drop the apply_sharding call (dist_shard splits over ranks and "
                    "workers by itself) or pass rank=/world_size= to dist_shard"
                )
            return _context.ShardContext(default[1], default[0], 0, 1, "apply_sharding")
        ranks = self._sharding.get(SHARDING_PRIORITIES.DISTRIBUTED)
        if ranks is not None:
            rank, world = ranks[1], ranks[0]
            source = "apply_sharding"
        else:
            rank, world, source = _context.resolve_distributed(self._explicit, self._captured)
        workers = self._sharding.get(SHARDING_PRIORITIES.MULTIPROCESSING)
        if workers is not None:
            if info is not None and (workers[0], workers[1]) != (info.num_workers, info.id):
                raise RuntimeError(
                    f"apply_sharding({workers[0]}, {workers[1]}, MULTIPROCESSING) disagrees with "
                    f"DataLoader worker {info.id} of {info.num_workers}; drop the call"
                )
            return _context.ShardContext(rank, world, workers[1], workers[0], source)
        if info is None:
            return _context.ShardContext(rank, world, 0, 1, source)
        return _context.ShardContext(rank, world, info.id, info.num_workers, source)

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
        for name, value in (("num_of_instances", num_of_instances), ("instance_id", instance_id)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}={value!r} must be an int")
        if num_of_instances < 1 or not 0 <= instance_id < num_of_instances:
            raise ValueError(f"instance_id={instance_id} must be in [0, num_of_instances={num_of_instances})")
        if sharding_group == SHARDING_PRIORITIES.DEFAULT and \
                (num_of_instances, instance_id) == _torch_split(self._captured):
            return  # the DataLoader's own call: nothing to override
        self._sharding[sharding_group] = (num_of_instances, instance_id)

    def set_seed(self, seed: int) -> "DistShardIterDataPipe[T]":
        """Called by torch's DataLoader with the seed it shares with all workers.

        Used as the base of upstream randomness only when ``seed`` was not given
        and the value is the same on every rank: with ``torch.distributed``
        initialized (the DataLoader broadcasts it) or a single rank.
        """
        self._loader_seed = int(seed)
        self._loader_seed_shared = _context.dist_rank_world() is not None or self._captured is not None
        loader_iter = _iterating_loader()
        if loader_iter is not None:
            self._loader_workers = max(1, int(loader_iter._num_workers))
        self._refusal = frameworks.refusal_for_loader()
        return self

    def set_shuffle(self, shuffle: bool = True) -> "DistShardIterDataPipe[T]":
        """Called by torch's DataLoader with its ``shuffle=`` argument (when given).

        ``False`` turns ``shuffle=True`` off; ``True`` turns it on where the source
        allows random access (elsewhere upstream ``.shuffle()`` pipes, which the
        DataLoader turns on too, do the shuffling).
        """
        self.global_shuffle = bool(shuffle) and self._can_shuffle()
        return self

    def set_epoch(self, epoch: int) -> "DistShardIterDataPipe[T]":
        """Set the epoch; upstream random pipes are seeded from ``(seed, epoch)``.

        Call it with the same value on every rank before each epoch, before the
        DataLoader creates its iterator (workers receive a copy of the pipe then).
        A loaded state of another epoch is discarded (also when it is loaded later,
        as StatefulDataLoader does in its workers): a state resumes its own epoch only.
        """
        epoch = _check_seed("epoch", epoch, allow_none=False)  # type: ignore[assignment]
        if self._resume is not None and self._resume["epoch"] != epoch:
            self._resume = None
        self._epoch, self._epoch_set = epoch, True
        return self

    @property
    def epoch(self) -> int:
        return self._epoch

    def base_seed(self, ctx: _context.ShardContext | None = None) -> int:
        """The base seed of upstream randomness this copy uses (see ``seed``)."""
        if self.seed is not None:
            return self.seed
        if self._loader_seed is not None:
            ctx = ctx or self.context()
            if self._loader_seed_shared or ctx.world_size == 1:
                return self._loader_seed
        return 0

    def _seed_upstream(self, base: int) -> None:
        if self._random_pipes is None:
            self._random_pipes = random_pipes(self.source_datapipe)
        salt = stable_digest(self.chain_identity())
        for index, pipe in enumerate(self._random_pipes):
            pipe.set_seed(mix_seed(base, self._epoch, index, int(salt, 16)))

    # -- how the source is read ---------------------------------------------------
    def read_plan(self) -> Pushdown:
        """How this pipe reads its source (see :class:`distshard.graph.Pushdown`)."""
        if self._pushdown is None:
            self._pushdown = plan_pushdown(self.source_datapipe, self.pushdown and self.expand is None)
        return self._pushdown

    @property
    def mode(self) -> str:
        """``element``, ``units`` (expand without sizes, or whole files) or ``sized_units``."""
        if self.expand is None:
            return "units" if self._whole_files else "element"
        return "units" if self.sizes is None else "sized_units"

    def chain_identity(self) -> str:
        """A process-independent identity of the upstream graph: the pipes' types
        and, for ``IterableWrapper``s, what they wrap (see ``readers.base``)."""
        if self._chain is None:
            parts = []
            for pipe in upstream_pipes(self.source_datapipe):
                part = type(pipe).__qualname__
                if isinstance(pipe, IterableWrapperIterDataPipe):
                    data = pipe.iterable
                    size = len(data) if hasattr(data, "__len__") else None
                    sample = (data[0], data[-1]) if type(data) in (list, tuple, range) and data else ()
                    part += f"({type(data).__qualname__}:{size}:{stable_digest(*sample)})"
                parts.append(part)
            self._chain = ">".join(parts)
        return self._chain

    def reader(self) -> Reader:
        """The reader of this epoch's source (lists the units in unit mode)."""
        if self.expand is not None:
            if self.sizes is None:
                return WholeUnitsReader(lambda: self.source_datapipe, self.expand,
                                        f"units:{self.chain_identity()}")
            units = list(self.source_datapipe)
            return SizedUnitsReader(units, self._unit_sizes(units), self.expand)
        plan = self.read_plan()
        if plan.sequence is not None:
            return SequenceReader(plan.sequence, plan.copy_elements)
        base = plan.base
        if self._whole_files:
            files, expand = base.__distshard_units__()  # type: ignore[attr-defined]
            return WholeFilesReader(lambda: files, expand, f"files:{stable_digest(files)}:{self.chain_identity()}",
                                    base.describe())  # type: ignore[attr-defined]
        return StreamReader(lambda: _unwrapped(base), type(base).__name__,
                            f"stream:{self.chain_identity()}")

    def _unit_sizes(self, units: list) -> list[int]:
        """Every unit's count. A ``sizes`` callable is asked once per unit per job
        when the pipe is built (see ``_count_units``), and its answers travel to the
        DataLoader workers with the pipe, so no slot asks again."""
        sizes = self.sizes
        if not callable(sizes) or isinstance(sizes, Mapping):
            return unit_sizes(units, sizes)  # type: ignore[arg-type]
        try:
            missing = [unit for unit in units if unit not in self._sizes_cache]
        except TypeError:  # unhashable units: nothing to remember them by
            return unit_sizes(units, sizes)
        self._sizes_cache.update(zip(missing, unit_sizes(missing, sizes)))
        return [self._sizes_cache[unit] for unit in units]

    def _count_units(self) -> None:
        """Ask a ``sizes`` callable for every unit, once per job: with
        torch.distributed up each rank asks for its share of the units and the
        answers are exchanged (a collective at construction, like building a file
        source: build the pipeline on every rank); else this process asks for all.
        DataLoader workers inherit the answers with the pipe."""
        units = list(self.source_datapipe)
        found = _context.dist_rank_world()
        if found is None or found[1] == 1 or get_worker_info() is not None:
            self._unit_sizes(units)
            return
        rank, world = found
        share = units[rank::world]
        try:
            mine: Any = dict(zip(share, self._unit_sizes(share)))
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            mine = exc
        answers = _context.gather_objects(mine)
        for answer in answers:
            if isinstance(answer, Exception):
                raise answer
            self._sizes_cache.update(answer)

    # -- iteration ---------------------------------------------------------------
    def _pending(self) -> dict[str, Any] | None:
        """The loaded state the next iteration resumes, if it is of this epoch."""
        resume = self._resume
        return resume if resume is not None and resume["epoch"] == self._epoch else None

    def __iter__(self) -> Iterator[T]:
        refusal = self._refusal or frameworks.refusal_for_iteration()
        if refusal is not None:
            raise RuntimeError(refusal)
        ctx = self.context()
        resume = self._pending()
        seed = resume["seed"] if resume is not None and resume["seed"] is not None else self.base_seed(ctx)
        self._seed_upstream(seed)
        reader = self.reader()
        if resume is not None:
            self._check_against(resume, reader)
        # raises before anything is consumed if the state is for another slot
        run = SlotRun(reader, ctx=ctx, even=self.even, shuffle=self.global_shuffle,
                      epoch=self._epoch, seed=seed, resume=resume, multiple=self.multiple_of)
        self._progress = run
        plan = self.read_plan() if self.expand is None else None
        elements = map(plan.apply, run) if plan is not None and plan.maps else iter(run)
        # the loaded state stays pending until the run shows it fits (a stream shorter
        # than the state claims raises at the first element, every time)
        first = next(elements, _END)
        self._resume = None
        if first is _END:
            return
        yield first
        yield from elements

    # -- state ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This copy's position in the epoch, as JSON-serialisable data.

        Taken between two elements it lets a fresh pipe continue exactly after the
        last element this one yielded. States of all slots can be merged with
        :func:`distshard.merge_states` to resume with other ranks or workers.
        """
        progress = self._progress
        if progress is not None and progress.epoch == self._epoch:
            return progress.state()
        pending = self._pending()
        if pending is not None:
            return dict(pending)
        return fresh_state(self._epoch, self.mode, self.even)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` at the next iteration (a slot's or a merged state).

        The state resumes its own epoch: a fresh pipe takes the state's epoch; after
        ``set_epoch(e)`` a state of another epoch is discarded. A state taken after
        a slot's last element resumes with nothing left of that epoch for that slot.
        Raises ``ValueError`` for a malformed state or one from another pipeline
        (other options, other data), leaving this pipe exactly as it was.
        """
        found = validate_state(state)
        self._check_against(found, self.reader() if self._cheap_reader() else None)
        if self._epoch_set and found["epoch"] != self._epoch:
            return  # a state of another epoch than the one set: void (see set_epoch)
        self._epoch, self._resume, self._progress = found["epoch"], found, None

    def _cheap_reader(self) -> bool:
        """Whether building the reader reads no data (everything but listing units,
        which is cheap too unless sizes are computed from the files)."""
        return not (self.mode == "sized_units" and callable(self.sizes) and not isinstance(self.sizes, Mapping))

    def _check_against(self, found: dict[str, Any], reader: Reader | None) -> None:
        """Raise ``ValueError`` if ``found`` does not come from a pipe like this one."""
        check_fits(found, mode=self.mode, shuffle=self.global_shuffle, even=self.even,
                   multiple_of=self.multiple_of, seed=self.seed,
                   length=reader.length() if reader is not None else None,
                   source=reader.identity() if reader is not None else None)

    # -- length ------------------------------------------------------------------------
    def _total(self) -> int:
        """The number of positions ``dist_shard`` splits, if it can be known."""
        if self._whole_files:
            raise TypeError(f"{type(self).__name__} over whole files (compressed) has no length: a slot's count "
                            "is known only once its files are read")
        if self.expand is not None:
            if self.sizes is None:
                raise TypeError(f"{type(self).__name__} in unit mode without sizes= has no length")
            return sum(self._unit_sizes(list(self.source_datapipe)))
        try:
            return len(self.source_datapipe)
        except TypeError:
            raise TypeError(
                f"{type(self).__name__} has no length: its source "
                f"{type(self.source_datapipe).__name__} has none"
            ) from None

    def __len__(self) -> int:
        """This worker's count inside a DataLoader worker; else this rank's count,
        over the workers of the DataLoader that iterates (or asks ``len()`` of)
        this pipe, or 1 if none did yet. After loading a slot's own state: still the
        whole epoch's count (as StatefulDataLoader's ``len``), of which the loader
        yields what is left; after a merged state: the share of what was left."""
        total = self._total()
        ctx = self.context()
        resume = self._pending()
        if get_worker_info() is not None or self._sharding:
            return self._share(total, resume, ctx.slot, ctx.num_slots)
        workers = _context.loader_num_workers() or self._loader_workers or 1
        num_slots = ctx.world_size * workers
        first = ctx.rank * workers
        counts = [self._share(total, resume, s, num_slots) for s in range(first, first + workers)]
        if workers > 1:
            _check_batched_length(counts)
        return sum(counts)

    def _share(self, total: int, resume: dict | None, slot: int, num_slots: int) -> int:
        if resume is not None and resume["slot"] is not None and resume["slot"] != slot:
            resume = None  # another slot's state: that copy will refuse it when iterated
        return remaining_share(total, resume, slot, num_slots, self.even, self.multiple_of)

    # -- seeing it -------------------------------------------------------------------
    def explain(self, pipeline: IterDataPipe | None = None) -> "Explanation":
        """What this pipe will do here: context and where it came from, the plan
        (slots, counts, what ``even`` drops or repeats), how often elements are read
        and decoded as placed, and warnings with their fix. Pass the whole
        ``pipeline`` to also check what comes after ``dist_shard``
        (``distshard.explain(pipeline)`` does that for you).

        Example:
            >>> print(IterableWrapper(range(10)).dist_shard(rank=0, world_size=2).explain())  # doctest: +SKIP
        """
        from .explaining import explain_shard

        return explain_shard(self, pipeline)

    def _repr_html_(self) -> str:
        return self.explain()._repr_html_()

    def __repr__(self) -> str:
        options = [f"even={self.even!r}"]
        if self._explicit is not None:
            options.append(f"rank={self._explicit[0]}, world_size={self._explicit[1]}")
        if self.seed is not None:
            options.append(f"seed={self.seed}")
        if self.global_shuffle:
            options.append("shuffle=True")
        if self.expand is not None:
            options.append(f"expand={getattr(self.expand, '__name__', self.expand)!r}")
            options.append(f"sizes={'given' if self.sizes is not None else None}")
        if not self.pushdown:
            options.append("pushdown=False")
        if self.multiple_of != 1:
            options.append(f"multiple_of={self.multiple_of}")
        return f"{type(self).__name__}({type(self.source_datapipe).__name__}, {', '.join(options)})"

    __str__ = __repr__

    # -- pickling ------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        # per-process caches, and the progress of an iteration that ran here, not in the copy
        state["_random_pipes"] = state["_pushdown"] = state["_progress"] = None
        found = _context.dist_rank_world()
        if found is not None:
            state["_captured"] = found
        if IterDataPipe.getstate_hook is not None:
            return IterDataPipe.getstate_hook(state)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._captured is not None:
            _context.note_captured(self._captured)


def _torch_split(captured: tuple[int, int] | None) -> tuple[int, int]:
    """``(num_of_instances, instance_id)`` torch's DataLoader passes to
    ``apply_sharding`` in this process: from torch.distributed only (as the main
    process saw it: ``captured`` in a spawned worker; else one rank), times the
    workers in a worker, numbered worker-major."""
    rank, world = _context.dist_rank_world() or captured or (0, 1)
    info = get_worker_info()
    if info is None:
        return world, rank
    return info.num_workers * world, info.id * world + rank


def _check_batched_length(counts: list[int]) -> None:
    """``len()`` of a ``.batch(n)`` right after the shard (maps in between are fine)
    divides the rank's total by ``n``; with several DataLoader workers each worker
    batches its own share, so that is wrong whenever a share is not a multiple of
    ``n``, and a loop that stops after ``len(loader)`` batches (Lightning) would skip
    data. Raise ``TypeError`` (what ``len`` raises when there is no length: such
    loops then run to the end) naming the fix."""
    from torch.utils.data.datapipes.iter.callable import MapperIterDataPipe
    from torch.utils.data.datapipes.iter.grouping import BatcherIterDataPipe

    frame = sys._getframe(2)
    for _ in range(8):
        owner = frame.f_locals.get("self") if frame is not None else None
        if isinstance(owner, BatcherIterDataPipe):
            size, drop_last = owner.batch_size, owner.drop_last
            per_worker = sum(c // size if drop_last else -(-c // size) for c in counts)
            naive = sum(counts) // size if drop_last else -(-sum(counts) // size)
            if per_worker != naive:
                raise TypeError(
                    f"len() of .batch({size}) after dist_shard is not exact here: each of the "
                    f"{len(counts)} DataLoader workers batches its own share ({counts} elements), so the "
                    f"loader yields {per_worker} batches, not {naive}; pass dist_shard(even='drop', "
                    f"multiple_of={size}) so every share is whole batches"
                )
            return
        if frame is None or not isinstance(owner, (MapperIterDataPipe, DistShardIterDataPipe)):
            return
        frame = frame.f_back


def _iterating_loader() -> Any:
    """The DataLoader iterator being created right now, if this call comes from one
    (torch seeds the pipe from ``_BaseDataLoaderIter.__init__``)."""
    for owner in _context.callers(8, skip=3):
        if type(owner).__name__.endswith("DataLoaderIter") and hasattr(owner, "_num_workers"):
            return owner
    return None


def _unwrapped(base: IterDataPipe) -> Any:
    """What to stream from: an ``IterableWrapper``'s own iterable (same elements,
    same deep copy), which skips torch's per-element hook, about 0.8 µs an
    element: most of the cost of walking a stream to find a slot's share."""
    if type(base) is not IterableWrapperIterDataPipe:
        return base
    data = base.iterable
    if base.deepcopy:
        try:
            data = copy.deepcopy(data)
        except TypeError:
            warnings.warn(DEEPCOPY_WARNING, stacklevel=3)
    return data


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
        raise ValueError(f"{type(pipeline).__name__} has no dist_shard upstream to set the epoch of")
    for shard in shards:
        shard.set_epoch(epoch)
    return pipeline
