"""Checkpoint state of ``dist_shard``: its format and validation (the merge that
makes elastic resume possible is ``merging.py``).

A *slot state* is what one copy of the pipeline (one rank's DataLoader worker)
reports: the epoch and seed it runs, the part of the epoch its run splits
(``remaining``, in visit indices), how the run laid that out over its slots
(``layout``), and how many elements it yielded of its share (``taken``). A
*merged state* has no slot: it is the part of the epoch nobody consumed yet, and
any number of ranks and workers can load it and split it afresh. Everything is
plain JSON (ints, strings, lists, ``None``, bools), with a version number.

A state identifies the run it came from: ``mode``, ``shuffle``, ``seed``, ``even``,
``length`` (the epoch's element count, when known before reading) and ``source``
(a short identity of the data) are checked on load and merge, so a state from
another pipeline, or one whose data changed, is refused instead of resuming at
the wrong positions.

Under ``even="carry"`` the epochs form one stream, and a state's ``remaining`` is a
*base* in global positions (``epoch * N + position``, see ``plan.py``) that opens the
epoch ``carry_from``: the part of the concatenated stream not consumed yet, ending in
an open interval. Everything else is as above; ``carry_from`` is ``None`` for the
other modes, so a state of a carry run and one of another run never fit each other.

In the code a state is a :class:`State` (typed; ``State.from_dict`` checks the wire
format, ``to_dict`` writes it); the functions taking a state take it typed or as the
validated dict the front-ends keep, and return dicts where a user sees the result.
Errors: a malformed state is an ``OptionError``, a state of another run (or states that
do not merge) a ``StateMismatchError``, a merge that cannot be exact an
``UnsupportedError``; each a ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Mapping

from .errors import OptionError, StateMismatchError, UnsupportedError
from .layouts import LAYOUTS as _REGISTRY
from .layouts import Layout, invalid_state, layout_named
from .plan import (
    ALL_EVEN_MODES,
    CARRY,
    Even,
    Remaining,
    carry_after,
    carry_window,
)

VERSION = 3  # 3: carry_from (even="carry")
KEY = "distshard"  # the marker (and version) key of a slot or merged state
REPLICA = "replica"  # the copy a data group's state comes from: [slot, num_slots] (absent otherwise)
# how the source identity of whole files (compressed, each streamed to one slot) begins: on the
# wire, State.whole_files is this prefix (so states stay readable by older code both ways)
WHOLE_FILES_SOURCE = "files:"
MODES = ("element", "units", "sized_units")  # what the positions are
LAYOUTS = tuple(_REGISTRY)  # how a run laid its positions out over slots (layouts.py)

__all__ = [
    "VERSION",
    "State",
    "as_state",
    "carry_base_after",
    "check_carry_load",
    "check_fits",
    "check_slot",
    "fresh_state",
    "validate_state",
    "find_states",
]

FRESH_CARRY: tuple[list, int] = ([[0, None]], 0)  # the base of a carry pipe no state moved: epoch 0 at 0


@dataclass(frozen=True)
class State:
    """A slot state (``slot`` set: one copy's run, where it is) or a merged one
    (``slot`` ``None``: what is left of the epoch, for any ranks and workers), typed.

    ``to_dict`` / ``from_dict`` convert to and from the JSON wire format (version
    :data:`VERSION`, unchanged): ``layout`` travels as its name, ``remaining`` as a list
    of ``[start, stop]`` pairs, and ``whole_files`` as the prefix
    :data:`WHOLE_FILES_SOURCE` of ``source``. Keys a front-end adds (``node_source``)
    are kept in ``extra``."""

    epoch: int
    mode: str  # what the positions are: element, units, sized_units
    even: Even
    seed: int | None = None
    layout: Layout | None = None  # how the run laid its positions out (a slot's state always says)
    shuffle: bool | None = None
    length: int | None = None  # the epoch's element count, when known before reading
    source: str | None = None  # a short identity of the data
    multiple_of: int = 1
    workers: int | None = None  # the run's workers per rank
    remaining: Remaining = field(default_factory=Remaining)  # the visit indices the run splits (carry: a base)
    total: int | None = None  # how many of them, when known
    num_slots: int | None = None
    slot: int | None = None
    taken: int = 0  # elements this slot yielded of its share
    finished: bool = False
    carry_from: int | None = None  # even="carry": the epoch the base opens, else None
    whole_files: bool = False  # whole compressed files, each streamed to one slot: no merge for another layout
    # (slot, num_slots) of the copy that reported it, when a data group (mesh= / group=) decided its
    # slot: model-parallel peers report the same copy, and a merge counts identical ones once
    replica: tuple[int, int] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.whole_files != is_whole_files(self.source):
            raise OptionError(
                f"whole_files={self.whole_files} but source={self.source!r}: the identity of whole files "
                f"begins with {WHOLE_FILES_SOURCE!r}"
            )

    @property
    def is_slot(self) -> bool:
        """A slot's own state (else a merged or a fresh one)."""
        return self.slot is not None

    @property
    def is_carry(self) -> bool:
        return self.even == CARRY

    @classmethod
    def fresh(cls, epoch: int, mode: str, even: Any, carry: tuple[list, int] | None = None) -> "State":
        """The state of an epoch nobody has consumed anything of yet; under
        ``even="carry"`` with the base (``remaining``, ``carry_from``) the pipe counts
        from (``carry``)."""
        if even != CARRY:
            base, first = [[0, None]], None
        else:  # a base opening a later epoch does not apply to this one
            base, first = carry if carry is not None and carry[1] <= epoch else FRESH_CARRY
        return cls(epoch=epoch, mode=mode, even=even, remaining=_remaining(base), carry_from=first)

    def to_dict(self) -> dict[str, Any]:
        """The wire format: plain JSON, the keys of version :data:`VERSION`."""
        out: dict[str, Any] = {
            KEY: VERSION,
            "epoch": self.epoch,
            "seed": self.seed,
            "mode": self.mode,
            "even": self.even,
            "layout": None if self.layout is None else self.layout.name,
            "shuffle": self.shuffle,
            "length": self.length,
            "source": self.source,
            "multiple_of": self.multiple_of,
            "workers": self.workers,
            "remaining": self.remaining.to_list(),
            "total": self.total,
            "num_slots": self.num_slots,
            "slot": self.slot,
            "taken": self.taken,
            "finished": self.finished,
            "carry_from": self.carry_from,
        }
        if self.replica is not None:  # only a data group's states have it: the others' wire is unchanged
            out[REPLICA] = list(self.replica)
        out.update((k, v) for k, v in self.extra.items() if k not in out)
        return out

    @classmethod
    def from_dict(cls, state: object) -> "State":
        """Check a state's structure (``ValueError`` naming the first problem) and
        return it typed."""
        wire, remaining = _check_wire(state)
        layout = None if wire["layout"] is None else layout_named(wire["layout"])
        found = cls(
            **{f.name: wire[f.name] for f in fields(cls) if f.name in _WIRE_AS_IS},
            layout=layout,
            remaining=remaining,
            whole_files=is_whole_files(wire["source"]),
            replica=_replica(wire),
            extra={k: v for k, v in wire.items() if k not in _WIRE_KEYS and k != REPLICA},
        )
        if found.is_carry:
            _check_carry(found)
        return found


def is_whole_files(source: str | None) -> bool:
    """Whether ``source`` is the identity of whole files (each streamed to one slot)."""
    return source is not None and source.startswith(WHOLE_FILES_SOURCE)


def _remaining(pairs: Iterable[Any]) -> Remaining:
    try:
        return Remaining((a, b) for a, b in pairs)
    except ValueError as exc:
        raise _fail(f"remaining: {exc}") from None


_WIRE_ORDER = tuple(State.fresh(0, "element", None).to_dict())  # every key of the wire format, in order
_WIRE_KEYS = frozenset(_WIRE_ORDER)
_WIRE_AS_IS = frozenset(_WIRE_KEYS - {KEY, "layout", "remaining"})


def as_state(state: "State | Mapping[str, Any]") -> State:
    """``state`` typed: a :class:`State` as it is, a dict checked and converted."""
    return state if isinstance(state, State) else State.from_dict(state)


def fresh_state(epoch: int, mode: str, even: Any, carry: tuple[list, int] | None = None) -> dict[str, Any]:
    """:meth:`State.fresh` on the wire."""
    return State.fresh(epoch, mode, even, carry).to_dict()


def _fail(why: str) -> OptionError:
    return invalid_state(why)


def _int(state: Mapping, key: str, *, minimum: int = 0, optional: bool = False) -> int | None:
    value = state.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(f"{key}={value!r} must be an int")
    if value < minimum:
        raise _fail(f"{key}={value} must be at least {minimum}")
    return value


def validate_state(state: object) -> dict[str, Any]:
    """Check a state's structure and return a normalised copy; ``ValueError``
    naming the first problem otherwise."""
    return State.from_dict(state).to_dict()


def _check_wire(state: object) -> tuple[Mapping[str, Any], Remaining]:
    """The wire format's checks, in the order their messages name the first problem;
    the state and its ``remaining``."""
    if not isinstance(state, Mapping):
        raise _fail(f"expected a dict, got {type(state).__name__}")
    if KEY not in state:
        raise _fail(
            f"no {KEY!r} key (got keys {sorted(map(str, state))[:8]}); pass what "
            "dist_shard's state_dict(), StatefulPipeline.state_dict() or merge_states() returned"
        )
    if state[KEY] != VERSION or isinstance(state[KEY], bool):
        older = (
            " (an older distshard's state records too little to check it against the data)" if state[KEY] == 1 else ""
        )
        raise _fail(f"version {state[KEY]!r} is not {VERSION}, the one this distshard reads{older}")
    missing = [k for k in _WIRE_ORDER if k not in state]
    if missing:
        raise _fail(f"missing keys {missing}")
    for key in ("epoch", "seed", "total", "taken", "length"):
        _int(state, key, optional=key in ("seed", "total", "length"))
    _int(state, "multiple_of", minimum=1)
    _int(state, "workers", minimum=1, optional=True)
    if state["layout"] is not None and state["layout"] not in LAYOUTS:
        raise _fail(f"layout={state['layout']!r} is not one of {LAYOUTS}")
    if state["layout"] is not None and layout_named(state["layout"]).needs_workers and state["workers"] is None:
        raise _fail(f"a state in {layout_named(state['layout']).noun} layout must say how many workers its run had")
    if state["shuffle"] is not None and not isinstance(state["shuffle"], bool):
        raise _fail(f"shuffle={state['shuffle']!r} must be True, False or None")
    if state["source"] is not None and not isinstance(state["source"], str):
        raise _fail(f"source={state['source']!r} must be a string or None")
    _check_slot_keys(state)
    if state["mode"] not in MODES:
        raise _fail(f"mode={state['mode']!r} is not one of {MODES}")
    if state["even"] not in ALL_EVEN_MODES:
        raise _fail(f"even={state['even']!r} is not one of {ALL_EVEN_MODES}")
    if not isinstance(state["finished"], bool):
        raise _fail(f"finished={state['finished']!r} must be True or False")
    remaining = _check_remaining(state["remaining"])
    if state["slot"] is None and state["taken"]:
        raise _fail("a merged state (no slot) must have taken=0")
    if state["slot"] is not None and state["layout"] is None:
        raise _fail("a slot's state must say its layout")
    if (state["even"] == CARRY) != (state["carry_from"] is not None):
        raise _fail(f"carry_from={state['carry_from']!r} must be an int with even='carry' and None otherwise")
    if state["even"] == CARRY:
        _int(state, "carry_from")
    return state, remaining


def _replica(state: Mapping[str, Any]) -> tuple[int, int] | None:
    """The ``replica`` of a validated wire state: ``[slot, num_slots]`` of the copy, a
    slot state's own slot, or ``None`` when absent."""
    found = state.get(REPLICA)
    if found is None:
        return None
    if (
        not isinstance(found, (list, tuple))
        or len(found) != 2
        or any(isinstance(v, bool) or not isinstance(v, int) for v in found)
        or not 0 <= found[0] < found[1]
    ):
        raise _fail(f"replica={found!r} must be [slot, num_slots] with 0 <= slot < num_slots")
    if state["slot"] is not None and (found[0], found[1]) != (state["slot"], state["num_slots"]):
        raise _fail(f"replica={list(found)} is not the slot state's own slot [{state['slot']}, {state['num_slots']}]")
    return found[0], found[1]


def _check_slot_keys(state: Mapping[str, Any]) -> None:
    num_slots = _int(state, "num_slots", minimum=1, optional=True)
    slot = _int(state, "slot", optional=True)
    if (num_slots is None) != (slot is None):
        raise _fail("num_slots and slot must both be set (a slot's state) or both None (merged)")
    if slot is not None and slot >= num_slots:  # type: ignore[operator]
        raise _fail(f"slot={slot} is outside [0, num_slots={num_slots})")


def _check_remaining(remaining: object) -> Remaining:
    if not isinstance(remaining, list) or not all(
        isinstance(pair, (list, tuple))
        and len(pair) == 2
        and all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in pair)
        and pair[0] is not None
        for pair in remaining
    ):
        raise _fail(f"remaining={remaining!r} must be a list of [start, stop] pairs of ints (stop may be None)")
    empty = [pair for pair in remaining if pair[1] is not None and pair[1] <= pair[0]]
    if empty:
        raise _fail(f"remaining has an empty or inverted interval {list(empty[0])}")
    return _remaining(remaining)


def _check_carry(state: State) -> None:
    """A carry state's base: open-ended, opening an epoch no later than the one after
    the state's, never past the end of that epoch's own stream."""
    first, base = state.carry_from, state.remaining
    assert first is not None  # checked on the wire
    if first > state.epoch + 1:
        raise _fail(f"carry_from={first} is after the epoch after the state's ({state.epoch})")
    if not base.intervals or base.intervals[-1][1] is not None:
        raise _fail("under even='carry' remaining must end in an open interval [start, None]")
    if state.layout is not None and not state.layout.carries:
        raise _fail(f"even='carry' has no {state.layout.name} layout")
    if state.is_slot and state.length is None:
        raise _fail("a carry slot state must record its epoch's length")
    if state.length is not None and base.intervals[-1][0] > (first + 1) * state.length:
        raise _fail(
            f"remaining starts its open end at {base.intervals[-1][0]}, past the end of epoch {first}'s "
            f"stream ({(first + 1) * state.length}): it was altered or comes from other data"
        )


def check_fits(
    state: State | Mapping[str, Any],
    *,
    mode: str,
    shuffle: bool,
    even: Any,
    multiple_of: int,
    seed: int | None,
    length: int | None = None,
    source: str | None = None,
    what: str = "dist_shard",
) -> None:
    """Raise ``StateMismatchError`` (a ``ValueError``) if the validated state does not
    come from a pipeline with these options (``length`` and ``source``, the reader's,
    when known).

    What a slot's state records of its own run (``even``, ``multiple_of``) is checked
    only for slot states: a merged state starts a new run with the loader's options."""
    found = as_state(state)

    def refuse(key: str, theirs: Any, ours: Any) -> StateMismatchError:
        return StateMismatchError(
            f"the state was saved with {key}={theirs!r} but this {what} has {key}={ours!r}: "
            "it comes from another pipeline or other data; load it into the pipeline that saved it"
        )

    if found.mode != mode:
        raise refuse("mode", found.mode, mode)
    if found.is_carry != (even == CARRY):  # one stream of epochs or each epoch to itself
        raise StateMismatchError(
            f"the state was saved with even={found.even!r} but this {what} has even={even!r}: under "
            "even='carry' positions count through the epochs as one stream, otherwise within each epoch, so "
            "neither state means anything to the other; load it into a pipeline with the even it was saved with"
        )
    if found.shuffle is not None and found.shuffle != shuffle:
        raise refuse("shuffle", found.shuffle, shuffle)
    if found.is_slot and found.even != even:
        raise refuse("even", found.even, even)
    if found.is_slot and found.multiple_of != multiple_of:
        raise refuse("multiple_of", found.multiple_of, multiple_of)
    if seed is not None and found.seed is not None and found.seed != seed:
        if even == CARRY:  # the next epoch reads this epoch's tail in this seed's order
            raise StateMismatchError(
                f"the state was saved with seed={found.seed!r} but this {what} orders its epochs with "
                f"seed={seed!r} (under even='carry' seed=None means 0): every epoch's order, its tail "
                f"read in the next epoch included, must come from one seed; pass seed={found.seed!r} "
                "to resume it"
            )
        raise refuse("seed", found.seed, seed)
    if found.length is not None and length is not None and found.length != length:
        raise StateMismatchError(
            f"the state's epoch had {found.length} elements, this pipeline's has {length}: the data "
            "changed since the checkpoint (or it comes from another pipeline); it cannot be resumed"
        )
    if found.source is not None and source is not None and found.source != source:
        raise StateMismatchError(f"{refuse('source', found.source, source)}{_difference(found.source, source)}")
    if length is not None:
        _check_within(found, length)


def _check_within(found: State, length: int) -> None:
    """Refuse a state whose remaining positions reach past an epoch of ``length``."""
    if found.is_carry:
        first, start = found.carry_from, found.remaining.intervals[-1][0]
        assert first is not None  # a carry state's
        if start > (first + 1) * length:
            raise StateMismatchError(
                f"the state's remaining positions open at {start}, beyond the end of epoch {first}'s stream "
                f"({(first + 1) * length}) with {length} elements an epoch: it comes from other data or was altered"
            )
        return
    for start, stop in found.remaining.intervals:
        end = stop if stop is not None else start
        if end > length:
            raise StateMismatchError(
                f"the state's remaining positions reach {end}, beyond this epoch's {length} "
                "elements: it comes from other data or was altered"
            )


def _difference(theirs: str, ours: str) -> str:
    """Where two identities first differ, as `` (the state's seed=1, this pipeline's
    seed=2)``: identities are space-separated ``key=value`` parts (mixes record
    their seed, weights, phases and costs that way)."""
    for a, b in zip(theirs.split(), ours.split(), strict=False):
        if a != b:
            return f" (the state's {a}, this pipeline's {b})"
    return ""


def check_slot(state: State | Mapping[str, Any], slot: int, num_slots: int, where: str) -> None:
    """Raise ``StateMismatchError`` if the state is another slot's (``where``
    describes this copy: rank and worker)."""
    found = as_state(state)
    if found.is_slot and (found.slot, found.num_slots) != (slot, num_slots):
        if found.num_slots == num_slots:  # same ranks and workers: another rank's (or worker's) state
            fix = (
                "the run has the same ranks and workers, so this is another slot's own state: give every "
                "rank the state it saved (PyTorch Lightning 2.6 saves rank 0's loader state only and "
                "hands it to every rank: add the LoaderStatePerRank callback of docs/integrations.md), "
                "or merge the states of all slots with distshard.merge_states() and load that"
            )
        else:
            fix = (
                "to resume with other ranks or workers, merge the states of all slots with "
                "distshard.merge_states() and load that"
            )
        raise StateMismatchError(
            f"the loaded state is slot {found.slot} of {found.num_slots}'s, but this copy is slot "
            f"{slot} of {num_slots} ({where}); {fix}"
        )


def find_states(obj: object) -> list[dict[str, Any]]:
    """Every distshard state inside ``obj``: a state itself, a ``StatefulPipeline``
    state, a ``StatefulDataLoader`` state (which nests one per worker), or lists and
    dicts of those, e.g. what every rank saved."""
    return [state.to_dict() for state in find_typed_states(obj)]


def find_typed_states(obj: object) -> list[State]:
    """:func:`find_states`, typed."""
    found: list[State] = []

    def walk(value: object) -> None:
        if isinstance(value, Mapping):
            if KEY in value:
                found.append(State.from_dict(value))
                return
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(obj)
    return found


# -- carry: the base a pipe keeps from one epoch to the next ------------------------------------


def carry_base_after(state: State | Mapping[str, Any]) -> tuple[list, int]:
    """The base (``remaining``, ``carry_from``) that the epochs after the state's go on
    from: a slot's state moves it to where its run ends, so the next epoch starts
    there whatever layout it runs with; a merged (or blank) state is a base already."""
    found = as_state(state)
    base, first = found.remaining, found.carry_from
    assert first is not None, "a carry state's"
    if not found.is_slot or first > found.epoch:
        return base.to_list(), first
    assert found.num_slots is not None and found.length is not None  # a carry slot state's
    unit = found.num_slots * found.multiple_of
    return carry_after(base, first, found.epoch, found.length, unit).to_list(), found.epoch + 1


def _rebased(base: tuple[list, int], epoch: int, length: int, unit: int) -> list | None:
    """``base`` as it opens ``epoch`` (``None`` if it opens a later epoch)."""
    pairs, first = base
    if first > epoch:
        return None
    remaining = Remaining((a, b) for a, b in pairs)
    lo, _ = carry_window(remaining, first, epoch, length, unit)
    return remaining.compose(Remaining([(lo, None)])).to_list()


def check_carry_load(state: State | Mapping[str, Any], base: tuple[list, int] | None, in_worker: bool) -> None:
    """Refuse a carry slot state loaded in a DataLoader worker whose base is not the
    one the pipe brought from the main process.

    A worker's pipe is a copy: what it learns from a state is gone when the next
    epoch's workers are copied from the main process again. The epochs' boundaries
    after an elastic resume live in the base (no later epoch can find them from its
    number alone), so such a load would make a later epoch skip or repeat up to a
    round of elements: raise before anything is yielded instead."""
    found = as_state(state)
    if not in_worker or not found.is_carry or not found.is_slot:
        return
    assert found.num_slots is not None and found.length is not None  # a carry slot state's
    unit = found.num_slots * found.multiple_of
    after = carry_base_after(found)  # where the epochs after the state's go on from
    theirs = _rebased(after, after[1], found.length, unit)
    ours = _rebased(base or FRESH_CARRY, after[1], found.length, unit)
    if theirs != ours:
        raise UnsupportedError(
            "this even='carry' state comes from a run whose epoch boundaries an elastic resume moved, and it is "
            "loaded in a DataLoader worker, whose copy of the pipeline forgets them when the next epoch's workers "
            "start: later epochs would skip or repeat elements. Load the same state into the pipeline in the "
            "main process too (StatefulPipeline.load_state_dict(state) before loader.load_state_dict(state)), "
            "or merge every rank's states (distshard.merge_states / gather_states) and load the merged state "
            "into the pipeline"
        )
