"""Mixing sources by weight over 4 gloo ranks × 2 workers: ``distshard.mix`` against
torchdata.nodes' ``MultiNodeWeightedSampler`` and Hugging Face
``interleave_datasets`` + ``split_dataset_by_node``, in one run, on the same data.

The data and the job
--------------------
Three random-access sources of small records (dicts with a source name, an index
and a short text), ``web`` / ``code`` / ``math`` = 20,000 / 5,000 / 2,000
records, mixed 70 / 20 / 10 (``--quick``: 4,000 / 1,000 / 400). The job takes
``STEPS = 100`` steps (``--quick``: 20) of a global batch of 256, i.e. a per-rank
batch of 64 on ``WORLD_SIZE = 4`` ranks: 25,600 draws, so ``code`` and ``math``
are each taken more than once over (5,120 draws of 5,000; 2,560 of 2,000) and
every row must cycle them. ``decode`` is the same everywhere: a calibrated busy
loop (~50 µs of CPU, chained BLAKE2b) that counts its calls in a counter shared
by the rank and the processes it forks.

Every row runs on a real gloo group on 127.0.0.1 (``harness.run_job``, each rank
a spawned process, a fresh group per row and round); the decode runs
in 2 worker processes per rank:

(a) ``distshard``
    ``distshard.mix({name: IterableWrapper(records).map(decode)}, weights,
    samples=25_600).dist_shard(even="drop", multiple_of=64)`` through
    ``DataLoader(batch_size=64, num_workers=2, collate_fn=list)`` on every rank:
    lists of 64 ``(source, index)``, what the peers' rows deliver.
(a') the same with the DataLoader's ``default_collate`` (two tensors a batch,
    which workers pass through shared memory), and with ``num_workers=0``
    (decode in the rank): diagnostic rows, see "per training step" below.
(a'') ``DistShardNode(distshard.mix(records...))`` (the rank's share of the mix,
    undecoded) → ``ParallelMapper(decode, 2, "process", prebatch=64)`` →
    ``Batcher(64)`` → ``Loader``: distshard's mix in torchdata.nodes' loader.
(p) the pipeline of (a) in two weight phases (70 / 20 / 10, then 30 / 30 / 40
    from position 12,900), and weighted by cost (every record's token count:
    70 / 20 / 10 of the tokens): a table of their own, with their own bound over
    every prefix of the reconstructed global stream (a phase's counts within 1 of
    its shares counted from its start; a source's tokens within the largest
    record's tokens of its share of the tokens).
(b) torchdata.nodes 0.11 (dev venv)
    every rank builds its own nodes over its slice ``records[rank::4]`` of each
    source: ``MultiNodeWeightedSampler(nodes, weights,
    stop_criteria=CYCLE_FOREVER, seed=0)`` (it seeds each rank from ``(seed,
    rank)`` itself), ``Take(6400)`` (a 20-line node in ``mix_rows.py``: torchdata
    0.11 has none; it ends the stream at the rank's share, so no read-ahead is decoded
    past the 100th step), ``ParallelMapper(decode, num_workers=2,
    method="process", prebatch=64)`` (``prebatch`` sends 64 records per message
    to the workers, which costs less CPU than one message per record for
    records this small), ``Batcher(64)``, ``Loader``.
(b') the same with ``ParallelMapper``'s default (no ``prebatch``).
(c) HF ``datasets`` 4.8.5 (the benchmark-only venv ``benchmarks/.venv``, run as a
    subprocess with that interpreter, numbers back as JSON)
    each source ``Dataset.from_dict(columns).to_iterable_dataset(num_shards=8)``,
    ``interleave_datasets(sources, probabilities=[.7, .2, .1], seed=rank,
    stopping_strategy="all_exhausted")`` (a seed per rank: with one seed every
    rank draws the same sequence of sources), ``split_dataset_by_node``,
    ``.map(decode)``, ``DataLoader(batch_size=64, num_workers=2)``. 8 shards
    divide 4 ranks × 2 workers, HF's best case: each worker reads its own shard
    of every source. ``.take(3200)`` stops every worker at its share (HF's
    ``take`` counts per DataLoader worker), so no read-ahead is decoded past the
    100th step.
(c') the same with 20 / 5 / 2 shards (``interleave`` keeps the smallest count,
    2, which 4 ranks do not divide): every rank reads every example and keeps
    one in 4, so here every rank uses the same ``seed=0`` (with a seed per rank
    the ranks would skip over different streams and overlap);
    ``.take(12800)`` (it counts before the skip).

Metrics
-------
reads / delivered
    decode calls in every process of the job / elements the ranks received in
    the 100 steps.
worst deviation per global batch of 256
    per source, the largest ``|count − 256 × weight|`` over the 100 global
    batches. A global batch is 256 consecutive positions of the global stream.
    For distshard the global stream exists, so it is reconstructed: slot
    ``s = rank × 2 + worker`` holds positions ``s, s + 8, s + 16, …``
    (``dist_shard``'s layout) and the DataLoader alternates its workers' batches;
    the reconstruction is checked against the unsharded ``mix`` (column "same
    stream"). The peers have no global stream: their global batch of a step is
    the 4 ranks' batches of that step, concatenated.
per training step
    the same deviation for what a step actually gets: the 4 ranks' batches of
    that step, concatenated, for every row. With DataLoader workers a rank's
    step-``t`` batch is 64 elements of *one* worker (``t mod 2``), so a step of
    distshard holds the positions of slots 0, 2, 4, 6 (or 1, 3, 5, 7) of 512
    consecutive positions, not 256 consecutive ones; row (a') has one slot per
    rank, so its steps are consecutive windows.
each element once per pass
    per source, with ``d`` elements delivered out of ``n``, every element must
    have been delivered ``⌊d/n⌋`` or ``⌈d/n⌉`` times (a pass is complete before
    the next one starts repeating it). Otherwise: how many elements a completed
    pass left out, and how many deliveries exceed ``⌈d/n⌉``.
CPU s / wall s
    user + sys CPU of every rank and its worker processes (``RUSAGE_SELF`` +
    ``RUSAGE_CHILDREN`` of each rank, from just before the pipeline is built to
    its workers joined), summed over the ranks; the slowest rank's wall time.
    Median over rounds (interleaved, 3 by default).

Targets for (a): reads 1.00 per delivered element, deviation ≤ 1 element per
source per global batch, CPU ≤ the best peer's; for (p): reads 1.00 and the prefix
bounds. Nothing is asserted: this is a benchmark, not a test.

How to run
----------
::

    .venv/bin/python benchmarks/bench_files.py --setup-peers   # once: benchmarks/.venv with the peers
    .venv/bin/python benchmarks/bench_mix.py                   # 3 rounds: ~3-4 min on 2 cores
    .venv/bin/python benchmarks/bench_mix.py --quick           # smaller sources, 20 steps, 1 round
    .venv/bin/python benchmarks/bench_mix.py --only distshard,hf --json mix.json

Without the peers' venv the HF rows say so.

The data and its decode are in ``mix_data.py``, the rows and the job every rank runs
in ``mix_rows.py``, their analysis in ``mix_analysis.py``; this script runs the rows
and prints the tables.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Iterable

import harness
from harness import Col
from mix_analysis import analyze, expected_stream, summarize
from mix_data import GLOBAL_BATCH, NAMES, NUM_WORKERS, WEIGHTS, WORLD_SIZE, calibration_decode
from mix_rows import BY_KEY, Variant, run_peer, run_variant

# re-exported: run_peer is called in a child by name (harness.launch)
__all__ = ["run_peer"]

SIZES = (20_000, 5_000, 2_000)
STEPS = 100
QUICK_SIZES, QUICK_STEPS = (4_000, 1_000, 400), 20
ROUNDS = 3
DECODE_TARGET_S = 50e-6
TARGET_DEVIATION = 1.0


# -- the table -------------------------------------------------------------------------------
def _dev(values: list[float]) -> str:
    return " / ".join(f"{v:.1f}" for v in values)


def _once(row: dict[str, Any]) -> str:
    passes = row["passes"]
    if not passes["left_out"] and not passes["beyond"]:
        return "✓"
    parts = []
    if passes["left_out"]:
        worst = [f"{name} {p['left_out']}" for name, p in passes["per_source"].items() if p["left_out"]]
        parts.append(f"{passes['left_out']} left out of a completed pass ({', '.join(worst)})")
    if passes["beyond"]:
        parts.append(f"{passes['beyond']} extra repeats")
    return "✗ " + "; ".join(parts)


def targets(row: dict[str, Any], best_peer_cpu: float | None) -> dict[str, Any]:
    reads_ok = f"{row['reads_max']:.2f}" == "1.00"
    deviation = max(row["global_deviation"])
    step = max(row["step_deviation"])
    cpu_ok = best_peer_cpu is not None and row["cpu_s"] <= best_peer_cpu
    return {"reads": reads_ok, "deviation": deviation <= TARGET_DEVIATION,
            "deviation_per_step": step <= TARGET_DEVIATION, "cpu": cpu_ok if best_peer_cpu is not None else None}


COLUMNS = [Col("row"), Col("pipeline (per rank)"), Col("reads / delivered", 2),
           Col("worst deviation per global batch of 256 (web / code / math)", right=True),
           Col("same, per training step as delivered", right=True), Col("same stream"),
           Col("each element once per pass"), Col("CPU s", 2), Col("wall s", 2), Col("targets")]
BOUNDS_COLUMNS = [Col("row"), Col("pipeline (per rank)"), Col("reads / delivered", 2),
                  Col("worst prefix deviation", right=True), Col("bound"), Col("same stream"),
                  Col("each element once per pass"), Col("CPU s", 2), Col("wall s", 2)]


def table(rows: list[dict[str, Any]], best_peer_cpu: float | None) -> str:
    cells = []
    for row in rows:
        variant = BY_KEY[row["key"]]
        code = variant.code
        if (instead := harness.unmeasured(row, "cpu_s", none="?", width=140)) is not None:
            cells.append([variant.label, code, instead])
            continue
        verdict = "—"
        if variant.target:
            t = targets(row, best_peer_cpu)
            words = [("reads", t["reads"]), ("deviation", t["deviation"]), ("CPU", t["cpu"])]
            met = [w for w, ok in words if ok]
            missed = [w for w, ok in words if ok is False]
            verdict = ("met: " + ", ".join(met) if met else "") + (
                ("; " if met else "") + "**missed**: " + ", ".join(missed) if missed else "")
            if not t["deviation_per_step"]:
                verdict += "; per step: **missed**"
        cells.append([variant.label, code, row["reads_per_delivered"], _dev(row["global_deviation"]),
                      _dev(row["step_deviation"]), row["same_stream"], _once(row), row["cpu_s"], row["wall_s"],
                      verdict])
    return harness.table(COLUMNS, cells)


def bounds_table(rows: list[dict[str, Any]]) -> str:
    """The phased and cost-weighted rows: their own prefix bound, reads, CPU."""
    cells = []
    for row in rows:
        variant = BY_KEY[row["key"]]
        if "cpu_s" not in row or "prefix" not in row:
            cells.append([variant.label, variant.code, harness.failed(row, "no global stream", 140)])
            continue
        prefix = row["prefix"]
        if prefix["unit"] == "elements":
            worst = f"{prefix['worst']:.2f} elements (from each phase's start)"
            bound = "< 1 element: " + ("**met**" if prefix["worst"] < 1 else "**missed**")
        else:
            shares = " / ".join(f"{t:.1%}" for t in prefix["token_shares"])
            samples = " / ".join(f"{t:.1%}" for t in prefix["sample_shares"])
            worst = f"{prefix['worst']:.2f} × the largest record's tokens (token shares {shares}; sample shares {samples})"
            bound = (f"≤ 1 × (the issue's: ≤ {prefix['issue_bound']:g} ×): "
                     + ("**met**" if prefix["worst"] <= 1 else "**missed**"))
        cells.append([variant.label, variant.code, row["reads_per_delivered"], worst, bound, row["same_stream"],
                      _once(row), row["cpu_s"], row["wall_s"]])
    return harness.table(BOUNDS_COLUMNS, cells)


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"sources {'/'.join(map(str, QUICK_SIZES))}, {QUICK_STEPS} steps, 1 round")
    parser.add_argument("--rounds", type=int, default=None, help=f"interleaved rounds (default {ROUNDS})")
    parser.add_argument("--only", default="", help="comma-separated rows: " + ",".join(BY_KEY))
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds a row may take")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the raw numbers")
    harness.add_child_args(parser)  # internal: one row in the peers' venv
    args = parser.parse_args(None if argv is None else list(argv))
    if args.run:
        return harness.child(args.run, args.out, globals())
    return orchestrate(args, harness.choose(args.only, BY_KEY, parser))


def orchestrate(args: argparse.Namespace, chosen: list[Variant]) -> int:
    """Run the ``chosen`` rows in interleaved rounds, print the tables, the notes and the
    target row's verdict, and write ``--json``."""
    sizes, steps = (list(QUICK_SIZES), QUICK_STEPS) if args.quick else (list(SIZES), STEPS)
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else ROUNDS)
    session = harness.Session()
    iters, cost = harness.calibrate(DECODE_TARGET_S, calibration_decode)
    runs, peer_versions = run_rounds(chosen, sizes, steps, iters, rounds, args.timeout)
    rows = [summarize(v, runs[v.key]) for v in chosen]
    peers = [row["cpu_s"] for row in rows if "cpu_s" in row and not BY_KEY[row["key"]].key.startswith("distshard")]
    best_peer = min(peers) if peers else None
    print_tables(session, rows, best_peer, sizes, steps, rounds, cost)
    print_notes(steps, rounds, cost, best_peer, session.elapsed)
    print_targets(rows, best_peer)
    session.dump(args.json, peers=peer_versions, sizes=sizes, steps=steps, weights=WEIGHTS, global_batch=GLOBAL_BATCH,
                 world_size=WORLD_SIZE, num_workers=NUM_WORKERS, decode_iters=iters, decode_cost_s=cost,
                 rounds=rounds, best_peer_cpu_s=best_peer,
                 rows=[{k: v for k, v in row.items() if k != "rounds"} | {"per_round": row.get("rounds", [])}
                       for row in rows])
    return 0


def run_rounds(chosen: list[Variant], sizes: list[int], steps: int, iters: int, rounds: int,
               timeout: float) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str]]:
    """Every chosen row once a round (the dev venv's here, the peers' in a child), each
    run analyzed (or kept as skipped); the runs by row and the peers' versions."""
    expected = {v.key: expected_stream(v.key, sizes, steps) for v in chosen if v.key.startswith("distshard")}
    runs: dict[str, list[dict[str, Any]]] = {v.key: [] for v in chosen}
    peer_versions: dict[str, str] = {}
    for r, order in harness.rounds(chosen, rounds):
        for variant in order:
            t0 = time.perf_counter()
            if variant.venv == "dev":
                run = run_variant(variant.key, sizes, steps, iters, timeout)
            else:
                run = harness.launch(__file__, "run_peer", {"key": variant.key, "sizes": sizes, "steps": steps,
                                                            "iters": iters, "timeout": timeout},
                                     peers=True, timeout=timeout, grace=60)
                peer_versions.update(run.get("versions", {}))
            if "skipped" in run:
                runs[variant.key].append(run)
            else:
                runs[variant.key].append(analyze(variant, run, sizes, steps, expected.get(variant.key)))
            print(f"#   round {r + 1}/{rounds}: {variant.key} in {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
    return runs, peer_versions


def print_tables(session: harness.Session, rows: list[dict[str, Any]], best_peer: float | None, sizes: list[int],
                 steps: int, rounds: int, cost: float) -> None:
    """The header, the main table, the phased and cost-weighted rows' table (if any
    ran) and the rounds that failed."""
    draws = steps * GLOBAL_BATCH
    print(session.header(
        f"sources {' / '.join(f'{n} {s:,}' for n, s in zip(NAMES, sizes, strict=True))}, weights "
        f"{' / '.join(f'{w:g}' for w in WEIGHTS)}; {steps} steps × global batch {GLOBAL_BATCH} = {draws:,} draws; "
        f"{WORLD_SIZE} gloo ranks × {NUM_WORKERS} workers; decode {cost * 1e6:.0f} µs CPU; {rounds} round(s), "
        "CPU medians"))
    print()
    print(table([row for row in rows if not BY_KEY[row["key"]].bounds], best_peer))
    print()
    bounded = [row for row in rows if BY_KEY[row["key"]].bounds]
    if bounded:
        print(bounds_table(bounded))
        print()
    harness.print_left_out(rows, lambda row: BY_KEY[row["key"]].label)


def print_notes(steps: int, rounds: int, cost: float, best_peer: float | None, elapsed: float) -> None:
    """What the columns mean, the targets, the ideal CPU and the run's total time."""
    draws = steps * GLOBAL_BATCH
    print(f"reads / delivered: decode calls in all processes / elements the 4 ranks received. Deviation: "
          f"per source, max over the {steps} global batches of |count − 256 × weight| (targets "
          f"{', '.join(f'{256 * w:g}' for w in WEIGHTS)}); distshard's global batches are 256 consecutive "
          f"positions of its reconstructed global stream (checked against the unsharded mix: same stream), "
          f"the peers' are the 4 ranks' batches of a step. Per training step: the 4 ranks' batches of a step, "
          f"for every row. CPU s: user+sys of the 4 ranks and their workers, median of {rounds}. "
          f"Targets for distshard: reads 1.00, deviation ≤ {TARGET_DEVIATION:g} per source per global batch, "
          f"CPU ≤ the best peer's ({'—' if best_peer is None else f'{best_peer:.2f} s'}). "
          f"Ideal CPU (decode once per draw): {draws * cost:.2f} s. Total {elapsed:.0f} s.")


def print_targets(rows: list[dict[str, Any]], best_peer: float | None) -> None:
    """The target row's figures against its targets, met or MISSED."""
    for row in rows:
        if BY_KEY[row["key"]].target and "cpu_s" in row:
            t = targets(row, best_peer)
            print(f"distshard: reads {row['reads_per_delivered']:.4f} per delivered element "
                  f"({'met' if t['reads'] else 'MISSED'}); worst deviation per global batch "
                  f"{max(row['global_deviation']):.1f} ({'met' if t['deviation'] else 'MISSED'}), per training "
                  f"step {max(row['step_deviation']):.1f} ({'met' if t['deviation_per_step'] else 'MISSED'}); "
                  f"CPU {row['cpu_s']:.2f} s vs best peer "
                  f"{'—' if best_peer is None else f'{best_peer:.2f} s'} "
                  f"({'met' if t['cpu'] else 'not measured' if t['cpu'] is None else 'MISSED'}).")


if __name__ == "__main__":
    sys.exit(main())
