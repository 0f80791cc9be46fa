"""The merge that makes elastic resume possible: the states of *all* slots of a run
become one slot-agnostic state, what is left of the epoch, which any number of ranks
and workers can load and split afresh (``even="carry"``: the base the run leaves).

In parts: the run every state shares (``_same_run``), how it split (``_RunOf``),
every slot once (``_every_slot_once``), what it leaves (``_epoch_left``,
``_carry_left``, each asking the run's layout). The state format and its checks are
``state.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Sequence

from .errors import OptionError, StateMismatchError
from .layouts import Layout, invalid_state
from .plan import CARRY, Even, Remaining, carry_left, slot_count
from .state import State, find_typed_states, is_whole_files

__all__ = ["merge", "merge_items", "merge_states", "replicas_once"]


def merge_states(states: Iterable[object]) -> dict[str, Any]:
    """Merge the states of *all* slots of a run into one slot-agnostic state.

    Pass what every rank saved (pipeline or StatefulDataLoader states; nested
    lists and dicts are searched). The result describes what is left of the epoch
    and can be loaded by a run with any number of ranks and workers: that run
    splits the remainder exactly once among its slots. Raises ``ValueError`` if a
    slot is missing or appears twice, or the states come from different epochs,
    seeds or pipelines, or claim more than their share.

    Under ``mesh=`` / ``group=`` the model-parallel peers of a data rank report the
    same copies: their identical states count once, and peers whose states differ
    (they consumed different counts) raise, naming them (``states[i]``: the i-th
    item passed).
    """
    return merge_items(list(states), lambda index: f"states[{index}]").to_dict()


def merge_items(items: Sequence[object], owner: Callable[[int], str]) -> State:
    """:func:`merge` of the states found in each of ``items`` (what one rank saved),
    ``owner(i)`` naming where item ``i`` came from."""
    found: list[State] = []
    owners: list[str] = []
    for index, item in enumerate(items):
        typed = find_typed_states(item)
        found += typed
        owners += [owner(index)] * len(typed)
    return merge(found, owners)


def merge(found: list[State], owners: list[str] | None = None) -> State:
    """:func:`merge_states` of states already found and typed; ``owners`` names
    where each came from (a rank), for the refusal of peers that disagree."""
    if not found:
        raise OptionError("merge_states found no distshard state in what was given")
    found = replicas_once(found, owners or [f"state {i}" for i in range(len(found))])
    first = replace(_same_run(found), replica=None)
    sized = [s for s in found if s.is_slot]
    if not sized:  # only merged/fresh states: nothing to combine
        return first
    run = _RunOf.agreed(sized)
    taken, absent = _every_slot_once(sized, len(found) - len(sized), run.num_slots)
    merged = replace(
        first, even=run.even, layout=None, num_slots=None, slot=None, taken=0, multiple_of=run.multiple, workers=None
    )
    if run.even == CARRY:
        return _carry_left(merged, run, taken)
    if not absent and all(s.finished for s in sized):
        return replace(merged, remaining=Remaining([]), total=0, finished=True)
    return _epoch_left(merged, run, taken)


_OPTIONAL = ("seed", "total", "length", "source", "shuffle")  # states that do not know them yet say None


def _wire(state: State, key: str) -> Any:
    """``key``'s value as the wire format writes it (what a disagreement names)."""
    value = getattr(state, key)
    return value.to_list() if isinstance(value, Remaining) else getattr(value, "name", value)


def _agree(found: list[State], key: str, optional: bool) -> Any:
    """The value every state has for ``key`` (``optional``: ignoring ``None``)."""
    values = {repr(_wire(s, key)) for s in found if not (optional and getattr(s, key) is None)}
    if len(values) > 1:
        raise StateMismatchError(
            f"states disagree on {key} ({', '.join(sorted(values))}): they come from "
            "different epochs, runs or pipelines; merge the states all slots saved at one step"
        )
    return next((getattr(s, key) for s in found if getattr(s, key) is not None), None)


def _same_run(found: list[State]) -> State:
    """The first state with what every state must share (their epoch, data, seed and
    what is left of the epoch before the run): states of one run of one pipeline."""
    keys = ("epoch", "mode", "remaining", "seed", "total", "length", "source", "shuffle")
    common = {key: _agree(found, key, optional=key in _OPTIONAL) for key in keys}
    if len({s.is_carry for s in found}) > 1:
        raise StateMismatchError(
            "some states come from a run with even='carry' and others not: they count positions "
            "differently (through the epochs or within one) and cannot be merged"
        )
    common["carry_from"] = _agree(found, "carry_from", False)
    return replace(found[0], **common, whole_files=is_whole_files(common["source"]))


@dataclass(frozen=True)
class _RunOf:
    """How the run the slot states come from split: only slots that ran know it."""

    even: Even
    layout: Layout
    multiple: int
    workers: int | None
    num_slots: int

    @classmethod
    def agreed(cls, sized: list[State]) -> "_RunOf":
        even, layout = _agree(sized, "even", False), _agree(sized, "layout", False)
        multiple, workers = _agree(sized, "multiple_of", False), _agree(sized, "workers", True)
        num_slots = sized[0].num_slots
        assert num_slots is not None  # a slot's state
        if any(s.num_slots != num_slots for s in sized):
            raise StateMismatchError(
                f"states come from runs with different slot counts: {sorted({s.num_slots or 0 for s in sized})}"
            )
        return cls(even, layout, multiple, workers, num_slots)


def replicas_once(found: list[State], owners: list[str]) -> list[State]:
    """``found`` with the states of every copy of a data group (``State.replica``)
    once: model-parallel peers report the same copies, with identical states; peers
    whose states differ raise ``StateMismatchError`` naming them (``owners[i]`` says
    where ``found[i]`` came from)."""
    kept: list[State] = []
    first: dict[tuple[int, int], tuple[State, str]] = {}
    for state, owner in zip(found, owners, strict=True):
        if state.replica is None:
            kept.append(state)
            continue
        seen = first.setdefault(state.replica, (state, owner))
        if seen[0] is state:
            kept.append(state)
        elif seen[0] != state:
            raise _peers_disagree(seen, (state, owner))
    return kept


def _peers_disagree(a: tuple[State, str], b: tuple[State, str]) -> StateMismatchError:
    (one, who), (other, whom) = a, b
    assert one.replica is not None  # a data group's copy
    wire, theirs = one.to_dict(), other.to_dict()
    differ = ", ".join(f"{k}: {wire.get(k)!r} vs {theirs.get(k)!r}" for k in wire if wire.get(k) != theirs.get(k))
    return StateMismatchError(
        f"model-parallel peers disagree: {who} and {whom} are the same data copy (slot {one.replica[0]} of "
        f"{one.replica[1]}) but saved different states ({differ}): peers must read the same batches and "
        "checkpoint at the same step; take every rank's state after the same number of steps"
    )


def _every_slot_once(sized: list[State], blank: int, num_slots: int) -> tuple[list[int], list[int]]:
    """Every slot's count of yielded elements, and the slots without a state; ``blank``
    states (slots that consumed nothing yet, no slot known) stand for those."""
    by_slot: dict[int, State] = {}
    for s in sized:
        assert s.slot is not None  # a slot's state
        if s.slot in by_slot:
            raise StateMismatchError(
                f"slot {s.slot} appears twice; pass one state per slot (model-parallel peers that read the "
                "same slot: build the pipe with dist_shard(mesh=...) or group=..., whose peers' identical "
                "states count once)"
            )
        by_slot[s.slot] = s
    absent = [slot for slot in range(num_slots) if slot not in by_slot]
    if len(absent) > blank:
        raise StateMismatchError(
            f"states of slots {absent} of {num_slots} are missing; every rank's every worker "
            "must contribute (gather them with all_gather_object or save one file per rank)"
        )
    if len(absent) < blank:
        raise StateMismatchError(f"{len(sized) + blank} states for {num_slots} slots: some appear twice")
    return [by_slot[slot].taken if slot in by_slot else 0 for slot in range(num_slots)], absent


def _carry_left(merged: State, run: _RunOf, taken: list[int]) -> State:
    """Under ``even="carry"``: the base the run leaves (``plan.carry_left``)."""
    workers, num_slots = run.workers, run.num_slots
    if workers is None or num_slots % workers:
        raise invalid_state(f"workers={workers} does not divide num_slots={num_slots}")
    assert merged.carry_from is not None and merged.length is not None  # a carry slot state's

    def left_after(taken: Any, count: int) -> Remaining:
        return run.layout.left_after(taken, num_slots, workers, count, "drop", run.multiple)

    base, opens, finished = carry_left(
        merged.remaining,
        merged.carry_from,
        merged.epoch,
        merged.length,
        left_after,
        taken,
        num_slots // workers,
        workers,
        run.multiple,
    )
    return replace(merged, remaining=base, carry_from=opens, total=None, finished=finished)


def _epoch_left(merged: State, run: _RunOf, taken: list[int]) -> State:
    """What the run leaves of the epoch: its layout's leftover, within what the run split."""
    refusal = run.layout.refuse_merge(merged.whole_files)
    if refusal is not None:
        raise refusal
    count = merged.total
    if count is not None:
        for slot, took in enumerate(taken):
            share = slot_count(slot, run.num_slots, count, run.even, run.multiple)
            if took > share:
                raise StateMismatchError(
                    f"slot {slot}'s state says it yielded {took} elements, but its share of the {count} "
                    f"positions its run split is {share}: the state was altered or comes from another run"
                )
    outer = merged.remaining
    inner = run.layout.left_after(taken, run.num_slots, run.workers, count, run.even, run.multiple)
    left = outer.compose(inner)
    if count is not None:
        left = left.clip(outer.index(count - 1) + 1) if count else Remaining([])
    return replace(merged, remaining=left, total=left.length(), finished=False)
