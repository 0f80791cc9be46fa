"""Real gloo groups on 127.0.0.1: every rank is a process that joined the group
with init_process_group(rank=..., world_size=...) and no RANK/WORLD_SIZE in its
environment (as mp.spawn code does), iterating through real DataLoader workers."""

import pytest
from torch.utils.data import DataLoader
from torch.utils.data.datapipes.iter import IterableWrapper

import distshard
from distshard.verify import run_on_group

from . import builds

TIMEOUT = 60


pytestmark = pytest.mark.watched(TIMEOUT)  # every process's stack on file past the group's timeout


@pytest.mark.parametrize(
    "build, world, workers, method, loader",
    [
        (builds.strings_none, 4, 2, "fork", "torch"),
        (builds.dicts_drop, 3, 2, "spawn", "torch"),
        (builds.dicts_pad, 2, 3, "fork", "stateful"),
        (builds.tensors_none, 2, 2, "spawn", "stateful"),
        (builds.evens_drop, 4, 1, "fork", "torch"),
        (builds.duplicated_pad, 3, 0, "fork", "torch"),
    ],
    ids=[
        "strings-4x2-fork",
        "dicts-drop-3x2-spawn",
        "dicts-pad-2x3-stateful",
        "tensors-2x2-spawn-stateful",
        "evens-drop-4x1",
        "duplicated-pad-3x0",
    ],
)
def test_exactly_once_on_a_real_group(build, world, workers, method, loader):
    report = distshard.verify(
        build, world_size=world, num_workers=workers, start_method=method, loader=loader, timeout=TIMEOUT
    )
    assert report.ok, report.summary()
    assert report.error is None
    assert report.received == report.expected - report.allowed_missing + report.allowed_duplicates
    if report.even is not None:
        assert report.slots_equal and report.ranks_equal, report.summary()


@pytest.mark.parametrize("loader", ["none", "torch"])
def test_per_rank_torch_seeds_do_not_break_exactly_once(loader):
    """torch.manual_seed(rank) on every rank, shuffle upstream, 2 epochs."""
    report = distshard.verify(
        builds.per_rank_seeded_shuffle, world_size=3, num_workers=2, loader=loader, epochs=2, timeout=TIMEOUT
    )
    assert report.ok, report.summary()
    orders = {}
    for epoch, _slot, key in report.seen:
        orders.setdefault(epoch, []).append(key)
    assert orders[0] != orders[1]  # a different order per epoch


def test_verify_catches_torch_sharding_filter_with_unsynced_shuffle():
    """The harness can fail: sharding_filter after a per-rank seeded shuffle."""
    report = distshard.verify(
        builds.sharding_filter_unsynced, world_size=4, num_workers=0, loader="none", timeout=TIMEOUT
    )
    assert not report.ok
    assert report.duplicate_count > 0 and report.missing_count == report.duplicate_count


@pytest.mark.parametrize("build", [builds.ddp_batches_drop, builds.ddp_batches_pad])
def test_ddp_loop_with_batches_finishes_on_every_rank(build):
    """One all_reduce per batch, 34 records, 3 ranks x 2 workers, batch(5)."""
    report = distshard.verify(build, world_size=3, num_workers=2, timeout=TIMEOUT)
    assert report.error is None, report.summary()
    assert report.ranks_equal and report.slots_equal, report.summary()
    assert report.per_rank == ([2, 2, 2] if build is builds.ddp_batches_drop else [4, 4, 4])


def test_ddp_loop_without_even_fails_within_the_timeout_instead_of_hanging():
    """The same loop with even=None: ranks get 4/4/2 batches and the collectives
    no longer match. The harness reports it within its timeout."""
    # the timeout bounds the whole run now (start-up of 4 interpreters included): leave
    # room for start-up, and the collective mismatch still ends it well before a hang would
    report = distshard.verify(builds.ddp_batches_uneven, world_size=3, num_workers=2, timeout=25, step_collective=True)
    assert report.error is not None
    assert report.per_rank[2] == 2 and report.per_rank[0] > 2  # rank 2 ran out first


class _SourceTag:
    def __init__(self, shard):
        self.shard = shard

    def __call__(self, element):
        ctx = self.shard.context()
        return [ctx.source, ctx.rank, ctx.world_size, ctx.slot, element]


def _contexts_in_workers(rank, world_size, method):
    shard = IterableWrapper(list(range(24))).dist_shard()
    loader = DataLoader(
        shard.map(_SourceTag(shard)), batch_size=None, num_workers=2, multiprocessing_context=method, timeout=TIMEOUT
    )
    return [tuple(x) for x in loader]


@pytest.mark.parametrize("method, source", [("spawn", "pickled"), ("fork", "torch.distributed")])
def test_workers_resolve_the_rank_of_an_mp_spawn_style_group(method, source):
    outcomes = run_on_group(_contexts_in_workers, world_size=2, args=(method,), timeout=TIMEOUT)
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    rows = [row for o in outcomes for row in o.value]
    assert {row[0] for row in rows} == {source}
    for o in outcomes:
        assert {(row[1], row[2]) for row in o.value} == {(o.rank, 2)}
    assert sorted(row[4] for row in rows) == list(range(24))
    assert {row[3] for row in rows} == {0, 1, 2, 3}
    assert all(row[4] % 4 == row[3] for row in rows)  # position p went to slot p % 4
