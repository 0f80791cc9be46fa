"""``DistShardIterDataPipe``: the ``.dist_shard()`` functional."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, TypeVar

from torch.utils.data import get_worker_info
from torch.utils.data.datapipes._decorator import functional_datapipe
from torch.utils.data.datapipes.datapipe import IterDataPipe
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torch.utils.data.datapipes.iter.utils import IterableWrapperIterDataPipe

from . import context as _context
from .graph import Pushdown, check_no_sharding, plan_pushdown, random_pipes
from .plan import (
    Even,
    Permutation,
    Remaining,
    block_positions,
    check_even,
    mix_seed,
    select_stream,
    slot_count,
    slot_positions,
)
from .state import fresh_state, validate_state
from .units import check_sizes, iterate_sized_units, iterate_whole_units, unit_sizes

if TYPE_CHECKING:
    from .explain import Explanation

T = TypeVar("T")

__all__ = ["DistShardIterDataPipe", "set_epoch", "shards_in"]


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
        if shuffle and expand is None and plan_pushdown(source_datapipe, pushdown).sequence is None:
            raise ValueError(
                f"shuffle=True needs random access to the stream, but it comes from "
                f"{type(source_datapipe).__name__}: use IterableWrapper over a list/range/"
                "MapDataPipe with only .map() in between, unit mode with sizes=, or shuffle "
                "upstream with .shuffle() and shuffle=False"
            )
        if self._explicit is None:
            # Surface a malformed RANK / WORLD_SIZE now rather than in a worker.
            _context.env_rank_world()
        check_no_sharding(source_datapipe)
        self._epoch = 0
        self._captured: tuple[int, int] | None = None
        self._loader_seed: int | None = None
        self._loader_seed_shared = False
        self._random_pipes: list | None = None  # per process, never pickled
        self._pushdown: Pushdown | None = None  # per process, never pickled
        self._resume: dict[str, Any] | None = None  # a loaded state, applied by the next iteration
        self._progress: _Progress | None = None  # the state of the current iteration

    # -- who am I ---------------------------------------------------------------
    def context(self) -> _context.ShardContext:
        """The :class:`~distshard.ShardContext` this pipe resolves to in this process."""
        return _context.current_context(*(self._explicit or (None, None)), _captured=self._captured)

    # -- hooks torch's DataLoader calls ----------------------------------------
    def apply_sharding(
        self,
        num_of_instances: int,
        instance_id: int,
        sharding_group: SHARDING_PRIORITIES = SHARDING_PRIORITIES.DEFAULT,
    ) -> None:
        """Called by torch's DataLoader (and ``graph_settings.apply_sharding``).

        ``dist_shard`` resolves ranks and workers itself, so the values are
        ignored. Having this method makes torch's own check raise when a
        ``sharding_filter`` sits in the same chain.
        """

    def set_seed(self, seed: int) -> "DistShardIterDataPipe[T]":
        """Called by torch's DataLoader with the seed it shares with all workers.

        Used as the base of upstream randomness only when ``seed`` was not given
        and the value is the same on every rank: with ``torch.distributed``
        initialized (the DataLoader broadcasts it) or a single rank.
        """
        self._loader_seed = int(seed)
        self._loader_seed_shared = _context.dist_rank_world() is not None or self._captured is not None
        return self

    def set_epoch(self, epoch: int) -> "DistShardIterDataPipe[T]":
        """Set the epoch; upstream random pipes are seeded from ``(seed, epoch)``.

        Call it with the same value on every rank before each epoch, before the
        DataLoader creates its iterator (workers receive a copy of the pipe then).
        """
        epoch = _check_seed("epoch", epoch, allow_none=False)  # type: ignore[assignment]
        if self._resume is not None and self._resume["epoch"] != epoch:
            self._resume = None  # a loaded state of another epoch no longer applies
        self._epoch = epoch
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
        for index, pipe in enumerate(self._random_pipes):
            pipe.set_seed(mix_seed(base, self._epoch, index))

    # -- iteration ---------------------------------------------------------------
    def read_plan(self) -> Pushdown:
        """How this pipe reads its source (see :class:`distshard.graph.Pushdown`)."""
        if self._pushdown is None:
            self._pushdown = plan_pushdown(self.source_datapipe, self.pushdown and self.expand is None)
        return self._pushdown

    @property
    def mode(self) -> str:
        """``element``, ``units`` (expand without sizes) or ``sized_units``."""
        if self.expand is None:
            return "element"
        return "units" if self.sizes is None else "sized_units"

    def _start(self, ctx: _context.ShardContext) -> _Progress:
        """The progress record of the iteration that starts now, from a loaded
        state if there is one for this epoch."""
        resume, self._resume = self._resume, None
        if resume is not None and resume["epoch"] == self._epoch:
            if resume["slot"] is not None and (resume["slot"], resume["num_slots"]) != (ctx.slot, ctx.num_slots):
                raise ValueError(
                    f"the loaded state is slot {resume['slot']} of {resume['num_slots']}'s, but this copy "
                    f"is slot {ctx.slot} of {ctx.num_slots} (rank {ctx.rank} of {ctx.world_size}, worker "
                    f"{ctx.worker_id} of {ctx.num_workers}); to resume with other ranks or workers, "
                    "merge the states of all slots with distshard.merge_states() and load that"
                )
            seed = resume["seed"] if resume["seed"] is not None else self.base_seed(ctx)
            remaining = Remaining((a, b) for a, b in resume["remaining"])
            return _Progress(self._epoch, seed, remaining, ctx, resume["taken"])
        return _Progress(self._epoch, self.base_seed(ctx), Remaining(), ctx, 0)

    def _order(self, total: int, seed: int) -> Permutation | None:
        if not self.global_shuffle:
            return None
        return Permutation(total, mix_seed(seed, self._epoch, 0x5EED))

    def __iter__(self) -> Iterator[T]:
        ctx = self.context()
        progress = self._progress = self._start(ctx)
        self._seed_upstream(progress.seed)
        if self.expand is not None:
            selected = self._iter_units(progress)
        else:
            plan = self.read_plan()
            if plan.sequence is not None:
                selected = self._iter_sequence(plan, progress)
            else:
                selected = select_stream(progress.remaining.stream(_unwrapped(plan.base)), ctx.slot,
                                         ctx.num_slots, self.even, progress.taken)
            if plan.maps:
                selected = map(plan.apply, selected)
        for element in selected:
            progress.taken += 1
            yield element
        progress.finished = True

    def _positions(self, progress: _Progress, total: int, blocks: bool = False) -> Iterator[int]:
        """The visit indices this slot still has to yield, out of ``total``."""
        remaining = progress.remaining.clip(total)
        count = remaining.length()
        assert count is not None
        progress.total = count
        ctx = progress.ctx
        layout = block_positions if blocks else slot_positions
        own = layout(ctx.slot, ctx.num_slots, count, self.even, progress.taken)  # O(1) to skip
        if remaining == Remaining([(0, total)]):
            return own
        return map(remaining.indexer(), own)

    def _iter_sequence(self, plan: Pushdown, progress: _Progress) -> Iterator[Any]:
        """The fast path: index the slot's own positions, O(1) to reach any of them."""
        sequence = plan.sequence
        total = len(sequence)
        positions = self._positions(progress, total)
        order = self._order(total, progress.seed)
        if order is not None:
            positions = map(order, positions)
        if not plan.copy_elements:
            for position in positions:
                yield sequence[position]
            return
        warned = False
        for position in positions:
            element = sequence[position]
            try:  # IterableWrapper(deepcopy=True) copies the data; we copy only what we yield
                element = copy.deepcopy(element)
            except TypeError:
                if not warned:
                    warnings.warn(_DEEPCOPY_WARNING, stacklevel=2)
                    warned = True
            yield element

    def _iter_units(self, progress: _Progress) -> Iterator[Any]:
        expand = self.expand
        assert expand is not None
        ctx = progress.ctx
        if self.sizes is None:
            if not progress.remaining.is_full:
                raise ValueError("a merged state cannot be resumed in unit mode without sizes=")
            yield from iterate_whole_units(self.source_datapipe, expand, ctx.slot, ctx.num_slots,
                                           progress.taken)
            return
        units = list(self.source_datapipe)
        sizes = unit_sizes(units, self.sizes)
        total = sum(sizes)
        order = self._order(total, progress.seed)
        positions = self._positions(progress, total, blocks=order is None)
        yield from iterate_sized_units(units, sizes, expand, positions, order, check_empty=ctx.slot == 0)

    # -- state ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This copy's position in the epoch, as JSON-serialisable data.

        Taken between two elements it lets a fresh pipe continue exactly after the
        last element this one yielded. States of all slots can be merged with
        :func:`distshard.merge_states` to resume with other ranks or workers.
        """
        progress = self._progress
        if progress is not None and progress.epoch == self._epoch:
            return progress.state(self.mode, self.even)
        if self._resume is not None:
            return dict(self._resume)
        return fresh_state(self._epoch, self.mode, self.even)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` at the next iteration (a slot's or a merged state).

        A state taken at the end of an epoch starts the next epoch. Raises
        ``ValueError`` for a malformed state or one from another kind of pipeline,
        leaving this pipe unchanged.
        """
        found = validate_state(state)
        if found["mode"] != self.mode:
            raise ValueError(
                f"the state comes from a dist_shard in {found['mode']!r} mode, this one is in "
                f"{self.mode!r} mode; load it into the pipeline that saved it"
            )
        if found["slot"] is not None and found["even"] != self.even:
            raise ValueError(
                f"the state was saved with even={found['even']!r} but this pipe has even={self.even!r}"
            )
        if found["finished"]:
            self._epoch, self._resume = found["epoch"] + 1, None
        else:
            self._epoch, self._resume = found["epoch"], found
        self._progress = None

    def _total(self) -> int:
        """The number of positions ``dist_shard`` splits, if it can be known."""
        if self.expand is not None:
            if self.sizes is None:
                raise TypeError(f"{type(self).__name__} in unit mode without sizes= has no length")
            units = list(self.source_datapipe)
            return sum(unit_sizes(units, self.sizes))
        try:
            return len(self.source_datapipe)
        except TypeError:
            raise TypeError(
                f"{type(self).__name__} has no length: its source "
                f"{type(self.source_datapipe).__name__} has none"
            ) from None

    def __len__(self) -> int:
        total = self._total()
        ctx = self.context()
        if get_worker_info() is not None:
            return slot_count(ctx.slot, ctx.num_slots, total, self.even)
        workers = _context.loader_num_workers() or 1
        num_slots = ctx.world_size * workers
        first = ctx.rank * workers
        return sum(slot_count(s, num_slots, total, self.even) for s in range(first, first + workers))

    # -- seeing it -------------------------------------------------------------------
    def explain(self, pipeline: IterDataPipe | None = None) -> "Explanation":
        """What this pipe will do here: context and where it came from, the plan
        (slots, counts, what ``even`` drops or repeats), how often elements are read
        and decoded as placed, and warnings with their fix. Pass the whole
        ``pipeline`` to also check what comes after ``dist_shard``.

        Example:
            >>> print(IterableWrapper(range(10)).dist_shard(rank=0, world_size=2).explain())  # doctest: +SKIP
        """
        from .explain import explain

        return explain(self, pipeline)

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


class _Progress:
    """Where the current iteration of one slot is: what its ``state_dict`` reports."""

    __slots__ = ("epoch", "seed", "remaining", "ctx", "taken", "total", "finished")

    def __init__(self, epoch: int, seed: int, remaining: Remaining,
                 ctx: _context.ShardContext, taken: int) -> None:
        self.epoch, self.seed, self.remaining, self.ctx = epoch, seed, remaining, ctx
        self.taken, self.total, self.finished = taken, None, False

    def state(self, mode: str, even: Even) -> dict[str, Any]:
        state = fresh_state(self.epoch, mode, even)
        state.update(
            seed=self.seed, remaining=self.remaining.to_list(), total=self.total,
            num_slots=self.ctx.num_slots, slot=self.ctx.slot, taken=self.taken,
            finished=self.finished,
        )
        return state


_DEEPCOPY_WARNING = ("The input iterable can not be deepcopied, please be aware of in-place "
                     "modification would affect source data.")


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
            warnings.warn(_DEEPCOPY_WARNING, stacklevel=3)
    return data


def shards_in(pipeline: IterDataPipe) -> list[DistShardIterDataPipe]:
    """Every ``dist_shard`` in ``pipeline`` (itself included), in traversal order."""
    from .graph import upstream_pipes

    return [p for p in upstream_pipes(pipeline) if isinstance(p, DistShardIterDataPipe)]


def set_epoch(pipeline: IterDataPipe, epoch: int) -> IterDataPipe:
    """Call ``set_epoch(epoch)`` on every ``dist_shard`` in ``pipeline`` and return it,
    so a training loop need not keep a reference to the shard itself.

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
