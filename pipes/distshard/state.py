"""Checkpoint state of ``dist_shard``: its format, validation, and the merge that
makes elastic resume possible.

A *slot state* is what one copy of the pipeline (one rank's DataLoader worker)
reports: the epoch and seed it runs, the part of the epoch its run splits
(``remaining``), and how many elements it yielded of its share (``taken``). A
*merged state* has no slot: it is the part of the epoch nobody consumed yet, and
any number of ranks and workers can load it and split it afresh. Everything is
plain JSON (ints, strings, lists, ``None``), with a version number.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from .plan import EVEN_MODES, Remaining, left_after_blocks, left_after_round_robin

VERSION = 1
KEY = "distshard"  # the marker (and version) key of a slot or merged state
MODES = ("element", "units", "sized_units")  # how positions are laid out over slots

__all__ = ["VERSION", "fresh_state", "validate_state", "merge_states", "find_states"]


def fresh_state(epoch: int, mode: str, even: Any) -> dict[str, Any]:
    """The state of an epoch nobody has consumed anything of yet."""
    return {
        KEY: VERSION, "epoch": epoch, "seed": None, "mode": mode, "even": even,
        "remaining": [[0, None]], "total": None, "num_slots": None, "slot": None,
        "taken": 0, "finished": False,
    }


def _fail(why: str) -> ValueError:
    return ValueError(f"not a valid distshard state: {why}")


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
    if not isinstance(state, Mapping):
        raise _fail(f"expected a dict, got {type(state).__name__}")
    if KEY not in state:
        raise _fail(
            f"no {KEY!r} key (got keys {sorted(map(str, state))[:8]}); pass what "
            "dist_shard's state_dict(), StatefulPipeline.state_dict() or merge_states() returned"
        )
    if state[KEY] != VERSION:
        raise _fail(f"version {state[KEY]!r} is not {VERSION}, the one this distshard reads")
    missing = [k for k in fresh_state(0, "element", None) if k not in state]
    if missing:
        raise _fail(f"missing keys {missing}")
    _int(state, "epoch")
    _int(state, "seed", optional=True)
    _int(state, "total", optional=True)
    _int(state, "taken")
    num_slots = _int(state, "num_slots", minimum=1, optional=True)
    slot = _int(state, "slot", optional=True)
    if (num_slots is None) != (slot is None):
        raise _fail("num_slots and slot must both be set (a slot's state) or both None (merged)")
    if slot is not None and slot >= num_slots:  # type: ignore[operator]
        raise _fail(f"slot={slot} is outside [0, num_slots={num_slots})")
    if state["mode"] not in MODES:
        raise _fail(f"mode={state['mode']!r} is not one of {MODES}")
    if state["even"] not in EVEN_MODES:
        raise _fail(f"even={state['even']!r} is not one of {EVEN_MODES}")
    if not isinstance(state["finished"], bool):
        raise _fail(f"finished={state['finished']!r} must be True or False")
    remaining = state["remaining"]
    if not isinstance(remaining, list) or not all(
        isinstance(pair, (list, tuple)) and len(pair) == 2
        and all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in pair)
        and pair[0] is not None
        for pair in remaining
    ):
        raise _fail(f"remaining={remaining!r} must be a list of [start, stop] pairs of ints (stop may be None)")
    empty = [pair for pair in remaining if pair[1] is not None and pair[1] <= pair[0]]
    if empty:
        raise _fail(f"remaining has an empty or inverted interval {list(empty[0])}")
    try:
        intervals = Remaining((a, b) for a, b in remaining)
    except ValueError as exc:
        raise _fail(f"remaining: {exc}") from None
    if slot is None and state["taken"]:
        raise _fail("a merged state (no slot) must have taken=0")
    out = dict(state)
    out["remaining"] = intervals.to_list()
    return out


def find_states(obj: object) -> list[dict[str, Any]]:
    """Every distshard state inside ``obj``: a state itself, a ``StatefulPipeline``
    state, a ``StatefulDataLoader`` state (which nests one per worker), or lists and
    dicts of those, e.g. what every rank saved."""
    found: list[dict[str, Any]] = []

    def walk(value: object) -> None:
        if isinstance(value, Mapping):
            if KEY in value:
                found.append(validate_state(value))
                return
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(obj)
    return found


def merge_states(states: Iterable[object]) -> dict[str, Any]:
    """Merge the states of *all* slots of a run into one slot-agnostic state.

    Pass what every rank saved (pipeline or StatefulDataLoader states; nested
    lists and dicts are searched). The result describes what is left of the epoch
    and can be loaded by a run with any number of ranks and workers: that run
    splits the remainder exactly once among its slots. Raises ``ValueError`` if a
    slot is missing or appears twice, or the states come from different epochs,
    seeds or pipelines.
    """
    found = find_states(list(states))
    if not found:
        raise ValueError("merge_states found no distshard state in what it was given")
    first = found[0]
    for key in ("epoch", "mode", "even", "remaining", "seed", "total"):
        # a state taken before its slot yielded anything may not know seed and total yet
        values = {repr(s[key]) for s in found if s[key] is not None or key not in ("seed", "total")}
        if len(values) > 1:
            raise ValueError(
                f"states disagree on {key} ({', '.join(sorted(values))}): they come from "
                "different epochs, runs or pipelines; merge the states all slots saved at one step"
            )
    known = {key: next((s[key] for s in found if s[key] is not None), None) for key in ("seed", "total")}
    sized = [s for s in found if s["slot"] is not None]
    blank = len(found) - len(sized)  # states of slots that consumed nothing yet (no slot known)
    if not sized:  # only merged/fresh states: nothing to combine
        return dict(first, **known)
    num_slots = sized[0]["num_slots"]
    if any(s["num_slots"] != num_slots for s in sized):
        raise ValueError(f"states come from runs with different slot counts: "
                         f"{sorted({s['num_slots'] for s in sized})}")
    by_slot: dict[int, dict] = {}
    for s in sized:
        if s["slot"] in by_slot:
            raise ValueError(f"slot {s['slot']} appears twice; pass one state per slot")
        by_slot[s["slot"]] = s
    absent = [slot for slot in range(num_slots) if slot not in by_slot]
    if len(absent) > blank:
        raise ValueError(
            f"states of slots {absent} of {num_slots} are missing; every rank's every worker "
            "must contribute (gather them with all_gather_object or save one file per rank)"
        )
    if len(absent) < blank:
        raise ValueError(f"{len(found)} states for {num_slots} slots: some appear twice")
    for slot in absent:  # those consumed nothing
        by_slot[slot] = dict(first, slot=slot, num_slots=num_slots, taken=0, finished=False)
    first = dict(first, **known)
    merged = dict(first, num_slots=None, slot=None, taken=0)
    if all(s["finished"] for s in by_slot.values()):
        merged.update(remaining=[], total=0, finished=True)
        return merged
    if first["mode"] == "units":
        raise ValueError(
            "elastic resume in unit mode needs sizes= (without them nobody knows where a "
            "slot's elements sit); resume with the same ranks and workers, or pass sizes="
        )
    taken = [by_slot[slot]["taken"] for slot in range(num_slots)]
    outer = Remaining((a, b) for a, b in first["remaining"])
    if first["mode"] == "sized_units":
        inner = left_after_blocks(taken, num_slots, first["total"], first["even"])
    else:
        inner = left_after_round_robin(taken, num_slots)
    left = outer.compose(inner)
    if first["total"] is not None:
        left = left.clip(outer.index(first["total"] - 1) + 1) if first["total"] else Remaining([])
    merged.update(remaining=left.to_list(), total=left.length(), finished=False)
    return merged
