"""bench_remote's data: the seeded tar shards of both suites; for the S3 suite, its
settings, the same samples as litdata chunks and Mosaic MDS shards (``convert``, run
by bench_remote in the peers' venv by name, ``harness.launch``), their upload to moto,
and the stored index built once per data with ``python -m distshard index``."""

from __future__ import annotations

import contextlib
import io
import os
import random
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import harness
from bench_files import fake_jpeg

MiB = 1 << 20
BUCKET = "bench"


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


def shard_urls(data: str, folder: str, shards: int) -> str:
    """The brace pattern of ``shards`` tar shards under ``s3://bench/data/folder/``."""
    return f"s3://{BUCKET}/{data}/{folder}/shard-{{000000..{shards - 1:06d}}}.tar"


# -- the parent: moto, the proxy, the data, every row --------------------------------------------------
@dataclass
class Store:
    """moto, and the data already uploaded (by ``Setting.data``)."""

    moto: Any
    workdir: Path
    feats: dict[str, Any]
    uploaded: dict[str, dict[str, Any]] = field(default_factory=dict)
    indexed: dict[str, dict[str, Any]] = field(default_factory=dict)


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
