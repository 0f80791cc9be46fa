"""DistShardNode: the dist_shard partition for torchdata.nodes pipelines.

Ranks are simulated with explicit rank / world_size (and DataLoader workers with
``helpers.as_worker``), so every slot of a grid runs in this process.
"""

import doctest
import json
import threading
from collections import Counter

import pytest
from torch.utils.data.datapipes.iter import IterableWrapper as PipeWrapper
from torchdata.nodes import BaseNode, IterableWrapper, Loader, Mapper, ParallelMapper, SamplerWrapper

import distshard
import distshard.nodes
from distshard.nodes import DistShardNode
from distshard.plan import EVEN_MODES, slot_count, slot_positions
from distshard.state import VERSION

from .helpers import as_worker

SLOTS = (1, 2, 3, 5)


def _sizes(num_slots):
    return sorted({n for n in (0, 1, num_slots - 1, num_slots, num_slots + 1, 100) if n >= 0})


GRID = [(s, n, even) for s in SLOTS for n in _sizes(s) for even in EVEN_MODES]


def data(n):
    return [f"e{i}" for i in range(n)]


def node(n_or_items, slot, num_slots, even=None):
    items = data(n_or_items) if isinstance(n_or_items, int) else n_or_items
    return DistShardNode(IterableWrapper(items), rank=slot, world_size=num_slots, even=even)


def take(it, k):
    return [next(it) for _ in range(k)]


# -- the partition ------------------------------------------------------------------


@pytest.mark.parametrize("num_slots,n,even", GRID)
def test_every_slot_gets_its_positions_and_the_union_is_exact(num_slots, n, even):
    items = data(n)
    per_slot = {slot: list(node(items, slot, num_slots, even)) for slot in range(num_slots)}
    for slot, got in per_slot.items():
        assert got == [items[p] for p in slot_positions(slot, num_slots, n, even)]
        assert len(got) == slot_count(slot, num_slots, n, even)
    union = sum((Counter(got) for got in per_slot.values()), Counter())
    if even is None:
        assert union == Counter(items)
    elif even == "drop":
        assert {len(got) for got in per_slot.values()} == {n // num_slots}
        assert union == Counter(items[: num_slots * (n // num_slots)])
    else:
        assert {len(got) for got in per_slot.values()} == {-(-n // num_slots)}
        extra = union - Counter(items)
        assert Counter(items) - union == Counter()  # nothing lost
        assert sum(extra.values()) == (-n) % num_slots if n else not extra
        for slot, got in per_slot.items():  # a padded slot repeats its own first element
            if n and len(got) > len(set(got)):
                assert got[-1] == (got[0] if n >= num_slots else items[slot % n])


@pytest.mark.parametrize("num_slots,n,even", [g for g in GRID if g[0] in (3, 5)])
def test_same_sharding_as_the_datapipe(num_slots, n, even):
    items = data(n)
    for slot in range(num_slots):
        pipe = PipeWrapper(items).dist_shard(rank=slot, world_size=num_slots, even=even)
        assert list(node(items, slot, num_slots, even)) == list(pipe)


def test_values_are_never_looked_at():
    items = [None, 0, None, [1], None, {"a": 1}, None]
    got = [list(node(items, slot, 3)) for slot in range(3)]
    assert got == [[None, [1], None], [0, None], [None, {"a": 1}]]


# -- torchdata.nodes composition -----------------------------------------------------


def test_through_loader_over_several_epochs():
    loader = Loader(node(10, 1, 3, even="drop"))
    assert list(loader) == ["e1", "e4", "e7"]
    assert list(loader) == ["e1", "e4", "e7"]


def test_mapper_after_the_shard_maps_only_this_slots_elements():
    calls = []

    def fn(x):
        calls.append(x)
        return x.upper()

    loader = Loader(Mapper(node(11, 2, 4), fn))
    assert list(loader) == ["E2", "E6", "E10"]
    assert calls == ["e2", "e6", "e10"]


def test_parallel_mapper_after_the_shard():
    seen, lock = [], threading.Lock()

    def fn(x):
        with lock:
            seen.append(x)
        return x + "!"

    shards = []
    for slot in range(3):
        mapped = ParallelMapper(node(20, slot, 3, "pad"), fn, num_workers=2, method="thread")
        shards.append(list(Loader(mapped)))
    assert [len(s) for s in shards] == [7, 7, 7]
    assert Counter(x for s in shards for x in s) - Counter(x + "!" for x in data(20)) == Counter(
        ["e2!"]
    )  # slot 2 repeats its first
    assert sorted(seen) == sorted(x[:-1] for s in shards for x in s)


class _EpochSampler:
    """A sampler whose order depends on the epoch (like DistributedSampler's)."""

    def __init__(self, n):
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        shift = self.epoch * 3 % self.n
        return iter([(i + shift) % self.n for i in range(self.n)])

    def __len__(self):
        return self.n


def test_epochs_of_an_epoch_aware_source_stay_exactly_once():
    loaders = [Loader(DistShardNode(SamplerWrapper(_EpochSampler(10)), rank=r, world_size=2)) for r in range(2)]
    epochs = []
    for _ in range(3):
        shards = [list(loader) for loader in loaders]
        assert sorted(shards[0] + shards[1]) == list(range(10))
        epochs.append(shards[0])
    assert epochs[0] != epochs[1] != epochs[2]


# -- where the slot comes from ----------------------------------------------------------


def test_slot_is_resolved_at_reset_from_the_worker_info():
    shard = node(20, 1, 2)  # built outside any worker
    with as_worker(1, 2):  # iterated in DataLoader worker 1 of 2 on rank 1: slot 3 of 4
        got = list(shard)
        assert shard.state_dict()["shard"]["slot"] == 3 and shard.state_dict()["shard"]["num_slots"] == 4
    assert got == ["e3", "e7", "e11", "e15", "e19"]


def test_rank_and_world_size_from_the_environment(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    shard = DistShardNode(IterableWrapper(data(7)))
    assert shard.context().source == "env"
    assert list(shard) == ["e2", "e5"]


def test_malformed_environment_fails_at_construction(monkeypatch):
    monkeypatch.setenv("RANK", "one")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK='one'"):
        DistShardNode(IterableWrapper(data(3)))
    DistShardNode(IterableWrapper(data(3)), rank=0, world_size=1)  # explicit wins


# -- state and resume ---------------------------------------------------------------------


RESUME = [(s, n, even) for s in (1, 3, 4) for n in (0, 1, s + 1, 14) for even in EVEN_MODES]


@pytest.mark.parametrize("num_slots,n,even", RESUME)
def test_resume_at_every_position_equals_an_uninterrupted_run(num_slots, n, even):
    for slot in range(num_slots):
        full = list(node(n, slot, num_slots, even))
        for k in range(len(full) + 1):  # 0, every position, the end
            first = node(n, slot, num_slots, even)
            head = take(first, k)
            state = json.loads(json.dumps(first.state_dict()))
            assert state["shard"]["taken"] == k
            resumed = node(n, slot, num_slots, even)
            resumed.reset(state)
            assert head + list(resumed) == full
            assert resumed.state_dict()["shard"]["taken"] == len(full)


def test_state_format():
    shard = node(10, 1, 4, "pad")
    state = shard.state_dict()
    assert state["distshard_node"] == 2
    inner = state["shard"]
    assert (inner["distshard"], inner["taken"], inner["slot"], inner["num_slots"], inner["even"]) == (
        VERSION,
        0,
        1,
        4,
        "pad",
    )
    assert inner["node_source"] == {"_num_yielded": 0} and inner["layout"] == "stride"
    take(shard, 2)
    state = shard.state_dict()
    assert state["shard"]["taken"] == 2 and state["shard"]["node_source"] == {"_num_yielded": 0}
    assert json.loads(json.dumps(state)) == state


def test_resume_skips_the_prefix_without_mapping_it():
    calls = []

    def fn(x):
        calls.append(x)
        return x

    first = Mapper(node(30, 0, 3), fn)
    full = [next(first) for _ in range(4)]
    state = json.loads(json.dumps(first.state_dict()))
    calls.clear()
    resumed = Mapper(node(30, 0, 3), fn)
    resumed.reset(state)
    rest = list(resumed)
    assert full + rest == data(30)[0::3]
    assert calls == rest


@pytest.mark.parametrize("k", [0, 1, 3, 4])
def test_resume_through_loader(k):
    full = ["e1", "e4", "e7", "e10"]
    loader = Loader(node(12, 1, 3))
    it = iter(loader)
    head = take(it, k)
    state = json.loads(json.dumps(loader.state_dict()))
    again = Loader(node(12, 1, 3))
    again.load_state_dict(state)
    rest = list(again)
    if k == len(full):  # Loader restarts a finished epoch
        assert rest == full
    else:
        assert head + rest == full


@pytest.mark.parametrize("k", [0, 2, 5])
def test_resume_with_a_parallel_mapper_after_the_shard(k):
    def build():
        return Loader(ParallelMapper(node(16, 2, 3, "drop"), str.upper, num_workers=2))

    full = ["E2", "E5", "E8", "E11", "E14"]
    loader = build()
    it = iter(loader)
    head = take(it, k)
    state = json.loads(json.dumps(loader.state_dict()))
    again = build()
    again.load_state_dict(state)
    rest = list(again)
    if k == len(full):  # Loader restarts a finished epoch
        assert rest == full
    else:
        assert head + rest == full


def test_resume_restores_the_epoch_of_the_source():
    def build():
        return Loader(DistShardNode(SamplerWrapper(_EpochSampler(10)), rank=1, world_size=2))

    loader = build()
    list(loader)  # epoch 0
    it = iter(loader)  # epoch 1
    epoch1 = take(it, 2)
    state = json.loads(json.dumps(loader.state_dict()))
    rest = list(it)
    again = build()
    again.load_state_dict(state)
    assert list(again) == rest
    assert epoch1 + rest != list(build())


class _Stateless(BaseNode):
    """A source that does not implement get_state."""

    def __init__(self, n):
        super().__init__()
        self.n = n

    def reset(self, initial_state=None):
        super().reset(initial_state)
        self._it = iter(range(self.n))

    def next(self):
        return next(self._it)


def test_source_without_state():
    first = DistShardNode(_Stateless(9), rank=0, world_size=2)
    head = take(first, 2)
    state = first.state_dict()
    assert state["shard"]["node_source"] is None
    resumed = DistShardNode(_Stateless(9), rank=0, world_size=2)
    resumed.reset(json.loads(json.dumps(state)))
    assert head + list(resumed) == [0, 2, 4, 6, 8]


def _good():
    first = node(12, 1, 3)
    take(first, 1)
    return json.loads(json.dumps(first.state_dict()))


def _shard(**changes):
    good = _good()
    return {**good, "shard": {**good["shard"], **changes}}


BAD_STATES = [
    ("a list", [1, 2], "no 'distshard_node' key"),
    ("no marker", {"taken": 1}, "no 'distshard_node' key"),
    ("loader state", {"root": _good(), "num_yielded": 1}, "Loader state"),
    ("version", dict(_good(), distshard_node=1), "version 1"),
    (
        "missing",
        _shard(distshard=2, taken=None) | {"shard": {k: v for k, v in _good()["shard"].items() if k != "taken"}},
        r"missing keys \['taken'\]",
    ),
    ("taken negative", _shard(taken=-1), "taken=-1 must be at least 0"),
    ("taken str", _shard(taken="1"), "taken='1' must be an int"),
    ("taken bool", _shard(taken=True), "taken=True must be an int"),
    ("slot outside", _shard(slot=3), r"slot=3 is outside \[0, num_slots=3\)"),
    ("num_slots 0", _shard(num_slots=0), "num_slots=0 must be at least 1"),
    ("even", _shard(even="odd"), "even='odd' is not one of"),
    ("other slot", _shard(slot=2), "slot 2 of 3's, but this copy is slot 1 of 3"),
    ("other num_slots", _shard(slot=1, num_slots=4), "slot 1 of 4's, but this copy is slot 1 of 3"),
    ("other even", _shard(even="pad"), "saved with even='pad' but this node has even=None"),
    ("other shuffle", _shard(shuffle=True), "saved with shuffle=True but this node has shuffle=False"),
    ("other data", _shard(source="stream:node:Other"), "saved with source="),
    ("taken beyond", _shard(taken=400), "yielded 400 elements, but the stream"),
]


@pytest.mark.parametrize("name,state,message", BAD_STATES, ids=[b[0] for b in BAD_STATES])
def test_bad_state_raises_and_leaves_the_node_unchanged(name, state, message):
    full = list(node(12, 1, 3))
    assert node(12, 1, 3).reset(_good()) is None  # the template itself is valid
    fresh = node(12, 1, 3)
    with pytest.raises(ValueError, match=message):
        fresh.reset(state)
        next(fresh)  # a stream shorter than the state claims is found when it is read
    if name == "taken beyond":
        fresh.reset()
        assert list(fresh) == full
        return
    assert list(fresh) == full
    running = node(12, 1, 3)
    head = take(running, 2)
    before = running.state_dict()
    with pytest.raises(ValueError, match=message):
        running.reset(state)
    assert running.state_dict() == before
    assert head + list(running) == full


# -- arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"rank": "0", "world_size": 2}, TypeError, "rank='0' must be an int"),
        ({"rank": 0, "world_size": 2.0}, TypeError, "world_size=2.0 must be an int"),
        ({"rank": True, "world_size": 2}, TypeError, "rank=True must be an int"),
        ({"rank": 1}, ValueError, "rank=1 was given without world_size"),
        ({"world_size": 2}, ValueError, "world_size=2 was given without rank"),
        ({"rank": 2, "world_size": 2}, ValueError, r"rank=2 is outside \[0, world_size=2\)"),
        ({"rank": 0, "world_size": 0}, ValueError, "world_size=0 must be at least 1"),
        ({"even": "odd"}, ValueError, "even='odd' is not a known mode"),
        ({"even": True}, ValueError, "even=True is not a known mode"),
    ],
)
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        DistShardNode(IterableWrapper([1]), **kwargs)


def test_source_must_be_a_node_or_a_positional_sequence():
    with pytest.raises(TypeError, match="BaseNode or a random-access sequence, got set; wrap an iterable"):
        DistShardNode({1, 2, 3}, rank=0, world_size=1)
    assert list(DistShardNode([1, 2, 3], rank=0, world_size=1)) == [1, 2, 3]


def test_repr_and_docstring_example(capsys):
    assert repr(node(3, 1, 2, "drop")) == "DistShardNode(IterableWrapper, even='drop', rank=1, world_size=2)"
    result = doctest.testmod(distshard.nodes, report=False)
    assert result.attempted >= 2 and result.failed == 0
    assert capsys.readouterr().out == ""


def test_a_node_not_yet_started_pickles_like_a_dataset_for_spawned_workers():
    import pickle

    copy = pickle.loads(pickle.dumps(node(9, 2, 4, "pad")))
    assert list(copy) == ["e2", "e6", "e2"]


def test_reset_mid_epoch_restarts_the_epoch():
    shard = node(10, 0, 2)
    take(shard, 3)
    shard.reset()
    assert list(shard) == ["e0", "e2", "e4", "e6", "e8"]


def test_pickled_node_remembers_the_process_group_rank(monkeypatch):
    import pickle

    import distshard.context

    monkeypatch.setattr(distshard.context, "dist_rank_world", lambda: (1, 2))
    # unpickling notes the captured rank for this process: put it back after the test, or a
    # later test's in-process worker would resolve to rank 1 of 2 (test_carry_seed's did)
    monkeypatch.setattr(distshard.context, "_pickled", None)
    blob = pickle.dumps(DistShardNode(IterableWrapper(data(6))))
    monkeypatch.setattr(distshard.context, "dist_rank_world", lambda: None)
    copy = pickle.loads(blob)  # as in a spawned DataLoader worker: no process group
    assert copy.context().source == "pickled"
    assert list(copy) == ["e1", "e3", "e5"]


# -- issue 15: one check of the arguments for both front-ends ----------------------------------

BAD_ARGUMENTS = [
    dict(seed=-1),
    dict(seed="1"),
    dict(seed=1.5),
    dict(seed=True),
    dict(rank=1),
    dict(world_size=2),
    dict(rank=0, world_size=0),
    dict(rank=2, world_size=2),
    dict(rank="0", world_size=2),
    dict(even="x"),
    dict(shuffle=1),
    dict(expand=3),
    dict(sizes=[1, 2]),
    dict(expand=list, even="drop"),
    dict(expand=list, shuffle=True),
    dict(expand=list, sizes="ab"),
    dict(expand=list, sizes=[1, -1]),
    dict(expand=list, sizes=[1, 1.5]),
    dict(multiple_of=0),
    dict(multiple_of=2),
    dict(multiple_of=2.0),
]


@pytest.mark.parametrize("arguments", BAD_ARGUMENTS, ids=repr)
def test_both_front_ends_refuse_bad_arguments_alike(arguments):
    with pytest.raises((TypeError, ValueError)) as pipe:
        PipeWrapper([0, 1, 2]).dist_shard(**arguments)
    with pytest.raises((TypeError, ValueError)) as node:
        DistShardNode([0, 1, 2], **arguments)
    assert (type(node.value), str(node.value)) == (type(pipe.value), str(pipe.value))


@pytest.mark.parametrize(
    "epoch, error", [(-1, ValueError), ("1", TypeError), (1.5, TypeError), (True, TypeError), (2**63, ValueError)]
)
def test_both_front_ends_refuse_bad_epochs_alike(epoch, error):
    with pytest.raises(error) as pipe:
        PipeWrapper([0]).dist_shard().set_epoch(epoch)
    with pytest.raises(error) as node:
        DistShardNode([0]).set_epoch(epoch)
    assert str(node.value) == str(pipe.value)
