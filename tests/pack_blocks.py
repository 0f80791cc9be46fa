"""The blocks distshard.pack must give, by definition (concatenate and cut, or the brute-force
best fit), and a block as a comparable key: shared by the pack tests."""

from __future__ import annotations

from collections import Counter

import torch

from .packing_oracle import concat_layout, filled, reference_best_fit


def oracle(docs, seq_len: int, eos=None, pad: int = 0) -> list[tuple]:
    """The blocks by definition: concatenate (eos after each), cut, pad the last;
    segment ids number the documents of each block from 1 (0 on padding)."""
    with_eos = [list(doc) + ([] if eos is None else [eos]) for doc in docs]
    return filled(with_eos, concat_layout([len(d) for d in with_eos], seq_len), seq_len, pad)


def best_oracle(docs, seq_len: int, eos=None, pad: int = 0, window=None, window_documents=None) -> list[tuple]:
    """The blocks of fit="best" by definition: the brute-force best-fit decreasing of
    tests/packing_oracle.py over the documents' counts, filled with their tokens."""
    with_eos = [list(doc) + ([] if eos is None else [eos]) for doc in docs]
    if window is None and window_documents is None:
        window = 256 * seq_len
    layout = reference_best_fit([len(d) for d in with_eos], seq_len, window, window_documents)
    return filled(with_eos, layout, seq_len, pad)


FIELDS = ("input_ids", "position_ids", "loss_mask", "segment_ids")


def key(block: dict) -> tuple:
    assert set(block) == set(FIELDS)
    for value in block.values():
        assert value.dtype == torch.long and value.dim() == 1
    return tuple(tuple(block[k].tolist()) for k in FIELDS)


def tokens_of(blocks) -> Counter:
    """Every real token (loss_mask 1) of the blocks."""
    out: Counter = Counter()
    for b in blocks:
        b = key(b) if isinstance(b, dict) else b
        out.update(t for t, m in zip(b[0], b[2], strict=True) if m)
    return out
