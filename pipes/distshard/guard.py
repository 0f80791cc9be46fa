"""``stop_together``: end a DDP epoch on every rank when the first rank runs out.

``even=`` balances what ``dist_shard`` yields, but a ``filter`` (or any pipe that
yields a data-dependent number of elements) *after* it unbalances the ranks
again, and a DDP loop then hangs in the collective of the rank that has one more
batch. Wrapping the loop's iterable in :func:`stop_together` adds one tiny
``all_reduce`` per step (a flag on a CPU gloo group with a bounded timeout: every
rank's is created for the epoch and destroyed after it, a subgroup's is made by its
ranks once and kept), so all
ranks stop at the step where the first one has nothing left. This is what
torchdata's removed ``fullsync`` did.
"""

from __future__ import annotations

import math
import numbers
from datetime import timedelta
from typing import Any, Generic, Iterable, Iterator, TypeVar

from .errors import OptionError, OptionTypeError, SetupError
from .groups import subgroup
from .stateful import data_group_of
from .waits import naming_collective_timeouts

T = TypeVar("T")

__all__ = ["StopTogether", "check_timeout", "stop_together"]

_END = object()


def check_timeout(value: Any, name: str = "timeout") -> float:
    """Return ``value`` as a float if it is a finite, positive number of seconds,
    else raise ``TypeError`` (not a number) or ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise OptionTypeError(f"{name}={value!r} must be a number of seconds, not {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise OptionError(f"{name}={value!r} must be positive and finite (seconds)")
    return float(value)


class StopTogether(Generic[T]):
    """Iterable returned by :func:`stop_together`.

    After an epoch, ``steps`` is how many items every rank consumed,
    ``unused`` how many this rank left unconsumed, and ``unused_per_rank`` the
    same for every rank (gathered when ``count_unused`` is on).
    """

    def __init__(self, iterable: Iterable[T], group: Any, timeout: float, count_unused: bool) -> None:
        self.iterable = iterable
        self.timeout = check_timeout(timeout)
        self.count_unused = count_unused
        self._group_arg = group
        self.steps = 0
        self.unused: int | None = None
        self.unused_per_rank: list[int] | None = None

    def _flag_group(self) -> tuple[Any, bool]:
        """The epoch's flag group, and whether it was made for the epoch (the
        world's: destroyed after it; a subgroup's is kept, see ``groups.subgroup``)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise SetupError(
                "stop_together needs an initialized torch.distributed process group; call "
                "torch.distributed.init_process_group first (or do not wrap single-process loops)"
            )
        # a CPU group of its own, so the flag never waits on GPU work and has its own timeout;
        # every rank creates it at the start of every epoch, so all call new_group in the same order
        if self._group_arg is not None:
            ranks: list[int] | None = dist.get_process_group_ranks(self._group_arg)
        else:  # the data group of the pipe's dist_shard(mesh= / group=), else every rank
            found = data_group_of(self.iterable)
            ranks = None if found is None else list(found.ranks)
        if ranks is not None:  # only the group's members make it (the others never iterate this loop)
            return subgroup(ranks, self.timeout), False
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout)), True

    def __iter__(self) -> Iterator[T]:
        import torch.distributed as dist

        group, made = self._flag_group()
        try:
            yield from self._epoch(group)
        finally:  # release its sockets: one group per epoch, never one more per epoch
            if made and dist.is_initialized():  # else destroying the default group released it already
                dist.destroy_process_group(group)

    def _epoch(self, group: Any) -> Iterator[T]:
        import torch
        import torch.distributed as dist

        self.steps, self.unused, self.unused_per_rank = 0, None, None
        it = iter(self.iterable)
        flag = torch.zeros(1, dtype=torch.int32)
        while True:
            item = next(it, _END)
            flag[0] = 0 if item is _END else 1
            with naming_collective_timeouts(f"stop_together: the flag of step {self.steps} (all_reduce)"):
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
            if flag[0] == 0:
                break
            self.steps += 1
            yield item  # type: ignore[misc]
        left = 0 if item is _END else 1
        if self.count_unused:
            if item is not _END:
                left += sum(1 for _ in it)
            counts: list[Any] = [None] * dist.get_world_size(group)
            with naming_collective_timeouts("stop_together: the unused counts (all_gather_object)"):
                dist.all_gather_object(counts, left, group=group)
            self.unused_per_rank = counts
        self.unused = left


def stop_together(
    iterable: Iterable[T], *, group: Any = None, timeout: float = 300.0, count_unused: bool = True
) -> StopTogether[T]:
    """Iterate ``iterable`` until *any* rank runs out, on every rank together.

    Args:
        iterable: what the training loop iterates (a DataLoader, a pipeline).
        group: the process group of the ranks that train together (default: the
            data group of the pipeline's ``dist_shard(mesh=...)`` or ``group=``,
            found from ``iterable``; else all ranks). Under a mesh each data group
            stops together, and model-parallel peers, which read the same batches,
            stop at the same step.
        timeout: seconds (finite, positive) the per-step flag may wait for the
            other ranks before raising instead of hanging.
        count_unused: after stopping, count (by draining) what this rank did not
            consume, and gather every rank's count into ``unused_per_rank``.

    Example:
        >>> loader = DataLoader(IterableWrapper(data).dist_shard().filter(keep).batch(8))  # doctest: +SKIP
        >>> guarded = distshard.stop_together(loader)                                      # doctest: +SKIP
        >>> for batch in guarded:                                                          # doctest: +SKIP
        ...     train_step(batch)  # DDP: every rank runs the same number of steps
        >>> guarded.unused_per_rank                                                        # doctest: +SKIP
    """
    return StopTogether(iterable, group, timeout, count_unused)
