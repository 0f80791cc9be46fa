"""The pure arithmetic of packing (distshard.packing), property-tested."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distshard import packing
from distshard.packing import Packing, permuted, prefix_sums, shuffled_prefix
from distshard.plan import Permutation

counts_lists = st.lists(st.integers(0, 12), max_size=40)


def expected_blocks(counts, seq_len, order=None):
    """The oracle: every (document, token) of the concatenation, cut into seq_len."""
    order = range(len(counts)) if order is None else order
    stream = [(k, t) for k, d in enumerate(order) for t in range(counts[d])]
    return [stream[i : i + seq_len] for i in range(0, len(stream), seq_len)]


@given(counts=counts_lists, seq_len=st.integers(1, 9), eos=st.booleans())
def test_blocks_cut_the_concatenation_every_token_once(counts, seq_len, eos):
    with_eos = [c + eos for c in counts]
    plan = Packing(prefix_sums(counts, int(eos)), seq_len)
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


@given(n=st.integers(0, 600), seed=st.integers(0, 2**63 - 1))
@settings(max_examples=60)
def test_the_vectorized_permutation_is_the_per_index_one(n, seed):
    perm = Permutation(n, seed)
    assert permuted(perm, np.arange(n, dtype=np.uint64)).tolist() == [perm(k) for k in range(n)]


@given(counts=counts_lists, seed=st.integers(0, 2**40), seq_len=st.integers(1, 9))
def test_shuffled_prefix_packs_the_permuted_documents(counts, seed, seq_len):
    perm = Permutation(len(counts), seed)
    prefix = prefix_sums(counts, 1)
    shuffled = shuffled_prefix(prefix, perm)
    order = [perm(k) for k in range(len(counts))]
    assert list(shuffled) == list(prefix_sums([counts[d] for d in order], 1))
    plan = Packing(shuffled, seq_len)
    tokens = Counter((order[k], t) for b in range(plan.blocks) for k, lo, hi in plan.segments(b) for t in range(lo, hi))
    assert tokens == Counter((d, t) for d, c in enumerate(counts) for t in range(c + 1))


def test_without_numpy_the_arrays_are_the_same(monkeypatch):
    counts = [3, 0, 7, 1, 12, 5] * 50
    perm = Permutation(len(counts), 7)
    fast = (list(prefix_sums(counts, 1)), list(shuffled_prefix(prefix_sums(counts, 1), perm)))
    monkeypatch.setattr(packing, "_numpy", lambda: None)
    assert (list(prefix_sums(counts, 1)), list(shuffled_prefix(prefix_sums(counts, 1), perm))) == fast


def test_seq_len_below_one_is_refused():
    with pytest.raises(ValueError, match="seq_len=0"):
        Packing(prefix_sums([1, 2]), 0)
