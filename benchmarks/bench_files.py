"""Real sharded files: ``distshard.webdataset`` against torch's ``sharding_filter``
and the real peers (webdataset, Hugging Face ``datasets``, MosaicML Streaming),
in one run, on the same generated data, 4 gloo ranks × 2 DataLoader workers.

The data
--------
64 WebDataset-style tar shards (``--shards``) of 201–492 samples each (seeded),
each sample a JPEG-like blob (``.jpg``: a JPEG start marker, 1–4 KiB of
incompressible bytes, an end marker) and its label (``.cls``). Mosaic reads its
own format: the same samples converted once to MDS (conversion time reported,
outside the measured window).

What runs
---------
Every variant runs in its own process tree: ``python bench_files.py --run KEY``
(the dev venv for torch and distshard, the benchmark-only venv
``benchmarks/.venv`` for the peers), which starts a gloo group of
``WORLD_SIZE = 4`` ranks on 127.0.0.1 (``distshard.verify.run_on_group``); every
rank iterates ``DataLoader(dataset, batch_size=32, num_workers=2,
multiprocessing_context="fork")``, so there are ``S = 8`` slots. ``decode`` is
the same in every variant: a BLAKE2b of the JPEG bytes, then a calibrated busy
loop (~0.25 ms of CPU), counted. Each distshard run starts with an empty
``$DISTSHARD_CACHE``: the cold index build is part of the measured job. Rounds
are interleaved (every variant once per round, in a rotating order) and the
table shows medians.

Columns
-------
per-slot counts
    samples each slot yielded (the last pipe of every pipeline counts them in
    its worker), min–max over the 8 slots.
exactly-once
    the multiset of every key the 4 ranks received against the N keys of the
    data: ✓, or the duplicates / missing; ``even="drop"`` may drop ``N mod 8``.
decodes / N
    decode calls summed over all processes, divided by N.
read / data
    bytes read (``rchar`` of ``/proc/self/io``: every ``read``/``pread``) by the
    8 workers over their life plus by the 4 ranks while they build the pipeline
    (a rank's reads while iterating are the batches its workers send it through
    pipes, not file reads, so they are not counted), divided by the tar bytes.
CPU s / wall s
    user + sys CPU of the 4 ranks and their workers over the window (from just
    before the pipeline is built to the workers' exit), summed; the slowest
    rank's wall time over the same window.
peak RSS
    the peak resident set of the 12 processes, summed (forked workers share
    pages, so this over-counts what the job needs).
user lines
    the lines a user writes to get from shard files to decoded samples per slot
    (the DataLoader line, common to all, excluded).

How to run
----------
::

    .venv/bin/python benchmarks/bench_files.py --setup-peers   # once: benchmarks/.venv with the peers
    .venv/bin/python benchmarks/bench_files.py                 # 64 shards, 3 rounds: ~10 min on 2 cores
    .venv/bin/python benchmarks/bench_files.py --quick         # 12 shards, 1 round
    .venv/bin/python benchmarks/bench_files.py --only distshard,webdataset --json files.json

Without the peers' venv their rows say so; nothing else needs more than the dev venv.
"""

from __future__ import annotations

import argparse
import hashlib
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
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
PEERS_VENV = HERE / ".venv"
REQUIREMENTS = HERE / "requirements-peers.txt"
WORLD_SIZE, NUM_WORKERS, BATCH = 4, 2, 32
NUM_SLOTS = WORLD_SIZE * NUM_WORKERS
DECODE_TARGET_S = 0.25e-3

warnings.filterwarnings("ignore", message=".*torchdata.*", category=UserWarning)
warnings.filterwarnings("ignore", message="This DataLoader will create")

from torch.utils.data import IterableDataset  # noqa: E402
from torch.utils.data.datapipes.datapipe import IterDataPipe  # noqa: E402


# -- the data ------------------------------------------------------------------------------
def fake_jpeg(rng: random.Random, size: int) -> bytes:
    """JPEG-looking bytes: SOI + APP0 marker, incompressible payload, EOI."""
    head = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    return head + rng.randbytes(max(0, size - len(head) - 2)) + b"\xff\xd9"


def generate(folder: Path, shards: int, low: int, high: int, seed: int = 0) -> dict[str, Any]:
    """Write the shards; returns the manifest (urls, keys, bytes)."""
    folder = folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    urls, keys = [], []
    for s in range(shards):
        path = folder / f"shard-{s:06d}.tar"
        with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
            for i in range(rng.randint(low, high)):
                key = f"s{s:04d}_{i:04d}"
                for ext, data in (("jpg", fake_jpeg(rng, rng.randint(1024, 4096))),
                                  ("cls", str(rng.randrange(1000)).encode())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size, info.mtime = len(data), 1_700_000_000
                    tf.addfile(info, io.BytesIO(data))
                keys.append(key)
        urls.append(str(path))
    manifest = {"urls": urls, "keys": keys, "bytes": sum(os.path.getsize(u) for u in urls),
                "pattern": str(folder / f"shard-{{000000..{shards - 1:06d}}}.tar")}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def import_streaming() -> Any:
    """``import streaming`` (MosaicML), without its vision datasets: they import
    torchvision, whose PyPI wheel is a CUDA build that cannot load next to the
    local CPU torch ("libc10_cuda.so: cannot open shared object file"), and this
    benchmark uses none of them (``StreamingDataset`` and ``MDSWriter`` need no
    torchvision)."""
    import types

    sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    import streaming

    return streaming


def convert_to_mds(manifest: dict[str, Any], out: Path) -> dict[str, Any]:
    """Mosaic's own format, written once (peers venv)."""
    MDSWriter = import_streaming().MDSWriter

    started = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    with MDSWriter(out=str(out), columns={"__key__": "str", "jpg": "bytes", "cls": "bytes"},
                   size_limit=1 << 22) as writer:
        for url in manifest["urls"]:
            for sample in read_tar(url):
                writer.write({"__key__": sample["__key__"], "jpg": sample["jpg"], "cls": sample["cls"]})
    return {"seconds": time.perf_counter() - started,
            "bytes": sum(p.stat().st_size for p in out.rglob("*") if p.is_file())}


# -- decode: counted, the same everywhere ------------------------------------------------------
_DECODES = 0


def burn(iters: int, seed: bytes) -> bytes:
    digest = seed
    for _ in range(iters):
        digest = hashlib.blake2b(digest, digest_size=16).digest()
    return digest


class Decode:
    """``sample -> key`` after hashing the JPEG bytes and ``iters`` digests of CPU
    (``{"__key__": key}`` with ``as_dict``: Hugging Face's ``map`` wants a dict)."""

    def __init__(self, iters: int, as_dict: bool = False) -> None:
        self.iters = iters
        self.as_dict = as_dict

    def __call__(self, sample: dict[str, Any]) -> Any:
        global _DECODES
        _DECODES += 1
        jpg = sample["jpg"]
        if isinstance(jpg, dict):  # Hugging Face's Image(decode=False)
            jpg = jpg["bytes"]
        burn(self.iters, hashlib.blake2b(jpg, digest_size=16).digest())
        return {"__key__": sample["__key__"]} if self.as_dict else sample["__key__"]


def calibrate(target_s: float) -> tuple[int, float]:
    probe, calls, start = 256, 0, time.process_time()
    while time.process_time() - start < 0.2:
        burn(probe, calls.to_bytes(8, "little"))
        calls += 1
    iters = max(1, round(target_s / ((time.process_time() - start) / (calls * probe))))
    start = time.process_time()
    for i in range(200):
        burn(iters, i.to_bytes(8, "little"))
    return iters, (time.process_time() - start) / 200


# -- the variants ----------------------------------------------------------------------------------
def read_tar(url):  # the tar reader a torch user writes (torchdata 0.11 has none)
    with tarfile.open(url, "r|") as tf:
        sample = None
        for member in tf:
            if not member.isfile():
                continue
            key, ext = member.name.split(".", 1)
            if sample is None or sample["__key__"] != key:
                if sample is not None:
                    yield sample
                sample = {"__key__": key}
            sample[ext] = tf.extractfile(member).read()
        if sample is not None:
            yield sample


class TarSamples(IterDataPipe):  # ... and the pipe around it
    def __init__(self, urls):
        self.urls = urls

    def __iter__(self):
        for url in self.urls:
            yield from read_tar(url)


_READER_LINES = 13 + 6  # read_tar + TarSamples, as a user writes them


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    venv: str  # "dev" or "peers"
    code: str  # what the user writes (shown in the README)
    extra_lines: int = 0  # helper code the user writes besides ``code``
    distshard: bool = False
    epochs: int = 1  # > 1: the even='drop' / 'carry' rows, run over several epochs (a table of their own)

    @property
    def lines(self) -> int:
        return len([line for line in self.code.splitlines() if line.strip()]) + self.extra_lines


VARIANTS = [
    Variant("sf_files", "torch `sharding_filter` over files", "dev",
            "dp = TarSamples(IterableWrapper(urls).sharding_filter()).map(decode)",
            extra_lines=_READER_LINES),
    Variant("sf_samples", "torch `sharding_filter` over samples", "dev",
            "dp = TarSamples(IterableWrapper(urls)).sharding_filter().map(decode)",
            extra_lines=_READER_LINES),
    Variant("webdataset", "webdataset 1.0.2", "peers",
            "ds = wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node,\n"
            "                    workersplitter=wds.split_by_worker, empty_check=False)\n"
            "ds = ds.map(decode)"),
    Variant("hf", "HF datasets 4.8.5 (streaming)", "peers",
            'ds = load_dataset("webdataset", data_files={"train": urls}, split="train", streaming=True)\n'
            'ds = ds.cast_column("jpg", Image(decode=False))\n'
            "ds = split_dataset_by_node(ds, rank=rank, world_size=world_size)\n"
            'ds = ds.map(decode, remove_columns=["jpg", "cls", "__url__"])'),
    Variant("mosaic", "MosaicML Streaming 0.13.0 (MDS copy)", "peers",
            "class Decoded(StreamingDataset):\n"
            "    def __getitem__(self, i):\n"
            "        return decode(super().__getitem__(i))\n"
            "ds = Decoded(local=mds_dir, shuffle=False, batch_size=32)",
            extra_lines=1),  # MDSWriter conversion, at least one more line
    Variant("distshard", "distshard.webdataset", "dev",
            'dp = distshard.webdataset(urls).dist_shard(even="drop").map(decode)', distshard=True),
    Variant("distshard_shuffle", "distshard.webdataset, shuffle=True", "dev",
            'dp = distshard.webdataset(urls).dist_shard(even="drop", shuffle=True).map(decode)',
            distshard=True),
    Variant("distshard_drop_epochs", "distshard.webdataset, even='drop', 4 epochs", "dev",
            'dp = distshard.webdataset(urls).dist_shard(even="drop", multiple_of=32).map(decode)',
            distshard=True, epochs=4),
    Variant("distshard_carry_epochs", "distshard.webdataset, even='carry', 4 epochs", "dev",
            'dp = distshard.webdataset(urls).dist_shard(even="carry", multiple_of=32).map(decode)',
            distshard=True, epochs=4),
]
BY_KEY = {v.key: v for v in VARIANTS}


def import_libraries(key: str, urls: list[str]) -> None:
    """Import what ``key`` needs before the measured window (imports read .py
    files: that is not reading the data)."""
    if key == "webdataset":
        import webdataset  # noqa: F401
    elif key == "hf":
        from datasets import Image, load_dataset

        # HF imports more on the first iteration (~240 KB of .py per process):
        # one sample of one shard here, before the window, so that forked workers have it
        ds = load_dataset("webdataset", data_files={"train": urls[:1]}, split="train", streaming=True)
        next(iter(ds.cast_column("jpg", Image(decode=False))))
    elif key == "mosaic":
        import_streaming()
    elif key.startswith("distshard"):
        import distshard.sources  # noqa: F401


def build(key: str, manifest: dict[str, Any], decode: Decode, rank: int, mds: str | None) -> Any:
    urls = manifest["urls"]
    if key in ("sf_files", "sf_samples"):
        from torch.utils.data.datapipes.iter import IterableWrapper

        if key == "sf_files":
            return TarSamples(IterableWrapper(urls).sharding_filter()).map(decode)
        return TarSamples(IterableWrapper(urls)).sharding_filter().map(decode)
    if key == "webdataset":
        import webdataset as wds

        ds = wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node,
                            workersplitter=wds.split_by_worker, empty_check=False)
        return ds.map(decode)
    if key == "hf":
        from datasets import Image, load_dataset
        from datasets.distributed import split_dataset_by_node

        ds = load_dataset("webdataset", data_files={"train": urls}, split="train", streaming=True)
        ds = ds.cast_column("jpg", Image(decode=False))
        ds = split_dataset_by_node(ds, rank=rank, world_size=WORLD_SIZE)
        return ds.map(Decode(decode.iters, as_dict=True), remove_columns=["jpg", "cls", "__url__"])
    if key == "mosaic":
        StreamingDataset = import_streaming().StreamingDataset

        class Decoded(StreamingDataset):
            def __getitem__(self, i: int) -> Any:
                return decode(super().__getitem__(i))

        return Decoded(local=mds, shuffle=False, batch_size=BATCH)
    if key in ("distshard", "distshard_shuffle"):
        import distshard
        import distshard.sources

        webdataset = getattr(distshard, "webdataset", distshard.sources.webdataset)  # until it is exported
        return webdataset(urls).dist_shard(even="drop", shuffle=key == "distshard_shuffle").map(decode)
    if key in ("distshard_drop_epochs", "distshard_carry_epochs"):
        import distshard

        even = "carry" if key == "distshard_carry_epochs" else "drop"
        return distshard.webdataset(urls).dist_shard(even=even, multiple_of=BATCH).map(decode)
    raise ValueError(f"unknown variant {key!r}")


# -- measuring inside the ranks and workers ------------------------------------------------------------
def rchar() -> int:
    """Bytes this process passed to read()/pread() so far."""
    with open("/proc/self/io", "rb") as f:
        for line in f:
            if line.startswith(b"rchar:"):
                return int(line.split()[1])
    return 0


_BASE: dict[str, float] = {}
_EPOCH = 0  # the epoch a rank runs (its forked workers inherit it)


def worker_init(_: int) -> None:
    _BASE.update(decodes=_DECODES, rchar=rchar(), cpu=time.process_time())


def _report(outdir: str, rank: int, yielded: int) -> None:
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    worker = -1 if info is None else info.id
    usage = resource.getrusage(resource.RUSAGE_SELF)
    record = {"rank": rank, "worker": worker, "yielded": yielded,
              "decodes": _DECODES - _BASE.get("decodes", 0), "rchar": rchar() - _BASE.get("rchar", 0),
              "cpu_s": time.process_time() - _BASE.get("cpu", 0), "maxrss_kib": usage.ru_maxrss,
              "epoch": _EPOCH}
    (Path(outdir) / f"r{rank}-w{worker}-e{_EPOCH}-p{os.getpid()}.json").write_text(json.dumps(record))


class _Reporting:
    """The last stage: counts what this slot yields and, at its end, reports."""

    def __init__(self, inner: Any, outdir: str, rank: int) -> None:
        self.inner, self.outdir, self.rank = inner, outdir, rank

    def __iter__(self) -> Iterator[Any]:
        yielded = 0
        try:
            for item in self.inner:
                yielded += 1
                yield item
        finally:
            _report(self.outdir, self.rank, yielded)


class ReportPipe(_Reporting, IterDataPipe):
    """For DataPipes: stays a DataPipe, so that the DataLoader shards and seeds its graph."""


class ReportDataset(_Reporting, IterableDataset):
    """For the peers' iterable datasets."""


def _wrap(inner: Any, outdir: str, rank: int) -> Any:
    return (ReportPipe if isinstance(inner, IterDataPipe) else ReportDataset)(inner, outdir, rank)


def _cpu(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


def rank_main(rank: int, world_size: int, key: str, manifest: dict[str, Any], iters: int,
              outdir: str, mds: str | None, timeout: float, epochs: int = 1) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1")
    mydir = Path(outdir) / f"rank{rank}"
    mydir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"rank": rank, "keys": [], "error": None}
    import_libraries(key, manifest["urls"])
    dist.barrier()
    self0, children0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    wall0, rchar0, decodes0 = time.perf_counter(), rchar(), _DECODES
    pipe = None
    try:
        pipe = _wrap(build(key, manifest, Decode(iters), rank, mds), str(mydir), rank)
        out["reads"] = _how_it_reads(pipe)
    except BaseException:  # noqa: BLE001 - reported
        out["error"] = traceback.format_exc()
    ok = torch.tensor([0 if pipe is None else 1])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok.item():
        out["error"] = out["error"] or "another rank failed to build its pipeline"
        return out
    out["rank_rchar"] = rchar() - rchar0
    global _EPOCH
    iterator = None
    try:
        loader = DataLoader(pipe, batch_size=BATCH, num_workers=NUM_WORKERS, multiprocessing_context="fork",
                            worker_init_fn=worker_init, timeout=timeout)
        for epoch in range(epochs):
            if epochs > 1:
                import distshard

                distshard.set_epoch(pipe, epoch)
            _EPOCH = epoch
            iterator = iter(loader)
            for batch in iterator:
                out["keys"].extend(batch["__key__"] if isinstance(batch, dict) else batch)
            iterator._shutdown_workers()
            iterator = None
    except BaseException:  # noqa: BLE001
        out["error"] = traceback.format_exc()
    finally:
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        del iterator
    out["wall_s"] = time.perf_counter() - wall0
    out["cpu_s"] = (_cpu(resource.getrusage(resource.RUSAGE_SELF)) - _cpu(self0)
                    + _cpu(resource.getrusage(resource.RUSAGE_CHILDREN)) - _cpu(children0))
    out["rank_decodes"] = _DECODES - decodes0
    out["rank_maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out["workers"] = [json.loads(p.read_text()) for p in sorted(mydir.glob("*.json"))]
    return out


def _how_it_reads(pipe: Any) -> str:
    """For distshard rows: does dist_shard read the source at random (the file
    sources' protocol wired in), or stream it?"""
    try:
        from distshard.datapipe import shards_in
    except ImportError:
        return ""
    shards = shards_in(pipe.inner) if hasattr(pipe, "inner") else []
    if not shards:
        return ""
    try:
        plan = shards[0].read_plan()
    except Exception as exc:  # noqa: BLE001 - an API in flux must not fail the run
        return f"unknown ({type(exc).__name__})"
    return "random access" if plan.sequence is not None else "streams (protocol not wired)"


def run_variant(key: str, manifest: dict[str, Any], iters: int, mds: str | None, timeout: float) -> dict[str, Any]:
    """In the ``--run`` process: one gloo group, one variant; a summary."""
    from distshard.verify import run_on_group

    epochs = BY_KEY[key].epochs
    with tempfile.TemporaryDirectory(prefix="bench_files-") as outdir:
        outcomes = run_on_group(rank_main, world_size=WORLD_SIZE, timeout=timeout * epochs,
                                args=(key, manifest, iters, outdir, mds, timeout, epochs))
    errors = [f"rank {o.rank}: {o.error or o.value.get('error')}" for o in outcomes
              if o.error or o.value is None or o.value.get("error")]
    values = [o.value for o in outcomes if o.value is not None and "wall_s" in o.value]
    workers = [w for v in values for w in v["workers"]]
    got = Counter(k for v in values for k in v["keys"])
    expected = Counter(manifest["keys"])
    slots = {(w["rank"], w["worker"]): w["yielded"] for w in workers}
    epochs_part: dict[str, Any] = {}
    if epochs > 1:
        epochs_part = _epochs_summary(key, got, manifest["keys"], workers, epochs)
        expected = Counter({k: epochs for k in manifest["keys"]})
    return {
        **epochs_part,
        "errors": errors,
        "complete": len(values) == WORLD_SIZE and len(workers) == NUM_SLOTS * epochs,
        "per_slot": [slots.get((r, w)) for r in range(WORLD_SIZE) for w in range(NUM_WORKERS)],
        "duplicates": sum((got - expected).values()),
        "missing": sum((expected - got).values()),
        "decodes": sum(v["rank_decodes"] for v in values) + sum(w["decodes"] for w in workers),
        "read_bytes": sum(v["rank_rchar"] for v in values) + sum(w["rchar"] for w in workers),
        "rank_read_bytes": [v["rank_rchar"] for v in values],
        "worker_read_bytes": [w["rchar"] for w in workers],
        "cpu_s": sum(v["cpu_s"] for v in values),
        "wall_s": max((v["wall_s"] for v in values), default=float("nan")),
        "rss_mib": (sum(v["rank_maxrss_kib"] for v in values) + sum(w["maxrss_kib"] for w in workers)) / 1024,
        "reads": next((v.get("reads") for v in values if v.get("reads")), ""),
    }


def _epochs_summary(key: str, got: Counter, keys: list[str], workers: list[dict[str, Any]],
                    epochs: int) -> dict[str, Any]:
    """The even='drop' / 'carry' rows: per-slot counts of every epoch, and what was
    delivered against the epochs' concatenated streams (each the keys in file order)."""
    n, unit = len(keys), NUM_SLOTS * BATCH  # multiple_of=BATCH: rounds of whole batches
    if key == "distshard_carry_epochs":  # epoch e takes [U floor(eN/U), U floor((e+1)N/U)) of the concatenation
        wanted = Counter(keys[g % n] for g in range(unit * (epochs * n // unit)))
    else:
        wanted = Counter(k for _ in range(epochs) for k in keys[:n // unit * unit])
    per_epoch: dict[int, list[int]] = {}
    for record in workers:
        per_epoch.setdefault(record["epoch"], []).append(record["yielded"])
    every = Counter({k: epochs for k in keys})
    delivered = sum(got.values())
    left = epochs * n - delivered if key == "distshard_carry_epochs" else 0
    return {"per_epoch_slots": {e: sorted(c) for e, c in sorted(per_epoch.items())},
            "equal_slots": len(per_epoch) == epochs and all(len(c) == NUM_SLOTS and len(set(c)) == 1
                                                            for c in per_epoch.values()),
            "delivered": delivered, "exact": got == wanted, "left_for_next_epoch": left,
            "dropped": sum((every - got).values()) - left, "padded": sum((got - every).values())}


def epochs_table(rows: list[dict[str, Any]]) -> str:
    """The even='drop' / 'carry' rows over several epochs, CPU against drop's."""
    drop = next((row for row in rows if row["key"] == "distshard_drop_epochs" and "cpu_s" in row), None)
    lines = ["| pipeline | per-slot counts by epoch | equal slots | delivered | dropped | padded | left for the "
             "next epoch | exact | CPU s | CPU / drop's |", "|---|---|---|---:|---:|---:|---:|---|---:|---:|"]
    for row in rows:
        variant = BY_KEY[row["key"]]
        if "epochs_runs" not in row:
            lines.append(f"| `{variant.code}` | not run: {(row.get('errors') or [row.get('skipped')])[0]} |"
                         + " |" * 8)
            continue
        last = row["epochs_runs"][-1]
        counts = " / ".join(str(c[0]) if len(set(c)) == 1 else f"{min(c)}–{max(c)}"
                            for c in last["per_epoch_slots"].values())
        ratio = f"{row['cpu_s'] / drop['cpu_s']:.3f}×" if drop else "—"
        exact = all(r["exact"] and r["equal_slots"] for r in row["epochs_runs"])
        lines.append(f"| `{variant.code}` | {counts} | {'✓' if last['equal_slots'] else '✗'} | {last['delivered']} "
                     f"| {last['dropped']} | {last['padded']} | {last['left_for_next_epoch']} | {'✓' if exact else '✗'} "
                     f"| {row['cpu_s']:.1f} | {ratio} |")
    return "\n".join(lines)


# -- the parent: generate, run every variant in rounds, tabulate --------------------------------------
def peers_python() -> Path | None:
    python = PEERS_VENV / "bin" / "python"
    return python if python.exists() else None


def setup_peers() -> int:
    """Create ``benchmarks/.venv`` and install the peers (torch pinned in the same command)."""
    if not peers_python():
        subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
        base = Path(sys.base_prefix) / "bin" / "python3"
        if not peers_python() and base.exists():
            subprocess.run([str(base), "-m", "venv", str(PEERS_VENV)], check=True)
    return subprocess.run([str(peers_python()), "-m", "pip", "install", "-r", str(REQUIREMENTS)]).returncode


def _child_env(cache: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "pipes"), str(HERE)])
    env.update(DISTSHARD_CACHE=cache, HF_HOME=os.path.join(cache, "hf"), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore")
    return env


def launch(variant: Variant, data: Path, iters: int, mds: Path | None, timeout: float) -> dict[str, Any]:
    python = sys.executable if variant.venv == "dev" else peers_python()
    if python is None:
        return {"skipped": f"no benchmark venv ({PEERS_VENV.relative_to(ROOT)}): run with --setup-peers"}
    with tempfile.TemporaryDirectory(prefix="bench_files-cache-") as cache:
        out = Path(cache) / "result.json"
        command = [str(python), str(Path(__file__).resolve()), "--run", variant.key, "--data", str(data),
                   "--iters", str(iters), "--out", str(out), "--timeout", str(timeout)]
        if mds is not None:
            command += ["--mds", str(mds)]
        try:
            done = subprocess.run(command, env=_child_env(cache), capture_output=True, text=True,
                                  timeout=timeout + 120)
        except subprocess.TimeoutExpired:
            return {"errors": [f"timed out after {timeout + 120:.0f}s"], "complete": False}
        if not out.exists():
            return {"errors": [f"exit {done.returncode}: {done.stderr[-2000:]}"], "complete": False}
        return json.loads(out.read_text())


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(variant: Variant, runs: list[dict[str, Any]], manifest: dict[str, Any]) -> dict[str, Any]:
    n, total = len(manifest["keys"]), manifest["bytes"]
    if runs and "skipped" in runs[0]:
        return {"key": variant.key, "skipped": runs[0]["skipped"]}
    good = [r for r in runs if r.get("complete") and not r.get("errors")]
    row: dict[str, Any] = {"key": variant.key, "label": variant.label, "lines": variant.lines, "runs": runs,
                           "errors": [e for r in runs for e in r.get("errors", [])]}
    if not good:
        return row
    if variant.epochs > 1:
        row.update(epochs_runs=[{k: r[k] for k in ("per_epoch_slots", "equal_slots", "delivered", "exact",
                                                   "left_for_next_epoch", "dropped", "padded")} for r in good],
                   cpu_s=_median([r["cpu_s"] for r in good]), cpu_runs=[r["cpu_s"] for r in good])
        return row
    allowed_drop = n % NUM_SLOTS if variant.distshard else 0
    once = all(r["duplicates"] == 0 and r["missing"] <= allowed_drop for r in good)
    slots = good[0]["per_slot"]
    row.update(
        per_slot=f"{min(slots)}–{max(slots)}" if min(slots) != max(slots) else f"{slots[0]} each",
        exactly_once="✓" if once else f"✗ {good[0]['duplicates']} dup, {good[0]['missing']} missing",
        dropped=good[0]["missing"] if once else None,
        decodes_per_n=_median([r["decodes"] / n for r in good]),
        read_ratio=_median([r["read_bytes"] / total for r in good]),
        cpu_s=_median([r["cpu_s"] for r in good]),
        wall_s=_median([r["wall_s"] for r in good]),
        rss_mib=_median([r["rss_mib"] for r in good]),
        reads=good[0].get("reads", ""),
    )
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| pipeline | per-slot counts | exactly-once | decodes / N | read / data | CPU s | wall s "
            "| peak RSS MiB | user lines |")
    lines = [head, "|" + "---|" * 9]
    for row in rows:
        variant = BY_KEY[row["key"]]
        if "skipped" in row:
            lines.append(f"| {variant.label} | not run: {row['skipped']} |" + " |" * 7)
        elif "per_slot" not in row:
            first = (row["errors"] or ["no complete run"])[0].strip().splitlines()[-1][:120]
            lines.append(f"| {variant.label} | failed: {first} |" + " |" * 7)
        else:
            label = variant.label + (f" ({row['reads']})" if variant.distshard and row["reads"] else "")
            once = row["exactly_once"] + (f" (drop {row['dropped']})" if row["dropped"] else "")
            lines.append(
                f"| {label} | {row['per_slot']} | {once} | {row['decodes_per_n']:.2f} | {row['read_ratio']:.2f}× "
                f"| {row['cpu_s']:.1f} | {row['wall_s']:.1f} | {row['rss_mib']:.0f} | {row['lines']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="12 shards of 40-90 samples, 1 round")
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated variant keys: " + ",".join(BY_KEY))
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", type=Path, help="also dump every measurement here")
    parser.add_argument("--data", type=Path, help="where to write the shards (default: a temp dir)")
    parser.add_argument("--setup-peers", action="store_true", help="create benchmarks/.venv with the peers")
    # internal: one variant in a fresh process tree
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--iters", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--mds", help=argparse.SUPPRESS)
    parser.add_argument("--convert-mds", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.setup_peers:
        return setup_peers()
    if args.convert_mds is not None:  # in the peers venv
        manifest = json.loads((args.data / "manifest.json").read_text())
        args.out.write_text(json.dumps(convert_to_mds(manifest, args.convert_mds)))
        return 0
    if args.run:
        manifest = json.loads((args.data / "manifest.json").read_text())
        try:
            result = run_variant(args.run, manifest, args.iters, args.mds, args.timeout)
        except BaseException:  # noqa: BLE001
            result = {"errors": [traceback.format_exc()], "complete": False}
        args.out.write_text(json.dumps(result))
        return 0
    return orchestrate(args)


def orchestrate(args: argparse.Namespace) -> int:
    from _common import command_line, environment, write_json

    chosen = [BY_KEY[k] for k in args.only.split(",") if k] if args.only else VARIANTS
    shards, low, high, rounds = (12, 40, 90, 1) if args.quick else (args.shards, 201, 492, args.rounds)
    workdir = Path(tempfile.mkdtemp(prefix="bench_files-data-"))
    data = args.data or workdir / "shards"
    try:
        manifest = generate(data, shards, low, high)
        n, total = len(manifest["keys"]), manifest["bytes"]
        iters, cost = calibrate(DECODE_TARGET_S)
        print(f"# {command_line()}")
        print(f"# Python {sys.version.split()[0]}, torch {environment()['torch']}, {os.cpu_count()} cores; "
              f"{shards} shards, {n:,} samples, {total / 2**20:.1f} MiB; decode {cost * 1e3:.2f} ms; "
              f"{WORLD_SIZE} ranks x {NUM_WORKERS} workers, batch {BATCH}; {rounds} round(s), medians", flush=True)
        mds, mds_bytes = None, 0
        if any(v.key == "mosaic" for v in chosen) and peers_python():
            mds = workdir / "mds"
            out = workdir / "mds.json"
            subprocess.run([str(peers_python()), str(Path(__file__).resolve()), "--convert-mds", str(mds),
                            "--data", str(data), "--out", str(out)], env=_child_env(str(workdir)), check=False,
                           capture_output=True, text=True, timeout=args.timeout)
            if out.exists():
                conversion = json.loads(out.read_text())
                mds_bytes = conversion["bytes"]
                print(f"# MDS conversion for Mosaic: {conversion['seconds']:.1f} s, "
                      f"{conversion['bytes'] / 2**20:.1f} MiB (outside the measured window)", flush=True)
            else:
                mds = None
        results: dict[str, list[dict[str, Any]]] = {v.key: [] for v in chosen}
        for r in range(rounds):
            order = chosen[r % len(chosen):] + chosen[:r % len(chosen)]
            for variant in order:
                if variant.key == "mosaic" and mds is None and peers_python():
                    results[variant.key].append({"errors": ["the MDS conversion failed"], "complete": False})
                    continue
                started = time.perf_counter()
                results[variant.key].append(launch(variant, data, iters, mds, args.timeout))
                print(f"#   round {r + 1}/{rounds}: {variant.key} done in {time.perf_counter() - started:.0f}s",
                      file=sys.stderr, flush=True)
        rows = [summarize(v, results[v.key], manifest) for v in chosen]
        one_epoch = [row for row in rows if BY_KEY[row["key"]].epochs == 1]
        several = [row for row in rows if BY_KEY[row["key"]].epochs > 1]
        if one_epoch:
            print(table(one_epoch))
        if several:
            print(f"\n{BY_KEY[several[0]['key']].epochs} epochs, batch {BATCH}, multiple_of={BATCH} (rounds of "
                  f"{NUM_SLOTS * BATCH} samples), {n:,} samples an epoch:\n")
            print(epochs_table(several))
            print("\ndropped: samples of the epochs' streams never delivered (under carry not counting the last "
                  "epoch's tail, which opens the next epoch); padded: deliveries beyond one a sample an epoch; "
                  "exact: the delivered multiset is the concatenated streams' prefix (carry) or every epoch but its "
                  "last N mod 256 (drop), with equal counts on the 8 slots every epoch. Target: carry's CPU ≤ "
                  "1.05× drop's, equal slots, 0 dropped, 0 padded.")
        mosaic = next((row for row in rows if row["key"] == "mosaic" and "read_ratio" in row), None)
        own = (f" (its MDS copy, {mds_bytes / 2**20:.1f} MiB: {mosaic['read_ratio'] * total / mds_bytes:.2f}× of it; "
               "Mosaic repeats a few samples so that ranks have equal counts)") if mosaic and mds_bytes else ""
        if one_epoch:
            print(f"\nread / data: rchar over the dataset's {total / 2**20:.1f} MiB of tar files; Mosaic reads "
                  f"its own format{own}. distshard builds its index cold in the measured job. Targets for "
                  "distshard: read ≤ 1.10×, CPU ≤ webdataset's, shuffle=True CPU ≤ 1.2× the unshuffled run, "
                  "equal per-slot counts, one user line.")
        if args.json:
            write_json(args.json, {"environment": environment(), "samples": n, "bytes": total, "mds_bytes": mds_bytes,
                                   "decode_s": cost, "rows": rows})
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
