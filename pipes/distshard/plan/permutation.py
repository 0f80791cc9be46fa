"""Seeded permutations computed per index in O(1) memory: of ``[0, n)``, and of units
kept together (``shuffle=True``'s orders)."""

from __future__ import annotations

from array import array
from typing import Any, Sequence

from ..digests import mix_seed
from ..errors import OptionError

_MASK64 = 0xFFFFFFFFFFFFFFFF


def _numpy() -> Any:
    """numpy when it is installed (an optional dependency), else ``None``."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def prefix_sums(values: Sequence[int], order: Sequence[int] | None = None) -> Sequence[int]:
    """``[0, v0, v0 + v1, ...]`` of ``values`` (taken in ``order`` when given):
    ``len + 1`` items, one numpy pass when numpy is there (a pass in Python else,
    and for sums past 64 bits)."""
    np = _numpy()
    if np is not None and len(values) > 64:
        try:
            taken = np.asarray(values, dtype=np.int64)
            if order is not None:
                taken = taken[np.asarray(order, dtype=np.int64)]
            if taken.min() >= 0 and int(taken.max()) * len(taken) < 1 << 62:
                return array("q", b"\0" * 8 + np.cumsum(taken, dtype=np.int64).tobytes())
        except OverflowError:
            pass
    out = [0]
    for v in values if order is None else (values[k] for k in order):
        out.append(out[-1] + v)
    return out


# -- a permutation of [0, n) in O(1) memory ---------------------------------------------


class Permutation:
    """A seeded pseudo-random bijection of ``[0, n)``, computed per index.

    A balanced Feistel network on the smallest even number of bits that covers
    ``n`` (so the domain is less than ``4 n``), made a bijection of ``[0, n)`` by
    cycle walking: an index whose image falls outside is mapped again until it
    lands inside (fewer than 4 steps on average). Memory is O(1) whatever ``n``.
    """

    ROUNDS = 4

    def __init__(self, n: int, seed: int) -> None:
        if n < 0:
            raise OptionError(f"n={n} must be non-negative")
        self.n = n
        bits = max(2, (max(n - 1, 1)).bit_length())
        bits += bits % 2
        self.half = bits // 2
        self.mask = (1 << self.half) - 1
        self.keys = [mix_seed(seed, r) for r in range(self.ROUNDS)]

    def _round(self, value: int, key: int) -> int:
        z = (value * 0x9E3779B97F4A7C15 + key) & 0xFFFFFFFFFFFFFFFF
        z ^= z >> 29
        z = (z * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        return (z ^ (z >> 32)) & self.mask

    def _encrypt(self, value: int) -> int:
        left, right = value >> self.half, value & self.mask
        for key in self.keys:
            left, right = right, left ^ self._round(right, key)
        return (left << self.half) | right

    def __call__(self, index: int) -> int:
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} is outside [0, {self.n})")
        value = self._encrypt(index)
        while value >= self.n:
            value = self._encrypt(value)
        return value

    def __len__(self) -> int:
        return self.n

    def table(self) -> Sequence[int]:
        """Every image in index order, ``[self(k) for k in range(n)]``: computed for
        all indices at once with numpy when it is installed (the same arithmetic,
        modulo 2^64), one call per index else."""
        np = _numpy()
        if np is None or self.n < 64:
            return [self(k) for k in range(self.n)]
        half, mask = np.uint64(self.half), np.uint64(self.mask)
        keys = [np.uint64(key & _MASK64) for key in self.keys]
        golden, mixer = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9)
        shift29, shift32 = np.uint64(29), np.uint64(32)

        def encrypt(value: Any) -> Any:
            left, right = value >> half, value & mask
            for key in keys:
                z = right * golden + key  # (uint64: wraps modulo 2^64, as _round masks)
                z ^= z >> shift29
                z = z * mixer
                left, right = right, left ^ ((z ^ (z >> shift32)) & mask)
            return (left << half) | right

        with np.errstate(over="ignore"):
            out = encrypt(np.arange(self.n, dtype=np.uint64))
            outside = np.nonzero(out >= np.uint64(self.n))[0]
            while len(outside):  # cycle walking, for the indices still outside
                out[outside] = encrypt(out[outside])
                outside = outside[out[outside] >= np.uint64(self.n)]
        return array("q", out.astype(np.int64).tobytes())


class UnitOrder:
    """A seeded permutation of ``[0, sum(sizes))`` that keeps units together: the
    units in a permuted order, each unit's elements in a permuted order of their
    own. A run of consecutive visit indices touches one or two units, so a slot
    reading a block of them expands each unit about once (a global permutation
    would touch a different unit for nearly every element). Memory: O(units).
    """

    def __init__(self, sizes: Sequence[int], seed: int) -> None:
        import bisect

        self._bisect = bisect.bisect_right
        units = Permutation(len(sizes), mix_seed(seed, 1))
        self.order = units.table()
        self.sizes = list(sizes)
        self.offsets = prefix_sums(self.sizes)
        self.starts = prefix_sums(self.sizes, self.order)
        self.seed = seed
        self._inner: tuple[int, Permutation] | None = None

    def __len__(self) -> int:
        return self.starts[-1]

    def __call__(self, index: int) -> int:
        if not 0 <= index < self.starts[-1]:
            raise IndexError(f"index {index} is outside [0, {self.starts[-1]})")
        k = self._bisect(self.starts, index) - 1
        unit = self.order[k]
        if self._inner is None or self._inner[0] != unit:
            self._inner = (unit, Permutation(self.sizes[unit], mix_seed(self.seed, 2, unit)))
        return self.offsets[unit] + self._inner[1](index - self.starts[k])
