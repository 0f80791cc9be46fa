"""The mixing schedule: every prefix holds each source within 1 of its exact share
(of a phase, counted from its start), or within the largest element cost of its
share of the cost; random access agrees with the walk."""

from __future__ import annotations

from fractions import Fraction
from itertools import islice

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distshard.schedule import CostSchedule, PhasedSchedule, Schedule, integer_weights

WEIGHTS = st.lists(
    st.one_of(st.integers(1, 1000), st.floats(0.001, 1000, allow_nan=False, allow_infinity=False)),
    min_size=1,
    max_size=8,
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
    for p, (source, k) in enumerate(islice(schedule.iterate(), length)):
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
    walked = list(islice(schedule.iterate(), position + 1))
    assert walked[-1] == (source, k)
    assert list(enumerate(islice(schedule.iterate(position), 5))) == [
        (j, schedule.source_at(position + j)) for j in range(5)
    ]


def test_very_unequal_weights_and_decimals():
    assert integer_weights([0.7, 0.2, 0.1]) == [7, 2, 1]
    assert integer_weights([1000, 1]) == [1000, 1]
    schedule = Schedule([1000, 1])
    assert [s for s, _ in islice(schedule.iterate(), 1001)].count(1) == 1
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
    assert list(islice(slow.iterate(5), 40)) == list(islice(fast.iterate(5), 40))


# -- phases ------------------------------------------------------------------------------


def _phases(draw, n):
    """1-3 phases over ``n`` sources; a weight may be 0 in a phase, never all."""
    phases, start = [], 0
    for _ in range(draw(st.integers(1, 3))):
        weights = draw(st.lists(st.sampled_from([0, 0, 1, 2, 3, 7, 0.5, 12.25]), min_size=n, max_size=n))
        if not any(weights):
            weights[draw(st.integers(0, n - 1))] = 1
        phases.append((start, weights))
        start += draw(st.integers(1, 150))
    return phases


@st.composite
def phased(draw):
    n = draw(st.integers(1, 5))
    return _phases(draw, n), draw(st.integers(1, 500))


@settings(max_examples=150, deadline=None)
@given(phased())
def test_every_prefix_of_a_phase_is_within_one_of_its_share_and_sources_go_on(spec):
    phases, length = spec
    schedule = PhasedSchedule(phases)
    starts = [start for start, _ in phases] + [float("inf")]
    total_picks = [0] * len(phases[0][1])
    phase = -1
    for p, (source, k) in enumerate(islice(schedule.iterate(), length)):
        while p >= starts[phase + 1]:  # a phase starts: its prefixes are counted from here
            phase += 1
            weights = integer_weights(phases[phase][1])
            counts, since = [0] * len(weights), 0
        assert weights[source], (p, source)  # a source of weight 0 never appears in that phase
        assert k == total_picks[source]  # picks numbered across phases: no element repeats
        total_picks[source] += 1
        counts[source] += 1
        since += 1
        total = sum(weights)
        for i, c in enumerate(counts):
            assert abs(c * total - since * weights[i]) < total, (phases, p, counts)


@settings(max_examples=100, deadline=None)
@given(phased(), st.integers(0, 400))
def test_a_phased_schedule_answers_at_random_what_its_walk_gives(spec, position):
    phases, _ = spec
    schedule = PhasedSchedule(phases)
    walked = list(islice(schedule.iterate(), position + 6))
    source, k = walked[position]
    assert schedule.source_at(position) == (source, k)
    assert schedule.position_of(source, k) == position
    assert schedule.count_before(source, position) == k
    assert list(islice(schedule.iterate(position), 6)) == walked[position:]


def test_a_source_without_weight_in_the_last_phase_never_comes_again():
    schedule = PhasedSchedule([(0, [1, 1]), (10, [1, 0])])
    assert schedule.count_before(1, 10) == 5
    assert schedule.position_of(1, 4) is not None and schedule.position_of(1, 5) is None
    assert schedule.first_reaching([100, 5]) == 10 + (100 - 5)  # source 0 (5 picks before 10) reaches 100


@pytest.mark.parametrize("phases", [[(1, [1])], [(0, [1]), (0, [2])], [(0, [1]), (5, [1]), (3, [1])]])
def test_phases_must_start_at_0_and_increase(phases):
    with pytest.raises(ValueError, match="start at 0 and at increasing"):
        PhasedSchedule(phases)
    with pytest.raises(ValueError, match="start at 0 and at increasing"):
        CostSchedule(phases, [[1]])


# -- costs -------------------------------------------------------------------------------


@st.composite
def costed(draw):
    n = draw(st.integers(1, 5))
    costs = [draw(st.lists(st.integers(0, 100), min_size=1, max_size=12)) for _ in range(n)]
    for c in costs:
        if not any(c):
            c[0] = draw(st.integers(1, 100))
    return _phases(draw, n), costs, draw(st.integers(1, 600))


@settings(max_examples=150, deadline=None)
@given(costed())
def test_every_prefix_of_a_cost_mix_is_within_the_largest_cost_of_its_share(spec):
    """In every prefix (of a phase, from its start) each source's cost C_i is within
    the largest element cost of its share s_i C of the prefix's cost: better than
    the (sources - 1) x that largest-deficit-first keeps. Exact, in integers."""
    phases, costs, length = spec
    schedule = CostSchedule(phases, costs)
    largest = max(max(c) for c in costs)
    starts = [start for start, _ in phases] + [float("inf")]
    picks = [0] * len(costs)
    phase = -1
    for p, (source, k) in enumerate(islice(schedule.iterate(), length)):
        while p >= starts[phase + 1]:
            phase += 1
            weights = integer_weights(phases[phase][1])
            total, cost, own = sum(weights), 0, [0] * len(costs)
        assert weights[source] and k == picks[source]
        picks[source] += 1
        c = costs[source][k % len(costs[source])]  # passes repeat the costs
        cost += c
        own[source] += c
        for i in range(len(costs)):  # |C_i - C w_i / W| <= largest, times W
            assert abs(own[i] * total - cost * weights[i]) <= largest * total, (phases, costs, p, own)


@settings(max_examples=100, deadline=None)
@given(costed(), st.integers(0, 500))
def test_a_cost_schedule_answers_at_random_what_its_walk_gives(spec, position):
    phases, costs, _ = spec
    walked = list(islice(CostSchedule(phases, costs).iterate(), position + 6))
    schedule = CostSchedule(phases, costs)  # a fresh one: random access first, then the walk
    source, k = walked[position]
    assert schedule.position_of(source, k) == position
    assert schedule.source_at(position) == (source, k)
    assert schedule.count_before(source, position) == k
    assert list(islice(schedule.iterate(position), 6)) == walked[position:]


EXTREME_COSTS = st.one_of(
    st.floats(0, 1.7976931348623157e308, allow_nan=False, allow_infinity=False),  # subnormals to the largest
    st.sampled_from([5e-324, 2.2250738585072014e-308, 1e306, 1.7976931348623157e308, 0.1, 0.1234567]),
    st.integers(0, 10**400),  # ints beyond any float
)
EXTREME_WEIGHTS = st.one_of(
    st.floats(1e-300, 1e300, allow_nan=False, allow_infinity=False),
    st.sampled_from([0.1234567, 0.5, 1e-300, 1.7976931348623157e308]),
    st.integers(1, 10**30),
)


@st.composite
def extreme_costed(draw):
    n = draw(st.integers(1, 4))
    costs = [draw(st.lists(EXTREME_COSTS, min_size=1, max_size=8)) for _ in range(n)]
    for c in costs:
        if not any(c):
            c[0] = draw(EXTREME_COSTS.filter(bool))
    phases, start = [], 0
    for _ in range(draw(st.integers(1, 2))):
        phases.append((start, draw(st.lists(EXTREME_WEIGHTS, min_size=n, max_size=n))))
        start += draw(st.integers(1, 100))
    return phases, costs, draw(st.integers(1, 250))


@settings(max_examples=100, deadline=None)
@given(extreme_costed())
def test_the_cost_bound_holds_for_every_finite_cost_and_weight(spec):
    """The bound of the test above for every cost and weight mix() accepts: costs from
    the smallest subnormal to the largest float (and ints beyond), weights over 600
    orders of magnitude; checked in exact rationals, with no slack."""
    phases, costs, length = spec
    schedule = CostSchedule(phases, costs)
    largest = max(Fraction(x) for c in costs for x in c)
    starts = [start for start, _ in phases] + [float("inf")]
    phase = -1
    for p, (source, k) in enumerate(islice(schedule.iterate(), length)):
        while p >= starts[phase + 1]:
            phase += 1
            weights = integer_weights(phases[phase][1])
            total, cost, own = sum(weights), Fraction(0), [Fraction(0)] * len(costs)
        assert weights[source]
        c = Fraction(costs[source][k % len(costs[source])])
        cost += c
        own[source] += c
        for i in range(len(costs)):
            assert abs(own[i] * total - cost * weights[i]) <= largest * total, (phases, costs, p)


def test_costs_near_the_largest_float_keep_the_bound():
    """Issue 21: costs about 1e306 with weights 0.1234567 / 0.5 overflowed the float
    arithmetic, and a source strayed far beyond the largest element cost of its share."""
    costs = [[1e306 * (1 + i / 7) for i in range(7)], [1e306 * (1 + i / 5) for i in range(5)]]
    weights = integer_weights([0.1234567, 0.5])
    total, largest = sum(weights), Fraction(max(map(max, costs)))
    cost, own = Fraction(0), [Fraction(0)] * 2
    for source, k in islice(CostSchedule([(0, [0.1234567, 0.5])], costs).iterate(), 400):
        c = Fraction(costs[source][k % len(costs[source])])
        cost, own[source] = cost + c, own[source] + c
        assert all(abs(own[i] * total - cost * weights[i]) <= largest * total for i in range(2)), own


def test_float_costs_and_refused_costs():
    schedule = CostSchedule([(0, [1, 1])], [[0.5, 1.5], [2.25]])
    own, cost = [0.0, 0.0], 0.0
    for source, k in islice(schedule.iterate(), 200):
        c = [[0.5, 1.5], [2.25]][source][k % (2 if source == 0 else 1)]
        own[source] += c
        cost += c
        assert all(abs(o - cost / 2) <= 2.25 + 1e-9 for o in own)
    assert CostSchedule([(0, [1, 1])], [[3], []]).source_at(0) == (1, 0)  # no elements: its first pick at once
    for bad in ([[1], [0, 0]], [[1], [-1, 2]]):
        with pytest.raises(ValueError, match="costs of source 1"):
            CostSchedule([(0, [1, 1])], bad)
