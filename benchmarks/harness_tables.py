"""The one table printer (:mod:`harness` re-exports it): ``table`` and ``Col``, a
Markdown table (text left, numbers right, ``—`` for nothing, ``✓`` / ``✗``, counts
with thousands separators), and ``ratio``, ``seconds``, how a ratio and a duration read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence


@dataclass(frozen=True)
class Col:
    """A column: its title and how its numbers read. ``digits`` (floats: that many
    decimals; ints always with thousands separators), ``suffix`` (``×``, `` ms``),
    ``signed`` (a ``+`` on positive numbers), or ``fmt`` (a function of the value).
    Numeric columns (``digits`` or ``fmt``) are right-aligned unless ``right`` says."""

    title: str
    digits: int | None = None
    suffix: str = ""
    signed: bool = False
    fmt: Callable[[Any], str] | None = None
    right: bool | None = None

    @property
    def numeric(self) -> bool:
        return self.right if self.right is not None else (self.digits is not None or self.fmt is not None)

    def cell(self, value: Any) -> str:
        if value is None:
            return "—"
        if isinstance(value, str):
            return value
        if isinstance(value, bool):
            return "✓" if value else "✗"
        if self.fmt is not None:
            return self.fmt(value)
        sign = "+" if self.signed else ""
        if isinstance(value, int):
            return f"{value:{sign},}{self.suffix}"
        return f"{value:{sign}.{2 if self.digits is None else self.digits}f}{self.suffix}"


def table(columns: Sequence[Col | str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table. A row's cells: ``None`` → ``—``, ``True`` / ``False`` → ``✓`` /
    ``✗``, numbers by their column, strings as they are; a row shorter than the
    columns (a failed or skipped row: its label and what happened) is padded with
    empty cells."""
    cols = [c if isinstance(c, Col) else Col(c) for c in columns]
    lines = ["| " + " | ".join(c.title for c in cols) + " |",
             "|" + "|".join("---:" if c.numeric else "---" for c in cols) + "|"]
    for row in rows:
        cells = [col.cell(value) for col, value in zip(cols, row, strict=False)]
        lines.append("| " + " | ".join(cells + [""] * (len(cols) - len(cells))) + " |")
    return "\n".join(lines)


def ratio(value: float | None) -> str:
    """A ratio whose size varies over orders of magnitude: ``0.98×``, ``64.9×``, ``9,029×``."""
    if value is None:
        return "—"
    if value >= 100:
        return f"{value:,.0f}×"
    return f"{value:.1f}×" if value >= 10 else f"{value:.2f}×"


def seconds(value: float) -> str:
    """A duration in the unit that reads best: ``113 µs``, ``9.41 ms``, ``2.89 s``."""
    if value >= 1:
        return f"{value:.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.3g} ms"
    return f"{value * 1e6:.3g} µs"
