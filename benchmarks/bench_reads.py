"""How many times each element is *decoded* (and what that costs in CPU) when a
stream is split over 4 ranks × 2 DataLoader workers, for ``.dist_shard()`` and for
the recipes people use today, in one run, on the same data.

What is measured
----------------
Every variant runs on a fresh gloo group of ``WORLD_SIZE = 4`` ranks on 127.0.0.1,
every rank iterating its pipeline through ``DataLoader(pipe, batch_size=None,
num_workers=2, multiprocessing_context="fork")``, so there are ``S = 8`` slots
(``harness.run_job``). The data are the element ids ``0 .. N-1`` (default
``N = 2000``, ``--n``); every variant yields those ids (decode returns the id),
so the classic per-value modulo recipe can run on them. ``decode`` is the
harness's calibrated busy loop, ~0.5 ms of CPU a call (the *measured decode
cost*, measured in the parent): decoding every element exactly once costs
``ideal = N × cost`` CPU seconds (~1 s by default).

For each variant the table reports:

decodes / N
    decode calls in every process (every DataLoader worker reports its own when
    its iteration ends; ranks only receive), over all 4 ranks and 8 workers, / N.
CPU s
    user + sys CPU of the 4 ranks and their joined workers (``harness.Meter``)
    from just after the pipeline is built to after the workers are joined:
    interpreter start-up, ``import torch`` and the gloo rendezvous are outside.
    The JSON also has a cross-check, ``cpu_process_time_s``: the ranks'
    ``time.process_time()`` over the same window plus each worker's around its
    own iteration.
CPU / ideal
    ``CPU s / (N × measured decode cost)``.
(CPU − floor) / ideal
    the same without the harness floor (the CPU of row 0, which decodes
    nothing): what the reading and decoding cost on top of running 12 processes
    and passing N elements through the DataLoader's queues.
wall s
    the slowest rank's wall time over the window (ranks start together). 12 busy
    processes share the machine's cores, so on a small machine wall ≈ CPU / cores.
exactly-once
    the multiset of everything the 8 slots yielded against ``0 .. N-1`` (each
    once); ✗ with the duplicate / missing counts, or the error. A variant that
    fails is reported, never fatal to the script.

The ``harness floor`` row runs the fast path with no decode at all: its CPU is
the cost of the processes, the DataLoader and the queues alone, which every
other row pays too (on a 2-core VM: ~0.4 s for N = 2000, i.e. ~0.4 × the ideal,
so no row can get within 1.25 × of the ideal on raw CPU at this decode cost).
Targets, stated under the table: 1.00 × N decodes and CPU within 1.25 × of the
ideal for the ``dist_shard`` fast path (with and without ``shuffle=True``),
pushdown, and unit mode with ``sizes`` and a sequence-returning ``expand``; the
``target`` column says whether they are met on raw CPU or only net of the
floor. The line under the table compares the decode cost measured in the idle
parent with what a decode costs inside the loaded workers. Nothing is asserted:
this is a benchmark, not a test.

Variants
--------
classic modulo
    ``ClassicModuloIterDataPipe(IterableWrapper(range(N)).map(decode))``: decode
    must come first (the recipe looks at values), every slot decodes everything.
``sharding_filter``
    ``IterableWrapper(range(N)).map(decode).sharding_filter()``; the DataLoader
    shards it over ranks × workers itself.
every slot skips (HF-style)
    ``EverySlotSkips``: every slot iterates the full decoded stream and keeps
    every S-th element with ``itertools.islice``. This is what Hugging Face
    ``datasets.distributed.split_dataset_by_node`` does for an
    ``IterableDataset`` whose number of shards is not a multiple of the world
    size: "each node keeps 1 example out of world_size, skipping the other
    examples" (a ``.map()`` before it runs on every example on every node,
    huggingface/datasets#5961). In HF the DataLoader workers of a node then split
    by *shards*, so with a single shard one worker per node does all the work
    (world_size × decode); here the skip is done per slot, like
    ``sharding_filter`` placed after the decode (S × decode).
``dist_shard`` element mode
    over ``IterOnly`` (only ``__iter__``, no random access): decode after the
    shard; decode before the shard with ``pushdown=False`` (the naive placement);
    decode before the shard with pushdown (the default: selection moves below the
    1:1 map). Over a list / range: the fast path (a slot indexes its positions),
    also with ``shuffle=True``.
``dist_shard`` unit mode
    16 units (``--units``) of ~N/16 consecutive ids; ``expand(unit)`` returns a
    lazy sequence whose ``__getitem__`` decodes, or a generator decoding every
    element it yields (a slot that starts inside a unit skips with ``islice``,
    which decodes the skipped elements). With 16 equal units and 8 slots every
    slot's block is exactly 2 whole units, so nothing is skipped; the ``uneven``
    rows use 16 units of deterministic unequal sizes (same N) so that the blocks
    start inside units, as they do with real files.

How to run
----------
::

    .venv/bin/python benchmarks/bench_reads.py                 # N=2000, ~2-3 min on 2 cores
    .venv/bin/python benchmarks/bench_reads.py --quick         # smoke run, N=400
    .venv/bin/python benchmarks/bench_reads.py --json reads.json --only fast_path,pushdown
    .venv/bin/python benchmarks/bench_reads.py --carry         # even="carry" against "drop", 3 epochs

It prints the harness's header line (command, versions, cores, load average) with
N and the decode cost, and a Markdown table. Only torch, distshard and the
standard library are needed. Every wait is bounded (``--timeout`` per variant,
also the gloo and DataLoader timeout).

Unit mode's sizes and ``expand`` functions are in ``reads_units.py``; this script
has the variants, runs them and prints the tables.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from torch.utils.data import get_worker_info
from torch.utils.data.datapipes.datapipe import IterDataPipe
from torch.utils.data.datapipes.iter import IterableWrapper

import distshard  # noqa: F401  (registers .dist_shard())
import harness
from distshard.baselines import ClassicModuloIterDataPipe
from harness import Col, IterOnly
from reads_units import ExpandIterator, ExpandSequence, unit_bounds, unit_sizes

WORLD_SIZE = 4
NUM_WORKERS = 2
NUM_SLOTS = WORLD_SIZE * NUM_WORKERS
DEFAULT_N = 2000
QUICK_N = 400
DEFAULT_UNITS = 16
DEFAULT_TIMEOUT = 120.0
DECODE_TARGET_S = 0.5e-3
TARGET_DECODES = 1.00
TARGET_CPU_RATIO = 1.25


class Decode(harness.Decode):
    """``decode(element_id) -> element_id`` after ~0.5 ms of CPU; counts its calls."""

    def __call__(self, element: int) -> int:
        self.work(element)
        return element


# -- sources and the baselines' pipes ---------------------------------------------------


class EverySlotSkips(IterDataPipe):
    """HF-style "every node reads everything and skips": each slot iterates the
    whole incoming (decoded) stream and keeps every ``S``-th element with
    ``islice``. Rank / world size from ``torch.distributed``, worker from torch."""

    def __init__(self, source_datapipe: IterDataPipe) -> None:
        super().__init__()
        self.source_datapipe = source_datapipe

    def __iter__(self) -> Iterator[Any]:
        import torch.distributed as dist

        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        yield from islice(self.source_datapipe, rank * workers + worker, None, world * workers)


# -- the variants -------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    code: str  # the pipeline as the table shows it
    target: bool = False  # the 1.00 × N / 1.25 × CPU targets apply


VARIANTS = [
    Variant("floor", "harness floor (no decode)",
            "IterableWrapper(range(N)).dist_shard()"),
    Variant("classic", "classic per-value modulo",
            "ClassicModuloIterDataPipe(IterableWrapper(range(N)).map(decode))"),
    Variant("sharding_filter", "torch `sharding_filter`",
            "IterableWrapper(range(N)).map(decode).sharding_filter()"),
    Variant("every_slot_skips", "every slot skips (HF-style)",
            "EverySlotSkips(IterableWrapper(range(N)).map(decode))"),
    Variant("shard_then_decode", "dist_shard, decode after",
            "IterableWrapper(iter_only).dist_shard().map(decode)"),
    Variant("no_pushdown", "dist_shard, decode before, pushdown=False",
            "IterableWrapper(iter_only).map(decode).dist_shard(pushdown=False)"),
    Variant("pushdown", "dist_shard pushdown",
            "IterableWrapper(iter_only).map(decode).dist_shard()", target=True),
    Variant("fast_path", "dist_shard fast path",
            "IterableWrapper(list(range(N))).map(decode).dist_shard()", target=True),
    Variant("fast_path_shuffle", "dist_shard fast path, shuffle=True",
            "IterableWrapper(range(N)).map(decode).dist_shard(shuffle=True)", target=True),
    Variant("units_seq", "units + sizes, sequence expand",
            "IterableWrapper(units).dist_shard(expand=seq, sizes=sizes)", target=True),
    Variant("units_iter", "units + sizes, iterator expand",
            "IterableWrapper(units).dist_shard(expand=gen, sizes=sizes)"),
    Variant("units_seq_uneven", "uneven units + sizes, sequence expand",
            "IterableWrapper(units).dist_shard(expand=seq, sizes=uneven)", target=True),
    Variant("units_iter_uneven", "uneven units + sizes, iterator expand",
            "IterableWrapper(units).dist_shard(expand=gen, sizes=uneven)"),
    Variant("units_no_sizes", "units without sizes, sequence expand",
            "IterableWrapper(units).dist_shard(expand=seq)"),
    Variant("units_shuffle", "units + sizes, sequence expand, shuffle=True",
            "IterableWrapper(units).dist_shard(expand=seq, sizes=sizes, shuffle=True)"),
]
BY_KEY = {v.key: v for v in VARIANTS}


def build_pipe(key: str, n: int, iters: int, units: int) -> IterDataPipe:
    """The pipeline of variant ``key`` (built in each rank, after the group exists)."""
    decode = Decode(iters)
    if key == "floor":
        return IterableWrapper(range(n)).dist_shard()
    if key == "classic":
        return ClassicModuloIterDataPipe(IterableWrapper(range(n)).map(decode))
    if key == "sharding_filter":
        return IterableWrapper(range(n)).map(decode).sharding_filter()
    if key == "every_slot_skips":
        return EverySlotSkips(IterableWrapper(range(n)).map(decode))
    if key == "shard_then_decode":
        return IterableWrapper(IterOnly(range(n))).dist_shard().map(decode)
    if key == "no_pushdown":
        return IterableWrapper(IterOnly(range(n))).map(decode).dist_shard(pushdown=False)
    if key == "pushdown":
        return IterableWrapper(IterOnly(range(n))).map(decode).dist_shard()
    if key == "fast_path":
        return IterableWrapper(list(range(n))).map(decode).dist_shard()
    if key == "fast_path_shuffle":
        return IterableWrapper(range(n)).map(decode).dist_shard(shuffle=True)
    if key.startswith("units_"):
        sizes = unit_sizes(n, units, uneven=key.endswith("_uneven"))
        bounds = unit_bounds(sizes)
        expand: Callable[[int], Any]
        expand = (ExpandIterator if "_iter" in key else ExpandSequence)(bounds, decode)
        source = IterableWrapper(list(range(units)))
        if key == "units_no_sizes":
            return source.dist_shard(expand=expand)
        return source.dist_shard(expand=expand, sizes=sizes, shuffle=key == "units_shuffle")
    raise ValueError(f"unknown variant {key!r}")


def describe_reads(key: str, n: int, units: int) -> str:
    """How each slot reads, from ``read_plan()`` for element-mode ``dist_shard``."""
    static = {
        "classic": "every slot decodes all, keeps value ≡ −slot (mod S)",
        "sharding_filter": "every slot decodes all, keeps every S-th",
        "every_slot_skips": "every slot decodes all, islice every S-th",
        "units_seq": "own block, indexed",
        "units_seq_uneven": "own block, indexed",
        "units_iter": "own block, islice inside units",
        "units_iter_uneven": "own block, islice inside units",
        "units_no_sizes": "whole units by rounds",
        "units_shuffle": "own permuted positions, indexed",
    }
    if key in static:
        return static[key]
    plan = harness.read_plan(build_pipe(key, min(n, 8), 0, units))
    how = "indexes" if plan.sequence is not None else "streams (islice)"
    if plan.maps:
        how += ", map pushed down"
    if key == "shard_then_decode":
        how += ", map after"
    elif not plan.maps and key != "floor":
        how += ", map on every element"
    return how


# -- one variant on a gloo group ----------------------------------------------------------------


@dataclass
class ReadsJob(harness.Job):
    """Every rank builds variant ``key`` (with ``even``: the several-epochs pipeline of
    ``key``) and iterates it through a forking 2-worker DataLoader; the window starts
    after the build."""

    key: str = "floor"
    n: int = 0
    iters: int = 0
    units: int = DEFAULT_UNITS
    even: str | None = None
    window_includes_build: bool = False

    def build(self, rank: int) -> IterDataPipe:
        if self.even is not None:
            return build_epochs_pipe(self.key, self.even, self.n, self.iters, self.units)
        return build_pipe(self.key, self.n, self.iters, self.units)


def run_variant(variant: Variant, n: int, iters: int, units: int, timeout: float,
                cost: float) -> dict[str, Any]:
    run = harness.run_job(ReadsJob(key=variant.key, n=n, iters=iters, units=units, timeout=timeout,
                                   world_size=WORLD_SIZE, num_workers=NUM_WORKERS))
    once = harness.exactly_once(run.values(), range(n))
    measured, workers = run.measured, run.workers
    ideal = n * cost
    return {
        "key": variant.key,
        "label": variant.label,
        "code": variant.code,
        "target": variant.target,
        "complete": run.complete,
        "decodes": run.total("decodes"),
        "decodes_per_n": run.total("decodes") / n,
        "cpu_s": run.cpu_s,
        "cpu_process_time_s": sum(r["rank_process_time_s"] for r in measured) + sum(w["iter_cpu_s"] for w in workers),
        "cpu_ratio": run.cpu_s / ideal if ideal and measured else None,
        "wall_s": run.wall_s,
        "group_s": run.seconds,
        "yielded": len(run.values()),
        "duplicates": once.duplicates,
        "missing": once.missing,
        "exactly_once": not run.errors and once.ok,
        "once_cell": once.cell(run.errors[0] if run.errors else None),
        "errors": run.errors,
        "per_rank": [{k: r.get(k) for k in ("rank", "wall_s", "rank_cpu_s", "workers_cpu_s", "rank_process_time_s",
                                            "rank_counts")} for r in run.ranks],
        "per_worker": sorted(workers, key=lambda w: (w["rank"], w["worker"])),
        "per_slot_yield": sorted((w["rank"], w["worker"], w["yielded"]) for w in workers),
        "per_process_decodes": sorted((w["rank"], w["worker"], w["counts"].get("decodes", 0)) for w in workers),
    }


def in_situ_decode_cost(rows: list[dict[str, Any]], floor_row: dict[str, Any] | None) -> float | None:
    """What a decode costs inside the workers, under the benchmark's own load: the
    workers' iteration CPU beyond the floor's, per decode call (median over rows)."""
    if floor_row is None:
        return None
    base = sum(w["iter_cpu_s"] for w in floor_row["per_worker"])
    costs = [(sum(w["iter_cpu_s"] for w in row["per_worker"]) - base) / row["decodes"]
             for row in rows if row["complete"] and row["decodes"] and row is not floor_row]
    return statistics.median(costs) if costs else None


def _target_cell(row: dict[str, Any]) -> str:
    """Whether the stated targets hold: 1.00 × N decodes, exactly-once, and CPU within
    1.25 × of the ideal, raw and net of the harness floor (row 0)."""
    if not row["target"]:
        return "—"
    decodes_ok = (row["complete"] and row["exactly_once"]
                  and abs(row["decodes_per_n"] - TARGET_DECODES) < 0.005)
    raw_ok = row["cpu_ratio"] is not None and row["cpu_ratio"] <= TARGET_CPU_RATIO
    net_ok = row["net_ratio"] is not None and row["net_ratio"] <= TARGET_CPU_RATIO
    if decodes_ok and raw_ok:
        return "met"
    if decodes_ok and net_ok:
        return "decodes met; CPU met net of floor, not raw"
    what = []
    if not decodes_ok:
        what.append("decodes / exactly-once")
    if not net_ok:
        what.append("CPU")
    return "**missed**: " + ", ".join(what)


COLUMNS = [Col("#", 0), Col("variant"), Col("pipeline"), Col("each slot"), Col("decodes / N", 2), Col("CPU s", 2),
           Col("CPU / ideal", 2, "×"), Col("(CPU − floor) / ideal", 2, "×"), Col("wall s", 2), Col("exactly-once"),
           Col("target")]


def table(rows: list[dict[str, Any]]) -> str:
    partial = " (partial)"
    return harness.table(COLUMNS, [[
        index,
        row["label"],
        f"`{row['code']}`",
        row["reads"],
        row["decodes_per_n"] if row["complete"] else f"{row['decodes_per_n']:.2f}{partial}",
        row["cpu_s"] if row["complete"] else f"{row['cpu_s']:.2f}{partial}",
        row["cpu_ratio"],
        row["net_ratio"],
        row["wall_s"],
        row["once_cell"],
        _target_cell(row),
    ] for index, row in enumerate(rows)])


# -- even="carry" against even="drop", over several epochs ----------------------------------------

CARRY_EPOCHS = 3
CARRY_ROUNDS = 5
CARRY_SOURCES = {
    "fast_path": "IterableWrapper(list(range(N))).map(decode).dist_shard(even=...)",
    "units_seq_uneven": "IterableWrapper(units).dist_shard(expand=seq, sizes=uneven, even=...)",
}


def build_epochs_pipe(source: str, even: str, n: int, iters: int, units: int) -> IterDataPipe:
    decode = Decode(iters)
    if source == "fast_path":
        return IterableWrapper(list(range(n))).map(decode).dist_shard(even=even)
    sizes = unit_sizes(n, units, uneven=True)
    return IterableWrapper(list(range(units))).dist_shard(
        expand=ExpandSequence(unit_bounds(sizes), decode), sizes=sizes, even=even)


def run_epochs(source: str, even: str, n: int, iters: int, units: int, epochs: int,
               timeout: float) -> dict[str, Any]:
    """One gloo group running ``epochs`` epochs (``set_epoch``, a fresh 2-worker
    DataLoader iterator each); what was consumed against the epochs' concatenated
    streams (each epoch ``0 .. n-1``); CPU of the ranks and their joined workers over
    all of them."""
    run = harness.run_job(ReadsJob(key=source, even=even, n=n, iters=iters, units=units, epochs=epochs,
                                   timeout=timeout, world_size=WORLD_SIZE, num_workers=NUM_WORKERS))
    check = harness.epochs_check(Counter(run.values()), range(n), run.workers, epochs=epochs, even=even,
                                 unit=NUM_SLOTS, slots=NUM_SLOTS)
    return {**check, "errors": run.errors, "cpu_s": run.cpu_s, "exact": not run.errors and check["exact"]}


def carry_rows(n: int, iters: int, units: int, epochs: int, rounds: int, timeout: float) -> list[dict[str, Any]]:
    """``even="drop"`` and ``even="carry"`` of each source, alternating, ``rounds`` times."""
    rows = []
    for source in CARRY_SOURCES:
        runs: dict[str, list[dict[str, Any]]] = {"drop": [], "carry": []}
        for r, order in harness.rounds(["drop", "carry"], rounds):
            for even in order:
                runs[even].append(run_epochs(source, even, n, iters, units, epochs, timeout))
                print(f"  {source} even={even} round {r + 1}: CPU {runs[even][-1]['cpu_s']:.2f} s",
                      file=sys.stderr, flush=True)
        drop_cpu = statistics.median(run["cpu_s"] for run in runs["drop"])
        for even in ("drop", "carry"):
            last = runs[even][-1]
            cpu = statistics.median(run["cpu_s"] for run in runs[even])
            rows.append({**last, "source": source, "even": even, "cpu_s": cpu, "cpu_vs_drop": cpu / drop_cpu,
                         "cpu_per_delivered_ms": 1e3 * cpu / last["delivered"],
                         "all_exact": all(run["exact"] and run["equal_slots"] for run in runs[even]),
                         "cpu_runs": [run["cpu_s"] for run in runs[even]]})
    return rows


def carry_table(rows: list[dict[str, Any]], n: int, epochs: int) -> str:
    columns = [Col("source"), Col("even"), Col(f"per-slot counts, epochs 0..{epochs - 1}"), Col("equal slots"),
               Col("delivered", 0), Col("dropped", 0), Col("padded", 0), Col(f"left for epoch {epochs}", 0),
               Col("exact"), Col("CPU s (median)", 2), Col("CPU / drop's", 3, "×"), Col("CPU ms / delivered", 3)]
    return harness.table(columns, [[
        f"`{CARRY_SOURCES[row['source']].replace('...', repr(row['even']))}`", row["even"],
        harness.slot_counts(row["per_epoch_slots"]), row["equal_slots"], row["delivered"], row["dropped"],
        row["padded"], row["left_for_next_epoch"], row["all_exact"], row["cpu_s"], row["cpu_vs_drop"],
        row["cpu_per_delivered_ms"]] for row in rows])


def parse_args(argv: Iterable[str] | None) -> tuple[argparse.Namespace, int, list[Variant]]:
    """The options, N, and the variants to run (the floor first, always)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--n", type=int, default=None,
                        help=f"elements (default {DEFAULT_N}; {QUICK_N} with --quick)")
    parser.add_argument("--units", type=int, default=DEFAULT_UNITS,
                        help=f"units in unit mode (default {DEFAULT_UNITS})")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help=f"seconds any variant may take (default {DEFAULT_TIMEOUT:.0f})")
    parser.add_argument("--only", default=None,
                        help="comma-separated variant keys: " + ",".join(BY_KEY))
    parser.add_argument("--quick", action="store_true", help=f"smoke run: N={QUICK_N}")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write the raw numbers to PATH")
    parser.add_argument("--carry", action="store_true",
                        help=f"only the even='carry' vs even='drop' rows: {CARRY_EPOCHS} epochs of N + 3 "
                             f"elements (a tail every epoch), {CARRY_ROUNDS} alternating rounds")
    args = parser.parse_args(None if argv is None else list(argv))
    n = args.n if args.n is not None else (QUICK_N if args.quick else DEFAULT_N)
    if args.units < 1 or n < args.units:
        parser.error("need --units >= 1 and --n >= --units")
    variants = harness.choose(args.only, BY_KEY, parser)
    if variants[0].key != "floor":  # the floor is needed to read every other row
        variants = [BY_KEY["floor"], *[v for v in variants if v.key != "floor"]]
    return args, n, variants


def main(argv: Iterable[str] | None = None) -> int:
    args, n, variants = parse_args(argv)
    session = harness.Session()
    iters, cost = harness.calibrate(DECODE_TARGET_S, Decode)
    if args.carry:
        return carry_main(args, n, session, iters, cost)
    rows = measure_rows(variants, n, iters, args.units, args.timeout, cost)
    elapsed = session.elapsed
    ideal = n * cost
    floor_row = net_of_floor(rows, ideal)
    in_situ = in_situ_decode_cost(rows, floor_row)
    print_report(session, rows, n, args.units, iters, cost, ideal, in_situ, elapsed)
    session.dump(args.json, n=n, units=args.units, world_size=WORLD_SIZE, num_workers=NUM_WORKERS,
                 decode_iters=iters, decode_cost_s=cost, ideal_cpu_s=ideal, in_situ_decode_cost_s=in_situ, rows=rows)
    return 0


def carry_main(args: argparse.Namespace, n: int, session: harness.Session, iters: int, cost: float) -> int:
    """``--carry``: the even="carry" against even="drop" rows over N + 3 elements an
    epoch, their table and notes, and ``--json``."""
    epochs_n = n + 3  # not a multiple of S: every epoch has a tail to drop or carry
    rows = carry_rows(epochs_n, iters, args.units, CARRY_EPOCHS, CARRY_ROUNDS, args.timeout)
    print(session.header(
        f"N={epochs_n:,} per epoch, {CARRY_EPOCHS} epochs, S={NUM_SLOTS} ({WORLD_SIZE} ranks × {NUM_WORKERS} "
        f"fork workers, gloo), decode = {cost * 1e3:.3f} ms CPU, {CARRY_ROUNDS} rounds alternating drop / "
        f"carry (medians), {session.elapsed:.0f} s"))
    print()
    print(carry_table(rows, epochs_n, CARRY_EPOCHS))
    print()
    print("dropped: elements of the epochs' streams never delivered (for carry: not counting the last "
          "epoch's tail, which opens the next epoch: 'left for epoch E'); padded: deliveries beyond one per "
          "element of a stream; exact: the multiset delivered over all epochs is the concatenated streams' "
          "prefix (carry) or every epoch but its last N mod S (drop). CPU: user+sys of the 4 ranks and their "
          "workers over all epochs. Target: carry's CPU ≤ 1.05× drop's, equal slots, 0 dropped, 0 padded.")
    session.dump(args.json, n=epochs_n, epochs=CARRY_EPOCHS, decode_cost_s=cost, rows=rows)
    return 0


def measure_rows(variants: list[Variant], n: int, iters: int, units: int, timeout: float,
                 cost: float) -> list[dict[str, Any]]:
    """Every variant once, in order, each with how its slots read; progress on stderr."""
    rows = []
    for variant in variants:
        row = run_variant(variant, n, iters, units, timeout, cost)
        row["reads"] = describe_reads(variant.key, n, units)
        rows.append(row)
        print(f"  {variant.key}: decodes {row['decodes_per_n']:.2f}×N, CPU {row['cpu_s']:.2f} s, "
              f"{'ok' if row['exactly_once'] else 'VIOLATED'} ({row['group_s']:.1f} s)",
              file=sys.stderr, flush=True)
    return rows


def net_of_floor(rows: list[dict[str, Any]], ideal: float) -> dict[str, Any] | None:
    """Every row's ``floor_cpu_s`` and ``net_ratio`` ((CPU − floor) / ideal); the floor's
    row (row 0, if it completed) or None."""
    floor_row = rows[0] if rows[0]["key"] == "floor" and rows[0]["complete"] else None
    floor = None if floor_row is None else floor_row["cpu_s"]
    for row in rows:
        row["floor_cpu_s"] = floor
        row["net_ratio"] = (None if floor is None or not ideal or row["key"] == "floor"
                            else (row["cpu_s"] - floor) / ideal)
    return floor_row


def print_report(session: harness.Session, rows: list[dict[str, Any]], n: int, units: int, iters: int, cost: float,
                 ideal: float, in_situ: float | None, elapsed: float) -> None:
    """The header, the table, what its columns mean and the in-situ decode cost."""
    print(session.header(
        f"N={n:,}, S={NUM_SLOTS} ({WORLD_SIZE} ranks × {NUM_WORKERS} fork workers, gloo), units={units}, "
        f"decode = {cost * 1e3:.3f} ms CPU (iters={iters}), ideal = N × decode = {ideal:.2f} s (the benchmark "
        f"itself runs 12 processes; other load inflates CPU per decode)"))
    print()
    print(table(rows))
    print()
    print(f"decodes / N: decode calls summed over all {WORLD_SIZE} ranks and {NUM_SLOTS} workers. "
          f"CPU s: user+sys of every rank (RUSAGE_SELF) and its joined DataLoader workers "
          f"(RUSAGE_CHILDREN), from DataLoader creation to workers joined. CPU / ideal: CPU s / "
          f"(N × measured decode cost). wall s: slowest rank. exactly-once: the multiset of all "
          f"yielded ids vs 0..N-1. Targets (dist_shard fast path ± shuffle, pushdown, units + sizes "
          f"+ sequence expand): {TARGET_DECODES:.2f} × N decodes and CPU ≤ {TARGET_CPU_RATIO}× ideal. "
          f"Row 0 (no decode) is the harness floor every row pays (process and DataLoader costs: "
          f"fork, worker start/exit, passing N elements through the queues); (CPU − floor) / ideal "
          f"leaves it out. Total {elapsed:.0f} s.")
    if in_situ is not None:
        print(f"A decode measured {cost * 1e3:.3f} ms in the idle parent; inside the workers, with "
              f"{WORLD_SIZE * (NUM_WORKERS + 1)} processes sharing {os.cpu_count()} cores, it cost "
              f"{in_situ * 1e3:.3f} ms ({in_situ / cost:.2f}×: workers' iteration CPU beyond the "
              f"floor's, per decode, median over rows). The rest of (CPU − floor) / ideal in the "
              f"1.00 × N rows is not decoding: see per_rank / per_worker in --json.")


if __name__ == "__main__":
    sys.exit(main())
