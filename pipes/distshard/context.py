"""Who am I: the rank, world size, DataLoader worker and slot of the running copy.

The distributed part (``rank``, ``world_size``) comes from, in this order:

1. ``explicit``: the ``rank`` / ``world_size`` given to ``dist_shard``;
   ``mesh`` / ``group``: the data group given to it (``mesh=`` a ``DeviceMesh`` of the
   data-parallel dimensions, ``group=`` a ``ProcessGroup``; see ``groups.py``): the
   data rank and data world, also in DataLoader workers, which receive it with the pipe;
2. ``torch.distributed``: the default process group, when it is initialized
   (also in DataLoader workers started with ``fork``, which inherit it);
3. ``pickled``: the values captured when the pipe was pickled in a process where
   ``torch.distributed`` was initialized (DataLoader workers started with
   ``spawn`` or ``forkserver`` receive the pipe that way, without a process group);
   a pipe that arrives so records its value for the whole process
   (:func:`note_captured`), which ``current_context()`` then reports too;
4. ``env``: the ``RANK`` / ``WORLD_SIZE`` variables ``torchrun`` sets (or, without
   ``RANK``, the rank derived from ``LOCAL_RANK`` / ``NODE_RANK`` /
   ``LOCAL_WORLD_SIZE`` where certain, as PyTorch Lightning's launcher sets them);
5. ``default``: ``(0, 1)``.

The worker part comes from ``torch.utils.data.get_worker_info()``; torchdata's
``StatefulDataLoader`` fills the same record.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Mapping

import torch.distributed as dist
from torch.utils.data import get_worker_info
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES

from . import frames
from .errors import DistshardError, OptionError, OptionTypeError, SetupError
from .forks import at_fork
from .groups import DataGroup, data_group, gloo_group
from .waits import naming_collective_timeouts

SOURCES = ("explicit", "mesh", "group", "torch.distributed", "pickled", "env", "default")


@dataclass(frozen=True)
class ShardContext:
    """Where a copy of the pipeline runs.

    ``num_workers`` counts the copies per rank: the DataLoader's worker processes,
    or 1 when the pipe is iterated in the rank's own process. ``slot`` is
    ``rank * num_workers + worker_id`` and ``num_slots`` is
    ``world_size * num_workers``. ``source`` says where ``rank`` and
    ``world_size`` came from (one of ``explicit``, ``mesh``, ``group``,
    ``torch.distributed``, ``pickled``, ``env``, ``default``). With ``mesh=`` or
    ``group=``, ``rank`` and ``world_size`` are the data rank and data world, and
    ``group`` the :class:`~distshard.groups.DataGroup` (its coordinate, shape and
    world ranks); model-parallel peers share the data rank and read the same elements.
    """

    rank: int
    world_size: int
    worker_id: int = 0
    num_workers: int = 1
    source: str = "default"
    group: DataGroup | None = None
    slot: int = field(init=False)
    num_slots: int = field(init=False)

    def __post_init__(self) -> None:
        check_rank_world(self.rank, self.world_size)
        if not 0 <= self.worker_id < self.num_workers:
            raise OptionError(f"worker_id={self.worker_id} is outside [0, num_workers={self.num_workers})")
        object.__setattr__(self, "slot", self.rank * self.num_workers + self.worker_id)
        object.__setattr__(self, "num_slots", self.world_size * self.num_workers)


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptionTypeError(f"{name}={value!r} must be an int (got {type(value).__name__}); pass e.g. {name}=0")
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
        raise OptionError(f"{where}{world_name}={world_size} must be at least 1")
    if not 0 <= rank < world_size:
        raise OptionError(f"{where}{rank_name}={rank} is outside [0, {world_name}={world_size}); ranks count from 0")
    return rank, world_size


def check_explicit(rank: object, world_size: object) -> tuple[int, int] | None:
    """Validate the ``rank`` / ``world_size`` arguments of ``dist_shard``."""
    if rank is None and world_size is None:
        return None
    if rank is None or world_size is None:
        given, missing = ("rank", "world_size") if rank is not None else ("world_size", "rank")
        raise OptionError(
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
        raise OptionError(
            f"environment variable {name}={raw!r} is not an integer; torchrun sets it to "
            f"the process's {name.lower()}: unset it or set it to an integer"
        ) from None


class UnknownRankError(DistshardError, ValueError):
    """The environment says how many ranks there are (``WORLD_SIZE``) but not which one
    this process is, for certain: ``RANK`` is unset and ``LOCAL_RANK`` / ``NODE_RANK`` /
    ``LOCAL_WORLD_SIZE`` do not determine it (a multi-node job started without
    torchrun). The message names the variables it found and the one to set.

    Raised when a pipe resolves its rank without ``torch.distributed`` initialized
    (``dist_shard`` at iteration, ``distshard.current_context()``); a ``ValueError``,
    like every malformed environment. Set ``RANK``, pass ``rank=`` / ``world_size=``,
    or initialize ``torch.distributed`` before iterating.
    """


def env_rank_world(environ: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """``(rank, world_size)`` from the environment, or ``None`` if it names no world size.

    ``RANK`` / ``WORLD_SIZE`` as ``torchrun`` sets them. Without ``RANK`` (PyTorch
    Lightning's launcher sets ``WORLD_SIZE``, ``LOCAL_RANK`` and ``NODE_RANK``
    only) the rank is derived from ``LOCAL_RANK`` only where that is certain:
    ``LOCAL_RANK`` itself on node 0 (``NODE_RANK=0``) or on the only node
    (``LOCAL_WORLD_SIZE == WORLD_SIZE``), else
    ``NODE_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK``. Raises ``ValueError`` naming the
    variables for malformed values, and :class:`UnknownRankError` (a ``ValueError``)
    for a rank that cannot be known.
    """
    environ = os.environ if environ is None else environ
    if "RANK" not in environ and "WORLD_SIZE" not in environ:
        return None
    if "WORLD_SIZE" not in environ:
        raise OptionError(
            f"environment variable RANK={environ['RANK']!r} is set but WORLD_SIZE is not; "
            "set both (torchrun does) or neither"
        )
    world_size = _env_int(environ, "WORLD_SIZE")
    if world_size < 1:
        raise OptionError(f"environment variable WORLD_SIZE={world_size} must be at least 1")
    if "RANK" in environ:
        rank = _env_int(environ, "RANK")
        return check_rank_world(rank, world_size, ("RANK", "WORLD_SIZE"), "environment variable ")
    if "LOCAL_RANK" not in environ:
        raise OptionError(
            f"environment variable WORLD_SIZE={environ['WORLD_SIZE']!r} is set but RANK is not "
            "(nor LOCAL_RANK to derive it from); set both RANK and WORLD_SIZE (torchrun does) or neither"
        )
    rank, how = _derived_rank(environ, world_size)
    if rank >= world_size:
        raise OptionError(
            f"environment variables {how} give rank {rank}, outside [0, WORLD_SIZE={world_size}); "
            "set RANK to this process's global rank"
        )
    return rank, world_size


def _derived_rank(environ: Mapping[str, str], world_size: int) -> tuple[int, str]:
    """``(rank, what it came from)`` out of ``LOCAL_RANK``, ``NODE_RANK`` and
    ``LOCAL_WORLD_SIZE``, when ``RANK`` is unset."""
    values: dict[str, int] = {}
    for name in ("LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE"):
        if name in environ:
            values[name] = _env_int(environ, name)
            if values[name] < (1 if name == "LOCAL_WORLD_SIZE" else 0):
                low = "at least 1" if name == "LOCAL_WORLD_SIZE" else "non-negative"
                raise OptionError(f"environment variable {name}={values[name]} must be {low}")
    local, node, per_node = values["LOCAL_RANK"], values.get("NODE_RANK"), values.get("LOCAL_WORLD_SIZE")
    how = ", ".join(f"{name}={value}" for name, value in values.items())
    if per_node is not None:
        if world_size % per_node or local >= per_node:
            raise OptionError(
                f"environment variables {how}, WORLD_SIZE={world_size} do not fit together "
                "(LOCAL_WORLD_SIZE must divide WORLD_SIZE, and LOCAL_RANK be below it); "
                "set RANK to this process's global rank"
            )
        if per_node == world_size and node not in (None, 0):
            raise OptionError(
                f"environment variables {how}, WORLD_SIZE={world_size}: LOCAL_WORLD_SIZE == WORLD_SIZE "
                "means a single node, but NODE_RANK is not 0; set RANK to this process's global rank"
            )
        if per_node == world_size or node is not None:
            return (node or 0) * per_node + local, how
    elif node == 0:
        return local, how
    missing = "NODE_RANK" if per_node is not None else "LOCAL_WORLD_SIZE (processes per node)"
    raise UnknownRankError(
        f"environment variable RANK is not set, and {how} with WORLD_SIZE={world_size} do not say "
        f"this process's global rank for certain: set RANK, or {missing}"
        + (" and NODE_RANK" if per_node is None and node is None else "")
    )


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Validate ``RANK`` / ``WORLD_SIZE`` (and Lightning's ``LOCAL_RANK`` /
    ``NODE_RANK``) when they will be used: only if ``torch.distributed`` is not
    initialized, since otherwise the process group decides and the environment is
    never read. Raises ``ValueError`` naming the variable.

    A rank the environment does not determine (a multi-node Lightning job without
    ``LOCAL_WORLD_SIZE``) is not an error here: such launchers initialize
    ``torch.distributed`` before the pipe is iterated, and if nothing does,
    resolving the context raises then.
    """
    if dist_rank_world() is not None:
        return
    try:
        env_rank_world(environ)
    except UnknownRankError:
        pass


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


_pickled: tuple[int, int] | None = None  # forgotten in a forked child (_forget_pickled)


def note_captured(rank_world: tuple[int, int] | None) -> None:
    """Record the ``(rank, world_size)`` a pipe carried when it was unpickled in
    this process (a ``spawn`` / ``forkserver`` DataLoader worker of a rank whose
    ``torch.distributed`` was initialized), so that :func:`current_context` and
    pipes that carry none resolve to it with ``source="pickled"``. ``None`` forgets
    it. The last call wins; all pipes sent by one rank carry the same value.
    """
    global _pickled
    _pickled = None if rank_world is None else check_rank_world(*rank_world)


def _forget_pickled() -> None:
    """In a forked child: the record was its parent's (a child adopts nothing by pickle)."""
    global _pickled
    _pickled = None


at_fork(_forget_pickled)


def resolve_distributed(
    explicit: tuple[int, int] | None = None,
    captured: tuple[int, int] | None = None,
    group: DataGroup | None = None,
) -> tuple[int, int, str]:
    """``(rank, world_size, source)`` by the priority in the module docstring;
    ``captured`` is a pipe's own captured value, else this process's record
    (:func:`note_captured`) is used; ``group`` a pipe's data group."""
    if _forced is not None:
        explicit = _forced
    if explicit is not None:
        return explicit[0], explicit[1], "explicit"
    if group is not None:
        return group.rank, group.world_size, group.kind
    found = dist_rank_world()
    if found is not None:
        return found[0], found[1], "torch.distributed"
    if captured is None and get_worker_info() is not None:
        # the record serves DataLoader workers that received pipes by pickle; neither a
        # rank's own process unpickling a copy (deepcopy) nor its forked children (which forget it) adopt it
        captured = _pickled
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

    for frame in frames.above(1, 12):
        owner = frame.f_locals.get("self")
        if isinstance(owner, DataLoader):
            return max(1, owner.num_workers)
    return None


def sharded_context(
    sharding: Mapping[SHARDING_PRIORITIES, tuple[int, int]],
    explicit: tuple[int, int] | None = None,
    captured: tuple[int, int] | None = None,
    group: DataGroup | None = None,
) -> ShardContext:
    """The context of a pipe on which ``apply_sharding`` was called with values of its
    own (not the DataLoader's automatic call), ``sharding`` holding them by group:
    honoured as an explicit split (``DEFAULT``: instance ``i`` of ``n``; else the rank
    part, ``DISTRIBUTED``, and the worker part, ``MULTIPROCESSING``)."""
    info = get_worker_info()
    default = sharding.get(SHARDING_PRIORITIES.DEFAULT)
    if default is not None:
        if len(sharding) > 1:
            raise SetupError(
                "apply_sharding was called with the DEFAULT group and another "
                "group on this dist_shard: use one or the other"
            )
        if info is not None:
            raise SetupError(
                f"apply_sharding({default[0]}, {default[1]}) was called on this dist_shard, and it "
                f"also runs in DataLoader worker {info.id} of {info.num_workers}: it cannot honour "
                "both splits. Drop the apply_sharding call (dist_shard splits over ranks and "
                "workers by itself) or pass rank=/world_size= to dist_shard"
            )
        return ShardContext(default[1], default[0], 0, 1, "apply_sharding")
    ranks = sharding.get(SHARDING_PRIORITIES.DISTRIBUTED)
    if ranks is not None:
        rank, world = ranks[1], ranks[0]
        source, group = "apply_sharding", None
    else:
        rank, world, source = resolve_distributed(explicit, captured, group)
    workers = sharding.get(SHARDING_PRIORITIES.MULTIPROCESSING)
    if workers is not None:
        if info is not None and (workers[0], workers[1]) != (info.num_workers, info.id):
            raise SetupError(
                f"apply_sharding({workers[0]}, {workers[1]}, MULTIPROCESSING) disagrees with "
                f"DataLoader worker {info.id} of {info.num_workers}; drop the call"
            )
        return _context_of(rank, world, source, group, (workers[1], workers[0]))
    return _context_of(rank, world, source, group)


def _context_of(
    rank: int, world: int, source: str, group: DataGroup | None, worker: tuple[int, int] | None = None
) -> ShardContext:
    """The context of ``(rank, world)`` from ``source``, in this DataLoader worker
    (or ``worker``: ``(id, count)``); ``group`` only where the data group decided."""
    if worker is None:
        info = get_worker_info()
        worker = (0, 1) if info is None else (info.id, info.num_workers)
    decided = group if group is not None and source == group.kind else None
    return ShardContext(rank, world, worker[0], worker[1], source, decided)


def current_context(
    rank: int | None = None,
    world_size: int | None = None,
    *,
    mesh: object = None,
    group: object = None,
    _captured: tuple[int, int] | None = None,
    _group: DataGroup | None = None,
) -> ShardContext:
    """The :class:`ShardContext` of the calling process.

    Args:
        rank: explicit rank; give it together with ``world_size``.
        world_size: explicit world size.
        mesh: a ``DeviceMesh`` of the data-parallel dimensions: the data rank (its
            row-major coordinate) and data world (the product of its sizes), as
            ``dist_shard(mesh=...)`` takes them.
        group: a ``ProcessGroup`` of the data-parallel ranks, instead of ``mesh``.

    Example:
        >>> import distshard
        >>> distshard.current_context(rank=1, world_size=4).slot
        1
    """
    explicit = check_explicit(rank, world_size)
    given = data_group(mesh, group)
    if given is not None and explicit is not None:
        raise given_twice(explicit, given)
    found = given or _group
    r, w, source = resolve_distributed(explicit, _captured, found)
    return _context_of(r, w, source, found)


def given_twice(explicit: tuple[int, int], group: DataGroup) -> OptionError:
    """The error for ``rank=`` / ``world_size=`` given with ``mesh=`` / ``group=``."""
    return OptionError(
        f"rank={explicit[0]}, world_size={explicit[1]} and {group.kind}= were both given: {group.kind}= gives the data rank and data world itself ({group.describe()}); "
        "pass one or the other"
    )


def gather_objects(obj: object, what: str, group: DataGroup | None = None) -> list:
    """Every rank's ``obj``, on every rank of ``group`` (default: every rank), in
    the order of the group's ranks: a collective (``what`` it gathers names it in
    the error if not every rank joins in time).

    Runs on a CPU (gloo) group, so it works whatever backend the job uses (NCCL
    included): the group itself when it is gloo, else the gloo group its ranks made
    once (every rank's: one made for the call and destroyed after it; see
    :func:`distshard.groups.gloo_group`). Every rank of the group must call this, and
    no other."""
    size = dist.get_world_size() if group is None else group.world_size
    over = "every rank" if group is None else f"the data group ({group.describe()})"
    with gloo_group(group) as pg:
        out: list = [None] * size
        with naming_collective_timeouts(f"{what}: all_gather_object over {over}"):
            dist.all_gather_object(out, obj, group=pg)
        return out
