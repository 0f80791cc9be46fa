"""What a format knows of one file: :class:`FileIndex` (its sample count, the arrays and strings
that name each sample's byte spans) and the shuffle windows over those spans (:func:`byte_windows`).

Format-neutral and without I/O: the formats build a ``FileIndex``, the index cache
(:mod:`distshard.sources.formats.index_cache`) stores and exchanges it.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["FileIndex", "byte_windows"]


@dataclass
class FileIndex:
    """What is known about one file: ``count`` samples and, unless ``complete``
    is false (a header-only load), the format's ``arrays`` and ``strings``."""

    format: str
    key: str
    size: int
    stamp: str
    count: int
    arrays: dict[str, array] = field(default_factory=dict)
    strings: dict[str, list[str]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    complete: bool = True
    derived: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)  # per process, never stored

    def weight(self) -> int:
        """A memory estimate, in array items, for the per-process LRU."""
        return 1 + sum(len(a) for a in self.arrays.values()) + 4 * sum(len(s) for s in self.strings.values())


def byte_windows(count: int, extent: Callable[[int], tuple[int, int]], window: int) -> array:
    """Shuffle windows over ``count`` samples whose byte extents ``extent(i)``
    (``(start, stop)``, ``(-1, -1)`` for none) increase: the sample index where
    each window starts, then ``count``. A window grows while its samples span at
    most ``window`` bytes (one larger sample is a window of its own)."""
    bounds = array("q", [0])
    begin = None
    for i in range(count):
        start, stop = extent(i)
        if start < 0:
            continue
        if begin is None:
            begin = start
        elif stop - begin > window:
            bounds.append(i)
            begin = start
    if count:
        bounds.append(count)
    return bounds
