"""The order ``shuffle=True`` visits a file source in: files, windows, samples.

A global permutation would send every sample of a slot to another file (a
separate round trip each). :class:`FileOrder` is a seeded permutation of
``[0, N)`` that keeps a slot's consecutive visits inside one file, and inside
one window of it:

* the files in a permuted order;
* each file's *windows* (runs of consecutive samples of about
  ``ReadOptions.window`` bytes; a Parquet row group) in a permuted order;
* each window's samples in a seeded order: for byte-addressed formats (tar,
  JSON lines) a random *expansion* (start at a random sample, then take the next
  sample to the left or to the right of what was taken, at random), so that any
  first part of a window is one run of consecutive samples and the rest at most
  two; for Parquet, whose row group is read whole anyway, a permutation.

A slot reads a contiguous block of visit indices, so it reads whole files in
large ranges and, where its block starts or ends inside a file, a set of whole
windows plus one or two runs of a window: no byte of another slot's samples is
fetched (a full permutation inside windows would make both neighbouring slots
download the window they share), and the requests stay few. The trade-off: two
samples of one window always come close together in an epoch (as with a shuffle
buffer of a window's size after a shard shuffle); put a ``.shuffle(buffer)``
after ``dist_shard`` to mix further. Memory is O(files) plus O(windows) of the
file being visited plus O(samples) of the window being visited; file and window
permutations are :class:`distshard.plan.Permutation` (O(1) each).
"""

from __future__ import annotations

import bisect
from itertools import pairwise
from typing import Callable, Sequence

from ...digests import mix_seed
from ...errors import OptionError, SourceDataError
from ...plan import Permutation, prefix_sums

__all__ = ["FileOrder", "expansion"]


def expansion(size: int, seed: int) -> list[int]:
    """A seeded order of ``[0, size)`` in which every prefix is an interval:
    a random start, then repeatedly the neighbour to the left or the right of
    what was taken (a seeded coin; forced at an end)."""
    if size <= 0:
        return []
    start = mix_seed(seed, 0) % size
    lo = hi = start
    out = [start]
    bits = 0
    for t in range(1, size):
        if t % 62 == 1:
            bits = mix_seed(seed, 1 + t // 62)
        right = bits & 1
        bits >>= 1
        if lo == 0 or (right and hi < size - 1):
            hi += 1
            out.append(hi)
        else:
            lo -= 1
            out.append(lo)
    return out


class FileOrder:
    """A seeded permutation of ``[0, sum(counts))`` keeping files and windows
    together (see the module docstring). ``windows(f)`` gives file ``f``'s window
    bounds: sample indices ``[0, ..., counts[f]]``, increasing. ``within`` is
    ``"expand"`` (every first part of a window is one run) or ``"permute"``."""

    def __init__(
        self, counts: Sequence[int], seed: int, windows: Callable[[int], Sequence[int]], within: str = "expand"
    ) -> None:
        if within not in ("expand", "permute"):
            raise OptionError(f"within={within!r} must be 'expand' or 'permute'")
        self.counts = list(counts)
        self.seed = seed
        self.windows = windows
        self.within = within
        files = Permutation(len(self.counts), mix_seed(seed, 1))
        self.order = files.table()
        self.offsets = prefix_sums(self.counts)
        self.starts = prefix_sums(self.counts, self.order)
        self._file: tuple[int, list[int], list[int], Sequence[int]] | None = None
        self._window: tuple[int, int, Callable[[int], int]] | None = None

    def __len__(self) -> int:
        return self.starts[-1]

    def _layout(self, f: int) -> tuple[list[int], list[int], Sequence[int]]:
        """File ``f``'s windows in visit order and where each starts in it."""
        if self._file is None or self._file[0] != f:
            bounds = self.windows(f)
            if (
                len(bounds) < 1
                or bounds[0] != 0
                or bounds[-1] != self.counts[f]
                or any(b > a for b, a in pairwise(bounds))
            ):
                raise SourceDataError(
                    f"file {f}'s windows {list(bounds)[:8]} do not cover its {self.counts[f]} samples"
                )
            count = max(0, len(bounds) - 1)
            permuted = Permutation(count, mix_seed(self.seed, 2, f))
            order = [permuted(k) for k in range(count)]
            visits = [0]
            for w in order:
                visits.append(visits[-1] + bounds[w + 1] - bounds[w])
            self._file = (f, order, visits, bounds)
        return self._file[1], self._file[2], self._file[3]

    def __call__(self, index: int) -> int:
        if not 0 <= index < self.starts[-1]:
            raise IndexError(f"index {index} is outside [0, {self.starts[-1]})")
        k = bisect.bisect_right(self.starts, index) - 1
        f = self.order[k]
        j = index - self.starts[k]
        order, visits, bounds = self._layout(f)
        at = bisect.bisect_right(visits, j) - 1
        w = order[at]
        size = bounds[w + 1] - bounds[w]
        if self._window is None or self._window[:2] != (f, w):
            seed = mix_seed(self.seed, 3, f, w)
            inner = Permutation(size, seed) if self.within == "permute" else expansion(size, seed).__getitem__
            self._window = (f, w, inner)
        return self.offsets[f] + bounds[w] + self._window[2](j - visits[at])
