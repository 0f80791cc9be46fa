"""dist_shard in one process: the whole ranks x workers x even x N x data grid,
composition, randomness, len and bad input. Real workers and gloo groups are in
test_dataloader.py and test_gloo.py."""

import itertools
from collections import Counter

import pytest
import torch
from torch.utils.data.datapipes.iter import IterableWrapper
from torch.utils.data.graph_settings import apply_sharding

import distshard
from distshard.plan import dropped_count, padded_count, slot_count, slot_positions
from distshard.verify import canonical

from .helpers import as_worker, multiset, run_slots, union

DATA = {
    "strings": lambda n: [f"s{i}" for i in range(n)],
    "dicts": lambda n: [{"id": f"r{i}", "x": i % 3} for i in range(n)],
    "tensors": lambda n: [torch.tensor([i, -i]) for i in range(n)],
    "duplicated": lambda n: [i % 3 for i in range(n)],
    "evens": lambda n: list(range(0, 2 * n, 2)),
}


def _grid():
    for world, workers, even, kind in itertools.product(range(1, 5), range(0, 4), (None, "drop", "pad"), DATA):
        slots = world * max(1, workers)
        for n in sorted({0, 1, slots - 1, slots, slots + 1, 1000}):
            yield world, workers, even, kind, n


class _Stream:
    """An iterable with no length and no indexing: forces the streaming path."""

    def __init__(self, data):
        self.data = data

    def __iter__(self):
        return iter(self.data)


def _identity(x):
    return x


SOURCES = {
    # random access: the fast path indexes the slot's positions
    "sequence": lambda data: IterableWrapper(data),
    # no random access: the slot walks the stream and keeps its positions
    "stream": lambda data: IterableWrapper(_Stream(data), deepcopy=False),
    # a 1:1 map over a stream: selection moves below the map (pushdown)
    "stream+map": lambda data: IterableWrapper(_Stream(data), deepcopy=False).map(_identity),
}


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("world, workers", list(itertools.product(range(1, 5), range(0, 4))))
def test_exactly_once_grid(world, workers, source):
    """world 1..4 x workers 0..3 x even x N in {0, 1, S-1, S, S+1, 1000} x five kinds
    of data x three ways of reading the source, each slot checked against the plan."""
    slots = world * max(1, workers)
    make = SOURCES[source]
    for even, kind in itertools.product((None, "drop", "pad"), DATA):
        for n in sorted({0, 1, slots - 1, slots, slots + 1, 1000}):
            data = DATA[kind](n)
            got = run_slots(
                lambda r, w, data=data, even=even: make(data).dist_shard(rank=r, world_size=w, even=even),
                world,
                workers,
            )
            # every element's canonical key once (a tensor's costs most): the checks compare keys
            keys = [canonical(x) for x in data]
            got_keys = {slot: [canonical(x) for x in got[slot]] for slot in range(slots)}
            for slot in range(slots):  # the exact positions, in order, on every path
                want = [keys[p] for p in slot_positions(slot, slots, n, even)]
                assert got_keys[slot] == want, (slot, even, kind, n)
            counts = [len(got[s]) for s in range(slots)]
            assert counts == [slot_count(s, slots, n, even) for s in range(slots)], (even, kind, n)
            everything, received = Counter(keys), Counter(k for slot in got_keys.values() for k in slot)
            if even is None:
                assert received == everything, (kind, n)
            elif even == "drop":
                assert received == Counter(keys[: n - n % slots]), (kind, n)
                assert sum(everything.values()) - sum(received.values()) == dropped_count(slots, n, even)
            else:
                assert not everything - received, (kind, n)  # nothing missing
                extra = received - everything
                assert sum(extra.values()) == padded_count(slots, n, even)
                assert set(extra) <= set(keys[:slots])  # repeats come from the start


def test_position_not_value_decides():
    """Each slot keeps positions p % S == slot, so its elements are in stream order."""
    data = ["c", "a", "b", "a", "z", "y", "x"]
    got = run_slots(lambda r, w: IterableWrapper(data).dist_shard(rank=r, world_size=w), 3, 0)
    assert got == {0: ["c", "a", "x"], 1: ["a", "z"], 2: ["b", "y"]}


def test_pad_repeats_the_slots_own_first_element():
    got = run_slots(lambda r, w: IterableWrapper(range(10)).dist_shard(rank=r, world_size=w, even="pad"), 4, 0)
    assert got == {0: [0, 4, 8], 1: [1, 5, 9], 2: [2, 6, 2], 3: [3, 7, 3]}
    tiny = run_slots(lambda r, w: IterableWrapper(["a", "b"]).dist_shard(rank=r, world_size=w, even="pad"), 5, 0)
    assert tiny == {0: ["a"], 1: ["b"], 2: ["a"], 3: ["b"], 4: ["a"]}


# -- composition --------------------------------------------------------------------


def _double(x):
    return 2 * x


def _keep_even(x):
    return x % 2 == 0


def _generator_source(n):
    yield from range(n)


@pytest.mark.parametrize(
    "name, build, expected",
    [
        (
            "map before",
            lambda r, w: IterableWrapper(range(50)).map(_double).dist_shard(rank=r, world_size=w),
            [2 * i for i in range(50)],
        ),
        (
            "map after",
            lambda r, w: IterableWrapper(range(50)).dist_shard(rank=r, world_size=w).map(_double),
            [2 * i for i in range(50)],
        ),
        (
            "filter before",
            lambda r, w: IterableWrapper(range(50)).filter(_keep_even).dist_shard(rank=r, world_size=w),
            list(range(0, 50, 2)),
        ),
        (
            "filter after",
            lambda r, w: IterableWrapper(range(50)).dist_shard(rank=r, world_size=w).filter(_keep_even),
            list(range(0, 50, 2)),
        ),
        (
            "batch after",
            lambda r, w: IterableWrapper(range(50)).dist_shard(rank=r, world_size=w).batch(4).unbatch(),
            list(range(50)),
        ),
        (
            "batch before",
            lambda r, w: IterableWrapper(range(50)).batch(4).dist_shard(rank=r, world_size=w).unbatch(),
            list(range(50)),
        ),
        (
            "shuffle before",
            lambda r, w: IterableWrapper(range(50)).shuffle().dist_shard(rank=r, world_size=w),
            list(range(50)),
        ),
        (
            "shuffle after",
            lambda r, w: IterableWrapper(range(50)).dist_shard(rank=r, world_size=w).shuffle(),
            list(range(50)),
        ),
        ("generator", lambda r, w: IterableWrapper(_GenIterable(50)).dist_shard(rank=r, world_size=w), list(range(50))),
    ],
)
def test_composes_with_datapipe_operations(name, build, expected):
    for world, workers in [(1, 0), (3, 0), (2, 3)]:
        got = run_slots(build, world, workers)
        assert union(got) == multiset(expected), (name, world, workers)


class _GenIterable:
    """An iterable whose ``__iter__`` is a generator (no length, no indexing)."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return _generator_source(self.n)


def test_batches_after_dist_shard_are_equal_per_slot_with_drop():
    """34 elements, 3 ranks x 2 workers, batch(4): where unequal slots would hang a DDP loop."""
    got = run_slots(
        lambda r, w: IterableWrapper(range(34)).dist_shard(rank=r, world_size=w, even="drop").batch(4),
        3,
        2,
    )
    assert {len(batches) for batches in got.values()} == {2}
    assert [len(b) for b in got[0]] == [4, 1]


# -- randomness -----------------------------------------------------------------------


def _shuffled(rank, world, *, epoch=0, seed=None, torch_seed=None):
    if torch_seed is not None:
        torch.manual_seed(torch_seed)
    pipe = IterableWrapper(range(200)).shuffle().dist_shard(rank=rank, world_size=world, seed=seed)
    return pipe.set_epoch(epoch)


def test_upstream_shuffle_is_synced_whatever_each_rank_torch_seed():
    """Every rank seeds torch differently (torch.manual_seed(rank)); no DataLoader."""
    got = run_slots(lambda r, w: _shuffled(r, w, torch_seed=1000 + r), 4, 0)
    assert union(got) == multiset(range(200))
    full = list(_shuffled(0, 1, torch_seed=7))
    assert full != list(range(200))  # it really shuffles
    for slot in range(4):
        assert got[slot] == full[slot::4]  # same upstream order on every slot


def test_orders_differ_between_epochs_and_seeds_but_not_between_runs():
    e0, e1 = list(_shuffled(0, 1, epoch=0)), list(_shuffled(0, 1, epoch=1))
    assert sorted(e0) == sorted(e1) == list(range(200)) and e0 != e1
    assert list(_shuffled(0, 1, epoch=1, torch_seed=5)) == e1
    assert list(_shuffled(0, 1, epoch=1, seed=3)) != e1
    for epoch in range(3):
        got = run_slots(lambda r, w, epoch=epoch: _shuffled(r, w, epoch=epoch, torch_seed=r), 2, 2)
        assert union(got) == multiset(range(200))


def test_two_random_pipes_get_different_seeds():
    pipe = IterableWrapper(range(100)).shuffle().map(_double).shuffle().dist_shard(rank=0, world_size=1)
    first, second = [p for p in distshard.graph.random_pipes(pipe.source_datapipe)]
    assert first is not second
    assert sorted(pipe) == [2 * i for i in range(100)]


def test_unsynced_sharding_filter_duplicates_where_dist_shard_does_not():
    """The classic trap, reproduced: shuffle before sharding_filter, per-rank torch seeds."""
    seen = Counter()
    for rank in range(4):
        torch.manual_seed(rank)
        pipe = IterableWrapper(range(1000)).shuffle().sharding_filter()
        apply_sharding(pipe, 4, rank)
        seen.update(pipe)
    assert sum(n > 1 for n in seen.values()) > 0  # the trap is real
    got = run_slots(lambda r, w: _shuffled(r, w, torch_seed=r), 4, 0)
    assert union(got) == multiset(range(200))


# -- torch's sharding hooks and double sharding -----------------------------------------


def test_torch_apply_sharding_does_not_change_the_partition():
    pipe = IterableWrapper(range(20)).dist_shard(rank=1, world_size=4)
    apply_sharding(pipe, 1, 0)  # what a DataLoader without workers calls (no torch.distributed)
    assert list(pipe) == [1, 5, 9, 13, 17]
    with as_worker(1, 2):
        apply_sharding(pipe, 2, 1)  # what worker 1 of 2 calls: changes nothing either
        assert list(pipe) == [3, 11, 19]  # slot 1 * 2 + 1 of 8


def test_apply_sharding_by_hand_is_honoured_as_an_explicit_split():
    """torch's own idiom (and what reading services do) must not be ignored silently."""
    pipe = IterableWrapper(range(20)).dist_shard()
    apply_sharding(pipe, 3, 1)
    assert list(pipe) == [1, 4, 7, 10, 13, 16, 19]
    assert pipe.context().source == "apply_sharding" and pipe.context().num_slots == 3
    slots = []
    for i in range(3):
        copy = IterableWrapper(range(20)).dist_shard()
        apply_sharding(copy, 3, i)
        slots += list(copy)
    assert sorted(slots) == list(range(20))


def test_apply_sharding_by_hand_in_dataloader_workers_is_refused():
    pipe = IterableWrapper(range(20)).dist_shard()
    apply_sharding(pipe, 3, 1)
    with as_worker(0, 2):
        with pytest.raises(RuntimeError, match="cannot honour both"):
            list(pipe)


def test_dataloader_shuffle_false_turns_shuffle_true_off():
    from torch.utils.data import DataLoader

    pipe = IterableWrapper(range(30)).dist_shard(shuffle=True, seed=1)
    assert list(DataLoader(pipe, batch_size=None, shuffle=False)) == list(range(30))
    pipe = IterableWrapper(range(30)).dist_shard(seed=1)
    shuffled = list(DataLoader(pipe, batch_size=None, shuffle=True))
    assert shuffled != list(range(30)) and sorted(shuffled) == list(range(30))


@pytest.mark.parametrize(
    "build",
    [
        lambda: IterableWrapper(range(8)).sharding_filter().dist_shard(),
        lambda: IterableWrapper(range(8)).dist_shard().map(_double).dist_shard(),
        lambda: IterableWrapper(range(8)).sharding_filter().map(_double).shuffle().dist_shard(),
    ],
)
def test_double_sharding_upstream_raises_at_construction(build):
    with pytest.raises(RuntimeError, match="sharding twice loses data"):
        build()


def test_sharding_filter_downstream_raises_before_the_first_element():
    pipe = IterableWrapper(range(8)).dist_shard(rank=0, world_size=2).map(_double).sharding_filter()
    with pytest.raises(RuntimeError, match="Sharding twice"):
        apply_sharding(pipe, 2, 0)


def test_sharding_filter_downstream_raises_in_a_dataloader():
    from torch.utils.data import DataLoader

    pipe = IterableWrapper(range(8)).dist_shard(rank=0, world_size=2).sharding_filter()
    with pytest.raises(RuntimeError, match="Sharding twice"):
        next(iter(DataLoader(pipe, batch_size=None)))


# -- len ----------------------------------------------------------------------------------


@pytest.mark.parametrize("even", [None, "drop", "pad"])
def test_len_is_the_rank_count_and_the_worker_count_inside_a_worker(even):
    for world, workers, n in [(3, 0, 10), (2, 3, 17), (4, 2, 5)]:
        got = run_slots(
            lambda r, w, n=n: IterableWrapper(range(n)).dist_shard(rank=r, world_size=w, even=even), world, workers
        )
        for rank in range(world):
            for worker in range(max(1, workers)):
                with as_worker(worker, workers):
                    pipe = IterableWrapper(range(n)).dist_shard(rank=rank, world_size=world, even=even)
                    assert len(pipe) == len(got[rank * max(1, workers) + worker])
        if workers == 0:
            for rank in range(world):
                assert len(IterableWrapper(range(n)).dist_shard(rank=rank, world_size=world, even=even)) == len(
                    got[rank]
                )


def test_len_without_a_known_length_is_a_type_error():
    pipe = IterableWrapper(_GenIterable(5)).filter(_keep_even).dist_shard(rank=0, world_size=2)
    with pytest.raises(TypeError, match="has no length"):
        len(pipe)


# -- bad input ------------------------------------------------------------------------------


def test_bad_arguments_raise_with_the_value():
    src = IterableWrapper(range(4))
    with pytest.raises(ValueError, match="even='Pad'"):
        src.dist_shard(even="Pad")
    with pytest.raises(TypeError, match="seed='1'"):
        src.dist_shard(seed="1")
    with pytest.raises(ValueError, match="seed=-1"):
        src.dist_shard(seed=-1)
    with pytest.raises(TypeError, match="epoch=1.5"):
        src.dist_shard().set_epoch(1.5)
    with pytest.raises(TypeError, match="IterDataPipe source, got list"):
        distshard.DistShardIterDataPipe([1, 2, 3])


def test_registered_functional_returns_the_public_class():
    pipe = IterableWrapper(range(3)).dist_shard()
    assert isinstance(pipe, distshard.DistShardIterDataPipe)


def test_set_epoch_reaches_the_shard_through_the_pipeline():
    pipeline = IterableWrapper(range(100)).shuffle().dist_shard(rank=0, world_size=1).map(_double)
    orders = [list(distshard.set_epoch(pipeline, e)) for e in (0, 1, 0)]
    assert orders[0] == orders[2] != orders[1]
    with pytest.raises(ValueError, match="no dist_shard upstream"):
        distshard.set_epoch(IterableWrapper(range(3)).map(_double), 1)


# -- issue 15: what an error raised while iterating says ----------------------------------------


def test_an_error_while_iterating_names_the_arguments_not_the_shuffle_functional():
    shard = IterableWrapper([f"s{i}" for i in range(10)]).dist_shard(rank=0, world_size=2, shuffle=True)
    state = shard.state_dict()
    list(shard)
    other = IterableWrapper([f"s{i}" for i in range(10)]).dist_shard(rank=1, world_size=2, shuffle=True)
    other.load_state_dict(shard.state_dict())  # slot 0's state in slot 1: refused at the first element
    with pytest.raises(ValueError) as raised:
        list(other)
    text = str(raised.value)
    assert "This exception is thrown by __iter__ of DistShardIterDataPipe(" in text
    assert "functools.partial" not in text and "register_datapipe_as_function" not in text, text
    assert callable(shard.shuffle) and state["epoch"] == 0  # .shuffle() after the shard still works


def test_another_slots_state_with_the_same_layout_names_the_per_rank_callback():
    shard = IterableWrapper(range(12)).dist_shard(rank=0, world_size=2)
    next(iter(shard))
    other = IterableWrapper(range(12)).dist_shard(rank=1, world_size=2)
    other.load_state_dict(shard.state_dict())
    with pytest.raises(ValueError, match="same ranks and workers.*LoaderStatePerRank callback of docs/integrations.md"):
        list(other)
    elastic = IterableWrapper(range(12)).dist_shard(rank=1, world_size=3)
    elastic.load_state_dict(shard.state_dict())
    with pytest.raises(ValueError, match="to resume with other ranks or workers, merge") as raised:
        list(elastic)
    assert "LoaderStatePerRank" not in str(raised.value)
