"""Checkpointing a whole pipeline: :class:`StatefulPipeline` and the collective
that gathers every rank's state for an elastic resume.

torchdata's ``StatefulDataLoader`` wraps every ``IterDataPipe`` in torch's
serialization wrapper, which hides the pipe's ``state_dict``; it then falls back
to re-iterating the consumed prefix ("naively fast-forwarding"). Wrapping the
pipeline in :class:`StatefulPipeline` (an ``IterableDataset``, not an
``IterDataPipe``) lets the loader see and restore the exact position.
"""

from __future__ import annotations

from typing import Any, Iterator

from torch.utils.data import IterableDataset
from torch.utils.data.datapipes.datapipe import IterDataPipe

from .datapipe import DistShardIterDataPipe, shards_in
from .errors import OptionError, OptionTypeError
from .groups import DataGroup
from .merging import merge_items
from .waits import naming_collective_timeouts

__all__ = ["StatefulPipeline", "data_group_of", "gather_states"]

_KEY = "distshard_pipeline"


class StatefulPipeline(IterableDataset):
    r"""A pipeline with ``state_dict`` / ``load_state_dict``, for checkpoints.

    The state is the position of the pipeline's ``dist_shard``: exact at a batch
    boundary as long as the pipes after ``dist_shard`` hold nothing between two
    outputs (``map``, ``filter``, ``batch`` and ``collate`` qualify; a
    ``shuffle()`` *after* ``dist_shard`` holds a buffer, whose elements a resume
    skips: shuffle before ``dist_shard`` or use ``dist_shard(shuffle=True)``).

    Use it as the dataset of torchdata's ``StatefulDataLoader`` (any number of
    workers: each worker's state travels in the loader's ``state_dict()``), of
    torch's ``DataLoader`` with ``num_workers=0``, or iterate it directly. torch's
    ``DataLoader`` with workers never reports worker state: use
    ``StatefulDataLoader`` there, it takes the same arguments.

    Example:
        >>> from torchdata.stateful_dataloader import StatefulDataLoader
        >>> pipeline = distshard.StatefulPipeline(
        ...     IterableWrapper(records).dist_shard(even="drop").map(decode).batch(32))
        >>> loader = StatefulDataLoader(pipeline, batch_size=None, num_workers=2)
        >>> state = loader.state_dict()       # at any step, on every rank  # doctest: +SKIP
        >>> loader.load_state_dict(state)     # same ranks and workers       # doctest: +SKIP
        >>> pipeline.load_state_dict(distshard.merge_states(all_ranks_states))  # any  # doctest: +SKIP
    """

    def __init__(self, pipeline: IterDataPipe) -> None:
        if not isinstance(pipeline, IterDataPipe):
            raise OptionTypeError(f"StatefulPipeline wraps an IterDataPipe, got {type(pipeline).__name__}")
        shards = shards_in(pipeline)
        if len(shards) != 1:
            raise OptionError(f"StatefulPipeline needs exactly one dist_shard in the pipeline, found {len(shards)}")
        self.pipeline = pipeline
        self.shard: DistShardIterDataPipe = shards[0]

    def __iter__(self) -> Iterator[Any]:
        # eagerly (the pipeline's iterator starts at its first element): a persistent
        # worker takes the epoch now, and the state StatefulDataLoader records right
        # after this call is the new iteration's
        self.shard._new_iterator()
        return iter(self.pipeline)

    def __len__(self) -> int:
        """``len()`` of the pipeline (see ``DistShardIterDataPipe.__len__``): after
        loading a slot's own state, still that slot's whole share of the epoch (of which
        the loader yields what is left, as Lightning expects); after a merged state,
        the new run's share of what was left."""
        return len(self.pipeline)

    def set_epoch(self, epoch: int) -> "StatefulPipeline":
        """Set the epoch of the pipeline's ``dist_shard`` (see its ``set_epoch``)."""
        self.shard.set_epoch(epoch)
        return self

    def state_dict(self) -> dict[str, Any]:
        return {_KEY: 1, "shard": self.shard.state_dict()}

    def load_state_dict(self, state: Any) -> None:
        """Load a state this pipeline saved, a merged state, or the states of all
        slots of a run (merged here). Malformed input raises ``ValueError`` and
        leaves the pipeline unchanged."""
        self.shard.load_state_dict(state)


def gather_states(state: Any, group: Any = None) -> dict[str, Any]:
    """Collective: merge the states every rank passes (its pipeline's or its
    StatefulDataLoader's ``state_dict()``) into one state any world size can load.

    Every rank of ``group`` (default: every rank) must call it at the same step;
    every rank gets the merged state (save it from rank 0). Under ``mesh=`` /
    ``group=`` call it on every rank of the world: model-parallel peers' identical
    states count once, and peers whose states differ raise ``StateMismatchError``
    naming their ranks.
    """
    import torch.distributed as dist

    states: list[Any] = [None] * dist.get_world_size(group)
    with naming_collective_timeouts("gather_states: all_gather_object of every rank's state"):
        dist.all_gather_object(states, state, group=group)
    return merge_items(
        states, lambda index: f"rank {index if group is None else dist.get_global_rank(group, index)}"
    ).to_dict()


def data_group_of(obj: Any) -> DataGroup | None:
    """The data group (``dist_shard(mesh=...)`` / ``group=``) of the pipeline in
    ``obj`` (a pipeline, a :class:`StatefulPipeline`, a DataLoader over either), or
    ``None``: no ``dist_shard``, or none with a data group. ``OptionError`` if its
    ``dist_shard`` pipes have different ones."""
    shard = _stateful_of(obj)
    shards = [shard] if shard is not None else shards_in(obj)
    groups = {s.core.options.group for s in shards if s.core.options.group is not None}
    if len(groups) > 1:
        raise OptionError(
            f"the pipeline's dist_shard pipes have different data groups ({sorted(g.describe() for g in groups)}); "
            "pass group= explicitly"
        )
    return next(iter(groups), None)


def _stateful_of(obj: Any) -> DistShardIterDataPipe | None:
    """The shard of a :class:`StatefulPipeline` in ``obj`` (itself, or a loader's
    dataset), found without walking the pipeline's graph."""
    for candidate in (obj, getattr(obj, "dataset", None)):
        if isinstance(candidate, StatefulPipeline):
            return candidate.shard
    return None
