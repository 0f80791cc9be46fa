"""Per-element overhead of ``.dist_shard()`` against torch's ``sharding_filter`` and
the classic per-value modulo recipe, on the same trivial pipeline, in one run.

What is measured
----------------
Single-process iteration only: no DataLoader, no ``torch.distributed``, no workers.
The source is ``IterableWrapper(range(N), deepcopy=False)``. Every variant
simulates being slot ``s = S // 2`` of ``S`` slots, for each ``S`` in ``--slots``
(default 1, 8, 64), and the whole iterator is consumed with
``collections.deque(iter(pipe), maxlen=0)``. The variants:

plain source
    the unsharded source alone, the reference: a streaming shard still reads
    all N elements. Measured once per round, independent of ``S``.
``sharding_filter``
    ``IterableWrapper(...).sharding_filter()`` after
    ``torch.utils.data.graph_settings.apply_sharding(pipe, S, s)``.
``classic``
    ``distshard.baselines.ClassicModuloIterDataPipe`` iterated inside
    ``distshard.context.forced_distributed(s, S)``.
``dist_shard``
    ``.dist_shard(rank=s, world_size=S, even=...)`` for ``even`` in ``None``,
    ``"drop"``, ``"pad"`` (explicit rank and world size; without workers the
    slot is the rank), twice:

    * source ``range``: the pipeline above. When ``dist_shard`` sees an
      ``IterableWrapper`` over something indexable (and only ``.map()`` in
      between) it may index its own positions instead of walking the stream;
      the ``reads`` column says which path it took (``indexes`` / ``streams``).
    * source ``iter-only``: ``IterableWrapper`` over an object that wraps the same
      ``range`` but has only ``__iter__``, so ``dist_shard`` must stream like the
      other two. This is the like-for-like per-element overhead; its own plain
      source row shows that it costs the same to read as ``range``.

With ``--map`` every row is measured a second time with a ``.map(identity)``
between the source and the shard (``sharding_filter`` and ``classic`` then run the
map on every element; ``dist_shard`` may push the selection below the map).

N is 500,000 by default: torch's DataPipe iterator hook costs ~0.9 us per element
per pipe on a slow 2-core machine, where N = 1,000,000 would take over 3 minutes.
The per-element numbers do not depend on N; pass ``--n 1000000`` if you have the
time.

Each cell is timed ``--repeats`` times (default 7). Within a repeat round every
cell is timed once, in an order rotated (and reversed every other round) from
round to round, so that machine noise is spread over all variants; the garbage
collector is off while a cell is timed. Every pipe is built fresh for each
timing, and its graph is walked with ``traverse_dps`` before timing, as torch's
DataLoader does (see ``_walked`` for why this matters for fairness).

Reported: the median wall time, nanoseconds per *input* element (median / N),
the extra ns per input element over the plain source of the same kind, and the
ratios of the medians to ``sharding_filter`` and to ``classic`` at the same ``S``
(a ratio below 1 means faster than that baseline).

Before any timing, for every ``S``, the script checks that ``dist_shard(even=None)``
for slot ``s`` (on both sources) and ``sharding_filter`` for instance ``s`` yield
the same elements in the same order, exactly ``range(s, N, S)``; that the classic
recipe yields ``range(-s mod S, N, S)`` (it keeps ``v`` with ``(v + s) % S == 0``),
which is the same set for the default ``s = S // 2`` when ``S`` is even or 1; and
that ``"drop"`` / ``"pad"`` yield that prefix / ``ceil(N / S)`` elements. So a
broken variant cannot look fast. This untimed pass is also the warm-up.

How to run
----------
::

    make bench                                    # .venv/bin/python benchmarks/bench_overhead.py
    .venv/bin/python benchmarks/bench_overhead.py --quick          # N=100_000, repeats=3
    .venv/bin/python benchmarks/bench_overhead.py --slots 1,8,64,512 --map --json out.json

It prints a one-line header (command, Python / torch versions, N, repeats,
``os.cpu_count()``) and a Markdown table ready to paste into the README. Only
torch and the standard library are needed. Nothing here belongs in the tests.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Sequence

from torch.utils.data.datapipes.datapipe import IterDataPipe
from torch.utils.data.datapipes.iter import IterableWrapper
from torch.utils.data.graph import traverse_dps
from torch.utils.data.graph_settings import apply_sharding

import distshard  # noqa: F401  (registers .dist_shard())
import harness
from distshard.baselines import ClassicModuloIterDataPipe
from distshard.context import forced_distributed
from harness import Col, IterOnly

DEFAULT_N = 500_000  # see the module docstring
DEFAULT_REPEATS = 7
QUICK_N = 100_000
QUICK_REPEATS = 3
DEFAULT_SLOTS = (1, 8, 64)
EVEN_MODES: tuple[str | None, ...] = (None, "drop", "pad")

SOURCE = "source"
SHARDING_FILTER = "sharding_filter"
CLASSIC = "classic"
DIST_SHARD = "dist_shard"

RANGE = "range"
ITER_ONLY = "iter-only"


def identity(x: Any) -> Any:
    """Module-level (picklable) identity for the ``--map`` pipelines."""
    return x


def slot_for(num_slots: int) -> int:
    """The simulated slot: the middle one (0 when there is a single slot)."""
    return num_slots // 2


@dataclass(frozen=True)
class Cell:
    """One thing to time: a variant at one ``S`` on one pipeline and source."""

    pipeline: str  # "plain" or "map"
    source: str  # RANGE or ITER_ONLY
    variant: str  # SOURCE, SHARDING_FILTER, CLASSIC or DIST_SHARD
    num_slots: int | None = None  # None for SOURCE
    even: str | None = None  # only for DIST_SHARD

    @property
    def slot(self) -> int | None:
        return None if self.num_slots is None else slot_for(self.num_slots)

    @property
    def label(self) -> str:
        if self.variant == DIST_SHARD:
            return f"`dist_shard(even={self.even!r})`"
        if self.variant == SHARDING_FILTER:
            return "`sharding_filter`"
        if self.variant == CLASSIC:
            return "classic modulo"
        return "plain source (unsharded)"


@dataclass
class Result:
    cell: Cell
    yielded: int
    reads: str
    seconds: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def make_source(n: int, cell: Cell) -> IterDataPipe:
    data: Iterable[int] = range(n) if cell.source == RANGE else IterOnly(range(n))
    source: IterDataPipe = IterableWrapper(data, deepcopy=False)
    if cell.pipeline == "map":
        source = source.map(identity)
    return source


def _build(cell: Cell, n: int) -> tuple[IterDataPipe, Callable[[], ContextManager[Any]]]:
    source = make_source(n, cell)
    if cell.variant == SOURCE:
        return source, contextlib.nullcontext
    num_slots, slot = cell.num_slots, cell.slot
    if num_slots is None or slot is None:
        raise ValueError(f"{cell} needs num_slots")
    if cell.variant == SHARDING_FILTER:
        pipe = source.sharding_filter()
        apply_sharding(pipe, num_slots, slot)
        return pipe, contextlib.nullcontext
    if cell.variant == CLASSIC:
        return ClassicModuloIterDataPipe(source), lambda: forced_distributed(slot, num_slots)
    if cell.variant == DIST_SHARD:
        pipe = source.dist_shard(rank=slot, world_size=num_slots, even=cell.even)
        ctx = pipe.context()
        if (ctx.slot, ctx.num_slots) != (slot, num_slots):
            raise RuntimeError(f"dist_shard resolved {ctx}, expected slot {slot} of {num_slots}")
        return pipe, contextlib.nullcontext
    raise ValueError(cell.variant)


def _walked(pipe: IterDataPipe) -> IterDataPipe:
    """Walk the graph the way torch's DataLoader does (it pickles every pipe).

    This matters for fairness, not just realism: pickling materializes each
    pipe's instance ``__dict__``, and on CPython 3.11 attribute access on an
    object whose dict has been materialized is slower. torch's iterator hook
    touches the source pipe's attributes for every element, so a walked source
    costs ~5-10 % more per element (measured: 0.81 s vs 0.89 s for 1M elements).
    ``apply_sharding`` (sharding_filter) and ``dist_shard`` (its upstream
    checks) walk the graph anyway; doing it for every variant keeps the plain
    source and the classic recipe comparable.
    """
    traverse_dps(pipe)
    return pipe


def build(cell: Cell, n: int) -> tuple[IterDataPipe, Callable[[], ContextManager[Any]]]:
    """The pipe for ``cell`` (graph walked) and a factory of the context to iterate it in."""
    pipe, context = _build(cell, n)
    return _walked(pipe), context


def reads(cell: Cell, n: int) -> str:
    """How ``dist_shard`` reads its source (its ``read_plan()``): indexes its
    positions (the pushdown / random-access fast path) or streams."""
    if cell.variant == SOURCE:
        return "all"
    if cell.variant != DIST_SHARD:
        return "streams"
    plan = harness.read_plan(_build(cell, min(n, 1))[0])
    return ("indexes" if plan.sequence is not None else "streams") + (", map pushed down" if plan.maps else "")


def collect(cell: Cell, n: int) -> list[Any]:
    pipe, context = build(cell, n)
    with context():
        return list(pipe)


def time_once(cell: Cell, n: int) -> float:
    """Wall seconds to consume the whole iterator of a freshly built pipe."""
    pipe, context = build(cell, n)
    consume = collections.deque
    gc.collect()
    with harness.gc_paused(), context():
        start = time.perf_counter_ns()
        consume(iter(pipe), maxlen=0)
        stop = time.perf_counter_ns()
    return (stop - start) / 1e9


# -- correctness guard -----------------------------------------------------------------


class OutputMismatch(AssertionError):
    """A variant does not yield what it should: its timing would be meaningless."""


def _require(ok: bool, message: str) -> None:
    # Not ``assert``: the check must also run under ``python -O``.
    if not ok:
        raise OutputMismatch(message)


def check_outputs(n: int, slots: Sequence[int], pipelines: Sequence[str]) -> None:
    """Guard against timing something broken (see the module docstring).

    One untimed pass over every cell, so it is also the warm-up.
    """
    for pipeline in pipelines:
        for kind in (RANGE, ITER_ONLY):
            got = collect(Cell(pipeline, kind, SOURCE), n)
            _require(got == list(range(n)), f"the {kind} source ({pipeline}) is not range({n})")
            del got
        for num_slots in slots:
            s = slot_for(num_slots)
            where = f"{pipeline} pipeline, S={num_slots}, slot {s}"
            expected = list(range(s, n, num_slots))
            got_filter = collect(Cell(pipeline, RANGE, SHARDING_FILTER, num_slots), n)
            _require(got_filter == expected, f"sharding_filter is off ({where})")
            for kind in (RANGE, ITER_ONLY):
                got_dist = collect(Cell(pipeline, kind, DIST_SHARD, num_slots, None), n)
                _require(set(got_dist) == set(got_filter),
                         f"dist_shard(even=None) on {kind} and sharding_filter yield "
                         f"different sets ({where})")
                _require(got_dist == got_filter,
                         f"dist_shard(even=None) on {kind}: order differs ({where})")
                drop = collect(Cell(pipeline, kind, DIST_SHARD, num_slots, "drop"), n)
                _require(drop == expected[: n // num_slots],
                         f"dist_shard(even='drop') on {kind} is off ({where})")
                pad = collect(Cell(pipeline, kind, DIST_SHARD, num_slots, "pad"), n)
                _require(len(pad) == -(-n // num_slots) and pad[: len(expected)] == expected,
                         f"dist_shard(even='pad') on {kind} is off ({where})")
                del got_dist, drop, pad

            got_classic = collect(Cell(pipeline, RANGE, CLASSIC, num_slots), n)
            residue = (-s) % num_slots  # the recipe keeps (value + s) % S == 0
            _require(got_classic == list(range(residue, n, num_slots)),
                     f"the classic recipe is off ({where})")
            if residue == s:
                _require(set(got_classic) == set(got_filter),
                         f"the classic recipe and dist_shard yield different sets ({where})")
            else:
                print(f"note: the classic recipe's rank {s} of {num_slots} keeps the values "
                      f"= {residue} mod {num_slots}, not {s} (same work, other elements)",
                      file=sys.stderr)
            del expected, got_filter, got_classic


# -- timing ----------------------------------------------------------------------------


def cells_for(slots: Sequence[int], pipelines: Sequence[str]) -> list[Cell]:
    cells: list[Cell] = []
    for pipeline in pipelines:
        cells.append(Cell(pipeline, RANGE, SOURCE))
        cells.append(Cell(pipeline, ITER_ONLY, SOURCE))
        for num_slots in slots:
            cells.append(Cell(pipeline, RANGE, SHARDING_FILTER, num_slots))
            cells.append(Cell(pipeline, RANGE, CLASSIC, num_slots))
            for kind in (RANGE, ITER_ONLY):
                for even in EVEN_MODES:
                    cells.append(Cell(pipeline, kind, DIST_SHARD, num_slots, even))
    return cells


def expected_yield(cell: Cell, n: int) -> int:
    if cell.num_slots is None or cell.slot is None:
        return n
    s, num_slots = cell.slot, cell.num_slots
    if cell.even == "drop":
        return n // num_slots
    if cell.even == "pad":
        return -(-n // num_slots)
    residue = (-s) % num_slots if cell.variant == CLASSIC else s
    return len(range(residue, n, num_slots))


def run(n: int, repeats: int, slots: Sequence[int], pipelines: Sequence[str]) -> list[Result]:
    cells = cells_for(slots, pipelines)
    results = {cell: Result(cell, expected_yield(cell, n), reads(cell, n)) for cell in cells}
    for _, order in harness.rounds(cells, repeats, reverse_odd=True):
        for cell in order:
            results[cell].seconds.append(time_once(cell, n))
    return [results[cell] for cell in cells]


# -- report ----------------------------------------------------------------------------


COLUMNS = [Col("S", 0), Col("slot", 0), Col("variant"), Col("source"), Col("reads"), Col("median s", 3),
           Col("ns / input elem", 1), Col("Δ ns vs source", 1, signed=True), Col("vs sharding_filter", 2, "×"),
           Col("vs classic", 2, "×"), Col("yielded", 0)]


def table(results: list[Result], n: int, with_pipeline: bool) -> tuple[str, list[dict[str, Any]]]:
    """The Markdown table and the rows behind it (for ``--json``)."""
    by_key = {
        (r.cell.pipeline, r.cell.source, r.cell.variant, r.cell.num_slots, r.cell.even): r
        for r in results
    }

    def median(pipeline: str, source: str, variant: str, num_slots: int | None) -> float:
        return by_key[(pipeline, source, variant, num_slots, None)].median

    rows: list[dict[str, Any]] = []
    cells: list[list[Any]] = []
    for r in results:
        cell = r.cell
        source = median(cell.pipeline, cell.source, SOURCE, None)
        vs_filter = vs_classic = None
        if cell.num_slots is not None:
            vs_filter = r.median / median(cell.pipeline, RANGE, SHARDING_FILTER, cell.num_slots)
            vs_classic = r.median / median(cell.pipeline, RANGE, CLASSIC, cell.num_slots)
        ns = r.median / n * 1e9
        delta = None if cell.variant == SOURCE else (r.median - source) / n * 1e9
        rows.append({
            "pipeline": cell.pipeline,
            "source": cell.source,
            "variant": cell.variant,
            "even": cell.even,
            "num_slots": cell.num_slots,
            "slot": cell.slot,
            "reads": r.reads,
            "median_s": r.median,
            "ns_per_input": ns,
            "delta_ns_vs_source": delta,
            "ratio_vs_sharding_filter": vs_filter,
            "ratio_vs_classic": vs_classic,
            "yielded": r.yielded,
            "seconds": r.seconds,
        })
        pipeline = ["map(identity)" if cell.pipeline == "map" else "plain"] if with_pipeline else []
        cells.append([*pipeline, cell.num_slots, cell.slot, cell.label, cell.source, r.reads, r.median, ns, delta,
                      vs_filter, vs_classic, r.yielded])
    columns = [Col("pipeline")] * with_pipeline + COLUMNS
    return harness.table(columns, cells), rows


def _parse_slots(text: str) -> list[int]:
    try:
        slots = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--slots {text!r}: give integers like 1,8,64") from None
    if not slots or any(s < 1 for s in slots):
        raise argparse.ArgumentTypeError(f"--slots {text!r}: every S must be at least 1")
    return sorted(set(slots))


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--n", type=int, default=None,
                        help=f"stream length (default {DEFAULT_N:_}; {QUICK_N:_} with --quick)")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"timed rounds (default {DEFAULT_REPEATS}; {QUICK_REPEATS} with --quick)")
    parser.add_argument("--slots", type=_parse_slots, default=list(DEFAULT_SLOTS),
                        help="comma-separated numbers of slots S (default 1,8,64)")
    parser.add_argument("--map", action="store_true",
                        help="also measure every row with a .map(identity) before the shard")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: N={QUICK_N:_}, repeats={QUICK_REPEATS}")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write the raw numbers to PATH")
    args = parser.parse_args(None if argv is None else list(argv))
    n = args.n if args.n is not None else (QUICK_N if args.quick else DEFAULT_N)
    repeats = args.repeats if args.repeats is not None else (
        QUICK_REPEATS if args.quick else DEFAULT_REPEATS)
    if n < 1 or repeats < 1:
        parser.error("--n and --repeats must be at least 1")
    pipelines = ["plain", "map"] if args.map else ["plain"]

    session = harness.Session()
    check_outputs(n, args.slots, pipelines)
    results = run(n, repeats, args.slots, pipelines)
    elapsed = session.elapsed

    text, rows = table(results, n, with_pipeline=args.map)
    print(session.header(f"N={n:,}, repeats={repeats} (median)"))
    print()
    print(text)
    print()
    print(f"slot s = S // 2. `iter-only`: the same range behind an object with only "
          f"`__iter__`, so `dist_shard` cannot index it and streams like the others. "
          f"Ratios: median / median of the `range` `sharding_filter` / classic row at the "
          f"same S (< 1 is faster). Outputs checked before timing; total {elapsed:.0f} s.")

    session.dump(args.json, n=n, repeats=repeats, slots=args.slots, pipelines=pipelines, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
