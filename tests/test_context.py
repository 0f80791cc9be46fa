"""Who am I: priority of the sources and the errors for bad input."""

import pickle

import pytest
from torch.utils.data.datapipes.iter import IterableWrapper

import distshard
from distshard.context import check_explicit, env_rank_world, resolve_distributed

from .helpers import as_worker


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
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
        ctx.rank = 3  # type: ignore[misc]


def test_pickling_without_a_process_group_captures_nothing(no_env):
    pipe = IterableWrapper(range(4)).dist_shard()
    clone = pickle.loads(pickle.dumps(pipe))
    assert clone._captured is None
    assert clone.context().source == "default"
