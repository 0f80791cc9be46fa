"""What training frameworks do around a ``dist_shard`` pipeline, and refusing what
would lose or repeat data.

Nothing here imports a framework: wrappers are recognised by their module and
class name on the call stack, where they drive the pipe.

* Hugging Face Accelerate's ``DataLoaderDispatcher`` (its default for iterable
  datasets) lets rank 0 alone iterate the DataLoader and hands slices of its
  batches to the other ranks: with ``dist_shard`` only rank 0's shard would ever
  be trained. Its ``IterableDatasetShard`` (with ``dispatch_batches=False``) shards
  again, element by element: ``1 / world_size`` of every rank's shard survives.
  Both are refused before the first element, with what to do instead.
"""

from __future__ import annotations

from .frames import above

__all__ = ["refusal_for_loader", "refusal_for_iteration"]

_DISPATCHER = ("accelerate", "DataLoaderDispatcher")
_RESHARD = ("accelerate", "IterableDatasetShard")

_ACCELERATE_FIX = (
    "dist_shard already splits the data over ranks and DataLoader workers exactly once. Do not "
    "pass this DataLoader to accelerator.prepare(): prepare the model and optimizer only, iterate "
    "the DataLoader yourself and move each batch with batch.to(accelerator.device) (see the "
    "Accelerate section of docs/integrations.md)"
)


def _is(owner: object, what: tuple[str, str]) -> bool:
    cls = type(owner)
    return cls.__module__.split(".")[0] == what[0] and any(klass.__name__ == what[1] for klass in cls.__mro__)


def refusal_for_loader() -> str | None:
    """Called while a DataLoader creates its iterator over the pipe (in the main
    process): why this loader would lose data, or ``None``."""
    for frame in above(2, 24):
        owner = frame.f_locals.get("self")
        if _is(owner, _DISPATCHER):
            return (
                "Accelerate's DataLoaderDispatcher (what accelerator.prepare() makes of a DataLoader "
                "over an iterable dataset by default) lets rank 0 alone read the data and hands its "
                "batches to every rank, so only rank 0's shard would be trained. " + _ACCELERATE_FIX
            )
    return None


def refusal_for_iteration() -> str | None:
    """Called when the pipe starts yielding (in the process that iterates it), and
    when its ``len()`` is asked: why the code iterating it would lose data, or ``None``."""
    for frame in above(2, 16):
        owner = frame.f_locals.get("self")
        if _is(owner, _RESHARD):
            return (
                "Accelerate's IterableDatasetShard (what accelerator.prepare() wraps an iterable "
                "dataset in with dispatch_batches=False) shards the stream again over processes, so "
                "each rank would keep 1 / world_size of its own shard. " + _ACCELERATE_FIX
            )
    return None
