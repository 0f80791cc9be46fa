"""What torch's DataLoader is doing around a DataPipe, found on the call stack: the
split it hands ``apply_sharding``, the DataLoader iterator being created, whether it
forks workers, whether a graph walk is its own, and the ``len()`` of a ``.batch()``
that several workers would make wrong. The DataPipe front-end asks; nothing here
changes what torch does.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import get_worker_info

from . import context as _context
from .frames import above

__all__ = [
    "check_batched_length",
    "forking_loader",
    "iterating_loader",
    "starting_workers",
    "torch_split",
    "walk_for_seeds_or_sharding",
]


def torch_split(captured: tuple[int, int] | None) -> tuple[int, int]:
    """``(num_of_instances, instance_id)`` torch's DataLoader passes to
    ``apply_sharding`` in this process: from torch.distributed only (as the main
    process saw it: ``captured`` in a spawned worker; else one rank), times the
    workers in a worker, numbered worker-major."""
    rank, world = _context.dist_rank_world() or captured or (0, 1)
    info = get_worker_info()
    if info is None:
        return world, rank
    return info.num_workers * world, info.id * world + rank


def iterating_loader() -> Any:
    """The DataLoader iterator being created right now, if this call comes from one
    (torch seeds the pipe from ``_BaseDataLoaderIter.__init__``)."""
    for frame in above(2, 8):
        owner = frame.f_locals.get("self")
        if type(owner).__name__.endswith("DataLoaderIter") and hasattr(owner, "_num_workers"):
            return owner
    return None


def forking_loader() -> bool:
    """Whether a DataLoader with workers is creating its iterator right now (before
    it starts them: its ``__init__`` holds the DataLoader as ``loader``)."""
    from torch.utils.data import DataLoader

    for frame in above(2, 8):
        loader = frame.f_locals.get("loader")
        if isinstance(loader, DataLoader):
            return loader.num_workers > 0
    return False


def starting_workers() -> int:
    """The workers a DataLoader is about to start, when this call comes from the
    creation of its iterator, before it starts them (``_BaseDataLoaderIter.__init__``
    seeds the pipe first); 0 otherwise: no workers, a call from elsewhere, or a new
    epoch of persistent workers (``_reset``: they exist, with their own copies)."""
    from torch.utils.data import DataLoader

    for frame in above(2, 12):
        name = frame.f_code.co_name
        owner = frame.f_locals.get("self") if name in ("__init__", "_reset") else None
        if owner is not None and type(owner).__name__.endswith("DataLoaderIter"):
            loader = frame.f_locals.get("loader")
            if name == "_reset" or not isinstance(loader, DataLoader):
                return 0
            return max(0, int(loader.num_workers))
    return 0


_OWN_WALKS = ("apply_random_seed", "apply_sharding")


def walk_for_seeds_or_sharding() -> bool:
    """Whether this call comes from torch's ``graph_settings.apply_random_seed`` or
    ``apply_sharding``, which the DataLoader runs in its main process and twice in
    every worker."""
    for frame in above(2):
        if frame.f_code.co_name in _OWN_WALKS and frame.f_globals.get("__name__") == "torch.utils.data.graph_settings":
            return True
    return False


def check_batched_length(counts: list[int], shard_type: type) -> None:
    """``len()`` of a ``.batch(n)`` right after the shard (maps in between are fine)
    divides the rank's total by ``n``; with several DataLoader workers each worker
    batches its own share, so that is wrong whenever a share is not a multiple of
    ``n``, and a loop that stops after ``len(loader)`` batches (Lightning) would skip
    data. Raise ``TypeError`` (what ``len`` raises when there is no length: such
    loops then run to the end) naming the fix. Called from ``shard_type.__len__``."""
    from torch.utils.data.datapipes.iter.callable import MapperIterDataPipe
    from torch.utils.data.datapipes.iter.grouping import BatcherIterDataPipe

    for frame in above(2, 8):
        owner = frame.f_locals.get("self")
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
        if not isinstance(owner, (MapperIterDataPipe, shard_type)):
            return
