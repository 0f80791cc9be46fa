r"""The pure arithmetic of packing documents into blocks of ``seq_len`` tokens (no torch).

Documents ``0 .. n-1`` hold ``c_k`` tokens each (their eos included), in packing order.
Two fits place them, both functions of the counts and ``L`` alone, never of who reads:

* ``"concat"`` (:class:`Packing`): the documents' tokens are concatenated and block
  ``b`` is tokens ``[b*L, (b+1)*L)`` of the concatenation; only the last block is short.
* ``"best"`` (:class:`BestPacking`): whole documents are placed into blocks by a
  best-fit decreasing over windows of documents in packing order. A document longer
  than ``L`` gives ``c // L`` pieces of ``L`` (a block each) and its remainder is placed
  like a document; every block but those pieces may end in padding.

The counts (:class:`TokenCounts`) are held as given (a memory map of an ``.idx``
stays one) with the prefix sums checkpointed every ``_STEP`` documents, so the plan of
``"concat"`` takes well under a byte per document; the prefix at any document is a
checkpoint plus a short sum. ``"best"`` adds its placement in compact arrays, indexed
per window (see :class:`BestPacking`). With ``shuffle_documents`` the packing order is
a seeded permutation of the documents (:class:`distshard.plan.Permutation`, computed
per index) and the counts are taken in that order (:meth:`TokenCounts.permuted`, the
counts' own dtype: 4 bytes a document for an ``.idx``'s int32). numpy computes the
arrays; without it ``"concat"`` keeps full prefix sums in an ``array("q")`` (the same
values) and ``"best"`` is refused.
"""

from __future__ import annotations

import bisect
from array import array
from typing import Any, Iterator, Sequence

from .errors import OptionError
from .plan import Permutation

__all__ = ["BestPacking", "Packing", "ReadGroups", "TokenCounts", "best_fit", "permuted"]

_STEP = 128  # documents per checkpoint of the prefix sums
_CHUNK = 1 << 20  # documents per vectorized step (bounded temporary memory)
_PERMUTED_CHUNK = 1 << 20
_U32 = 1 << 32


def numpy_module() -> Any:
    """numpy if it is installed (the arithmetic and ``pack``'s blocks run in it), else ``None``."""
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with the test extra
        return None
    return numpy


class TokenCounts:
    """The tokens of documents ``0 .. n-1`` in packing order: ``counts[k] + extra``
    each (``extra`` is 1 when every document is followed by an eos token).

    ``counts`` is kept as given (a numpy array, a memory map, an ``array("q")``, a
    list); the prefix sums are stored every ``_STEP`` documents (``base``), and
    :meth:`at` and :meth:`find` add the few counts after a checkpoint."""

    def __init__(self, counts: Sequence[int], extra: int = 0) -> None:
        self.extra = int(extra)
        self.documents = len(counts)
        np = numpy_module()
        if np is None:
            self.step = 1
            self.counts: Any = counts
            self.base: Any = _full_prefix(counts, self.extra)
        else:
            self.step = _STEP
            self.counts = _as_array(np, counts)
            self.base = _checkpoints(np, self.counts, self.extra, _STEP)
        self.total = int(self.base[-1])

    @property
    def nbytes(self) -> int:
        """The bytes of the checkpoints (the counts themselves are the source's)."""
        return int(getattr(self.base, "nbytes", 8 * len(self.base)))

    def count(self, k: int) -> int:
        """The tokens of the ``k``-th document (its eos included)."""
        if self.step == 1:
            return int(self.base[k + 1] - self.base[k])
        return int(self.counts[k]) + self.extra

    def at(self, k: int) -> int:
        """The tokens before the ``k``-th document (``at(documents)`` is the total)."""
        j, r = divmod(k, self.step)
        if r == 0:
            return int(self.base[j])
        lo = j * self.step
        return int(self.base[j]) + int(self.counts[lo:k].sum(dtype="int64")) + self.extra * r

    def find(self, t: int) -> int:
        """The largest ``k`` with ``at(k) <= t`` (``bisect_right`` on the prefix sums, less one)."""
        base = self.base
        if self.step == 1:
            return bisect.bisect_right(base, t) - 1
        j = int(base.searchsorted(t, "right")) - 1
        lo = j * self.step
        hi = min(lo + self.step, self.documents)
        if lo >= hi:  # t is past the total (the last checkpoint)
            return self.documents
        local = self.chunk(lo, hi).cumsum()
        local += base[j]
        return lo + int(local.searchsorted(t, "right"))

    def chunk(self, lo: int, hi: int) -> Any:
        """The tokens of documents ``[lo, hi)`` as an int64 numpy array."""
        np = numpy_module()
        out = np.asarray(self.counts[lo:hi], dtype=np.int64)
        if out.base is not None or out is self.counts:
            out = out.copy()
        if self.extra:
            out += self.extra
        return out

    def prefix_chunks(self) -> Iterator[Any]:
        """The prefix sums ``at(0) .. at(documents)`` in order, as buffers of int64
        (what a digest of the counts reads, without holding them all)."""
        if self.step == 1:
            yield memoryview(self.base).cast("B")
            return
        np = numpy_module()
        yield np.zeros(1, dtype=np.int64).data
        total = 0
        for lo in range(0, self.documents, _CHUNK):
            part = self.chunk(lo, min(self.documents, lo + _CHUNK))
            np.cumsum(part, out=part)
            part += total
            total = int(part[-1])
            yield part.data

    def permuted(self, permutation: Permutation) -> "TokenCounts":
        """The same documents in the order ``permutation`` gives (the ``k``-th document
        packed is ``permutation(k)``), their counts in the counts' own dtype."""
        n = self.documents
        np = numpy_module()
        if np is None:
            return TokenCounts([self.count(permutation(k)) - self.extra for k in range(n)], self.extra)
        source = self.counts
        out = np.empty(n, dtype=source.dtype)
        for lo in range(0, n, _PERMUTED_CHUNK):
            hi = min(n, lo + _PERMUTED_CHUNK)
            out[lo:hi] = source[permuted(permutation, np.arange(lo, hi, dtype=np.uint64))]
        return TokenCounts(out, self.extra)


def _as_array(np: Any, counts: Sequence[int]) -> Any:
    if isinstance(counts, np.ndarray):
        return counts
    if isinstance(counts, array) and counts.typecode == "q":
        return np.frombuffer(counts, dtype=np.int64) if len(counts) else np.zeros(0, np.int64)
    return np.asarray(counts, dtype=np.int64).reshape(-1)


def _checkpoints(np: Any, counts: Any, extra: int, step: int) -> Any:
    """``base[j]``: the tokens before document ``j * step`` (the last: the total)."""
    n = len(counts)
    steps = -(-n // step)
    base = np.zeros(steps + 1, dtype=np.int64)
    chunk = max(step, _CHUNK // step * step)
    for lo in range(0, n, chunk):  # in chunks: summing with an int64 accumulator casts no copy of the whole
        hi = min(n, lo + chunk)
        whole = (hi - lo) // step * step
        at = lo // step + 1
        part = np.asarray(counts[lo : lo + whole]).reshape(-1, step)
        base[at : at + len(part)] = part.sum(axis=1, dtype=np.int64)
        if whole < hi - lo:
            base[-1] = np.asarray(counts[lo + whole : hi]).sum(dtype=np.int64)
    if n and extra:
        base[1:] += extra * step
        base[-1] -= extra * (steps * step - n)
    np.cumsum(base, out=base)
    return base


def _full_prefix(counts: Sequence[int], extra: int) -> array:
    out = array("q", bytes(8 * (len(counts) + 1)))
    total = 0
    for k in range(len(counts)):
        total += int(counts[k]) + extra
        out[k + 1] = total
    return out


def permuted(permutation: Permutation, indices: Any) -> Any:
    """``[permutation(i) for i in indices]`` for a numpy array of indices, computed
    with numpy's uint64 arithmetic (the same values as the per-index call)."""
    np = numpy_module()
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


def _check_seq_len(seq_len: int) -> None:
    if seq_len < 1:
        raise OptionError(f"seq_len={seq_len} must be at least 1")


class Packing:
    """``fit="concat"``: blocks of ``seq_len`` tokens cut from the concatenation.

    ``blocks`` is ``ceil(total / seq_len)``; only the last block is short (padded by
    ``padding`` tokens). :meth:`segments` says which tokens of which documents a
    block holds."""

    fit = "concat"

    def __init__(self, counts: TokenCounts, seq_len: int) -> None:
        _check_seq_len(seq_len)
        self.counts = counts
        self.seq_len = seq_len
        self.documents = counts.documents
        self.total = counts.total
        self.blocks = -(-self.total // seq_len)
        self.padding = self.blocks * seq_len - self.total

    @property
    def nbytes(self) -> int:
        return self.counts.nbytes

    def count(self, k: int) -> int:
        """The tokens of the ``k``-th document of the packing (its eos included)."""
        return self.counts.count(k)

    def window_of(self, block: int) -> int | None:
        """The window a block's documents come from (``None``: blocks read in order)."""
        return None

    def segments(self, block: int) -> list[tuple[int, int, int]]:
        """``(k, lo, hi)`` for every document the block holds tokens of, in order:
        tokens ``[lo, hi)`` of the ``k``-th document of the packing. Their lengths
        add up to ``seq_len``, or less in the last block. Empty documents hold none."""
        if not 0 <= block < self.blocks:
            raise IndexError(f"block {block} is outside [0, {self.blocks})")
        counts = self.counts
        start = block * self.seq_len
        stop = min(start + self.seq_len, self.total)
        k = counts.find(start)  # at(k) <= start < at(k + 1)
        begin = counts.at(k)
        out = []
        while start < stop:
            end = begin + counts.count(k)
            if end > start:
                hi = min(end, stop)
                out.append((k, start - begin, hi - begin))
                start = hi
            begin = end
            k += 1
        return out

    def documents_of(self, block: int) -> tuple[int, int]:
        """``(first, last)``: the packing indices of the first and last documents
        the block holds tokens of."""
        segments = self.segments(block)
        return segments[0][0], segments[-1][0]


def best_fit(sizes: Sequence[int], bounds: Sequence[int], capacity: int) -> tuple[list[int], list[int]]:
    """Best fit of items already sorted by decreasing size within each window.

    Window ``w`` holds items ``[bounds[w], bounds[w+1])``; each goes into the open bin
    of that window with the least room that still takes it (of bins with equal room,
    the one that reached it last), else into a new bin of ``capacity``. Returns every
    item's bin (numbered from 0 in each window, in the order they were opened) and the
    bins of every window. Items above ``capacity / 2`` never share a bin with an
    earlier one, so they open theirs without a search."""
    out: list[int] = []
    append = out.append
    per_window: list[int] = []
    half = capacity // 2
    stacks: list[Any] = [None] * (capacity + 1)  # the bins with room r, reset after each window
    for w in range(len(bounds) - 1):
        a, b = bounds[w], bounds[w + 1]
        opened = 0
        if a < b:
            smallest = sizes[b - 1]  # room below the window's smallest item is never used
            rooms: list[int] = []  # the distinct rooms of open bins, sorted
            for s in sizes[a:b]:
                if s > half:
                    where, left = opened, capacity - s
                    opened += 1
                else:
                    j = bisect.bisect_left(rooms, s)
                    if j < len(rooms):
                        room = rooms[j]
                        stack = stacks[room]
                        where = stack.pop()
                        if not stack:
                            del rooms[j]
                        left = room - s
                    else:
                        where, left = opened, capacity - s
                        opened += 1
                append(where)
                if left >= smallest:
                    stack = stacks[left]
                    if stack:
                        stack.append(where)
                    else:
                        stacks[left] = [where]
                        bisect.insort(rooms, left)
            for room in rooms:
                stacks[room] = None
        per_window.append(opened)
    return out, per_window


class BestPacking:
    """``fit="best"``: whole documents placed into blocks by best-fit decreasing
    within windows of documents in packing order.

    A window is ``window_documents`` consecutive documents, or (``window_tokens``)
    the documents whose first token lies in the same stretch of ``window_tokens``
    tokens of the concatenation. A window's blocks come in this order: the pieces of
    ``L`` of its documents longer than ``L`` (by document, then piece), then its bins
    in the order best fit opened them, each holding the remainders and whole
    documents it was given in the order they were placed (decreasing size), padding
    after them. The windows' blocks follow each other in window order.

    The plan, per window (8 bytes each of six arrays: its first document, block,
    bin, member and long document, its pieces) and per document: ``members`` (the
    documents of each bin, relative to the window's first: 4 bytes), ``bin_first``
    (where each bin starts in them: 4 bytes a bin) and, for documents longer than
    ``L``, ``long_rel`` and ``long_cum`` (which, and their pieces so far in the
    window: 4 + 4 bytes). Block ``b`` is found by bisection over the windows and,
    for a piece, over the window's long documents."""

    fit = "best"

    def __init__(
        self,
        counts: TokenCounts,
        seq_len: int,
        *,
        window_tokens: int | None = None,
        window_documents: int | None = None,
    ) -> None:
        _check_seq_len(seq_len)
        if (window_tokens is None) == (window_documents is None):
            raise OptionError("give one of window_tokens and window_documents")
        np = numpy_module()
        if np is None:  # pragma: no cover - numpy comes with the test extra
            raise ImportError("pack(fit='best') computes its plan with numpy: `pip install numpy`")
        self.counts = counts
        self.seq_len = seq_len
        self.window_tokens = window_tokens
        self.window_documents = window_documents
        self.documents = counts.documents
        self.total = counts.total
        self._last: tuple[int, ...] | None = None  # the window of the last block asked for
        parts = [_plan_windows(np, counts, seq_len, lo, hi, starts) for lo, hi, starts in self._windows(np)]
        self._join(np, parts)
        self.padding = self.blocks * seq_len - self.total

    # -- building ------------------------------------------------------------------------
    def _windows(self, np: Any) -> Iterator[tuple[int, int, Any]]:
        """``(lo, hi, starts)``: runs of whole windows, documents ``[lo, hi)``, their
        windows starting at ``lo + starts``."""
        n, lo = self.documents, 0
        while lo < n:
            if self.window_documents is not None:
                docs = self.window_documents
                hi = min(n, lo + max(docs, _CHUNK // docs * docs))
                yield lo, hi, np.arange(0, hi - lo, docs, dtype=np.int64)
                lo = hi
                continue
            span, size = _CHUNK, self.window_tokens
            assert size is not None
            while True:
                hi = min(n, lo + span)
                c = self.counts.chunk(lo, hi)
                ends = np.cumsum(c)
                ends += self.counts.at(lo)
                window = (ends - c) // size
                cut = len(c)
                if hi < n and int(ends[-1]) // size == int(window[-1]):
                    cut = int(window.searchsorted(window[-1], "left"))  # the last window goes on: next run
                if cut > 0:
                    break
                span *= 2
            window = window[:cut]
            starts = np.flatnonzero(np.diff(window)) + 1
            yield lo, lo + cut, np.concatenate([np.zeros(1, np.int64), starts.astype(np.int64)])
            lo += cut

    def _join(self, np: Any, parts: list[dict[str, Any]]) -> None:
        def cat(name: str, dtype: Any) -> Any:
            arrays = [p[name] for p in parts]
            return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)

        def starts(name: str) -> Any:
            sizes = cat(name, np.int64)
            out = np.zeros(len(sizes) + 1, dtype=np.int64)
            np.cumsum(sizes, out=out[1:])
            return out

        wide = max((p["wide"] for p in parts), default=False)
        self.win_doc = np.append(cat("win_doc", np.int64), np.int64(self.documents))
        self.win_full = cat("full", np.int64)
        self.win_bin = starts("bins")
        self.win_member = starts("items")
        self.win_long = starts("longs")
        self.win_block = np.zeros(len(self.win_full) + 1, dtype=np.int64)
        np.cumsum(self.win_full + (self.win_bin[1:] - self.win_bin[:-1]), out=self.win_block[1:])
        self.members = cat("members", np.uint32)
        self.bin_first = cat("bin_first", np.uint32)
        self.long_rel = cat("long_rel", np.uint32)
        self.long_cum = cat("long_cum", np.int64 if wide else np.uint32)
        self.windows = len(self.win_full)
        self.blocks = int(self.win_block[-1])

    @property
    def nbytes(self) -> int:
        """The plan's bytes: the counts' checkpoints and the placement arrays."""
        arrays = (self.win_doc, self.win_full, self.win_bin, self.win_member, self.win_long, self.win_block)
        own = (self.members, self.bin_first, self.long_rel, self.long_cum)
        return self.counts.nbytes + sum(int(a.nbytes) for a in arrays + own)

    # -- reading ---------------------------------------------------------------------------
    def count(self, k: int) -> int:
        return self.counts.count(k)

    def window_of(self, block: int) -> int:
        return self._window(block)[0]

    def _window(self, block: int) -> tuple[int, ...]:
        """The window of ``block`` and its figures as ints: ``(w, first block, end
        block, first document, pieces, first long, end long, first bin, end bin,
        first member, end member)``, kept for the next block (a slot reads on)."""
        known = self._last
        if known is not None and known[1] <= block < known[2]:
            return known
        if not 0 <= block < self.blocks:
            raise IndexError(f"block {block} is outside [0, {self.blocks})")
        w = int(self.win_block.searchsorted(block, "right")) - 1

        def pair(array: Any) -> tuple[int, int]:
            return int(array[w]), int(array[w + 1])

        (b0, b1), (la, lb), (g0, g1), (m0, m1) = (
            pair(a) for a in (self.win_block, self.win_long, self.win_bin, self.win_member)
        )
        doc, full = int(self.win_doc[w]), int(self.win_full[w])
        self._last = (w, b0, b1, doc, full, la, lb, g0, g1, m0, m1)
        return self._last

    def segments(self, block: int) -> list[tuple[int, int, int]]:
        """``(k, lo, hi)`` for every document the block holds tokens of, in the
        block's order: tokens ``[lo, hi)`` of the ``k``-th document of the packing
        (a piece of ``L``, a remainder ``[c - c % L, c)`` or a whole document)."""
        _, b0, _, first, full, la, lb, g0, g1, m0, m1 = self._window(block)
        j = block - b0
        L = self.seq_len
        if j < full:
            i = la + int(self.long_cum[la:lb].searchsorted(j, "right"))
            before = int(self.long_cum[i - 1]) if i > la else 0
            piece = j - before
            return [(first + int(self.long_rel[i]), piece * L, (piece + 1) * L)]
        g = g0 + j - full
        ends = self.bin_first[g : g + 2].tolist()
        lo, hi = m0 + ends[0], (m0 + ends[1] if g + 1 < g1 else m1)
        out = []
        for m in self.members[lo:hi].tolist():
            k = first + m
            c = self.counts.count(k)
            out.append((k, c - c % L, c))
        return out

    def documents_of(self, block: int) -> tuple[int, int]:
        """``(first, last)``: the lowest and highest packing indices of the documents
        the block holds tokens of."""
        ks = [k for k, _, _ in self.segments(block)]
        return min(ks), max(ks)


def _plan_windows(np: Any, counts: TokenCounts, L: int, lo: int, hi: int, starts: Any) -> dict[str, Any]:
    """The placement of the windows of documents ``[lo, hi)`` (starting at ``lo +
    starts``): per window its first document, pieces, bins, members and long
    documents; per bin where its members start; the members and long documents."""
    c = counts.chunk(lo, hi)
    m, nw = len(c), len(starts)
    sizes_w = np.diff(np.append(starts, m))
    window = np.repeat(np.arange(nw, dtype=np.int64), sizes_w)
    pieces = c // L
    rest = c - pieces * L
    full = np.add.reduceat(pieces, starts) if m else np.zeros(0, np.int64)
    long_docs = np.flatnonzero(pieces)
    longs = np.bincount(window[long_docs], minlength=nw)
    before = np.concatenate([np.zeros(1, np.int64), np.cumsum(full)[:-1]])
    long_cum = np.cumsum(pieces[long_docs]) - before[window[long_docs]]
    items = np.flatnonzero(rest)
    order = np.argsort(window[items] * (L + 1) + (L - rest[items]), kind="stable")
    items = items[order]
    per_window = np.bincount(window[items], minlength=nw)
    bounds = np.concatenate([np.zeros(1, np.int64), np.cumsum(per_window)])
    local, bins = best_fit(rest[items].tolist(), bounds.tolist(), L)
    bins_w = np.asarray(bins, dtype=np.int64)
    bin_start = np.concatenate([np.zeros(1, np.int64), np.cumsum(bins_w)[:-1]])
    bin_of = np.asarray(local, dtype=np.int64) + bin_start[window[items]]
    members = items[np.argsort(bin_of, kind="stable")]
    per_bin = np.bincount(bin_of, minlength=int(bins_w.sum()))
    member_start = np.concatenate([np.zeros(1, np.int64), np.cumsum(per_bin)[:-1]])
    window_members = np.concatenate([np.zeros(1, np.int64), np.cumsum(per_window)[:-1]])
    bin_window = np.repeat(np.arange(nw, dtype=np.int64), bins_w)
    if int(sizes_w.max(initial=0)) >= _U32:  # pragma: no cover - a window of 2^32 documents
        raise OptionError("a window of fit='best' holds 2^32 documents or more: give a smaller window")
    wide = bool(len(long_cum)) and int(long_cum.max()) >= _U32
    return {  # the per-document arrays in their compact dtypes already (the runs are joined at the end)
        "win_doc": starts + lo,
        "full": full,
        "bins": bins_w,
        "items": per_window,
        "longs": longs,
        "members": (members - starts[window[members]]).astype(np.uint32),
        "bin_first": (member_start - window_members[bin_window]).astype(np.uint32),
        "long_rel": (long_docs - starts[window[long_docs]]).astype(np.uint32),
        "long_cum": long_cum if wide else long_cum.astype(np.uint32),
        "wide": wide,
    }


Segments = list[tuple[int, int, int]]
Group = tuple[list[tuple[int, Segments]], list[int]]


class ReadGroups:
    """The blocks at ``positions`` taken in groups that read their documents together:
    consecutive blocks of one window (``fit="best"``, whose documents come in any order
    within the window), else one block at a time. A group's reads are the packing
    indices of the documents its blocks hold, ascending, less those of the previous
    group's last block (the reader holds them over: a document cut by a block boundary
    is read once)."""

    def __init__(self, packing: "Packing | BestPacking", positions: Iterator[int]) -> None:
        self.packing = packing
        self.positions = positions
        self.peeked: int | None = None
        self.carried: set[int] = set()

    def _next(self) -> int | None:
        block: int | None = self.peeked
        if block is not None:
            self.peeked = None
        else:
            block = next(self.positions, None)
        if block is not None and not 0 <= block < self.packing.blocks:
            raise IndexError(f"block {block} is outside [0, {self.packing.blocks})")
        return block

    def take(self) -> Group | None:
        """The next group: its blocks with their segments, and what it reads; ``None`` at the end."""
        block = self._next()
        if block is None:
            return None
        packing = self.packing
        blocks = [(block, packing.segments(block))]
        window = packing.window_of(block)
        while window is not None:
            after = self._next()
            if after is None:
                break
            if packing.window_of(after) != window:
                self.peeked = after
                break
            blocks.append((after, packing.segments(after)))
        reads = sorted({k for _, segments in blocks for k, _, _ in segments} - self.carried)
        self.carried = {k for k, _, _ in blocks[-1][1]}
        return blocks, reads
