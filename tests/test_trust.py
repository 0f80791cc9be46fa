"""Regression tests for the review of issue 8: each reproduces a way data was lost,
repeated or mis-reported silently, and checks it is now exact or refused loudly."""

from __future__ import annotations

from collections import Counter

import pytest
from torch.utils.data import DataLoader
from torch.utils.data.datapipes.iter import IterableWrapper

import distshard

from .helpers import as_worker

SIZES = [5, 3, 7, 4, 6, 5]
UNITS = {u: [f"u{u}e{i}" for i in range(n)] for u, n in enumerate(SIZES)}
ALL = [e for u in UNITS for e in UNITS[u]]


def _sized(rank, world, **kw):
    return IterableWrapper(list(UNITS)).dist_shard(
        rank=rank, world_size=world, expand=UNITS.__getitem__, sizes=SIZES, **kw
    )


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("even", [None, "drop", "pad"])
def test_elastic_resume_of_units_with_sizes_and_shuffle_is_exact(shuffle, even):
    """Item 2: 3 ranks take r + 2 elements each, merge, resume on 2 ranks."""
    first, states = [], []
    for rank in range(3):
        pipe = _sized(rank, 3, shuffle=shuffle, seed=5, even=even)
        it = iter(pipe)
        first += [next(it) for _ in range(rank + 2)]
        states.append(pipe.state_dict())
    merged = distshard.merge_states(states)
    second = []
    counts = []
    for rank in range(2):
        pipe = _sized(rank, 2, shuffle=shuffle, seed=5, even=even)
        pipe.load_state_dict(merged)
        got = list(pipe)
        counts.append(len(got))
        second += got
    together = Counter(first + second)
    assert not [e for e, n in together.items() if n > 1] or even == "pad"
    missing = set(ALL) - set(together)
    if even == "drop":
        assert len(missing) < 2 and len(set(counts)) == 1
    else:
        assert not missing
    if even == "pad":
        assert sum(together.values()) - len(ALL) < 2 and len(set(counts)) == 1


def test_an_iterator_expand_yielding_more_than_its_size_raises():
    """Item 5: sizes=[1]*10 but every unit yields 2: never extra elements, a clear error."""
    for even in (None, "drop"):
        slots = []
        for rank in range(4):
            pipe = IterableWrapper(list(range(10))).dist_shard(
                rank=rank, world_size=4, even=even, expand=lambda u: iter([(u, 0), (u, 1)]), sizes=[1] * 10
            )
            with pytest.raises(ValueError, match=r"unit \d+ has more than 1 elements but sizes says 1"):
                slots.append(list(pipe))


def test_an_iterator_expand_yielding_fewer_than_its_size_raises():
    pipe = IterableWrapper(list(range(4))).dist_shard(rank=0, world_size=1, expand=lambda u: iter([u]), sizes=[2] * 4)
    with pytest.raises(ValueError, match="unit 0 has only 1 elements but sizes says 2"):
        list(pipe)


def test_expand_returning_a_non_iterable_names_the_unit():
    pipe = IterableWrapper(["a.tar", "b.tar"]).dist_shard(rank=0, world_size=1, expand=lambda u: 42)
    with pytest.raises(TypeError, match=r"expand\('a.tar'\) returned int, which is not iterable"):
        list(pipe)


def test_len_after_a_resume_counts_the_run_the_state_belongs_to():
    """len() follows StatefulDataLoader's convention: a slot's own state keeps the
    epoch's count (Lightning compares its restored batch counter with len(loader):
    a remaining-count len made it stop 7 batches early, 56 elements an epoch);
    a merged state starts a new run over what is left."""
    pipe = IterableWrapper(range(20)).dist_shard(rank=0, world_size=2)
    it = iter(pipe)
    for _ in range(3):
        next(it)
    fresh = IterableWrapper(range(20)).dist_shard(rank=0, world_size=2)
    fresh.load_state_dict(pipe.state_dict())
    assert len(fresh) == 10 and len(list(fresh)) == 7
    states = []
    for rank in range(2):
        p = IterableWrapper(range(20)).dist_shard(rank=rank, world_size=2)
        it = iter(p)
        next(it)
        states.append(p.state_dict())
    merged = distshard.merge_states(states)
    lengths = []
    for rank in range(3):
        p = IterableWrapper(range(20)).dist_shard(rank=rank, world_size=3, even="drop")
        p.load_state_dict(merged)
        lengths.append((len(p), len(list(p))))
    assert lengths == [(6, 6)] * 3


def test_len_in_the_main_process_counts_the_workers_of_the_loader_that_iterates_it():
    """Item 10: 5 where the loader yields 4 with even='drop', 2 workers."""
    pipe = IterableWrapper(range(22)).dist_shard(rank=0, world_size=2, even="drop")
    assert len(pipe) == 11  # no loader seen yet: the rank's own process, 22 // 2
    loader = DataLoader(pipe, batch_size=None, num_workers=2)
    assert len(loader) == 10  # len(loader) sees the loader's workers: 2 x (22 // 4)
    got = list(loader)
    assert len(got) == 10
    assert len(pipe) == 10  # and the pipe remembers the loader that iterated it


def test_two_shuffled_branches_of_one_pipeline_do_not_shuffle_alike():
    """Item 12: zipped .shuffle().dist_shard() branches got identical orders."""
    left = IterableWrapper(list(range(50))).shuffle().dist_shard(rank=0, world_size=1)
    right = IterableWrapper(list(range(100, 150))).shuffle().dist_shard(rank=0, world_size=1)
    pairs = list(left.zip(right))
    assert [a for a, _ in pairs] != [b - 100 for _, b in pairs]
    # and each branch is still the same on every slot (its order does not depend on the process)
    again = IterableWrapper(list(range(50))).shuffle().dist_shard(rank=0, world_size=1)
    assert list(again) == [a for a, _ in pairs]


def test_set_epoch_reaches_through_a_stateful_pipeline_and_a_loader():
    """Item 9: distshard.set_epoch(StatefulPipeline(...), e) raised from torch's graph walk."""
    shard = IterableWrapper(range(10)).shuffle().dist_shard(rank=0, world_size=1)
    pipeline = distshard.StatefulPipeline(shard.map(str))
    distshard.set_epoch(pipeline, 3)
    assert shard.epoch == 3
    distshard.set_epoch(DataLoader(pipeline, batch_size=None), 4)
    assert shard.epoch == 4
    distshard.set_epoch(DataLoader(shard, batch_size=None), 5)  # torch wraps a DataPipe dataset
    assert shard.epoch == 5


def test_pad_and_drop_counts_per_slot_hold_in_workers_after_elastic_resume():
    states = []
    for rank in range(2):
        for worker in range(2):
            with as_worker(worker, 2):
                p = IterableWrapper(range(41)).dist_shard(rank=rank, world_size=2)
                it = iter(p)
                for _ in range(worker + 1):
                    next(it)
                states.append(p.state_dict())
    merged = distshard.merge_states(states)
    counts = []
    for rank in range(3):
        p = IterableWrapper(range(41)).dist_shard(rank=rank, world_size=3, even="pad")
        p.load_state_dict(merged)
        counts.append(len(list(p)))
    assert len(set(counts)) == 1


@pytest.mark.parametrize("source", ["list", "stream", "units"])
@pytest.mark.parametrize("world, workers", [(2, 2), (3, 1), (1, 3)])
def test_multiple_of_makes_every_batch_full_and_len_exact(source, world, workers):
    """Issue 9: len(loader) said 25 batches while 2 workers delivered 26 (partial batches)."""
    n = 203

    def build(rank):
        if source == "units":
            sizes = [7, 0, 31, 50, 15, 100]
            return IterableWrapper(list(range(6))).dist_shard(
                rank=rank,
                world_size=world,
                even="drop",
                multiple_of=4,
                expand=lambda u: [(u, i) for i in range(sizes[u])],
                sizes=sizes,
            )
        data = list(range(n)) if source == "list" else _OnlyIter(list(range(n)))
        return IterableWrapper(data, deepcopy=False).dist_shard(rank=rank, world_size=world, even="drop", multiple_of=4)

    seen, batches = [], []
    for rank in range(world):
        for worker in range(workers):
            with as_worker(worker, workers if workers > 1 else 0):
                got = list(build(rank).batch(4))
            batches.append(len(got))
            assert all(len(b) == 4 for b in got)
            seen += [x for b in got for x in b]
    assert len(set(batches)) == 1 and len(seen) == len(set(seen))
    assert n - len(seen) < world * workers * 4
    loader = DataLoader(build(0).batch(4), batch_size=None, num_workers=workers if workers > 1 else 0)
    if source != "stream":  # a stream has no length
        assert len(loader) == batches[0] * workers
    assert len(list(loader)) == batches[0] * workers


def test_multiple_of_needs_drop_and_an_int():
    with pytest.raises(ValueError, match="multiple_of=4 needs even='drop'"):
        IterableWrapper(range(3)).dist_shard(multiple_of=4)
    with pytest.raises(TypeError, match="multiple_of=2.0 must be an int"):
        IterableWrapper(range(3)).dist_shard(even="drop", multiple_of=2.0)
    with pytest.raises(ValueError, match="multiple_of=0 must be at least 1"):
        IterableWrapper(range(3)).dist_shard(even="drop", multiple_of=0)


def test_multiple_of_stream_resume_is_exact():
    def build():
        return IterableWrapper(_OnlyIter(list(range(50))), deepcopy=False).dist_shard(
            rank=1, world_size=2, even="drop", multiple_of=4
        )

    full = list(build())
    assert len(full) == 24
    for k in range(len(full) + 1):
        pipe = build()
        it = iter(pipe)
        head = [next(it) for _ in range(k)]
        fresh = build()
        fresh.load_state_dict(pipe.state_dict())
        assert head + list(fresh) == full


class _OnlyIter:
    def __init__(self, data):
        self.data = data

    def __iter__(self):
        return iter(self.data)


def test_len_of_a_batch_after_the_shard_refuses_to_be_wrong_with_workers():
    """Issue 9: len(loader) said 25 batches where 2 workers deliver 26; a loop that
    stops after len(loader) batches (Lightning) skipped 2 elements per rank."""
    pipe = IterableWrapper(range(203)).dist_shard(rank=0, world_size=2, even="drop").batch(4)
    loader = DataLoader(pipe, batch_size=None, num_workers=2)
    with pytest.raises(TypeError) as raised:
        len(loader)  # torch's wrapper re-raises our TypeError as its own, with ours as the cause
    assert "yields 26 batches, not 25; pass dist_shard(even='drop', multiple_of=4)" in str(raised.value.__cause__)
    assert len(list(loader)) == 26
    aligned = IterableWrapper(range(203)).dist_shard(rank=0, world_size=2, even="drop", multiple_of=4).batch(4)
    loader = DataLoader(aligned, batch_size=None, num_workers=2)
    assert len(loader) == 24 == len(list(loader))
    assert len(DataLoader(pipe, batch_size=None)) == 26  # one copy per rank: exact as it is
