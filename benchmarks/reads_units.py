"""bench_reads' unit mode: the sizes of its units (equal or deterministic unequal ones)
and the ``expand`` functions ``dist_shard(expand=...)`` gets, a lazy sequence that
decodes only what is read or a generator that decodes every element it yields."""

from __future__ import annotations

from typing import Callable, Iterator


def unit_sizes(n: int, units: int, uneven: bool) -> list[int]:
    """Element counts of ``units`` consecutive units covering ``0 .. n-1``: equal
    (±1), or deterministic unequal ones (weights 2..8) for ``uneven``."""
    weights = [2 + (u * 5) % 7 for u in range(units)] if uneven else [1] * units
    total = sum(weights)
    sizes = [n * w // total for w in weights]
    order = sorted(range(units), key=lambda u: (-(n * weights[u] % total), u))
    for u in order[: n - sum(sizes)]:
        sizes[u] += 1
    return sizes


def unit_bounds(sizes: list[int]) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


class LazyUnit:
    """A unit's elements as a sequence: ``unit[k]`` decodes element ``start + k``."""

    def __init__(self, start: int, stop: int, decode: Callable[[int], int]) -> None:
        self.start, self.stop, self.decode = start, stop, decode

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, k: int) -> int:
        if not 0 <= k < self.stop - self.start:
            raise IndexError(k)
        return self.decode(self.start + k)


class ExpandSequence:
    """``expand(unit) -> LazyUnit``: random access, decodes only what is read."""

    def __init__(self, bounds: list[tuple[int, int]], decode: Callable[[int], int]) -> None:
        self.bounds, self.decode = bounds, decode

    def __call__(self, unit: int) -> LazyUnit:
        return LazyUnit(*self.bounds[unit], self.decode)


class ExpandIterator:
    """``expand(unit) -> generator`` that decodes every element it yields (a reader
    that must parse a record to get to the next one)."""

    def __init__(self, bounds: list[tuple[int, int]], decode: Callable[[int], int]) -> None:
        self.bounds, self.decode = bounds, decode

    def __call__(self, unit: int) -> Iterator[int]:
        start, stop = self.bounds[unit]
        decode = self.decode
        return (decode(i) for i in range(start, stop))
