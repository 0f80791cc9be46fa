"""Exactly-once checks and what a row says about its failed rounds (:mod:`harness`
re-exports them).

``exactly_once``, ``Once``, ``epochs_check``, ``slot_counts``: the delivered multiset
    against the expected one, with what ``even`` allows, or over several epochs of
    ``drop`` / ``carry``.
``error_line``, ``left_out``, ``print_left_out``: a traceback's error line, and the
    rounds a row's medians leave out (never hidden).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence


# -- exactly-once ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Once:
    """Delivered against expected: how many extra and how many missing, and how
    many of each ``even`` allows."""

    duplicates: int
    missing: int
    allowed_duplicates: int = 0
    allowed_missing: int = 0

    @property
    def ok(self) -> bool:
        return self.duplicates <= self.allowed_duplicates and self.missing <= self.allowed_missing

    def cell(self, error: str | None = None) -> str:
        """``✓`` (with what ``even`` dropped or repeated), or ``✗`` with the counts and the error."""
        if self.ok and not error:
            allowed = [f"drop {self.missing}"] * bool(self.missing) + [f"pad {self.duplicates}"] * bool(self.duplicates)
            return "✓" + (f" ({', '.join(allowed)})" if allowed else "")
        parts = [f"{self.duplicates} dup, {self.missing} missing"] if self.duplicates or self.missing else []
        if error:
            parts.append(("error: " + error_line(error))[:100])
        return "✗ " + "; ".join(parts)


def exactly_once(got: Iterable[Any], expected: Iterable[Any], *, even: str | None = None, slots: int = 1) -> Once:
    """The multiset ``got`` against ``expected`` (each element once), with what
    ``even`` allows over ``slots`` slots: ``"drop"`` up to ``N mod slots`` missing,
    ``"pad"`` up to ``slots - N mod slots`` repeated (none when ``slots`` divides N)."""
    got = got if isinstance(got, Counter) else Counter(got)
    expected = expected if isinstance(expected, Counter) else Counter(expected)
    tail = sum(expected.values()) % slots
    return Once(sum((got - expected).values()), sum((expected - got).values()),
                allowed_duplicates=(slots - tail) % slots if even == "pad" else 0,
                allowed_missing=tail if even == "drop" else 0)


def epochs_check(got: Counter, keys: Sequence[Any], workers: list[dict[str, Any]], *, epochs: int, even: str,
                 unit: int, slots: int) -> dict[str, Any]:
    """Several epochs of ``keys`` (each epoch's stream in this order) with ``even``
    ``"drop"`` (every epoch leaves out its last ``N mod unit``) or ``"carry"``
    (epoch ``e`` takes ``[U floor(eN/U), U floor((e+1)N/U))`` of the concatenated
    streams, ``U = unit``): the per-slot counts of every epoch (from the workers'
    reports) and the delivered multiset ``got`` against what ``even`` promises."""
    n = len(keys)
    if even == "carry":
        wanted = Counter(keys[g % n] for g in range(unit * (epochs * n // unit)))
    else:
        wanted = Counter(k for _ in range(epochs) for k in keys[:n // unit * unit])
    per_epoch: dict[int, list[int]] = {}
    for record in workers:
        per_epoch.setdefault(record["epoch"], []).append(record["yielded"])
    every = Counter({k: epochs for k in keys})
    delivered = sum(got.values())
    tail = epochs * n % unit if even == "carry" else 0  # the last epoch's tail opens the next epoch
    return {"per_epoch_slots": {e: sorted(c) for e, c in sorted(per_epoch.items())},
            "equal_slots": len(per_epoch) == epochs and all(len(c) == slots and len(set(c)) == 1
                                                            for c in per_epoch.values()),
            "delivered": delivered, "exact": got == wanted,
            "left_for_next_epoch": epochs * n - delivered if even == "carry" else 0,
            "dropped": sum((every - got).values()) - tail, "padded": sum((got - every).values())}


def slot_counts(per_epoch_slots: dict[Any, list[int]]) -> str:
    """``250 / 250 / 251``: every epoch's per-slot count (``min–max`` if they differ)."""
    return " / ".join(str(c[0]) if len(set(c)) == 1 else f"{min(c)}–{max(c)}" for c in per_epoch_slots.values())


def error_line(text: str) -> str:
    """The ``SomeError: message`` line of a traceback (torch appends notes after it)."""
    lines = text.strip().splitlines()
    for line in reversed(lines):
        if re.match(r"^[\w.]+(Error|Exception|Interrupt|Exit)\b", line):
            return line
    return lines[-1] if lines else text


def failed(row: dict[str, Any], none: str = "no run", width: int = 120) -> str:
    """A table's cell for a row with no figures: ``failed:`` and its first error's
    line, at most ``width`` characters (``none`` if it has no error)."""
    return "failed: " + error_line((row.get("errors") or [none])[0])[:width]


def unmeasured(row: dict[str, Any], measured: str, none: str = "no run", width: int = 120) -> str | None:
    """What a table says of a row instead of its figures: ``not run:`` and why
    (skipped), :func:`failed` (no ``measured`` figure), else ``None``."""
    if "skipped" in row:
        return f"not run: {row['skipped']}"
    return failed(row, none, width) if measured not in row else None


def left_out(runs: Sequence[dict[str, Any]], good: Sequence[dict[str, Any]]) -> str | None:
    """What a row's medians leave out: ``"1 of 3 rounds failed: TimeoutError: ..."``
    when some rounds of a row failed and others did not (a row whose rounds all
    failed says so in its table cell), else ``None``. Print it under the table: a
    failed round is never hidden."""
    failed = [r for r in runs if r not in good]
    if not failed or not good:
        return None
    first = (failed[0].get("errors") or ["no complete run"])[0]
    return f"{len(failed)} of {len(runs)} rounds failed and are left out of its medians: {error_line(first)[:200]}"


def print_left_out(rows: Iterable[dict[str, Any]], label: Callable[[dict[str, Any]], str]) -> None:
    """One line per row whose medians left failed rounds out (see :func:`left_out`)."""
    for row in rows:
        if row.get("left_out"):
            print(f"\n{label(row)}: {row['left_out']}")
