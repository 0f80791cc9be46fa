"""bench_files' data: the generated tar shards, the tar reader a torch user writes, and
the converted copies Mosaic and litdata read (made in the peers' venv, in setup).
bench_files.py imports what it runs from here; ``convert`` and ``convert_litdata`` are
called in a child by name (``harness.launch``), so bench_files imports them too."""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import sys
import tarfile
import time
from pathlib import Path
from typing import Any


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
    urls, keys, counts = [], [], []
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
            counts.append(i + 1)
        urls.append(str(path))
    manifest = {"urls": urls, "keys": keys, "counts": counts, "bytes": sum(os.path.getsize(u) for u in urls),
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


def convert(data: str, out: str) -> dict[str, Any]:
    """``convert_to_mds`` in a child (the peers' venv): the data's manifest into ``out``."""
    return convert_to_mds(json.loads((Path(data) / "manifest.json").read_text()), Path(out))


def litdata_samples(url: str) -> Any:
    """``litdata.optimize``'s ``fn``: one input is a tar shard, its samples as dicts."""
    for sample in read_tar(url):
        yield {"__key__": sample["__key__"], "jpg": sample["jpg"], "cls": sample["cls"]}


def convert_litdata(data: str, out: str) -> dict[str, Any]:
    """In a child (the peers' venv): the same samples as ``litdata.optimize`` chunks in
    ``out``, each about the tar shards' mean size (so that it reads about as many files)."""
    import litdata

    manifest = json.loads((Path(data) / "manifest.json").read_text())
    started = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    litdata.optimize(fn=litdata_samples, inputs=manifest["urls"], output_dir=out, num_workers=1,
                     chunk_bytes=manifest["bytes"] // len(manifest["urls"]), mode="overwrite", verbose=False)
    return {"seconds": time.perf_counter() - started,
            "bytes": sum(p.stat().st_size for p in Path(out).rglob("*") if p.is_file())}


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
