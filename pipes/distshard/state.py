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

Under ``even="carry"`` the epochs form one stream, and a state's ``remaining`` is a
*base* in global positions (``epoch * N + position``, see ``plan.py``) that opens the
epoch ``carry_from``: the part of the concatenated stream not consumed yet, ending in
an open interval. Everything else is as above; ``carry_from`` is ``None`` for the
other modes, so a state of a carry run and one of another run never fit each other.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from .plan import (
    ALL_EVEN_MODES,
    CARRY,
    Remaining,
    carry_after,
    carry_left,
    carry_window,
    left_after_blocks,
    left_after_chunks,
    left_after_round_robin,
    slot_count,
)

VERSION = 3  # 3: carry_from (even="carry")
KEY = "distshard"  # the marker (and version) key of a slot or merged state
# how the source identity of whole files (compressed, each streamed to one slot) begins:
# their states cannot be merged for another layout
WHOLE_FILES_SOURCE = "files:"
MODES = ("element", "units", "sized_units")  # what the positions are
LAYOUTS = ("stride", "blocks", "units", "chunks")  # how a run laid its positions out over slots

__all__ = [
    "VERSION",
    "carry_base_after",
    "check_carry_load",
    "check_fits",
    "check_slot",
    "fresh_state",
    "validate_state",
    "merge_states",
    "find_states",
]

FRESH_CARRY: tuple[list, int] = ([[0, None]], 0)  # the base of a carry pipe no state moved: epoch 0 at 0


def fresh_state(epoch: int, mode: str, even: Any, carry: tuple[list, int] | None = None) -> dict[str, Any]:
    """The state of an epoch nobody has consumed anything of yet; under ``even="carry"``
    with the base (``remaining``, ``carry_from``) the pipe counts from (``carry``)."""
    if even != CARRY:
        base, first = [[0, None]], None
    else:  # a base opening a later epoch does not apply to this one
        base, first = carry if carry is not None and carry[1] <= epoch else FRESH_CARRY
    return {
        KEY: VERSION,
        "epoch": epoch,
        "seed": None,
        "mode": mode,
        "even": even,
        "layout": None,
        "shuffle": None,
        "length": None,
        "source": None,
        "multiple_of": 1,
        "workers": None,
        "remaining": [list(pair) for pair in base],
        "total": None,
        "num_slots": None,
        "slot": None,
        "taken": 0,
        "finished": False,
        "carry_from": first,
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
        older = (
            " (an older distshard's state records too little to check it against the data)" if state[KEY] == 1 else ""
        )
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
    if state["even"] not in ALL_EVEN_MODES:
        raise _fail(f"even={state['even']!r} is not one of {ALL_EVEN_MODES}")
    if not isinstance(state["finished"], bool):
        raise _fail(f"finished={state['finished']!r} must be True or False")
    remaining = state["remaining"]
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
    try:
        intervals = Remaining((a, b) for a, b in remaining)
    except ValueError as exc:
        raise _fail(f"remaining: {exc}") from None
    if slot is None and state["taken"]:
        raise _fail("a merged state (no slot) must have taken=0")
    if slot is not None and state["layout"] is None:
        raise _fail("a slot's state must say its layout")
    if (state["even"] == CARRY) != (state["carry_from"] is not None):
        raise _fail(f"carry_from={state['carry_from']!r} must be an int with even='carry' and None otherwise")
    if state["even"] == CARRY:
        _check_carry(state, intervals)
    out = dict(state)
    out["remaining"] = intervals.to_list()
    return out


def _check_carry(state: Mapping, base: Remaining) -> None:
    """A carry state's base: open-ended, opening an epoch no later than the one after
    the state's, never past the end of that epoch's own stream."""
    first = _int(state, "carry_from")
    assert first is not None  # not optional
    if first > state["epoch"] + 1:
        raise _fail(f"carry_from={first} is after the epoch after the state's ({state['epoch']})")
    if not base.intervals or base.intervals[-1][1] is not None:
        raise _fail("under even='carry' remaining must end in an open interval [start, None]")
    if state["layout"] == "units":
        raise _fail("even='carry' has no units layout")
    if state["slot"] is not None and state["length"] is None:
        raise _fail("a carry slot state must record its epoch's length")
    if state["length"] is not None and base.intervals[-1][0] > (first + 1) * state["length"]:
        raise _fail(
            f"remaining starts its open end at {base.intervals[-1][0]}, past the end of epoch {first}'s "
            f"stream ({(first + 1) * state['length']}): it was altered or comes from other data"
        )


def check_fits(
    found: Mapping[str, Any],
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
    if (found["even"] == CARRY) != (even == CARRY):  # one stream of epochs or each epoch to itself
        raise ValueError(
            f"the state was saved with even={found['even']!r} but this {what} has even={even!r}: under "
            "even='carry' positions count through the epochs as one stream, otherwise within each epoch, so "
            "neither state means anything to the other; load it into a pipeline with the even it was saved with"
        )
    if found["shuffle"] is not None and found["shuffle"] != shuffle:
        raise refuse("shuffle", found["shuffle"], shuffle)
    if found["slot"] is not None and found["even"] != even:
        raise refuse("even", found["even"], even)
    if found["slot"] is not None and found["multiple_of"] != multiple_of:
        raise refuse("multiple_of", found["multiple_of"], multiple_of)
    if seed is not None and found["seed"] is not None and found["seed"] != seed:
        if even == CARRY:  # the next epoch reads this epoch's tail in this seed's order
            raise ValueError(
                f"the state was saved with seed={found['seed']!r} but this {what} orders its epochs with "
                f"seed={seed!r} (under even='carry' seed=None means 0): every epoch's order, its tail "
                f"read in the next epoch included, must come from one seed; pass seed={found['seed']!r} "
                "to resume it"
            )
        raise refuse("seed", found["seed"], seed)
    if found["length"] is not None and length is not None and found["length"] != length:
        raise ValueError(
            f"the state's epoch had {found['length']} elements, this pipeline's has {length}: the data "
            "changed since the checkpoint (or it comes from another pipeline); it cannot be resumed"
        )
    if found["source"] is not None and source is not None and found["source"] != source:
        raise ValueError(f"{refuse('source', found['source'], source)}{_difference(found['source'], source)}")
    if length is not None and found["even"] == CARRY:
        first, start = found["carry_from"], found["remaining"][-1][0]
        if start > (first + 1) * length:
            raise ValueError(
                f"the state's remaining positions open at {start}, beyond the end of epoch {first}'s stream "
                f"({(first + 1) * length}) with {length} elements an epoch: it comes from other data or was altered"
            )
    elif length is not None:
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
    for a, b in zip(theirs.split(), ours.split(), strict=False):
        if a != b:
            return f" (the state's {a}, this pipeline's {b})"
    return ""


def check_slot(found: Mapping[str, Any], slot: int, num_slots: int, where: str) -> None:
    """Raise ``ValueError`` if ``found`` is another slot's state (``where`` describes
    this copy: rank and worker)."""
    if found["slot"] is not None and (found["slot"], found["num_slots"]) != (slot, num_slots):
        if found["num_slots"] == num_slots:  # same ranks and workers: another rank's (or worker's) state
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
        raise ValueError(
            f"the loaded state is slot {found['slot']} of {found['num_slots']}'s, but this copy is slot "
            f"{slot} of {num_slots} ({where}); {fix}"
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
    common = {
        key: _agree(found, key, optional=key in ("seed", "total", "length", "source", "shuffle"))
        for key in ("epoch", "mode", "remaining", "seed", "total", "length", "source", "shuffle")
    }
    if len({s["even"] == CARRY for s in found}) > 1:
        raise ValueError(
            "some states come from a run with even='carry' and others not: they count positions "
            "differently (through the epochs or within one) and cannot be merged"
        )
    common["carry_from"] = _agree(found, "carry_from", False)
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
        raise ValueError(f"states come from runs with different slot counts: {sorted({s['num_slots'] for s in sized})}")
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
    merged = dict(first, even=even, layout=None, num_slots=None, slot=None, taken=0, multiple_of=multiple, workers=None)
    if even == CARRY:
        if workers is None or num_slots % workers:
            raise _fail(f"workers={workers} does not divide num_slots={num_slots}")
        taken = [by_slot[slot]["taken"] if slot in by_slot else 0 for slot in range(num_slots)]
        base, opens, finished = carry_left(
            Remaining((a, b) for a, b in common["remaining"]),
            common["carry_from"],
            common["epoch"],
            common["length"],
            layout,
            taken,
            num_slots // workers,
            workers,
            multiple,
        )
        merged.update(remaining=base.to_list(), carry_from=opens, total=None, finished=finished)
        return merged
    if all(s["finished"] for s in by_slot.values()) and not absent:
        merged.update(remaining=[], total=0, finished=True)
        return merged
    if layout == "units":
        if str(common.get("source") or "").startswith(WHOLE_FILES_SOURCE):
            raise ValueError(
                "elastic resume over compressed files cannot be done: a slot's samples are known only by "
                "decompressing its files; resume with the same ranks and workers, or decompress the files"
            )
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


# -- carry: the base a pipe keeps from one epoch to the next ------------------------------------


def carry_base_after(found: Mapping[str, Any]) -> tuple[list, int]:
    """The base (``remaining``, ``carry_from``) that the epochs after ``found``'s go on
    from: a slot's state moves it to where its run ends, so the next epoch starts
    there whatever layout it runs with; a merged (or blank) state is a base already."""
    base, first = Remaining((a, b) for a, b in found["remaining"]), found["carry_from"]
    if found["slot"] is None or first > found["epoch"]:
        return base.to_list(), first
    unit = found["num_slots"] * found["multiple_of"]
    return carry_after(base, first, found["epoch"], found["length"], unit).to_list(), found["epoch"] + 1


def _rebased(base: tuple[list, int], epoch: int, length: int, unit: int) -> list | None:
    """``base`` as it opens ``epoch`` (``None`` if it opens a later epoch)."""
    pairs, first = base
    if first > epoch:
        return None
    remaining = Remaining((a, b) for a, b in pairs)
    lo, _ = carry_window(remaining, first, epoch, length, unit)
    return remaining.compose(Remaining([(lo, None)])).to_list()


def check_carry_load(found: Mapping[str, Any], base: tuple[list, int] | None, in_worker: bool) -> None:
    """Refuse a carry slot state loaded in a DataLoader worker whose base is not the
    one the pipe brought from the main process.

    A worker's pipe is a copy: what it learns from a state is gone when the next
    epoch's workers are copied from the main process again. The epochs' boundaries
    after an elastic resume live in the base (no later epoch can find them from its
    number alone), so such a load would make a later epoch skip or repeat up to a
    round of elements: raise before anything is yielded instead."""
    if not in_worker or found["even"] != CARRY or found["slot"] is None:
        return
    unit = found["num_slots"] * found["multiple_of"]
    after = carry_base_after(found)  # where the epochs after the state's go on from
    theirs = _rebased(after, after[1], found["length"], unit)
    ours = _rebased(base or FRESH_CARRY, after[1], found["length"], unit)
    if theirs != ours:
        raise ValueError(
            "this even='carry' state comes from a run whose epoch boundaries an elastic resume moved, and it is "
            "loaded in a DataLoader worker, whose copy of the pipeline forgets them when the next epoch's workers "
            "start: later epochs would skip or repeat elements. Load the same state into the pipeline in the "
            "main process too (StatefulPipeline.load_state_dict(state) before loader.load_state_dict(state)), "
            "or merge every rank's states (distshard.merge_states / gather_states) and load the merged state "
            "into the pipeline"
        )
