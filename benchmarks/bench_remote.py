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
Every variant runs in its own process tree (``--run KEY``): a gloo group of
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
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (str(HERE), str(ROOT)):
    if path not in sys.path:
        sys.path.insert(0, path)

from bench_files import _child_env, fake_jpeg, peers_python, setup_peers  # noqa: E402
from torch.utils.data import IterableDataset  # noqa: E402
from torch.utils.data.datapipes.datapipe import IterDataPipe  # noqa: E402

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


# -- inside the ranks ----------------------------------------------------------------------
def worker_report(outdir: str, rank: int) -> None:
    """At a worker's end: the read-ahead's peak and the worker's peak RSS."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    record: dict[str, Any] = {"rank": rank, "worker": info.id if info else -1,
                              "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
    try:
        from distshard.sources import fetch

        record.update(fetch.STATS.as_dict())
    except ImportError:
        pass
    (Path(outdir) / f"r{rank}-w{record['worker']}-p{os.getpid()}.json").write_text(json.dumps(record))


def build(key: str, urls: list[str]) -> Any:
    if key == "webdataset":
        import webdataset as wds

        return wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node,
                              workersplitter=wds.split_by_worker, empty_check=False).map(key_of)
    import distshard

    return distshard.webdataset(urls).dist_shard(even="drop", shuffle=key.endswith("shuffle")).map(key_of)


class _Reporting:
    """The last stage: at a worker's end, its figures (see ``worker_report``)."""

    def __init__(self, inner: Any, outdir: str, rank: int) -> None:
        self.inner, self.outdir, self.rank = inner, outdir, rank

    def __iter__(self):
        try:
            yield from self.inner
        finally:
            worker_report(self.outdir, self.rank)


class ReportPipe(_Reporting, IterDataPipe):
    """For DataPipes: stays a DataPipe, so that the DataLoader shards and seeds its graph."""


class ReportDataset(_Reporting, IterableDataset):
    """For webdataset's iterable datasets."""


def key_of(sample: dict[str, Any]) -> str:
    return sample["__key__"]


def wrap(inner: Any, outdir: str, rank: int) -> Any:
    return (ReportPipe if isinstance(inner, IterDataPipe) else ReportDataset)(inner, outdir, rank)


def rank_main(rank: int, world_size: int, key: str, urls: list[str], outdir: str, timeout: float) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1")
    mine = Path(outdir) / f"rank{rank}"
    mine.mkdir(parents=True, exist_ok=True)
    if key == "webdataset":
        import webdataset  # noqa: F401
    else:
        import distshard.sources  # noqa: F401
    dist.barrier()
    started = time.perf_counter()
    out: dict[str, Any] = {"rank": rank, "keys": [], "error": None}
    try:
        pipe = wrap(build(key, urls), str(mine), rank)
        loader = DataLoader(pipe, batch_size=None, num_workers=NUM_WORKERS, multiprocessing_context="fork",
                            timeout=timeout)
        out["keys"] = list(loader)
    except BaseException:  # noqa: BLE001 - reported
        out["error"] = traceback.format_exc()
    out["wall_s"] = time.perf_counter() - started
    out["workers"] = [json.loads(p.read_text()) for p in sorted(mine.glob("*.json"))]
    return out


def run_variant(key: str, urls: list[str], world_size: int, timeout: float) -> dict[str, Any]:
    from distshard.verify import run_on_group

    with tempfile.TemporaryDirectory(prefix="bench_remote-") as outdir:
        outcomes = run_on_group(rank_main, world_size=world_size, timeout=timeout,
                                args=(key, urls, outdir, timeout))
    errors = [f"rank {o.rank}: {o.error or (o.value or {}).get('error')}" for o in outcomes
              if o.error or o.value is None or o.value.get("error")]
    values = [o.value for o in outcomes if o.value is not None]
    return {"errors": errors, "keys": [k for v in values for k in v["keys"]],
            "wall_s": max((v["wall_s"] for v in values), default=float("nan")),
            "workers": [w for v in values for w in v["workers"]]}


# -- the parent ---------------------------------------------------------------------------------
def launch(key: str, data: Path, urls: list[str], cache: str, world_size: int, timeout: float) -> dict[str, Any]:
    python = sys.executable if VARIANTS[key][1] == "dev" else peers_python()
    if python is None:
        return {"skipped": "no benchmark venv (benchmarks/.venv): run bench_files.py --setup-peers"}
    with tempfile.TemporaryDirectory(prefix="bench_remote-out-") as tmp:
        out = Path(tmp) / "result.json"
        (Path(tmp) / "urls.json").write_text(json.dumps(urls))
        command = [str(python), str(Path(__file__).resolve()), "--run", key, "--urls", str(Path(tmp) / "urls.json"),
                   "--out", str(out), "--world-size", str(world_size), "--timeout", str(timeout)]
        env = _child_env(cache)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "pipes"), str(HERE), str(ROOT)])
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout + 120)
        except subprocess.TimeoutExpired:
            return {"errors": [f"timed out after {timeout + 120:.0f}s"]}
        if not out.exists():
            return {"errors": [f"exit {done.returncode}: {done.stderr[-2000:]}"]}
        return json.loads(out.read_text())


def summarize(key: str, runs: list[dict[str, Any]], manifest: dict[str, Any], slots: int,
              budget: int) -> dict[str, Any]:
    if runs and "skipped" in runs[0]:
        return {"key": key, "skipped": runs[0]["skipped"]}
    good = [r for r in runs if not r.get("errors")]
    row: dict[str, Any] = {"key": key, "errors": [e for r in runs for e in r.get("errors", [])]}
    if not good:
        return row
    n = len(manifest["keys"])
    expected = Counter(manifest["keys"])
    checks = []
    for r in good:
        got = Counter(r["keys"])
        allowed = n % slots if key.startswith("distshard") else 0
        checks.append((sum((got - expected).values()), sum((expected - got).values()), allowed))
    once = all(dup == 0 and miss <= allowed for dup, miss, allowed in checks)
    workers = [w for r in good for w in r["workers"]]
    row.update(
        wall_s=statistics.median(r["wall_s"] for r in good),
        requests=statistics.median(r["requests"] for r in good),
        gets=statistics.median(r["gets"] for r in good),
        heads=statistics.median(r["heads"] for r in good),
        bytes=statistics.median(r["served"] for r in good),
        once="✓" + (f" (drop {checks[0][1]})" if checks[0][1] else "") if once else
             f"✗ {checks[0][0]} dup, {checks[0][1]} missing",
        peak_held=max((w.get("peak_held", 0) for w in workers), default=0),
        maxrss_mib=max((w.get("maxrss_kib", 0) for w in workers), default=0) / 1024,
        budget=budget,
    )
    return row


def table(rows: list[dict[str, Any]], manifest: dict[str, Any], shards: int) -> str:
    total = manifest["bytes"]
    base = next((r for r in rows if r["key"] == "webdataset" and "wall_s" in r), None)
    lines = ["| pipeline | wall s | vs webdataset | requests (GET + HEAD) | target | bytes / dataset | target "
             "| exactly-once | read-ahead peak / budget per worker | worker RSS MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for row in rows:
        label = VARIANTS[row["key"]][0]
        if "skipped" in row:
            lines.append(f"| {label} | not run: {row['skipped']} |" + " |" * 8)
            continue
        if "wall_s" not in row:
            first = (row["errors"] or ["no run"])[0].strip().splitlines()[-1][:100]
            lines.append(f"| {label} | failed: {first} |" + " |" * 8)
            continue
        ratio = f"{row['wall_s'] / base['wall_s']:.2f}×" if base else "—"
        read_mib = row["bytes"] / MiB
        cold = "cold" in row["key"]
        if row["key"] == "webdataset":
            req_target = byte_target = "—"
        else:
            allowed = (8 if cold else 4) * shards + (2 if cold else 1) * read_mib / 4
            req_target = f"≤ {allowed:.0f} {'✓' if row['requests'] <= allowed else '✗'}"
            limit = 2.0 if cold else 1.10
            byte_target = f"≤ {limit:.2f} {'✓' if row['bytes'] <= limit * total else '✗'}"
        wall_target = "" if not base or row["key"] == "webdataset" else (
            " ✓" if row["wall_s"] <= (2.0 if cold else 1.25) * base["wall_s"] else " ✗")
        peak = "—" if row["key"] == "webdataset" else \
            f"{row['peak_held'] / MiB:.1f} / {row['budget'] / MiB:.0f} MiB {'✓' if row['peak_held'] <= row['budget'] else '✗'}"
        lines.append(
            f"| {label} | {row['wall_s']:.2f} | {ratio}{wall_target} | {row['requests']:.0f} ({row['gets']:.0f} + "
            f"{row['heads']:.0f}) | {req_target} | {row['bytes'] / total:.3f} | {byte_target} | {row['once']} | "
            f"{peak} | {row['maxrss_mib']:.0f} |")
    return "\n".join(lines)


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
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--urls", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.setup_peers:
        return setup_peers()
    if args.run:
        try:
            result = run_variant(args.run, json.loads(args.urls.read_text()), args.world_size, args.timeout)
        except BaseException:  # noqa: BLE001
            result = {"errors": [traceback.format_exc()]}
        args.out.write_text(json.dumps(result))
        return 0
    return orchestrate(args)


def orchestrate(args: argparse.Namespace) -> int:
    from _common import command_line, environment, write_json

    from distshard.sources import ReadOptions
    from tests.range_server import RangeServer

    chosen = [k for k in args.only.split(",") if k] if args.only else list(VARIANTS)
    workdir = Path(tempfile.mkdtemp(prefix="bench_remote-"))
    try:
        manifest = generate(workdir / "data", args.shards, args.per_shard)
        n, total = len(manifest["keys"]), manifest["bytes"]
        slots = args.world_size * NUM_WORKERS
        server = RangeServer(workdir / "data", latency=args.latency, bandwidth=args.bandwidth).start()
        urls = [server.url(p) for p in manifest["paths"]]
        print(f"# {command_line()}")
        print(f"# Python {sys.version.split()[0]}, torch {environment()['torch']}, {os.cpu_count()} cores; "
              f"{args.shards} shards, {n:,} samples, {total / MiB:.1f} MiB; {args.latency * 1e3:.0f} ms per request"
              f"{f', {args.bandwidth / 1e6:.0f} MB/s per response' if args.bandwidth else ''}; "
              f"{args.world_size} ranks x {NUM_WORKERS} workers; {args.rounds} round(s), medians", flush=True)
        warm = str(workdir / "warm-cache")
        if any(k in ("distshard", "distshard_shuffle") for k in chosen):
            launch("distshard", workdir, urls, warm, args.world_size, args.timeout)  # builds the cached index
        results: dict[str, list[dict[str, Any]]] = {k: [] for k in chosen}
        for r in range(args.rounds):
            for key in chosen:
                cache = str(workdir / f"cold-{r}-{key}") if "cold" in key or key == "webdataset" else warm
                server.reset_counters()
                started = time.perf_counter()
                result = launch(key, workdir, urls, cache, args.world_size, args.timeout)
                server.settle()
                result.update(requests=server.total_requests, gets=server.requests["GET"],
                              heads=server.requests["HEAD"], served=server.served)
                results[key].append(result)
                print(f"#   round {r + 1}/{args.rounds}: {key} done in {time.perf_counter() - started:.0f}s",
                      file=sys.stderr, flush=True)
        server.stop()
        budget = ReadOptions().budget
        rows = [summarize(k, results[k], manifest, slots, budget) for k in chosen]
        print(table(rows, manifest, args.shards))
        print(f"\nbytes: body bytes the server sent, over the {total / MiB:.1f} MiB of tar files; requests: every "
              "request it answered (the cold rows include the index build). The read-ahead's peak is the most "
              "bytes a worker held in fetched or in-flight ranges (ReadOptions.budget).")
        if args.json:
            for row in rows:
                row.pop("keys", None)
            write_json(args.json, {"environment": environment(), "samples": n, "bytes": total, "rows": rows,
                                   "latency": args.latency, "bandwidth": args.bandwidth})
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
