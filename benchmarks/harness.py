"""What every benchmark script shares, once; a script keeps its contenders (the
pipelines it compares), its targets and its own analysis. A script and the tests
import this module alone (``import harness``; ``from harness import Col``): it
re-exports what its sibling modules hold, one concern each (they never import this
module: imports go one way).

``harness_groups``: ``Job``, ``run_job``, ``GroupRun``, a job on a fresh gloo group
    of ranks, and ``reporting``, the last stage through which every DataLoader
    worker reports its counts, CPU, reads and peak RSS to its rank.
``harness_meters``: ``count``, ``share_counts``, ``Meter``: per-process counters,
    and a rank's CPU (its own and its joined workers'), wall, peak RSS, bytes read.
``harness_checks``: ``exactly_once``, ``epochs_check``: the delivered multiset against
    the expected one, with what ``even`` allows, or over several epochs of ``drop`` /
    ``carry``; ``error_line``, ``left_out``: what a row says of its failed rounds; ``unmeasured``,
    ``failed``: a table's cell for a row that was not run or has no figures.
``harness_children``: ``peers_python``, ``setup_peers``, ``launch``, ``child``: the
    benchmark-only venv ``benchmarks/.venv`` and running a script's function in a
    fresh process tree with either venv's interpreter, its result back as JSON.
``harness_session``: ``Session``: the header line and the ``--json`` dump's environment record.
``harness_tables``: ``table``, ``Col``: the one Markdown table printer (text left,
    numbers right, ``—`` for nothing, ``✓`` / ``✗``, counts with thousands separators).

Here, what a script's own loop uses: ``burn``, ``Decode``, ``calibrate``, the counted
busy-loop decode, calibrated once; ``rounds`` and ``median``, interleaved rounds and
their medians; ``choose`` (``--only``), ``gc_paused``, ``read_plan``, ``IterOnly``.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import statistics
import time
import warnings
from typing import Any, Callable, Iterable, Iterator, Sequence

from harness_checks import (
    Once,
    epochs_check,
    error_line,
    exactly_once,
    failed,
    left_out,
    print_left_out,
    slot_counts,
    unmeasured,
)
from harness_children import (
    HERE,
    NO_PEERS,
    PEERS_VENV,
    REQUIREMENTS,
    ROOT,
    add_child_args,
    child,
    child_env,
    kill_tree,
    launch,
    peers_python,
    setup_peers,
)
from harness_groups import GroupRun, Job, ReportDataset, ReportPipe, SelfReporting, reporting, run_job, worker_init
from harness_meters import Meter, count, counts, rchar, share_counts
from harness_session import Session, command_line, loadavg, versions
from harness_tables import Col, ratio, seconds, table

__all__ = [
    # harness_groups
    "GroupRun", "Job", "ReportDataset", "ReportPipe", "SelfReporting", "reporting", "run_job", "worker_init",
    # harness_meters
    "Meter", "count", "counts", "rchar", "share_counts",
    # harness_checks
    "Once", "epochs_check", "error_line", "exactly_once", "failed", "left_out", "print_left_out", "slot_counts",
    "unmeasured",
    # harness_children
    "HERE", "NO_PEERS", "PEERS_VENV", "REQUIREMENTS", "ROOT", "add_child_args", "child", "child_env", "kill_tree",
    "launch", "peers_python", "setup_peers",
    # harness_session
    "Session", "command_line", "loadavg", "versions",
    # harness_tables
    "Col", "ratio", "seconds", "table",
    # here
    "Decode", "IterOnly", "burn", "calibrate", "choose", "gc_paused", "median", "read_plan", "rounds",
]

warnings.filterwarnings("ignore", message=".*torchdata.*", category=UserWarning)
warnings.filterwarnings("ignore", message="This DataLoader will create")


class IterOnly:
    """An iterable with no ``__len__`` / ``__getitem__``: forces streaming."""

    def __init__(self, iterable: Iterable[Any]) -> None:
        self.iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        return iter(self.iterable)


# -- the calibrated decode ----------------------------------------------------------------------
def burn(iters: int, seed: int | bytes) -> bytes:
    """Deterministic CPU work: ``iters`` chained BLAKE2b digests."""
    digest = seed if isinstance(seed, bytes) else seed.to_bytes(8, "little", signed=True)
    for _ in range(iters):
        digest = hashlib.blake2b(digest, digest_size=16).digest()
    return digest


class Decode:
    """A decode that burns ``iters`` digests of CPU and counts its calls (``decodes``);
    a script's subclass turns its element into a seed and returns what it decodes to."""

    def __init__(self, iters: int) -> None:
        self.iters = iters

    def work(self, seed: int | bytes) -> None:
        count("decodes")
        if self.iters:
            burn(self.iters, seed)


def calibrate(target_s: float, make: Callable[[int], Callable[[int], Any]] | None = None) -> tuple[int, float]:
    """``(iters, seconds)``: how many chained digests burn ``target_s`` of CPU, and
    what one call of ``make(iters)`` (the script's decode; default ``burn``) then
    costs: the median of 5 rounds of ~0.15 s."""
    probe, calls, start = 256, 0, time.process_time()
    while time.process_time() - start < 0.15:
        burn(probe, calls)
        calls += 1
    iters = max(1, round(target_s / ((time.process_time() - start) / (calls * probe))))
    decode = make(iters) if make is not None else (lambda i: burn(iters, i))
    per_round = max(20, round(0.15 / target_s))
    samples = []
    for round_index in range(5):
        start = time.process_time()
        for i in range(per_round):
            decode(round_index * per_round + i)
        samples.append((time.process_time() - start) / per_round)
    return iters, statistics.median(samples)


# -- timing in one process ---------------------------------------------------------------------
@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The garbage collector off inside the block (back on after, if it was)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def rounds(items: Sequence[Any], n: int, reverse_odd: bool = False) -> Iterator[tuple[int, list[Any]]]:
    """``(round, order)``: every item once a round, the order rotated by one each round
    (and reversed every other round with ``reverse_odd``), so that machine noise
    spreads over all of them."""
    items = list(items)
    for r in range(n):
        shift = r % len(items)
        order = items[shift:] + items[:shift]
        yield r, order[::-1] if reverse_odd and r % 2 else order


def choose(only: str | None, known: dict[str, Any], parser: Any) -> list[Any]:
    """The items ``--only a,b`` names (all without it); an unknown name is a usage error."""
    if not only:
        return list(known.values())
    names = [name for name in only.split(",") if name]
    unknown = [name for name in names if name not in known]
    if unknown:
        parser.error(f"--only: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    return [known[name] for name in names]


def read_plan(pipe: Any) -> Any:
    """The read plan of the first ``dist_shard`` in ``pipe`` (``None`` without one):
    ``.sequence`` is set when it indexes its positions, ``.maps`` when maps moved below it."""
    from distshard.datapipe import shards_in

    shards = shards_in(pipe)
    return shards[0].read_plan() if shards else None


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")
