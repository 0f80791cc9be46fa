"""Files and factories for the file-source tests; importable by name in spawned
processes (concurrent index builders, gloo ranks, DataLoader workers)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest

import distshard  # noqa: F401  (registers .dist_shard)
from distshard.sources import jsonl, webdataset
from distshard.sources.formats.tar import TarFormat


# -- files ----------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    """The source tests' cache directory, under tmp_path, and no file handle, index or
    row group kept by this process from another test (the modules import it as ``cache``)."""
    from distshard.sources.transport.lru import clear_all

    monkeypatch.setenv("DISTSHARD_CACHE", str(tmp_path / "cache"))
    clear_all()
    yield tmp_path / "cache"
    clear_all()


def fresh_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str) -> None:
    """A job on another machine: an empty per-machine cache (``tmp_path/name``) and nothing
    kept in this process (file handles, indexes, row groups)."""
    from distshard.sources.transport.lru import clear_all

    monkeypatch.setenv("DISTSHARD_CACHE", str(tmp_path / name))
    clear_all()


def blob(tag: str, size: int) -> bytes:
    """Deterministic bytes standing in for a JPEG."""
    out = b""
    seed = tag.encode()
    while len(out) < size:
        seed = hashlib.blake2b(seed).digest()
        out += seed
    return out[:size]


def add_member(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 1_700_000_000
    tf.addfile(info, io.BytesIO(data))


def write_shards(folder: Path, shards: int, per_shard: int, prefix: str = "shard") -> tuple[list[str], list[dict]]:
    """``shards`` tar files of ``per_shard + s`` samples (jpg, cls, json members);
    returns the paths and every expected sample in order."""
    folder.mkdir(parents=True, exist_ok=True)
    urls, expected = [], []
    for s in range(shards):
        path = str(folder / f"{prefix}-{s:06d}.tar")
        with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
            for i in range(per_shard + s):
                key = f"{s:03d}/sample{i:05d}"
                members = {
                    "jpg": blob(f"{s}-{i}", 100 + (37 * i + 11 * s) % 900),
                    "cls": str((i * 7 + s) % 10).encode(),
                    "json": json.dumps({"i": i, "s": s}).encode(),
                }
                for ext, data in members.items():
                    add_member(tf, f"{key}.{ext}", data)
                expected.append({"__key__": key, "__url__": path, **members})
        urls.append(path)
    return urls, expected


def write_jsonl(folder: Path, files: int, lines: int) -> tuple[list[str], list[Any]]:
    folder.mkdir(parents=True, exist_ok=True)
    urls, expected = [], []
    for f in range(files):
        path = str(folder / f"part-{f:03d}.jsonl")
        with open(path, "w", encoding="utf-8", newline="") as out:
            for i in range(lines + f):
                value = {"f": f, "i": i, "text": "é" * (i % 5) + "漢字" * (i % 3)}
                out.write(json.dumps(value, ensure_ascii=False) + ("\r\n" if i % 4 == 1 else "\n"))
                if i % 6 == 2:
                    out.write("\n   \n")
                expected.append(value)
        urls.append(path)
    return urls, expected


def write_tiny_tar(path: Path, samples: int, size: int, big: dict[int, int] | None = None) -> list[str]:
    """One tar of ``samples`` one-member samples of ``size`` bytes (``big``:
    sample -> a larger size); returns the keys in order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = []
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
        for i in range(samples):
            data = blob(str(i), (big or {}).get(i, size))
            info = tarfile.TarInfo(f"s{i:06d}.bin")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
            keys.append(f"s{i:06d}")
    return keys


def write_parquet_rows(folder: Path, files: int = 3, rows: int = 50, row_group_size: int = 7) -> tuple[list[str], list]:
    """``files`` Parquet files of ``rows + 3 * f`` rows (int, text, float and list columns);
    returns the paths and every expected row in order (needs pyarrow)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    urls, expected = [], []
    for f in range(files):
        n = rows + 3 * f
        table = pa.table(
            {
                "id": list(range(f * 1000, f * 1000 + n)),
                "text": [f"ligne {i} é" for i in range(n)],
                "score": [i / 3 for i in range(n)],
                "tags": [[f"t{i % 3}"] * (i % 4) for i in range(n)],
            }
        )
        path = folder / f"part-{f}.parquet"
        pq.write_table(table, path, row_group_size=row_group_size)
        urls.append(str(path))
        expected.extend(table.to_pylist())
    return urls, expected


def write_keyed_parquet(
    folder: Path, files: int, rows: int = 40, columns: int = 2, row_group_size: int = 9
) -> list[Path]:
    """``files`` Parquet files whose rows are distinct (``f<file>-<row>`` in column ``k``),
    ``columns - 1`` integer columns beside it (wide files: a long footer; needs pyarrow)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for f in range(files):
        table: dict[str, list] = {"k": [f"f{f}-{i}" for i in range(rows)]}
        table.update({f"c{c}": list(range(c, c + rows)) for c in range(columns - 1)})
        path = folder / f"part-{f:03d}.parquet"
        pq.write_table(pa.table(table), path, row_group_size=row_group_size)
        paths.append(path)
    return paths


# -- processes --------------------------------------------------------------------------
class LoggedTarFormat(TarFormat):
    """A tar format that appends one line per index build to ``log`` (O_APPEND)."""

    def __init__(self, log: str) -> None:
        self.log = log

    def build_index(self, ref, access):
        with open(self.log, "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()} {ref.url}\n")
        return super().build_index(ref, access)


def logged_source(urls: list[str], log: str):
    from distshard.sources import WebDatasetIterDataPipe

    return WebDatasetIterDataPipe(LoggedTarFormat(log), urls)


def build_concurrently(cache: str, urls: list[str], log: str, barrier: Any, results: Any) -> None:
    """One of several processes indexing the same files at the same moment."""
    os.environ["DISTSHARD_CACHE"] = cache
    source = logged_source(urls, log)
    barrier.wait(timeout=60)
    sequence = source.__distshard_sequence__()
    results.put([sequence[i]["__key__"] for i in (0, len(sequence) - 1)] and list(sequence.counts))


def rank_indexes(
    rank: int, world_size: int, cache_root: str, urls: list[str], log: str, shared: bool
) -> dict[str, Any]:
    """On a gloo rank: build the source (construction indexes the files
    collectively); report counts and which cache entries this rank can read."""
    from distshard.sources.formats.index_cache import load_cached
    from distshard.sources.transport.files import FileRef, file_identity

    cache = cache_root if shared else os.path.join(cache_root, f"rank{rank}")
    os.environ["DISTSHARD_CACHE"] = cache
    source = logged_source(urls, log)
    counts = source.counts()
    present = [load_cached("webdataset", FileRef(u, *file_identity(u))) is not None for u in urls]
    return {"counts": counts, "present": present}


def rank_error(rank: int, world_size: int, cache: str, urls: list[str]) -> str:
    os.environ["DISTSHARD_CACHE"] = cache
    try:
        webdataset(urls).counts()
    except ValueError as exc:
        return f"ValueError: {exc}"
    return "no error"


def sharded_tar() -> Any:
    """The gloo test's pipeline: shards named by $DISTSHARD_TEST_URLS."""
    urls = json.loads(os.environ["DISTSHARD_TEST_URLS"])
    return webdataset(urls).dist_shard(even="drop")


def sharded_tar_shuffled() -> Any:
    urls = json.loads(os.environ["DISTSHARD_TEST_URLS"])
    return webdataset(urls).dist_shard(even="drop", shuffle=True)


def sharded_jsonl() -> Any:
    urls = json.loads(os.environ["DISTSHARD_TEST_URLS"])
    return jsonl(urls).dist_shard(even="pad")


def sample_key(sample: dict) -> str:
    return f"{sample['__url__']}#{sample['__key__']}"


def rank_reads(
    rank: int, world_size: int, urls: list[str], cache: str, shuffle: bool, read_options: Any = None
) -> list[str]:
    """On a gloo rank: what this rank's 2 DataLoader workers yield from the shards."""
    from torch.utils.data import DataLoader

    os.environ["DISTSHARD_CACHE"] = cache
    pipe = webdataset(urls, read_options=read_options).dist_shard(shuffle=shuffle).map(sample_key)
    loader = DataLoader(pipe, batch_size=None, num_workers=2, multiprocessing_context="fork")
    return list(loader)
