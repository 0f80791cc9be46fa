"""Shards on object storage: distshard against litdata, Mosaic Streaming and
webdataset on an S3 API (the default, ``--store s3``), or against webdataset on
a plain HTTP range server (``--store http``), counted in round trips and bytes
as well as time.

The S3 suite (issue 22)
-----------------------
moto's S3 server (``moto[server]``, the dev venv) in its own process on
127.0.0.1, reached only through ``latency_proxy.LatencyProxy``: it waits 20 or
50 ms before every response, can cap the aggregate bandwidth (25 MB/s, one token
bucket for every connection), and counts requests by kind (HEAD, GET, LIST) and
body bytes, each rank on its own endpoint (``AWS_ENDPOINT_URL`` and Mosaic's
``S3_ENDPOINT_URL``, set in the rank before any client exists; its fork workers
inherit it), so that it can tell what each rank asked before its first batch.

The same samples for everyone (2–20 KB JPEG-like blobs and a label, seeded):
WebDataset tar shards for distshard and webdataset; ``litdata.optimize()``
chunks and Mosaic MDS shards converted from them in the benchmark venv (not
timed), each of about the tar shards' mean size, so that every library reads
about as many objects; all uploaded straight to moto (not counted).

Settings: 16 shards × ~300 samples (63 MB) and 1,024 shards × ~5, at 20 ms and
50 ms, and 16 × 300 under a 25 MB/s aggregate cap (its floor: dataset bytes /
bandwidth). Every row is a fresh process tree (``harness.launch``): a gloo group
of 2 ranks, each iterating ``DataLoader(batch_size=32, num_workers=2, fork)``
for one epoch; wall is the slowest rank's, from building the pipeline to the
end of the epoch; the first batch is timed on every rank from the same start.

Rows (a new user's setup of each): ``distshard.webdataset(urls).dist_shard(
even="drop")`` with an empty ``$DISTSHARD_CACHE`` (cold: the ranks index the
shards inside the window) and with a warm one (per-machine index cached); with
the index stored beside the data by ``python -m distshard index`` on a fresh
``$DISTSHARD_CACHE`` (when the library has that command; the build is timed and
counted once, against streaming every shard once at the same concurrency); the
same over 2 epochs with ``ReadOptions(cache_dir=...)`` (when it has that
option: the 2nd epoch's bytes from the store); litdata 0.2.76
(``StreamingDataset``), Mosaic 0.13.0 (``StreamingDataset(batch_size=32)``),
webdataset 1.0.2 over s3fs (``split_by_node`` / ``split_by_worker``). The
targets (issue 22) are printed under the tables, met or MISSED.

::

    .venv/bin/python benchmarks/bench_remote.py --setup-peers   # once: benchmarks/.venv (litdata, Mosaic, ...)
    .venv/bin/python benchmarks/bench_remote.py --quick         # a smoke run: small data, 20 ms
    .venv/bin/python benchmarks/bench_remote.py                 # every setting (--settings 0,1,4 for some)

The HTTP suite (``--store http``, issue 14)
-------------------------------------------
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
    .venv/bin/python benchmarks/bench_remote.py --store http   # 16 shards, 20 ms, 2 ranks x 2 workers
    .venv/bin/python benchmarks/bench_remote.py --store http --latency 0 --bandwidth 50e6 --world-size 4

Where it lives
--------------
The data, its conversions and the stored index are in ``remote_data.py``, what every
rank runs in ``remote_jobs.py``, the rows' figures, tables and targets in
``remote_rows.py``; this script serves the data, runs every row and prints.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (str(HERE), str(ROOT)):
    if path not in sys.path:
        sys.path.insert(0, path)

import harness  # noqa: E402
from remote_data import (  # noqa: E402
    BUCKET,
    MiB,
    Setting,
    Store,
    build_stored_index,
    convert,
    generate,
    settings,
    upload,
)
from remote_jobs import BATCH, NUM_WORKERS, run_s3, run_variant  # noqa: E402
from remote_rows import (  # noqa: E402
    FEATURES,
    S3_VARIANTS,
    VARIANTS,
    median_row,
    s3_row,
    s3_table,
    s3_targets,
    summarize,
    table,
)

# re-exported: convert, run_s3 and run_variant are called in a child by name (harness.launch)
__all__ = ["convert", "run_s3", "run_variant"]


# == the S3 suite (the default): moto behind the latency proxy, against litdata and Mosaic ==========
def features() -> dict[str, Any]:
    """What the library under test offers: ``python -m distshard index`` and
    ``ReadOptions(cache_dir=...)`` (rows that need them are left out otherwise)."""
    from dataclasses import fields as dc_fields

    from distshard.sources import ReadOptions

    done = subprocess.run([sys.executable, "-m", "distshard", "index", "--help"], capture_output=True, text=True,
                          timeout=120, env=harness.child_env(tempfile.gettempdir()))
    return {"index": done.returncode == 0 and "usage" in done.stdout.lower(),
            "cache_dir": "cache_dir" in {f.name for f in dc_fields(ReadOptions)},
            "index_help": done.stdout}


# -- the parent: moto, the proxy, the data, every row --------------------------------------------------
def prepare_data(store: Store, setting: Setting, convert: bool = True) -> dict[str, Any]:
    """Generate, convert (unless no peer runs) and upload ``setting``'s samples once (not timed)."""
    if setting.data in store.uploaded:
        return store.uploaded[setting.data]
    folder = store.workdir / setting.data
    manifest = generate(folder / "tars", setting.shards, setting.per_shard)
    chunk = max(1 << 16, manifest["bytes"] // setting.shards)
    if convert:
        manifest["converted"] = harness.launch(__file__, "convert", {"paths": manifest["paths"],
                                                                     "out": str(folder / "peers"),
                                                                     "chunk_bytes": chunk}, peers=True, timeout=1200)
    for prefix in ("wds", "wds-indexed"):
        upload(store.moto.endpoint, folder / "tars", f"{setting.data}/{prefix}")
    for fmt in ("litdata", "mds"):
        if (folder / "peers" / fmt).exists():
            files = upload(store.moto.endpoint, folder / "peers" / fmt, f"{setting.data}/{fmt}")
            manifest[f"{fmt}_objects"] = len(files)
            manifest[f"{fmt}_bytes"] = sum(p.stat().st_size for p in (folder / "peers" / fmt).rglob("*")
                                           if p.is_file())
    print(f"#   {setting.data}: {len(manifest['keys']):,} samples, {manifest['bytes'] / MiB:.1f} MiB, "
          f"{setting.shards} tar shards, {manifest.get('litdata_objects', 0)} litdata objects, "
          f"{manifest.get('mds_objects', 0)} MDS objects uploaded", file=sys.stderr, flush=True)
    store.uploaded[setting.data] = manifest
    return manifest


def measure(key: str, setting: Setting, proxy: Any, manifest: dict[str, Any], args: argparse.Namespace,
            cache: str) -> dict[str, Any]:
    """One run of variant ``key``: what the child returned and what the proxy counted, by rank."""
    epochs = 2 if key == "distshard_local_cache" else 1
    proxy.reset()
    started = time.perf_counter()
    result = harness.launch(__file__, "run_s3", {"key": key, "data": setting.data, "shards": setting.shards,
                                                  "endpoints": proxy.endpoints[1:], "world_size": args.world_size,
                                                  "timeout": args.timeout, "epochs": epochs,
                                                  "cache_bytes": 4 * manifest["bytes"]},
                            peers=S3_VARIANTS[key][1] == "peers", timeout=args.timeout, cache=cache)
    proxy.settle()
    result["seen"] = proxy.snapshot()[1:]
    print(f"#   {setting.title}: {key} done in {time.perf_counter() - started:.0f}s", file=sys.stderr, flush=True)
    return result


def orchestrate_s3(args: argparse.Namespace, chosen: list[str]) -> int:
    """The S3 suite: moto in its own process, every chosen setting's data uploaded once
    and the ``chosen`` rows run on it in rounds behind the latency proxy; the tables,
    the targets and ``--json``. Rows whose feature the library lacks are left out."""
    from latency_proxy import MotoProcess

    s3_environment()
    session = harness.Session()
    feats = features()
    chosen = [k for k in chosen if k not in FEATURES or feats[FEATURES[k]]]
    left = [k for k in FEATURES if not feats[FEATURES[k]]]
    workdir = Path(tempfile.mkdtemp(prefix="bench_remote_s3-"))
    moto = None
    try:
        import boto3

        moto = MotoProcess().start()
        boto3.client("s3", endpoint_url=moto.endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        store = Store(moto, workdir, feats)
        chosen_settings = settings(args.quick)
        if args.settings:
            chosen_settings = [chosen_settings[int(i)] for i in args.settings.split(",")]
        tables = [run_setting(store, setting, chosen, args) for setting in chosen_settings]
        print_s3_report(session, args, tables, store, left)
        session.dump(args.json, tables=[{"setting": s.__dict__, "rows": rows, "samples": len(m["keys"]),
                                         "bytes": m["bytes"]} for s, rows, m in tables],
                     indexed=store.indexed, features={k: v for k, v in feats.items() if k != "index_help"})
    finally:
        if moto is not None:
            moto.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def s3_environment() -> None:
    """Test credentials for moto, and no profile, token or endpoint from the caller's
    environment (each rank sets its own endpoint)."""
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}.items():
        os.environ[name] = value
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "S3_ENDPOINT_URL"):
        os.environ.pop(name, None)


def run_setting(store: Store, setting: Setting, chosen: list[str],
                args: argparse.Namespace) -> tuple[Setting, list[dict[str, Any]], dict[str, Any]]:
    """One table: ``setting``'s data (uploaded once), a latency proxy of its own, the
    stored index (when a row needs it or ``--index-only``), then the ``chosen`` rows in
    rounds; the setting, its median rows and the data's manifest."""
    from latency_proxy import LatencyProxy

    manifest = prepare_data(store, setting, convert=any(S3_VARIANTS[k][1] == "peers" for k in chosen))
    proxy = LatencyProxy(store.moto.endpoint, latency=setting.latency, bandwidth=setting.bandwidth,
                         ports=args.world_size + 1).start()
    try:
        if "distshard_stored" in chosen or "distshard_local_cache" in chosen or args.index_only:
            if store.feats["index"]:
                build_stored_index(store, setting, proxy, args.timeout)
        results = measure_rounds(setting, proxy, manifest, chosen, args, store.workdir)
    finally:
        proxy.stop()
    slots = args.world_size * NUM_WORKERS
    rows = [median_row(k, [s3_row(k, res, manifest, slots) for res in results[k]]) for k in chosen]
    return setting, rows, manifest


def measure_rounds(setting: Setting, proxy: Any, manifest: dict[str, Any], chosen: list[str],
                   args: argparse.Namespace, workdir: Path) -> dict[str, list[dict[str, Any]]]:
    """The ``chosen`` rows in ``--rounds`` interleaved rounds, each run by row: the warm
    row on a per-machine index built by an unmeasured run first, every other row on a
    cold ``$DISTSHARD_CACHE`` of its own (removed after it)."""
    warm = str(workdir / f"warm-{setting.data}")
    if "distshard_cached" in chosen and not Path(warm).exists():
        measure("distshard_cached", setting, proxy, manifest, args, warm)  # builds the per-machine index
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in chosen}
    for r, order in harness.rounds(chosen, args.rounds) if chosen else []:
        for key in order:
            cache = warm if key == "distshard_cached" else str(workdir / f"cold-{setting.data}-{r}-{key}")
            results[key].append(measure(key, setting, proxy, manifest, args, cache))
            if key != "distshard_cached":
                shutil.rmtree(cache, ignore_errors=True)
    return results


def print_s3_report(session: harness.Session, args: argparse.Namespace,
                    tables: list[tuple[Setting, list[dict[str, Any]], dict[str, Any]]], store: Store,
                    left: list[str]) -> None:
    """The header, every setting's table, the targets, the rows left out and the notes."""
    print(session.header(f"{args.world_size} ranks x {NUM_WORKERS} fork workers, batch {BATCH}, one epoch; "
                         f"{args.rounds} round(s), medians; moto on 127.0.0.1 behind the latency proxy"))
    for setting, rows, manifest in tables:
        print_s3_table(setting, rows, manifest)
    print("\n**Targets** (issue 22; ratios to litdata in the same run)")
    for line in s3_targets(tables, store.indexed, store.feats):
        print(line)
    if left:
        print(f"\nrows left out (the library lacks the feature): {', '.join(left)}")
    print("\nwall: the slowest rank, from building the pipeline to the end of the epoch; first batch: from "
          "building the pipeline, each rank; requests and bytes: what the proxy relayed for the ranks and their "
          "workers (each rank has its own endpoint); bytes over the tar shards' bytes (litdata's and Mosaic's "
          "copies are about as big).")


def print_s3_table(setting: Setting, rows: list[dict[str, Any]], manifest: dict[str, Any]) -> None:
    """One setting: what its data is in each format, its floor under a bandwidth cap,
    its table and the rounds that failed."""
    conv = manifest.get("converted", {})
    print(f"\n**{setting.title}** — {len(manifest['keys']):,} samples, {manifest['bytes'] / MiB:.1f} MiB of "
          f"tar shards; litdata {manifest.get('litdata_objects', '—')} objects "
          f"({manifest.get('litdata_bytes', 0) / MiB:.1f} MiB), MDS {manifest.get('mds_objects', '—')} "
          f"objects ({manifest.get('mds_bytes', 0) / MiB:.1f} MiB)"
          + (f"; conversion failed: {harness.error_line(conv['errors'][0])}" if conv.get("errors") else ""))
    if setting.bandwidth:
        print(f"(floor: dataset bytes / bandwidth = {manifest['bytes'] / setting.bandwidth:.2f} s)")
    print()
    print(s3_table(setting, rows, manifest))
    harness.print_left_out(rows, lambda row: row["key"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", choices=("s3", "http"), default="s3",
                        help="s3: moto behind the latency proxy, against litdata, Mosaic and webdataset (default); "
                        "http: tests/range_server.py, distshard against webdataset")
    parser.add_argument("--quick", action="store_true", help="s3: small data, 20 ms only (a smoke run)")
    parser.add_argument("--settings", default="", help="s3: comma-separated indices of the settings to run "
                        "(0: 16x300 20 ms, 1: 1024x5 20 ms, 2: 16x300 50 ms, 3: 1024x5 50 ms, 4: 16x300 20 ms 25 MB/s)")
    parser.add_argument("--shards", type=int, default=16, help="http: shards (16)")
    parser.add_argument("--per-shard", type=int, default=300, help="http: samples per shard (300)")
    parser.add_argument("--latency", type=float, default=0.02, help="http: seconds before every response (0.02)")
    parser.add_argument("--bandwidth", type=float, default=None, help="http: bytes per second per response (no cap)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--only", default="", help="comma-separated variants: s3: " + ",".join(S3_VARIANTS)
                        + "; http: " + ",".join(VARIANTS))
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", type=Path, help="also dump every measurement here")
    parser.add_argument("--index-only", action="store_true",
                        help="s3: time `python -m distshard index` against streaming the shards once, and run "
                             "only the --only rows (none unless given; no conversion for the peers then)")
    parser.add_argument("--setup-peers", action="store_true", help="create benchmarks/.venv with the peers")
    harness.add_child_args(parser)
    args = parser.parse_args(argv)
    if args.setup_peers:
        return harness.setup_peers()
    if args.run:  # one variant in a fresh process tree
        return harness.child(args.run, args.out, globals())
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still stops what it started
    if args.store == "s3":
        if args.index_only and not args.only:
            return orchestrate_s3(args, [])
        return orchestrate_s3(args, harness.choose(args.only, {k: k for k in S3_VARIANTS}, parser))
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
