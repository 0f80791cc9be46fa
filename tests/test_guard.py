"""stop_together on a real gloo group: a filter after dist_shard drops a different
number of elements on every rank; the loop still ends on every rank together."""

import math
import re

import pytest

import distshard
from distshard.verify import run_on_group

from . import builds, verify_factories

pytestmark = pytest.mark.watched(60)  # every process's stack on file past the group's timeout


@pytest.mark.parametrize("workers", [0, 2])
def test_all_ranks_stop_at_the_first_rank_that_runs_out(workers):
    outcomes = run_on_group(builds.guarded_loop, world_size=3, args=(True, workers), timeout=60)
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    steps = {o.value[0] for o in outcomes}
    totals = [o.value[3] for o in outcomes]
    assert len(set(totals)) > 1  # the filter really unbalanced the ranks
    assert steps == {min(totals)}  # everybody stopped where the shortest rank ran out
    for o in outcomes:
        assert o.value[1] == o.value[3] - min(totals)  # what this rank left unused
        assert o.value[2] == [t - min(totals) for t in totals]  # and everybody's


def test_without_the_guard_the_same_loop_fails_instead_of_finishing():
    outcomes = run_on_group(builds.guarded_loop, world_size=3, args=(False, 0), timeout=25)
    assert any(o.error for o in outcomes)


def test_needs_a_process_group_and_a_positive_timeout():
    with pytest.raises(RuntimeError, match="needs an initialized torch.distributed"):
        list(distshard.stop_together([1, 2]))
    with pytest.raises(ValueError, match="timeout=0 must be positive"):
        distshard.stop_together([1], timeout=0)


@pytest.mark.parametrize(
    "timeout, error",
    [
        (math.nan, ValueError),
        (math.inf, ValueError),
        (0, ValueError),
        (-1.5, ValueError),
        ("5", TypeError),
        (True, TypeError),
        (None, TypeError),
    ],
)
def test_timeout_must_be_a_finite_positive_number(timeout, error):
    with pytest.raises(error, match=re.escape(f"timeout={timeout!r}")):
        distshard.stop_together([1], timeout=timeout)


def test_wrappers_release_their_flag_groups():
    """20 wrappers, one short epoch each: the rank's open fds do not grow per wrapper."""
    outcomes = run_on_group(verify_factories.fds_over_wrappers, world_size=2, args=(20,), timeout=60)
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    for o in outcomes:
        first, last = o.value
        assert last - first <= 5, (o.rank, first, last)


def test_a_subgroup_guard_needs_only_its_members():
    """Also epoch after epoch, with rank 1 a second behind rank 0 into the second epoch:
    the flag group of a subgroup made again after a destroy took the destroyed one's name,
    and gloo connected to the addresses it left in the store (the second epoch failed)."""
    outcomes = run_on_group(builds.guarded_subgroup, world_size=3, timeout=60)
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    assert [o.value for o in outcomes] == [[3, 3, 4], [3, 3, 4], None]
