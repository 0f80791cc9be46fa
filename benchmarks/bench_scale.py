"""Scale, by simulation: 100,000 shards and 65,536 slots (1,024 nodes x 8 ranks x 8
workers), no cluster needed.

Measures, for one slot, the time and memory to build its plan over the shards'
counts (what the rank's main process holds once the index is loaded: one count per
shard) and reach its first element; and the size and merge time of an elastic state
when every slot stopped at a random point of its block, then one slot of a new run
(32,768 slots) planning from that merged state. Also how each grows with shards
and slots (a smaller configuration is measured too).

    .venv/bin/python benchmarks/bench_scale.py            # 100,000 shards x 65,536 slots
    .venv/bin/python benchmarks/bench_scale.py --quick    # 10,000 shards x 4,096 slots

Not measured here: reading 100,000 per-file index entries from the cache (one small
file each); the slot plan starts from the counts.
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipes"))

import harness  # noqa: E402
from distshard.context import ShardContext  # noqa: E402
from distshard.engine import SlotRun  # noqa: E402
from distshard.merging import merge_states  # noqa: E402
from distshard.readers import SequenceReader  # noqa: E402


class Shards:
    """A positional view over shards with known counts, as a file source's sequence
    is (one int per shard; element i is (shard, index in shard))."""

    distshard_blocks = True

    def __init__(self, counts: list[int]) -> None:
        self.starts = [0]
        for count in counts:
            self.starts.append(self.starts[-1] + count)

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, i: int) -> tuple[int, int]:
        shard = bisect.bisect_right(self.starts, i) - 1
        return shard, i - self.starts[shard]

    def distshard_identity(self) -> str:
        return f"shards:{len(self.starts) - 1}:{self.starts[-1]}"


def _slot_plan(counts: list[int], world: int, workers: int, rank: int, worker: int, resume=None) -> dict:
    """Build one slot's run and take its first element: seconds and peak bytes."""
    tracemalloc.start()
    started = time.perf_counter()
    reader = SequenceReader(Shards(counts))
    ctx = ShardContext(rank, world, worker, workers, "explicit")
    run = SlotRun(reader, ctx=ctx, even="drop", shuffle=False, epoch=0, seed=0, resume=resume)
    first = next(iter(run))
    seconds = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"seconds": seconds, "peak_mb": peak / 2**20, "first": first}


def _merged_state(counts: list[int], world: int, workers: int, rng: random.Random) -> tuple[dict, dict]:
    """Every slot's state after it took a random part of its block, and their merge."""
    reader = SequenceReader(Shards(counts))
    states = []
    started = time.perf_counter()
    for rank in range(world):
        for worker in range(workers):
            ctx = ShardContext(rank, world, worker, workers, "explicit")
            run = SlotRun(reader, ctx=ctx, even="drop", shuffle=False, epoch=0, seed=0)
            share = run.count // ctx.num_slots  # type: ignore[operator]
            run.taken = rng.randint(0, share)  # stopped at a random point of its block
            states.append(run.state())
    build = time.perf_counter() - started
    started = time.perf_counter()
    merged = merge_states(states)
    merge = time.perf_counter() - started
    text = json.dumps(merged)
    return merged, {"states_s": build, "merge_s": merge, "json_mb": len(text) / 2**20,
                    "intervals": len(merged["remaining"])}


def measure(shards: int, world: int, workers: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    counts = [rng.randint(100, 500) for _ in range(shards)]
    slots = world * workers
    plan = _slot_plan(counts, world, workers, world - 1, workers - 1)  # the last slot: the farthest block
    merged, merge = _merged_state(counts, world, workers, rng)
    after = _slot_plan(counts, world // 2, workers, world // 2 - 1, workers - 1, resume=merged)
    return {"shards": shards, "samples": sum(counts), "slots": slots, "plan": plan, "merge": merge,
            "resumed_plan": after}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    session = harness.Session()
    configs = [(10_000, 512, 8)] if args.quick else [(10_000, 512, 8), (100_000, 8_192, 8)]
    rows = [measure(*config) for config in configs]
    columns = [harness.Col("shards", 0), harness.Col("samples", 0), harness.Col("slots", 0),
               harness.Col("one slot: plan + first element", 1, " ms"), harness.Col("peak memory", 1, " MB"),
               harness.Col("merged state (JSON)", 2, " MB"), harness.Col("intervals", 0),
               harness.Col("merge time", 2, " s"), harness.Col("new run's slot from the merged state", right=True)]
    print(session.header())
    print()
    print(harness.table(columns, [
        [row["shards"], row["samples"], row["slots"], row["plan"]["seconds"] * 1e3, row["plan"]["peak_mb"],
         row["merge"]["json_mb"], row["merge"]["intervals"], row["merge"]["merge_s"],
         f"{row['resumed_plan']['seconds'] * 1e3:.1f} ms, {row['resumed_plan']['peak_mb']:.1f} MB"]
        for row in rows]))
    session.dump(args.json, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
