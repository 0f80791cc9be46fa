"""Graph walks when torch's pickling traversal cannot run (a DataPipe class
defined inside a function): random pipes and double sharding are still found."""

import pytest
import torch
from torch.utils.data.datapipes.datapipe import IterDataPipe
from torch.utils.data.datapipes.iter import IterableWrapper
from torch.utils.data.datapipes.map import SequenceWrapper
from torch.utils.data.graph import traverse_dps

import distshard
from distshard.graph import pipe_graph, random_pipes, upstream_pipes

from .helpers import run_slots


def _local_classes():
    class Passthrough(IterDataPipe):
        def __init__(self, datapipe):
            self.datapipe = datapipe

        def __iter__(self):
            yield from self.datapipe

    class Chain(IterDataPipe):
        def __init__(self, parts, named):
            self.parts, self.named = list(parts), dict(named)

        def __iter__(self):
            for part in [*self.parts, *self.named.values()]:
                yield from part

    return Passthrough, Chain


Passthrough, Chain = _local_classes()


def test_torch_traversal_cannot_pickle_a_local_class():
    with pytest.raises(AttributeError, match="local object"):
        traverse_dps(Passthrough(IterableWrapper(range(3))))


def _build(rank, world_size):
    torch.manual_seed(rank)  # each rank's own torch seed: dist_shard must reseed the shuffle
    return Passthrough(IterableWrapper(range(40))).shuffle().dist_shard(rank=rank, world_size=world_size)


def test_shuffle_above_a_local_class_is_found_and_seeded_identically():
    shard = _build(0, 1)
    assert [type(p).__name__ for p in random_pipes(shard.source_datapipe)] == ["ShufflerIterDataPipe"]
    per_slot = run_slots(_build, world_size=3, num_workers=2)
    everything = sorted(x for elements in per_slot.values() for x in elements)
    assert everything == list(range(40))
    assert sorted(per_slot[0]) != per_slot[0] or sorted(per_slot[1]) != per_slot[1]  # shuffled


@pytest.mark.parametrize(
    "build",
    [
        lambda: Passthrough(IterableWrapper(range(8)).sharding_filter()),
        lambda: Passthrough(IterableWrapper(range(8))).sharding_filter(),
        lambda: Chain([IterableWrapper(range(4))], {"b": Passthrough(IterableWrapper(range(4)).sharding_filter())}),
        lambda: Passthrough(IterableWrapper(range(8)).dist_shard(rank=0, world_size=2)),
    ],
)
def test_double_sharding_behind_a_local_class_is_refused(build):
    with pytest.raises(RuntimeError, match="sharding twice loses data"):
        build().dist_shard(rank=0, world_size=2)


def test_attribute_walk_visits_each_pipe_once_in_attribute_order():
    a, b, c = IterableWrapper([1]), IterableWrapper([2]), SequenceWrapper([3])
    shared = Passthrough(a)
    top = Chain([shared, (b, [shared])], {"x": IterableWrapper(c), "y": a})
    top.self_reference = top  # a cycle does not loop
    found = upstream_pipes(top)
    assert [id(p) for p in found] == [id(p) for p in (top, shared, a, b, top.named["x"], c)]
    assert [id(p) for p in upstream_pipes(top)] == [id(p) for p in found]  # deterministic


def test_picklable_pipelines_keep_torchs_own_traversal():
    pipeline = IterableWrapper(range(4)).map(str).shuffle().zip(IterableWrapper(range(4)))
    assert pipe_graph(pipeline) == traverse_dps(pipeline)


def test_explain_and_iteration_work_with_a_local_class():
    shard = Passthrough(IterableWrapper(range(10)).map(str)).dist_shard(rank=1, world_size=2)
    assert list(shard) == ["1", "3", "5", "7", "9"]
    found = distshard.explain(shard.batch(2))
    assert found.reads_per_element == 2.0
    assert any("map(str) sits below Passthrough" in w for w in found.warnings)
