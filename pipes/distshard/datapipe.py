"""``DistShardIterDataPipe``: the ``.dist_shard()`` functional."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence, TypeVar

from torch.utils.data import get_worker_info
from torch.utils.data.datapipes._decorator import functional_datapipe
from torch.utils.data.datapipes.datapipe import IterDataPipe
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES

from . import context as _context
from .graph import check_no_sharding, random_pipes
from .plan import Even, check_even, mix_seed, select_stream, slot_count

T = TypeVar("T")

__all__ = ["DistShardIterDataPipe"]


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

    Args:
        source_datapipe: the stream to shard.
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
        seed: base seed of upstream randomness. ``None`` means 0, or, under torch's
            DataLoader with ``torch.distributed`` initialized (or a single rank), the
            seed the DataLoader shares with every worker and rank.

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
        sizes: Sequence[int] | Callable[[Any], int] | None = None,
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
        if shuffle is not False or expand is not None or sizes is not None:
            raise NotImplementedError(
                "dist_shard(shuffle=, expand=, sizes=) are not available in this version "
                "of distshard; shuffle upstream with .shuffle() instead"
            )
        if self._explicit is None:
            # Surface a malformed RANK / WORLD_SIZE now rather than in a worker.
            _context.env_rank_world()
        check_no_sharding(source_datapipe)
        self._epoch = 0
        self._captured: tuple[int, int] | None = None
        self._loader_seed: int | None = None
        self._loader_seed_shared = False
        self._sharding_hint: tuple[int, int] | None = None
        self._random_pipes: list | None = None  # per process, never pickled

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

        ``dist_shard`` resolves ranks and workers itself, so the values are only
        recorded. Having this method makes torch's own check raise when a
        ``sharding_filter`` sits in the same chain.
        """
        self._sharding_hint = (num_of_instances, instance_id)

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
        self._epoch = _check_seed("epoch", epoch, allow_none=False)  # type: ignore[assignment]
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

    def _seed_upstream(self, ctx: _context.ShardContext) -> None:
        if self._random_pipes is None:
            self._random_pipes = random_pipes(self.source_datapipe)
        base = self.base_seed(ctx)
        for index, pipe in enumerate(self._random_pipes):
            pipe.set_seed(mix_seed(base, self._epoch, index))

    # -- iteration ---------------------------------------------------------------
    def __iter__(self) -> Iterator[T]:
        ctx = self.context()
        self._seed_upstream(ctx)
        yield from select_stream(self.source_datapipe, ctx.slot, ctx.num_slots, self.even)

    def __len__(self) -> int:
        try:
            total = len(self.source_datapipe)
        except TypeError:
            raise TypeError(
                f"{type(self).__name__} has no length: its source "
                f"{type(self.source_datapipe).__name__} has none"
            ) from None
        ctx = self.context()
        if get_worker_info() is not None:
            return slot_count(ctx.slot, ctx.num_slots, total, self.even)
        workers = _context.loader_num_workers() or 1
        num_slots = ctx.world_size * workers
        first = ctx.rank * workers
        return sum(slot_count(s, num_slots, total, self.even) for s in range(first, first + workers))

    # -- pickling ------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_random_pipes"] = None
        found = _context.dist_rank_world()
        if found is not None:
            state["_captured"] = found
        if IterDataPipe.getstate_hook is not None:
            return IterDataPipe.getstate_hook(state)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
