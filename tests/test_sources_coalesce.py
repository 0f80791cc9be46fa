"""The pure parts of the file sources' reads, property-tested: coalescing byte
spans into ranges, the read-ahead's delivery order and memory bound (with a
fake file), the shuffle order that keeps files and windows together, and the
windows themselves."""

from __future__ import annotations

import concurrent.futures
from collections import Counter
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distshard.errors import OptionError
from distshard.sources.coalesce import Coverage, Range, ScanRamp, coalesce
from distshard.sources.formats.file_index import byte_windows
from distshard.sources.read_options import ReadOptions
from distshard.sources.reading.fetch import ReadAhead, Request
from distshard.sources.reading.order import FileOrder, expansion
from distshard.sources.transport.files import RemoteRandomFile, ScanFile

FAST = settings(max_examples=150, deadline=None)


@st.composite
def layouts(draw):
    """Files of disjoint spans (samples) with gaps between them, as ``(file, start, stop)``."""
    spans = []
    for file in range(draw(st.integers(1, 3))):
        at = 0
        for _ in range(draw(st.integers(0, 25))):
            at += draw(st.integers(0, 300))  # a gap: headers, or other slots' samples
            size = draw(st.integers(1, 400))
            spans.append((file, at, at + size))
            at += size
    return spans


@FAST
@given(layout=layouts(), data=st.data(), max_range=st.integers(1, 2000), max_gap=st.integers(0, 500))
def test_coalesced_ranges_cover_every_span_once_within_the_limits(layout, data, max_range, max_gap):
    wanted = data.draw(st.lists(st.sampled_from(layout), max_size=40)) if layout else []
    live_spans = [s for s in layout if s not in wanted and data.draw(st.booleans())]
    live: dict[int, list[Range]] = {}
    for rng in coalesce(live_spans, max_range, max_gap):  # ranges fetched before: disjoint, sorted
        live.setdefault(rng.file, []).append(rng)
    ranges = coalesce(wanted, max_range, max_gap, live)
    assert ranges == sorted(ranges, key=lambda r: (r.file, r.start))
    for file, start, stop in set(wanted):
        inside_live = [r for r in live.get(file, []) if r.covers(start, stop)]
        inside_new = [r for r in ranges if r.file == file and r.covers(start, stop)]
        assert len(inside_live) + len(inside_new) == 1, (file, start, stop)  # never split, never twice
    distinct = {s for s in wanted if not any(r.covers(s[1], s[2]) for r in live.get(s[0], []))}
    assert len(ranges) <= len(distinct)  # at most one range per span (a sample), never one per member
    for a, b in pairwise(ranges):
        assert a.file != b.file or a.stop < b.start or (a.stop <= b.start)  # disjoint
    for rng in ranges:
        assert not any(r.start < rng.stop and rng.start < r.stop for r in live.get(rng.file, []))  # not re-fetched
        members = sorted(s for s in distinct if s[0] == rng.file and rng.covers(s[1], s[2]))
        assert members and rng.start == members[0][1] and rng.stop == max(s[2] for s in members)
        assert rng.size <= max_range or len(members) == 1
        for (_, _, stop), (_, start, _) in pairwise(members):
            assert start - stop <= max_gap  # only small gaps are read through


@FAST
@given(sizes=st.lists(st.integers(1, 100), min_size=1, max_size=60), max_range=st.integers(100, 1000))
def test_contiguous_spans_make_about_total_over_max_range_requests(sizes, max_range):
    spans, at = [], 0
    for size in sizes:
        spans.append((0, at, at + size))
        at += size
    ranges = coalesce(spans, max_range, 0)
    assert sum(r.size for r in ranges) == at  # nothing read twice, nothing extra
    assert len(ranges) <= 2 * at // max_range + 1


@FAST
@given(layout=layouts(), data=st.data(), max_range=st.integers(1, 2000), max_gap=st.integers(0, 500))
def test_coverage_bounds_the_bytes_coalescing_fetches_and_undoes_exactly(layout, data, max_range, max_gap):
    wanted = data.draw(st.lists(st.sampled_from(layout), max_size=40)) if layout else []
    live_spans = [s for s in layout if s not in wanted and data.draw(st.booleans())]
    live: dict[int, list[Range]] = {}
    for rng in coalesce(live_spans, max_range, max_gap):
        live.setdefault(rng.file, []).append(rng)
    coverage = Coverage()
    totals = []
    for count, (file, start, stop) in enumerate(wanted, 1):
        mark = coverage.mark()
        before = coverage.total
        growth = coverage.add(file, start, stop, max_gap)
        assert growth >= 0 and coverage.total == before + growth
        fetched = sum(r.size for r in coalesce(wanted[:count], max_range, max_gap, live))
        assert fetched <= coverage.total  # what the read-ahead counts is never below what it holds
        if data.draw(st.booleans()):  # tried and withdrawn, as a request that does not fit
            extra = data.draw(st.sampled_from(layout))
            inner = coverage.mark()
            coverage.add(*extra, max_gap)
            coverage.undo(inner)
            assert coverage.total == before + growth
        totals.append((mark, before))
    for mark, before in reversed(totals):
        coverage.undo(mark)
        assert coverage.total == before
    assert coverage.total == 0


def test_coalesce_refuses_nonsense():
    with pytest.raises(ValueError, match="max_range"):
        coalesce([], 0, 0)
    with pytest.raises(ValueError, match="not a byte range"):
        coalesce([(0, 5, 3)], 10, 0)


# -- the read-ahead, with a fake file -------------------------------------------------------------
class FakeFile:
    """Bytes ``i % 251`` at offset ``i``; counts and checks the ranges asked for."""

    def __init__(self, pool: concurrent.futures.ThreadPoolExecutor, log: list) -> None:
        self.pool, self.log = pool, log

    def submit(self, start: int, stop: int):
        self.log.append((start, stop))

        def read() -> bytes:
            return bytes(i % 251 for i in range(start, stop))

        return self.pool.submit(read)


@FAST
@given(
    layout=layouts(),
    data=st.data(),
    budget=st.integers(1, 3000),
    max_range=st.integers(1, 1500),
    window=st.integers(2, 600),
)
def test_read_ahead_delivers_every_request_in_order_within_its_budget(layout, data, budget, max_range, window):
    from distshard.sources.reading import fetch

    order = data.draw(st.lists(st.sampled_from(layout), max_size=60)) if layout else []
    options = ReadOptions(
        budget=budget, max_range=max_range, max_gap=min(window - 1, data.draw(st.integers(0, 300))), window=window
    )
    log: list = []
    fetch.reset_stats()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        files = {f: FakeFile(pool, log) for f in range(3)}
        ahead = ReadAhead(options, files.__getitem__)
        got = list(ahead.run(Request(k, f, [(a, b)]) for k, (f, a, b) in enumerate(order)))
    assert [k for k, _ in got] == list(range(len(order)))
    for (_, views), (_, a, b) in zip(got, order, strict=True):
        assert bytes(views[0]) == bytes(i % 251 for i in range(a, b))
    largest = max((b - a for _, a, b in order), default=0)
    assert fetch.STATS.peak_held <= max(budget, largest)  # gaps included; one larger request alone
    assert fetch.STATS.held == 0  # everything released at the end
    assert len(log) <= len(order)


def test_read_ahead_stays_within_its_budget_on_a_long_run():
    from distshard.sources.reading import fetch

    fetch.reset_stats()
    options = ReadOptions(budget=64 << 10, max_range=8 << 10, max_gap=0, window=4 << 10)
    spans = [(i * 1000, i * 1000 + 1000) for i in range(2000)]  # 2 MB, contiguous
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        log: list = []
        ahead = ReadAhead(options, lambda f: FakeFile(pool, log))
        for _, views in ahead.run(Request(k, 0, [span]) for k, span in enumerate(spans)):
            assert len(views[0]) == 1000
    assert 0 < fetch.STATS.peak_held <= options.budget
    assert sum(b - a for a, b in log) == 2000 * 1000  # each byte once
    assert len(log) <= 2 * 2000 * 1000 // options.max_range + 1


class Ready:
    """A fake file whose ranges are there at once (a deterministic plan)."""

    def __init__(self, log: list) -> None:
        self.log = log

    def submit(self, start: int, stop: int):
        self.log.append((start, stop))
        future: concurrent.futures.Future[bytes] = concurrent.futures.Future()
        future.set_result(bytes(i % 251 for i in range(start, stop)))
        return future


@FAST
@given(
    layout=layouts(),
    data=st.data(),
    budget=st.integers(1, 6000),
    max_range=st.integers(1, 1500),
    first=st.integers(1, 600),
    max_gap=st.integers(0, 300),
)
def test_the_read_plan_starts_small_grows_geometrically_and_reads_each_byte_once(
    layout, data, budget, max_range, first, max_gap
):
    from distshard.sources.reading import fetch

    spans = [s for s in layout if s[0] == 0]  # one file
    order = data.draw(st.permutations(spans)) if data.draw(st.booleans()) else spans  # shuffled, or in order
    options = ReadOptions(budget=budget, max_range=max_range, max_gap=max_gap, window=max_gap + 1, first_range=first)
    log: list = []
    fetch.reset_stats()
    ahead = ReadAhead(options, lambda f: Ready(log))
    got = list(ahead.run(Request(k, 0, [(a, b)]) for k, (_, a, b) in enumerate(order)))
    assert [k for k, _ in got] == list(range(len(order)))
    for (_, views), (_, a, b) in zip(got, order, strict=True):
        assert bytes(views[0]) == bytes(i % 251 for i in range(a, b))
    largest = max((b - a for _, a, b in order), default=0)
    assert fetch.STATS.peak_held <= max(budget, largest)  # the budget, gaps included
    if not order:
        assert log == []
        return
    a, b = order[0][1:]
    assert log[0][0] <= a and b <= log[0][1]  # the first sample's bytes are asked first
    assert log[0][1] - log[0][0] <= max(ahead.first, b - a)  # in a small range
    for i, (start, stop) in enumerate(log):
        inside = [s for s in spans if start <= s[1] and s[2] <= stop]
        assert inside and start == min(s[1] for s in inside) and stop == max(s[2] for s in inside)
        # plan k admits at most first << k bytes and submits one range or more
        assert stop - start <= max(ahead.first << i, max(s[2] - s[1] for s in inside))
    if max_gap == 0:  # nothing read through: every requested byte exactly once
        assert sorted(log) == sorted(set(log))
        assert sum(stop - start for start, stop in log) == sum(b - a for _, a, b in order)
        for (_, stop), (start, _) in pairwise(sorted(log)):
            assert stop <= start  # disjoint


def test_the_read_plan_widens_to_max_range_on_a_long_run():
    log: list = []
    options = ReadOptions(budget=1 << 20, max_range=64 << 10, max_gap=0, window=16 << 10, first_range=4 << 10)
    spans = [(i * 1000, i * 1000 + 1000) for i in range(4000)]  # 4 MB, contiguous
    for _, views in ReadAhead(options, lambda f: Ready(log)).run(Request(k, 0, [span]) for k, span in enumerate(spans)):
        assert len(views[0]) == 1000
    sizes = [stop - start for start, stop in log]
    assert sizes[0] <= 4 << 10 and max(sizes) >= (64 << 10) - 1000
    assert sum(sizes) == 4000 * 1000 and sorted(log) == log  # each byte once, in order
    grown = next(i for i, size in enumerate(sizes) if size >= (64 << 10) - 1000)
    assert grown <= 12  # doubling every other range (two in flight): 4 KiB to 64 KiB in a few round trips
    assert len(log) <= grown + 4000 * 1000 // ((64 << 10) - 1000) + 2


def test_a_failed_range_is_raised_at_the_request_that_needs_it():
    class Failing:
        def submit(self, start, stop):
            future = concurrent.futures.Future()
            if start >= 3000:
                future.set_exception(OSError(f"bytes [{start}, {stop}) failed"))
            else:
                future.set_result(bytes(stop - start))
            return future

    options = ReadOptions(budget=1 << 20, max_range=1000, max_gap=0, window=2000)
    got = []
    with pytest.raises(OSError, match=r"bytes \[3000"):
        for k, _ in ReadAhead(options, lambda f: Failing()).run(
            Request(k, 0, [(k * 1000, k * 1000 + 1000)]) for k in range(6)
        ):
            got.append(k)
    assert got == [0, 1, 2]  # everything before the failure was delivered, in order


# -- the shuffle order ------------------------------------------------------------------------------
@st.composite
def sources(draw):
    counts = draw(st.lists(st.integers(0, 30), min_size=1, max_size=6))
    bounds = []
    for count in counts:
        cuts = sorted(draw(st.sets(st.integers(1, max(1, count - 1)), max_size=5))) if count > 1 else []
        bounds.append([0, *[c for c in cuts if c < count], count] if count else [0])
    return counts, bounds


@FAST
@given(size=st.integers(0, 300), seed=st.integers(0, 2**40))
def test_an_expansion_is_a_permutation_whose_every_prefix_is_one_run(size, seed):
    order = expansion(size, seed)
    assert sorted(order) == list(range(size))
    lo = hi = order[0] if order else 0
    for position in order[1:]:
        assert position in (lo - 1, hi + 1)  # so a slot's share of a window is one run, the rest at most two
        lo, hi = min(lo, position), max(hi, position)


@FAST
@given(source=sources(), seed=st.integers(0, 2**32), within=st.sampled_from(["expand", "permute"]))
def test_file_order_is_a_permutation_that_keeps_files_and_windows_together(source, seed, within):
    counts, bounds = source
    order = FileOrder(counts, seed, lambda f: bounds[f], within)
    n = sum(counts)
    visited = [order(v) for v in range(n)]
    assert sorted(visited) == list(range(n))
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)

    def where(p):
        f = next(k for k in range(len(counts)) if offsets[k] <= p < offsets[k + 1])
        j = p - offsets[f]
        w = next(k for k in range(len(bounds[f]) - 1) if bounds[f][k] <= j < bounds[f][k + 1])
        return f, w

    runs = [where(p) for p in visited]
    changes_of_file = sum(1 for a, b in pairwise(runs) if a[0] != b[0])
    assert changes_of_file == sum(1 for c in counts if c) - 1 if n else True  # each file visited in one run
    changes_of_window = sum(1 for a, b in pairwise(runs) if a != b)
    assert (
        changes_of_window == sum(1 for f, b in enumerate(bounds) for k in range(len(b) - 1) if b[k + 1] > b[k]) - 1
        if n
        else True
    )  # each window visited in one run
    again = FileOrder(counts, seed, lambda f: bounds[f], within)
    assert [again(v) for v in reversed(range(n))] == visited[::-1]  # the same from any visit, in any order


def test_file_order_changes_with_the_seed_and_checks_its_windows():
    orders = {
        tuple(FileOrder([10, 10], seed, lambda f: [0, 5, 10]).__call__(v) for v in range(20)) for seed in range(5)
    }
    assert len(orders) > 1
    with pytest.raises(ValueError, match="do not cover"):
        FileOrder([4], 0, lambda f: [0, 3])(0)


@given(sizes=st.lists(st.integers(0, 50), max_size=40), window=st.integers(1, 120))
@settings(max_examples=100, deadline=None)
def test_byte_windows_span_at_most_the_window_unless_one_sample_is_larger(sizes, window):
    extents, at = [], 0
    for size in sizes:
        extents.append((at, at + size) if size else (-1, -1))
        at += size + 7  # a header between samples
    bounds = list(byte_windows(len(sizes), extents.__getitem__, window))
    if not sizes:
        assert bounds == [0]
        return
    assert bounds[0] == 0 and bounds[-1] == len(sizes) and bounds == sorted(set(bounds))
    for lo, hi in pairwise(bounds):
        present = [extents[i] for i in range(lo, hi) if extents[i][0] >= 0]
        if len(present) > 1:
            assert present[-1][1] - present[0][0] <= window


def test_read_options_are_checked():
    with pytest.raises(TypeError, match="budget"):
        ReadOptions(budget="1")
    with pytest.raises(ValueError, match="max_range"):
        ReadOptions(max_range=0)
    with pytest.raises(ValueError, match="below window"):
        ReadOptions(max_gap=1 << 20, window=1 << 20)
    assert ReadOptions(retries=0).retries == 0
    assert Counter(ReadOptions().token()) == Counter(ReadOptions(budget=1).token())  # budget is not part of the order
    assert ReadOptions(window=1 << 10, max_gap=0).token() != ReadOptions().token()


def test_live_ranges_find_what_holds_a_span_whole_and_forget_what_is_removed():
    from distshard.sources.coalesce import Live, find_live

    live: Live[str] = Live()
    for name, rng in (("b", Range(0, 100, 200)), ("a", Range(0, 0, 50)), ("c", Range(1, 10, 20))):
        live.add(rng, name)
    assert [r.start for r in live.of(0)] == [0, 100]  # sorted by start
    assert live.find(0, 120, 200) == "b" and live.find(0, 0, 50) == "a" and live.find(1, 10, 11) == "c"
    assert live.find(0, 40, 60) is None and live.find(0, 150, 201) is None and live.find(2, 0, 1) is None
    assert find_live(live.of(0), 120, 130) == Range(0, 100, 200)  # the one lookup both use
    live.remove(Range(0, 100, 200))
    assert live.find(0, 120, 130) is None and sorted(live.values()) == ["a", "c"]


# -- a scan's ranges (ScanRamp, ScanFile) ------------------------------------------------------------
class _Answer:
    def __init__(self, data: bytes) -> None:
        self.data, self.cancelled = data, False

    def result(self) -> bytes:
        return self.data

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class _FakeRemote(RemoteRandomFile):
    """A remote file of ``data``: every range asked is recorded, answered at once."""

    def __init__(self, data: bytes) -> None:  # (no client: nothing is asked of a store)
        self.data = data
        self.asked: list[tuple[int, int]] = []

    def submit(self, start: int, stop: int) -> _Answer:
        self.asked.append((start, stop))
        return _Answer(self.data[start:stop])


def _scan(data: bytes, max_range: int) -> tuple[ScanFile, _FakeRemote]:
    handle = _FakeRemote(data)
    return ScanFile(handle, len(data), ReadOptions(max_range=max_range)), handle


@FAST
@given(
    size=st.integers(0, 5000),
    largest=st.integers(1, 3000),
    reads=st.lists(st.tuples(st.booleans(), st.integers(0, 6000), st.integers(0, 900)), max_size=30),
)
def test_a_scan_reads_exactly_the_bytes_asked_through_ranges_within_the_file(size, largest, reads):
    """Whatever its seeks and read sizes, a remote scan returns the file's bytes at
    each position; each range it asks is inside the file, at most ``max_range``
    (64 KiB after a seek) unless one read is longer, and starts at the read's
    position or is the next range asked ahead."""
    data = bytes(k % 251 for k in range(size))
    scan, handle = _scan(data, largest)
    for seek, where, n in reads:
        if seek:
            scan.seek(where)
        at = scan.tell()
        assert scan.read(n) == data[at : at + n]
        assert scan.tell() == (min(size, at + n) if at < size else at)
    assert scan.requests == len(handle.asked)
    for start, stop in handle.asked:
        assert 0 <= start < stop <= size
    bound = max(largest, ScanRamp.SMALL, *(n for _, _, n in reads), 1)
    assert all(stop - start <= bound for start, stop in handle.asked)


@FAST
@given(size=st.integers(1, 20000), largest=st.integers(1, 3000), data=st.data())
def test_a_sequential_scan_asks_each_byte_once_in_ranges_of_max_range(size, largest, data):
    piece = data.draw(st.integers(1, largest))
    content = bytes(k % 253 for k in range(size))
    scan, handle = _scan(content, largest)
    assert b"".join(iter(lambda: scan.read(piece), b"")) == content
    # every byte asked once, in order: max_range at a time, each next one asked ahead
    assert handle.asked == [(a, min(size, a + largest)) for a in range(0, size, largest)]


def test_a_scan_after_a_seek_asks_a_small_range_and_grows_it_on_sequential_reads():
    ramp = ScanRamp(size=20 << 20, largest=1 << 20)
    assert ramp.next(0, 10, None) == Range(0, 0, 1 << 20)  # the first range: max_range
    assert ramp.ahead(1 << 20) == Range(0, 1 << 20, 2 << 20)  # full size: the next one asked ahead
    assert ramp.next(5 << 20, (5 << 20) + 512, 2 << 20) == Range(0, 5 << 20, (5 << 20) + (64 << 10))  # a seek
    assert ramp.ahead((5 << 20) + (64 << 10)) is None  # small: nothing ahead
    sizes = []
    end = (5 << 20) + (64 << 10)
    for _ in range(4):
        rng = ramp.next(end, end + 1, end)
        sizes.append(rng.size)
        end = rng.stop
    assert sizes == [256 << 10, 1 << 20, 1 << 20, 1 << 20]  # fourfold per sequential range, up to max_range
    assert ramp.next(end, end + (3 << 20), end).stop == end + (3 << 20)  # a longer read is asked whole
    assert ScanRamp(100, 1 << 20).next(0, 10, None) == Range(0, 0, 100)  # within the file
    with pytest.raises(OptionError, match="max_range=0"):
        ScanRamp(10, 0)
