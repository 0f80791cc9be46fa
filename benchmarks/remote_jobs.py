"""bench_remote's contenders, on a gloo group in a child process tree: what every rank
builds for a row and iterates (``RemoteJob`` over HTTP, ``S3Job`` through its own
endpoint of the latency proxy), when each process met its first sample, and
``run_variant`` / ``run_s3``, which bench_remote runs in a child by name (``harness.launch``)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import harness
from remote_data import BUCKET, import_streaming, shard_urls

NUM_WORKERS = 2
BATCH = 32


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


# -- the contenders (in a child process tree, on a gloo group) ---------------------------------------
def key_only(item: Any) -> Any:
    return item["key"]


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
