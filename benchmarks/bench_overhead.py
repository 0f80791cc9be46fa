"""Per-element overhead of ``.dist_shard()`` against torch's ``sharding_filter`` and
the classic per-value modulo recipe, on the same trivial pipeline, in one run.

What is measured
----------------
Single-process iteration only: no DataLoader, no ``torch.distributed``, no workers.
The source is ``IterableWrapper(range(N), deepcopy=False)`` (N = 1,000,000 by
default). Every variant simulates being slot ``s = S // 2`` of ``S`` slots, for
each ``S`` in ``--slots`` (default 1, 8, 64), and the whole iterator is consumed
with ``collections.deque(iter(pipe), maxlen=0)``:

``source``
    the unsharded source alone (the floor every variant pays: it still reads all
    N elements), measured once per round, independent of ``S``;
``sharding_filter``
    ``IterableWrapper(...).sharding_filter()`` after
    ``torch.utils.data.graph_settings.apply_sharding(pipe, S, s)``;
``classic``
    ``distshard.baselines.ClassicModuloIterDataPipe`` iterated inside
    ``distshard.context.forced_distributed(s, S)``;
``dist_shard``
    ``.dist_shard(rank=s, world_size=S, even=...)`` for ``even`` in
    ``None``, ``"drop"``, ``"pad"`` (explicit rank and world size; without
    workers the slot is the rank).

With ``--map`` every variant is measured a second time with a
``.map(identity)`` between the source and the shard (a pipeline whose per-element
cost is twice as high, to show how the relative overhead shrinks).

Each cell is timed ``--repeats`` times (default 7). Within a repeat round every
cell is timed once, in an order rotated from round to round, so that machine
noise (frequency scaling, other processes) is spread over all variants; the
garbage collector is off while a cell is timed. One untimed warm-up pass over a
shorter stream precedes the rounds. Reported: the median wall time, nanoseconds
per *input* element (median / N), the extra ns per input element over the plain
source, and the ratios of the medians to ``sharding_filter`` and to ``classic``
at the same ``S`` (a ratio below 1 means faster than that baseline).

Before any timing, for every ``S``, the script checks that ``dist_shard(even=None)``
for slot ``s``, ``sharding_filter`` for instance ``s`` and the classic recipe yield
exactly ``range(s', N, S)`` (``s' = s`` for ``dist_shard`` / ``sharding_filter``;
the classic recipe keeps values ``v`` with ``(v + s) % S == 0``, i.e. residue
``-s mod S``, which is ``s`` again for the default ``s = S // 2`` with even ``S``),
and that ``"drop"`` / ``"pad"`` yield ``N // S`` / ``ceil(N / S)`` elements. So a
broken variant cannot look fast.

How to run
----------
::

    make bench                                    # .venv/bin/python benchmarks/bench_overhead.py
    .venv/bin/python benchmarks/bench_overhead.py --quick          # N=100_000, repeats=3
    .venv/bin/python benchmarks/bench_overhead.py --slots 1,8,64,512 --map --json out.json

It prints a one-line header (command, Python / torch versions, N, repeats,
``os.cpu_count()``) and a Markdown table ready to paste into the README. Only
torch and the standard library are needed.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

warnings.filterwarnings("ignore", message=".*torchdata.*", category=UserWarning)

import torch  # noqa: E402
from torch.utils.data.datapipes.datapipe import IterDataPipe  # noqa: E402
from torch.utils.data.datapipes.iter import IterableWrapper  # noqa: E402
from torch.utils.data.graph import traverse_dps  # noqa: E402
from torch.utils.data.graph_settings import apply_sharding  # noqa: E402

import distshard  # noqa: E402,F401  (registers .dist_shard())
from distshard.baselines import ClassicModuloIterDataPipe  # noqa: E402
from distshard.context import forced_distributed  # noqa: E402

DEFAULT_N = 1_000_000
DEFAULT_REPEATS = 7
QUICK_N = 100_000
QUICK_REPEATS = 3
DEFAULT_SLOTS = (1, 8, 64)

SOURCE = "source"
SHARDING_FILTER = "sharding_filter"
CLASSIC = "classic"
DIST_SHARD = "dist_shard"


def identity(x: Any) -> Any:
    """Module-level (picklable) identity for the ``--map`` pipelines."""
    return x


def slot_for(num_slots: int) -> int:
    """The simulated slot: the middle one (0 when there is a single slot)."""
    return num_slots // 2


@dataclass(frozen=True)
class Cell:
    """One thing to time: a variant at one ``S`` on one pipeline."""

    pipeline: str  # "plain" or "map"
    variant: str  # SOURCE, SHARDING_FILTER, CLASSIC or DIST_SHARD
    num_slots: int | None  # None for SOURCE
    even: str | None = None  # only for DIST_SHARD

    @property
    def slot(self) -> int | None:
        return None if self.num_slots is None else slot_for(self.num_slots)

    @property
    def label(self) -> str:
        if self.variant == DIST_SHARD:
            return f"dist_shard(even={self.even!r})"
        if self.variant == SHARDING_FILTER:
            return "sharding_filter"
        if self.variant == CLASSIC:
            return "classic modulo"
        return "plain source (unsharded)"


@dataclass
class Result:
    cell: Cell
    seconds: list[float] = field(default_factory=list)
    yielded: int = -1

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def make_source(n: int, pipeline: str) -> IterDataPipe:
    source: IterDataPipe = IterableWrapper(range(n), deepcopy=False)
    if pipeline == "map":
        source = source.map(identity)
    return source


def build(cell: Cell, n: int) -> tuple[IterDataPipe, Callable[[], Any]]:
    """The pipe for ``cell`` (its graph walked, see ``_walked``) and a factory of
    the context manager to iterate it in."""
    pipe, context = _build(cell, n)
    return _walked(pipe), context


def _walked(pipe: IterDataPipe) -> IterDataPipe:
    """Walk the graph the way torch's DataLoader does (it pickles every pipe).

    This matters for fairness, not just realism: pickling materializes each
    pipe's instance ``__dict__``, and on CPython 3.11+ attribute access on an
    object whose dict has been materialized is slower. torch's iterator hook
    touches the source pipe's attributes for every element, so a walked source
    costs ~5-10 % more per element. ``apply_sharding`` (sharding_filter) and
    ``dist_shard`` (its upstream checks) walk the graph anyway; doing it for
    every variant keeps the plain source and the classic recipe comparable.
    """
    traverse_dps(pipe)
    return pipe


def _build(cell: Cell, n: int) -> tuple[IterDataPipe, Callable[[], Any]]:
    source = make_source(n, cell.pipeline)
    no_context: Callable[[], Any] = _NullContext
    if cell.variant == SOURCE:
        return source, no_context
    num_slots, slot = cell.num_slots, cell.slot
    assert num_slots is not None and slot is not None
    if cell.variant == SHARDING_FILTER:
        pipe = source.sharding_filter()
        apply_sharding(pipe, num_slots, slot)
        return pipe, no_context
    if cell.variant == CLASSIC:
        return ClassicModuloIterDataPipe(source), lambda: forced_distributed(slot, num_slots)
    if cell.variant == DIST_SHARD:
        pipe = source.dist_shard(rank=slot, world_size=num_slots, even=cell.even)
        ctx = pipe.context()
        assert (ctx.slot, ctx.num_slots) == (slot, num_slots), ctx
        return pipe, no_context
    raise ValueError(cell.variant)


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def collect(cell: Cell, n: int) -> list[Any]:
    pipe, context = build(cell, n)
    with context():
        return list(pipe)


def time_once(cell: Cell, n: int) -> float:
    """Wall seconds to consume the whole iterator of a freshly built pipe."""
    pipe, context = build(cell, n)
    consume = collections.deque
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with context():
            start = time.perf_counter_ns()
            consume(iter(pipe), maxlen=0)
            stop = time.perf_counter_ns()
    finally:
        if gc_was_enabled:
            gc.enable()
    return (stop - start) / 1e9


def check_outputs(n: int, slots: Sequence[int], pipelines: Sequence[str]) -> None:
    """Guard against timing something broken (see the module docstring)."""
    for pipeline in pipelines:
        for num_slots in slots:
            s = slot_for(num_slots)
            expected = list(range(s, n, num_slots))
            got_dist = collect(Cell(pipeline, DIST_SHARD, num_slots, None), n)
            got_filter = collect(Cell(pipeline, SHARDING_FILTER, num_slots), n)
            assert got_filter == expected, f"sharding_filter S={num_slots} s={s} is off"
            assert set(got_dist) == set(got_filter), (
                f"dist_shard(even=None) and sharding_filter disagree at S={num_slots} s={s}"
            )
            assert got_dist == got_filter, f"dist_shard order differs at S={num_slots}"
            got_classic = collect(Cell(pipeline, CLASSIC, num_slots), n)
            classic_residue = (-s) % num_slots
            assert got_classic == list(range(classic_residue, n, num_slots)), (
                f"classic recipe S={num_slots} s={s} is off"
            )
            if classic_residue == s:
                assert set(got_classic) == set(got_dist)
            else:
                print(
                    f"note: at S={num_slots} the classic recipe's rank {s} keeps residue "
                    f"{classic_residue}, not {s} (same amount of work, other elements)",
                    file=sys.stderr,
                )
            drop = collect(Cell(pipeline, DIST_SHARD, num_slots, "drop"), n)
            pad = collect(Cell(pipeline, DIST_SHARD, num_slots, "pad"), n)
            assert len(drop) == n // num_slots and drop == expected[: n // num_slots]
            assert len(pad) == -(-n // num_slots) and pad[: len(expected)] == expected
            del expected, got_dist, got_filter, got_classic, drop, pad


def cells_for(slots: Sequence[int], pipelines: Sequence[str]) -> list[Cell]:
    cells: list[Cell] = []
    for pipeline in pipelines:
        cells.append(Cell(pipeline, SOURCE, None))
        for num_slots in slots:
            cells.append(Cell(pipeline, SHARDING_FILTER, num_slots))
            cells.append(Cell(pipeline, CLASSIC, num_slots))
            for even in (None, "drop", "pad"):
                cells.append(Cell(pipeline, DIST_SHARD, num_slots, even))
    return cells


def expected_yield(cell: Cell, n: int) -> int:
    if cell.num_slots is None:
        return n
    s, S = cell.slot, cell.num_slots
    assert s is not None
    if cell.even == "drop":
        return n // S
    if cell.even == "pad":
        return -(-n // S)
    residue = (-s) % S if cell.variant == CLASSIC else s
    return len(range(residue, n, S))


def run(n: int, repeats: int, slots: Sequence[int], pipelines: Sequence[str]) -> list[Result]:
    cells = cells_for(slots, pipelines)
    results = {cell: Result(cell, yielded=expected_yield(cell, n)) for cell in cells}
    for round_index in range(repeats):
        shift = round_index % len(cells)
        order = cells[shift:] + cells[:shift]
        if round_index % 2:
            order.reverse()
        for cell in order:
            results[cell].seconds.append(time_once(cell, n))
    return [results[cell] for cell in cells]


def _fmt_ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def table(results: list[Result], n: int, with_pipeline: bool) -> tuple[str, list[dict[str, Any]]]:
    """The Markdown table and the rows behind it."""
    by_key: dict[tuple[str, str, int | None, str | None], Result] = {
        (r.cell.pipeline, r.cell.variant, r.cell.num_slots, r.cell.even): r for r in results
    }
    header = ["S", "slot", "variant", "median s", "ns / input elem", "Δ ns vs source",
              "vs sharding_filter", "vs classic", "yielded"]
    if with_pipeline:
        header.insert(0, "pipeline")
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i < (4 if with_pipeline else 3) else "---:"
                            for i in range(len(header))) + "|"]
    rows: list[dict[str, Any]] = []
    for r in results:
        cell = r.cell
        source = by_key[(cell.pipeline, SOURCE, None, None)].median
        vs_filter = vs_classic = None
        if cell.num_slots is not None:
            vs_filter = r.median / by_key[(cell.pipeline, SHARDING_FILTER, cell.num_slots, None)].median
            vs_classic = r.median / by_key[(cell.pipeline, CLASSIC, cell.num_slots, None)].median
        ns = r.median / n * 1e9
        delta = (r.median - source) / n * 1e9
        row = {
            "pipeline": cell.pipeline,
            "variant": cell.variant,
            "label": cell.label,
            "num_slots": cell.num_slots,
            "slot": cell.slot,
            "even": cell.even,
            "median_s": r.median,
            "ns_per_input": ns,
            "delta_ns_vs_source": delta,
            "ratio_vs_sharding_filter": vs_filter,
            "ratio_vs_classic": vs_classic,
            "yielded": r.yielded,
            "seconds": r.seconds,
        }
        rows.append(row)
        cells = [
            "—" if cell.num_slots is None else str(cell.num_slots),
            "—" if cell.slot is None else str(cell.slot),
            f"`{cell.label}`" if cell.variant != SOURCE else cell.label,
            f"{r.median:.3f}",
            f"{ns:.1f}",
            "—" if cell.variant == SOURCE else f"{delta:+.1f}",
            _fmt_ratio(vs_filter),
            _fmt_ratio(vs_classic),
            f"{r.yielded:,}",
        ]
        if with_pipeline:
            cells.insert(0, "`range→map(identity)`" if cell.pipeline == "map" else "`range`")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines), rows


def _command() -> str:
    exe = Path(sys.executable)
    try:
        shown = os.path.relpath(exe) if exe.is_relative_to(Path.cwd()) else str(exe)
    except ValueError:
        shown = str(exe)
    return shlex.join([shown, *sys.argv])


def _parse_slots(text: str) -> list[int]:
    try:
        slots = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--slots {text!r}: give integers like 1,8,64") from None
    if not slots or any(s < 1 for s in slots):
        raise argparse.ArgumentTypeError(f"--slots {text!r}: every S must be at least 1")
    return slots


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=None,
                        help=f"stream length (default {DEFAULT_N:_}; {QUICK_N:_} with --quick)")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"timed rounds (default {DEFAULT_REPEATS}; {QUICK_REPEATS} with --quick)")
    parser.add_argument("--slots", type=_parse_slots, default=list(DEFAULT_SLOTS),
                        help="comma-separated numbers of slots S (default 1,8,64)")
    parser.add_argument("--map", action="store_true",
                        help="also measure every variant after a .map(identity)")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: N={QUICK_N:_}, repeats={QUICK_REPEATS}")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write the raw numbers to PATH")
    args = parser.parse_args(None if argv is None else list(argv))
    n = args.n if args.n is not None else (QUICK_N if args.quick else DEFAULT_N)
    repeats = args.repeats if args.repeats is not None else (QUICK_REPEATS if args.quick else DEFAULT_REPEATS)
    if n < 1 or repeats < 1:
        parser.error("--n and --repeats must be at least 1")
    pipelines = ["plain", "map"] if args.map else ["plain"]

    started = time.perf_counter()
    check_outputs(n, args.slots, pipelines)
    results = run(n, repeats, args.slots, pipelines)
    elapsed = time.perf_counter() - started

    header = (
        f"`{_command()}` — Python {platform.python_version()}, torch {torch.__version__}, "
        f"N={n:,}, repeats={repeats} (median), os.cpu_count()={os.cpu_count()}"
    )
    text, rows = table(results, n, with_pipeline=args.map)
    print(header)
    print()
    print(text)
    print()
    print(f"(slot s = S // 2; ratios are median / median at the same S, < 1 is faster; "
          f"outputs checked before timing; total {elapsed:.0f} s)")

    if args.json is not None:
        payload = {
            "command": _command(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "distshard": distshard.__version__,
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "n": n,
            "repeats": repeats,
            "slots": args.slots,
            "pipelines": pipelines,
            "elapsed_s": elapsed,
            "rows": rows,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
