"""dist_shard through real DataLoader workers (fork and spawn) and torchdata's
StatefulDataLoader, one process per simulated rank (explicit rank / world_size).
Real gloo groups are in test_gloo.py."""

from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.datapipes.iter import IterableWrapper

import distshard  # noqa: F401  (registers .dist_shard)

from .builds import records
from .helpers import multiset


def _loader_items(pipe, workers, method, cls=DataLoader, **kwargs):
    extra = {"multiprocessing_context": method, "timeout": 60} if workers else {}
    return list(cls(pipe, batch_size=None, num_workers=workers, **extra, **kwargs))


class _SlotTag:
    """``element -> (slot, element)``, computed in the worker from the shard pipe."""

    def __init__(self, shard):
        self.shard = shard

    def __call__(self, element):
        return self.shard.context().slot, element


def _tagged(data, rank, world, even=None):
    shard = IterableWrapper(data).shuffle().dist_shard(rank=rank, world_size=world, even=even)
    return shard.map(_SlotTag(shard))


@pytest.mark.parametrize(
    "method, even",
    [
        ("fork", None),
        ("fork", "drop"),
        ("fork", "pad"),
        ("spawn", None),
        ("spawn", "drop"),
        ("spawn", "pad"),
        ("forkserver", "drop"),
    ],
)
def test_workers_partition_exactly(method, even):
    world, workers, n = 2, 2, 103
    data = [f"x{i}" for i in range(n)]
    per_slot = Counter()
    seen = []
    for rank in range(world):
        for slot, element in _loader_items(_tagged(data, rank, world, even), workers, method):
            per_slot[slot] += 1
            seen.append(element)
    slots = world * workers
    assert sorted(per_slot) == list(range(slots))  # every worker resolved a distinct slot
    if even is None:
        assert multiset(seen) == multiset(data)
    else:
        expected = n // slots if even == "drop" else -(-n // slots)
        assert set(per_slot.values()) == {expected}
        if even == "drop":
            assert not multiset(seen) - multiset(data) and len(seen) == n - n % slots
        else:
            assert not multiset(data) - multiset(seen) and len(seen) == slots * expected


def test_len_of_the_dataloader_is_the_rank_total():
    for world, workers, n, even in [(2, 3, 20, None), (3, 2, 100, "drop"), (2, 2, 7, "pad")]:
        for rank in range(world):
            pipe = IterableWrapper(list(range(n))).dist_shard(rank=rank, world_size=world, even=even)
            loader = DataLoader(pipe, batch_size=None, num_workers=workers, multiprocessing_context="fork")
            assert len(loader) == len(list(loader)), (world, workers, n, even, rank)


def test_stateful_dataloader_partitions_exactly():
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = records(57)
    seen = []
    for rank in range(3):
        seen += [e for _, e in _loader_items(_tagged(data, rank, 3), 2, "fork", cls=StatefulDataLoader)]
    assert multiset(seen) == multiset(data)


def test_dataloader_seed_cannot_break_the_partition():
    """DataLoader reseeds upstream shuffles per iterator; every worker of every
    rank must still see one order. Two epochs, different generators per rank."""
    data = list(range(300))
    for epoch in range(2):
        seen = []
        for rank in range(2):
            pipe = IterableWrapper(data).shuffle().dist_shard(rank=rank, world_size=2)
            pipe.set_epoch(epoch)
            gen = torch.Generator().manual_seed(rank * 17 + epoch)
            seen += _loader_items(pipe, 2, "fork", generator=gen)
        assert sorted(seen) == data


def test_workers_see_the_base_seed_of_a_single_rank_loader():
    """Without torch.distributed a single rank may use the DataLoader's seed: one
    order per DataLoader iterator, shared by its workers."""
    pipe = IterableWrapper(list(range(64))).shuffle().dist_shard()
    loader = DataLoader(pipe, batch_size=None, num_workers=2, multiprocessing_context="fork")
    first, second = list(loader), list(loader)
    assert sorted(first) == sorted(second) == list(range(64))
    assert first != second  # a new DataLoader seed per epoch, like shuffle=True
