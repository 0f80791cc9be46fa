"""The read-ahead's planning arithmetic (``sources/reading/extents.py``),
property-tested: a plan admits a prefix of the next requests, covers every
admitted span, stays within its room, reads only the slot's own upcoming bytes
(and gaps of at most ``max_gap``), never a live range, and makes one range per
file extent it touches (unless ``max_range`` splits it)."""

from __future__ import annotations

from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from distshard.sources.coalesce import Live, Range
from distshard.sources.reading.extents import Upcoming, plan

FAST = settings(max_examples=200, deadline=None)


@st.composite
def lookaheads(draw):
    """Disjoint spans of up to 3 files with gaps between them, some of them live
    (fetched already), the rest visited by the next requests in a drawn order."""
    spans = []
    for file in range(draw(st.integers(1, 3))):
        at = 0
        for _ in range(draw(st.integers(0, 20))):
            at += draw(st.integers(0, 200))
            size = draw(st.integers(1, 300))
            spans.append((file, at, at + size))
            at += size
    live_flags = [draw(st.booleans()) and draw(st.booleans()) for _ in spans]
    live = [Range(*s) for s, flag in zip(spans, live_flags, strict=True) if flag]
    rest = [s for s, flag in zip(spans, live_flags, strict=True) if not flag]
    order = draw(st.permutations(rest))
    requests, k = [], 0
    while k < len(order):
        n = draw(st.integers(1, 3))
        requests.append(Upcoming(sorted(set(order[k : k + n])), draw(st.integers(0, 50))))
        k += n
    return requests, live


@FAST
@given(
    case=lookaheads(),
    room=st.integers(-5, 3000),
    max_gap=st.integers(0, 150),
    max_range=st.integers(1, 2000),
    through=st.booleans(),
)
def test_a_plan_covers_what_it_admits_within_its_room_and_reads_only_upcoming_bytes(
    case, room, max_gap, max_range, through
):
    requests, live_ranges = case
    live: Live[int] = Live()
    for rng in live_ranges:
        live.add(rng, 0)
    admitted, ranges = plan(requests, room, lambda f: max_gap, live.of, max_range, through)
    assert 0 <= admitted <= len(requests)
    cost = sum(r.size for r in ranges) + sum(req.extra for req in requests[:admitted])
    assert cost <= max(room, 0) or admitted == 0 and not ranges
    for req in requests[:admitted]:  # every admitted span whole in one range
        for f, a, b in req.spans:
            assert sum(1 for r in ranges if r.file == f and r.start <= a and b <= r.stop) == 1
    upcoming = sorted({s for req in requests for s in req.spans})
    everything = sorted(upcoming + [tuple(r) for r in live_ranges])
    for rng in ranges:
        assert not any(r.file == rng.file and r.start < rng.stop and rng.start < r.stop for r in live_ranges)
        inside = [s for s in upcoming if s[0] == rng.file and rng.start <= s[1] and s[2] <= rng.stop]
        assert inside and rng.start == inside[0][1] and rng.stop == max(s[2] for s in inside)
        if len(inside) > 1:
            assert rng.size <= max_range
        # only upcoming bytes and gaps of at most max_gap between them are read
        own = [s for s in everything if s[0] == rng.file and rng.start <= s[1] and s[2] <= rng.stop]
        for (_, _, stop), (_, start, _) in pairwise(own):
            assert start - stop <= max_gap
    for x, y in pairwise(sorted(ranges)):  # disjoint
        assert x.file != y.file or x.stop <= y.start


def test_a_shuffled_file_is_one_range_a_plan_not_one_a_window():
    """Windows of a file visited in a permuted order: one plan with room for the
    whole file reads it in one range (exact coalescing: a range per window)."""
    windows = [[(0, w * 1000 + i * 100, w * 1000 + i * 100 + 90) for i in range(10)] for w in range(8)]
    order = [3, 0, 6, 1, 7, 2, 5, 4]
    requests = [Upcoming([span]) for w in order for span in windows[w]]
    admitted, ranges = plan(requests, 8000, lambda f: 20, lambda f: (), 1 << 20, True)
    assert admitted == len(requests) and ranges == [Range(0, 0, 7990)]
    admitted, ranges = plan(requests, 8000, lambda f: 5, lambda f: (), 1 << 20, False)
    assert admitted == len(requests) and len(ranges) == 80
    # with room for less: window 3 (the hull of 3 and 0 does not fit), widened over the
    # room left by the neighbouring windows' spans, in one range
    admitted, ranges = plan(requests, 2500, lambda f: 20, lambda f: (), 1 << 20, True)
    assert admitted == 10 and len(ranges) == 1
    assert ranges[0].start <= 3000 and 3990 <= ranges[0].stop and ranges[0].size <= 2500
