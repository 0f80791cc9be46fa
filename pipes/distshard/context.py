"""Who am I: the rank, world size, DataLoader worker and slot of the running copy.

The distributed part (``rank``, ``world_size``) comes from, in this order:

1. ``explicit``: the ``rank`` / ``world_size`` given to ``dist_shard``;
2. ``torch.distributed``: the default process group, when it is initialized
   (also in DataLoader workers started with ``fork``, which inherit it);
3. ``pickled``: the values captured when the pipe was pickled in a process where
   ``torch.distributed`` was initialized (DataLoader workers started with
   ``spawn`` or ``forkserver`` receive the pipe that way, without a process group);
4. ``env``: the ``RANK`` / ``WORLD_SIZE`` variables ``torchrun`` sets;
5. ``default``: ``(0, 1)``.

The worker part comes from ``torch.utils.data.get_worker_info()``; torchdata's
``StatefulDataLoader`` fills the same record.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Mapping

import torch.distributed as dist
from torch.utils.data import get_worker_info

SOURCES = ("explicit", "torch.distributed", "pickled", "env", "default")


@dataclass(frozen=True)
class ShardContext:
    """Where a copy of the pipeline runs.

    ``num_workers`` counts the copies per rank: the DataLoader's worker processes,
    or 1 when the pipe is iterated in the rank's own process. ``slot`` is
    ``rank * num_workers + worker_id`` and ``num_slots`` is
    ``world_size * num_workers``. ``source`` says where ``rank`` and
    ``world_size`` came from (one of ``explicit``, ``torch.distributed``,
    ``pickled``, ``env``, ``default``).
    """

    rank: int
    world_size: int
    worker_id: int = 0
    num_workers: int = 1
    source: str = "default"
    slot: int = field(init=False)
    num_slots: int = field(init=False)

    def __post_init__(self) -> None:
        check_rank_world(self.rank, self.world_size)
        if not 0 <= self.worker_id < self.num_workers:
            raise ValueError(
                f"worker_id={self.worker_id} is outside [0, num_workers={self.num_workers})"
            )
        object.__setattr__(self, "slot", self.rank * self.num_workers + self.worker_id)
        object.__setattr__(self, "num_slots", self.world_size * self.num_workers)


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{name}={value!r} must be an int (got {type(value).__name__}); "
            f"pass e.g. {name}=0"
        )
    return value


def check_rank_world(
    rank: object, world_size: object, names: tuple[str, str] = ("rank", "world_size"), where: str = ""
) -> tuple[int, int]:
    """Validate a ``(rank, world_size)`` pair and return it; ``names`` and ``where``
    say in the message where the values came from (e.g. the environment)."""
    rank_name, world_name = names
    rank = _check_int(rank_name, rank)
    world_size = _check_int(world_name, world_size)
    if world_size < 1:
        raise ValueError(f"{where}{world_name}={world_size} must be at least 1")
    if not 0 <= rank < world_size:
        raise ValueError(
            f"{where}{rank_name}={rank} is outside [0, {world_name}={world_size}); ranks count from 0"
        )
    return rank, world_size


def check_explicit(rank: object, world_size: object) -> tuple[int, int] | None:
    """Validate the ``rank`` / ``world_size`` arguments of ``dist_shard``."""
    if rank is None and world_size is None:
        return None
    if rank is None or world_size is None:
        given, missing = ("rank", "world_size") if rank is not None else ("world_size", "rank")
        raise ValueError(
            f"{given}={rank if rank is not None else world_size!r} was given without "
            f"{missing}; pass both rank= and world_size=, or neither to take them from "
            "torch.distributed or the RANK/WORLD_SIZE environment"
        )
    return check_rank_world(rank, world_size)


def _env_int(environ: Mapping[str, str], name: str) -> int:
    raw = environ[name]
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(
            f"environment variable {name}={raw!r} is not an integer; torchrun sets it to "
            f"the process's {name.lower()}: unset it or set it to an integer"
        ) from None


def env_rank_world(environ: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """``(rank, world_size)`` from ``RANK`` / ``WORLD_SIZE``, or ``None`` if unset."""
    environ = os.environ if environ is None else environ
    has_rank, has_world = "RANK" in environ, "WORLD_SIZE" in environ
    if not has_rank and not has_world:
        return None
    if has_rank != has_world:
        present, absent = ("RANK", "WORLD_SIZE") if has_rank else ("WORLD_SIZE", "RANK")
        raise ValueError(
            f"environment variable {present}={environ[present]!r} is set but {absent} is "
            f"not; set both (torchrun does) or neither"
        )
    rank, world_size = _env_int(environ, "RANK"), _env_int(environ, "WORLD_SIZE")
    return check_rank_world(rank, world_size, ("RANK", "WORLD_SIZE"), "environment variable ")


def dist_rank_world() -> tuple[int, int] | None:
    """``(rank, world_size)`` of the default process group, if initialized."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


_forced: tuple[int, int] | None = None


@contextmanager
def forced_distributed(rank: int, world_size: int) -> Iterator[None]:
    """Resolve every pipe to ``(rank, world_size)`` inside the block (``source``
    ``explicit``); ``verify`` uses it to read the unsharded stream."""
    global _forced
    previous, _forced = _forced, check_rank_world(rank, world_size)
    try:
        yield
    finally:
        _forced = previous


def resolve_distributed(
    explicit: tuple[int, int] | None = None,
    captured: tuple[int, int] | None = None,
) -> tuple[int, int, str]:
    """``(rank, world_size, source)`` by the priority in the module docstring."""
    if _forced is not None:
        explicit = _forced
    if explicit is not None:
        return explicit[0], explicit[1], "explicit"
    found = dist_rank_world()
    if found is not None:
        return found[0], found[1], "torch.distributed"
    if captured is not None:
        return captured[0], captured[1], "pickled"
    found = env_rank_world()
    if found is not None:
        return found[0], found[1], "env"
    return 0, 1, "default"


def loader_num_workers() -> int | None:
    """The ``num_workers`` of a DataLoader that is asking for ``len()`` right now.

    ``len(loader)`` on an iterable-style DataLoader calls ``len(dataset)`` in the
    main process, where no worker info exists. A rank's total depends on how many
    workers it splits into, so we look a few frames up for that DataLoader.
    """
    from torch.utils.data import DataLoader

    frame = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, DataLoader):
            return max(1, owner.num_workers)
        frame = frame.f_back
    return None


def current_context(
    rank: int | None = None,
    world_size: int | None = None,
    *,
    _captured: tuple[int, int] | None = None,
) -> ShardContext:
    """The :class:`ShardContext` of the calling process.

    Args:
        rank: explicit rank; give it together with ``world_size``.
        world_size: explicit world size.

    Example:
        >>> import distshard
        >>> distshard.current_context(rank=1, world_size=4).slot
        1
    """
    r, w, source = resolve_distributed(check_explicit(rank, world_size), _captured)
    info = get_worker_info()
    if info is None:
        return ShardContext(r, w, 0, 1, source)
    return ShardContext(r, w, info.id, info.num_workers, source)
