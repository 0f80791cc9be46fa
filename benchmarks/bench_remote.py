"""Shards on object storage: ``distshard.webdataset`` against webdataset over the
same URLs, behind a loopback object-store stand-in that waits before every
response, counted in round trips and bytes as well as time.

The data
--------
16 WebDataset tar shards (``--shards``) of ~300 samples of 2–20 KB each (a
JPEG-like blob and a label; seeded), about 63 MB, served by
``tests/range_server.py`` on 127.0.0.1: HTTP/1.1 with ``Range``, strong
``ETag``\\ s and ``If-Match``, ``--latency`` seconds (default 0.02) before every
response (an object store's first-byte latency), an optional ``--bandwidth``
cap per response; it counts requests and body bytes.

What runs
---------
Every variant runs in its own process tree (``harness.launch``): a gloo group of
``--world-size`` ranks (default 2) on 127.0.0.1, each iterating
``DataLoader(..., batch_size=None, num_workers=2, multiprocessing_context="fork")``
over the pipeline:

* webdataset 1.0.2 (benchmark venv): ``WebDataset(urls, nodesplitter=split_by_node,
  workersplitter=split_by_worker, shardshuffle=False)``: one GET per shard (curl);
* ``distshard.webdataset(urls).dist_shard(even="drop")`` with its index cached
  (built by an earlier, unmeasured run), with and without ``shuffle=True``;
* the same with a cold index (an empty ``$DISTSHARD_CACHE``: the ranks split the
  index build, which is part of the measured job).

Columns: wall (the slowest rank, from building the pipeline to the end of the
epoch), requests and bytes the server saw (with ratios to webdataset's and to
the dataset), exactly-once (the multiset of keys the ranks received against the
data; ``even="drop"`` may drop ``N mod slots``), and for distshard the
read-ahead's peak bytes held per worker (``fetch.STATS``) against its budget,
and the workers' peak RSS.

Targets (issue 14), ratios to webdataset in the same run: cached wall ≤ 1.25×
(also ``shuffle=True``), cold ≤ 2×; requests ≤ 4 per shard + 1 per 4 MiB read
(cached), ≤ 8 per shard + 2 per 4 MiB (cold); bytes ≤ 1.10× the dataset
(cached), ≤ 2× (cold); the read-ahead's peak within its budget.

How to run
----------
::

    .venv/bin/python benchmarks/bench_files.py --setup-peers   # once: benchmarks/.venv with webdataset
    .venv/bin/python benchmarks/bench_remote.py                # 16 shards, 20 ms, 2 ranks x 2 workers
    .venv/bin/python benchmarks/bench_remote.py --latency 0 --bandwidth 50e6 --world-size 4
"""

from __future__ import annotations

import argparse
import io
import os
import random
import shutil
import sys
import tarfile
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (str(HERE), str(ROOT)):
    if path not in sys.path:
        sys.path.insert(0, path)

import harness  # noqa: E402
from bench_files import fake_jpeg  # noqa: E402
from harness import Col  # noqa: E402

NUM_WORKERS = 2
MiB = 1 << 20

VARIANTS = {
    "webdataset": ("webdataset 1.0.2 (one GET per shard)", "peers"),
    "distshard": ('`distshard.webdataset(urls).dist_shard(even="drop")`, index cached', "dev"),
    "distshard_shuffle": ("same, `shuffle=True`, index cached", "dev"),
    "distshard_cold": ("same, cold index (built in the job)", "dev"),
    "distshard_cold_shuffle": ("same, cold index, `shuffle=True`", "dev"),
}


# -- the data ------------------------------------------------------------------------------
def generate(folder: Path, shards: int, per_shard: int, seed: int = 0) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    paths, keys = [], []
    for s in range(shards):
        path = folder / f"shard-{s:06d}.tar"
        with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
            for i in range(per_shard + rng.randint(-10, 10)):
                key = f"s{s:04d}_{i:04d}"
                for ext, data in (("jpg", fake_jpeg(rng, rng.randint(2 << 10, 20 << 10))),
                                  ("cls", str(rng.randrange(1000)).encode())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size, info.mtime = len(data), 1_700_000_000
                    tf.addfile(info, io.BytesIO(data))
                keys.append(key)
        paths.append(str(path))
    return {"paths": paths, "keys": keys, "bytes": sum(os.path.getsize(p) for p in paths)}


# -- the contenders, on a gloo group (in a child process tree) --------------------------------------
def key_of(sample: dict[str, Any]) -> str:
    return sample["__key__"]


def build(key: str, urls: list[str]) -> Any:
    if key == "webdataset":
        import webdataset as wds

        return wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node,
                              workersplitter=wds.split_by_worker, empty_check=False).map(key_of)
    import distshard

    return distshard.webdataset(urls).dist_shard(even="drop", shuffle=key.endswith("shuffle")).map(key_of)


def read_ahead() -> dict[str, int]:
    """A worker's read-ahead figures (``fetch.STATS``: ``peak_held`` ...), for its report."""
    try:
        from distshard.sources import fetch
    except ImportError:
        return {}
    return fetch.STATS.as_dict()


@dataclass
class RemoteJob(harness.Job):
    """Every rank (torchrun's variables set) builds variant ``key`` over ``urls``
    inside the window and iterates it through ``DataLoader(batch_size=None,
    num_workers=2)``; every worker reports its read-ahead's figures."""

    key: str = ""
    urls: list[str] = field(default_factory=list)
    num_workers: int = NUM_WORKERS
    torchrun_env: bool = True
    worker_extra: Callable[[], dict] | None = read_ahead

    def prepare(self, rank: int) -> None:
        if self.key == "webdataset":
            import webdataset  # noqa: F401
        else:
            import distshard.sources  # noqa: F401

    def build(self, rank: int) -> Any:
        return build(self.key, self.urls)


def run_variant(key: str, urls: list[str], world_size: int, timeout: float) -> dict[str, Any]:
    """In a child process: one gloo group, one variant; the keys it delivered and its figures."""
    run = harness.run_job(RemoteJob(key=key, urls=urls, world_size=world_size, timeout=timeout))
    return {"errors": run.errors, "keys": run.values(), "wall_s": run.wall_s, "workers": run.workers}


# -- the parent: serve, run every variant in rounds, tabulate ------------------------------------------
def summarize(key: str, runs: list[dict[str, Any]], manifest: dict[str, Any], slots: int,
              budget: int) -> dict[str, Any]:
    if runs and "skipped" in runs[0]:
        return {"key": key, "skipped": runs[0]["skipped"]}
    good = [r for r in runs if not r.get("errors")]
    row: dict[str, Any] = {"key": key, "errors": [e for r in runs for e in r.get("errors", [])],
                           "left_out": harness.left_out(runs, good)}
    if not good:
        return row
    expected = Counter(manifest["keys"])
    even = "drop" if key.startswith("distshard") else None
    onces = [harness.exactly_once(r["keys"], expected, even=even, slots=slots) for r in good]
    workers = [w for r in good for w in r["workers"]]
    row.update(
        wall_s=harness.median(r["wall_s"] for r in good),
        requests=harness.median(r["requests"] for r in good),
        gets=harness.median(r["gets"] for r in good),
        heads=harness.median(r["heads"] for r in good),
        bytes=harness.median(r["served"] for r in good),
        once=next((o for o in onces if not o.ok), onces[0]).cell(),
        peak_held=max((w.get("peak_held", 0) for w in workers), default=0),
        maxrss_mib=max((w.get("maxrss_kib", 0) for w in workers), default=0) / 1024,
        budget=budget,
    )
    return row


COLUMNS = [Col("pipeline"), Col("wall s", 2), Col("vs webdataset", right=True),
           Col("requests (GET + HEAD)", right=True), Col("target", right=True), Col("bytes / dataset", 3),
           Col("target", right=True), Col("exactly-once"), Col("read-ahead peak / budget per worker", right=True),
           Col("worker RSS MiB", 0)]


def mark(ok: bool) -> str:
    return "✓" if ok else "✗"


def table(rows: list[dict[str, Any]], manifest: dict[str, Any], shards: int) -> str:
    """Against webdataset in the same run; the targets (module docstring) for distshard."""
    total = manifest["bytes"]
    base = next((r for r in rows if r["key"] == "webdataset" and "wall_s" in r), None)
    cells: list[list[Any]] = []
    for row in rows:
        label = VARIANTS[row["key"]][0]
        if "skipped" in row:
            cells.append([label, f"not run: {row['skipped']}"])
            continue
        if "wall_s" not in row:
            cells.append([label, f"failed: {harness.error_line((row['errors'] or ['no run'])[0])[:100]}"])
            continue
        peer, cold = row["key"] == "webdataset", "cold" in row["key"]
        vs = "—" if not base else f"{row['wall_s'] / base['wall_s']:.2f}×" + (
            "" if peer else f" {mark(row['wall_s'] <= (2.0 if cold else 1.25) * base['wall_s'])}")
        requests = f"{row['requests']:.0f} ({row['gets']:.0f} + {row['heads']:.0f})"
        if peer:
            req_target = byte_target = peak = "—"
        else:
            allowed = (8 if cold else 4) * shards + (2 if cold else 1) * row["bytes"] / MiB / 4
            req_target = f"≤ {allowed:.0f} {mark(row['requests'] <= allowed)}"
            limit = 2.0 if cold else 1.10
            byte_target = f"≤ {limit:.2f} {mark(row['bytes'] <= limit * total)}"
            peak = (f"{row['peak_held'] / MiB:.1f} / {row['budget'] / MiB:.0f} MiB "
                    f"{mark(row['peak_held'] <= row['budget'])}")
        cells.append([label, row["wall_s"], vs, requests, req_target, row["bytes"] / total, byte_target, row["once"],
                      peak, row["maxrss_mib"]])
    return harness.table(COLUMNS, cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--per-shard", type=int, default=300)
    parser.add_argument("--latency", type=float, default=0.02, help="seconds before every response (0.02)")
    parser.add_argument("--bandwidth", type=float, default=None, help="bytes per second per response (no cap)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--only", default="", help="comma-separated variants: " + ",".join(VARIANTS))
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", type=Path, help="also dump every measurement here")
    parser.add_argument("--setup-peers", action="store_true", help="create benchmarks/.venv with the peers")
    harness.add_child_args(parser)
    args = parser.parse_args(argv)
    if args.setup_peers:
        return harness.setup_peers()
    if args.run:  # one variant in a fresh process tree
        return harness.child(args.run, args.out, globals())
    return orchestrate(args, harness.choose(args.only, {k: k for k in VARIANTS}, parser))


def orchestrate(args: argparse.Namespace, chosen: list[str]) -> int:
    from tests.range_server import RangeServer

    from distshard.sources import ReadOptions

    session = harness.Session()
    workdir = Path(tempfile.mkdtemp(prefix="bench_remote-"))
    server = None
    try:
        manifest = generate(workdir / "data", args.shards, args.per_shard)
        n, total = len(manifest["keys"]), manifest["bytes"]
        slots = args.world_size * NUM_WORKERS
        server = RangeServer(workdir / "data", latency=args.latency, bandwidth=args.bandwidth).start()
        urls = [server.url(p) for p in manifest["paths"]]

        def launch(key: str, cache: str) -> dict[str, Any]:
            return harness.launch(__file__, "run_variant", {"key": key, "urls": urls, "world_size": args.world_size,
                                                            "timeout": args.timeout},
                                  peers=VARIANTS[key][1] == "peers", timeout=args.timeout, cache=cache)

        warm = str(workdir / "warm-cache")
        if any(k in ("distshard", "distshard_shuffle") for k in chosen):
            launch("distshard", warm)  # builds the cached index
        results: dict[str, list[dict[str, Any]]] = {k: [] for k in chosen}
        for r, order in harness.rounds(chosen, args.rounds):
            for key in order:
                cache = str(workdir / f"cold-{r}-{key}") if "cold" in key or key == "webdataset" else warm
                server.reset_counters()
                started = time.perf_counter()
                result = launch(key, cache)
                server.settle()
                result.update(requests=server.total_requests, gets=server.requests["GET"],
                              heads=server.requests["HEAD"], served=server.served)
                results[key].append(result)
                print(f"#   round {r + 1}/{args.rounds}: {key} done in {time.perf_counter() - started:.0f}s",
                      file=sys.stderr, flush=True)
        budget = ReadOptions().budget
        rows = [summarize(k, results[k], manifest, slots, budget) for k in chosen]
        print(session.header(
            f"{args.shards} shards, {n:,} samples, {total / MiB:.1f} MiB; {args.latency * 1e3:.0f} ms per request"
            f"{f', {args.bandwidth / 1e6:.0f} MB/s per response' if args.bandwidth else ''}; "
            f"{args.world_size} ranks x {NUM_WORKERS} workers; {args.rounds} round(s), medians"))
        print()
        print(table(rows, manifest, args.shards))
        harness.print_left_out(rows, lambda row: row["key"])
        print(f"\nbytes: body bytes the server sent, over the {total / MiB:.1f} MiB of tar files; requests: every "
              "request it answered (the cold rows include the index build). The read-ahead's peak is the most "
              "bytes a worker held in fetched or in-flight ranges (ReadOptions.budget).")
        session.dump(args.json, samples=n, bytes=total, rows=rows, latency=args.latency, bandwidth=args.bandwidth)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
