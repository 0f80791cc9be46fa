"""``even="carry"`` under the seed a DataLoader hands over (issue 21, items 1, 2, 9).

torch's DataLoader calls ``set_seed`` on a DataPipe with a new shared seed every
epoch. Under ``even="carry"`` an epoch's tail is read in the next epoch, so every
reader of an epoch's positions (its carried tail, a resume, an elastic resume) must
order them by the seed that epoch was drawn with: with ``seed=None`` that is 0, never
the loader's. The oracle: over epochs ``0..E-1`` every element is yielded ``E`` times,
but for the last tail (fewer than a round), yielded ``E - 1`` times; nothing more often.
"""

from __future__ import annotations

import json
from collections import Counter
from itertools import islice

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.datapipes.iter import IterableWrapper
from torchdata.stateful_dataloader import StatefulDataLoader

import distshard

from .helpers import as_worker
from .verify_factories import carry_under_the_loaders_seed

N = 29


def shuffled(n: int = N, **options):
    return IterableWrapper([f"e{i}" for i in range(n)]).dist_shard(even="carry", shuffle=True, **options)


def weighted_mix(**options):
    """Draws that change with the epoch (a weighted_sample inside a mix): the carried
    tail must come with its own epoch's draws."""
    return distshard.mix(
        {
            "w": distshard.weighted_sample(IterableWrapper(list(range(300))), [1.0] * 300, samples=9),
            "l": IterableWrapper(list(range(21))),
        },
        {"w": 1, "l": 2},
    ).dist_shard(even="carry", **options)


def assert_epochs_exact(read: list, epochs: int, universe: list, slots: int, tail: int | None = None) -> None:
    """``epochs`` epochs of carry over ``universe`` with ``slots * multiple_of = slots``:
    every element ``epochs`` times but the last tail (``tail`` long), once fewer."""
    n, counts = len(universe), Counter(read)
    assert set(counts) <= set(universe), sorted(set(counts) - set(universe))[:5]
    tail = epochs * n % slots if tail is None else tail
    by_count = Counter(counts[x] for x in universe)
    expected = Counter({epochs: n - tail, epochs - 1: tail}) if tail else Counter({epochs: n})
    assert +by_count == +expected, f"elements by how often they came: {dict(by_count)}, expected {dict(expected)}"


def run_epochs(pipe, loader, epochs: int, start: int = 0) -> list:
    read: list = []
    for epoch in range(start, start + epochs):
        distshard.set_epoch(pipe, epoch)
        read += [x for x in loader]
    return read


@pytest.mark.parametrize(
    "context, workers, persistent",
    [("fork", 3, False), ("fork", 2, True), ("spawn", 2, True), (None, 0, False)],
    ids=["fork3", "fork2-persistent", "spawn2-persistent", "no-workers"],
)
def test_the_issue_case_is_exact_under_the_loaders_new_seed_every_epoch(context, workers, persistent):
    """The issue's case: 29 elements, shuffle=True, seed=None, 3 epochs through torch's
    DataLoader (which calls set_seed with a new seed every epoch). It repeated and
    dropped at every epoch end ({2: 24, 1: 3, 3: 2} after 2 epochs with 3 workers)."""
    torch.manual_seed(0)
    pipe = shuffled()
    options = {"multiprocessing_context": context, "persistent_workers": persistent, "timeout": 60} if workers else {}
    loader = DataLoader(pipe, batch_size=None, num_workers=workers, **options)
    read = run_epochs(pipe, loader, 3)
    assert_epochs_exact(read, 3, [f"e{i}" for i in range(N)], max(1, workers))


def test_multiple_of_and_a_stateful_dataloader_over_the_datapipe_are_exact_too():
    """StatefulDataLoader over the DataPipe itself seeds it like torch's DataLoader."""
    torch.manual_seed(1)
    pipe = shuffled(multiple_of=2)
    loader = StatefulDataLoader(pipe, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60)
    read = run_epochs(pipe, loader, 3)
    assert_epochs_exact(read, 3, [f"e{i}" for i in range(N)], 2 * 2)


def test_a_mix_with_epoch_draws_keeps_each_epochs_draws_in_its_carried_tail():
    """The tail of epoch e, read in epoch e+1 by loader workers, is epoch e's draws: the
    stream over 3 epochs is what one slot alone reads epoch by epoch, cut at the same
    positions."""
    alone = []
    for epoch in range(3):
        alone += list(weighted_mix(rank=0, world_size=1).set_epoch(epoch))
    torch.manual_seed(2)
    pipe = weighted_mix()
    loader = DataLoader(pipe, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60)
    read = run_epochs(pipe, loader, 3)
    n = len(alone) // 3
    kept = 3 * n // 2 * 2  # two slots take whole rounds of the one stream
    assert Counter(read) == Counter(alone[:kept])


def test_a_resume_in_the_carried_tail_then_the_loader_is_exact():
    """Slot states taken in epoch 1 (plain iteration, 3 slots in this process), merged
    and loaded into the pipe a DataLoader copies to its 2 workers, which end epoch 1 with
    a tail of one element that opens epoch 2 (read by the loader under its new seed):
    epochs 0..2 are one stream, exactly."""
    universe = [f"e{i}" for i in range(N)]
    read: list = []
    for worker in range(3):  # epoch 0, every slot whole: 27 of 29, a tail of 2
        with as_worker(worker, 3):
            read += list(shuffled().set_epoch(0))
    states = []
    for worker, take in enumerate((2, 1, 1)):  # epoch 1: slot 0 reads past the carried tail
        with as_worker(worker, 3):
            pipe = distshard.StatefulPipeline(shuffled()).set_epoch(1)
            read += list(islice(pipe, take))
            states.append(json.loads(json.dumps(pipe.state_dict())))
    merged = distshard.merge_states(states)
    torch.manual_seed(3)
    pipe = shuffled()
    distshard.StatefulPipeline(pipe).load_state_dict(merged)
    loader = DataLoader(pipe, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60)
    read += [x for x in loader]  # the rest of epoch 1 on 2 slots: 26 of 27, a tail of 1
    assert len(read) == 27 + 4 + 26
    read += run_epochs(pipe, loader, 1, start=2)  # the tail, then epoch 2: 30, no tail
    assert_epochs_exact(read, 3, universe, 2, tail=0)


def test_a_carry_state_of_another_seed_is_refused_naming_the_seed_to_pass():
    """A carry state ordered by another seed (as one taken under a DataLoader's seed
    before this fix) would read its tail in the next epoch in another order: refused,
    naming the seed that resumes it; with that seed it loads."""
    pipe = distshard.StatefulPipeline(shuffled(rank=0, world_size=3)).set_epoch(0)
    next(iter(pipe))
    state = json.loads(json.dumps(pipe.state_dict()))
    shard = state["shard"]
    shard["seed"] = 12345
    with pytest.raises(ValueError, match=r"seed=12345.*seed=None means 0.*pass seed=12345"):
        distshard.StatefulPipeline(shuffled(rank=0, world_size=3)).load_state_dict(state)
    distshard.StatefulPipeline(shuffled(rank=0, world_size=3, seed=12345)).load_state_dict(state)
    node = distshard.DistShardNode([f"e{i}" for i in range(N)], even="carry", shuffle=True, rank=0, world_size=3)
    with pytest.raises(ValueError, match=r"pass seed=12345"):
        node.load_state_dict(state)


def test_set_epoch_during_a_carry_iteration_changes_nothing_in_it():
    """Issue 21 item 2: set_epoch takes effect at the next iteration, never in the
    middle of one, also after the carried group was read (its reader seeds back to the
    running epoch, not to the one just set)."""

    def make():
        return weighted_mix(rank=0, world_size=5, seed=5)

    whole = list(make().set_epoch(1))
    for cut in range(1, len(whole)):  # a generator starts at its first element
        pipe = make().set_epoch(1)
        it = iter(pipe)
        head = list(islice(it, cut))
        pipe.set_epoch(2)
        assert head + list(it) == whole, cut


def test_verify_reports_an_exact_carry_run_under_the_loaders_seed():
    """2 ranks x 2 fork workers, 3 epochs, seed=None: the report is exactly-once."""
    report = distshard.verify(carry_under_the_loaders_seed, world_size=2, num_workers=2, epochs=3, timeout=120)
    assert report.error is None, report.error
    assert report.ok and not report.violated, report.summary()
