"""The pure arithmetic of the partition, property-tested."""

from collections import Counter
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distshard.plan import (
    EVEN_MODES,
    check_even,
    dropped_count,
    mix_seed,
    pad_position,
    padded_count,
    select_stream,
    slot_count,
    slot_of,
    slot_positions,
)

slots = st.integers(min_value=1, max_value=40)
totals = st.integers(min_value=0, max_value=500)
evens = st.sampled_from(EVEN_MODES)


@given(num_slots=slots, total=totals, even=evens)
def test_every_position_is_owned_once_and_counts_follow_even(num_slots, total, even):
    taken = Counter()
    for slot in range(num_slots):
        positions = list(slot_positions(slot, num_slots, total, even))
        assert len(positions) == slot_count(slot, num_slots, total, even)
        taken.update(positions)
        if even == "pad" and pad_position(slot, num_slots, total) is not None:
            assert positions[-1] == pad_position(slot, num_slots, total)
            positions = positions[:-1]
        assert all(slot_of(p, num_slots) == slot for p in positions)
        assert positions == sorted(positions)  # a slot walks its positions in stream order
    counts = [slot_count(s, num_slots, total, even) for s in range(num_slots)]
    if even is None:
        assert taken == Counter(range(total))
        assert max(counts) - min(counts) <= 1
    elif even == "drop":
        kept = total - total % num_slots
        assert taken == Counter(range(kept))  # only the tail of N % S is dropped
        assert set(counts) == {total // num_slots}
        assert dropped_count(num_slots, total, even) == total - kept
    else:
        assert set(taken) == set(range(total))  # nothing missing
        repeats = sum(taken.values()) - total
        assert repeats == padded_count(num_slots, total, even) < num_slots
        if total >= num_slots:
            assert all(n <= 2 for n in taken.values())
        assert set(counts) == ({-(-total // num_slots)} if total else {0})


@given(num_slots=slots, total=totals, even=evens)
def test_streaming_selector_matches_known_length_plan(num_slots, total, even):
    for slot in range(num_slots):
        streamed = list(select_stream(iter(range(total)), slot, num_slots, even))
        assert streamed == list(slot_positions(slot, num_slots, total, even))


@given(num_slots=slots, total=totals)
def test_pad_repeats_come_from_the_start_of_the_stream(num_slots, total):
    for slot in range(num_slots):
        pad = pad_position(slot, num_slots, total)
        if pad is not None:
            assert 0 <= pad < min(total, num_slots)


def test_selector_reads_lazily_and_holds_one_element():
    """``drop`` yields a slot's element as soon as its round is complete."""
    pulled = []

    def source():
        for i in range(10):
            pulled.append(i)
            yield i

    it = select_stream(source(), 1, 4, "drop")
    assert next(it) == 1
    assert pulled == [0, 1, 2, 3]  # the end of round 0, nothing more


def test_value_based_modulo_recipe_fails_where_positions_do_not():
    """The classic recipe on [0, 2, 4, ...] leaves odd slots empty; positions do not."""
    values = list(range(0, 200, 2))
    classic = {s: [v for v in values if (v + s) % 4 == 0] for s in range(4)}
    assert classic[1] == [] and classic[3] == []
    ours = {s: list(select_stream(values, s, 4, None)) for s in range(4)}
    assert all(len(v) == 25 for v in ours.values())


@pytest.mark.parametrize("bad", ["Drop", "even", 1, True, "none"])
def test_unknown_even_is_rejected_by_name(bad):
    with pytest.raises(ValueError, match=repr(bad)):
        check_even(bad)


@settings(max_examples=200)
@given(st.integers(0, 2**62), st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6))
def test_mix_seed_is_deterministic_in_range_and_order_sensitive(a, b, c, d):
    value = mix_seed(a, b, c)
    assert value == mix_seed(a, b, c)
    assert 0 <= value < 2**63
    if (b, c) != (c, b):
        assert mix_seed(a, b, c) != mix_seed(a, c, b) or b == c


# -- what is left after an interrupted run ---------------------------------------------

from distshard.plan import (  # noqa: E402
    Remaining,
    block_positions,
    block_range,
    left_after_blocks,
    left_after_round_robin,
)


@st.composite
def interrupted_runs(draw):
    num_slots = draw(st.integers(1, 12))
    total = draw(st.integers(0, 300))
    even = draw(evens)
    taken = [draw(st.integers(0, slot_count(s, num_slots, total, even) + (even == "pad"))) for s in range(num_slots)]
    return num_slots, total, even, taken


@given(interrupted_runs())
def test_round_robin_leftover_is_exactly_what_was_not_taken(run):
    num_slots, total, even, taken = run
    consumed = set()
    for slot, count in enumerate(taken):
        consumed.update(
            p for p in list(slot_positions(slot, num_slots, total, even))[:count] if slot_of(p, num_slots) == slot
        )
    left = left_after_round_robin(taken, num_slots).clip(total)
    left_positions = [left.index(j) for j in range(left.length())]
    assert left_positions == sorted(set(range(total)) - consumed)


@given(interrupted_runs())
def test_block_leftover_is_exactly_what_was_not_taken(run):
    num_slots, total, even, taken = run
    consumed = set()
    for slot, count in enumerate(taken):
        start, stop = block_range(slot, num_slots, total, even)
        mine = list(block_positions(slot, num_slots, total, even))
        assert mine[: stop - start] == list(range(start, stop))  # a block, then maybe a repeat
        consumed.update(p for p in mine[:count] if start <= p < stop)  # a repeat consumes nothing
    left = left_after_blocks(taken, num_slots, total, even)
    assert [left.index(j) for j in range(left.length())] == sorted(set(range(total)) - consumed)


intervals = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 15)), max_size=6)


def _remaining(pairs, open_end):
    out, position = [], 0
    for gap, length in pairs:
        start = position + gap
        out.append((start, start + length))
        position = start + length
    if open_end:
        out.append((position + 1, None))
    return Remaining(out)


@given(intervals, st.booleans(), intervals, st.booleans())
def test_compose_and_stream_agree_with_plain_indexing(outer_pairs, outer_open, inner_pairs, inner_open):
    outer, inner = _remaining(outer_pairs, outer_open), _remaining(inner_pairs, inner_open)
    limit = 400
    outer_list = list(outer.stream(range(limit)))
    inner_list = [j for j in inner.stream(range(len(outer_list)))]
    expected = [outer_list[j] for j in inner_list]
    assert list(outer.compose(inner).stream(range(limit))) == expected
    assert [outer.index(j) for j in range(len(outer_list))] == outer_list
    index = outer.indexer()
    assert [index(j) for j in range(len(outer_list))] == outer_list


@given(st.integers(1, 9), st.integers(0, 120), evens)
def test_skip_rounds_resumes_the_streaming_selector(num_slots, total, even):
    for slot in range(num_slots):
        full = list(slot_positions(slot, num_slots, total, even))
        for taken in range(len(full) + 1):
            assert list(select_stream(range(total), slot, num_slots, even, taken)) == full[taken:]


@given(st.lists(st.integers(0, 12), max_size=12), st.integers(0, 2**32))
def test_unit_order_is_a_bijection_that_keeps_units_together(sizes, seed):
    from distshard.plan import UnitOrder

    order = UnitOrder(sizes, seed)
    total = sum(sizes)
    image = [order(v) for v in range(total)]
    assert sorted(image) == list(range(total))
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    unit_of = [next(u for u in range(len(sizes)) if offsets[u] <= p < offsets[u + 1]) for p in image]
    runs = sum(1 for a, b in pairwise(unit_of) if a != b) + (1 if unit_of else 0)
    assert runs == sum(1 for size in sizes if size)  # every unit visited in one run


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 3000), st.integers(0, 2**80), st.booleans())
def test_a_permutations_table_is_its_images_with_numpy_or_without(n, seed, numpy_there):
    """The table ``shuffle=True``'s orders take at once (issue 33: no call per file) is
    exactly the per-index images, bit for bit: a resumed run must visit the same order."""
    from distshard.plan import Permutation, permutation

    real = permutation._numpy
    permutation._numpy = real if numpy_there else (lambda: None)
    try:
        p = Permutation(n, seed)
        assert list(p.table()) == [p(k) for k in range(n)]
    finally:
        permutation._numpy = real


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 2**40) | st.integers(0, 2**70), max_size=200), st.randoms(), st.booleans())
def test_prefix_sums_are_the_running_totals(values, rng, ordered):
    from distshard.plan import prefix_sums

    order = list(range(len(values)))
    rng.shuffle(order)
    taken = [values[k] for k in order] if ordered else values
    totals = [0]
    for v in taken:
        totals.append(totals[-1] + v)
    assert list(prefix_sums(values, order if ordered else None)) == totals


@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 4), st.integers(0, 200), st.data())
def test_chunk_layout_partitions_whole_rounds_and_merges_exactly(world, workers, multiple, total, data):
    from distshard.plan import chunk_positions, left_after_chunks, select_chunks

    num_slots = world * workers
    per_slot = total // num_slots // multiple * multiple
    owned = {}
    for rank in range(world):
        for worker in range(workers):
            mine = list(chunk_positions(rank, world, worker, workers, total, multiple))
            assert len(mine) == per_slot
            assert list(select_chunks(iter(range(total)), rank, world, worker, workers, multiple)) == mine
            owned[rank * workers + worker] = mine
    used = sorted(p for mine in owned.values() for p in mine)
    assert used == list(range(num_slots * per_slot))  # everything but the dropped tail, once
    # a training step t: every rank's batch from worker t % K is the next W chunks
    for t in range(per_slot // multiple * workers):
        step = sorted(
            p
            for rank in range(world)
            for p in owned[rank * workers + t % workers][(t // workers) * multiple : (t // workers + 1) * multiple]
        )
        assert step == list(range(t * world * multiple, (t + 1) * world * multiple))
    taken = [data.draw(st.integers(0, per_slot)) for _ in range(num_slots)]
    left = left_after_chunks(taken, world, workers, total, multiple)
    consumed = {p for slot, mine in owned.items() for p in mine[: taken[slot]]}
    assert [p for p in range(total) if p not in consumed] == [left.index(j) for j in range(left.length())]
    for slot, count in enumerate(taken):  # resume in O(1) where the slot stopped
        rank, worker = divmod(slot, workers)
        assert list(chunk_positions(rank, world, worker, workers, total, multiple, count)) == owned[slot][count:]
        assert (
            list(select_chunks(iter(range(total)), rank, world, worker, workers, multiple, count))
            == owned[slot][count:]
        )


# -- even="carry": the epochs as one stream ---------------------------------------------------

from types import SimpleNamespace  # noqa: E402

from distshard.layouts import LAYOUTS  # noqa: E402
from distshard.plan import (  # noqa: E402
    carry_after,
    carry_left,
    carry_reads,
    carry_window,
)

carry_layouts = st.sampled_from(["stride", "blocks", "chunks"])


def slot_runs(layout, rank, world, worker, workers, total, multiple=1, skip=0):
    """The runs of ``even="drop"`` rounds the layout named ``layout`` gives a slot."""
    at = SimpleNamespace(
        rank=rank,
        world_size=world,
        worker_id=worker,
        num_workers=workers,
        slot=rank * workers + worker,
        num_slots=world * workers,
    )
    return LAYOUTS[layout].runs(at, total, multiple, skip)


def left_after(layout, world, workers, multiple):
    """What a carry run (``even="drop"`` rounds) in the layout named ``layout`` leaves."""
    return lambda taken, count: LAYOUTS[layout].left_after(taken, world * workers, workers, count, "drop", multiple)


def _carry_run(base, first, epoch, n, world, workers, multiple, layout, taken=None):
    """Every slot's (epoch, position) reads of one carry run, the first ``taken[slot]`` of each."""
    num_slots = world * workers
    lo, hi = carry_window(base, first, epoch, n, num_slots * multiple)
    window = base.compose(Remaining([(lo, hi)]))
    reads = []
    for rank in range(world):
        for worker in range(workers):
            runs = slot_runs(layout, rank, world, worker, workers, hi - lo, multiple)
            mine = [(e, p) for e, positions in carry_reads(window, n, runs) for p in positions]
            reads.append(mine if taken is None else mine[: taken[rank * workers + worker]])
    return reads


@settings(max_examples=150)
@given(
    st.integers(1, 3),
    st.integers(1, 3),
    st.sampled_from([1, 1, 2, 3]),
    st.integers(0, 40),
    st.integers(1, 5),
    carry_layouts,
)
def test_carry_epochs_take_whole_rounds_of_one_stream(world, workers, multiple, n, epochs, layout):
    """Epoch e takes [U floor(eN/U), U floor((e+1)N/U)) of the concatenated streams, every
    slot the same multiple of multiple_of, each epoch's tail opening the next."""
    layout = "stride" if layout == "chunks" and multiple == 1 else layout
    unit = world * workers * multiple
    seen = []
    for epoch in range(epochs):
        assert carry_window(Remaining(), 0, epoch, n, unit) == (
            unit * (epoch * n // unit),
            unit * ((epoch + 1) * n // unit),
        )
        reads = _carry_run(Remaining(), 0, epoch, n, world, workers, multiple, layout)
        counts = {len(mine) for mine in reads}
        assert len(counts) == 1 and counts.pop() % multiple == 0
        for mine in reads:
            assert all(e <= epoch for e, _ in mine)  # never ahead of its own epoch's stream
            assert mine == sorted(mine)  # the carried tail first, then the epoch's own
            seen.extend(mine)
    frontier = unit * (epochs * n // unit)
    assert sorted(seen) == [divmod(g, n) for g in range(frontier)] if n else not seen


@settings(max_examples=100)
@given(
    st.integers(1, 3),
    st.integers(1, 3),
    st.sampled_from([1, 2, 3]),
    st.integers(1, 40),
    st.integers(0, 6),
    carry_layouts,
    st.data(),
)
def test_carry_resume_skips_in_constant_time(world, workers, multiple, n, epoch, layout, data):
    layout = "stride" if layout == "chunks" and multiple == 1 else layout
    unit = world * workers * multiple
    lo, hi = carry_window(Remaining(), 0, epoch, n, unit)
    rank, worker = data.draw(st.integers(0, world - 1)), data.draw(st.integers(0, workers - 1))
    full = [p for run in slot_runs(layout, rank, world, worker, workers, hi - lo, multiple) for p in run]
    skip = data.draw(st.integers(0, len(full)))
    runs = list(slot_runs(layout, rank, world, worker, workers, hi - lo, multiple, skip))
    assert [p for run in runs for p in run] == full[skip:]
    assert len(runs) <= max(1, len(full) // multiple + 1)  # ranges, not positions


@settings(max_examples=150)
@given(st.integers(0, 30), st.data())
def test_carry_merge_then_any_layout_goes_on_exactly(n, data):
    """A history of carry runs, each with its own layout (world, workers, multiple_of,
    stride / blocks / chunks), interrupted at random and merged (carry_left), crossing
    epoch ends (rebased as a slot's state does, or counting on from the same base with
    the same round size, as a pipe does from one epoch to the next): what is left is
    always exactly what nobody read, every complete run's slots yield the same count,
    and the tail left at an epoch's end is less than a round of the run that ended it."""
    base, first, epoch = Remaining(), 0, 0
    seen: list = []
    kept = None  # (world, workers, multiple) the next run must keep: the base was not rebased
    for _ in range(data.draw(st.integers(1, 8))):
        world, workers = kept[:2] if kept else (data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3)))
        multiple = kept[2] if kept else data.draw(st.sampled_from([1, 1, 2]))
        layout = data.draw(carry_layouts)
        layout = "stride" if layout == "chunks" and multiple == 1 else layout
        num_slots, kept = world * workers, None
        unit = num_slots * multiple
        lo, hi = carry_window(base, first, epoch, n, unit)
        share = (hi - lo) // num_slots
        if data.draw(st.booleans()):  # the run ends its epoch
            reads = _carry_run(base, first, epoch, n, world, workers, multiple, layout)
            assert {len(mine) for mine in reads} <= {share}
            seen.extend(r for mine in reads for r in mine)
            if data.draw(st.booleans()):
                base, first = carry_after(base, first, epoch, n, unit), epoch + 1
            else:
                kept = (world, workers, multiple)
            epoch += 1
            assert all(e < epoch for e, _ in seen)  # nothing read ahead
            assert len(seen) > epoch * n - unit  # the tail is less than a round
            lo = carry_window(base, first, epoch, n, unit)[0]
        else:
            taken = [data.draw(st.integers(0, share)) for _ in range(num_slots)]
            reads = _carry_run(base, first, epoch, n, world, workers, multiple, layout, taken)
            seen.extend(r for mine in reads for r in mine)
            base, first, finished = carry_left(
                base, first, epoch, n, left_after(layout, world, workers, multiple), taken, world, workers, multiple
            )
            assert finished == all(t == share for t in taken)
            epoch += finished
            lo = 0
        # what is left is exactly what nobody read: nothing lost, nothing read twice
        bound = (epoch + 2) * n
        left = base.compose(Remaining([(lo, None)]))
        assert len(set(seen)) == len(seen)
        assert sorted(set(range(bound)) - {e * n + p for e, p in seen}) == list(left.stream(range(bound)))
