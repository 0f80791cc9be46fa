"""A data loader's position in ``torch.distributed.checkpoint`` (DCP), beside the model.

:class:`LoaderCheckpoint` is a DCP ``Stateful``. DCP keeps one value per key of a
state dict, written by one rank of its choosing, so a loader's own ``state_dict()``
(one per rank, each different) cannot go in as it is. ``state_dict()`` therefore
gathers every rank's contribution (:class:`Contribution`: its data rank, the
loader's state, its pipeline's) and returns the same value on every rank: one entry
per data rank (:func:`pack`; the identical states of model-parallel peers once,
peers that differ refused). ``load_state_dict`` takes this rank's entry back
(:func:`restore`): on the same data world and worker count the loader resumes its
own state exactly; on another, the entries are merged (``merge_states``) and the
pipeline resumes what is left, elastically.

A loader that has not started (``dcp.load`` asks for ``state_dict()`` before it
loads) is not started by it: its state is the one loaded into it and not yet used
(``next_iter_state``), or its pipeline's.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Sequence

from . import context as _context
from .datapipe import DistShardIterDataPipe, shards_in
from .errors import OptionError, OptionTypeError, StateMismatchError
from .groups import DataGroup, data_group
from .merging import merge_items
from .state import find_states
from .stateful import StatefulPipeline

__all__ = ["Contribution", "LoaderCheckpoint", "Restore", "pack", "restore"]

FORMAT = "distshard.LoaderCheckpoint"
VERSION = 1
KEY = "distshard_loader"  # the one key of the state dict DCP sees: a bytes value, the same on every rank


@dataclass(frozen=True)
class Contribution:
    """What one rank puts into a checkpoint: ``rank`` (its world rank), its data
    rank and data world, the loader's ``workers``, the loader's
    state (``None``: not started), the pipeline's own state and the pipeline's
    ``identity`` (its upstream graph)."""

    rank: int
    data_rank: int
    data_world: int
    workers: int
    loader: Any
    pipeline: Any
    identity: str

    @property
    def position(self) -> Any:
        """Where this rank's data stands: the loader's state, or the pipeline's."""
        return self.loader if self.loader is not None else self.pipeline


def _agreed(contributions: Sequence[Contribution], what: str) -> Any:
    values = {repr(getattr(c, what)): getattr(c, what) for c in contributions}
    if len(values) > 1:
        by = ", ".join(f"rank {c.rank}: {getattr(c, what)!r}" for c in contributions[:8])
        raise StateMismatchError(
            f"the ranks of the checkpoint disagree on their {what.replace('_', ' ')} ({by}): every rank that "
            "saves the loader must run the same pipeline with the same data group and workers"
        )
    return next(iter(values.values()))


def pack(contributions: Sequence[Contribution]) -> dict[str, Any]:
    """The checkpoint of every rank's ``contributions``: one entry per data rank,
    the same whoever computes it. Model-parallel peers (ranks of one data rank) must
    hold identical distshard states (``StateMismatchError`` naming them otherwise);
    the lowest rank's loader state is kept."""
    world = _agreed(contributions, "data_world")
    workers, identity = _agreed(contributions, "workers"), _agreed(contributions, "identity")
    entries: dict[int, dict[str, Any]] = {}
    for c in sorted(contributions, key=lambda c: c.rank):
        entry = entries.setdefault(c.data_rank, {"loader": c.loader, "pipeline": c.pipeline, "ranks": []})
        first = entry["loader"] if entry["loader"] is not None else entry["pipeline"]
        if entry["ranks"] and find_states(first) != find_states(c.position):
            raise StateMismatchError(
                f"model-parallel peers disagree: ranks {entry['ranks'][0]} and {c.rank} are data rank "
                f"{c.data_rank} of {world} but their loaders stand at different positions: peers must read the "
                "same batches and checkpoint at the same step; save after the same number of steps on every rank"
            )
        entry["ranks"].append(c.rank)
    missing = [d for d in range(world) if d not in entries]
    if missing:
        raise StateMismatchError(
            f"no rank of data ranks {missing[:8]} of {world} contributed to the checkpoint: every rank of every "
            "data rank must hold the LoaderCheckpoint in dcp.save (and group= cover them all)"
        )
    return {
        "format": FORMAT,
        "version": VERSION,
        "data_world": world,
        "workers": workers,
        "identity": identity,
        "entries": [entries[d] for d in range(world)],
    }


@dataclass(frozen=True)
class Restore:
    """What a rank resumes from a checkpoint: ``exact`` (same data world and
    workers) with its data rank's ``loader`` state (``None``: the loader had not
    started; then the ``pipeline``'s state), else the ``merged`` state of all."""

    exact: bool
    loader: Any = None
    pipeline: Any = None
    merged: dict[str, Any] | None = None


def restore(saved: Any, mine: Contribution) -> Restore:
    """What the rank ``mine`` describes (its data rank, data world, workers and
    pipeline identity; its states are not read) resumes from ``saved``, which
    :func:`pack` made. ``StateMismatchError`` for something else, or another
    pipeline's checkpoint."""
    if not isinstance(saved, dict) or saved.get("format") != FORMAT or saved.get("version") != VERSION:
        found = saved.get("format") if isinstance(saved, dict) else type(saved).__name__
        raise StateMismatchError(
            f"not a distshard LoaderCheckpoint of version {VERSION} (found {found!r}): load what "
            "LoaderCheckpoint.state_dict() saved"
        )
    if saved["identity"] != mine.identity:
        raise StateMismatchError(
            f"the checkpoint is of another pipeline: it was saved from {saved['identity']!r}, this pipeline is "
            f"{mine.identity!r}; load it into the pipeline that saved it"
        )
    entries = saved["entries"]
    if (saved["data_world"], saved["workers"]) == (mine.data_world, mine.workers):
        entry = entries[mine.data_rank]
        return Restore(True, entry["loader"], entry["pipeline"])
    positions = [e["loader"] if e["loader"] is not None else e["pipeline"] for e in entries]
    return Restore(False, merged=merge_items(positions, lambda d: f"data rank {d}").to_dict())


class LoaderCheckpoint:
    r"""A loader's position as a ``torch.distributed.checkpoint`` ``Stateful``.

    Put it next to the model and the optimizer: ``dcp.save({"model": ..., "data":
    distshard.LoaderCheckpoint(loader)}, checkpoint_id=...)`` on every rank, and
    ``dcp.load`` into the same dict before iterating. ``loader`` is torchdata's
    ``StatefulDataLoader`` over a :class:`distshard.StatefulPipeline` (or that
    pipeline, iterated directly).

    * Loaded on the same data world (``mesh=`` / ``group=``'s size, else the
      world) and the same ``num_workers``, every rank resumes exactly where its data
      rank stood: the run goes on batch by batch as the uninterrupted one.
    * On another data-parallel degree or worker count, the data ranks' states are
      merged and the pipeline resumes what is left (every element once over both
      runs, but what the new run's own ``even="drop"`` leaves aside).
    * A checkpoint of another pipeline (data, options) raises ``StateMismatchError``
      (a ``ValueError``) before anything is loaded; so do model-parallel peers that
      saved different positions.

    ``state_dict()`` is a collective over ``group`` (a ``ProcessGroup`` of the ranks
    that hold the loader; default: every rank), as ``dcp.save`` and ``dcp.load`` are;
    the state is taken when it is called (``dcp.async_save`` included). It never
    starts a loader that has not started.

    Example:
        >>> import torch.distributed.checkpoint as dcp
        >>> state = {"model": model_state, "data": distshard.LoaderCheckpoint(loader)}  # doctest: +SKIP
        >>> dcp.save(state, checkpoint_id="ckpt/step-100")  # doctest: +SKIP
        >>> dcp.load(state, checkpoint_id="ckpt/step-100")  # a new run, before iterating  # doctest: +SKIP
    """

    def __init__(self, loader: Any, *, group: Any = None) -> None:
        if not (callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))):
            raise OptionTypeError(
                f"LoaderCheckpoint needs a loader with state_dict() and load_state_dict(), got "
                f"{type(loader).__name__}: use torchdata's StatefulDataLoader over a distshard.StatefulPipeline "
                "(torch's DataLoader keeps no state)"
            )
        self.loader = loader
        self.pipeline: StatefulPipeline | None = next(
            (p for p in (loader, getattr(loader, "dataset", None)) if isinstance(p, StatefulPipeline)), None
        )
        shards = [self.pipeline.shard] if self.pipeline is not None else shards_in(loader)
        if len(shards) != 1:
            raise OptionError(f"LoaderCheckpoint needs a pipeline with exactly one dist_shard, found {len(shards)}")
        self.shard: DistShardIterDataPipe = shards[0]
        self.group: DataGroup | None = data_group(group=group) if group is not None else None

    # -- what this rank contributes -------------------------------------------------------
    def contribution(self, with_state: bool = True) -> Contribution:
        """This rank's :class:`Contribution` (``with_state=False``: without states,
        for :func:`restore`)."""
        ctx = self.shard.context()
        found = _context.dist_rank_world()
        rank = 0 if found is None else found[0]  # the world rank: what a refusal names
        workers = int(getattr(self.loader, "num_workers", 0) or 0)
        loader = pipeline = None
        if with_state:
            loader = self._loader_state()
            if loader is None:
                pipeline = (self.pipeline or self.shard).state_dict()
        return Contribution(rank, ctx.rank, ctx.world_size, workers, loader, pipeline, self.shard.chain_identity())

    def _loader_state(self) -> Any:
        """The loader's state, without starting a loader that has not started (a
        ``StatefulDataLoader`` would start its workers for it): then the state loaded
        into it and not used yet, if any."""
        loader = self.loader
        if hasattr(loader, "next_iter_state") and getattr(loader, "_iterator", None) is None:
            return loader.next_iter_state
        return loader.state_dict()

    # -- DCP's Stateful ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Collective: every rank's contribution, packed (the same bytes on every rank)."""
        mine = self.contribution()
        if _context.dist_rank_world() is None:
            gathered = [mine]
        else:
            gathered = _context.gather_objects(mine, "LoaderCheckpoint.state_dict", self.group)
        return {KEY: pickle.dumps(pack(gathered), protocol=pickle.HIGHEST_PROTOCOL)}

    def load_state_dict(self, state_dict: Any) -> None:
        """Resume from what :meth:`state_dict` saved (see the class); checked against
        this pipeline before anything is loaded."""
        blob = state_dict.get(KEY) if isinstance(state_dict, dict) else None
        if not isinstance(blob, bytes):
            raise StateMismatchError(
                f"not a LoaderCheckpoint state (no {KEY!r} bytes in it): load what LoaderCheckpoint.state_dict() saved"
            )
        found = restore(pickle.loads(blob), self.contribution(with_state=False))  # noqa: S301 - DCP's own pickle
        if not found.exact:
            self._load_pipeline(found.merged)
            self._restart_loader()
            return
        for state in find_states(found.loader if found.loader is not None else found.pipeline):
            self.shard.check_state(state)
        if found.loader is None:
            self._load_pipeline(found.pipeline)
            return
        if self.shard.even == "carry" and self.loader is not self.pipeline:
            self._load_pipeline(found.loader)  # the pipeline keeps the epochs' boundaries (docs/usage.md, carry)
        self.loader.load_state_dict(found.loader)

    def _load_pipeline(self, state: Any) -> None:
        (self.pipeline or self.shard).load_state_dict(state)

    def _restart_loader(self) -> None:
        """A loader that resumes a merged state starts afresh, its workers copying the pipeline."""
        if self.loader is self.pipeline or self.loader is self.shard:
            return
        self.loader.load_state_dict({})  # StatefulDataLoader: drops its iterator, so new workers start
        if hasattr(self.loader, "next_iter_state"):
            self.loader.next_iter_state = None
