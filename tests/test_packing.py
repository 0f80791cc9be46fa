"""The pure arithmetic of packing (distshard.packing), property-tested."""

import zlib
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distshard import packing
from distshard.packing import BestPacking, Packing, ReadGroups, TokenCounts, permuted
from distshard.plan import Permutation

from .packing_oracle import prefix_of, reference_best_fit, windows_of

counts_lists = st.lists(st.integers(0, 12), max_size=40)
# the fixtures below only set a module constant, the same for every example; no deadline
# (a loaded machine's scheduling is not the arithmetic's speed)
FIXTURES = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def expected_blocks(counts, seq_len, order=None):
    """The oracle: every (document, token) of the concatenation, cut into seq_len."""
    order = range(len(counts)) if order is None else order
    stream = [(k, t) for k, d in enumerate(order) for t in range(counts[d])]
    return [stream[i : i + seq_len] for i in range(0, len(stream), seq_len)]


@pytest.fixture(params=[128, 3], ids=["step128", "step3"])
def step(request, monkeypatch):
    """The checkpoints every 128 documents, and every 3 (most lookups cross one)."""
    monkeypatch.setattr(packing, "_STEP", request.param)
    return request.param


# -- the counts ------------------------------------------------------------------------------


@given(counts=counts_lists, extra=st.integers(0, 1), data=st.data())
@FIXTURES
def test_token_counts_are_the_prefix_sums(step, counts, extra, data):
    tokens = TokenCounts(np.array(counts, dtype=np.int32), extra)
    prefix = prefix_of(counts, extra)
    assert tokens.total == prefix[-1] and tokens.documents == len(counts)
    assert [tokens.at(k) for k in range(len(counts) + 1)] == prefix
    assert [tokens.count(k) for k in range(len(counts))] == [c + extra for c in counts]
    for t in data.draw(st.lists(st.integers(0, prefix[-1] + 2), max_size=10)):
        assert tokens.find(t) == max(k for k, p in enumerate(prefix) if p <= t)
    # the digest reads the int64 prefix sums in chunks: the CRC of the whole array
    crc = 0
    for chunk in tokens.prefix_chunks():
        crc = zlib.crc32(chunk, crc)
    assert crc == zlib.crc32(np.array(prefix, dtype=np.int64).tobytes())


def test_counts_are_kept_as_given_and_the_plan_is_a_byte_a_hundred_documents():
    counts = np.arange(100_000, dtype=np.int32) % 50
    tokens = TokenCounts(counts, 1)
    assert tokens.counts is counts  # a memory map of an .idx stays one
    assert tokens.nbytes <= 8 * (len(counts) // 128 + 2)
    assert Packing(tokens, 64).nbytes == tokens.nbytes


@given(n=st.integers(0, 600), seed=st.integers(0, 2**63 - 1))
@settings(max_examples=60, deadline=None)
def test_the_vectorized_permutation_is_the_per_index_one(n, seed):
    perm = Permutation(n, seed)
    assert permuted(perm, np.arange(n, dtype=np.uint64)).tolist() == [perm(k) for k in range(n)]


@given(counts=counts_lists, seed=st.integers(0, 2**40), seq_len=st.integers(1, 9))
@settings(deadline=None)
def test_permuted_counts_pack_the_permuted_documents(counts, seed, seq_len):
    perm = Permutation(len(counts), seed)
    source = np.array(counts, dtype=np.uint16)
    shuffled = TokenCounts(source, 1).permuted(perm)
    order = [perm(k) for k in range(len(counts))]
    assert shuffled.counts.dtype == source.dtype  # the counts' own dtype: 2 bytes a document here
    assert [shuffled.count(k) for k in range(len(counts))] == [counts[d] + 1 for d in order]
    plan = Packing(shuffled, seq_len)
    tokens = Counter((order[k], t) for b in range(plan.blocks) for k, lo, hi in plan.segments(b) for t in range(lo, hi))
    assert tokens == Counter((d, t) for d, c in enumerate(counts) for t in range(c + 1))


def test_without_numpy_the_plan_is_the_same(monkeypatch):
    counts = [3, 0, 7, 1, 12, 5] * 50
    perm = Permutation(len(counts), 7)

    def blocks(tokens):
        plan = Packing(tokens, 7)
        return [plan.segments(b) for b in range(plan.blocks)]

    fast = (blocks(TokenCounts(counts, 1)), blocks(TokenCounts(counts, 1).permuted(perm)))
    digest = b"".join(bytes(c) for c in TokenCounts(counts, 1).prefix_chunks())
    monkeypatch.setattr(packing, "numpy_module", lambda: None)
    slow = TokenCounts(counts, 1)
    assert (blocks(slow), blocks(slow.permuted(perm))) == fast
    assert b"".join(bytes(c) for c in slow.prefix_chunks()) == digest


# -- fit="concat" ------------------------------------------------------------------------------


@given(counts=counts_lists, seq_len=st.integers(1, 9), eos=st.booleans())
@FIXTURES
def test_blocks_cut_the_concatenation_every_token_once(step, counts, seq_len, eos):
    with_eos = [c + eos for c in counts]
    plan = Packing(TokenCounts(counts, int(eos)), seq_len)
    assert plan.total == sum(with_eos) and plan.blocks == -(-plan.total // seq_len)
    assert plan.padding == plan.blocks * seq_len - plan.total and 0 <= plan.padding < seq_len
    got = [[(k, t) for k, lo, hi in plan.segments(b) for t in range(lo, hi)] for b in range(plan.blocks)]
    assert got == expected_blocks(with_eos, seq_len)
    for b in range(plan.blocks):
        assert all(hi > lo for _, lo, hi in plan.segments(b))  # empty documents hold no segment
        assert sum(hi - lo for _, lo, hi in plan.segments(b)) == (
            seq_len if b < plan.blocks - 1 else seq_len - plan.padding
        )
    with pytest.raises(IndexError):
        plan.segments(plan.blocks)


def test_seq_len_below_one_is_refused():
    with pytest.raises(ValueError, match="seq_len=0"):
        Packing(TokenCounts([1, 2]), 0)
    with pytest.raises(ValueError, match="seq_len=0"):
        BestPacking(TokenCounts([1, 2]), 0, window_tokens=4)


# -- fit="best" ----------------------------------------------------------------------------------


best_cases = st.tuples(
    st.lists(st.integers(0, 30), max_size=50),
    st.integers(1, 9),
    st.one_of(st.tuples(st.integers(1, 60), st.none()), st.tuples(st.none(), st.integers(1, 12))),
    st.integers(0, 1),
)


@given(case=best_cases)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_best_fit_places_whole_documents_every_token_once(step, case):
    counts, L, (window_tokens, window_documents), extra = case
    with_eos = [c + extra for c in counts]
    plan = BestPacking(TokenCounts(counts, extra), L, window_tokens=window_tokens, window_documents=window_documents)
    blocks = [plan.segments(b) for b in range(plan.blocks)]
    assert blocks == reference_best_fit(with_eos, L, window_tokens, window_documents)
    # every token once; a block holds at most L; padding is what the blocks leave
    assert Counter((k, t) for b in blocks for k, lo, hi in b for t in range(lo, hi)) == Counter(
        (k, t) for k, c in enumerate(with_eos) for t in range(c)
    )
    assert all(0 < sum(hi - lo for _, lo, hi in b) <= L for b in blocks)
    assert plan.padding == plan.blocks * L - sum(with_eos) >= 0
    # a document is cut only when longer than L: into pieces of L (a block each) and its remainder
    for k, c in enumerate(with_eos):
        mine = sorted(s for b in blocks for s in b if s[0] == k)
        expect = [(k, q * L, (q + 1) * L) for q in range(c // L)] + ([(k, c - c % L, c)] if c % L else [])
        assert mine == expect
    # a block's documents come from one window
    window = {k: w for w, docs in enumerate(windows_of(with_eos, window_tokens, window_documents)) for k in docs}
    assert all(len({window[k] for k, _, _ in b}) == 1 for b in blocks)
    assert all(plan.window_of(b) == plan.window_of(b) for b in range(plan.blocks))


@given(case=best_cases)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_best_fit_is_the_same_in_any_chunking(monkeypatch, case):
    """Windows that straddle the plan's vectorized steps (every 2 documents here)
    give the plan of one step."""
    counts, L, (window_tokens, window_documents), extra = case
    tokens = TokenCounts(counts, extra)
    whole = BestPacking(tokens, L, window_tokens=window_tokens, window_documents=window_documents)
    with monkeypatch.context() as patch:
        patch.setattr(packing, "_CHUNK", 2)
        chunked = BestPacking(tokens, L, window_tokens=window_tokens, window_documents=window_documents)
    assert [chunked.segments(b) for b in range(chunked.blocks)] == [whole.segments(b) for b in range(whole.blocks)]


def test_best_fit_fills_blocks_that_concat_would_cut():
    counts = [5, 3, 3, 2, 2, 1] * 20  # 320 tokens: concat cuts ~19 documents into two
    plan = BestPacking(TokenCounts(counts), 8, window_tokens=10_000)
    assert plan.blocks == 40 and plan.padding == 0
    assert all(len(plan.segments(b)) >= 2 for b in range(plan.blocks))


def test_a_window_must_be_one_of_tokens_or_documents():
    with pytest.raises(ValueError, match="one of window_tokens and window_documents"):
        BestPacking(TokenCounts([1]), 4)


def test_the_best_plan_is_compact():
    """The placement takes about 4 bytes per document and bin, 8 per long document."""
    rng = np.random.default_rng(0)
    counts = rng.integers(20, 8001, 20_000).astype(np.int32)
    plan = BestPacking(TokenCounts(counts), 2048, window_tokens=256 * 2048)
    own = plan.nbytes - plan.counts.nbytes
    longs = int((counts >= 2048).sum())
    assert own <= 4 * len(counts) + 4 * plan.blocks + 8 * longs + 48 * (plan.windows + 1)
    assert own / len(counts) <= 16


# -- reading in groups --------------------------------------------------------------------------


@given(case=best_cases, data=st.data())
@settings(max_examples=80, deadline=None)
def test_read_groups_read_each_document_a_group_needs_once(case, data):
    counts, L, (window_tokens, window_documents), extra = case
    tokens = TokenCounts(counts, extra)
    plan = BestPacking(tokens, L, window_tokens=window_tokens, window_documents=window_documents)
    concat = Packing(tokens, L)
    for p in (plan, concat):
        if not p.blocks:
            continue
        positions = data.draw(st.lists(st.integers(0, p.blocks - 1), max_size=20))
        groups = ReadGroups(p, iter(positions))
        taken, held = [], set()
        while (group := groups.take()) is not None:
            blocks, reads = group
            assert reads == sorted(reads)
            needed = {k for _, segments in blocks for k, _, _ in segments}
            assert set(reads) == needed - held and needed <= set(reads) | held
            assert len({p.window_of(b) for b, _ in blocks}) == 1 or p.fit == "concat"
            if p.fit == "concat":
                assert len(blocks) == 1
            held = {k for k, _, _ in blocks[-1][1]}
            taken += [b for b, _ in blocks]
        assert taken == positions
