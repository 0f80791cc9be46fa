"""``DistShardNode``: the ``dist_shard`` partition for ``torchdata.nodes`` pipelines.

Users moving from DataPipes to ``torchdata.nodes`` keep exactly the same
sharding: the element at stream position ``p`` goes to slot ``p % num_slots``,
with the same ``even`` modes, the same rank / world size resolution and the same
argument checks as ``.dist_shard()``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Dict, Iterator, Optional, TypeVar

from torchdata.nodes.base_node import BaseNode

from . import context as _context
from .plan import EVEN_MODES, Even, check_even, select_stream

T = TypeVar("T")

__all__ = ["DistShardNode"]


class DistShardNode(BaseNode[T]):
    r"""Shard the stream of a ``torchdata.nodes`` source exactly once over ranks × workers.

    The node keeps the elements at the positions ``p`` with
    ``p % num_slots == slot``, where ``p`` counts the elements of the source's
    stream in the current epoch (their values are never looked at), exactly as
    ``.dist_shard()`` does for DataPipes. Every element goes to exactly one slot.

    The slot is resolved by :func:`distshard.current_context` at every
    :meth:`reset` (the start of every epoch): explicit ``rank`` / ``world_size``,
    else ``torch.distributed``, else (in a DataLoader worker started with
    ``spawn`` / ``forkserver``) the ``torch.distributed`` rank of the process that
    pickled the node, else the ``RANK`` / ``WORLD_SIZE`` environment, else
    ``(0, 1)``; times the workers of a ``torch.utils.data.DataLoader`` when the
    node runs inside one (``get_worker_info()``). In a plain
    :class:`torchdata.nodes.Loader` the slot is the rank: the thread or process
    workers of ``ParallelMapper`` only run the map function and never iterate
    the source, so they need no sharding of their own.

    Every element of the source is pulled (skipping is positional), but only this
    slot's elements leave the node, so maps placed *after* it run on the slot's
    share only. Put expensive decoding after the shard.

    Args:
        source: the node whose stream is split.
        rank: this process's rank; give it with ``world_size``. By default they
            come from ``torch.distributed``, else from the ``RANK`` /
            ``WORLD_SIZE`` environment (torchrun), else ``(0, 1)``.
        world_size: the number of ranks.
        even: ``None`` keeps every element (slot counts differ by at most one);
            ``"drop"`` makes every slot yield exactly ``N // num_slots`` (the last
            ``N % num_slots`` elements are dropped); ``"pad"`` makes every slot
            yield exactly ``ceil(N / num_slots)``, a slot that falls short
            repeating its own first element (or element ``slot % N`` when
            ``N < num_slots``). Use ``"drop"`` or ``"pad"`` under DDP.

    State:
        ``state_dict()`` (through ``get_state``) returns a JSON-serialisable dict
        (as far as the source's own state is)::

            {"distshard_node": 1,       # marker and format version
             "taken": 3,                # elements this node yielded this epoch
             "slot": 1, "num_slots": 4, # the slot the share was computed for
             "even": None,              # the even mode
             "source": {...}}           # the source's state at the start of the
                                        # epoch, or None if it has none

        ``reset(state)`` resets the source to that start-of-epoch state and skips
        the first ``taken`` rounds positionally (the skipped elements are pulled
        from the source but never leave this node), so the run continues exactly
        after the last element yielded. The source must replay the same stream
        from the same state, as every deterministic source does.

    Example:
        >>> from torchdata.nodes import IterableWrapper, Loader
        >>> from distshard.nodes import DistShardNode
        >>> node = DistShardNode(IterableWrapper(["a", "b", "c", "d", "e"]), rank=1, world_size=2)
        >>> list(Loader(node))
        ['b', 'd']
        >>> node = DistShardNode(IterableWrapper(["a", "b", "c", "d", "e"]), rank=1, world_size=2,
        ...                      even="pad")
        >>> list(Loader(node))
        ['b', 'd', 'b']
    """

    STATE_KEY = "distshard_node"  # marker key; its value is the format version
    VERSION = 1
    TAKEN_KEY = "taken"
    SLOT_KEY = "slot"
    NUM_SLOTS_KEY = "num_slots"
    EVEN_KEY = "even"
    SOURCE_KEY = "source"
    _KEYS = (STATE_KEY, TAKEN_KEY, SLOT_KEY, NUM_SLOTS_KEY, EVEN_KEY, SOURCE_KEY)

    def __init__(
        self,
        source: BaseNode[T],
        *,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        even: Even = None,
    ) -> None:
        super().__init__()
        if not isinstance(source, BaseNode):
            raise TypeError(
                f"DistShardNode needs a torchdata.nodes.BaseNode source, got "
                f"{type(source).__name__}; wrap an iterable with torchdata.nodes.IterableWrapper"
            )
        self.source = source
        self._explicit = _context.check_explicit(rank, world_size)
        self.even = check_even(even)
        if self._explicit is None:
            # Surface a malformed RANK / WORLD_SIZE now rather than at the first reset.
            _context.check_environment()
        self._captured: Optional[tuple] = None  # (rank, world_size) of the pickling process
        self._ctx: Optional[_context.ShardContext] = None
        self._source_state: Optional[Dict[str, Any]] = None
        self._taken = 0
        self._it: Optional[Iterator[T]] = None

    # -- who am I -----------------------------------------------------------------
    def context(self) -> _context.ShardContext:
        """The :class:`~distshard.ShardContext` this node resolves to right now.

        The node itself uses the context resolved at its last :meth:`reset`.
        """
        return _context.current_context(*(self._explicit or (None, None)), _captured=self._captured)

    # -- BaseNode -----------------------------------------------------------------
    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        """Start the epoch from the beginning, or continue from ``initial_state``.

        ``initial_state`` must be a state this node's ``state_dict()`` returned on
        the same slot. Raises ``ValueError`` for a malformed state or one saved
        for another slot, ``num_slots`` or ``even`` mode, before touching the node
        or its source (the node stays as it was).
        """
        ctx = self.context()
        found = None if initial_state is None else self._check_state(initial_state, ctx)
        super().reset(initial_state)
        self._ctx = ctx
        if found is None:
            self.source.reset(None)
            self._source_state = self._current_source_state()
            self._taken = 0
        else:
            source_state = found[self.SOURCE_KEY]
            self.source.reset(copy.deepcopy(source_state))
            self._source_state = copy.deepcopy(source_state)
            self._taken = found[self.TAKEN_KEY]
        self._it = select_stream(self.source, ctx.slot, ctx.num_slots, self.even, self._taken)

    def next(self) -> T:
        item = next(self._it)  # type: ignore[arg-type]
        self._taken += 1
        return item

    def get_state(self) -> Dict[str, Any]:
        ctx = self._ctx
        assert ctx is not None  # BaseNode.state_dict() resets first
        return {
            self.STATE_KEY: self.VERSION,
            self.TAKEN_KEY: self._taken,
            self.SLOT_KEY: ctx.slot,
            self.NUM_SLOTS_KEY: ctx.num_slots,
            self.EVEN_KEY: self.even,
            self.SOURCE_KEY: copy.deepcopy(self._source_state),
        }

    # -- helpers ------------------------------------------------------------------
    def _current_source_state(self) -> Optional[Dict[str, Any]]:
        """The source's state right after its reset, or ``None`` if it keeps none."""
        try:
            state = self.source.state_dict()
        except NotImplementedError:
            return None
        return copy.deepcopy(state)

    def _check_state(self, state: object, ctx: _context.ShardContext) -> Dict[str, Any]:
        """Validate ``state`` for this node on slot ``ctx``; ``ValueError`` naming the
        first problem otherwise. Touches nothing."""

        def fail(why: str) -> ValueError:
            return ValueError(f"not a valid DistShardNode state: {why}")

        if not isinstance(state, Mapping):
            raise fail(f"expected a dict, got {type(state).__name__}")
        if self.STATE_KEY not in state:
            if "distshard" in state:
                raise fail(
                    "this is the state of a dist_shard DataPipe (DistShardIterDataPipe), not of a "
                    "DistShardNode; load it into the DataPipe pipeline that saved it"
                )
            hint = ""
            if "root" in state and "num_yielded" in state:
                hint = "; this looks like a Loader state: pass it to Loader.load_state_dict()"
            raise fail(
                f"no {self.STATE_KEY!r} key (got keys {sorted(map(str, state))[:8]}); pass what "
                f"this node's state_dict() returned{hint}"
            )
        version = state[self.STATE_KEY]
        if isinstance(version, bool) or version != self.VERSION:
            raise fail(f"version {version!r} is not {self.VERSION}, the one this distshard reads")
        missing = [key for key in self._KEYS if key not in state]
        if missing:
            raise fail(f"missing keys {missing}")
        for key, minimum in ((self.TAKEN_KEY, 0), (self.SLOT_KEY, 0), (self.NUM_SLOTS_KEY, 1)):
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, int):
                raise fail(f"{key}={value!r} must be an int")
            if value < minimum:
                raise fail(f"{key}={value} must be at least {minimum}")
        slot, num_slots = state[self.SLOT_KEY], state[self.NUM_SLOTS_KEY]
        if slot >= num_slots:
            raise fail(f"slot={slot} is outside [0, num_slots={num_slots})")
        even = state[self.EVEN_KEY]
        if even not in EVEN_MODES:
            raise fail(f"even={even!r} is not one of {EVEN_MODES}")
        source_state = state[self.SOURCE_KEY]
        if source_state is not None and not isinstance(source_state, Mapping):
            raise fail(f"source={source_state!r} must be the source's state dict or None")
        if (slot, num_slots) != (ctx.slot, ctx.num_slots):
            raise ValueError(
                f"the state is slot {slot} of {num_slots}'s, but this node is slot {ctx.slot} of "
                f"{ctx.num_slots} (rank {ctx.rank} of {ctx.world_size}, worker {ctx.worker_id} of "
                f"{ctx.num_workers}); resume with the same ranks and workers that saved it"
            )
        if even != self.even:
            raise ValueError(
                f"the state was saved with even={even!r} but this node has even={self.even!r}"
            )
        return dict(state)

    # -- pickling -----------------------------------------------------------------
    def __getstate__(self) -> Dict[str, Any]:
        # Like dist_shard: DataLoader workers started with spawn / forkserver get the
        # node by pickle and have no process group; remember the rank it had here.
        state = dict(self.__dict__)
        found = _context.dist_rank_world()
        if found is not None:
            state["_captured"] = found
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._captured is not None:
            _context.note_captured(self._captured)

    def __repr__(self) -> str:
        options = [f"even={self.even!r}"]
        if self._explicit is not None:
            options.append(f"rank={self._explicit[0]}, world_size={self._explicit[1]}")
        return f"{type(self).__name__}({type(self.source).__name__}, {', '.join(options)})"
