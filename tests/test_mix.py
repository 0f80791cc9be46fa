"""distshard.mix and distshard.weighted_sample: exact proportions, one global
stream at any world size, read once, exactly once over real groups."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data.datapipes.iter import IterableWrapper

import distshard

from . import builds
from .helpers import as_worker

TIMEOUT = 90


def _sources(sizes):
    return {f"s{i}": IterableWrapper([f"s{i}-{j}" for j in range(n)]) for i, n in enumerate(sizes)}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 60), st.floats(0.01, 1000)), min_size=2, max_size=8))
def test_every_prefix_of_the_mix_is_within_one_of_its_share(spec):
    sizes, weights = zip(*spec)
    names = [f"s{i}" for i in range(len(sizes))]
    mixed = list(distshard.mix(_sources(sizes), dict(zip(names, weights)), stop="first_exhausted"))
    total = sum(weights)
    counts = Counter()
    for p, element in enumerate(mixed, 1):
        counts[element.split("-")[0]] += 1
        for name, w in zip(names, weights):
            assert abs(counts[name] - p * w / total) < 1 + 1e-9


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted"])
@pytest.mark.parametrize("world, workers", [(1, 0), (2, 0), (2, 2), (4, 2), (3, 1)])
def test_the_same_global_stream_at_any_world_size(stop, world, workers):
    """Gather every slot's elements and put them back in position order."""
    expected = list(builds.mixed_sources(stop))
    num_slots = world * max(1, workers)
    placed = {}
    for rank in range(world):
        for worker in range(max(1, workers)):
            with as_worker(worker, workers):
                pipe = builds.mixed_sources(stop).dist_shard(rank=rank, world_size=world)
                slot = rank * max(1, workers) + worker
                for t, element in enumerate(pipe):
                    placed[slot + t * num_slots] = element
    assert [placed[p] for p in range(len(placed))] == expected


def test_all_exhausted_cycles_a_short_source_until_every_source_was_seen_whole():
    mixed = list(builds.mixed_sources("all_exhausted"))
    counts = Counter(e.rstrip("0123456789") for e in mixed)
    assert counts["web"] >= 140 and counts["code"] >= 37
    assert counts["math"] == 23  # the last source to be seen whole ends the stream, seen once
    assert mixed[-1] == "math22"
    for name, n in (("web", 140), ("code", 37)):  # cycled: a whole pass, then the next from the start
        seen = [e for e in mixed if e.startswith(name)]
        assert seen[:n] == [f"{name}{i}" for i in range(n)] and seen[n:] == seen[:len(seen) - n]
    first = list(builds.mixed_sources("first_exhausted"))
    assert len(first) < len(mixed) and len(set(first)) == len(first)


def test_each_element_read_once_through_the_mix():
    """A slot reads only its own positions from each source (random access)."""
    reads = Counter()

    class Counting(list):
        __distshard_positional__ = True

        def __getitem__(self, i):
            reads[list.__getitem__(self, i)] += 1
            return list.__getitem__(self, i)

    def build(rank, world):
        web, code = Counting(range(100)), Counting(range(100, 130))
        return distshard.mix({"web": IterableWrapper(web, deepcopy=False),
                              "code": IterableWrapper(code, deepcopy=False)},
                             {"web": 3, "code": 1}, stop="first_exhausted").dist_shard(rank=rank, world_size=world)
    got = [x for rank in range(4) for x in build(rank, 4)]
    assert len(got) == len(set(got)) and set(reads.values()) == {1} and sum(reads.values()) == len(got)


@pytest.mark.parametrize("weights, words", [
    ({"a": 0, "b": 1}, "weight of source 'a' is 0"),
    ({"a": -1, "b": 1}, "weight of source 'a' is -1"),
    ({"a": float("nan"), "b": 1}, "weight of source 'a' is nan"),
    ({"a": 1}, "source 'b' has no weight"),
    ({"a": 1, "b": 1, "c": 1}, "weights name 'c', which is not a source"),
])
def test_bad_weights_name_the_source(weights, words):
    with pytest.raises(ValueError, match=words):
        distshard.mix({"a": IterableWrapper([1]), "b": IterableWrapper([2])}, weights)


def test_bad_mix_arguments():
    with pytest.raises(ValueError, match="non-empty mapping"):
        distshard.mix({}, {})
    with pytest.raises(TypeError, match="not a number"):
        distshard.mix({"a": IterableWrapper([1])}, {"a": True})
    with pytest.raises(ValueError, match="stop='longest' is not one of"):
        distshard.mix({"a": IterableWrapper([1])}, {"a": 1}, stop="longest")
    with pytest.raises(ValueError, match="source 'b' is empty"):
        list(distshard.mix({"a": IterableWrapper([1]), "b": IterableWrapper([])}, {"a": 1, "b": 1}))


def test_each_pass_of_a_shuffled_stream_source_comes_in_a_new_order():
    pipe = builds.mixed_streams_shuffled()
    pipe = pipe.source_datapipe  # the mix itself, iterated alone (one slot)
    got = [e for e in distshard.mix(
        {"web": IterableWrapper([f"web{i}" for i in range(60)]).shuffle(),
         "math": IterableWrapper([f"math{i}" for i in range(7)]).shuffle()}, {"web": 3, "math": 1})
        .dist_shard(rank=0, world_size=1, seed=5)]
    passes = [m for m in got if m.startswith("math")]
    first, second = passes[:7], passes[7:14]
    assert sorted(first) == sorted(second) == sorted(f"math{i}" for i in range(7))
    assert first != second


@pytest.mark.parametrize("build", [builds.mixed_first_exhausted_drop, builds.mixed_all_exhausted,
                                   builds.mixed_streams_shuffled, builds.weighted_draws])
def test_exactly_once_on_a_real_group_with_workers(build):
    report = distshard.verify(build, world_size=2, num_workers=2, timeout=TIMEOUT)
    assert report.ok, report.summary()


def test_weighted_draws_follow_the_weights_and_split_exactly():
    weights = [1 + (i % 5) for i in range(50)]
    draws = list(distshard.weighted_sample(IterableWrapper(list(range(50))), weights, samples=30000, seed=1))
    counts = Counter(draws)
    total = sum(weights)
    for i, w in enumerate(weights):
        expected = 30000 * w / total
        assert abs(counts[i] - expected) < 6 * math.sqrt(expected)
    def shard(rank, world):
        return distshard.weighted_sample(IterableWrapper(list(range(50))), weights, samples=301).dist_shard(
            rank=rank, world_size=world, seed=7)
    unsharded = list(shard(0, 1))
    assert unsharded != list(distshard.weighted_sample(IterableWrapper(list(range(50))), weights, samples=301)
                             .dist_shard(rank=0, world_size=1, seed=8))  # the seed matters
    slots = {}
    for rank in range(3):
        pipe = shard(rank, 3)
        for t, x in enumerate(pipe):
            slots[rank + 3 * t] = x
    assert [slots[p] for p in range(301)] == unsharded


def test_weighted_draws_resume_exactly_and_refuse_bad_weights():
    def build():
        return distshard.weighted_sample(IterableWrapper(list(range(20))), [1.0] * 20, samples=50).dist_shard(
            rank=1, world_size=2)
    full = list(build())
    pipe = build()
    it = iter(pipe)
    head = [next(it) for _ in range(7)]
    fresh = build()
    fresh.load_state_dict(pipe.state_dict())
    assert head + list(fresh) == full
    with pytest.raises(ValueError, match="weights has 3 entries but the source has 20"):
        distshard.weighted_sample(IterableWrapper(list(range(20))), [1, 2, 3], samples=5)
    with pytest.raises(ValueError, match=r"weights\[1\]=-1"):
        distshard.weighted_sample(IterableWrapper([1, 2]), [1, -1], samples=5)
    with pytest.raises(ValueError, match="needs random access"):
        distshard.weighted_sample(IterableWrapper([1, 2]).shuffle(), [1, 1], samples=5)


def test_each_training_step_is_consecutive_positions_with_dataloader_workers():
    """bench_mix found a training step's batch 26 elements off its share with 2
    workers per rank: a step's batch came from one worker, every other chunk of the
    stream. With multiple_of the chunk layout makes step t's batches, over all
    ranks, the consecutive positions [t W b, (t + 1) W b) of the mixed stream."""
    from torch.utils.data import DataLoader

    world, batch = 2, 4
    stream = list(builds.mixed_sources())
    loaders = [iter(DataLoader(builds.mixed_sources().dist_shard(rank=r, world_size=world, even="drop",
                                                                 multiple_of=batch).batch(batch),
                               batch_size=None, num_workers=2, multiprocessing_context="fork"))
               for r in range(world)]
    steps = 0
    for batches in zip(*loaders):
        got = [x for b in batches for x in b]
        assert got == stream[steps * world * batch:(steps + 1) * world * batch], steps
        steps += 1
    assert steps == len(stream) // (world * 2 * batch) * 2  # whole rounds of chunks
