"""The data group: the ranks that split the data between them, in a job whose other
(model-parallel) dimensions must see identical data.

``dist_shard(mesh=M)`` takes a ``DeviceMesh`` of the data-parallel dimensions
(``world_mesh["dp"]``, or a sub-mesh of several such as
``world_mesh["dp_replicate", "dp_shard"]``): the data rank is this rank's row-major
coordinate over them, the data world the product of their sizes. ``group=G`` takes a
``ProcessGroup`` of the data-parallel ranks (Megatron's ``get_data_parallel_group()``):
the data rank is the rank in ``G``. Either is captured here as a :class:`DataGroup` of
plain values (rank, world size, coordinate, shape, the world ranks of the group), which
pickles into DataLoader workers started by ``spawn`` (a ``ProcessGroup`` does not);
the live group stays in the process that built the pipe, where the collectives run.

Every collective distshard makes for a pipe (the index build split, a ``sizes``
callable's answers, ``stop_together``'s flag, a loader checkpoint's gather) runs over
the data group only, on a gloo group: the mesh's or the given group when it is one,
else a gloo group over the same ranks made by them alone
(``use_local_synchronization``) once per process, so ranks outside the data group
(another pipeline stage) are never waited on.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterator

from .errors import OptionError, OptionTypeError, SetupError

__all__ = ["DataGroup", "data_group", "gloo_group", "job_ranks", "subgroup"]


@dataclass(frozen=True)
class DataGroup:
    """The ranks that split the data, as plain values.

    ``kind`` is ``"mesh"`` or ``"group"``; ``rank`` / ``world_size`` the data rank
    and the data world; ``coordinate`` / ``shape`` / ``dims`` this rank's place in
    the mesh's dimensions (a group: one dimension, no names); ``ranks`` the world
    ranks of the group, by data rank. ``process_group`` is the live group in the
    process that built the pipe (``None`` after pickling, and for a mesh of several
    dimensions, which has no group of its own)."""

    kind: str
    rank: int
    world_size: int
    ranks: tuple[int, ...]
    coordinate: tuple[int, ...]
    shape: tuple[int, ...]
    dims: tuple[str, ...] | None = None
    process_group: Any = field(default=None, compare=False, repr=False)
    owner: int | None = field(default=None, compare=False, repr=False)  # the pid the live group belongs to

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["process_group"] = state["owner"] = None  # a ProcessGroup does not pickle
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)

    def live_group(self) -> Any:
        """The live process group in this process, if it has one."""
        return self.process_group if self.owner == os.getpid() else None

    def describe(self) -> str:
        """E.g. ``mesh ('dp_replicate', 'dp_shard') of shape (2, 2), coordinate (1, 0):
        data rank 2 of 4 (world ranks [0, 2, 4, 6])``."""
        if self.kind == "mesh":
            dims = f" {self.dims}" if self.dims else ""
            where = f"mesh{dims} of shape {self.shape}, coordinate {self.coordinate}"
        else:
            where = f"process group of {self.world_size} ranks"
        return f"{where}: data rank {self.rank} of {self.world_size} (world ranks {list(self.ranks)})"


def data_group(mesh: object = None, group: object = None) -> DataGroup | None:
    """The :class:`DataGroup` of ``mesh=`` (a ``DeviceMesh`` of the data-parallel
    dimensions) or ``group=`` (a ``ProcessGroup`` of the data-parallel ranks), checked;
    ``None`` if neither is given. ``TypeError`` for a wrong type, ``ValueError`` for
    both or for a rank outside the group, ``RuntimeError`` without
    ``torch.distributed``."""
    if mesh is None and group is None:
        return None
    if mesh is not None and group is not None:
        raise OptionError(
            "mesh= and group= were both given: pass one, the DeviceMesh of the data-parallel dimensions "
            "(mesh=world_mesh['dp']) or the ProcessGroup of the data-parallel ranks (group=...)"
        )
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise SetupError(
            f"{'mesh' if mesh is not None else 'group'}= needs an initialized torch.distributed "
            "(init_device_mesh or init_process_group) before the pipe is built"
        )
    return _of_mesh(mesh) if mesh is not None else _of_group(group)


def _of_mesh(mesh: object) -> DataGroup:
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise OptionTypeError(
            f"mesh={mesh!r} must be a torch.distributed.device_mesh.DeviceMesh of the data-parallel "
            f"dimensions (e.g. world_mesh['dp']), got {type(mesh).__name__}; for a ProcessGroup pass group="
        )
    import torch.distributed as dist

    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise OptionError(
            f"this rank (world rank {dist.get_rank()}) is not in mesh={mesh!r}: build the pipeline on the "
            "ranks of the mesh only, or pass the data-parallel mesh this rank belongs to"
        )
    shape = tuple(int(n) for n in mesh.shape)
    rank = 0
    for index, size in zip(coordinate, shape, strict=True):
        rank = rank * size + int(index)
    ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    if ranks[rank] != dist.get_rank():  # the row-major order of the mesh's own tensor
        raise SetupError(f"mesh={mesh!r}: coordinate {coordinate} is not world rank {dist.get_rank()}'s")
    dims = None if mesh.mesh_dim_names is None else tuple(mesh.mesh_dim_names)
    live = mesh.get_group(0) if mesh.ndim == 1 else None
    return DataGroup(
        "mesh", rank, math.prod(shape), ranks, tuple(int(i) for i in coordinate), shape, dims, live, os.getpid()
    )


def _of_group(group: object) -> DataGroup:
    import torch.distributed as dist

    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise OptionError(
            f"this rank (world rank {dist.get_rank()}) is not in group= (new_group gave it NON_GROUP_MEMBER): "
            "build the pipeline on the group's ranks only, or pass the data-parallel group this rank belongs to"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise OptionTypeError(
            f"group={group!r} must be a torch.distributed ProcessGroup of the data-parallel ranks, got "
            f"{type(group).__name__}; for a DeviceMesh pass mesh="
        )
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise OptionError(f"this rank (world rank {dist.get_rank()}) is not in group={group!r}")
    ranks = tuple(dist.get_global_rank(group, r) for r in range(world))
    return DataGroup("group", rank, world, ranks, (rank,), (world,), None, group, os.getpid())


@contextmanager
def gloo_group(group: DataGroup | None) -> Iterator[Any]:
    """A gloo process group over ``group``'s ranks for a collective (``None``: the
    default group's ranks): the live group when it is a gloo one; else, for the
    default group, one made for the call by every rank and destroyed after it; else
    the one its ranks alone made for this process (:func:`subgroup`)."""
    import torch.distributed as dist

    live = dist.GroupMember.WORLD if group is None else group.live_group()
    if live is not None and dist.get_backend(live) == "gloo":
        yield None if group is None else live
    elif group is not None:
        yield subgroup(group.ranks)
    else:
        made = dist.new_group(backend="gloo")
        try:
            yield made
        finally:
            if dist.is_initialized():
                dist.destroy_process_group(made)


_MADE: dict[tuple[int, tuple[int, ...], float | None], tuple[Any, Any]] = {}  # -> (world group, group)


def subgroup(ranks: Sequence[int], timeout: float | None = None) -> Any:
    """A gloo group over ``ranks``, made by them alone (``use_local_synchronization``:
    the other ranks take no part) the first time this process asks, and kept for the
    job: one per ranks and ``timeout`` (seconds; ``None``: torch's default), never one
    per call. (torch names such a group after its ranks and the groups alive; made
    again after a destroy it would take the same name, and gloo would connect to the
    addresses the destroyed group left in the store.)"""
    import torch.distributed as dist

    key = (os.getpid(), tuple(ranks), timeout)
    world = dist.GroupMember.WORLD
    found = _MADE.get(key)
    if found is None or found[0] is not world:  # none yet, or the job's group was made again
        made = dist.new_group(
            ranks=list(ranks),
            backend="gloo",
            timeout=None if timeout is None else timedelta(seconds=timeout),
            use_local_synchronization=True,
        )
        found = _MADE[key] = (world, made)
    return found[1]


def job_ranks(group: DataGroup | None = None) -> tuple[int, int] | None:
    """``(rank, world_size)`` when this process is a rank of an initialized group
    of several (not a DataLoader worker), else ``None``; in ``group`` (the data
    group) when given, else in the default group."""
    from torch.utils.data import get_worker_info

    if get_worker_info() is not None:
        return None
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    rank, world = (dist.get_rank(), dist.get_world_size()) if group is None else (group.rank, group.world_size)
    return None if world <= 1 else (rank, world)
