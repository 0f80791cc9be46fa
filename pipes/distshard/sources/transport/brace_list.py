"""A brace pattern's expansion as a lazy, immutable sequence (issue 33).

``"s3://b/shard-{0000000..9999999}.tar"`` names 10^7 URLs; building them costs
seconds and gigabytes before the first sample. :func:`lazy_braceexpand` gives a
:class:`BraceList` instead: its length is the product of its groups' sizes and
its item ``k`` is decoded mixed-radix (the last group varies fastest, as
``itertools.product`` does in :func:`.urls.braceexpand`), so it holds only the
pattern's parts. It compares equal to the list it stands for, slices, iterates
and pickles as its parts.

Covered: literal parts and top-level groups that are integer ranges
(``{000..999}``, ``{0..10..2}``, descending) or a comma list of plain words
(``{train,val}``). Anything else (a backslash, a letter range, a nested group,
literal braces) is not: :func:`lazy_braceexpand` returns ``None`` and the
caller uses the eager :func:`.urls.braceexpand`.
"""

from __future__ import annotations

import re
from typing import Any, Iterator, Sequence, overload

__all__ = ["INT_RANGE", "BraceList", "IntRange", "lazy_braceexpand", "pattern_of"]

INT_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.-?(\d+))?$")
_TOKEN = re.compile(r"\{([^{}\\]*)\}|([^{}\\]+)")


class IntRange:
    """An integer range group: ``n`` numbers from ``lo`` by ``step``, printed ``%0*d``."""

    __slots__ = ("lo", "step", "n", "width")

    def __init__(self, first: str, last: str, step: str | None) -> None:
        padded = any(s.startswith(("0", "-0")) for s in (first, last) if s not in ("0", "-0"))
        self.width = max(len(first), len(last)) if padded else 0
        increment = (int(step) or 1) if step else 1
        lo, hi = int(first), int(last)
        numbers = range(lo, hi + 1, increment) if lo < hi else range(lo, hi - 1, -increment)
        self.lo, self.step, self.n = numbers.start, numbers.step, len(numbers)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, k: int) -> str:
        return "%0*d" % (self.width, self.lo + k * self.step)

    def key(self) -> tuple:
        return ("range", self.lo, self.step, self.n, self.width)


def _parts(pattern: str) -> list[Any] | None:
    """The pattern as literal strings and groups (``IntRange`` or a tuple of words), or
    ``None`` when it holds what the lazy form does not cover."""
    parts: list[Any] = []
    pos = 0
    for match in _TOKEN.finditer(pattern):
        if match.start() != pos:
            return None
        pos = match.end()
        body, literal = match.groups()
        if literal is not None:
            parts.append(literal)
            continue
        found = INT_RANGE.match(body)
        if found is not None:
            parts.append(IntRange(*found.groups()))
        elif "," in body:
            parts.append(tuple(body.split(",")))
        else:
            return None  # "{x}" stays literal in braceexpand, "{a..c}" is a letter range
    return parts if pos == len(pattern) else None


class BraceList(Sequence[str]):
    """The URLs of a brace pattern, computed an item at a time (see the module)."""

    __slots__ = ("pattern", "_parts", "_groups", "_n")

    def __init__(self, pattern: str) -> None:
        parts = _parts(pattern)
        if parts is None:
            raise ValueError(f"the pattern {pattern!r} is not one a BraceList covers (use braceexpand)")
        self.pattern, self._parts = pattern, parts
        self._groups = [p for p in parts if not isinstance(p, str)]
        n = 1
        for group in self._groups:
            n *= len(group)
        self._n = n

    def __reduce__(self) -> tuple:
        return (BraceList, (self.pattern,))

    def __len__(self) -> int:
        return self._n

    def _item(self, k: int) -> str:
        chosen = []
        for group in reversed(self._groups):  # the last group varies fastest
            k, digit = divmod(k, len(group))
            chosen.append(group[digit])
        out, groups = [], iter(reversed(chosen))
        for part in self._parts:
            out.append(part if isinstance(part, str) else next(groups))
        return "".join(out)

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self._item(k) for k in range(*index.indices(self._n))]
        k = index.__index__()
        if k < 0:
            k += self._n
        if not 0 <= k < self._n:
            raise IndexError(f"BraceList index {index} out of range for {self._n} items")
        return self._item(k)

    def __iter__(self) -> Iterator[str]:
        return (self._item(k) for k in range(self._n))

    def holds_empty(self) -> bool:
        """Whether some item is the empty string (no literal text, and every group a
        word list holding ``""``: ``"{,a}"``)."""
        return all(isinstance(p, tuple) and "" in p for p in self._parts)

    def head(self) -> str:
        """The literal text every item starts with (``""`` when the pattern starts with a group)."""
        return self._parts[0] if self._parts and isinstance(self._parts[0], str) else ""

    def tail(self) -> str:
        """The literal text every item ends with (``""`` when the pattern ends in a group)."""
        return self._parts[-1] if self._parts and isinstance(self._parts[-1], str) else ""

    def key(self) -> tuple:
        """What decides the expansion: equal keys, equal lists (compared in O(groups))."""
        return tuple(p if isinstance(p, str) else (p.key() if isinstance(p, IntRange) else p) for p in self._parts)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BraceList):
            if self.key() == other.key():
                return True
            return self._n == other._n and all(a == b for a, b in zip(self, other, strict=True))
        if isinstance(other, (list, tuple)):
            return len(other) == self._n and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, so unhashable as they are

    def __repr__(self) -> str:
        return f"BraceList({self.pattern!r}, n={self._n})"


def lazy_braceexpand(pattern: str) -> BraceList | None:
    """``pattern``'s expansion as a :class:`BraceList`, or ``None`` when the lazy
    form does not cover it (the caller then uses :func:`.urls.braceexpand`)."""
    try:
        return BraceList(pattern)
    except ValueError:  # (the pattern is parsed once: BraceList refuses what it does not cover)
        return None


_NUMBERED = re.compile(r"^((?:[^{}\\]*[^{}\\0-9])?)([0-9]+)([^{}\\0-9]*)$")  # (the last run of digits)


def pattern_of(urls: Sequence[str]) -> str | None:
    """The one-range brace pattern whose expansion is exactly ``urls``
    (``["s-00.tar", "s-01.tar", "s-02.tar"]`` -> ``"s-{00..02}.tar"``), or ``None``.
    What ``python -m distshard index`` records in a manifest's head, so that a source
    given that pattern is known to name the index's files without listing them."""
    if len(urls) < 2:
        return None
    first, last = _NUMBERED.match(urls[0]), _NUMBERED.match(urls[-1])
    if first is None or last is None or first.group(1, 3) != last.group(1, 3):
        return None
    before, low, after = first.groups()
    pattern = f"{before}{{{low}..{last.group(2)}}}{after}"
    lazy = lazy_braceexpand(pattern)
    if lazy is None or len(lazy) != len(urls) or any(a != b for a, b in zip(lazy, urls, strict=True)):
        return None
    return pattern
