"""The mixing schedule: every prefix holds each source within 1 of its exact share."""

from __future__ import annotations

from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from distshard.schedule import Schedule, integer_weights

WEIGHTS = st.lists(
    st.one_of(st.integers(1, 1000), st.floats(0.001, 1000, allow_nan=False, allow_infinity=False)),
    min_size=1, max_size=8,
)


def _exact(weights):
    return [Fraction(w) if isinstance(w, int) else Fraction(repr(float(w))) for w in weights]


@settings(max_examples=200, deadline=None)
@given(WEIGHTS, st.integers(1, 2500))
def test_every_prefix_is_within_one_of_the_exact_share(weights, length):
    schedule = Schedule(weights)
    exact = _exact(weights)
    scale = sum(exact)
    w = [e / scale for e in exact]  # the exact shares, as the user's numbers say
    assert [Fraction(x, schedule.period) for x in schedule.weights] == w
    total = schedule.period
    counts = [0] * len(weights)
    for p, (source, k) in zip(range(length), schedule.iterate()):
        assert k == counts[source]  # the k-th pick of its source, in order
        counts[source] += 1
        for i, c in enumerate(counts):  # |c - (p + 1) w_i / W| < 1, in integers
            assert abs(c * total - (p + 1) * schedule.weights[i]) < total, (weights, p, counts)


@settings(max_examples=200, deadline=None)
@given(WEIGHTS, st.integers(0, 5000))
def test_random_access_agrees_with_the_walk(weights, position):
    schedule = Schedule(weights)
    source, k = schedule.source_at(position)
    assert schedule.position_of(source, k) == position
    assert schedule.count_before(source, position) == k
    assert schedule.count_before(source, position + 1) == k + 1
    walked = [x for _, x in zip(range(position + 1), schedule.iterate())]
    assert walked[-1] == (source, k)
    assert list(zip(range(5), schedule.iterate(position))) == [
        (j, schedule.source_at(position + j)) for j in range(5)]


def test_very_unequal_weights_and_decimals():
    assert integer_weights([0.7, 0.2, 0.1]) == [7, 2, 1]
    assert integer_weights([1000, 1]) == [1000, 1]
    schedule = Schedule([1000, 1])
    assert [s for s, _ in zip(range(1001), schedule.iterate())].count(1) == 1
    assert Schedule([0.7, 0.2, 0.1]).period == 10


def test_an_untabulated_schedule_gives_the_same_answers():
    import distshard.schedule as module

    weights = [3, 5, 11]
    fast = Schedule(weights)
    old, module.PERIOD_LIMIT = module.PERIOD_LIMIT, 1
    try:
        slow = Schedule(weights)
    finally:
        module.PERIOD_LIMIT = old
    assert not slow.tabulated and fast.tabulated
    for p in range(0, 60, 7):
        assert slow.source_at(p) == fast.source_at(p)
        source, k = fast.source_at(p)
        assert slow.position_of(source, k) == p and slow.count_before(source, p) == k
    assert [x for _, x in zip(range(40), slow.iterate(5))] == [x for _, x in zip(range(40), fast.iterate(5))]
