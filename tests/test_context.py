"""Who am I: priority of the sources and the errors for bad input."""

import pickle
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.datapipes.datapipe import IterDataPipe
from torch.utils.data.datapipes.iter import IterableWrapper

import distshard
from distshard import context
from distshard.context import check_environment, check_explicit, env_rank_world, note_captured, resolve_distributed
from distshard.verify import free_port, run_on_group

from .helpers import as_worker

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture
def no_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(context, "_pickled", None)  # no pipe arrived pickled in this process
    return monkeypatch


def test_default_is_single_rank(no_env):
    ctx = distshard.current_context()
    assert (ctx.rank, ctx.world_size, ctx.slot, ctx.num_slots, ctx.source) == (0, 1, 0, 1, "default")


def test_env_is_read_like_torchrun_sets_it(no_env):
    no_env.setenv("RANK", "2")
    no_env.setenv("WORLD_SIZE", "4")
    ctx = distshard.current_context()
    assert (ctx.rank, ctx.world_size, ctx.source) == (2, 4, "env")


def test_explicit_beats_env_and_pickled_capture(no_env):
    no_env.setenv("RANK", "2")
    no_env.setenv("WORLD_SIZE", "4")
    assert resolve_distributed((1, 3), captured=(0, 2)) == (1, 3, "explicit")
    assert resolve_distributed(None, captured=(1, 2)) == (1, 2, "pickled")
    assert resolve_distributed(None, None) == (2, 4, "env")


def test_worker_part_makes_the_slot(no_env):
    with as_worker(1, 3):
        ctx = distshard.current_context(rank=2, world_size=4)
    assert (ctx.worker_id, ctx.num_workers, ctx.slot, ctx.num_slots) == (1, 3, 7, 12)
    assert ctx.source == "explicit"


@pytest.mark.parametrize(
    "rank, world_size, error, words",
    [
        (1, None, ValueError, "rank=1 was given without world_size"),
        (None, 4, ValueError, "world_size=4 was given without rank"),
        (True, 2, TypeError, "rank=True must be an int"),
        (0, 2.0, TypeError, "world_size=2.0 must be an int"),
        ("0", 2, TypeError, "rank='0' must be an int"),
        (0, 0, ValueError, "world_size=0 must be at least 1"),
        (2, 2, ValueError, r"rank=2 is outside \[0, world_size=2\)"),
        (-1, 2, ValueError, r"rank=-1 is outside"),
    ],
)
def test_bad_explicit_arguments_name_the_value(rank, world_size, error, words, no_env):
    with pytest.raises(error, match=words):
        check_explicit(rank, world_size)
    with pytest.raises(error, match=words):
        IterableWrapper(range(4)).dist_shard(rank=rank, world_size=world_size)


@pytest.mark.parametrize(
    "env, words",
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
        ({"RANK": "0"}, "RANK='0' is set but WORLD_SIZE is not"),
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE='2' is set but RANK is not"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be at least 1"),
        ({"RANK": "3", "WORLD_SIZE": "2"}, r"RANK=3 is outside \[0, WORLD_SIZE=2\)"),
    ],
)
def test_malformed_env_names_the_variable_at_construction(env, words, no_env):
    for key, value in env.items():
        no_env.setenv(key, value)
    with pytest.raises(ValueError, match=words):
        env_rank_world()
    with pytest.raises(ValueError, match=words):
        IterableWrapper(range(4)).dist_shard()
    # explicit values do not need the environment, so they still work
    assert list(IterableWrapper(range(4)).dist_shard(rank=0, world_size=2)) == [0, 2]


def test_context_is_frozen():
    ctx = distshard.current_context(rank=0, world_size=1)
    with pytest.raises(AttributeError):
        ctx.rank = 3


def test_pickling_without_a_process_group_captures_nothing(no_env):
    pipe = IterableWrapper(range(4)).dist_shard()
    clone = pickle.loads(pickle.dumps(pipe))
    assert clone.core.captured is None
    assert clone.context().source == "default"


# -- the environment Lightning's launcher sets: WORLD_SIZE, LOCAL_RANK, NODE_RANK, no RANK


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"WORLD_SIZE": "4", "LOCAL_RANK": "2", "NODE_RANK": "0"}, (2, 4)),  # one node
        ({"WORLD_SIZE": "8", "LOCAL_RANK": "3", "NODE_RANK": "0"}, (3, 8)),  # node 0 of two
        ({"WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, (1, 4)),
        ({"WORLD_SIZE": "8", "LOCAL_RANK": "1", "NODE_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, (5, 8)),
        ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "NODE_RANK": "1"}, (3, 4)),  # RANK wins
        ({"LOCAL_RANK": "1", "NODE_RANK": "0"}, None),  # no world size: not distributed
    ],
)
def test_rank_is_derived_from_local_rank_when_certain(env, expected):
    assert env_rank_world(env) == expected


@pytest.mark.parametrize(
    "env, words",
    [
        (
            {"WORLD_SIZE": "8", "LOCAL_RANK": "1", "NODE_RANK": "1"},
            r"RANK is not set, and LOCAL_RANK=1, NODE_RANK=1 with WORLD_SIZE=8 do not say .* set RANK, "
            r"or LOCAL_WORLD_SIZE \(processes per node\)$",
        ),
        ({"WORLD_SIZE": "8", "LOCAL_RANK": "1"}, r"set RANK, or LOCAL_WORLD_SIZE \(processes per node\) and NODE_RANK"),
        ({"WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, "set RANK, or NODE_RANK"),
        ({"WORLD_SIZE": "8", "LOCAL_RANK": "x", "NODE_RANK": "0"}, "LOCAL_RANK='x' is not an integer"),
        ({"WORLD_SIZE": "8", "LOCAL_RANK": "0", "NODE_RANK": "one"}, "NODE_RANK='one' is not an integer"),
        ({"WORLD_SIZE": "4", "LOCAL_RANK": "-1", "NODE_RANK": "0"}, "LOCAL_RANK=-1 must be non-negative"),
        ({"WORLD_SIZE": "4", "LOCAL_RANK": "4", "NODE_RANK": "0"}, r"give rank 4, outside \[0, WORLD_SIZE=4\)"),
        ({"WORLD_SIZE": "8", "LOCAL_RANK": "1", "NODE_RANK": "2", "LOCAL_WORLD_SIZE": "4"}, "give rank 9, outside"),
        ({"WORLD_SIZE": "6", "LOCAL_RANK": "1", "NODE_RANK": "0", "LOCAL_WORLD_SIZE": "4"}, "do not fit together"),
        ({"WORLD_SIZE": "4", "LOCAL_RANK": "1", "NODE_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, "means a single node"),
        ({"WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE=0 must be at least 1"),
    ],
)
def test_an_uncertain_or_malformed_derivation_names_the_variables(env, words):
    with pytest.raises(ValueError, match=words):
        env_rank_world(env)


def test_lightning_single_node_environment_resolves(no_env):
    for name, value in {"WORLD_SIZE": "2", "LOCAL_RANK": "1", "NODE_RANK": "0"}.items():
        no_env.setenv(name, value)
    check_environment()
    ctx = distshard.current_context()
    assert (ctx.rank, ctx.world_size, ctx.source) == (1, 2, "env")
    assert list(IterableWrapper(range(6)).dist_shard()) == [1, 3, 5]


def test_check_environment_defers_a_rank_only_torch_distributed_can_tell(no_env):
    # multi-node Lightning before trainer.fit: the process group will decide
    for name, value in {"WORLD_SIZE": "8", "LOCAL_RANK": "1", "NODE_RANK": "1"}.items():
        no_env.setenv(name, value)
    check_environment()
    with pytest.raises(ValueError, match="set RANK, or LOCAL_WORLD_SIZE"):
        distshard.current_context()
    no_env.setenv("LOCAL_RANK", "x")
    with pytest.raises(ValueError, match="LOCAL_RANK='x' is not an integer"):
        check_environment()


@pytest.fixture
def one_rank_group():
    """torch.distributed initialized in this process (gloo, world size 1)."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "env", [{"RANK": "0", "WORLD_SIZE": "two"}, {"WORLD_SIZE": "2"}, {"RANK": "5", "WORLD_SIZE": "2"}]
)
def test_malformed_env_is_ignored_when_torch_distributed_is_initialized(env, no_env, one_rank_group):
    for name, value in env.items():
        no_env.setenv(name, value)
    check_environment()
    ctx = distshard.current_context()
    assert (ctx.rank, ctx.world_size, ctx.source) == (0, 1, "torch.distributed")
    with pytest.raises(ValueError):
        env_rank_world()  # the environment itself is still malformed


def test_construction_ignores_malformed_env_when_torch_distributed_is_initialized(no_env, one_rank_group):
    no_env.setenv("WORLD_SIZE", "two")
    no_env.setenv("RANK", "0")
    assert list(IterableWrapper(range(3)).dist_shard()) == [0, 1, 2]


# -- the process-level record of a pipe that arrived pickled


def test_a_recorded_capture_is_the_context_of_dataloader_workers(no_env):
    from .helpers import as_worker

    no_env.setenv("RANK", "0")
    no_env.setenv("WORLD_SIZE", "4")
    note_captured((1, 2))
    with as_worker(0, 2):  # a worker received pipes by pickle: their rank is its rank
        ctx = distshard.current_context()
        assert (ctx.rank, ctx.world_size, ctx.source) == (1, 2, "pickled")  # pickled beats env
        assert distshard.current_context(rank=0, world_size=3).source == "explicit"
    # a rank's own process that unpickled a copy (deepcopy) does not adopt it
    assert distshard.current_context().source == "env"
    assert resolve_distributed(None, captured=(0, 5)) == (0, 5, "pickled")  # a pipe's own value first
    with pytest.raises(ValueError, match=r"rank=2 is outside \[0, world_size=2\)"):
        note_captured((2, 2))
    note_captured(None)
    with as_worker(0, 2):
        assert distshard.current_context().source == "env"


class _ContextProbe(IterDataPipe):
    """Yields ``current_context()`` of the process that iterates it. Pickled in a
    rank with torch.distributed, it records the capture on arrival, as
    ``DistShardIterDataPipe.__setstate__`` does."""

    def __init__(self):
        self.captured = None

    def __iter__(self):
        ctx = distshard.current_context()
        yield [ctx.source, ctx.rank, ctx.world_size, ctx.worker_id, ctx.num_workers]

    def __getstate__(self):
        return {**self.__dict__, "captured": context.dist_rank_world()}

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.captured is not None and context.dist_rank_world() is None:
            note_captured(self.captured)


def _contexts_in_spawn_workers(rank, world_size):
    loader = DataLoader(_ContextProbe(), batch_size=None, num_workers=2, multiprocessing_context="spawn", timeout=60)
    return [tuple(row) for row in loader]


def test_current_context_in_spawn_workers_of_a_gloo_rank_is_the_rank():
    outcomes = run_on_group(_contexts_in_spawn_workers, world_size=2, timeout=90)
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    for o in outcomes:
        assert sorted(o.value) == [("pickled", o.rank, 2, 0, 2), ("pickled", o.rank, 2, 1, 2)]


# -- issue 15: an ambiguous environment is a public, documented error ------------------------


def test_an_ambiguous_environment_raises_the_public_unknown_rank_error(monkeypatch):
    for name in ("RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("NODE_RANK", "1")
    pipe = IterableWrapper(range(8)).dist_shard()  # not an error before it is iterated
    with pytest.raises(distshard.UnknownRankError, match="LOCAL_RANK=1, NODE_RANK=1 with WORLD_SIZE=8") as raised:
        list(pipe)
    assert isinstance(raised.value, ValueError) and "UnknownRankError" in distshard.__all__
    assert type(raised.value).__module__ == "distshard.context" and not type(raised.value).__name__.startswith("_")
