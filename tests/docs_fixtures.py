"""What the hidden ``<!-- example setup -->`` blocks of the README and docs/ pages use to
give their examples real data (``tests/test_docs.py`` runs every example): small files
written into the current directory, and a one-rank gloo group for the collectives."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from .source_factories import write_shards as _write_shards


def write_shards(folder: str, shards: int, per_shard: int, pattern: str | None = None) -> list[str]:
    """``shards`` WebDataset tar files under ``folder`` (renamed to ``pattern`` if given,
    e.g. ``"data/shard-{:06d}.tar"``); returns their paths."""
    urls, _ = _write_shards(Path(folder), shards, per_shard)
    if pattern is None:
        return urls
    named = []
    for index, url in enumerate(urls):
        os.replace(url, pattern.format(index))
        named.append(pattern.format(index))
    return named


def write_jsonl(folder: str, files: int, lines: int) -> list[str]:
    """``files`` JSON-lines files ``folder/part-NNN.jsonl`` of ``lines`` values each."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    paths = []
    for f in range(files):
        path = os.path.join(folder, f"part-{f:03d}.jsonl")
        with open(path, "w", encoding="utf-8") as out:
            for i in range(lines):
                out.write(json.dumps({"text": f"line {i} of file {f}", "label": i % 3}) + "\n")
        paths.append(path)
    return paths


def write_parquet(paths: list[str], rows: int) -> list[str]:
    """Parquet files of ``rows`` rows with ``text`` and ``label`` columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for f, path in enumerate(paths):
        table = pa.table(
            {
                "text": [f"row {i} of {f}" for i in range(rows)],
                "label": [i % 3 for i in range(rows)],
                "extra": list(range(rows)),
            }
        )
        pq.write_table(table, path, row_group_size=max(1, rows // 4))
    return paths


def write_tokens(prefixes: list[str], sequences: int) -> list[str]:
    """Megatron-LM indexed datasets (``<prefix>.bin`` + ``<prefix>.idx``, uint16) of
    ``sequences`` sequences each (tests/token_files.py)."""
    from .token_files import sequences_for, write_indexed

    for n, prefix in enumerate(prefixes):
        write_indexed(prefix, sequences_for(sequences, "uint16", seed=n), "uint16")
    return prefixes


def write_tables(folder: str, tables: int, rows: int) -> tuple[Callable[[str], Any], dict[str, int]]:
    """``tables`` Arrow IPC files ``folder/part-N.arrow``; returns ``open_table`` (a
    path's rows, as a list) and ``row_counts`` (path -> rows)."""
    import pyarrow as pa

    Path(folder).mkdir(parents=True, exist_ok=True)
    counts = {}
    for t in range(tables):
        path = os.path.join(folder, f"part-{t}.arrow")
        n = rows + t
        table = pa.table({"row": list(range(n)), "table": [t] * n})
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        counts[path] = n
    return open_table, counts


def open_table(path: str) -> list[dict[str, Any]]:
    import pyarrow as pa

    with pa.memory_map(path) as source:
        return pa.ipc.open_file(source).read_all().to_pylist()


def one_rank_group() -> int:
    """A gloo process group of one rank (a FileStore, so nothing listens on a port),
    standing in for a job's; returns the rank. ``tests/test_docs.py`` destroys it."""
    import torch.distributed as dist

    if not dist.is_initialized():
        store = tempfile.mkstemp(prefix="distshard-docs-store-")[1]
        os.unlink(store)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    return dist.get_rank()


class LoggedDecode:
    """``torch.tensor(record)``, noting every record it decoded in a file of its
    process under ``$DISTSHARD_DOCS_LOG`` (set by the test for every rank it starts),
    so that :meth:`check` can count what the ranks and their workers decoded."""

    def __init__(self) -> None:
        self.folder = Path(os.environ.get("DISTSHARD_DOCS_LOG") or tempfile.mkdtemp(prefix="distshard-docs-"))
        self.folder.mkdir(parents=True, exist_ok=True)

    def __call__(self, record: int) -> Any:
        import torch

        with open(self.folder / f"{os.getpid()}.log", "a") as log:
            log.write(f"{record}\n")
        return torch.tensor(record)

    def check(self, records: Any, epochs: int, kept: int) -> None:
        """Each epoch decoded ``kept`` of ``records`` (``even="drop"`` leaves the rest),
        none twice in an epoch; then forget them (the next run counts afresh)."""
        wanted = set(records)
        decoded: dict[int, int] = {}
        for path in self.folder.glob("*.log"):
            for line in path.read_text().split():
                if int(line) in wanted:
                    decoded[int(line)] = decoded.get(int(line), 0) + 1
            path.unlink()
        assert sum(decoded.values()) == epochs * kept, (sum(decoded.values()), epochs, kept)
        assert max(decoded.values()) <= epochs, "a record was decoded twice in an epoch"


_CLEANUPS: list[Callable[[], None]] = []


def cleanup() -> None:
    """Undo what the fixtures started (servers, environment), last first."""
    while _CLEANUPS:
        _CLEANUPS.pop()()


def s3_store(bucket: str, objects: dict[str, str]) -> str:
    """An S3 API on 127.0.0.1 (moto's server, stopped by :func:`cleanup`) holding
    ``objects`` (key -> local path) in ``bucket``; test credentials in the environment
    while it runs. Returns its endpoint URL."""
    import boto3

    from tests.moto_server import start_moto

    saved = {
        name: os.environ.get(name)
        for name in (
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_DEFAULT_REGION",
            "AWS_EC2_METADATA_DISABLED",
            "AWS_PROFILE",
            "AWS_SESSION_TOKEN",
            "AWS_ENDPOINT_URL",
            "AWS_ENDPOINT_URL_S3",
        )
    }

    def restore() -> None:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    for name in saved:
        os.environ.pop(name, None)
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )
    _CLEANUPS.append(restore)
    server, endpoint = start_moto()
    _CLEANUPS.append(server.stop)
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    for key, path in objects.items():
        client.upload_file(path, bucket, key)
    return endpoint


def write_corpus(path: Path, documents: int = 90) -> str:
    """A JSON-lines file of ``{"ids": [...]}`` documents of 3 to 20 token ids in
    ``[1, 100)`` (seeded), for docs/parallel.md's programs."""
    import random

    rng = random.Random(0)
    lines = (
        json.dumps({"ids": [rng.randrange(1, 100) for _ in range(rng.randrange(3, 21))]}) for _ in range(documents)
    )
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def run_program(rank: int, world_size: int, code: str, cwd: str, corpus: str) -> Any:
    """One rank of a docs page's program on a gloo group ``run_on_group`` made (the
    program's ``init_device_mesh`` uses it): run in ``cwd``, with the page's corpus, and
    DataLoader workers started as under torchrun on Linux (fork; a rank forked from the
    tests' forkserver would default to it, each worker importing torch afresh); returns
    what the program recorded in ``trained``."""
    import multiprocessing

    multiprocessing.set_start_method("fork", force=True)
    os.chdir(cwd)
    os.environ["DISTSHARD_DOCS_CORPUS"] = corpus
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(code, "docs/parallel.md", "exec"), namespace)
    return namespace["trained"]
