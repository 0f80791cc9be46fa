"""Time to the first element after resuming mid-epoch: ``dist_shard``'s own state
against torchdata ``StatefulDataLoader``'s naive fast-forward, in one run.

What is measured
----------------
Single process, no ``torch.distributed``, no DataLoader workers. Every variant
simulates a realistic slot: **rank 1 of world size 4** (slot 1 of 4, which owns
the stream positions ``1, 5, 9, ...``: a share of ``N / 4`` elements). The stream
is ``range(N)`` (N = 1,000,000 by default) followed by a cheap ``decode`` (a
30-step integer-hash loop, ~2 us per call; ``--decode-iters`` changes the loop,
the measured cost is printed). Resume points: after the slot consumed 0 %, 50 %
and 90 % of its share (0, 125,000 and 225,000 of its 250,000 elements).

``dist_shard`` (fast path)
    ``IterableWrapper(range(N), deepcopy=False).map(decode).dist_shard(rank=1,
    world_size=4)``. The source has random access, so the slot indexes its own
    positions and runs ``decode`` on them only. Resume: a fresh pipe,
    ``load_state_dict(state)``, then ``next(iter(pipe))`` is timed.
``dist_shard`` (iterator source)
    The same over ``IterableWrapper(IterOnly(range(N)), deepcopy=False)``, where
    ``IterOnly`` has nothing but ``__iter__``: ``dist_shard`` must walk the stream.
    On resume it skips the consumed rounds with ``itertools.islice`` without
    running ``decode`` on them, so the time grows with the resume point but stays
    below re-decoding the prefix. (The skip is in C, but every skipped element
    still passes through torch's per-element iterator hook of the
    ``IterableWrapper``, ~0.8 us each, which is most of this row's cost.)
``StatefulDataLoader`` + ``sharding_filter`` (the baseline)
    ``IterableWrapper(range(N), deepcopy=False).map(decode).sharding_filter()``
    given to ``StatefulDataLoader(pipe, batch_size=None, num_workers=0)``. The
    loader wraps an ``IterDataPipe`` in torch's serialization wrapper, which has
    no ``state_dict``, so on resume it logs "naively fast-forwarding your dataset
    by k steps" and re-iterates (and re-decodes) the whole prefix, 4 stream
    elements per step. Resume: a new loader, ``load_state_dict(state)``, then
    ``next(iter(loader))`` is timed (the fast-forward happens inside ``iter``).

    Note on sharding: with ``num_workers=0`` the loader calls
    ``apply_sharding(pipe, world_size, rank)`` itself on every ``iter()``, with
    the values of ``torch.distributed``, i.e. ``(1, 0)`` here, which would undo an
    ``apply_sharding(pipe, 4, 1)`` done beforehand and read the whole stream. So
    while a loader is built and iterated, ``torch.utils.data.dataloader.
    _get_distributed_settings`` is patched to return ``(4, 1)``: the loader then
    shards exactly as it would on rank 1 of a real world of 4. The correctness
    check below would catch an unsharded baseline.
``StatefulDataLoader`` + ``StatefulPipeline``
    ``StatefulDataLoader(distshard.StatefulPipeline(<fast-path pipe>),
    batch_size=None, num_workers=0)``, same protocol as the baseline. The
    pipeline's ``state_dict`` travels in the loader's state, so the loader must
    not fast-forward (and must not log the warning).

Protocol
--------
For every variant one uninterrupted run is made (untimed): it is iterated to
0 %, 50 % and 90 % of the slot's share, and at each point the state is taken
(``pipe.state_dict()`` / ``loader.state_dict()``) together with the next
``CHECK`` elements the run yields after it. Each timed repeat builds a fresh pipe
or loader, loads a deep copy of the saved state (untimed, reported as ``setup``
in the JSON), and times ``next(iter(...))`` with the garbage collector off (a
full collection is done before the build, not just before the clock starts: it
empties CPython's free lists, which adds ~200 us to the next sub-millisecond
measurement). ``decode`` counts its calls; the table shows how many ran between
the start of the clock and the first element at 90 % (1 if nothing is re-decoded).
After the clock stops, every repeat checks that the resumed run's first
``CHECK`` elements equal the uninterrupted run's (its first element is the timed
one), and that they are ``decode(1 + 4 j)`` for the right ``j`` (the slot's own
positions: catches a variant that silently does not shard). The warnings and log
records emitted while resuming are captured; the table says whether the naive
fast-forward message was among them.

Repeats are interleaved: in each round every cell (variant x resume point) is
timed once, in an order rotated from round to round. The table reports the
median. A cell whose first repeat takes more than ``--slow-threshold`` seconds
(default 8: only the baseline at 90 %, ~5-10 s per repeat on a 2-core machine,
can get there) gets only ``--slow-repeats`` repeats (default 3), to keep the
whole run under ~4 minutes (the untimed preparation of the baseline adds ~10 s);
the ``repeats`` column says how many each cell got, at 0 / 50 / 90 %. The header
shows the 1-minute load average before and after the run: on a shared machine
the slow rows can be off by 2x.

How to run
----------
::

    .venv/bin/python benchmarks/bench_resume.py                  # N=1_000_000, repeats=5
    .venv/bin/python benchmarks/bench_resume.py --quick          # N=100_000, repeats=3
    .venv/bin/python benchmarks/bench_resume.py --json resume.json

It prints a header line (command, Python / torch / torchdata versions, N,
``os.cpu_count()``, load average) and a Markdown table for the README. This is a benchmark,
not a test: nothing asserts on timings. A failed correctness check is printed
and makes the exit status 1.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import statistics
import sys
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch.utils.data.dataloader as _torch_dataloader
from torch.utils.data.datapipes.datapipe import IterDataPipe
from torch.utils.data.datapipes.iter import IterableWrapper
from torch.utils.data.graph_settings import apply_sharding
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader import stateful_dataloader as _sdl_module

import distshard  # (registers .dist_shard())
import harness
from harness import Col, IterOnly

DEFAULT_N = 1_000_000
QUICK_N = 100_000
DEFAULT_REPEATS = 5
QUICK_REPEATS = 3
DEFAULT_SLOW_REPEATS = 3
DEFAULT_SLOW_THRESHOLD_S = 8.0
DEFAULT_DECODE_ITERS = 30
RANK, WORLD_SIZE = 1, 4  # the simulated slot: rank 1 of 4 (no workers: slot 1 of 4)
FRACTIONS = (0.0, 0.5, 0.9)
CHECK = 4  # elements compared after every resume
NAIVE_MARK = "naively fast-forwarding"

# -- the pipeline's pieces ------------------------------------------------------------

_decode_iters = DEFAULT_DECODE_ITERS
_decode_calls = 0  # how many times decode ran (to show what a resume re-decodes)


def decode(x: int) -> int:
    """A cheap, deterministic, element-dependent "decode": a short integer hash loop."""
    global _decode_calls
    _decode_calls += 1
    h = x
    for _ in range(_decode_iters):
        h = (h * 0x01000193 + 0x9E37) & 0xFFFFFFFF
    return h


def decode_cost_us(samples: int = 200_000) -> float:
    """Measured cost of one ``decode`` call, in microseconds (best of 3)."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for x in range(samples):
            decode(x)
        best = min(best, time.perf_counter() - start)
    return best / samples * 1e6


def fast_pipe(n: int) -> IterDataPipe:
    return IterableWrapper(range(n), deepcopy=False).map(decode).dist_shard(rank=RANK, world_size=WORLD_SIZE)


def stream_pipe(n: int) -> IterDataPipe:
    return IterableWrapper(IterOnly(range(n)), deepcopy=False).map(decode).dist_shard(
        rank=RANK, world_size=WORLD_SIZE)


def naive_loader(n: int) -> StatefulDataLoader:
    pipe = IterableWrapper(range(n), deepcopy=False).map(decode).sharding_filter()
    apply_sharding(pipe, WORLD_SIZE, RANK)  # redone by the loader itself (see loader_rank)
    return StatefulDataLoader(pipe, batch_size=None, num_workers=0)


def pipeline_loader(n: int) -> StatefulDataLoader:
    return StatefulDataLoader(distshard.StatefulPipeline(fast_pipe(n)), batch_size=None, num_workers=0)


@contextmanager
def loader_rank(rank: int, world_size: int) -> Iterator[None]:
    """Make torch's DataLoader iterators see ``(world_size, rank)`` as if
    ``torch.distributed`` were initialized (they call ``apply_sharding`` with it)."""
    saved = _torch_dataloader._get_distributed_settings
    _torch_dataloader._get_distributed_settings = lambda: (world_size, rank)
    try:
        yield
    finally:
        _torch_dataloader._get_distributed_settings = saved


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    build: Callable[[int], Any]  # n -> a pipe or a loader
    is_loader: bool

    def context(self):  # type: ignore[no-untyped-def]
        return loader_rank(RANK, WORLD_SIZE) if self.is_loader else nullcontext()

    def state(self, obj: Any) -> Any:
        return obj.state_dict()


VARIANTS = (
    Variant("fast", "`dist_shard` fast path (range source)", fast_pipe, False),
    Variant("stream", "`dist_shard` iterator source (`IterOnly`)", stream_pipe, False),
    Variant("naive", "`StatefulDataLoader` + `sharding_filter` (naive fast-forward)", naive_loader, True),
    Variant("pipeline", "`StatefulDataLoader` + `StatefulPipeline(dist_shard)`", pipeline_loader, True),
)


def reads(variant: Variant, n: int) -> str:
    """How the variant reaches its resume point, in words, from what it actually is."""
    if variant.key == "naive":
        return "re-iterates the prefix"
    pipe = fast_pipe(n) if variant.key == "pipeline" else variant.build(n)
    return "indexes" if pipe.read_plan().sequence is not None else "streams"


# -- preparation: one uninterrupted run per variant -------------------------------------


@dataclass
class Point:
    fraction: float
    taken: int  # elements of the slot's share consumed before the state was taken
    state: Any
    expected: list[Any]  # what the uninterrupted run yielded right after the state


def prepare(variant: Variant, n: int, share: int) -> tuple[list[Point], float]:
    """Iterate once through 90 % of the share, saving the state (and the next
    ``CHECK`` elements) at every resume point. Returns the points and the wall time."""
    start = time.perf_counter()
    points: list[Point] = []
    with variant.context():
        obj = variant.build(n)
        it = iter(obj)
        consumed = 0
        for fraction in FRACTIONS:
            taken = int(round(fraction * share))
            for _ in islice(it, taken - consumed):
                pass
            consumed = taken
            state = copy.deepcopy(variant.state(obj))
            expected = list(islice(it, CHECK))
            consumed += len(expected)
            points.append(Point(fraction, taken, state, expected))
    return points, time.perf_counter() - start


# -- timing ------------------------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"log {record.levelname}: {record.getMessage()}")


@dataclass
class Cell:
    variant: Variant
    point: Point
    first_s: list[float] = field(default_factory=list)
    setup_s: list[float] = field(default_factory=list)
    decodes: list[int] = field(default_factory=list)  # decode calls until the first element
    messages: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    planned: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.first_s)

    @property
    def naive_warned(self) -> bool:
        return any(NAIVE_MARK in m for m in self.messages)


def own_element(taken: int) -> int:
    """The element an uninterrupted slot yields after consuming ``taken`` of its share."""
    return decode(RANK + WORLD_SIZE * taken)


def time_once(cell: Cell, n: int) -> None:
    variant, point = cell.variant, cell.point
    handler = _Records()
    _sdl_module.logger.addHandler(handler)
    try:
        with variant.context(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gc.collect()  # here, not right before the clock: a full collection empties
            # CPython's free lists, which makes the next ~100 us of allocations slower
            t0 = time.perf_counter()
            obj = variant.build(n)
            obj.load_state_dict(copy.deepcopy(point.state))
            setup = time.perf_counter() - t0
            with harness.gc_paused():
                calls = _decode_calls
                t1 = time.perf_counter()
                it = iter(obj)
                first = next(it)
                elapsed = time.perf_counter() - t1
                calls = _decode_calls - calls
            got = [first, *islice(it, CHECK - 1)]
    finally:
        _sdl_module.logger.removeHandler(handler)
    cell.first_s.append(elapsed)
    cell.setup_s.append(setup)
    cell.decodes.append(calls)
    for message in handler.messages + [f"warning {w.category.__name__}: {w.message}" for w in caught]:
        if message not in cell.messages:
            cell.messages.append(message)
    want = [own_element(point.taken + j) for j in range(CHECK)]
    if got != point.expected:
        cell.failures.append(f"resumed run yields {got}, the uninterrupted run yielded {point.expected}")
    if point.expected != want:
        cell.failures.append(f"the uninterrupted run yielded {point.expected}, slot {RANK} of "
                             f"{WORLD_SIZE} owns {want} (decode of positions "
                             f"{RANK + WORLD_SIZE * point.taken}, ...)")


def run(cells: list[Cell], n: int, repeats: int, slow_repeats: int, slow_threshold: float,
        log: Callable[[str], None]) -> None:
    for cell in cells:
        cell.planned = repeats
    for round_, order in harness.rounds(cells, repeats):
        for cell in order:
            if len(cell.first_s) >= cell.planned:
                continue
            time_once(cell, n)
            if len(cell.first_s) == 1 and cell.first_s[0] > slow_threshold:
                cell.planned = min(repeats, slow_repeats)
        log(f"  round {round_ + 1}/{repeats} done")


# -- report --------------------------------------------------------------------------------


def table(variants: Iterable[Variant], by_key: dict[tuple[str, float], Cell], n: int) -> tuple[str, list[dict]]:
    columns = [Col("variant"), Col("reads"),
               *[Col(f"first element at {int(f * 100)} %", fmt=harness.seconds) for f in FRACTIONS],
               Col("90 % / 0 %", fmt=harness.ratio), Col("naive at 90 % / this at 90 %", fmt=harness.ratio),
               Col("`decode` calls to resume at 90 %", 0), Col("repeats"), Col("fast-forward warning"),
               Col("resume = uninterrupted")]
    lines, rows = [], []
    naive90 = by_key[("naive", FRACTIONS[-1])].median
    for variant in variants:
        cells = [by_key[(variant.key, f)] for f in FRACTIONS]
        medians = [c.median for c in cells]
        ratio = medians[-1] / medians[0]
        warned = [f"{int(c.point.fraction * 100)} %" for c in cells if c.naive_warned]
        ok = all(not c.failures for c in cells)
        lines.append([
            variant.label,
            reads(variant, n),
            *medians,
            ratio,
            naive90 / medians[-1] if variant.key != "naive" else "1×",
            max(cells[-1].decodes),
            "/".join(str(len(c.first_s)) for c in cells),
            ("yes (at " + ", ".join(warned) + ")") if warned else "no",
            "yes" if ok else "**NO**",
        ])
        rows.append({
            "variant": variant.key,
            "label": variant.label,
            "reads": reads(variant, n),
            "ratio_90_over_0": ratio,
            "cells": [{
                "fraction": c.point.fraction,
                "taken": c.point.taken,
                "next_position": RANK + WORLD_SIZE * c.point.taken,
                "first_s": c.first_s,
                "median_first_s": c.median,
                "setup_s": c.setup_s,
                "decode_calls_to_first": c.decodes,
                "naive_fast_forward_warning": c.naive_warned,
                "messages": c.messages,
                "failures": c.failures,
                "expected": c.point.expected,
                "state": c.point.state if not variant.is_loader else _jsonable(c.point.state),
            } for c in cells],
        })
    return harness.table(columns, lines), rows


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def parse_args(argv: Iterable[str] | None) -> tuple[argparse.Namespace, int, int]:
    """The options, N and the repeats per cell (``--quick``'s unless given)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--n", type=int, default=None,
                        help=f"stream length (default {DEFAULT_N:_}; {QUICK_N:_} with --quick)")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"timed repeats per cell (default {DEFAULT_REPEATS}; {QUICK_REPEATS} with --quick)")
    parser.add_argument("--slow-repeats", type=int, default=DEFAULT_SLOW_REPEATS,
                        help="repeats of a cell whose first repeat is slower than --slow-threshold "
                             f"(default {DEFAULT_SLOW_REPEATS})")
    parser.add_argument("--slow-threshold", type=float, default=DEFAULT_SLOW_THRESHOLD_S,
                        help=f"seconds (default {DEFAULT_SLOW_THRESHOLD_S})")
    parser.add_argument("--decode-iters", type=int, default=DEFAULT_DECODE_ITERS,
                        help=f"loop length of decode (default {DEFAULT_DECODE_ITERS}, ~2 us)")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: N={QUICK_N:_}")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="dump the raw numbers here")
    args = parser.parse_args(list(argv) if argv is not None else None)
    n = args.n if args.n is not None else (QUICK_N if args.quick else DEFAULT_N)
    repeats = args.repeats if args.repeats is not None else (QUICK_REPEATS if args.quick else DEFAULT_REPEATS)
    if n < 10 * WORLD_SIZE * CHECK or repeats < 1 or args.slow_repeats < 1 or args.decode_iters < 0:
        parser.error("need --n >= 160, --repeats >= 1, --slow-repeats >= 1, --decode-iters >= 0")
    return args, n, repeats


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: Iterable[str] | None = None) -> int:
    global _decode_iters
    args, n, repeats = parse_args(argv)
    _decode_iters = args.decode_iters
    share = len(range(RANK, n, WORLD_SIZE))
    session = harness.Session()
    cost = decode_cost_us()
    log(f"decode: {cost:.2f} us per call; preparing the uninterrupted runs ...")
    by_key, prep_s = prepare_cells(n, share)
    log("timing ...")
    run(list(by_key.values()), n, repeats, args.slow_repeats, args.slow_threshold, log)
    elapsed = session.elapsed

    text, rows = table(VARIANTS, by_key, n)
    takens = [by_key[("fast", f)].point.taken for f in FRACTIONS]
    print(session.header(f"N={n:,}, repeats={repeats} (median; slow cells {min(repeats, args.slow_repeats)})"))
    print()
    print(f"Slot {RANK} of {WORLD_SIZE} (rank {RANK}, world size {WORLD_SIZE}, no workers), a share of "
          f"{share:,} elements; resume after {', '.join(f'{t:,}' for t in takens)} of them. "
          f"`decode` costs {cost:.2f} µs per call. Time to the first element after "
          f"`load_state_dict` (median); whole run {elapsed:.0f} s.")
    print()
    print(text)
    failures = print_failures(by_key)
    if args.json is not None:
        session.dump(args.json, n=n, rank=RANK, world_size=WORLD_SIZE, share=share, fractions=list(FRACTIONS),
                     repeats=repeats, slow_repeats=args.slow_repeats, slow_threshold_s=args.slow_threshold,
                     decode_iters=args.decode_iters, decode_us=cost, prepare_s=prep_s, rows=rows)
        log(f"wrote {args.json}")
    return 1 if failures else 0


def prepare_cells(n: int, share: int) -> tuple[dict[tuple[str, float], Cell], dict[str, float]]:
    """Every variant's uninterrupted run (``prepare``): a cell per (variant, resume
    point), and each variant's preparation time."""
    by_key: dict[tuple[str, float], Cell] = {}
    prep_s: dict[str, float] = {}
    for variant in VARIANTS:
        points, seconds = prepare(variant, n, share)
        prep_s[variant.key] = seconds
        log(f"  {variant.key}: {seconds:.2f} s")
        for point in points:
            by_key[(variant.key, point.fraction)] = Cell(variant, point)
    return by_key, prep_s


def print_failures(by_key: dict[tuple[str, float], Cell]) -> list[tuple[tuple[str, float], list[str]]]:
    """Print the cells whose resumed run was wrong, and those whose fast-forward warning
    was not what it should be (only the naive loader past 0 % warns); the wrong ones."""
    failures = [(key, c.failures) for key, c in by_key.items() if c.failures]
    unexpected = [key for key, c in by_key.items()
                  if c.naive_warned != (key[0] == "naive" and c.point.taken > 0)]
    if failures or unexpected:
        print()
        for (key, fraction), msgs in failures:
            print(f"CORRECTNESS FAILURE {key} at {fraction:.0%}: {msgs[0]}")
        for key, fraction in unexpected:
            print(f"UNEXPECTED fast-forward warning state for {key} at {fraction:.0%}: "
                  f"{by_key[(key, fraction)].naive_warned}")
    return failures


if __name__ == "__main__":
    sys.exit(main())
