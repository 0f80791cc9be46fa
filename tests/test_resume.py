"""Exact mid-epoch resume, elastic resume under another world size, a killed rank."""

import json
import logging
import os
import warnings

import pytest
from torch.utils.data import DataLoader
from torch.utils.data.datapipes.iter import IterableWrapper
from torchdata.stateful_dataloader import StatefulDataLoader

import distshard
from distshard.state import validate_state
from distshard.verify import run_on_group

from . import builds
from .helpers import as_worker, multiset

TIMEOUT = 60


class _Stream:
    def __init__(self, data):
        self.data = data

    def __iter__(self):
        return iter(self.data)


def _units(n_units=9):
    sizes = [(5 * u) % 13 for u in range(n_units)]
    elements = {}
    for u, size in enumerate(sizes):
        elements[u] = [f"u{u}e{i}" for i in range(size)]
    return sizes, elements


def _upper(x):
    return x.upper() if isinstance(x, str) else x


SIZES, UNIT_ELEMENTS = _units()

PIPES = {
    "fast path": lambda even, r, w: (
        IterableWrapper([f"s{i}" for i in range(103)]).map(_upper).dist_shard(rank=r, world_size=w, even=even)
    ),
    "stream + shuffle": lambda even, r, w: (
        IterableWrapper(_Stream([f"s{i}" for i in range(103)]), deepcopy=False)
        .shuffle()
        .dist_shard(rank=r, world_size=w, even=even)
        .map(_upper)
    ),
    "shuffle=True": lambda even, r, w: IterableWrapper(range(103)).dist_shard(
        rank=r, world_size=w, even=even, shuffle=True
    ),
    "units + sizes": lambda even, r, w: IterableWrapper(list(UNIT_ELEMENTS)).dist_shard(
        rank=r, world_size=w, even=even, expand=UNIT_ELEMENTS.__getitem__, sizes=SIZES
    ),
    "units": lambda even, r, w: IterableWrapper(list(UNIT_ELEMENTS)).dist_shard(
        rank=r, world_size=w, expand=lambda u: iter(UNIT_ELEMENTS[u])
    ),
}


def _cases():
    for name in PIPES:
        for even in (None,) if name == "units" else (None, "drop", "pad"):
            yield name, even


@pytest.mark.parametrize("name, even", list(_cases()))
def test_plain_loop_resume_equals_an_uninterrupted_run(name, even):
    def make(*args):
        return distshard.StatefulPipeline(PIPES[name](*args))

    for world, workers in [(1, 0), (3, 0), (2, 2)]:
        for rank in range(world):
            for worker in range(max(1, workers)):
                with as_worker(worker, workers):
                    full = list(make(even, rank, world).set_epoch(2))
                    for k in sorted({0, 1, len(full) // 2, len(full) - 1, len(full)}):
                        pipe = make(even, rank, world).set_epoch(2)
                        it = iter(pipe)
                        head = [next(it) for _ in range(k)]
                        state = json.loads(json.dumps(pipe.state_dict()))  # JSON all the way
                        fresh = make(even, rank, world)
                        fresh.load_state_dict(state)
                        fresh.set_epoch(2)  # what a training loop does next: keeps the resume
                        assert head + list(fresh) == full, (name, even, world, rank, worker, k)


@pytest.mark.parametrize("even", [None, "drop", "pad"])
@pytest.mark.parametrize("world2", [1, 2])
def test_a_pad_yielded_before_its_own_position_leaves_that_position_to_come(even, world2):
    """8 slots over a 2-element stream under "pad": slot 7 owns nothing and repeats
    e1 (an element of the start of the stream) while slot 1, which owns e1, has not
    run yet. A pad consumes no position: after merging the eight states, e0 and e1
    are both still to come under any ``even``, so e1 is seen twice in all, the one
    repeat "pad" allows, and nothing is lost (found by the model, whose oracle had
    counted the pad as e1's own position)."""

    def make(rank, world, even):
        return IterableWrapper(_Stream(["e0", "e1"])).dist_shard(rank=rank, world_size=world, even=even)

    states, seen = [], []
    for rank in range(8):
        pipe = make(rank, 8, "pad")
        if rank == 7:
            seen += list(pipe)
        states.append(json.loads(json.dumps(pipe.state_dict())))
    assert seen == ["e1"]
    merged = distshard.merge_states(states)
    rest = []
    for rank in range(world2):
        pipe = make(rank, world2, even)
        pipe.load_state_dict(merged)
        rest += list(pipe)
    assert sorted(rest) == ["e0", "e1"]


def test_state_at_the_end_of_an_epoch_resumes_an_empty_rest_then_set_epoch_starts_the_next():
    def make():
        return distshard.StatefulPipeline(PIPES["stream + shuffle"](None, 0, 2))

    pipe = make().set_epoch(4)
    list(pipe)
    state = pipe.state_dict()
    assert state["shard"]["finished"] and state["shard"]["epoch"] == 4
    fresh = make()
    fresh.load_state_dict(state)
    assert fresh.shard.epoch == 4
    assert list(fresh) == []  # nothing is left of epoch 4
    assert list(fresh.set_epoch(5)) == list(make().set_epoch(5)) != list(make().set_epoch(4))
    # set_epoch before the load (as StatefulDataLoader loads in its workers): the same
    late = make().set_epoch(5)
    late.load_state_dict(state)
    assert list(late) == list(make().set_epoch(5))


def test_checkpoint_after_the_last_batch_with_workers_then_next_epoch_is_whole():
    """Issue 8, item 1: every worker yielded its last batch but none saw StopIteration."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make():
        return distshard.StatefulPipeline(
            IterableWrapper(list(range(23))).shuffle().dist_shard(rank=1, world_size=2, seed=3).batch(3)
        )

    for workers in (0, 2):
        loader = StatefulDataLoader(make(), batch_size=None, num_workers=workers)
        it = iter(loader)
        first = [x for _ in range(4) for x in next(it)]
        assert len(first) == 11
        state = loader.state_dict()
        del it
        pipeline = make()
        fresh = StatefulDataLoader(pipeline, batch_size=None, num_workers=workers)
        fresh.load_state_dict(state)
        pipeline.set_epoch(1)
        second = [x for batch in fresh for x in batch]
        assert len(second) == 11, (workers, second)
        expected = [
            x for batch in StatefulDataLoader(make().set_epoch(1), batch_size=None, num_workers=workers) for x in batch
        ]
        assert sorted(second) == sorted(expected)


def test_resume_does_not_run_maps_on_skipped_elements():
    calls = []

    def spy(x):
        calls.append(x)
        return x

    def make():
        return IterableWrapper(_Stream(range(1000)), deepcopy=False).map(spy).dist_shard(rank=1, world_size=4)

    pipe = make()
    it = iter(pipe)
    for _ in range(200):
        next(it)
    state = pipe.state_dict()
    calls.clear()
    fresh = make()
    fresh.load_state_dict(state)
    assert next(iter(fresh)) == 801
    assert calls == [801]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("k", [0, 5, 16, 34])
def test_stateful_dataloader_resumes_exactly_without_fast_forwarding(workers, k, tmp_path, monkeypatch, caplog):
    """The resumed loader neither re-reads the consumed prefix (every record the
    map after dist_shard sees, in any process, is one it then yields) nor logs
    torchdata's "naively fast-forwarding"."""
    monkeypatch.setenv(builds.COUNT_DIR, str(tmp_path))

    def loader():
        pipeline = distshard.StatefulPipeline(builds.resume_pipeline_counted()).set_epoch(1)
        kwargs = {"multiprocessing_context": "fork"} if workers else {}
        return StatefulDataLoader(pipeline, batch_size=None, num_workers=workers, **kwargs)

    full = [b for b in loader()]
    slots = max(1, workers)
    assert len(full) == slots * -(-(203 // slots) // 3)  # even="drop", batch(3) per slot
    first = loader()
    it = iter(first)
    head = [next(it) for _ in range(k)]
    state = json.loads(json.dumps(first.state_dict()))
    del it, first
    for name in os.listdir(tmp_path):  # count only what the resumed loader decodes
        os.remove(tmp_path / name)
    second = loader()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        second.load_state_dict(state)
        rest = list(second)
    assert not [w for w in caught if "fast-forward" in str(w.message)]
    assert "fast-forward" not in caplog.text
    assert head + rest == full
    decoded = builds.counted(str(tmp_path), "decode")
    assert sum(decoded.values()) == sum(len(batch) for batch in rest)


def test_torch_dataloader_without_workers_resumes_exactly():
    def loader():
        return DataLoader(distshard.StatefulPipeline(builds.resume_pipeline()), batch_size=None)

    full = list(loader())
    first = loader()
    it = iter(first)
    head = [next(it) for _ in range(10)]
    state = first.dataset.state_dict()
    second = loader()
    second.dataset.load_state_dict(state)
    assert head + list(second) == full


# -- elastic resume ----------------------------------------------------------------------


def _epoch_ids():
    return multiset(r["id"] for r in builds.records(builds.N_RESUME))


@pytest.mark.parametrize("world2, workers2", [(3, 1), (1, 3)])
def test_elastic_resume_on_real_groups(world2, workers2):
    first = run_on_group(builds.run_and_checkpoint, world_size=2, args=(2, 5), timeout=TIMEOUT)
    assert all(o.error is None for o in first), [o.error for o in first]
    before = [i for o in first for i in o.value[0]]
    merged = distshard.merge_states([o.value[1] for o in first])
    assert merged["slot"] is None and not merged["finished"]
    merged = json.loads(json.dumps(merged))
    second = run_on_group(builds.run_and_checkpoint, world_size=world2, args=(workers2, None, merged), timeout=TIMEOUT)
    assert all(o.error is None for o in second), [o.error for o in second]
    after = [i for o in second for i in o.value[0]]
    assert not set(before) & set(after)
    everything = _epoch_ids()
    union = multiset(before + after)
    assert not union - everything  # nothing twice
    # everything but the new run's even="drop" tail (< its slot count) was consumed
    assert 0 <= sum((everything - union).values()) < world2 * workers2


def test_killed_rank_restarts_from_its_checkpoint(tmp_path):
    """Rank 1 is SIGKILLed three steps after the checkpoint; the job restarts from
    the checkpoint files with the same world size, then again with another."""
    crashed = run_on_group(builds.run_and_checkpoint, world_size=2, args=(2, 4, None, 1, str(tmp_path)), timeout=60)
    assert crashed[1].error and "no result" in crashed[1].error  # killed, never answered
    assert crashed[0].error  # its peer failed instead of hanging
    saved = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    before = [i for s in saved for i in s["consumed"]]
    everything = _epoch_ids()

    # same world size: every rank loads its own loader state
    same = run_on_group(_resume_same, world_size=2, args=(saved,), timeout=TIMEOUT)
    assert all(o.error is None for o in same), [o.error for o in same]
    after = [i for o in same for i in o.value]
    assert multiset(before + after) == everything - _tail(everything, before + after)
    assert not set(before) & set(after)

    # another world size: merge the checkpoint files, every rank loads the merge
    merged = distshard.merge_states([s["state"] for s in saved])
    other = run_on_group(builds.run_and_checkpoint, world_size=3, args=(1, None, merged), timeout=TIMEOUT)
    assert all(o.error is None for o in other), [o.error for o in other]
    after = [i for o in other for i in o.value[0]]
    assert not set(before) & set(after)
    assert not multiset(before + after) - everything
    assert sum((everything - multiset(before + after)).values()) < 3


def _tail(everything, got):
    return everything - multiset(got)


def _resume_same(rank, world_size, saved):
    import torch
    import torch.distributed as dist

    pipeline = distshard.StatefulPipeline(builds.resume_pipeline())
    loader = StatefulDataLoader(pipeline, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60)
    loader.load_state_dict(saved[rank]["state"])
    consumed, grad = [], torch.zeros(2)
    for batch in loader:
        consumed.extend(r["id"] for r in batch)
        dist.all_reduce(grad)
    return consumed


# -- bad states -----------------------------------------------------------------------------


def _good_state():
    pipe = IterableWrapper(range(20)).dist_shard(rank=0, world_size=2)
    it = iter(pipe)
    next(it)
    return pipe.state_dict()


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda s: "nope", "expected a dict, got str"),
        (lambda s: {"epoch": 1}, "no 'distshard' key"),
        (lambda s: {**s, "distshard": 99}, "version 99"),
        (lambda s: {k: v for k, v in s.items() if k != "taken"}, r"missing keys \['taken'\]"),
        (lambda s: {**s, "taken": -1}, "taken=-1 must be at least 0"),
        (lambda s: {**s, "epoch": "1"}, "epoch='1' must be an int"),
        (lambda s: {**s, "slot": 5}, r"slot=5 is outside \[0, num_slots=2\)"),
        (lambda s: {**s, "slot": None}, "both be set"),
        (lambda s: {**s, "even": "Drop"}, "even='Drop' is not one of"),
        (lambda s: {**s, "mode": "magic"}, "mode='magic' is not one of"),
        (lambda s: {**s, "remaining": [[5, 2], [1, 3]]}, r"empty or inverted interval \[5, 2\]"),
        (lambda s: {**s, "remaining": [[5, 9], [1, 3]]}, "overlap or are out of order"),
        (lambda s: {**s, "remaining": "all"}, "must be a list of"),
        (lambda s: {**s, "finished": "no"}, "finished='no' must be True or False"),
    ],
)
def test_malformed_states_are_rejected_and_leave_the_pipe_unchanged(mutate, words):
    pipe = IterableWrapper(range(20)).dist_shard(rank=0, world_size=2).set_epoch(3)
    before = pipe.state_dict()
    with pytest.raises(ValueError, match=words):
        pipe.load_state_dict(mutate(_good_state()))
    assert pipe.state_dict() == before and pipe.epoch == 3
    assert list(pipe) == list(range(0, 20, 2))


def test_states_from_other_pipelines_or_slots_are_refused():
    state = _good_state()  # slot 0 of 2, element mode
    units = IterableWrapper(["a"]).dist_shard(rank=0, world_size=2, expand=list)
    with pytest.raises(ValueError, match="mode='element' but this dist_shard has mode='units'"):
        units.load_state_dict(state)
    dropper = IterableWrapper(range(20)).dist_shard(rank=0, world_size=2, even="drop")
    with pytest.raises(ValueError, match="saved with even=None"):
        dropper.load_state_dict(state)
    other_slot = IterableWrapper(range(20)).dist_shard(rank=1, world_size=3)
    other_slot.load_state_dict(state)
    for _ in range(2):  # refused at every iteration, never used up by the first refusal
        with pytest.raises(ValueError, match="slot 0 of 2's, but this copy is slot 1 of 3.*merge_states"):
            list(other_slot)


def test_a_state_of_a_shuffle_true_pipe_is_refused_by_an_unshuffled_one_and_back():
    """Issue 8, item 3: positions mean other elements under shuffle=True."""
    shuffled = IterableWrapper(range(20)).dist_shard(rank=0, world_size=2, shuffle=True)
    it = iter(shuffled)
    next(it)
    plain = IterableWrapper(range(20)).dist_shard(rank=0, world_size=2)
    with pytest.raises(ValueError, match="shuffle=True but this dist_shard has shuffle=False"):
        plain.load_state_dict(shuffled.state_dict())
    with pytest.raises(ValueError, match="shuffle=False but this dist_shard has shuffle=True"):
        IterableWrapper(range(20)).dist_shard(rank=0, world_size=2, shuffle=True).load_state_dict(_good_state())


def test_a_state_of_other_data_is_refused_and_the_loaded_state_is_kept():
    """Issue 8, item 3: a state of a 20-element epoch loaded into 25 elements."""
    state = _good_state()
    longer = IterableWrapper(range(25)).dist_shard(rank=0, world_size=2)
    with pytest.raises(ValueError, match="had 20 elements, this pipeline's has 25"):
        longer.load_state_dict(state)
    other_values = IterableWrapper([f"x{i}" for i in range(20)]).dist_shard(rank=0, world_size=2)
    with pytest.raises(ValueError, match="source="):
        other_values.load_state_dict(state)
    # a pipe that already holds a good state keeps it when a bad one is refused
    pipe = IterableWrapper(range(20)).dist_shard(rank=0, world_size=2)
    pipe.load_state_dict(state)
    with pytest.raises(ValueError):
        pipe.load_state_dict({**state, "shuffle": True})
    assert list(pipe) == list(range(2, 20, 2))


@pytest.mark.parametrize(
    "tamper",
    [
        {"taken": 10**12},
        {"taken": 11},
        {"remaining": [[0, 40]]},
        {"remaining": [[30, None]]},
    ],
)
def test_tampered_states_beyond_the_data_raise_instead_of_yielding_nothing(tamper):
    state = {**_good_state(), **tamper}
    pipe = IterableWrapper(range(20)).dist_shard(rank=0, world_size=2)
    with pytest.raises(ValueError, match="altered|beyond"):
        pipe.load_state_dict(state)
        list(pipe)


def test_a_stream_shorter_than_the_state_claims_raises_before_yielding():
    stream = IterableWrapper(_Stream(list(range(20))), deepcopy=False).shuffle()
    pipe = stream.dist_shard(rank=0, world_size=2, seed=1)
    it = iter(pipe)
    next(it)
    state = {**pipe.state_dict(), "taken": 500}
    fresh = IterableWrapper(_Stream(list(range(20))), deepcopy=False).shuffle().dist_shard(rank=0, world_size=2, seed=1)
    fresh.load_state_dict(state)
    for _ in range(2):  # every time: the refused state is not used up
        with pytest.raises(ValueError, match="yielded 500 elements, but the stream"):
            next(iter(fresh))


def test_merge_refuses_huge_or_impossible_counts_quickly():
    """Issue 8, item 4: taken=10**12 of a 10-element epoch must not walk 10**12 positions."""
    states = []
    for rank in range(2):
        pipe = IterableWrapper(range(10)).dist_shard(rank=rank, world_size=2)
        it = iter(pipe)
        next(it)
        states.append(pipe.state_dict())
    with pytest.raises(ValueError, match="share"):
        distshard.merge_states([states[0], {**states[1], "taken": 10**12}])
    streams = []
    for rank in range(2):
        pipe = IterableWrapper(_Stream(list(range(10))), deepcopy=False).dist_shard(rank=rank, world_size=2)
        it = iter(pipe)
        next(it)
        streams.append(pipe.state_dict())
    with pytest.raises(ValueError, match="differ by too much"):
        distshard.merge_states([streams[0], {**streams[1], "taken": 10**12}])


def test_merge_after_a_resumed_run_with_another_even():
    """Issue 8, item 4: the new run uses even='drop', a slot that yielded nothing yet
    reports the merged state it loaded (even=None)."""
    old = []
    for rank in range(2):
        pipe = IterableWrapper(range(30)).dist_shard(rank=rank, world_size=2)
        it = iter(pipe)
        for _ in range(3):
            next(it)
        old.append(pipe.state_dict())
    merged = distshard.merge_states(old)
    new = [IterableWrapper(range(30)).dist_shard(rank=r, world_size=3, even="drop") for r in range(3)]
    consumed = []
    for pipe in new:
        pipe.load_state_dict(merged)
    it = iter(new[0])
    consumed.append(next(it))
    again = distshard.merge_states([p.state_dict() for p in new])
    rest = []
    for r in range(2):
        pipe = IterableWrapper(range(30)).dist_shard(rank=r, world_size=2)
        pipe.load_state_dict(again)
        rest += list(pipe)
    first = [x for x in range(30) if x < 6]
    got = first + consumed + rest
    assert sorted(got) == list(range(30))


def test_merge_needs_every_slot_once():
    pipes = [IterableWrapper(range(20)).dist_shard(rank=r, world_size=3) for r in range(3)]
    states = []
    for pipe in pipes:
        it = iter(pipe)
        next(it)
        states.append(pipe.state_dict())
    with pytest.raises(ValueError, match=r"slots \[2\] of 3 are missing"):
        distshard.merge_states(states[:2])
    with pytest.raises(ValueError, match="slot 1 appears twice"):
        distshard.merge_states(states + [states[1]])
    with pytest.raises(ValueError, match="disagree on epoch"):
        distshard.merge_states(states[:2] + [{**states[2], "epoch": 7}])
    merged = distshard.merge_states(states)
    assert merged["remaining"] == [[3, 20]]  # the fast path knows the length
    assert validate_state(merged) == merged


@pytest.mark.parametrize("k", [1, 2, 9])
def test_merge_right_after_the_first_batches_and_resume_with_other_workers(k):
    """With 2 workers, after one batch one worker has yielded nothing: its state
    knows no slot yet, and the merge must still be exact."""

    def loader(workers, state=None):
        pipeline = distshard.StatefulPipeline(builds.resume_pipeline(even=None))
        if state is not None:
            pipeline.load_state_dict(state)
        return StatefulDataLoader(pipeline, batch_size=None, num_workers=workers, multiprocessing_context="fork")

    first = loader(2)
    it = iter(first)
    head = [r["id"] for _ in range(k) for r in next(it)]
    merged = distshard.merge_states([first.state_dict()])
    del it, first
    rest = [r["id"] for batch in loader(3, merged) for r in batch]
    assert multiset(head + rest) == multiset(r["id"] for r in builds.records(builds.N_RESUME))


def test_gather_states_merges_every_rank_collectively():
    outcomes = run_on_group(builds.gather_after, world_size=2, args=(4,), timeout=TIMEOUT)
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    merged = [o.value[1] for o in outcomes]
    assert merged[0] == merged[1] and merged[0]["slot"] is None  # every rank gets the same merge
    before = [i for o in outcomes for i in o.value[0]]
    pipeline = distshard.StatefulPipeline(builds.resume_pipeline())
    pipeline.load_state_dict(merged[0])  # one process finishes the epoch
    after = [r["id"] for batch in pipeline for r in batch]
    assert not set(before) & set(after)
    assert multiset(before + after) == _epoch_ids()  # one slot: even="drop" drops nothing
