"""``DistShardNode``: ``dist_shard`` for ``torchdata.nodes`` pipelines.

The same plan as the DataPipe, executed by the same engine over the same readers
(``engine.py``, ``readers/``): the element at position ``p`` goes to slot
``p % num_slots`` (or a block / whole units), with the same ``even`` modes, the same
``shuffle=True``, read once from random-access sources and units, the same state
format (``merge_states`` and elastic resume work across front-ends), and the same
rank / world size resolution and argument checks as ``.dist_shard()``: both
translate their protocol onto the same :class:`~distshard.core.ShardCore`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, TypeVar

from torch.utils.data import get_worker_info
from torchdata.nodes.base_node import BaseNode

from . import context as _context
from .access import Access, WholeFiles, access_of, reader_of
from .core import OptionsView, ShardCore
from .errors import OptionTypeError
from .options import carry_refused, check_epoch, check_given
from .plan import CARRY, Even
from .readers import Reader
from .saved import NodeWire
from .state import check_slot

T = TypeVar("T")

__all__ = ["DistShardNode"]


class DistShardNode(OptionsView, BaseNode[T]):
    r"""Shard a ``torchdata.nodes`` source exactly once over ranks × workers.

    ``source`` is either a :class:`torchdata.nodes.BaseNode`, whose stream every
    slot walks and keeps its own positions of (skipping in C; put decoding after
    the node), or a random-access sequence (a list, tuple, range, tensor, numpy
    array, ``distshard.positional(...)``, a ``distshard`` file source), which each
    slot indexes at its own positions only: read once, ``shuffle=True``, O(1)
    resume. With ``expand`` the source holds units (files, shards), as for
    ``.dist_shard(expand=, sizes=)``.

    The slot is resolved at every :meth:`reset` (the start of every epoch):
    explicit ``rank`` / ``world_size``, else ``torch.distributed``, else the rank of
    the process that pickled the node (spawned DataLoader workers), else the
    ``RANK`` / ``WORLD_SIZE`` environment, else ``(0, 1)``; times the workers of a
    ``torch.utils.data.DataLoader`` when the node runs inside one. In a plain
    :class:`torchdata.nodes.Loader` the slot is the rank: the workers of
    ``ParallelMapper`` only run the map function and never iterate the source.

    Epochs: every :meth:`reset` without a state after the first starts the next
    epoch (as ``SamplerWrapper`` does); :meth:`set_epoch` sets it. ``shuffle=True``
    visits positions in a permutation seeded by ``(seed, epoch)``. A node source's
    own randomness must give the same stream on every slot (seed it identically).

    Args:
        source: a ``BaseNode`` (a stream), or a random-access sequence.
        rank, world_size: as for ``.dist_shard()``: both or neither.
        even: ``None``, ``"drop"``, ``"pad"`` or ``"carry"`` (a sequence or units
            with sizes listed in a sequence), as for ``.dist_shard()``.
        seed: base seed of ``shuffle=True`` (``None``: 0).
        shuffle: visit positions in a seeded permutation (random access or units
            with ``sizes`` only).
        expand: unit mode: ``expand(unit)`` gives a unit's elements.
        sizes: unit mode: element counts per unit (sequence, mapping or callable).
        multiple_of: with ``even="drop"``, every slot yields a multiple of this
            (the batch size), as for ``.dist_shard()``.
        mesh, group: the data group (a ``DeviceMesh`` of the data-parallel
            dimensions, or a ``ProcessGroup``), as for ``.dist_shard()``.

    State:
        ``state_dict()`` (through ``get_state``) is ``{"distshard_node": 2, "shard":
        <the dist_shard state of this slot>}``; the shard state also holds the
        source node's state at the start of the epoch (``node_source``), so the
        epoch replays from there. States of all slots merge with
        :func:`distshard.merge_states`; load a merged state with
        :meth:`load_state_dict` (any ranks and workers) before the next epoch starts.

    Example:
        >>> from torchdata.nodes import IterableWrapper, Loader
        >>> from distshard.nodes import DistShardNode
        >>> node = DistShardNode(IterableWrapper(["a", "b", "c", "d", "e"]), rank=1, world_size=2)
        >>> list(Loader(node))
        ['b', 'd']
        >>> list(Loader(DistShardNode(["a", "b", "c", "d", "e"], rank=1, world_size=2, even="pad")))
        ['b', 'd', 'b']
    """

    STATE_KEY = "distshard_node"  # marker key; its value is the format version
    VERSION = 2
    WIRE = NodeWire(STATE_KEY, VERSION)

    def __init__(
        self,
        source: Any,
        *,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        even: Even = None,
        seed: Optional[int] = None,
        shuffle: bool = False,
        expand: Optional[Callable[[Any], Any]] = None,
        sizes: Optional[Sequence[int] | Mapping[Any, int] | Callable[[Any], int]] = None,
        multiple_of: int = 1,
        mesh: Any = None,
        group: Any = None,
    ) -> None:
        super().__init__()
        self._sequence: Any = None
        self._whole: Optional[WholeFiles] = None  # a file source read as whole files (compressed)
        if not isinstance(source, BaseNode):
            found = access_of(source, bare=True, whole=expand is None)
            if found is not None:
                self._sequence, self._whole = found.sequence, found.whole
            if self._sequence is None and self._whole is None:
                raise OptionTypeError(
                    f"DistShardNode needs a torchdata.nodes.BaseNode or a random-access sequence, got "
                    f"{type(source).__name__}; wrap an iterable with torchdata.nodes.IterableWrapper, "
                    "or a sequence whose [] is positional with distshard.positional()"
                )
        self.source = source
        options = check_given(locals())
        # the options, epoch, loaded state and runs, shared with the DataPipe
        self.core = ShardCore(options, whole=self._whole is not None, what="node")
        fix = "a random-access sequence (a list, range, tensor, distshard.positional(...), a distshard file source)"
        self.core.check_access(
            self.access(),
            source=type(source).__name__,
            fix=f"{fix} instead of a node, or units with sizes=",
            shuffle_fix="",
        )
        if self.even == CARRY and isinstance(source, BaseNode):  # units from a node: read again every epoch
            raise carry_refused(
                f"units from a node ({type(source).__name__})",
                "Pass the units in a list, with sizes=, or use even='drop' / 'pad'",
            )
        self._started = False
        self._source_start: Any = None
        self._source_fresh = False  # the source was just reset for this epoch
        self._it: Optional[Iterator[T]] = None

    # -- who am I -----------------------------------------------------------------
    def context(self) -> _context.ShardContext:
        """The :class:`~distshard.ShardContext` this node resolves to right now."""
        return self.core.context()

    # -- the options (frozen in the core) -------------------------------------------
    @property
    def shuffle(self) -> bool:
        return self.core.options.shuffle

    @property
    def multiple_of(self) -> int:
        return self.core.options.multiple_of

    @property
    def expand(self) -> Optional[Callable[[Any], Any]]:
        return self.core.options.expand

    @property
    def sizes(self) -> Any:
        return self.core.options.sizes

    def set_epoch(self, epoch: int) -> "DistShardNode[T]":
        """Set the epoch the next :meth:`reset` starts (same value on every rank)."""
        self.core.set_epoch(check_epoch(epoch))
        return self

    # -- BaseNode -----------------------------------------------------------------
    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        """Start the next epoch, continue the one ``initial_state`` was saved in, or
        (without a state) continue a state given to :meth:`load_state_dict`.

        A malformed state, or one from another pipeline or slot, raises
        ``ValueError`` before the node or its source is touched."""
        core = self.core
        ctx = self.context()
        resume = None
        if initial_state is not None:
            resume = self.WIRE.read(initial_state)
        elif core.pending is not None:
            resume = core.pending
        elif self._started and not core.epoch_set:
            core.next_epoch()
        if resume is not None:
            core.check_against(resume, None)
            check_slot(
                resume,
                ctx.slot,
                ctx.num_slots,
                f"rank {ctx.rank} of {ctx.world_size}, worker {ctx.worker_id} of {ctx.num_workers}",
            )
            if initial_state is not None:
                core.check_carry(resume, get_worker_info() is not None)
        listing = self.mode == "sized_units" and isinstance(self.source, BaseNode)  # reads the source
        if resume is not None and not listing:
            core.check_against(resume, self.reader())
        super().reset(initial_state)
        if resume is not None:
            core.resumed(resume)
        core.resume, core.epoch_set, self._started = None, False, True
        if isinstance(self.source, BaseNode):
            present, start = self.WIRE.source_of(resume) if resume is not None else (False, None)
            if present:
                self._source_start, self._source_fresh = copy.deepcopy(start), False
            else:
                self.source.reset(None)
                self._source_start, self._source_fresh = _node_state(self.source), True
        seed = core.run_seed(resume, core.base_seed(lambda: None))
        reader = self.reader()
        if resume is not None and listing:
            core.check_against(resume, reader)
        self._it = iter(core.slot_run(reader, ctx, seed, resume, keep=True))

    def next(self) -> T:
        return next(self._it)  # type: ignore[arg-type]

    def get_state(self) -> Dict[str, Any]:
        shard = self.core.run_state()  # BaseNode.state_dict() resets first
        return self.WIRE.write(shard, self._source_start, isinstance(self.source, BaseNode))

    def load_state_dict(self, state: Any) -> None:
        """Continue from ``state`` at the next :meth:`reset` without a state: this
        slot's own state, a merged state (:func:`distshard.merge_states`, any ranks
        and workers), or the states of all slots of a run (merged here). Raises
        ``ValueError`` and leaves the node unchanged if it does not fit."""
        in_worker = get_worker_info() is not None
        self.core.load_saved(state, lambda: None, in_worker, node_source=isinstance(self.source, BaseNode))

    # -- helpers ------------------------------------------------------------------
    def _stream(self) -> Iterator[Any]:
        """The source node's stream of this epoch, from its start state (a source
        just reset for this epoch is used as it is: it may keep no state)."""
        if self._source_fresh:
            self._source_fresh = False
        else:
            self.source.reset(copy.deepcopy(self._source_start))
        return iter(self.source)

    def access(self) -> Access:
        """How the source reads (see :mod:`distshard.access`): a sequence at random,
        else the node's stream (or, in unit mode, the units, listed)."""
        if self.expand is None and self._sequence is not None:
            return Access(sequence=self._sequence)
        if self._whole is not None:
            return Access(whole=self._whole, identity="node")
        name = type(self.source).__qualname__
        stream = self._stream if isinstance(self.source, BaseNode) else (lambda: iter(self.source))
        return Access(stream=stream, name=name, identity=f"node:{name}")

    def reader(self) -> Reader:
        """The reader of this epoch's source (lists the units in unit mode)."""
        return reader_of(self.access(), self.expand, self.sizes)

    # -- pickling -----------------------------------------------------------------
    def __getstate__(self) -> Dict[str, Any]:
        # Like dist_shard: DataLoader workers started with spawn / forkserver get the
        # node by pickle and have no process group; the core remembers the rank it had here.
        state = dict(self.__dict__)
        state["_it"] = None
        return state

    def __repr__(self) -> str:
        return self.core.describe(type(self).__name__, type(self.source).__name__)


def _node_state(node: BaseNode) -> Optional[Dict[str, Any]]:
    """The node's state right after its reset, or ``None`` if it keeps none."""
    try:
        return copy.deepcopy(node.state_dict())
    except NotImplementedError:
        return None
