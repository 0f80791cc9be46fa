r"""The pure arithmetic of packing documents into blocks of ``seq_len`` tokens (no torch).

Documents ``0 .. n-1`` hold ``c_k`` tokens each (their eos included). In packing
order their tokens are concatenated; block ``b`` is tokens ``[b*L, (b+1)*L)`` of the
concatenation, so a block depends on the counts and ``L`` alone, never on who reads
it. ``prefix[k]`` is the number of tokens before document ``k`` (``prefix[n]`` is the
total); a block's documents are found by bisection in it.

With ``shuffle_documents`` the packing order is a seeded permutation of the documents
(:class:`distshard.plan.Permutation`, O(1) memory, computed per index) and the prefix
sums are those of the permuted counts: 8 bytes per document for the prefix sums of
the file order, 8 more for those of the permuted order; the permutation itself is
not stored. numpy, when installed, computes the arrays (int64 numpy arrays, fast);
without it they are ``array("q")``\ s computed element by element (the same values).
"""

from __future__ import annotations

import bisect
from array import array
from typing import Any, Sequence

from .errors import OptionError
from .plan import Permutation

__all__ = ["Packing", "permuted", "prefix_sums", "shuffled_prefix"]

_CHUNK = 1 << 16  # indices per vectorized step (bounded temporary memory, in cache)
_PERMUTED_CHUNK = 1 << 20


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with the test extra
        return None
    return numpy


def _zeros(n: int) -> array:
    return array("q", bytes(8 * n))


def prefix_sums(counts: Sequence[int], extra: int = 0) -> Any:
    """``P`` with ``P[0] = 0`` and ``P[k+1] = P[k] + counts[k] + extra`` (8 bytes a
    document; ``extra`` is 1 when every document is followed by an eos token): a
    numpy int64 array, or an ``array("q")`` without numpy."""
    n = len(counts)
    np = _numpy()
    if np is not None:
        out = np.empty(n + 1, dtype=np.int64)
        out[0] = 0
        source = np.asarray(counts)
        carry = 0
        for lo in range(0, n, _CHUNK):  # in chunks: no temporary of the whole length
            hi = min(n, lo + _CHUNK)
            part = out[lo + 1 : hi + 1]
            part[:] = source[lo:hi]
            if extra:
                part += extra
            np.cumsum(part, out=part)
            part += carry
            carry = int(part[-1])
        return out
    out_ = _zeros(n + 1)
    total = 0
    for k in range(n):
        total += int(counts[k]) + extra
        out_[k + 1] = total
    return out_


def permuted(permutation: Permutation, indices: Any) -> Any:
    """``[permutation(i) for i in indices]`` for a numpy array of indices, computed
    with numpy's uint64 arithmetic (the same values as the per-index call)."""
    np = _numpy()
    u64 = np.uint64
    half, mask = u64(permutation.half), u64(permutation.mask)
    mult1, mult2 = u64(0x9E3779B97F4A7C15), u64(0xBF58476D1CE4E5B9)
    keys = [u64(key) for key in permutation.keys]

    def encrypt(value: Any) -> Any:
        left, right = value >> half, value & mask
        for key in keys:
            z = right * mult1 + key
            z ^= z >> u64(29)
            z = z * mult2
            left, right = right, left ^ ((z ^ (z >> u64(32))) & mask)
        return (left << half) | right

    n = u64(permutation.n)
    with np.errstate(over="ignore"):
        value = encrypt(np.asarray(indices, dtype=np.uint64))
        outside = value >= n
        while outside.any():
            value[outside] = encrypt(value[outside])
            outside = value >= n
    return value.astype(np.int64)


def shuffled_prefix(prefix: Sequence[int], permutation: Permutation) -> Any:
    """The prefix sums of the documents taken in the order ``permutation`` gives:
    the ``k``-th document of the packing is ``permutation(k)``."""
    n = len(prefix) - 1
    np = _numpy()
    if np is not None:
        source = np.asarray(prefix)
        out = np.empty(n + 1, dtype=np.int64)
        out[0] = 0
        total = 0
        for lo in range(0, n, _PERMUTED_CHUNK):
            hi = min(n, lo + _PERMUTED_CHUNK)
            docs = permuted(permutation, np.arange(lo, hi, dtype=np.uint64))
            part = out[lo + 1 : hi + 1]
            np.subtract(source[docs + 1], source[docs], out=part)
            np.cumsum(part, out=part)
            part += total
            total = int(part[-1])
        return out
    out_ = _zeros(n + 1)
    total = 0
    for k in range(n):
        doc = permutation(k)
        total += prefix[doc + 1] - prefix[doc]
        out_[k + 1] = total
    return out_


class Packing:
    """Blocks of ``seq_len`` tokens over documents with prefix sums ``prefix``.

    ``blocks`` is ``ceil(total / seq_len)``; only the last block is short (padded by
    ``padding`` tokens). :meth:`segments` says which tokens of which documents a
    block holds."""

    def __init__(self, prefix: Sequence[int], seq_len: int) -> None:
        if seq_len < 1:
            raise OptionError(f"seq_len={seq_len} must be at least 1")
        self.prefix = prefix
        self.seq_len = seq_len
        self.documents = len(prefix) - 1
        self.total = int(prefix[-1])
        self.blocks = -(-self.total // seq_len)
        self.padding = self.blocks * seq_len - self.total

    def count(self, k: int) -> int:
        """The tokens of the ``k``-th document of the packing (its eos included)."""
        return int(self.prefix[k + 1] - self.prefix[k])

    def segments(self, block: int) -> list[tuple[int, int, int]]:
        """``(k, lo, hi)`` for every document the block holds tokens of, in order:
        tokens ``[lo, hi)`` of the ``k``-th document of the packing. Their lengths
        add up to ``seq_len``, or less in the last block. Empty documents hold none."""
        if not 0 <= block < self.blocks:
            raise IndexError(f"block {block} is outside [0, {self.blocks})")
        prefix = self.prefix
        start = block * self.seq_len
        stop = min(start + self.seq_len, self.total)
        find = getattr(prefix, "searchsorted", None)  # numpy's bisection, else the sequence's
        k = (int(find(start, "right")) if find is not None else bisect.bisect_right(prefix, start)) - 1
        out = []  # prefix[k] <= start < prefix[k + 1]
        while start < stop:
            begin, end = int(prefix[k]), int(prefix[k + 1])
            if end > start:
                hi = min(end, stop)
                out.append((k, start - begin, hi - begin))
                start = hi
            k += 1
        return out

    def documents_of(self, block: int) -> tuple[int, int]:
        """``(first, last)``: the packing indices of the first and last documents
        the block holds tokens of."""
        segments = self.segments(block)
        return segments[0][0], segments[-1][0]
