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
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

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
    """``shards`` tar files of about ``per_shard`` samples (± 10, or ± a fifth of
    fewer than 50); returns the manifest (paths, keys, bytes)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    spread = 10 if per_shard >= 50 else per_shard // 5
    paths, keys = [], []
    for s in range(shards):
        path = folder / f"shard-{s:06d}.tar"
        with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
            for i in range(per_shard + rng.randint(-spread, spread)):
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


FIRST_SAMPLE_DIR = "BENCH_FIRST_SAMPLE_DIR"  # where each process of a rank notes when it met its first sample
_first_noted: list[int] = []  # the pid that noted (a forked worker inherits the list, not the pid)


def note_first_sample() -> None:
    """In whichever process makes samples (a DataLoader worker): note ``time.time()``
    of this process's first sample in ``$BENCH_FIRST_SAMPLE_DIR``, once."""
    folder = os.environ.get(FIRST_SAMPLE_DIR)
    if not folder or os.getpid() in _first_noted:
        return
    _first_noted.append(os.getpid())
    Path(folder, f"{os.getpid()}.txt").write_text(repr(time.time()))


def key_noting_first(sample: dict[str, Any]) -> str:
    note_first_sample()
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
        from distshard.sources.reading import fetch
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


# == the S3 suite (the default): moto behind the latency proxy, against litdata and Mosaic ==========
BUCKET = "bench"
BATCH = 32
S3_VARIANTS = {
    "distshard_cold": ('`distshard.webdataset(urls).dist_shard(even="drop")`, cold cache', "dev"),
    "distshard_cached": ("same, per-machine index cached (`$DISTSHARD_CACHE` warm)", "dev"),
    "distshard_stored": ("same, stored index (`python -m distshard index`), fresh `$DISTSHARD_CACHE`", "dev"),
    "distshard_local_cache": ("same, 2 epochs with `ReadOptions(cache_dir=)` (stored index if any; wall: both)", "dev"),
    "litdata": ("litdata 0.2.76 (`optimize()` chunks)", "peers"),
    "mosaic": ("Mosaic streaming 0.13.0 (MDS shards)", "peers"),
    "webdataset": ("webdataset 1.0.2 (s3fs)", "peers"),
}
FEATURES = {"distshard_stored": "index", "distshard_local_cache": "cache_dir"}  # rows that need a feature


@dataclass(frozen=True)
class Setting:
    """One table: ``shards`` × ``per_shard`` samples, ``latency`` s per response,
    an aggregate ``bandwidth`` cap (bytes/s) or none."""

    shards: int
    per_shard: int
    latency: float
    bandwidth: float | None = None

    @property
    def data(self) -> str:
        return f"d{self.shards}x{self.per_shard}"

    @property
    def title(self) -> str:
        cap = f", {self.bandwidth / 1e6:.0f} MB/s aggregate cap" if self.bandwidth else ""
        return f"{self.shards:,} shards × {self.per_shard}, {self.latency * 1e3:.0f} ms per request{cap}"


def settings(quick: bool) -> list[Setting]:
    if quick:
        return [Setting(8, 60, 0.02), Setting(128, 3, 0.02), Setting(8, 60, 0.02, 5e6)]
    return [Setting(16, 300, 0.02), Setting(1024, 5, 0.02), Setting(16, 300, 0.05), Setting(1024, 5, 0.05),
            Setting(16, 300, 0.02, 25e6)]


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


# -- the samples, in each library's own format (converted once, not timed) ----------------------------
def tar_samples(path: str) -> Iterator[tuple[str, bytes, int]]:
    """``(key, jpg, cls)`` of every sample of a tar shard, in order."""
    with tarfile.open(path) as tf:
        parts: dict[str, dict[str, bytes]] = {}
        order: list[str] = []
        for member in tf:
            key, _, ext = member.name.partition(".")
            if key not in parts:
                parts[key] = {}
                order.append(key)
            parts[key][ext] = tf.extractfile(member).read()
    for key in order:
        yield key, parts[key]["jpg"], int(parts[key]["cls"])


def import_streaming() -> Any:
    """Mosaic's ``streaming``. It imports torchvision for its vision datasets only; the
    torchvision 0.28.0 wheel on PyPI is a CUDA build whose ops cannot load against
    the CPU torch wheel here (``operator torchvision::nms does not exist``), so a
    stand-in with the two names it imports takes its place when it does not load."""
    try:
        import torchvision  # noqa: F401
    except (RuntimeError, ImportError, OSError):
        import importlib.machinery
        import types

        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        stub = {name: types.ModuleType(name) for name in ("torchvision", "torchvision.datasets",
                                                          "torchvision.transforms", "torchvision.transforms.functional")}
        for name, module in stub.items():
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        stub["torchvision.datasets"].VisionDataset = type("VisionDataset", (), {})
        stub["torchvision.datasets"].CIFAR10 = type("CIFAR10", (), {})
        stub["torchvision.transforms.functional"].to_tensor = lambda x: x
        sys.modules.update(stub)
    import streaming

    return streaming


def litdata_samples(path: str) -> Iterator[dict[str, Any]]:
    """``litdata.optimize``'s ``fn``: one input is a tar shard, its samples as dicts."""
    for key, jpg, cls in tar_samples(path):
        yield {"key": key, "jpg": jpg, "cls": cls}


def convert(paths: list[str], out: str, chunk_bytes: int) -> dict[str, Any]:
    """In the peers' venv: the same samples as litdata chunks (``out/litdata``) and
    Mosaic MDS shards (``out/mds``), each of about the tar shards' mean size, so
    that every library reads about as many objects."""
    import litdata

    MDSWriter = import_streaming().MDSWriter
    started = time.perf_counter()
    litdata.optimize(fn=litdata_samples, inputs=paths, output_dir=os.path.join(out, "litdata"),
                     chunk_bytes=chunk_bytes, num_workers=1, mode="overwrite")
    with MDSWriter(out=os.path.join(out, "mds"), columns={"key": "str", "jpg": "bytes", "cls": "int"},
                   size_limit=chunk_bytes) as writer:
        for path in paths:
            for key, jpg, cls in tar_samples(path):
                writer.write({"key": key, "jpg": jpg, "cls": cls})
    return {"seconds": time.perf_counter() - started}


def upload(endpoint: str, folder: Path, prefix: str, threads: int = 8) -> list[str]:
    """Every file under ``folder`` to ``s3://bench/prefix/...`` (straight to moto, not counted)."""
    import concurrent.futures

    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    files = sorted(p for p in folder.rglob("*") if p.is_file())

    def put(path: Path) -> str:
        key = f"{prefix}/{path.relative_to(folder).as_posix()}"
        client.put_object(Bucket=BUCKET, Key=key, Body=path.read_bytes())
        return f"s3://{BUCKET}/{key}"

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return list(pool.map(put, files))


# -- the contenders (in a child process tree, on a gloo group) ---------------------------------------
def key_only(item: Any) -> Any:
    return item["key"]


def shard_urls(data: str, folder: str, shards: int) -> str:
    """The brace pattern of ``shards`` tar shards under ``s3://bench/data/folder/``."""
    return f"s3://{BUCKET}/{data}/{folder}/shard-{{000000..{shards - 1:06d}}}.tar"


def s3_dataset(key: str, data: str, shards: int, work: str, cache_bytes: int) -> Any:
    """What a new user writes for variant ``key`` over the data under ``s3://bench/data/``
    (the endpoint comes from ``AWS_ENDPOINT_URL``, as each library reads it)."""
    if key == "webdataset":
        import fsspec
        import webdataset as wds

        sys.modules["webdataset.gopen"].gopen_schemes["s3"] = lambda url, mode="rb", bufsize=8192, **kw: fsspec.open(url, mode).open()
        return wds.WebDataset(shard_urls(data, "wds", shards), shardshuffle=False, nodesplitter=wds.split_by_node,
                              workersplitter=wds.split_by_worker, empty_check=False).map(key_noting_first)
    if key == "litdata":
        import litdata
        from litdata.streaming import downloader

        # its chunk GETs go through obstore, which refuses an http:// endpoint (a real S3 is https)
        downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"

        class Keys(litdata.StreamingDataset):
            def __getitem__(self, index: Any) -> Any:
                item = super().__getitem__(index)["key"]
                note_first_sample()
                return item

        return Keys(litdata.streaming.resolver.Dir(path=os.path.join(work, "litdata-cache"),
                                                   url=f"s3://{BUCKET}/{data}/litdata"))
    if key == "mosaic":
        class MosaicKeys(import_streaming().StreamingDataset):
            def __getitem__(self, index: Any) -> Any:
                item = super().__getitem__(index)["key"]
                note_first_sample()
                return item

        return MosaicKeys(remote=f"s3://{BUCKET}/{data}/mds", local=os.path.join(work, "mds-cache"),
                          shuffle=False, batch_size=BATCH)
    import distshard
    from distshard.sources import ReadOptions

    folder = "wds" if key == "distshard_cold" or key == "distshard_cached" else "wds-indexed"
    options = None
    if key == "distshard_local_cache":
        options = ReadOptions(cache_dir=os.path.join(work, "range-cache"), cache_bytes=cache_bytes)
    return distshard.webdataset(shard_urls(data, folder, shards), read_options=options).dist_shard(even="drop").map(
        key_noting_first)


@dataclass
class S3Job(harness.Job):
    """Every rank reads through its own endpoint of the proxy (``AWS_ENDPOINT_URL``
    and Mosaic's ``S3_ENDPOINT_URL``, set before any client exists; its forked
    workers inherit it), iterates ``DataLoader(batch_size=32, num_workers=2, fork)``
    and times its first batch of every epoch (``time.time()``, to compare with the
    proxy's arrival times, and from the start of ``build``)."""

    key: str = ""
    data: str = ""
    shards: int = 0
    work: str = ""
    cache_bytes: int = 0
    endpoints: list[str] = field(default_factory=list)
    num_workers: int = NUM_WORKERS
    batch_size: int | None = BATCH
    torchrun_env: bool = True

    def prepare(self, rank: int) -> None:
        os.environ["AWS_ENDPOINT_URL"] = os.environ["S3_ENDPOINT_URL"] = self.endpoints[rank]
        os.environ[FIRST_SAMPLE_DIR] = self.first_dir = tempfile.mkdtemp(prefix=f"first-sample-{rank}-")
        self.marks: list[dict[str, float]] = []
        if self.key == "webdataset":
            import webdataset  # noqa: F401
        elif self.key == "litdata":
            import litdata  # noqa: F401
        elif self.key == "mosaic":
            import_streaming()
        else:
            import distshard.sources  # noqa: F401

    def build(self, rank: int) -> Any:
        self.t0 = time.perf_counter()
        dataset = s3_dataset(self.key, self.data, self.shards, self.work, self.cache_bytes)
        self.built_s = time.perf_counter() - self.t0
        return dataset

    def keep(self, item: Any, values: list) -> None:
        now = time.time()
        if not values:
            self.marks.append({"first": now, "first_s": time.perf_counter() - self.t0})
        self.marks[-1]["last"] = now
        values.extend(item)

    def figures(self) -> dict[str, Any]:
        noted = [float(p.read_text()) for p in Path(self.first_dir).glob("*.txt")]
        shutil.rmtree(self.first_dir, ignore_errors=True)
        return {"marks": self.marks, "built_s": getattr(self, "built_s", None),
                "first_sample": min(noted) if noted else None}


def run_s3(key: str, data: str, shards: int, endpoints: list[str], world_size: int, timeout: float,
           epochs: int = 1, cache_bytes: int = 0) -> dict[str, Any]:
    """In a child process: one gloo group, one variant; the keys it delivered and each rank's times."""
    work = tempfile.mkdtemp(prefix="bench-s3-")  # the peers' local caches, the range cache
    try:
        run = harness.run_job(S3Job(key=key, data=data, shards=shards, work=work, endpoints=endpoints,
                                    world_size=world_size, timeout=timeout, epochs=epochs, cache_bytes=cache_bytes))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ranks = sorted(run.measured, key=lambda r: r["rank"])
    return {"errors": run.errors, "keys": run.values(), "wall_s": run.wall_s,
            "marks": [r.get("marks", []) for r in ranks], "walls": [r["wall_s"] for r in ranks],
            "built": [r.get("built_s") for r in ranks], "first_sample": [r.get("first_sample") for r in ranks]}


# -- the parent: moto, the proxy, the data, every row --------------------------------------------------
@dataclass
class Store:
    """moto, and the data already uploaded (by ``Setting.data``)."""

    moto: Any
    workdir: Path
    feats: dict[str, Any]
    uploaded: dict[str, dict[str, Any]] = field(default_factory=dict)
    indexed: dict[str, dict[str, Any]] = field(default_factory=dict)


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


def build_stored_index(store: Store, setting: Setting, proxy: Any, timeout: float) -> dict[str, Any]:
    """``python -m distshard index`` over the ``wds-indexed`` copy, through the proxy's
    general endpoint (timed and counted once per data), then the time to stream
    every shard once with as many threads (the issue's yardstick)."""
    if setting.data in store.indexed:
        return store.indexed[setting.data]
    urls = shard_urls(setting.data, "wds-indexed", setting.shards)
    env = harness.child_env(str(store.workdir / f"index-cache-{setting.data}"))
    env["AWS_ENDPOINT_URL"] = proxy.endpoints[0]
    threads = 16
    command = [sys.executable, "-m", "distshard", "index", urls]
    for flag in ("--workers", "--threads", "--jobs", "--concurrency"):
        if flag in store.feats.get("index_help", ""):
            command += [flag, str(threads)]
            break
    else:
        threads = 0  # the command's own default, unknown here
    started = time.perf_counter()  # what starting the command costs before it indexes (the interpreter, imports)
    with contextlib.suppress(subprocess.TimeoutExpired):
        subprocess.run(command[:4] + ["--help"], env=env, capture_output=True, timeout=timeout)
    startup = time.perf_counter() - started
    proxy.reset()
    started = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        error = None if done.returncode == 0 else f"exit {done.returncode}: {done.stderr[-1000:]}"
    except subprocess.TimeoutExpired:
        error = f"timed out after {timeout:.0f}s"
    seconds = time.perf_counter() - started
    proxy.settle()
    seen = proxy.snapshot()[0]
    result = {"seconds": seconds, "startup_s": startup, "error": error, "requests": seen["requests"], "bytes": sum(seen["bytes"].values()),
              "threads": threads, "command": " ".join(command[1:])}
    result["stream_s"] = stream_once(proxy.endpoints[0], setting, threads or 16)
    result["stream_threads"] = threads or 16
    store.indexed[setting.data] = result
    return result


def stream_once(endpoint: str, setting: Setting, threads: int) -> float:
    """Seconds to GET every tar shard whole, ``threads`` at a time, through ``endpoint``."""
    import concurrent.futures

    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    keys = [f"{setting.data}/wds/shard-{s:06d}.tar" for s in range(setting.shards)]
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda k: len(client.get_object(Bucket=BUCKET, Key=k)["Body"].read()), keys))
    return time.perf_counter() - started


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


def s3_row(key: str, result: dict[str, Any], manifest: dict[str, Any], slots: int) -> dict[str, Any]:
    """The figures of one run: wall, first batch per rank, requests by kind, before each
    rank's first batch, bytes, exactly-once (and the second epoch's for the cache row)."""
    if "skipped" in result:
        return {"key": key, "skipped": result["skipped"]}
    row: dict[str, Any] = {"key": key, "errors": result.get("errors", [])}
    seen = result.get("seen", [])
    requests: Counter = Counter()
    for port in seen:
        requests.update(port["requests"])
    row.update(requests=dict(requests), bytes=sum(sum(p["bytes"].values()) for p in seen))
    if row["errors"] or not result.get("marks") or any(not m for m in result["marks"]):
        return row
    marks = result["marks"]
    before = [sum(1 for t, _kind, _n in port["arrivals"] if t < m[0]["first"]) for port, m in zip(seen, marks, strict=True)]
    samples = result.get("first_sample") or [None] * len(seen)
    before_sample = [None if f is None else sum(1 for t, _kind, _n in port["arrivals"] if t < f)
                     for port, f in zip(seen, samples, strict=True)]
    row.update(wall_s=result["wall_s"], first_s=[m[0]["first_s"] for m in marks], before_first=before,
               before_sample=before_sample, built_s=result.get("built"))
    keys = result["keys"]
    if len(marks[0]) > 1:  # the cache row: epoch 2 from the first rank's end of epoch 1 on
        second = [sum(n for t, _kind, n in port["arrivals"] if t > m[0]["last"]) for port, m in zip(seen, marks, strict=True)]
        row["second_epoch_bytes"] = sum(second)
        row["second_epoch_s"] = max(m[1]["last"] - m[0]["last"] for m in marks)
        row["second_epoch_requests"] = sum(sum(1 for t, _k, _n in port["arrivals"] if t > m[0]["last"])
                                           for port, m in zip(seen, marks, strict=True))
        got, wanted = Counter(keys), Counter({k: 2 for k in manifest["keys"]})
        row["once"] = harness.Once(sum((got - wanted).values()), sum((wanted - got).values()),
                                   allowed_missing=2 * (len(manifest["keys"]) % slots)).cell()
    else:
        # litdata drops a distributed epoch's tail (its drop_last), Mosaic pads it (its padding)
        even = {"litdata": "drop", "mosaic": "pad", "webdataset": None}.get(key, "drop")
        row["once"] = harness.exactly_once(keys, manifest["keys"], even=even, slots=slots).cell()
    return row


def fmt_s(values: list[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


S3_COLUMNS = [Col("pipeline"), Col("wall s", 2), Col("vs litdata", right=True),
              Col("first batch s, per rank", right=True), Col("vs litdata", right=True),
              Col("of which building the pipeline", right=True),
              Col("HEAD + GET (+ LIST)", right=True),
              Col("requests before each rank's 1st sample (1st batch)", right=True),
              Col("bytes / dataset", 3), Col("exactly-once")]


def s3_table(setting: Setting, rows: list[dict[str, Any]], manifest: dict[str, Any]) -> str:
    """One setting's rows, with ratios to litdata's (the slowest rank's first batch)."""
    base = next((r for r in rows if r["key"] == "litdata" and "wall_s" in r), None)
    cells: list[list[Any]] = []
    for row in rows:
        label = S3_VARIANTS[row["key"]][0]
        if "skipped" in row:
            cells.append([label, f"not run: {row['skipped']}"])
            continue
        if "wall_s" not in row:
            cells.append([label, f"failed: {harness.error_line((row['errors'] or ['no run'])[0])[:120]}"])
            continue
        req = row["requests"]
        listed = f" (+ {req['LIST']:,})" if req.get("LIST") else ""
        other = sum(v for k, v in req.items() if k not in ("HEAD", "GET", "LIST"))
        counts = f"{req.get('HEAD', 0):,} + {req.get('GET', 0):,}{listed}" + (f" (+ {other} other)" if other else "")
        vs = harness.ratio(row["wall_s"] / base["wall_s"]) if base and "second_epoch_bytes" not in row else None
        vs_first = harness.ratio(max(row["first_s"]) / max(base["first_s"])) if base else None
        label_cell = label
        if "second_epoch_bytes" in row:
            label_cell += (f"; 2nd epoch: {row['second_epoch_s']:.2f} s, {row['second_epoch_requests']:,} requests, "
                           f"{row['second_epoch_bytes'] / manifest['bytes']:.3f}× the dataset from the store")
        built = row.get("built_s") or []
        cells.append([label_cell, row["wall_s"], vs, fmt_s(row["first_s"]), vs_first,
                      fmt_s(built) if built and None not in built else None, counts,
                      before_cell(row), row["bytes"] / manifest["bytes"], row["once"]])
    return harness.table(S3_COLUMNS, cells)


def before_cell(row: dict[str, Any]) -> str:
    """Requests each rank's processes made before its first sample, then before its first batch."""
    samples = row.get("before_sample") or [None] * len(row["before_first"])
    first = " / ".join("—" if s is None else f"{s:,}" for s in samples)
    return f"{first} ({' / '.join(f'{b:,}' for b in row['before_first'])})"


def s3_targets(tables: list[tuple[Setting, list[dict[str, Any]], dict[str, Any]]],
               indexed: dict[str, dict[str, Any]], feats: dict[str, Any]) -> list[str]:
    """The issue's targets, each ``met`` / ``MISSED`` with its figures (or why it was not measured)."""
    lines: list[str] = []

    def say(ok: bool | None, text: str) -> None:
        lines.append(f"- {'not measured' if ok is None else 'met' if ok else 'MISSED'}: {text}")

    for setting, rows, manifest in tables:
        by = {r["key"]: r for r in rows if "wall_s" in r}
        lit = by.get("litdata")
        if setting.bandwidth:
            floor = manifest["bytes"] / setting.bandwidth
            for key in ("distshard_stored", "distshard_cached", "distshard_cold"):
                if key in by:
                    ratio = by[key]["wall_s"] / floor
                    say(ratio <= 1.10, f"{setting.title}, {key}: wall {by[key]['wall_s']:.2f} s = {ratio:.2f}× "
                        f"(dataset bytes / bandwidth = {floor:.2f} s; target ≤ 1.10×)")
            continue
        stored = by.get("distshard_stored")
        if not feats.get("index"):
            say(None, f"{setting.title}: stored index (no `python -m distshard index` in this library)")
        elif stored is None or lit is None:
            say(False if stored is None else None, f"{setting.title}: stored-index row or litdata row did not run")
        else:
            wall, first = stored["wall_s"] / lit["wall_s"], max(stored["first_s"]) / max(lit["first_s"])
            heads = stored["requests"].get("HEAD", 0)
            before = [b for b in stored.get("before_sample") or [] if b is not None]
            say(wall <= 1.0, f"{setting.title}: stored index wall {stored['wall_s']:.2f} s = {wall:.2f}× litdata's")
            say(first <= 1.0, f"{setting.title}: stored index first batch {max(stored['first_s']):.2f} s = "
                f"{first:.2f}× litdata's {max(lit['first_s']):.2f} s")
            say(heads == 0, f"{setting.title}: stored index HEAD requests {heads} (target 0)")
            say(bool(before) and max(before) <= 4 if before else None,
                f"{setting.title}: stored index requests before a rank's first sample "
                f"{' / '.join(map(str, before)) or 'not noted'} (target ≤ 4; before its first batch of "
                f"{BATCH}: {' / '.join(map(str, stored['before_first']))}, one range per file a batch spans)")
        cache = by.get("distshard_local_cache")
        if cache is not None:
            share = cache["second_epoch_bytes"] / manifest["bytes"]
            say(share <= 0.05, f"{setting.title}: 2nd epoch from the local cache read {share:.3f}× the dataset "
                "from the store (target ≤ 0.05×)")
        for row in rows:
            if row["key"].startswith("distshard") and "once" in row and not row["once"].startswith("✓"):
                say(False, f"{setting.title}, {row['key']}: exactly-once {row['once']}")
    if not feats.get("cache_dir"):
        say(None, "2nd epoch from a local cache (no `ReadOptions(cache_dir=)` in this library)")
    for data, built in indexed.items():
        if built.get("error"):
            say(False, f"`python -m distshard index` over {data}: {built['error'][:200]}")
            continue
        net = max(0.0, built["seconds"] - built.get("startup_s", 0.0))
        ratio = net / built["stream_s"]
        say(ratio <= 1.2 if data.startswith("d1024") else None,
            f"`python -m distshard index` over {data} (at the first latency measured): {built['seconds']:.2f} s, "
            f"{sum(built['requests'].values()):,} requests; less its start ({built.get('startup_s', 0.0):.2f} s: "
            f"`index --help`) {net:.2f} s = {ratio:.2f}× streaming every shard once with "
            f"{built['stream_threads']} threads ({built['stream_s']:.2f} s; target ≤ 1.2× at 1,024 shards)")
    return lines


def orchestrate_s3(args: argparse.Namespace, chosen: list[str]) -> int:
    from latency_proxy import LatencyProxy, MotoProcess

    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}.items():
        os.environ[name] = value
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "S3_ENDPOINT_URL"):
        os.environ.pop(name, None)
    session = harness.Session()
    feats = features()
    chosen = [k for k in chosen if k not in FEATURES or feats[FEATURES[k]]]
    left = [k for k in FEATURES if not feats[FEATURES[k]]]
    workdir = Path(tempfile.mkdtemp(prefix="bench_remote_s3-"))
    slots = args.world_size * NUM_WORKERS
    tables: list[tuple[Setting, list[dict[str, Any]], dict[str, Any]]] = []
    moto = proxy = None
    try:
        import boto3

        moto = MotoProcess().start()
        boto3.client("s3", endpoint_url=moto.endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        store = Store(moto, workdir, feats)
        chosen_settings = settings(args.quick)
        if args.settings:
            chosen_settings = [chosen_settings[int(i)] for i in args.settings.split(",")]
        for setting in chosen_settings:
            manifest = prepare_data(store, setting, convert=any(S3_VARIANTS[k][1] == "peers" for k in chosen))
            proxy = LatencyProxy(moto.endpoint, latency=setting.latency, bandwidth=setting.bandwidth,
                                 ports=args.world_size + 1).start()
            if "distshard_stored" in chosen or "distshard_local_cache" in chosen or args.index_only:
                if feats["index"]:
                    build_stored_index(store, setting, proxy, args.timeout)
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
            proxy.stop()
            proxy = None
            rows = [median_row(k, [s3_row(k, res, manifest, slots) for res in results[k]]) for k in chosen]
            tables.append((setting, rows, manifest))
        print(session.header(f"{args.world_size} ranks x {NUM_WORKERS} fork workers, batch {BATCH}, one epoch; "
                             f"{args.rounds} round(s), medians; moto on 127.0.0.1 behind the latency proxy"))
        for setting, rows, manifest in tables:
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
        print("\n**Targets** (issue 22; ratios to litdata in the same run)")
        for line in s3_targets(tables, store.indexed, feats):
            print(line)
        if left:
            print(f"\nrows left out (the library lacks the feature): {', '.join(left)}")
        print("\nwall: the slowest rank, from building the pipeline to the end of the epoch; first batch: from "
              "building the pipeline, each rank; requests and bytes: what the proxy relayed for the ranks and their "
              "workers (each rank has its own endpoint); bytes over the tar shards' bytes (litdata's and Mosaic's "
              "copies are about as big).")
        session.dump(args.json, tables=[{"setting": s.__dict__, "rows": rows, "samples": len(m["keys"]),
                                         "bytes": m["bytes"]} for s, rows, m in tables],
                     indexed=store.indexed, features={k: v for k, v in feats.items() if k != "index_help"})
    finally:
        if proxy is not None:
            proxy.stop()
        if moto is not None:
            moto.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def median_row(key: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Over rounds: the median wall, the per-rank median first batch, the first
    complete round's counts (requests do not vary with timing much)."""
    good = [r for r in runs if "wall_s" in r]
    if not good:
        return runs[0]
    row = dict(good[0])
    row["wall_s"] = harness.median(r["wall_s"] for r in good)
    row["first_s"] = [harness.median(r["first_s"][i] for r in good) for i in range(len(good[0]["first_s"]))]
    row["left_out"] = harness.left_out(runs, good)
    bad = next((r for r in good if not r["once"].startswith("✓")), None)
    if bad is not None:
        row["once"] = bad["once"]
    return row


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
