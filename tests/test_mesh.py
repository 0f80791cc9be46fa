"""Model-parallel meshes (issue 29): ``dist_shard(mesh=...)`` / ``group=`` on real gloo
groups with real ``DeviceMesh``es on CPU, and ``distshard.LoaderCheckpoint`` through
``torch.distributed.checkpoint``.

Ranks with the same data coordinate (tensor-parallel peers) get identical batches,
the data ranks together every element exactly once; every collective for the pipe
runs over the data group only; a DCP checkpoint at step k resumes on the same mesh
batch by batch as the uninterrupted run, and elastically on dp = 1 x tp = 4 and
dp = 4 x tp = 1. The ranks are in ``tests/mesh_runs.py``."""

from __future__ import annotations

import pickle
from collections import Counter

import pytest
import torch.distributed as dist
from torch.utils.data.datapipes.iter import IterableWrapper
from torchdata.stateful_dataloader import StatefulDataLoader

import distshard
from distshard.errors import OptionError, OptionTypeError, SetupError, StateMismatchError
from distshard.verify import run_on_group

from . import mesh_runs

TIMEOUT = 120


pytestmark = pytest.mark.watched(TIMEOUT)  # every process's stack on file past the group's timeout


def values(outcomes) -> list:
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    return [o.value for o in outcomes]


def flat(batches) -> list[str]:
    return [x for batch in batches for x in batch]


# -- identical peers, exactly once over the data ranks ------------------------------------------


@pytest.mark.parametrize(
    "kind, context, workers", [("list", "spawn", 1), ("jsonl", "fork", 2)], ids=["list-spawn", "jsonl-fork"]
)
def test_peers_read_identical_batches_and_the_data_ranks_everything_once(tmp_path, kind, context, workers):
    """dp = 2 x tp = 2: ranks 0, 1 are data rank 0 and ranks 2, 3 data rank 1 (the mesh
    is row-major), through StatefulDataLoader workers (spawned and persistent over two
    epochs: the data group reaches them by pickle; forked); group= gives the same
    batches; stop_together behind a filter stops every rank at one step."""
    path = mesh_runs.write_jsonl(tmp_path / "e.jsonl") if kind == "jsonl" else None
    out = values(run_on_group(mesh_runs.peers, world_size=4, args=(kind, path, context, workers), timeout=TIMEOUT))
    assert [o["context"] for o in out] == [
        (0, 2, "mesh", (0,)),
        (0, 2, "mesh", (0,)),
        (1, 2, "mesh", (1,)),
        (1, 2, "mesh", (1,)),
    ]
    for epoch in range(2):
        assert out[0]["mesh"][epoch] == out[1]["mesh"][epoch] and out[2]["mesh"][epoch] == out[3]["mesh"][epoch]
        assert sorted(flat(out[0]["mesh"][epoch]) + flat(out[2]["mesh"][epoch])) == sorted(mesh_runs.elements())
        assert all(len(batch) == mesh_runs.BATCH for o in out for batch in o["mesh"][epoch])
    assert out[0]["mesh"][0] != out[0]["mesh"][1]  # shuffle=True: another order in epoch 1
    assert all(o["group"] == o["mesh"][0] for o in out)  # group= is the same data group
    assert len({o["steps"] for o in out}) == 1 and out[0]["together"] == out[1]["together"]
    assert all(len(o["unused"]) == 2 for o in out)  # gathered over the data group of 2
    assert (
        "data group: mesh ('dp',) of shape (2,), coordinate (1,): data rank 1 of 2 (world ranks [0, 2])"
        in out[2]["explain"]
    )


def test_the_first_pipeline_stage_alone_waits_on_no_other_rank(tmp_path):
    """pp = 2 x dp = 2: only stage 0 builds and reads (a file source indexed over the data
    group, a sizes callable, stop_together, gather_states and LoaderCheckpoint over it);
    stage 1 waits at a barrier over every rank that stage 0 reaches only when done: a
    collective over the world on stage 0 would meet it, and fail or hang."""
    path = mesh_runs.write_jsonl(tmp_path / "e.jsonl")
    out = values(run_on_group(mesh_runs.first_stage, world_size=4, args=(path,), timeout=TIMEOUT))
    assert out[2] == out[3] == {}
    assert sorted(flat(out[0]["batches"]) + flat(out[1]["batches"])) == sorted(mesh_runs.elements())
    assert sorted(out[0]["units"] + out[1]["units"]) == [0, 1, 1, 2, 2, 2]
    assert out[0]["merged"] == out[1]["merged"] and out[0]["merged"]["remaining"] == []
    assert out[0]["checkpoint"] == out[1]["checkpoint"] > 0


def test_peers_at_different_steps_are_refused_naming_them():
    """Rank 1 took a batch more than its peer rank 0: gather_states and LoaderCheckpoint
    refuse on every rank, naming both, never a silent merge."""
    out = values(run_on_group(mesh_runs.divergent, world_size=4, timeout=TIMEOUT))
    for o in out:
        assert "model-parallel peers disagree: rank 0 and rank 1" in o["gather_states"]
        assert "(taken: 4 vs 8)" in o["gather_states"]
        assert "ranks 0 and 1 are data rank 0 of 2" in o["LoaderCheckpoint"]


# -- DCP ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, asynchronous", [("list", False), ("jsonl", True)], ids=["list-save", "jsonl-async"])
def test_a_dcp_checkpoint_resumes_exactly_on_the_same_mesh_and_elastically_on_others(tmp_path, kind, asynchronous):
    """Saved at step 3 of the 2 x 2 mesh with 2 workers a rank: loaded on the same mesh,
    every rank yields what the uninterrupted run yielded, batch by batch; on dp = 1 x
    tp = 4 and dp = 4 x tp = 1 every element once over both runs, but what the new
    run's own even="drop" leaves aside (fewer than its slots x batch). Another
    pipeline's checkpoint is refused before anything is loaded."""
    path = mesh_runs.write_jsonl(tmp_path / "e.jsonl") if kind == "jsonl" else None
    ckpt = str(tmp_path / "ckpt")
    args = (kind, path, ckpt, 3, asynchronous)
    out = values(run_on_group(mesh_runs.checkpointed, world_size=4, args=args, timeout=TIMEOUT))
    for o in out:
        assert o["resumed"][(2, 2)] == o["rest"]  # the same mesh: exactly the uninterrupted run
    first = flat(out[0]["first"]) + flat(out[2]["first"])  # one rank of each data coordinate
    for shape, readers in (((1, 4), [0]), ((4, 1), [0, 1, 2, 3])):
        assert all(o["resumed"][shape] == out[readers[0]]["resumed"][shape] for o in out[: 4 // len(readers)])
        again = [x for r in readers for x in flat(out[r]["resumed"][shape])]
        seen = Counter(first + again)
        assert max(seen.values()) == 1, shape
        missing = set(mesh_runs.elements()) - set(seen)
        slots = shape[0] * 2
        assert len(missing) == (len(mesh_runs.elements()) - len(first)) % (slots * mesh_runs.BATCH), shape
        assert len({len(out[r]["resumed"][shape]) for r in readers}) == 1  # equal counts per rank
    for o in out:
        assert "another pipeline" in o["refused"]["length"]
        assert "shuffle=True but this dist_shard has shuffle=False" in o["refused"]["shuffle"]


def test_without_a_mesh_the_world_is_the_data_group(tmp_path):
    """4 ranks, no mesh, no workers: a DCP checkpoint at step 2 resumes exactly on the
    same loaders, and elastically on loaders with 2 workers each."""
    out = values(run_on_group(mesh_runs.worldwide, world_size=4, args=(str(tmp_path / "ckpt"),), timeout=TIMEOUT))
    assert all(o[0] == o["rest"] for o in out)
    seen = Counter(x for o in out for x in flat(o["first"]) + flat(o[2]))
    assert max(seen.values()) == 1
    assert len(mesh_runs.elements()) - len(seen) < 8 * mesh_runs.BATCH


def test_eight_ranks_with_a_two_dimensional_data_mesh(tmp_path):
    """dp_replicate 2 x dp_shard 2 x tp 2, the data mesh ("dp_replicate", "dp_shard"):
    data rank 2 * replicate + shard of 4, tp peers identical, every element once; a file
    source indexed over it (no process group of its own: one its ranks make),
    stop_together, and a DCP checkpoint at step 2 resumed on the same mesh, exactly."""
    path = mesh_runs.write_jsonl(tmp_path / "e.jsonl")
    args = (path, str(tmp_path / "ckpt"))
    out = values(run_on_group(mesh_runs.three_d, world_size=8, args=args, timeout=TIMEOUT))
    assert [(o["data_rank"], o["data_world"]) for o in out] == [(r // 2, 4) for r in range(8)]
    for peer in range(0, 8, 2):
        assert out[peer] == out[peer + 1]  # tp peers: the same batches, the same data rank
    assert all(o["resumed"] == o["rest"] for o in out)
    got = [x for o in out[::2] for x in flat(o["first"] + o["rest"])]
    assert sorted(got) == sorted(mesh_runs.elements())


# -- in one process: the options, the state, the checkpoint without a mesh ---------------------------


@pytest.fixture
def one_rank():
    """A one-rank gloo group in this process (a FileStore), destroyed after the test."""
    from .docs_fixtures import one_rank_group

    one_rank_group()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_data_group_arguments_are_checked(one_rank):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    source = IterableWrapper(["a", "b"])
    with pytest.raises(OptionError, match=r"rank=0, world_size=1 and mesh= were both given"):
        source.dist_shard(mesh=mesh, rank=0, world_size=1)
    with pytest.raises(OptionError, match="mesh= and group= were both given"):
        source.dist_shard(mesh=mesh, group=mesh.get_group())
    with pytest.raises(OptionTypeError, match="mesh=.* must be a torch.distributed.device_mesh.DeviceMesh"):
        source.dist_shard(mesh=mesh.get_group())
    with pytest.raises(OptionTypeError, match="group=.* must be a torch.distributed ProcessGroup"):
        distshard.DistShardNode(["a"], group=mesh)
    with pytest.raises(OptionTypeError, match="mesh="):
        distshard.jsonl("missing.jsonl", mesh="dp")
    pipe = source.dist_shard(mesh=mesh)
    ctx = pickle.loads(pickle.dumps(pipe)).context()  # as a spawned worker receives it
    assert (ctx.rank, ctx.world_size, ctx.source, ctx.group.coordinate, ctx.group.ranks) == (0, 1, "mesh", (0,), (0,))
    assert ctx.group.live_group() is None and pipe.context().group.live_group() is not None
    assert "mesh=<mesh ('dp',) of shape (1,)" in repr(pipe)


def test_a_data_group_needs_torch_distributed():
    if dist.is_initialized():
        pytest.skip("a process group is up")
    with pytest.raises(SetupError, match="group= needs an initialized torch.distributed"):
        IterableWrapper([1]).dist_shard(group=object())


def test_a_data_groups_states_name_their_copy_and_round_trip(one_rank):
    from distshard.state import State

    pipe = distshard.StatefulPipeline(IterableWrapper(list(range(6))).dist_shard(group=dist.group.WORLD))
    assert pipe.state_dict()["shard"]["replica"] == [0, 1]  # before iterating: this copy's
    it = iter(pipe)
    next(it)
    state = pipe.state_dict()["shard"]
    assert state["replica"] == [0, 1] and State.from_dict(state).to_dict() == state
    with pytest.raises(ValueError, match=r"replica=\[1, 1\] must be \[slot, num_slots\]"):
        State.from_dict({**state, "replica": [1, 1]})
    plain = IterableWrapper(list(range(6))).dist_shard(rank=0, world_size=1)
    assert "replica" not in plain.state_dict()  # the wire of a pipe without a data group is unchanged


def test_the_nodes_front_end_takes_the_data_group(one_rank):
    from torchdata.nodes import Loader

    node = distshard.DistShardNode(list(range(6)), group=dist.group.WORLD, even="drop")
    ctx = node.context()
    assert (ctx.rank, ctx.world_size, ctx.source) == (0, 1, "group")
    loader = Loader(node)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert distshard.merge_states([state, state])["remaining"] == [[1, 6]]  # a peer's identical state once


def test_a_loader_checkpoint_without_a_mesh_resumes_exactly_and_elastically():
    """No torch.distributed: the process is the data group. The same workers resume the
    loader's own state batch by batch; other workers resume the merge, every element once.
    Taking the state of a loader that has not started starts nothing (as dcp.load asks)."""

    def make(workers):
        shard = IterableWrapper(mesh_runs.elements()).dist_shard(even="drop", shuffle=True, seed=1, multiple_of=4)
        # forkserver: workers fork from the clean preloaded server, not from this threaded process
        kwargs = {"multiprocessing_context": "forkserver", "timeout": 60} if workers else {}
        return StatefulDataLoader(
            distshard.StatefulPipeline(shard.batch(4)), batch_size=None, num_workers=workers, **kwargs
        )

    loader = make(2)
    it = iter(loader)
    first = [next(it) for _ in range(5)]
    saved = distshard.LoaderCheckpoint(loader).state_dict()
    rest = list(it)
    fresh = make(2)
    blank = distshard.LoaderCheckpoint(fresh)
    blank.state_dict()  # what dcp.load asks first
    assert fresh._iterator is None  # no worker started
    blank.load_state_dict(saved)
    assert list(fresh) == rest
    other = make(0)
    distshard.LoaderCheckpoint(other).load_state_dict(saved)
    again = flat(first) + flat(other)
    assert len(again) == len(set(again)) and len(mesh_runs.elements()) - len(again) < 4


def test_another_pipelines_checkpoint_is_refused_before_anything_is_loaded():
    def make(n, shuffle=True):
        shard = IterableWrapper(mesh_runs.elements(n)).dist_shard(shuffle=shuffle, seed=1)
        return StatefulDataLoader(distshard.StatefulPipeline(shard), batch_size=None)

    loader = make(96)
    it = iter(loader)
    next(it)
    saved = distshard.LoaderCheckpoint(loader).state_dict()
    for other, words in ((make(97), "another pipeline"), (make(96, shuffle=False), "shuffle=True but")):
        with pytest.raises(StateMismatchError, match=words):
            distshard.LoaderCheckpoint(other).load_state_dict(saved)
        assert other.next_iter_state is None and other.dataset.shard.core.resume is None
    with pytest.raises(StateMismatchError, match="not a LoaderCheckpoint state"):
        distshard.LoaderCheckpoint(loader).load_state_dict({"model": 1})
    with pytest.raises(OptionTypeError, match="StatefulDataLoader"):
        distshard.LoaderCheckpoint(object())
