"""Checkpoint state of ``dist_shard``: its format, validation, and the merge that
makes elastic resume possible.

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
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from .plan import (
    EVEN_MODES,
    Remaining,
    left_after_blocks,
    left_after_chunks,
    left_after_round_robin,
    slot_count,
)

VERSION = 2
KEY = "distshard"  # the marker (and version) key of a slot or merged state
MODES = ("element", "units", "sized_units")  # what the positions are
LAYOUTS = ("stride", "blocks", "units", "chunks")  # how a run laid its positions out over slots

__all__ = ["VERSION", "check_fits", "check_slot", "fresh_state", "validate_state", "merge_states", "find_states"]


def fresh_state(epoch: int, mode: str, even: Any) -> dict[str, Any]:
    """The state of an epoch nobody has consumed anything of yet."""
    return {
        KEY: VERSION, "epoch": epoch, "seed": None, "mode": mode, "even": even,
        "layout": None, "shuffle": None, "length": None, "source": None, "multiple_of": 1, "workers": None,
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
    if state[KEY] != VERSION or isinstance(state[KEY], bool):
        older = " (an older distshard's state records too little to check it against the data)" \
            if state[KEY] == 1 else ""
        raise _fail(f"version {state[KEY]!r} is not {VERSION}, the one this distshard reads{older}")
    missing = [k for k in fresh_state(0, "element", None) if k not in state]
    if missing:
        raise _fail(f"missing keys {missing}")
    _int(state, "epoch")
    _int(state, "seed", optional=True)
    _int(state, "total", optional=True)
    _int(state, "taken")
    _int(state, "length", optional=True)
    _int(state, "multiple_of", minimum=1)
    _int(state, "workers", minimum=1, optional=True)
    if state["layout"] == "chunks" and state["workers"] is None:
        raise _fail("a state in chunk layout must say how many workers its run had")
    if state["layout"] is not None and state["layout"] not in LAYOUTS:
        raise _fail(f"layout={state['layout']!r} is not one of {LAYOUTS}")
    if state["shuffle"] is not None and not isinstance(state["shuffle"], bool):
        raise _fail(f"shuffle={state['shuffle']!r} must be True, False or None")
    if state["source"] is not None and not isinstance(state["source"], str):
        raise _fail(f"source={state['source']!r} must be a string or None")
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
    if slot is not None and state["layout"] is None:
        raise _fail("a slot's state must say its layout")
    out = dict(state)
    out["remaining"] = intervals.to_list()
    return out


def check_fits(found: Mapping[str, Any], *, mode: str, shuffle: bool, even: Any, multiple_of: int,
               seed: int | None, length: int | None = None, source: str | None = None,
               what: str = "dist_shard") -> None:
    """Raise ``ValueError`` if the validated state ``found`` does not come from a
    pipeline with these options (``length`` and ``source``, the reader's, when known).

    What a slot's state records of its own run (``even``, ``multiple_of``) is checked
    only for slot states: a merged state starts a new run with the loader's options."""
    def refuse(key: str, theirs: Any, ours: Any) -> ValueError:
        return ValueError(
            f"the state was saved with {key}={theirs!r} but this {what} has {key}={ours!r}: "
            "it comes from another pipeline or other data; load it into the pipeline that saved it"
        )

    if found["mode"] != mode:
        raise refuse("mode", found["mode"], mode)
    if found["shuffle"] is not None and found["shuffle"] != shuffle:
        raise refuse("shuffle", found["shuffle"], shuffle)
    if found["slot"] is not None and found["even"] != even:
        raise refuse("even", found["even"], even)
    if found["slot"] is not None and found["multiple_of"] != multiple_of:
        raise refuse("multiple_of", found["multiple_of"], multiple_of)
    if seed is not None and found["seed"] is not None and found["seed"] != seed:
        raise refuse("seed", found["seed"], seed)
    if found["length"] is not None and length is not None and found["length"] != length:
        raise ValueError(
            f"the state's epoch had {found['length']} elements, this pipeline's has {length}: the data "
            "changed since the checkpoint (or it comes from another pipeline); it cannot be resumed"
        )
    if found["source"] is not None and source is not None and found["source"] != source:
        raise ValueError(f"{refuse('source', found['source'], source)}{_difference(found['source'], source)}")
    if length is not None:
        for start, stop in found["remaining"]:
            end = stop if stop is not None else start
            if end > length:
                raise ValueError(
                    f"the state's remaining positions reach {end}, beyond this epoch's {length} "
                    "elements: it comes from other data or was altered"
                )


def _difference(theirs: str, ours: str) -> str:
    """Where two identities first differ, as `` (the state's seed=1, this pipeline's
    seed=2)``: identities are space-separated ``key=value`` parts (mixes record
    their seed, weights, phases and costs that way)."""
    for a, b in zip(theirs.split(), ours.split()):
        if a != b:
            return f" (the state's {a}, this pipeline's {b})"
    return ""


def check_slot(found: Mapping[str, Any], slot: int, num_slots: int, where: str) -> None:
    """Raise ``ValueError`` if ``found`` is another slot's state (``where`` describes
    this copy: rank and worker)."""
    if found["slot"] is not None and (found["slot"], found["num_slots"]) != (slot, num_slots):
        raise ValueError(
            f"the loaded state is slot {found['slot']} of {found['num_slots']}'s, but this copy is slot "
            f"{slot} of {num_slots} ({where}); to resume with other ranks or workers, merge the states "
            "of all slots with distshard.merge_states() and load that"
        )


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


def _agree(found: list[dict[str, Any]], key: str, optional: bool) -> Any:
    """The value every state has for ``key`` (``optional``: ignoring ``None``)."""
    values = {repr(s[key]) for s in found if not (optional and s[key] is None)}
    if len(values) > 1:
        raise ValueError(
            f"states disagree on {key} ({', '.join(sorted(values))}): they come from "
            "different epochs, runs or pipelines; merge the states all slots saved at one step"
        )
    return next((s[key] for s in found if s[key] is not None), None)


def merge_states(states: Iterable[object]) -> dict[str, Any]:
    """Merge the states of *all* slots of a run into one slot-agnostic state.

    Pass what every rank saved (pipeline or StatefulDataLoader states; nested
    lists and dicts are searched). The result describes what is left of the epoch
    and can be loaded by a run with any number of ranks and workers: that run
    splits the remainder exactly once among its slots. Raises ``ValueError`` if a
    slot is missing or appears twice, or the states come from different epochs,
    seeds or pipelines, or claim more than their share.
    """
    found = find_states(list(states))
    if not found:
        raise ValueError("merge_states found no distshard state in what was given")
    common = {key: _agree(found, key, optional=key in ("seed", "total", "length", "source", "shuffle"))
              for key in ("epoch", "mode", "remaining", "seed", "total", "length", "source", "shuffle")}
    sized = [s for s in found if s["slot"] is not None]
    blank = len(found) - len(sized)  # states of slots that consumed nothing yet (no slot known)
    first = dict(found[0], **common)
    if not sized:  # only merged/fresh states: nothing to combine
        return first
    # only slots that ran know how they split and what even they used
    even, layout = _agree(sized, "even", False), _agree(sized, "layout", False)
    multiple = _agree(sized, "multiple_of", False)
    workers = _agree(sized, "workers", True)
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
    merged = dict(first, even=even, layout=None, num_slots=None, slot=None, taken=0, multiple_of=multiple,
                  workers=None)
    if all(s["finished"] for s in by_slot.values()) and not absent:
        merged.update(remaining=[], total=0, finished=True)
        return merged
    if layout == "units":
        raise ValueError(
            "elastic resume in unit mode needs sizes= (without them nobody knows where a "
            "slot's elements sit); resume with the same ranks and workers, or pass sizes="
        )
    taken = [by_slot[slot]["taken"] if slot in by_slot else 0 for slot in range(num_slots)]
    count = common["total"]
    if count is not None:
        for slot, took in enumerate(taken):
            share = slot_count(slot, num_slots, count, even, multiple)
            if took > share:
                raise ValueError(
                    f"slot {slot}'s state says it yielded {took} elements, but its share of the {count} "
                    f"positions its run split is {share}: the state was altered or comes from another run"
                )
    outer = Remaining((a, b) for a, b in common["remaining"])
    if layout == "blocks":
        if count is None:
            raise _fail("a state in block layout must record total")
        inner = left_after_blocks(taken, num_slots, count, even, multiple)
    elif layout == "chunks":
        if workers is None or num_slots % workers:
            raise _fail(f"workers={workers} does not divide num_slots={num_slots}")
        inner = left_after_chunks(taken, num_slots // workers, workers, count, multiple)
    else:
        inner = left_after_round_robin(taken, num_slots)
    left = outer.compose(inner)
    if count is not None:
        left = left.clip(outer.index(count - 1) + 1) if count else Remaining([])
    merged.update(remaining=left.to_list(), total=left.length(), finished=False)
    return merged
