"""What a ``distshard.verify`` run found: :class:`VerifyReport` (the counts per rank and
slot, duplicates and missing elements by name, the verdict and its ``summary()``) and how
the processes' results become one: their errors, what every slot received, and the
comparison with the unsharded reference run less what the ``even`` checked allows."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .gloo_runs import who_label
from .plan import Even, dropped_count, padded_count


def _labels(names: dict[str, str]) -> dict[str, str]:
    """Display names, with a piece of the key where two distinct elements read alike."""
    uses = Counter(names.values())
    return {k: name if uses[name] == 1 else f"{name} #{k[:8]}" for k, name in names.items()}


@dataclass
class VerifyReport:
    """What ``verify`` saw. ``ok`` is the verdict; ``summary()`` reads well.

    ``violated`` says the data shows an exactly-once violation; ``error`` (with one
    line per failed process in ``reasons``) says the run could not complete, so the
    verdict is not ``ok`` without being a violation.
    """

    world_size: int
    num_workers: int
    even: Even
    epochs: int
    expected: int = 0  # elements of one epoch of the unsharded stream
    received: int = 0  # elements all slots yielded, all epochs
    per_rank: list[int] = field(default_factory=list)
    per_slot: list[int] = field(default_factory=list)
    duplicates: dict[str, int] = field(default_factory=dict)  # element's name -> extra copies
    missing: dict[str, int] = field(default_factory=dict)  # element's name -> copies missing
    duplicate_count: int = 0
    missing_count: int = 0  # under even="carry": beyond the carried tail
    allowed_duplicates: int = 0  # even="pad" repeats these many per epoch
    allowed_missing: int = 0  # even="drop" drops these many per epoch
    carried: int = 0  # even="carry": the last epoch's tail, which the next epoch yields first
    carried_elements: dict[str, int] = field(default_factory=dict)  # the tail's names, when nothing else is missing
    carried_received: int = 0  # even="carry": elements of the tail this run yielded instead of leaving them
    seconds: float = 0.0
    error: str | None = None  # tracebacks and reasons, one block per failed process
    reasons: list[str] = field(default_factory=list)  # one line per failed process
    reads: str = ""  # how the pipeline reads its source, from its dist_shard
    pipeline_even: Even = None  # the even= of the pipeline's own dist_shard
    multiple_of: int = 1  # the pipeline's multiple_of, when the even checked is its "drop"
    seen: list[tuple[int, int, str]] = field(default_factory=list, repr=False)

    @property
    def num_slots(self) -> int:
        return self.world_size * max(1, self.num_workers)

    @property
    def ranks_equal(self) -> bool:
        return len(set(self.per_rank)) <= 1

    @property
    def slots_equal(self) -> bool:
        return len(set(self.per_slot)) <= 1

    @property
    def violated(self) -> bool:
        """The data shows an exactly-once violation (duplicates or missing beyond
        what ``even`` allows, or unequal slots under ``even``), error or not."""
        if self.duplicate_count != self.allowed_duplicates * self.epochs:
            return True
        if self.error is None and (self.missing_count != self.allowed_missing * self.epochs or self.carried_received):
            return True
        return self.even is not None and not self.slots_equal and self.error is None

    @property
    def violations(self) -> list[str]:
        """Why ``violated`` is true, one line each (empty when it is not)."""
        out = []
        allowed = self.allowed_duplicates * self.epochs
        if self.duplicate_count != allowed:
            out.append(f"{self.duplicate_count} duplicates, where even={self.even!r} allows exactly {allowed}")
        allowed = self.allowed_missing * self.epochs
        if self.error is None and self.missing_count != allowed:
            beyond = f" beyond the carried tail of {self.carried}" if self.even == "carry" else ""
            out.append(
                f"{self.missing_count} missing{beyond}, where even={self.even!r} over {self.num_slots} slots "
                f"leaves out exactly {allowed}"
            )
        if self.error is None and self.carried_received:
            out.append(
                f"{self.carried_received} more received than the epochs' carry windows hold: even='carry' over "
                f"{self.num_slots} slots leaves the last epoch's tail of {self.carried} to open the next epoch"
            )
        if self.even is not None and not self.slots_equal and self.error is None:
            own = (
                ""
                if self.pipeline_even == self.even
                else f" (the pipeline's own dist_shard has even={self.pipeline_even!r})"
            )
            out.append(
                f"per-slot counts differ ({_counts(self.per_slot)}), where even={self.even!r} requires "
                f"every slot to yield the same{own}"
            )
        return out

    @property
    def ok(self) -> bool:
        """Exactly-once held: nothing duplicated or missing beyond what ``even``
        documents, and with ``even`` set, every slot yielded the same count."""
        return self.error is None and not self.violated

    def summary(self) -> str:
        lines = [
            f"world_size={self.world_size} num_workers={self.num_workers} even={self.even!r} "
            f"epochs={self.epochs}: {self.received} received, {self.expected} per epoch expected "
            f"({self.seconds:.1f}s)",
            f"  per rank: {self.per_rank}",
            f"  per slot: {self.per_slot}",
            f"  duplicates: {self.duplicate_count} (allowed by even: {self.allowed_duplicates * self.epochs})"
            + (f" e.g. {_examples(self.duplicates)}" if self.duplicates else ""),
            f"  missing: {self.missing_count} (allowed by even: {self.allowed_missing * self.epochs})"
            + (f" e.g. {_examples(self.missing)}" if self.missing else "")
            + (" (the carried tail is among these)" if self.missing and self.even == "carry" else ""),
        ]
        if self.even == "carry":
            lines.append(
                f"  carried: {self.carried} (the last epoch's tail, which opens the next epoch)"
                + (f" e.g. {_examples(self.carried_elements)}" if self.carried_elements else "")
            )
        lines += [f"  violation: {why}" for why in self.violations]
        lines += [f"  error: {reason}" for reason in self.reasons[:4]]
        if len(self.reasons) > 4:
            lines.append(f"  error: ... and {len(self.reasons) - 4} more")
        lines.append("  verdict: " + ("EXACTLY-ONCE" if self.ok else "VIOLATED" if self.violated else "COULD NOT RUN"))
        return "\n".join(lines)


def split_carried(report: VerifyReport) -> None:
    """Under ``even="carry"`` what the run did not yield is the last epoch's tail, which
    is not missing (it opens the next epoch), and what is missing beyond it. The tail's
    names are known when nothing else is missing; else the missing ones list it too."""
    not_received = report.missing_count
    report.missing_count = max(0, not_received - report.carried)
    report.carried_received = max(0, report.carried - not_received)
    if report.missing_count == 0:
        report.carried_elements, report.missing = report.missing, {}


def _counts(counts: list[int], limit: int = 16) -> str:
    return ", ".join(map(str, counts[:limit])) + (", ..." if len(counts) > limit else "")


def _examples(counts: dict[str, int], limit: int = 3) -> str:
    return ", ".join(f"{k} x{v}" for k, v in list(counts.items())[:limit])


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no message)"


def fill_report(report: VerifyReport, got: dict[Any, tuple[Any, str | None]], auto: bool) -> None:
    """The processes' results (``{rank or "reference": (value, error)}``) into ``report``: their
    errors, what every slot received and, when the reference run sent its stream, the verdict
    (``auto``: the ``even`` checked is the pipeline's own)."""
    report_errors(report, got)
    received = count_received(report, got)
    reference, _ = got["reference"]
    if reference is not None:  # without the unsharded stream there is nothing to compare with
        compare_with_reference(report, reference, received, auto)


def report_errors(report: VerifyReport, got: dict[Any, tuple[Any, str | None]]) -> None:
    """Whether the run could complete: every process's error, labelled, into ``report``."""
    blocks = []
    for who in ["reference", *range(report.world_size)]:
        value, error = got[who]
        if who != "reference" and value is not None:
            error = error or value[0]
        if error:
            label = "" if error.startswith(who_label(who)) else f"{who_label(who)}: "  # tracebacks get a label
            blocks.append(label + error)
            report.reasons.append(label + _last_line(error))
    report.error = "\n".join(blocks) or None


def count_received(report: VerifyReport, got: dict[Any, tuple[Any, str | None]]) -> list[Counter]:
    """What every rank and slot received (into ``report``), and the keys received in each epoch."""
    report.per_rank = [0] * report.world_size
    report.per_slot = [0] * report.num_slots
    received: list[Counter] = [Counter() for _ in range(report.epochs)]
    for rank in range(report.world_size):
        value, _ = got[rank]
        seen = value[1] if value is not None else []
        report.per_rank[rank] = len(seen)
        for epoch, slot, element_key in seen:
            if 0 <= slot < report.num_slots:
                report.per_slot[slot] += 1
            received[epoch][element_key] += 1
        report.seen.extend(seen)
    report.received = sum(report.per_rank)
    return received


def compare_with_reference(report: VerifyReport, reference: Any, received: list[Counter], auto: bool) -> None:
    """The verdict: what was received against the unsharded stream, less what the
    guarantee checked allows to be missing or repeated (``auto``: the pipeline's own)."""
    references, (report.pipeline_even, multiple), names, report.reads = reference
    if auto:
        report.even = report.pipeline_even
    labels = _labels(names)
    per_epoch = sum(references[0].values())
    report.expected = per_epoch
    report.multiple_of = multiple if report.even == report.pipeline_even == "drop" else 1
    report.allowed_missing = dropped_count(report.num_slots, per_epoch, report.even, report.multiple_of)
    report.allowed_duplicates = padded_count(report.num_slots, per_epoch, report.even)
    pairs = list(zip(received, references, strict=False))
    if report.even == "carry":  # the epochs are one stream: compare everything, less the last tail
        unit, total = report.num_slots * multiple, per_epoch * report.epochs
        report.allowed_missing, report.carried = 0, total - unit * (total // unit)
        pairs = [(sum(received, Counter()), sum(references, Counter()))]
    for got_epoch, want in pairs:
        for counts, delta in ((report.duplicates, got_epoch - want), (report.missing, want - got_epoch)):
            for element_key, n in delta.items():
                name = labels.get(element_key, f"<not in the reference run #{element_key[:8]}>")
                counts[name] = counts.get(name, 0) + n
    report.duplicate_count = sum(report.duplicates.values())
    report.missing_count = sum(report.missing.values())
    if report.even == "carry":
        split_carried(report)
