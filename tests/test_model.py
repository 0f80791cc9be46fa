"""Model-based test of the exactness promise: every path is exact, or refused loudly (docs/contract.md).

Hypothesis draws a pipeline (tests/model_factories.Spec) and a history of runs:
every run has its own layout (world size x workers) and loader, its slots consume
random amounts (nothing, everything, exactly their share without exhausting the
iterator, anything in between), then every slot checkpoints, the run is "killed"
(its pipes are dropped) and the next run resumes: from each slot's own state on
the same layout and loader, else from ``merge_states`` of all of them. A history
may cross an epoch end: the epoch's last checkpoint is loaded, then ``set_epoch``
starts the next epoch, which must be whole again.

The oracle knows nothing about the implementation, only the contract, per epoch:
the multiset of everything consumed over all its runs, against the epoch's
elements. A *split* is one layout dividing what was left: the first run of an
epoch, and every run that loaded a merged state, start one (and may pick another
``even``: "even holds for the new run's counts"); a resume from the slots' own
states continues it. With ``R`` the distinct elements not consumed when the
epoch's last split ``F`` started, ``S`` its slot count and ``even`` its mode:

* nothing outside the epoch; repeats only from ``"pad"`` splits, at most
  ``S' - 1`` for every such split ``S'`` in which some slot reached its end;
* ``even=None`` and ``"pad"``: nothing missing; ``"drop"``: exactly ``|R| % S``
  missing (the new run's own tail). If the split before ``F`` had reached the end
  of every share, the epoch was over, and ``F`` may also yield nothing (then
  ``|R|`` are missing);
* ``"drop"``: every slot of ``F`` yields ``|R| // S``; ``"pad"``: ``ceil(r / S)``,
  where ``r`` is ``|R|`` plus at most what earlier pads repeated (a pad may
  repeat an element its owner has not yielded yet, which stays to be consumed);
* with ``even``, every slot (every rank with real workers) of a split that
  reached the end of every share yielded the same count over that split.

Or the library refused with a clear error, of one of the kinds listed in
``REFUSALS`` (construction refusals must happen). Anything else fails.

Model-parallel meshes (``run_mesh_history``): every run on a random mesh (data ranks x
model-parallel peers x workers); the peers of a data slot must yield the same elements
(the oracle counts them once), a checkpoint goes through ``LoaderCheckpoint``'s
``pack`` / ``restore`` (exact on the same data world and workers, else merged) or
``merge_states`` of every rank's states, and a peer that took one more must be refused.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import Any, Callable, Sequence

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import distshard
from distshard.verify import run_on_group

from .helpers import as_worker
from .model_factories import PARQUET_PATHS, SOURCES, Spec, build, build_node, gloo_run, on_data_group, untag

# -- what the library may refuse, and must refuse --------------------------------------


@dataclass(frozen=True)
class Refusal:
    why: str
    stages: frozenset[str]  # see stage() below
    error: type
    message: str  # a regex the message must contain
    applies: Callable[[Spec], bool]


# The only refusals the contract documents (docs/contract.md, its "Refused" table). The
# construction ones are mandatory; the others may happen, but only at those stages.
REFUSALS = [
    # "shuffle=True (random-access sources and units with sizes)"
    Refusal(
        "shuffle=True without random access",
        frozenset({"construct"}),
        ValueError,
        r"shuffle=True",
        lambda s: s.shuffle and not s.random_access,
    ),
    # "with sizes ... enables even and shuffle=True in unit mode"
    Refusal(
        "even in unit mode without sizes",
        frozenset({"construct"}),
        ValueError,
        r"even=.*sizes=",
        lambda s: s.units and not s.sized and s.even is not None,
    ),
    # docs/files.md: over compressed files "`even=` and `shuffle=True` are refused"
    Refusal(
        "even over compressed files",
        frozenset({"construct"}),
        ValueError,
        r"needs random access.*compressed",
        lambda s: s.whole_files and s.even is not None,
    ),
    # docs/contract.md: elastic resume of whole compressed files
    Refusal(
        "elastic resume over compressed files",
        frozenset({"merge", "load-merged", "iterate-merged"}),
        ValueError,
        r"compressed files",
        lambda s: s.whole_files,
    ),
    # "every slot's state can be merged ... except unit mode without sizes"
    Refusal(
        "elastic resume in unit mode without sizes",
        frozenset({"merge", "load-merged", "iterate-merged"}),
        ValueError,
        r"sizes",
        lambda s: s.units and not s.sized,
    ),
    # units.py: shuffle=True reads single elements, so expand must return a sequence
    Refusal(
        "shuffle=True in unit mode with an iterator expand",
        frozenset({"iterate", "iterate-own", "iterate-merged"}),
        TypeError,
        r"not a sequence",
        lambda s: s.units and s.shuffle and not s.expand_list,
    ),
    # docs/checkpoint.md: StatefulDataLoader restarts by itself after a state saved at
    # an epoch's end, in workers that do not have the state (only loaders with workers)
    Refusal(
        "an epoch's end resumed in DataLoader workers, then the epoch again",
        frozenset({"iterate-own"}),
        RuntimeError,
        r"started after the one that resumed it",
        lambda s: True,
    ),
    # docs/usage.md "carry": "a stream (and units without sizes) is refused at construction"
    Refusal(
        "even='carry' without random access",
        frozenset({"construct"}),
        ValueError,
        r"even='carry'.*previous epoch",
        lambda s: s.even == "carry" and not s.random_access,
    ),
    # docs/usage.md "carry": "a worker refuses a slot's own state whose boundaries an elastic resume moved"
    Refusal(
        "a carry state with moved boundaries loaded in a worker",
        frozenset({"load-own", "iterate-own"}),
        ValueError,
        r"merge_states",
        lambda s: s.even == "carry",
    ),
    # docs/contract.md: "a file that changes during a job raises" (weak ETags compared, issue 21;
    # a stored index gone stale: If-Match answered 412, issue 22, naming the refresh command)
    Refusal(
        "a remote file rewritten during the job",
        frozenset({"iterate", "iterate-own", "iterate-merged", "late"}),
        ValueError,
        r"changed after it was indexed|changed after the stored index at .* refresh it with `python -m distshard index",
        lambda s: s.source in ("remote-weak", "remote-stale"),
    ),
]
CONSTRUCT = [r for r in REFUSALS if "construct" in r.stages]


class Refused(Exception):
    def __init__(self, stage: str, error: BaseException) -> None:
        super().__init__(f"{stage}: {type(error).__name__}: {error}")
        self.stage, self.error = stage, error


@contextlib.contextmanager
def stage(name: str):
    """Label a clear error (ValueError / TypeError / RuntimeError) with where it came from.

    Stages: construct, merge, load-own / load-merged, iterate / iterate-own /
    iterate-merged (the first element a pipe was asked for), late (a later
    element: never a documented refusal), checkpoint."""
    try:
        yield
    except (ValueError, TypeError, RuntimeError) as exc:
        raise Refused(name, exc) from exc


def assert_documented(spec: Spec, refused: Refused, log: Sequence[str] = ()) -> None:
    allowed = [
        r
        for r in REFUSALS
        if refused.stage in r.stages
        and r.applies(spec)
        and isinstance(refused.error, r.error)
        and re.search(r.message, str(refused.error))
    ]
    assert allowed, f"undocumented refusal for {spec}: {refused}\n" + "\n".join(log)


# -- the oracle ----------------------------------------------------------------------------


@dataclass
class Split:
    num_slots: int
    even: str | None
    left: int  # distinct elements not consumed when it started
    after_complete: bool  # the split before it reached the end of every share
    multiple: int = 1  # even="drop"'s multiple_of
    # pads an earlier "pad" split of the epoch may have yielded before their element's own
    # position: the element is seen, but its position is still to come, so the positions
    # really left are somewhere in [left, left + slack]
    slack: int = 0
    totals: Counter = field(default_factory=Counter)  # per unit (slot, or rank with workers)
    at_end: dict = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return bool(self.at_end) and all(self.at_end.values())


@dataclass
class Epoch:
    consumed: Counter = field(default_factory=Counter)
    splits: list[Split] = field(default_factory=list)

    def start_split(
        self, universe: Counter, num_slots: int, even: str | None, multiple: int = 1, left: int | None = None
    ) -> None:
        after = bool(self.splits) and self.splits[-1].complete
        left = len(set(universe) - set(self.consumed)) if left is None else left
        slack = sum(s.num_slots - 1 for s in self.splits if s.even == "pad" and any(s.at_end.values()))
        self.splits.append(Split(num_slots, even, left, after, multiple if even in ("drop", "carry") else 1, slack))

    def add(self, unit: int, elements: list, at_end: bool) -> None:
        self.consumed.update(elements)
        self.splits[-1].totals[unit] += len(elements)
        self.splits[-1].at_end[unit] = at_end


def drop_outcomes(last: Split) -> tuple[set[int], set[int]]:
    """What a last split under ``even="drop"`` may leave missing, and keep per slot.

    With ``r`` positions really left, every slot keeps ``r // S`` (rounded down to
    ``multiple_of``) and the other ``d`` are dropped. Without earlier pads
    (``slack == 0``) ``r`` is ``left`` and exactly ``d`` elements are never seen. An
    earlier ``"pad"`` split may have shown up to ``slack`` elements as pads before
    their own position: then ``r`` is up to ``left + slack``, and a dropped position
    whose element was already seen as a pad is not missing."""
    missing: set[int] = set()
    kept_per_slot: set[int] = set()
    for ahead in range(last.slack + 1):
        really_left = last.left + ahead
        kept = really_left // last.num_slots // last.multiple * last.multiple
        dropped = really_left - kept * last.num_slots
        missing.update(range(max(0, dropped - ahead), dropped + 1) if ahead else {dropped})
        kept_per_slot.add(kept)
    return missing, kept_per_slot


def check_epoch(universe: Counter, epoch: Epoch, where: str) -> None:
    consumed, last, even = epoch.consumed, epoch.splits[-1], epoch.splits[-1].even
    assert last.complete, where
    foreign = set(consumed) - set(universe)
    missing = sorted(universe - consumed)
    repeats = sum(count - 1 for count in consumed.values() if count > 1)
    repeated = sorted(k for k, count in consumed.items() if count > 1)
    shown = f"{where}: missing {missing[:8]} ({len(missing)}), repeated {repeated[:8]} ({repeats})"
    assert not foreign, f"{where}: foreign elements {sorted(foreign)[:8]}"
    padded = [s.num_slots - 1 for s in epoch.splits if s.even == "pad" and any(s.at_end.values())]
    assert repeats <= sum(padded), f"{shown}; expected at most {sum(padded)} repeats"
    allowed, kept_per_slot = drop_outcomes(last) if even == "drop" else ({0}, set())
    if last.after_complete:
        allowed.add(last.left)  # the epoch was over before F
    assert len(missing) in allowed, f"{shown}; expected {sorted(allowed)} missing"
    counts = set(last.totals.values())
    per_unit = last.num_slots // len(last.totals)  # slots per unit
    if even == "drop" and len(missing) != last.left:
        expected = {kept * per_unit for kept in kept_per_slot}
        assert len(counts) == 1 and counts <= expected, (
            f"{where}: the last split yielded {dict(last.totals)}, expected one of {sorted(expected)}"
        )
    if even == "pad" and not (last.after_complete and len(missing) == last.left):
        earlier = sum(padded) - (last.num_slots - 1 if any(last.at_end.values()) else 0)
        low, high = (-(-r // last.num_slots) * per_unit for r in (last.left, last.left + earlier))
        assert len(counts) == 1 and low <= counts.pop() <= high, (
            f"{where}: the last split yielded {dict(last.totals)}, expected {low}..{high} per unit"
        )
    for index, split in enumerate(epoch.splits):
        if split.even is not None and split.complete:
            assert len(set(split.totals.values())) == 1, (
                f"{where}: split {index} (even={split.even!r}) yielded unequal counts {dict(split.totals)}"
            )


# -- even="carry": the epochs as one stream ---------------------------------------------------


def check_carry_epoch(
    universe: Counter, epoch_index: int, epoch: Epoch, history: Counter, epoch_tags: bool, where: str
) -> None:
    """The contract of ``even="carry"`` at the end of epoch ``epoch_index``, from the
    whole history (``history``: every element consumed so far, as yielded):

    * every split that reached its end yielded the same count on every unit;
    * the last split took whole rounds (``U`` = its slots x multiple_of) of what was
      left of the epochs' one stream up to this epoch's end, and left less than a
      round: exactly ``left % U`` are still to come (or all ``left`` if the split
      before it had ended the epoch already);
    * nothing foreign, and nothing read twice: an element of a source whose elements
      say their epoch (``epoch_tags``) is consumed at most once, any other at most
      once an epoch, and never more than ``epoch_index + 1`` epochs' streams are touched.
    """
    last = epoch.splits[-1]
    assert last.complete, where
    n = sum(universe.values())
    unit = last.num_slots * last.multiple
    missing = (epoch_index + 1) * n - sum(history.values())
    allowed = {last.left % unit} | ({last.left} if last.after_complete else set())
    assert missing in allowed, f"{where}: {missing} of the epochs so far still to come, expected {sorted(allowed)}"
    per_unit = last.num_slots // len(last.totals)
    if missing == last.left % unit and not (last.after_complete and missing == last.left):
        expected = {last.left // unit * unit // last.num_slots * per_unit}
        assert set(last.totals.values()) == expected, (
            f"{where}: the last split yielded {dict(last.totals)}, expected {expected} per unit"
        )
    for index, split in enumerate(epoch.splits):
        if split.complete:
            assert len(set(split.totals.values())) == 1, (
                f"{where}: split {index} yielded unequal counts {dict(split.totals)}"
            )
    names: Counter = Counter()
    for element, count in history.items():
        names[untag(element)[0]] += count
    foreign = set(names) - set(universe)
    assert not foreign, f"{where}: foreign elements {sorted(foreign)[:8]}"
    over = sorted(k for k, c in names.items() if c > epoch_index + 1)
    assert not over, f"{where}: {over[:8]} consumed more often than there were epochs"
    if epoch_tags:
        twice = sorted(k for k, c in history.items() if c > 1 and untag(k)[1] is not None)
        assert not twice, f"{where}: {twice[:8]} consumed twice"
        tags = {untag(element)[1] for element in history} - {None}
        assert len(tags) <= epoch_index + 1, f"{where}: elements of {len(tags)} epochs' streams"


# -- running one unit (a slot, or a rank of a loader) ----------------------------------------

ALL = -1  # take until the iterator is exhausted


def jsonable(state):
    return json.loads(json.dumps(state))  # a checkpoint goes through a file


def consume(it, take: int, first_stage: str) -> tuple[list, bool]:
    """Take ``take`` elements (ALL: until exhausted); return them and whether the
    iterator was exhausted."""
    out: list = []
    while take == ALL or len(out) < take:
        try:
            with stage(first_stage if not out else "late"):
                element = next(it)
        except StopIteration:
            return out, True
        out.append(element)
    return out, False


def shutdown(it) -> None:
    """A killed run: stop its worker processes now, not at garbage collection."""
    stop = getattr(it, "_shutdown_workers", None)
    if stop is not None:
        stop()


@dataclass(frozen=True)
class Run:
    # "plain" (slots in-process), "sdl0" (StatefulDataLoader, no workers), "sdl2" (2 real
    # workers), "node" (DistShardNode); persistent workers (see PERSISTENT): "sdlp-fork",
    # "sdlp-spawn" (StatefulDataLoader over StatefulPipeline), "dlp-fork", "dlp-spawn"
    # (torch's DataLoader over the DataPipe itself: no checkpoint, so only an epoch's last run)
    kind: str
    world: int
    workers: int  # per rank; the units of a run are slots, except "sdl2": ranks
    resume: str | None  # None, "own" (each unit its own state) or "merged"
    epoch_first: bool  # set_epoch before loading the state (else after)

    @property
    def num_slots(self) -> int:
        return self.world * max(1, self.workers)

    @property
    def units(self) -> list[tuple[int, int]]:
        """(rank, worker_id) of every unit; worker_id -1 for a whole rank."""
        if self.kind in ("plain", "node"):
            return [(r, w) for r in range(self.world) for w in range(max(1, self.workers))]
        return [(r, -1) for r in range(self.world)]


def make_unit(spec: Spec, run: Run, rank: int, epoch: int, state) -> Callable[[], tuple]:
    """A factory of fresh (iterable, state_dict) for one unit of ``run``, its state
    loaded and its epoch set; called twice, for a dry run and the real one."""
    load_stage = f"load-{run.resume}"
    if run.kind in PERSISTENT:
        return PersistentUnit(spec, run, rank, epoch, state, load_stage)

    def fresh():
        if run.kind == "node":
            root = build_node(spec, rank, run.world)
            shard = root if isinstance(root, distshard.DistShardNode) else root.source
            if run.epoch_first:
                shard.set_epoch(epoch)
            if state is not None:
                with stage(load_stage):
                    shard.load_state_dict(state)
            if not run.epoch_first:
                shard.set_epoch(epoch)
            return root, root.state_dict
        pipeline = distshard.StatefulPipeline(build(spec, rank, run.world))
        loader = None
        if run.kind != "plain":
            kwargs = {"multiprocessing_context": "fork", "timeout": 30} if run.workers else {}
            loader = StatefulDataLoader(pipeline, batch_size=None, num_workers=run.workers, **kwargs)
        if run.epoch_first:
            pipeline.set_epoch(epoch)
        if state is not None:
            with stage(load_stage):
                if run.resume == "own" and loader is not None:
                    if spec.even == "carry":  # docs/usage.md "carry": the pipeline keeps the boundaries too
                        pipeline.load_state_dict(state)
                    loader.load_state_dict(state)
                else:
                    pipeline.load_state_dict(state)
        if not run.epoch_first:
            pipeline.set_epoch(epoch)
        target = loader if loader is not None else pipeline
        return target, target.state_dict

    return fresh


PERSISTENT = ("sdlp-fork", "sdlp-spawn", "dlp-fork", "dlp-spawn")


class PersistentUnit:
    """One rank's DataLoader with ``persistent_workers=True`` (make_unit's ``fresh``
    for the PERSISTENT kinds). A history keeps it from an epoch's last run into the
    next epoch, which then goes on in the same workers after ``set_epoch``; its dry
    run, which only counts the share, uses fork workers that do not persist."""

    def __init__(self, spec: Spec, run: Run, rank: int, epoch: int, state, load_stage: str) -> None:
        self.spec, self.run, self.rank, self.epoch, self.state = spec, run, rank, epoch, state
        self.load_stage = load_stage
        self.pipe = self.loader = None
        self.base = None  # the state loaded when the workers started (carry keeps its boundaries)

    def dry(self):
        if self.state is None and self.base is not None and self.spec.even == "carry":
            # an epoch going on in the same workers: its share follows the boundaries the
            # state loaded at the start moved (the pipe keeps them), so the dry run loads it too
            run = replace(self.run, kind="sdl2", resume="merged", epoch_first=True)
            return make_unit(self.spec, run, self.rank, self.epoch, self.base)()
        return make_unit(self.spec, replace(self.run, kind="sdl2"), self.rank, self.epoch, self.state)()

    def __call__(self):
        stateful = self.run.kind.startswith("sdlp")
        if self.loader is not None:  # a new epoch in the same workers
            distshard.set_epoch(self.pipe, self.epoch)
            return self.loader, self.loader.state_dict if stateful else None
        self.pipe = pipe = build(self.spec, self.rank, self.run.world)
        options = dict(
            batch_size=None,
            num_workers=self.run.workers,
            persistent_workers=True,
            multiprocessing_context=self.run.kind.split("-")[1],
            timeout=60,
        )
        loader = (
            StatefulDataLoader(distshard.StatefulPipeline(pipe), **options) if stateful else DataLoader(pipe, **options)
        )
        if self.run.epoch_first:
            pipe.set_epoch(self.epoch)
        if self.state is not None:
            with stage(self.load_stage):
                if self.run.resume == "own":
                    if self.spec.even == "carry":  # docs/usage.md "carry": the pipeline keeps the boundaries too
                        distshard.StatefulPipeline(pipe).load_state_dict(self.state)
                    loader.load_state_dict(self.state)
                else:  # a merged state, into the loader's copy before its workers start
                    distshard.StatefulPipeline(pipe).load_state_dict(self.state)
        if not self.run.epoch_first:
            pipe.set_epoch(self.epoch)
        self.loader = loader
        return loader, loader.state_dict if stateful else None

    def next_epoch(self, epoch: int) -> "PersistentUnit":
        self.base = self.state if self.state is not None else self.base
        self.epoch, self.state = epoch, None
        return self

    def close(self) -> None:
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is not None:
            iterator._shutdown_workers()


def run_unit(fresh, choose: Callable[[int | None], int], first_stage: str) -> tuple[list, bool, dict | None]:
    """Dry-run the unit to learn its share ``L``, then take ``choose(L)`` elements
    from a fresh copy; return (elements, at the end of its share, state)."""
    try:
        target, _ = getattr(fresh, "dry", fresh)()
        it = iter(target)
        share = sum(1 for _ in it)
        shutdown(it)
    except (ValueError, TypeError, RuntimeError):
        share = None  # the real run will meet the same refusal
    take = choose(share)
    target, state_dict = fresh()
    with stage(first_stage):  # a loader's workers may refuse their state as they start
        it = iter(target)
    try:
        elements, exhausted = consume(it, take, first_stage)
        with stage("checkpoint"):
            state = None if state_dict is None else jsonable(state_dict())
    finally:
        if not isinstance(fresh, PersistentUnit):  # persistent workers may go on into the next epoch
            shutdown(it)
    return elements, exhausted or len(elements) == share, state


# -- the model -------------------------------------------------------------------------------

LAYOUTS = {
    "plain": st.tuples(st.integers(1, 4), st.integers(0, 2)),
    "sdl0": st.tuples(st.integers(1, 4), st.just(0)),
    "sdl2": st.tuples(st.integers(1, 2), st.just(2)),
    "node": st.tuples(st.integers(1, 4), st.integers(0, 2)),
    "sdlp-fork": st.tuples(st.integers(1, 2), st.just(2)),
    "dlp-fork": st.tuples(st.integers(1, 2), st.just(2)),
    "sdlp-spawn": st.tuples(st.just(1), st.just(2)),  # spawned workers take seconds to start
    "dlp-spawn": st.tuples(st.just(1), st.just(2)),
}


# None is dist_shard's default: under a DataLoader on one rank it takes the loader's seed,
# a new one every epoch (except under even="carry", where every epoch's order must last)
SEEDS = st.one_of(st.none(), st.integers(0, 2**20))


@st.composite
def specs(draw) -> Spec:
    source = draw(st.sampled_from(SOURCES))
    common = dict(
        source=source,
        shuffle=draw(st.booleans()),
        seed=draw(SEEDS),
        multiple=draw(st.sampled_from([1, 1, 2, 3])),
        even=draw(st.sampled_from([None, "drop", "pad"])),
    )
    if source == "remote-parquet":
        common["parquet"] = draw(st.sampled_from(PARQUET_PATHS))
    if source == "pack":
        seq_len = draw(st.integers(1, 6))
        fit = draw(st.sampled_from(["concat", "best"]))
        if fit == "best":  # blocks of up to 10 (bins of several documents), windows of 3 tokens to all
            window = draw(st.sampled_from([None, 3, 8, 20]))
            return Spec(n=draw(st.integers(0, 40)), seq_len=draw(st.integers(1, 10)), fit=fit, window=window, **common)
        return Spec(n=draw(st.integers(0, 40)), seq_len=seq_len, eos=seq_len > 1 and draw(st.booleans()), **common)
    if source != "units":
        return Spec(n=draw(st.integers(0, 60)), **common)
    return Spec(
        unit_sizes=tuple(draw(st.lists(st.integers(0, 9), max_size=10))),
        sized=draw(st.booleans()),
        expand_list=draw(st.booleans()),
        **common,
    )


def check_construction(spec: Spec, build=build) -> bool:
    """Construction refuses exactly the documented cases; True if it built."""
    must = [r for r in CONSTRUCT if r.applies(spec)]
    try:
        with stage("construct"):
            build(spec, 0, 1)
    except Refused as refused:
        assert must, f"{spec}: refused at construction: {refused}"
        assert any(isinstance(refused.error, r.error) and re.search(r.message, str(refused.error)) for r in must), (
            f"{spec}: unclear refusal {refused}"
        )
        return False
    assert not must, f"{spec}: built, but should be refused: {[r.why for r in must]}"
    return True


def choice(data, final: bool) -> Callable[[int | None], int]:
    def choose(share: int | None) -> int:
        if share is None:
            return ALL
        how = data.draw(st.sampled_from(["all", "end"] if final else ["zero", "all", "end", "some"]))
        if how == "some":
            return data.draw(st.integers(0, share))
        return {"zero": 0, "all": ALL, "end": share}[how]

    return choose


def run_history(
    spec: Spec, data, kinds: list[str], epochs: tuple[int, int] | None = None, epoch_tags: bool = True
) -> None:
    """Draw and run a history of ``epochs`` (at least, at most; default 1-2, 1-4 for
    carry) epochs; check every epoch, or that a refusal is documented. ``epoch_tags``:
    a "tagged" source's elements say their epoch (the DataPipe seeds it)."""
    universe = Counter(spec.universe())
    log: list[str] = []
    states: list | None = None  # every unit's state at the last checkpoint
    previous: tuple | None = None  # (kind, world, workers, even) of the last run
    evens: list[str | None] = [None] if (spec.units and not spec.sized) or spec.whole_files else [None, "drop", "pad"]
    carry = spec.even == "carry"
    if carry:
        evens = ["carry"]  # carry and the other modes refuse each other's states (test_carry.py)
    history: Counter = Counter()  # carry: everything consumed, all epochs
    kept: list | None = None  # persistent loaders of the previous epoch's last run, one per unit
    try:
        for epoch in range(data.draw(st.integers(*(epochs or ((1, 4) if carry else (1, 2)))), label="epochs")):
            record = Epoch()
            tags: set = set()  # the tags of a "tagged" source's elements this epoch
            # torch's DataLoader over the DataPipe cannot checkpoint: an epoch it goes on in is one run
            runs = 1 if kept and kept[0].run.kind.startswith("dlp") else data.draw(st.integers(1, 3), label="runs")
            for index in range(runs):
                final = index == runs - 1
                going_on, kept = kept, None
                if going_on:  # the training loop goes on in the same persistent workers
                    run, resume = replace(going_on[0].run, resume=None), None
                else:
                    kind = data.draw(st.sampled_from(kinds))
                    if kind.startswith("dlp") and not final:
                        kind = "sdlp" + kind[3:]  # an epoch's last run only
                    world, workers = data.draw(LAYOUTS[kind])
                    resume = None
                    if states is not None:
                        same = previous == (kind, world, workers, spec.even) and not kind.startswith("dlp")
                        resume = "own" if same and data.draw(st.booleans()) else "merged"
                    if resume == "merged" and data.draw(st.booleans(), label="new even"):
                        spec = replace(spec, even=data.draw(st.sampled_from(evens)))
                    run = Run(kind, world, workers, resume, data.draw(st.booleans()))
                log.append(f"epoch {epoch}: {run}, even={spec.even!r}" + (" (same workers)" if going_on else ""))
                if index == 0 or resume == "merged":
                    left = (epoch + 1) * sum(universe.values()) - sum(history.values()) if carry else None
                    record.start_split(universe, run.num_slots, spec.even, spec.multiple, left)
                loaded = states or [None] * len(run.units)
                persistent: list = []
                try:
                    if resume == "merged":
                        assert states is not None, "a merged resume follows a checkpoint"
                        with stage("merge"):
                            merged = jsonable(distshard.merge_states(states))
                        loaded = [merged] * len(run.units)
                    first_stage = f"iterate-{resume}" if resume else "iterate"
                    states = []
                    for unit, (rank, worker) in enumerate(run.units):
                        if going_on:
                            fresh = going_on[unit].next_epoch(epoch)
                        else:
                            fresh = make_unit(spec, run, rank, epoch, loaded[unit])
                        if isinstance(fresh, PersistentUnit):
                            persistent.append(fresh)
                        with as_worker(worker, run.workers) if worker >= 0 else contextlib.nullcontext():
                            elements, at_end, state = run_unit(fresh, choice(data, final), first_stage)
                        log.append(f"  unit {unit}: {len(elements)} elements, at end: {at_end}")
                        if carry:
                            history.update(elements)
                        else:
                            elements = untag_epoch(elements, tags, epoch_tags, log)
                        record.add(unit, elements, at_end)
                        states.append(state)
                except Refused as refused:
                    assert_documented(spec, refused, log)
                    return
                finally:
                    if not final or len(persistent) < len(run.units):
                        for unit in persistent:
                            unit.close()
                if final and persistent and len(persistent) == len(run.units):
                    kept = persistent  # the next epoch goes on in these workers
                if run.kind.startswith("dlp"):
                    states = None  # nothing to resume from: the next epoch starts afresh
                previous = (run.kind, run.world, run.workers, spec.even)
            where = f"{spec}, epoch {epoch}\n" + "\n".join(log)
            if carry:
                check_carry_epoch(universe, epoch, record, history, epoch_tags, where)
            else:
                check_epoch(universe, record, where)
    finally:
        for unit in kept or []:
            unit.close()


def untag_epoch(elements: list, tags: set, epoch_tags: bool, log: list[str]) -> list:
    """A "tagged" source's elements without their tag; every element of one epoch
    must come from that epoch's stream (one tag an epoch)."""
    out = []
    for element in elements:
        name, tag = untag(element)
        if tag is not None:
            tags.add(tag)
        out.append(name)
    assert not epoch_tags or len(tags) <= 1, f"elements of several epochs' streams in one epoch: {tags}\n" + "\n".join(
        log
    )
    return out


def check_model(spec: Spec, data, kinds: list[str], build_spec=build, epochs: tuple[int, int] | None = None) -> None:
    if check_construction(spec, build_spec):
        run_history(spec, data, kinds, epochs, epoch_tags=build_spec is build)


# ~10 ms an example when it passes; shrinking a failure takes longer
MODEL_SETTINGS = settings(max_examples=500, deadline=None, derandomize=False, suppress_health_check=list(HealthCheck))


@MODEL_SETTINGS
@given(spec=specs(), data=st.data())
def test_every_history_is_exact_or_refused(spec, data):
    """Slots in-process (as_worker) and StatefulDataLoader without workers."""
    check_model(spec, data, ["plain", "plain", "sdl0"])


@st.composite
def weak_etag_specs(draw) -> Spec:
    """specs() of the remote source whose server sends weak ETags and rewrites the
    file at the same size mid-history (issue 21): drawn on purpose, it is one kind in many."""
    return replace(draw(specs()), source="remote-weak", n=draw(st.integers(1, 60)))


@settings(MODEL_SETTINGS, max_examples=40)
@given(spec=weak_etag_specs(), data=st.data())
def test_every_history_of_a_file_rewritten_behind_weak_etags_is_exact_or_refused(spec, data):
    """A rewrite the server's weak ETags tell only by comparison: the run raises
    (a documented refusal) and never yields the new version's elements ("x3")."""
    check_model(spec, data, ["plain", "plain", "sdl0"])


def test_the_weak_etag_server_rewrites_the_file_while_a_pipe_reads_it():
    """The history test above is not vacuous: a pipe that reads the whole file sees
    the rewrite its HEAD armed, and refuses it."""
    from tests.model_factories import remote_weak_jsonl

    pipe = remote_weak_jsonl(55).dist_shard(rank=0, world_size=1)
    with pytest.raises(ValueError, match="changed after it was indexed"):
        list(pipe)


@settings(MODEL_SETTINGS, max_examples=30)
@given(spec=specs(), data=st.data())
def test_every_history_over_a_stored_index_is_exact_or_refused(spec, data):
    """The remote file with its index stored beside it (issue 22): no HEAD, the
    entries fetched by the slots that read, faults retried, exactly once."""
    check_model(replace(spec, source="remote-stored", n=max(spec.n, 1)), data, ["plain", "sdl0"])


@settings(MODEL_SETTINGS, max_examples=20)
@given(spec=specs(), data=st.data())
def test_every_history_over_a_stored_index_named_by_a_pattern_is_exact_or_refused(spec, data):
    """Files named by a brace pattern the stored index recorded (issue 33): the source
    holds a lazy list, matches the index as a pattern and reads exactly once."""
    check_model(replace(spec, source="pattern-stored"), data, ["plain", "sdl0"])


def test_the_pattern_model_source_is_a_lazy_list_matched_to_its_index():
    """The history test above is not vacuous: its source holds the pattern's lazy list
    and takes the index's summary by the pattern the command recorded."""
    from distshard.sources.stored.paged import StoredSummary
    from distshard.sources.transport.brace_list import BraceList
    from tests.model_factories import pattern_stored_jsonl

    source = pattern_stored_jsonl(10)
    assert isinstance(source.urls, BraceList) and len(source.urls) == 4
    assert sorted(source.dist_shard(rank=0, world_size=1)) == sorted(f"e{i}" for i in range(10))
    assert isinstance(source._summary, StoredSummary)


@settings(MODEL_SETTINGS, max_examples=20)
@given(spec=specs(), data=st.data())
def test_every_history_over_a_stored_index_on_s3_is_exact_or_refused(spec, data):
    """The same file in a bucket of moto's S3 server, its index stored beside it,
    read by the direct S3 client through a proxy that answers every 7th GET with a
    503 SlowDown, a reset or a cut body: no HEAD, faults retried, exactly once."""
    pytest.importorskip("moto.server")
    check_model(replace(spec, source="remote-s3", n=max(spec.n, 1)), data, ["plain", "sdl0"])


def test_the_s3_model_source_reads_through_the_direct_client_and_its_faults():
    """The history test above is not vacuous: the source's client is the direct
    one, and its proxy injects every kind of fault while a pipe reads."""
    pytest.importorskip("moto.server")
    from distshard.sources.transport import clients
    from distshard.sources.transport.s3direct import DirectS3Client
    from tests import model_factories

    pipe = model_factories.remote_s3_jsonl(150)
    assert isinstance(pipe.access.client(pipe.urls[0]), DirectS3Client)
    assert sorted(pipe.dist_shard(rank=0, world_size=1)) == sorted(f"e{i}" for i in range(150))
    assert set(model_factories._S3[2].faulted) == {"slowdown", "reset", "short"}
    assert model_factories._S3[2].requests["HEAD"] == 0
    clients.forget_clients()


@settings(MODEL_SETTINGS, max_examples=20)
@given(spec=specs(), data=st.data())
def test_every_history_over_a_stored_index_gone_stale_is_exact_or_refused(spec, data):
    """The file of a stored index rewritten at the same size under the running job
    (issue 22): every range asks ``If-Match`` of the manifest's ETag, the store answers
    412, and the run refuses naming the refresh command; it never yields the new
    version's elements ("x3")."""
    check_model(replace(spec, source="remote-stale", n=max(spec.n, 1)), data, ["plain", "sdl0"])


@settings(MODEL_SETTINGS, max_examples=15)
@given(spec=specs(), data=st.data())
def test_every_history_over_the_hub_is_exact_or_refused(spec, data):
    """The file in a repository of a loopback Hub at a commit, same-size rewrites pushed to main
    in the middle of jobs (issue 30): every read stays on that commit, never a row of another
    one ("x3"), whatever the loader, workers and resumes."""
    pytest.importorskip("huggingface_hub")
    check_model(replace(spec, source="remote-hub", n=max(spec.n, 1)), data, ["plain", "sdl0"])


def test_the_hub_pushes_a_commit_while_a_pipe_reads_it():
    """The history test above is not vacuous: the push lands mid-read and the pipe, pinned,
    still yields every element of the commit it was built at."""
    pytest.importorskip("huggingface_hub")
    from tests import hub_factories

    pipe = hub_factories.remote_hub_jsonl(54).dist_shard(rank=0, world_size=1)
    assert sorted(pipe) == sorted(f"e{i}" for i in range(54))
    assert hub_factories.HUB[2].pushes[54] >= 1


def test_the_stale_index_server_rewrites_the_file_while_a_pipe_reads_it():
    """The history test above is not vacuous: a pipe that reads the whole file asks
    no HEAD (the stored index), sees the rewrite its manifest GET armed, and refuses it."""
    from tests import model_factories

    pipe = model_factories.remote_stale_jsonl(55).dist_shard(rank=0, world_size=1)
    server = model_factories._STALE[1]
    heads = server.requests["HEAD"]
    with pytest.raises(ValueError, match=r"changed after the stored index at .*python -m distshard index"):
        list(pipe)
    assert server.requests["HEAD"] == heads  # the stored index answered the file's identity


@settings(MODEL_SETTINGS, max_examples=12)
@given(spec=specs(), data=st.data())
def test_every_history_over_a_cache_that_outlives_its_jobs_is_exact_or_refused(spec, data):
    """Issue 28: jobs one after the other over a stored index and a local range cache
    that outlives them (``CacheJobs``); between two jobs the file may be rewritten at
    the same size (the index stale) or deleted: the next job's read refuses with the
    documented error whatever the cache holds (then version 1 is put back), or a
    cache entry corrupted in place or truncated: the next job's history is exact."""
    from tests.model_factories import CacheJobs, cache_jobs

    spec = replace(spec, source="remote-jobs", n=max(spec.n, 1))
    jobs = cache_jobs(spec.n)
    for job in range(data.draw(st.integers(2, 3), label="jobs")):
        event = data.draw(st.sampled_from(CacheJobs.EVENTS), label="between jobs") if job else "none"
        jobs.between(event)
        if event in ("rewrite", "delete"):
            error, words = (
                (ValueError, r"changed after the stored index at .*python -m distshard index")
                if event == "rewrite"
                else (FileNotFoundError, r"no such file")
            )
            with pytest.raises(error, match=words):
                list(build(replace(spec, even=None), 0, 1))  # every element asked for
            jobs.restore()
            continue
        check_model(spec, data, ["plain", "sdl0"])


def test_the_cache_jobs_source_is_served_by_its_cache_and_sees_its_damage(caplog):
    """The history test above is not vacuous: a second job is served from the cache
    (no data GET), a damaged entry is found and replaced, a rewrite is refused."""
    from tests.model_factories import cache_jobs

    jobs = cache_jobs(57)
    jobs.between("none")
    assert sorted(jobs.source().dist_shard(rank=0, world_size=1)) == sorted(f"e{i}" for i in range(57))
    jobs.between("none")
    jobs.server.settle().reset_counters()
    assert sorted(jobs.source().dist_shard(rank=0, world_size=1)) == sorted(f"e{i}" for i in range(57))
    server = jobs.server.settle()
    assert server.by_path.get("e57.jsonl", 0) == 0 and server.requests["HEAD"] == 1  # the cache's version confirmed
    caplog.set_level(logging.WARNING, logger="distshard")
    jobs.between("flip-entry")
    assert sorted(jobs.source().dist_shard(rank=0, world_size=1)) == sorted(f"e{i}" for i in range(57))
    assert any("damaged" in r.getMessage() for r in caplog.records)
    jobs.between("rewrite")
    with pytest.raises(ValueError, match="changed after the stored index"):
        list(jobs.source().dist_shard(rank=0, world_size=1))
    jobs.restore()


@st.composite
def parquet_specs(draw) -> Spec:
    """specs() over the remote Parquet file, read cold (no stored index) on one of its
    paths (``Spec.parquet``), with at least one row (row groups of 3: the histories
    cross them)."""
    spec = draw(specs())
    path = draw(st.sampled_from(PARQUET_PATHS))
    return replace(spec, source="remote-parquet", n=max(spec.n, 1), parquet=path, fault_every=7)


@settings(MODEL_SETTINGS, max_examples=20)
@given(spec=parquet_specs(), data=st.data())
def test_every_history_over_remote_parquet_is_exact_or_refused(spec, data):
    """A remote Parquet file without a stored index: every build asks its identity and
    footer with one suffix GET (a footer longer than it: a second range checked
    against that identity; a server that refuses suffix ranges: a HEAD and the footer's
    range), the rows read by row group through faults (the suffix GETs' too), exactly once."""
    pytest.importorskip("pyarrow")
    check_model(spec, data, ["plain", "sdl0"])


def test_the_parquet_model_source_takes_every_path_and_faults_its_suffix_gets():
    """The history test above is not vacuous: the file crosses row groups, every path
    asks what it says (one suffix GET; a second range for the wide footer; a HEAD and
    the footer's range where suffix ranges are refused), the unselected column is not
    read, and a suffix GET that meets each kind of fault is retried, exactly."""
    pq = pytest.importorskip("pyarrow.parquet")
    from distshard.sources.formats.parquet import TAIL
    from tests import model_factories

    def elements(n: int, path: str) -> list[str]:
        pipe = model_factories.remote_parquet(n, path).map(model_factories.parquet_name)
        return sorted(pipe.dist_shard(rank=0, world_size=2)) + sorted(pipe.dist_shard(rank=1, world_size=2))

    def expected(n: int) -> list[str]:
        return sorted(f"e{i}" for i in range(n))

    model_factories.remote_parquet(1)  # this process's servers (made on first use: both, whatever ran before)
    model_factories.remote_parquet(1, "head")
    root, servers = model_factories._PARQUET[1], model_factories._PARQUET[2]
    server = servers[True, 7]
    for j, kind in enumerate(server.faults):  # the build's suffix GET meets ``kind``
        with server.lock:
            server.suffix_faults.append(kind)
        n = 91 + j  # a file of its own: its index is built from the suffix GET's footer
        assert sorted(elements(n, "suffix")) == expected(n)
        assert (f"/e{n}.parquet", f"bytes=-{TAIL}", kind) in server.fault_log, server.fault_log
    assert pq.read_metadata(root / "e91.parquet").num_row_groups == 31
    assert server.requests["HEAD"] == 0
    server.reset_counters()
    # files of their own (n > 60, which no history draws): an index built by an earlier
    # test of this process would leave nothing for the footer's second range to fetch
    assert sorted(elements(95, "wide")) == expected(95)
    wide = root / "e95-wide.parquet"
    size, need = wide.stat().st_size, pq.read_metadata(wide).serialized_size + 8
    asked = [r for m, p, r in server.settle().log if p.endswith("/e95-wide.parquet") and m == "GET"]
    assert need > TAIL and asked[:1] == [f"bytes=-{TAIL}"], asked
    assert f"bytes={size - need}-{size - TAIL - 1}" in asked, asked
    servers[False, 7].reset_counters()
    assert sorted(elements(96, "head")) == expected(96) and sorted(elements(97, "head")) == expected(97)
    suffixes = [p for m, p, r in servers[False, 7].settle().log if (r or "").startswith("bytes=-")]
    assert suffixes in ([], ["/e96.parquet"]), suffixes  # refused once (400), then remembered for the host
    assert servers[False, 7].requests["HEAD"] >= 2
    assert sum(server.faulted.values()) + sum(servers[False, 7].faulted.values()) > 0


@st.composite
def shuffled_units(draw) -> Spec:
    """The rarest corner of specs(), drawn on purpose: units with sizes read in a
    permuted order, whose states lay positions out in a stride, not blocks."""
    return Spec(
        source="units",
        unit_sizes=tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=8))),
        sized=True,
        expand_list=True,
        shuffle=True,
        seed=draw(st.integers(0, 2**20)),
        even=draw(st.sampled_from([None, "drop", "pad"])),
    )


@settings(MODEL_SETTINGS, max_examples=150)
@given(spec=shuffled_units(), data=st.data())
def test_every_history_of_shuffled_units_is_exact(spec, data):
    check_model(spec, data, ["plain", "plain", "sdl0"])


@settings(MODEL_SETTINGS, max_examples=200)
@given(spec=specs(), data=st.data())
def test_every_history_through_the_nodes_front_end_is_exact_or_refused(spec, data):
    """The same model through DistShardNode (torchdata.nodes), slots in-process."""
    check_model(spec, data, ["node"], build_spec=build_node)


# forks 4 to 8 worker processes a run: a small sample, and failures are reported
# unshrunk (each shrink step would fork again)
@settings(MODEL_SETTINGS, max_examples=12, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(spec=specs(), data=st.data())
def test_every_history_is_exact_or_refused_with_real_workers(spec, data):
    """A small sample with StatefulDataLoader(num_workers=2, fork) on some runs."""
    check_model(spec, data, ["sdl2", "plain"])


@st.composite
def shuffled_specs(draw) -> Spec:
    """Pipelines whose order changes with the epoch, so that an epoch that does not
    reach the workers shows: shuffle=True, or an upstream .shuffle()."""
    upstream = draw(st.booleans())
    source = "shuffled" if upstream else draw(st.sampled_from(["list", "list+map", "jsonl", "tokens"]))
    return Spec(
        source,
        n=draw(st.integers(1, 40)),
        shuffle=not upstream,
        seed=draw(SEEDS),
        multiple=draw(st.sampled_from([1, 1, 2])),
        even=draw(st.sampled_from([None, "drop", "pad"])),
    )


# persistent workers: two epochs, the second going on in the workers of the first's last
# run when that run had persistent workers; a few examples (every run starts real workers)
@settings(MODEL_SETTINGS, max_examples=10, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(spec=shuffled_specs(), data=st.data())
def test_every_history_with_persistent_workers_is_exact_or_refused(spec, data):
    check_model(spec, data, ["sdlp-fork", "dlp-fork", "plain"], epochs=(2, 2))


@settings(MODEL_SETTINGS, max_examples=2, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(spec=shuffled_specs(), data=st.data())
def test_every_history_with_spawned_persistent_workers_is_exact_or_refused(spec, data):
    check_model(spec, data, ["sdlp-spawn", "dlp-spawn"], epochs=(2, 2))


# -- pack(fit="best"): whole documents, drawn on purpose (one kind in many above) -----------


@st.composite
def best_pack_specs(draw) -> Spec:
    """ "pack" with fit="best" in windows of a few tokens to the whole corpus, every even
    (carry too: one packing, the same length every epoch)."""
    return Spec(
        source="pack",
        n=draw(st.integers(0, 40)),
        seq_len=draw(st.integers(1, 10)),
        fit="best",
        window=draw(st.sampled_from([None, 3, 8, 20])),
        shuffle=draw(st.booleans()),
        seed=draw(SEEDS),
        multiple=draw(st.sampled_from([1, 1, 2, 3])),
        even=draw(st.sampled_from([None, "drop", "pad", "carry"])),
    )


@settings(MODEL_SETTINGS, max_examples=80)
@given(spec=best_pack_specs(), data=st.data())
def test_every_history_of_best_fit_blocks_is_exact_or_refused(spec, data):
    """Blocks of whole documents: every block once per epoch over every layout and
    elastic resume, in-process, through StatefulDataLoader and the nodes front-end."""
    check_model(spec, data, ["plain", "sdl0"])
    check_model(spec, data, ["node"], build_spec=build_node)


@settings(MODEL_SETTINGS, max_examples=3, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(spec=best_pack_specs(), data=st.data())
def test_every_history_of_best_fit_blocks_is_exact_or_refused_with_real_workers(spec, data):
    check_model(spec, data, ["sdl2", "plain"])


# -- even="carry": histories over several epochs, resumed elastically in between -------------


@st.composite
def carry_specs(draw) -> Spec:
    """Pipelines with even="carry": mostly random-access sources (a stream is refused
    at construction), with multiple_of, shuffle=True, and short epochs (N from 0, also
    below the slot count, so a tail may span several epochs)."""
    source = draw(st.sampled_from([*SOURCES, "tagged", "tagged", "list", "units"]))
    common = dict(
        source=source,
        shuffle=draw(st.booleans()),
        seed=draw(SEEDS),
        multiple=draw(st.sampled_from([1, 1, 2, 3])),
        even="carry",
    )
    if source == "remote-parquet":
        common["parquet"] = draw(st.sampled_from(PARQUET_PATHS))
    if source != "units":
        return Spec(n=draw(st.integers(0, 30)), **common)
    return Spec(
        unit_sizes=tuple(draw(st.lists(st.integers(0, 6), max_size=8))),
        sized=draw(st.booleans().map(lambda b: b or draw(st.booleans()))),
        expand_list=True,
        **common,
    )


@settings(MODEL_SETTINGS, max_examples=250)
@given(spec=carry_specs(), data=st.data())
def test_every_carry_history_is_exact_or_refused(spec, data):
    """Up to 4 epochs of 1-3 runs each, slots in-process and StatefulDataLoader without
    workers, every run on its own layout, resumed from each slot's own state or merged."""
    check_model(spec, data, ["plain", "plain", "sdl0"])


@settings(MODEL_SETTINGS, max_examples=80)
@given(spec=carry_specs(), data=st.data())
def test_every_carry_history_through_the_nodes_front_end_is_exact_or_refused(spec, data):
    check_model(spec, data, ["node"], build_spec=build_node)


@settings(MODEL_SETTINGS, max_examples=5, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(spec=carry_specs(), data=st.data())
def test_every_carry_history_is_exact_or_refused_with_real_workers(spec, data):
    check_model(spec, data, ["sdl2", "plain"])


# the DataLoader hands its workers a new seed every epoch: carry's epochs, read across an
# epoch end by persistent workers (fork and spawn), must keep each epoch's own order
@settings(MODEL_SETTINGS, max_examples=6, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(spec=carry_specs(), data=st.data())
def test_every_carry_history_with_persistent_workers_is_exact_or_refused(spec, data):
    check_model(spec, data, ["sdlp-fork", "dlp-fork", "sdl2"], epochs=(2, 3))


@settings(MODEL_SETTINGS, max_examples=1, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(spec=carry_specs(), data=st.data())
def test_every_carry_history_with_spawned_persistent_workers_is_exact_or_refused(spec, data):
    check_model(spec, data, ["sdlp-spawn", "dlp-spawn"], epochs=(2, 2))


# -- model-parallel meshes: peers, and checkpoints through LoaderCheckpoint --------------------


@dataclass(frozen=True)
class Mesh:
    """A run on a mesh: ``data`` data ranks (the DP degree), each read by ``peers``
    model-parallel ranks (TP), ``workers`` DataLoader workers a rank (slots in-process)."""

    data: int
    peers: int
    workers: int

    @property
    def num_slots(self) -> int:
        return self.data * max(1, self.workers)

    @property
    def slots(self) -> list[tuple[int, int]]:
        return [(d, w) for d in range(self.data) for w in range(max(1, self.workers))]


MESHES = st.builds(Mesh, st.integers(1, 3), st.integers(1, 3), st.integers(0, 2))


def mesh_copy(spec: Spec, mesh: Mesh, data_rank: int, epoch: int, state, load_stage: str):
    """fresh() of one copy of a data slot (one peer's), built as dist_shard(mesh=...)."""

    def fresh():
        pipeline = distshard.StatefulPipeline(on_data_group(build(spec, data_rank, mesh.data), data_rank, mesh.data))
        pipeline.set_epoch(epoch)
        if state is not None:
            with stage(load_stage):
                pipeline.load_state_dict(state)
        return pipeline, pipeline.state_dict

    return fresh


class PeerTake:
    """The amount a data slot's peers consume: drawn once (by the first peer), the same
    for every peer, but one more for the peer ``odd`` (when there is more to take)."""

    def __init__(self, data, final: bool, odd: int | None) -> None:
        self.choose, self.odd = choice(data, final), odd
        self.taken: int | None = None

    def for_peer(self, peer: int) -> Callable[[int | None], int]:
        def take(share: int | None) -> int:
            taken = self.taken = self.choose(share) if self.taken is None else self.taken
            more = peer == self.odd and taken != ALL and share is not None and taken < share
            return taken + 1 if more else taken

        return take


@dataclass
class MeshHistory:
    """A history of runs on meshes (see :func:`run_mesh_history`)."""

    spec: Spec
    data: Any
    log: list = field(default_factory=list)
    history: Counter = field(default_factory=Counter)  # carry: everything consumed, all epochs
    states: dict | None = None  # (data rank, worker, peer) -> the copy's state at the last checkpoint
    mesh: Mesh | None = None  # the mesh of the last run
    diverged: bool = False  # a peer of the last run took more than the others

    def run(self, mesh: Mesh, epoch: int, loads: dict, first_stage: str, record: Epoch, tags: set, final: bool) -> None:
        """Every peer of every data slot consumes the same amount (rarely, one peer one
        more; the epoch's ``final`` run: to the end); peers must yield the same elements,
        which the oracle counts once."""
        data, states = self.data, {}
        odd = data.draw(st.sampled_from(mesh.slots)) if mesh.peers > 1 and data.draw(st.integers(0, 9)) == 0 else None
        self.diverged = False
        for d, w in mesh.slots:
            take, seen = PeerTake(data, final, 1 if (d, w) == odd else None), []
            for peer in range(mesh.peers):
                with as_worker(w, mesh.workers):
                    fresh = mesh_copy(self.spec, mesh, d, epoch, loads.get((d, w)), f"load-{first_stage[8:]}")
                    elements, at_end, states[d, w, peer] = run_unit(fresh, take.for_peer(peer), first_stage)
                seen.append(elements)
            self.diverged |= any(e != seen[0] for e in seen)
            assert (d, w) == odd or all(e == seen[0] for e in seen), f"the peers of data slot {(d, w)} differ"
            self.log.append(f"  data slot {(d, w)}: {len(seen[0])} elements x {mesh.peers} peers, at end: {at_end}")
            if self.spec.even == "carry":
                self.history.update(seen[0])
                record.add(d * max(1, mesh.workers) + w, seen[0], at_end)
            else:
                record.add(d * max(1, mesh.workers) + w, untag_epoch(seen[0], tags, True, self.log), at_end)
        self.states, self.mesh = states, mesh

    def resume(self, new: Mesh, identity: str) -> tuple[dict, bool] | None:
        """The next run's loads, and whether merged: through LoaderCheckpoint's pack and
        restore (exact on the same data world and workers, else merged), or
        gather_states' merge of every rank's state. Peers that diverged must be refused,
        naming them: ``None`` then."""
        from distshard.checkpoint import Contribution, pack, restore

        old, workers = self.mesh, max(1, self.mesh.workers) if self.mesh else 1
        assert old is not None and self.states is not None, "a checkpoint follows a run"
        given = [
            Contribution(
                d * old.peers + t,
                d,
                old.data,
                old.workers,
                {"slots": [self.states[d, w, t] for w in range(workers)]},
                None,
                identity,
            )  # fmt: skip
            for d in range(old.data)
            for t in range(old.peers)
        ]
        try:
            if self.data.draw(st.booleans(), label="gather"):
                with stage("merge"):
                    merged = jsonable(distshard.merge_states([c.loader for c in given]))
                return {slot: merged for slot in new.slots}, True
            with stage("checkpoint"):
                saved = pack(given)
            with stage("merge"):  # what every new data rank takes from the checkpoint
                found = [restore(saved, replace(given[0], data_rank=d, data_world=new.data, workers=new.workers))
                         for d in range(new.data)]  # fmt: skip
        except Refused as refused:
            if not self.diverged:
                raise
            assert isinstance(refused.error, distshard.StateMismatchError), refused
            assert "model-parallel peers disagree" in str(refused.error), refused
            return None
        assert not self.diverged, "peers at different positions were merged\n" + "\n".join(self.log)
        if found[0].exact:
            return {(d, w): found[d].loader["slots"][w] for d, w in new.slots}, False
        return {(d, w): found[d].merged for d, w in new.slots}, True


def run_mesh_history(spec: Spec, data) -> None:
    """Epochs of one to three runs, each on a mesh of its own, every run checkpointing and
    the next resuming from that; the oracle as for :func:`run_history`."""
    universe, carry = Counter(spec.universe()), spec.even == "carry"
    identity = build(spec, 0, 1).chain_identity()
    mine = MeshHistory(spec, data)
    for epoch in range(data.draw(st.integers(1, 3 if carry else 2), label="epochs")):
        record, tags = Epoch(), set[str]()
        runs = data.draw(st.integers(1, 3), label="runs")
        for index in range(runs):
            mesh = data.draw(MESHES, label="mesh")
            if mine.mesh is not None and data.draw(st.booleans(), label="same data ranks and workers"):
                mesh = replace(mine.mesh, peers=mesh.peers)  # another model-parallel degree at most
            try:
                found = ({}, False) if mine.states is None else mine.resume(mesh, identity)
                if found is None:
                    return  # peers diverged, and the checkpoint refused them
                loads, merged = found
                mine.log.append(f"epoch {epoch}: {mesh}, {'merged' if merged else 'own' if loads else 'fresh'}")
                if index == 0 or merged:
                    left = (epoch + 1) * sum(universe.values()) - sum(mine.history.values()) if carry else None
                    record.start_split(universe, mesh.num_slots, spec.even, spec.multiple, left)
                first = "iterate-merged" if merged else "iterate-own" if loads else "iterate"
                mine.run(mesh, epoch, loads, first, record, tags, index == runs - 1)
            except Refused as refused:
                assert_documented(spec, refused, mine.log)
                return
        if mine.diverged and mine.mesh is not None:  # the checkpoint must refuse it; the history ends there
            assert mine.resume(mine.mesh, identity) is None, "\n".join(mine.log)
            return
        where = f"{spec}, epoch {epoch}\n" + "\n".join(mine.log)
        if carry:
            check_carry_epoch(universe, epoch, record, mine.history, True, where)
        else:
            check_epoch(universe, record, where)


def local(spec: Spec) -> Spec:
    """``spec`` over a local source: the mesh histories build every copy once per peer, and
    the remote read paths (a build costs requests) are the other histories' concern."""
    return replace(spec, source="jsonl") if spec.source.startswith("remote") else spec


@settings(MODEL_SETTINGS, max_examples=60)
@given(spec=specs().map(local), data=st.data())
def test_every_history_on_meshes_is_exact_or_refused(spec, data):
    """Every run on a random mesh (data ranks x model-parallel peers x workers): peers yield
    the same elements, a checkpoint (LoaderCheckpoint's pack and restore, or gather_states'
    merge) counts their states once, resumes exactly on the same data world and workers and
    elastically on another; a peer that took one more is refused, naming it."""
    if check_construction(spec):
        run_mesh_history(spec, data)


@settings(MODEL_SETTINGS, max_examples=30)
@given(spec=carry_specs().map(local), data=st.data())
def test_every_carry_history_on_meshes_is_exact_or_refused(spec, data):
    if check_construction(spec):
        run_mesh_history(spec, data)


# -- a state loaded into another pipeline ----------------------------------------------------


def _other(spec: Spec, change: str, data) -> Spec | None:
    """``spec`` with one option that changes which position means which element."""
    if change == "shuffle":
        return replace(spec, shuffle=not spec.shuffle) if spec.random_access and spec.expand_list else None
    if change == "even":
        if spec.units and not spec.sized:
            return None
        evens = (None, "drop", "pad", "carry") if spec.random_access else (None, "drop", "pad")
        return replace(spec, even=data.draw(st.sampled_from([e for e in evens if e != spec.even])))
    if change == "length":
        if spec.units and spec.sized and spec.unit_sizes:
            sizes = list(spec.unit_sizes)
            sizes[data.draw(st.integers(0, len(sizes) - 1))] += data.draw(st.sampled_from([-1, 1, 3]))
            return replace(spec, unit_sizes=tuple(sizes)) if min(sizes) >= 0 else None
        if spec.source in ("list", "list+map"):
            return replace(spec, n=max(0, spec.n + data.draw(st.sampled_from([-3, -1, 1, 5]))))
        return None
    # mode: element <-> units with sizes <-> units without sizes
    n = len(spec.universe())
    targets = {
        "element": Spec("list", n=n, seed=spec.seed),
        "sized": Spec("units", unit_sizes=(n,), sized=True, seed=spec.seed),
        "units": Spec("units", unit_sizes=(n,), sized=False, seed=spec.seed),
    }
    mine = "element" if not spec.units else ("sized" if spec.sized else "units")
    return targets[data.draw(st.sampled_from(sorted(set(targets) - {mine})))]


@settings(MODEL_SETTINGS, max_examples=60)
@given(spec=specs(), data=st.data())
def test_a_state_of_another_pipeline_is_refused(spec, data):
    """A slot state (same slot) or a merged state loaded into a pipeline with
    another shuffle, even (slot states only), mode or data length raises
    ValueError at load or before the first element."""
    if not check_construction(spec) or not spec.universe():
        return
    change = data.draw(st.sampled_from(["shuffle", "even", "mode", "length"]))
    merged = change != "even" and not (spec.units and not spec.sized) and data.draw(st.booleans())
    other = _other(spec, change, data)
    if other is None or not check_construction(other):
        return
    world, workers = data.draw(LAYOUTS["plain"])
    run = Run("plain", world, workers, None, True)
    states, progress = [], []
    try:
        for rank, worker in run.units:
            with as_worker(worker, workers):

                def some(share):
                    return data.draw(st.integers(min(1, share), max(1, share))) if share else 0

                elements, at_end, state = run_unit(make_unit(spec, run, rank, 0, None), some, "iterate")
            states.append(state)
            progress.append((len(elements), at_end))
    except Refused as refused:
        assert_documented(spec, refused)
        return
    if merged:
        if all(at_end for _, at_end in progress) or not any(n for n, _ in progress):
            return
        try:
            with stage("merge"):
                state = jsonable(distshard.merge_states(states))
        except Refused as refused:  # e.g. whole compressed files: refused before any pipeline sees it
            assert_documented(spec, refused)
            return
        rank, worker = 0, 0
        world, workers = data.draw(LAYOUTS["plain"])
    else:
        unit = data.draw(st.integers(0, len(states) - 1))
        if not progress[unit][0] or progress[unit][1]:
            return  # nothing consumed yet, or nothing left: the state says little
        state, (rank, worker) = states[unit], run.units[unit]
    with as_worker(worker, workers):
        pipeline = distshard.StatefulPipeline(build(other, rank, world)).set_epoch(0)
        with pytest.raises(ValueError):
            pipeline.load_state_dict(state)
            list(islice(pipeline, 1))


# -- real gloo groups: checkpoint on every rank, resume on another world size ---------------

GLOO_CASES = [
    # spec, (world, workers, elements per rank) of the first group, (world, workers) of the second
    (Spec("shuffled", n=41, even="drop", seed=5), (2, 2, 7), (3, 1)),
    (Spec("units", unit_sizes=(5, 0, 7, 3, 9, 4), sized=True, shuffle=True, even="pad", seed=1), (2, 2, 6), (1, 2)),
    # the merged state keeps the carried tail: 3 ranks in whole batches of 2 take what fits of it
    (Spec("tagged", n=41, shuffle=True, even="carry", multiple=2, seed=5), (2, 2, 7), (3, 1)),
    # a Megatron token pair, indexed collectively when each group builds it
    (Spec("tokens", n=43, shuffle=True, even="drop", seed=3), (2, 2, 5), (3, 1)),
]


@pytest.mark.parametrize(
    "spec, first, second",
    GLOO_CASES,
    ids=["shuffled-drop-2x2-3x1", "units-shuffle-pad-2x2-1x2", "tagged-carry-2x2-3x1", "tokens-shuffle-drop-2x2-3x1"],
)
def test_elastic_resume_on_real_groups_is_exact(spec, first, second):
    world, workers, take = first
    outcomes = run_on_group(gloo_run, world_size=world, args=(spec, workers, take), timeout=60)
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    merged = outcomes[0].value[1]
    assert all(o.value[1] == merged for o in outcomes)  # every rank got the same merge
    universe = Counter(spec.universe())
    n, carry = sum(universe.values()), spec.even == "carry"
    epoch = Epoch()
    epoch.start_split(universe, world * max(1, workers), spec.even, spec.multiple, n if carry else None)
    for rank, outcome in enumerate(outcomes):
        elements = outcome.value[0] if carry else [untag(x)[0] for x in outcome.value[0]]
        epoch.add(rank, elements, len(outcome.value[0]) < take)
    first_outcomes = outcomes
    world2, workers2 = second
    outcomes = run_on_group(gloo_run, world_size=world2, args=(spec, workers2, None, merged), timeout=60)
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    consumed = sum(len(o.value[0]) for o in first_outcomes)
    epoch.start_split(universe, world2 * max(1, workers2), spec.even, spec.multiple, n - consumed if carry else None)
    for rank, outcome in enumerate(outcomes):
        epoch.add(rank, outcome.value[0] if carry else [untag(x)[0] for x in outcome.value[0]], True)
    if carry:
        history = Counter(x for o in (*first_outcomes, *outcomes) for x in o.value[0])
        check_carry_epoch(universe, 0, epoch, history, True, f"{spec}: {first} -> {second}")
    else:
        check_epoch(universe, epoch, f"{spec}: {first} -> {second}")
