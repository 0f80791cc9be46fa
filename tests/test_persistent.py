"""``persistent_workers=True``: every epoch reaches the workers' copies of the pipe.

A persistent DataLoader worker keeps its copy of the pipeline across epochs, and
torch sends it nothing that says the epoch (``mailbox.py``). Each epoch must still
be exactly what a fresh set of workers would yield: the same elements in the same
order, a new order every epoch, and states that say the right epoch.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
from collections import Counter
from itertools import zip_longest

import pytest
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data.datapipes.iter import IterableWrapper
from torchdata.stateful_dataloader import StatefulDataLoader

import distshard
from distshard.state import find_states

from .helpers import as_worker

N, WORKERS, SEED = 24, 2, 11
DATA = [f"e{i}" for i in range(N)]


def shuffled_globally():
    return IterableWrapper(DATA).dist_shard(shuffle=True, seed=SEED, rank=0, world_size=1)


def shuffled_upstream():
    return IterableWrapper(DATA).shuffle().dist_shard(seed=SEED, rank=0, world_size=1)


def both():
    """Two dist_shards in one pipeline: one shuffle=True, one after an upstream shuffle."""
    return shuffled_globally().zip(shuffled_upstream())


BUILDS = {"shuffle=True": shuffled_globally, "upstream shuffle": shuffled_upstream, "both": both}


def reference(build, epoch: int) -> list:
    """What fresh workers yield in ``epoch``: each worker's copy iterated in this
    process, interleaved as the DataLoader takes them (one element per worker in turn)."""
    per_worker = []
    for worker in range(WORKERS):
        with as_worker(worker, WORKERS):
            pipe = build()
            distshard.set_epoch(pipe, epoch)
            per_worker.append(list(pipe))
    return [x for round_ in zip_longest(*per_worker) for x in round_ if x is not None]


def _loader(pipeline, method, stateful):
    cls = StatefulDataLoader if stateful else DataLoader
    return cls(
        pipeline,
        batch_size=None,
        num_workers=WORKERS,
        persistent_workers=True,
        multiprocessing_context=method,
        timeout=60,
    )


def _epochs(build, method, stateful, epochs=3):
    pipe = build()
    loader = _loader(distshard.StatefulPipeline(pipe) if stateful else pipe, method, stateful)
    out = []
    for epoch in range(epochs):
        distshard.set_epoch(pipe, epoch)
        out.append([tuple(x) if isinstance(x, (list, tuple)) else x for x in loader])
    loader._iterator._shutdown_workers()
    return out


@pytest.mark.parametrize(
    "method, stateful, name",
    [
        ("fork", False, "shuffle=True"),
        ("fork", False, "upstream shuffle"),
        ("fork", True, "shuffle=True"),
        ("fork", True, "upstream shuffle"),
        ("spawn", False, "both"),  # spawn with StatefulDataLoader: the resume test below, and test_model
    ],
)
def test_every_epoch_reaches_persistent_workers(method, stateful, name):
    build = BUILDS[name]
    got = _epochs(build, method, stateful)
    for epoch, order in enumerate(got):
        expected = [tuple(x) if isinstance(x, tuple) else x for x in reference(build, epoch)]
        assert order == expected, f"epoch {epoch}"
        elements = [x for pair in order for x in pair] if name == "both" else order
        assert Counter(elements) == Counter(DATA * (2 if name == "both" else 1)), f"epoch {epoch}"
    assert len({tuple(order) for order in got}) == len(got)  # a new order every epoch


def _stateful(method):
    pipe = shuffled_globally()
    return pipe, _loader(distshard.StatefulPipeline(pipe), method, True)


def _epochs_of(state) -> set:
    return {s["epoch"] for s in find_states(state)}


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_checkpoint_in_the_second_epoch_of_persistent_workers_resumes_exactly(method):
    """The issue's case: epoch 0 whole, 10 elements of epoch 1, checkpoint; a fresh
    persistent loader after set_epoch(1) yields the rest, then epoch 2 whole."""
    pipe, loader = _stateful(method)
    pipe.set_epoch(0)
    assert list(loader) == reference(shuffled_globally, 0)
    pipe.set_epoch(1)
    it = iter(loader)
    assert _epochs_of(loader.state_dict()) == {1}  # before the epoch's first element, too
    head = [next(it) for _ in range(10)]
    state = loader.state_dict()
    assert _epochs_of(state) == {1}
    it._shutdown_workers()  # the job is killed

    pipe, loader = _stateful(method)
    pipe.set_epoch(1)
    loader.load_state_dict(state)
    tail = list(loader)
    assert Counter(head + tail) == Counter(DATA)
    assert head + tail == reference(shuffled_globally, 1)
    pipe.set_epoch(2)  # the resumed run goes on in the same workers
    assert list(loader) == reference(shuffled_globally, 2)
    loader._iterator._shutdown_workers()


def test_a_state_loaded_into_the_loaders_copy_after_the_workers_started_is_refused():
    pipe, loader = _stateful("fork")
    pipe.set_epoch(0)
    it = iter(loader)
    head = [next(it) for _ in range(5)]
    state = loader.state_dict()
    assert len(head + list(it)) == N
    loader.dataset.load_state_dict(state)  # into the loader's process's copy: the workers cannot see it
    with pytest.raises(RuntimeError, match="after its persistent workers started"):
        next(iter(loader))  # refused before the first element of the next epoch


class _Unpickled(IterableDataset):
    """Unpickles the pipeline in the worker (an ordinary pickle, not the worker's start)."""

    def __init__(self, pipe):
        self.blob, self.pipe = pickle.dumps(pipe), None

    def __iter__(self):
        if self.pipe is None:
            self.pipe = pickle.loads(self.blob)
        return iter(self.pipe)


def test_a_copy_that_cannot_hear_set_epoch_refuses_its_second_epoch():
    loader = DataLoader(
        _Unpickled(shuffled_globally()),
        batch_size=None,
        num_workers=WORKERS,
        persistent_workers=True,
        multiprocessing_context="fork",
        timeout=60,
    )
    assert Counter(loader) == Counter(DATA)
    with pytest.raises(RuntimeError, match="by an ordinary pickle"):
        list(loader)
    loader._iterator._shutdown_workers()


def _fd_count(element):
    return element, len(os.listdir("/proc/self/fd"))


def test_nothing_grows_per_epoch():
    """Open descriptors do not grow, in the workers or in the loader's process (whose
    count other tests' leftovers, closed by the collector meanwhile, may lower)."""
    pipe = shuffled_globally()
    loader = _loader(pipe.map(_fd_count), "fork", stateful=False)
    seen = []
    for epoch in range(6):
        pipe.set_epoch(epoch)
        counts = {count for _, count in loader}
        seen.append((len(os.listdir("/proc/self/fd")), counts))
    assert all(fds <= seen[1][0] and workers == seen[1][1] for fds, workers in seen[1:]), seen
    loader._iterator._shutdown_workers()


def _child(pipe, ready, results):
    ready.wait(30)  # the parent has set another epoch on its own copy meanwhile
    loader = DataLoader(
        pipe, batch_size=None, num_workers=WORKERS, persistent_workers=True, multiprocessing_context="fork", timeout=60
    )
    first = list(loader)
    pipe.set_epoch(1)
    results.put((first, list(loader)))
    loader._iterator._shutdown_workers()


def test_a_forked_rank_and_its_workers_hear_only_themselves():
    """Ranks forked from one process (Lightning's ddp_notebook) share nothing: the
    parent's set_epoch does not reach the rank's workers, the rank's own does."""
    ctx = mp.get_context("fork")
    pipe = shuffled_globally().set_epoch(0)
    ready, results = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_child, args=(pipe, ready, results))
    child.start()
    pipe.set_epoch(7)
    ready.set()
    first, second = results.get(timeout=60)
    child.join(30)
    assert first == reference(shuffled_globally, 0)
    assert second == reference(shuffled_globally, 1)


@pytest.mark.parametrize("workers, persistent", [(0, False), (2, False), (2, True)])
def test_a_state_saved_after_the_epoch_end_never_runs_that_epoch_again(workers, persistent):
    """StatefulDataLoader starts a new iteration by itself after loading a state saved
    at the end of an epoch, with fresh workers unless they persist: the epoch it
    resumes has nothing left, so without set_epoch(next) it yields nothing (no
    workers) or refuses before the first element, and after set_epoch(1) epoch 1 is whole."""

    def loader_of(pipe):
        extra = {"multiprocessing_context": "fork", "timeout": 60, "persistent_workers": persistent} if workers else {}
        return StatefulDataLoader(distshard.StatefulPipeline(pipe), batch_size=None, num_workers=workers, **extra)

    pipe = shuffled_globally().set_epoch(0)
    loader = loader_of(pipe)
    assert Counter(loader) == Counter(DATA)
    state = loader.state_dict()
    if workers:
        loader._iterator._shutdown_workers()
    again = loader_of(shuffled_globally().set_epoch(0))
    again.load_state_dict(state)
    if workers:
        with pytest.raises(RuntimeError, match=r"call set_epoch\(\) with the next epoch"):
            next(iter(again))
        again._iterator._shutdown_workers()
    else:
        assert list(again) == []
    pipe = shuffled_globally().set_epoch(1)
    after = loader_of(pipe)
    after.load_state_dict(state)
    assert Counter(after) == Counter(DATA)
    if workers:
        after._iterator._shutdown_workers()


@pytest.mark.parametrize(
    "even, persistent", [(None, True), ("drop", True), ("pad", True), ("carry", True), (None, False), ("carry", False)]
)
def test_a_loader_resumed_after_the_epoch_end_reports_the_epoch_done_or_refuses(even, persistent):
    """A StatefulDataLoader that loads a state saved at an epoch's end starts a new
    iteration of that epoch by itself (its first element is refused): the state a
    persistent worker reports meanwhile is the resumed run's, at its end, not a fresh
    epoch. Merged and resumed on 2 ranks, nothing of the epoch comes again; under carry,
    the next epoch then completes the epochs' one stream (23 elements: one carried over).
    New workers (not persistent) do not have the resumed run: they refuse, unless the
    pipeline holds the state too (carry's way, docs/usage.md)."""
    data = DATA[:23] if even == "carry" else DATA

    def build(rank=0, world=1):
        return IterableWrapper(data).dist_shard(shuffle=True, seed=SEED, even=even, rank=rank, world_size=world)

    def loader_of(pipe):
        return StatefulDataLoader(
            distshard.StatefulPipeline(pipe),
            batch_size=None,
            num_workers=WORKERS,
            persistent_workers=persistent,
            multiprocessing_context="fork",
            timeout=60,
        )

    loader = loader_of(build().set_epoch(0))
    first = list(loader)
    state = loader.state_dict()
    loader._iterator._shutdown_workers()
    pipe = build().set_epoch(0)
    again = loader_of(pipe)
    if even == "carry":  # docs/usage.md "carry": the pipeline keeps the boundaries too
        distshard.StatefulPipeline(pipe).load_state_dict(state)
    again.load_state_dict(state)
    if not persistent and even != "carry":
        with pytest.raises(RuntimeError, match="started after the one that resumed it"):
            iter(again)
        again._iterator._shutdown_workers()
        return
    it = iter(again)  # nothing taken: the resumed run has nothing left
    resumed = again.state_dict()
    it._shutdown_workers()
    merged = distshard.merge_states([resumed])
    rest = []
    for rank in range(2):
        pipe = build(rank, 2)
        pipe.load_state_dict(merged)
        rest += list(pipe)
        if even == "carry":
            rest += list(pipe.set_epoch(1))
    if even == "carry":
        assert Counter(first + rest) == Counter(data * 2)
    else:
        assert rest == []
        assert Counter(first) == Counter(data)
