"""What a user saved, taken to one typed state: the edge of the one load path.

Users hand a front-end what they saved: a slot's state, a merged one, a list of them
(every rank's), a ``StatefulPipeline`` state, a ``StatefulDataLoader`` state (one state
per worker, nested), a ``DistShardNode`` state, or lists and dicts of those. Here every
state in it is parsed once (``State.from_dict``, the only reader of the wire format),
several are merged typed (``merging.merge``), and what a front-end adds to the wire
(``DistShardNode``'s ``node_source``) is read and written. ``ShardCore.load_saved``
(``core.py``) loads the result; nothing after this module reads a state by key.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from .errors import StateMismatchError
from .merging import merge
from .state import KEY, State, find_typed_states

__all__ = ["NodeWire", "Saved", "saved_states"]

_NODE_SOURCE = "node_source"  # DistShardNode: the source node's state at the start of the epoch
_ACCEPTED = (
    "pass what dist_shard's state_dict(), StatefulPipeline.state_dict(), a StatefulDataLoader's "
    "state_dict() or merge_states() returned (or a list of those)"
)


def saved_states(saved: object) -> list[State]:
    """Every distshard state in ``saved``, each parsed once; ``StateMismatchError``
    (a ``ValueError``) naming what was found instead when there is none."""
    found = find_typed_states(saved)
    if not found:
        if isinstance(saved, Mapping):
            why = f"no {KEY!r} key (got keys {sorted(map(str, saved))[:8]})"
        elif isinstance(saved, (list, tuple)):
            why = f"none in a {type(saved).__name__} of {len(saved)} items"
        else:
            why = f"expected a dict, got {type(saved).__name__}"
        raise StateMismatchError(f"no distshard state found: {why}; {_ACCEPTED}")
    return found


@dataclass(frozen=True)
class Saved:
    """The states found in what a user saved, typed (see :func:`saved_states`)."""

    states: list[State]

    @classmethod
    def of(cls, saved: object) -> "Saved":
        return cls(saved_states(saved))

    def some_slots_of_a_carry_run(self) -> bool:
        """Whether these are several slot states that do not cover their run's slots
        (one rank's workers, a ``StatefulDataLoader`` state), as opposed to every slot's
        (to merge) or one state (to load)."""
        found = self.states
        if len(found) < 2 or not all(s.is_slot for s in found):
            return False
        num_slots = found[0].num_slots
        assert num_slots is not None  # a slot's state
        return len({s.slot for s in found}) < num_slots

    def state(self, node_source: bool = False) -> State:
        """The one state to load: the state itself, or the merge of all of them
        (``node_source``: a merged state keeps the source node's start state of the first
        state that has one, ``None`` if none does)."""
        found = self.states
        if len(found) == 1:
            return found[0]
        merged = merge(found)
        if node_source and _NODE_SOURCE not in merged.extra:
            first = next((s.extra[_NODE_SOURCE] for s in found if _NODE_SOURCE in s.extra), None)
            merged = replace(merged, extra={**merged.extra, _NODE_SOURCE: first})
        return merged


@dataclass(frozen=True)
class NodeWire:
    """A ``DistShardNode``'s state on the wire: ``{key: version, "shard": <its shard's
    state, holding the source node's state at the start of the epoch>}``."""

    key: str
    version: int

    def write(self, shard: dict[str, Any], source_start: Any = None, has_source: bool = False) -> dict[str, Any]:
        """The node state of ``shard`` (``has_source``: the source is a node, whose
        start state ``source_start`` the shard state holds)."""
        if has_source:
            shard[_NODE_SOURCE] = copy.deepcopy(source_start)
        return {self.key: self.version, "shard": shard}

    def read(self, state: object) -> State:
        """The shard state of a node state (or a bare shard state: what
        ``BaseNode.reset`` is given, nothing else), parsed once."""
        if isinstance(state, Mapping) and self.key in state:
            found = state[self.key]
            if isinstance(found, bool) or found != self.version:
                raise StateMismatchError(f"not a valid DistShardNode state: version {found!r} is not {self.version}")
            return State.from_dict(state.get("shard"))
        if isinstance(state, Mapping) and KEY in state:
            return State.from_dict(state)
        hint = ""
        if isinstance(state, Mapping) and "root" in state:
            hint = "; this looks like a Loader state: pass it to Loader.load_state_dict()"
        keys = sorted(map(str, state))[:8] if isinstance(state, Mapping) else type(state).__name__
        raise StateMismatchError(
            f"not a valid DistShardNode state: no {self.key!r} key (got {keys}); pass what "
            f"this node's state_dict() returned{hint}"
        )

    @staticmethod
    def source_of(state: State) -> tuple[bool, Any]:
        """``(present, value)`` of the source node's start state ``state`` holds."""
        return (_NODE_SOURCE in state.extra, state.extra.get(_NODE_SOURCE))
