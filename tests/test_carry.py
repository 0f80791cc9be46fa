"""``dist_shard(even="carry")``: the epochs as one stream, every slot the same count,
nothing dropped or padded (both front-ends, every random-access source kind).

The oracle is the contract: epoch ``e``'s slots together take positions
``[U floor(eN/U), U floor((e+1)N/U))`` (``U = slots * multiple_of``) of the
concatenation of the epochs' own streams. Each epoch's own stream is what one slot
alone reads in that epoch (``U = 1``: no tail), in that epoch's order.
"""

from __future__ import annotations

from collections import Counter
from itertools import islice

import pytest
from torch.utils.data.datapipes.iter import IterableWrapper

import distshard
from distshard.nodes import DistShardNode

from .helpers import as_worker
from .model_factories import Expand, jsonl_file

N = 23


def list_source(n=N):
    return IterableWrapper([f"e{i}" for i in range(n)])


def upper(x):
    return x.upper()


def weighted(n=N):
    """Draws that change with the epoch: reading epoch e-1's tail in epoch e must
    give epoch e-1's draws, not epoch e's at those positions."""
    return distshard.weighted_sample(IterableWrapper([f"w{i}" for i in range(500)]), [1.0] * 500, samples=n)


def mixed(n=N):
    return distshard.mix(
        {"a": IterableWrapper([f"a{i}" for i in range(n)]), "b": IterableWrapper([f"b{i}" for i in range(n)])},
        {"a": 2, "b": 1},
        stop="first_exhausted",
    )


def mixed_draws(n=N):
    """A mix that re-draws its weighted_sample every pass, seeding it when a position is
    read (not when the view is made): epoch e-1's tail needs epoch e-1's seeds as it is read."""
    return distshard.mix(
        {
            "w": distshard.weighted_sample(IterableWrapper([f"w{i}" for i in range(500)]), [1.0] * 500, samples=5),
            "l": IterableWrapper([f"l{i}" for i in range(n)]),
        },
        {"w": 1, "l": 2},
    )


SOURCES = {
    "list": lambda: list_source(),
    "list+map, shuffle": lambda: list_source().map(upper),
    "weighted_sample": weighted,
    "mix": mixed,
    "mix of draws": mixed_draws,
    "jsonl": lambda: distshard.jsonl(jsonl_file(N)),
    "units+sizes": lambda: IterableWrapper(list(range(6))),
}
UNIT_SIZES = (5, 0, 7, 3, 4, 4)


def build(name, rank, world, *, multiple=1, shuffle=None, seed=3):
    shuffle = name.endswith("shuffle") if shuffle is None else shuffle
    options = dict(rank=rank, world_size=world, even="carry", multiple_of=multiple, shuffle=shuffle, seed=seed)
    if name == "units+sizes":
        return SOURCES[name]().dist_shard(expand=Expand(UNIT_SIZES, True), sizes=list(UNIT_SIZES), **options)
    return SOURCES[name]().dist_shard(**options)


def epoch_streams(name, epochs, **options):
    """Every epoch's own stream: what one slot alone reads (no tail with U = 1)."""
    out = []
    for epoch in range(epochs):
        pipe = build(name, 0, 1, **options)
        pipe.set_epoch(epoch)
        out.append(list(pipe))
    return out


def run_epoch(pipes, workers, epoch):
    """Every slot's elements of ``epoch``; ``pipes[rank][worker]`` persist across epochs."""
    out = []
    for row in pipes:
        for worker, pipe in enumerate(row):
            with as_worker(worker, workers):
                pipe.set_epoch(epoch)
                got = list(pipe)
                assert len(pipe) == len(got)  # len() is the epoch's count
            out.append(got)
    return out


@pytest.mark.parametrize("name", list(SOURCES))
@pytest.mark.parametrize("world, workers, multiple", [(2, 2, 1), (3, 1, 2)])
def test_the_epochs_form_one_stream_with_equal_slots(name, world, workers, multiple):
    streams = epoch_streams(name, 5, multiple=1)
    n = len(streams[0])
    concatenated = [x for stream in streams for x in stream]
    if name == "weighted_sample":
        assert streams[0] != streams[1]  # the draws do change with the epoch
    unit = world * max(1, workers) * multiple
    pipes = [[build(name, rank, world, multiple=multiple) for _ in range(max(1, workers))] for rank in range(world)]
    for epoch in range(5):
        per_slot = run_epoch(pipes, workers, epoch)
        start, stop = unit * (epoch * n // unit), unit * ((epoch + 1) * n // unit)
        counts = {len(got) for got in per_slot}
        assert counts == {(stop - start) // (world * max(1, workers))}  # equal, nothing dropped or padded
        assert counts.pop() % multiple == 0
        assert Counter(x for got in per_slot for x in got) == Counter(concatenated[start:stop])


def test_set_epoch_may_jump_epoch_positions_are_defined_by_the_epoch_alone():
    ran = [[build("list+map, shuffle", rank, 3) for _ in range(2)] for rank in range(3)]
    for epoch in range(8):
        walked = run_epoch(ran, 2, epoch)
    jumped = run_epoch([[build("list+map, shuffle", rank, 3) for _ in range(2)] for rank in range(3)], 2, 7)
    assert walked == jumped


def test_len_counts_the_epoch_per_rank_and_per_worker():
    pipe = build("list", 1, 2)
    for epoch, expected in enumerate([11, 12, 11, 12]):  # 2 slots, N = 23: the tail of 1 moves on
        pipe.set_epoch(epoch)
        assert len(pipe) == expected == len(list(pipe))
    with as_worker(1, 3):
        pipe = build("list", 1, 2, multiple=2)
        pipe.set_epoch(1)  # U = 12: epochs end at 12, 36: epoch 1 takes 24, 4 per slot
        assert len(pipe) == 4 == len(list(pipe))


def test_streams_and_units_without_sizes_are_refused_naming_carry():
    class Stream:
        def __iter__(self):
            return iter(range(5))

    for make in (
        lambda: IterableWrapper(Stream()).dist_shard(even="carry"),
        lambda: IterableWrapper(range(9)).shuffle().dist_shard(even="carry"),
        lambda: IterableWrapper(list(range(9))).map(upper).dist_shard(even="carry", pushdown=False),
        lambda: IterableWrapper([0, 1]).dist_shard(even="carry", expand=Expand((2, 3), True)),
    ):
        with pytest.raises(ValueError, match=r"even='carry'.*previous epoch"):
            make()
    from torchdata.nodes import IterableWrapper as NodeWrapper

    with pytest.raises(ValueError, match=r"even='carry'.*previous epoch"):
        DistShardNode(NodeWrapper(range(5)), even="carry")
    with pytest.raises(ValueError, match=r"even='carry'.*previous epoch"):
        DistShardNode([0, 1], even="carry", expand=Expand((2, 3), True))


@pytest.mark.parametrize(
    "name, multiple", [("list+map, shuffle", 1), ("units+sizes", 1), ("jsonl", 2), ("weighted_sample", 1)]
)
def test_resume_at_every_step_of_an_epoch_that_opens_with_a_tail(name, multiple):
    pipe = build(name, 1, 2, multiple=multiple)
    pipe.set_epoch(3)
    whole = list(pipe)
    for k in range(len(whole) + 1):
        pipe = build(name, 1, 2, multiple=multiple)
        pipe.set_epoch(3)
        it = iter(pipe)
        head = list(islice(it, k))
        state = pipe.state_dict()
        again = build(name, 1, 2, multiple=multiple)
        again.load_state_dict(state)
        assert head + list(again) == whole
        assert len(again) == len(whole)


def test_merged_states_resume_on_any_layout_and_the_next_epochs_go_on_exactly():
    """A run of 2 ranks x 2 workers stops in epoch 1 at uneven steps; 3 ranks x 1 worker
    resume the merged state and run epochs 1..3 with the same pipes: everything read
    is the concatenated stream's prefix, each position once."""
    name = "weighted_sample"
    streams = epoch_streams(name, 4)
    concatenated = [x for stream in streams for x in stream]
    first = [[build(name, rank, 2) for _ in range(2)] for rank in range(2)]
    read = [x for got in run_epoch(first, 2, 0) for x in got]
    states = []
    for rank, row in enumerate(first):
        for worker, pipe in enumerate(row):
            with as_worker(worker, 2):
                pipe.set_epoch(1)
                read += list(islice(iter(pipe), 1 + (rank + worker) % 3))
                states.append(pipe.state_dict())
    merged = distshard.merge_states(states)
    assert merged["carry_from"] == 1 and merged["slot"] is None
    second = [[build(name, rank, 3)] for rank in range(3)]
    for row in second:
        row[0].load_state_dict(merged)
    for epoch in (1, 2, 3):
        per_slot = run_epoch(second, 0, epoch)
        assert len({len(got) for got in per_slot}) == 1
        read += [x for got in per_slot for x in got]
    assert Counter(read) == Counter(concatenated[: len(read)])
    assert 4 * N - len(read) < 3  # the last tail is less than a round of the new layout


def stopped_in_epoch_1(slots, take):
    """Epoch 0 run whole by ``slots`` slots, epoch 1 stopped after ``take(slot)``
    elements of each: the epochs' concatenated streams, what was read, the merged state."""
    streams = epoch_streams("list", 3)
    concatenated = [x for stream in streams for x in stream]
    read = concatenated[: slots * (N // slots)]
    states = []
    for slot in range(slots):
        pipe = build("list", slot, slots)
        pipe.set_epoch(1)
        read += list(islice(iter(pipe), take(slot)))
        states.append(pipe.state_dict())
    return concatenated, read, distshard.merge_states(states)


def test_a_state_taken_after_an_epoch_moves_the_next_epochs_start_not_its_progress():
    """Epoch 1 resumed elastically ends where the new layout's rounds end; a fresh pipe
    that loads a state of it and is set to epoch 2 starts there, not at the formula."""
    concatenated, read, merged = stopped_in_epoch_1(4, lambda slot: slot % 3)
    # 23 of the 46 left: 3 slots take 21, leave 2
    ends = []
    for rank in range(3):
        pipe = build("list", rank, 3)
        pipe.load_state_dict(merged)
        read += list(pipe)
        ends.append(pipe.state_dict())  # a slot's state after its epoch's end
    for rank in range(2):  # a new job of 2 ranks, each loading the state its rank saved
        pipe = build("list", rank, 2)
        pipe.load_state_dict(ends[rank])
        pipe.set_epoch(2)  # the progress of epoch 1 is gone, where epoch 2 begins is not
        read += list(pipe)
    assert Counter(read) == Counter(concatenated[: len(read)])
    assert 3 * N - len(read) < 2


@pytest.mark.parametrize("saved, loaded", [("carry", "drop"), ("drop", "carry"), ("carry", None), ("pad", "carry")])
def test_carry_and_other_states_refuse_each_other(saved, loaded):
    def pipe(even, rank=0):
        return list_source().dist_shard(rank=rank, world_size=2, even=even)

    def node(even):
        return DistShardNode([f"e{i}" for i in range(N)], rank=0, world_size=2, even=even)

    source = pipe(saved)
    next(iter(source))
    own = source.state_dict()
    merged = distshard.merge_states([own, pipe(saved, 1).state_dict()])
    for state in (own, merged):
        with pytest.raises(ValueError, match=r"even="):
            target = pipe(loaded)
            target.load_state_dict(state)
            list(target)
    source = node(saved)
    source.reset()
    source.next()
    with pytest.raises(ValueError, match=r"even="):
        node(loaded).load_state_dict(source.state_dict())


def test_an_own_state_whose_boundaries_moved_is_refused_in_a_worker_and_taken_in_the_main_process():
    merged = distshard.merge_states([_partial(build("list", r, 2), 1 + r) for r in range(2)])
    pipe = build("list", 0, 3)
    pipe.load_state_dict(merged)
    list(islice(iter(pipe), 2))
    own = pipe.state_dict()  # its base is the merged one: not where epoch 1 starts by the formula
    with as_worker(0, 1):
        with pytest.raises(ValueError, match=r"merge_states"):
            build("list", 0, 3).load_state_dict(own)
    main = build("list", 0, 3)
    main.load_state_dict(own)  # the main process keeps the boundaries for every later epoch
    with as_worker(0, 1):
        main.load_state_dict(own)  # a worker's copy of such a pipe has them: nothing to refuse


def _partial(pipe, k):
    pipe.set_epoch(1)
    list(islice(iter(pipe), k))
    return pipe.state_dict()


def test_node_front_end_runs_epochs_as_one_stream_and_resumes():
    from torchdata.nodes import Loader

    data = [f"e{i}" for i in range(N)]
    streams = []
    for epoch in range(4):
        node = DistShardNode(data, rank=0, world_size=1, even="carry", shuffle=True, seed=2).set_epoch(epoch)
        streams.append(list(Loader(node)))
    concatenated = [x for s in streams for x in s]
    loaders = [Loader(DistShardNode(data, rank=r, world_size=3, even="carry", shuffle=True, seed=2)) for r in range(3)]
    read = []
    for _epoch in range(4):  # every iteration of a Loader starts the next epoch
        per_rank = [list(loader) for loader in loaders]
        assert len({len(got) for got in per_rank}) == 1
        read += [x for got in per_rank for x in got]
    assert Counter(read) == Counter(concatenated[: 3 * (4 * N // 3)])
    node = DistShardNode(data, rank=1, world_size=3, even="carry", shuffle=True, seed=2).set_epoch(2)
    loader = Loader(node)
    whole = list(loader)
    for k in range(len(whole)):  # (a Loader's state at the very end restarts with the next epoch)
        loader = Loader(DistShardNode(data, rank=1, world_size=3, even="carry", shuffle=True, seed=2).set_epoch(2))
        it = iter(loader)
        head = list(islice(it, k))
        state = loader.state_dict()
        again = Loader(DistShardNode(data, rank=1, world_size=3, even="carry", shuffle=True, seed=2))
        again.load_state_dict(state)
        assert head + list(again) == whole


def test_explain_says_what_carry_takes_and_leaves():
    pipe = build("list", 0, 4)
    pipe.set_epoch(1)
    text = str(pipe.explain())
    assert "even='carry'" in text
    assert "3 from the tail of epoch 0" in text  # epoch 0 took 20 of 23
    assert "leaves 2 of epoch 1's elements to epoch 2" in text  # epoch 1 ends at 44 of 46
    assert "6 per slot" in text
    pipe = build("list", 0, 8)
    pipe.set_epoch(2)  # epoch 0 ends at 16 of 23, epoch 1 at 40 of 46: it leaves 6 to epoch 2
    assert "opens with 6 from the tail of epoch 1" in str(pipe.explain())


# torchdata restores the len() a loader state recorded and compares the next epoch's count with it
@pytest.mark.filterwarnings("ignore:Length of IterableDataset:UserWarning")
def test_stateful_dataloader_workers_keep_the_boundaries_an_elastic_resume_moved():
    """After an elastic resume, a job resumed from a StatefulDataLoader state (each
    worker its own) gives the state to the pipeline too, so every later epoch's
    workers know where epochs begin; without that its workers refuse the state."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    concatenated, read, merged = stopped_in_epoch_1(3, lambda slot: min(slot, 1))
    # 23 read: 2 ranks x 2 workers end epoch 1 at 43, not at 44 (the formula's)

    def loader(pipeline):
        return StatefulDataLoader(pipeline, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=30)

    saved = []
    for rank in range(2):
        pipeline = distshard.StatefulPipeline(build("list", rank, 2))
        pipeline.load_state_dict(merged)
        it = iter(running := loader(pipeline))
        read += list(islice(it, 3))
        saved.append(running.state_dict())
        del it
    unaware = loader(distshard.StatefulPipeline(build("list", 0, 2)))
    unaware.load_state_dict(saved[0])
    with pytest.raises(ValueError, match="into the pipeline in the main process"):
        next(iter(unaware))
    for rank in range(2):  # the job restarts with the same layout from what each rank saved
        pipeline = distshard.StatefulPipeline(build("list", rank, 2))
        pipeline.load_state_dict(saved[rank])  # keeps the boundaries: the workers resume the progress
        resumed = loader(pipeline)
        resumed.load_state_dict(saved[rank])
        read += list(resumed)
        pipeline.set_epoch(2)
        read += list(resumed)  # new workers, copied from the pipeline here
    assert Counter(read) == Counter(concatenated[: len(read)])
    assert 3 * N - len(read) < 4
