"""The stored index (issue 22): ``python -m distshard index`` writes per-file
entries and a manifest beside the data; a source finds it by itself and starts
with no metadata request per file, fetching only the entries of the files it
reads; a stale or missing file raises naming it (and the refresh command);
DataLoader workers reuse what the rank learnt; logging. Against the loopback
HTTP range server (requests counted by kind) and local files."""

from __future__ import annotations

import json
import logging
import os
from collections import Counter

import pytest

import distshard
from distshard.__main__ import main
from distshard.sources import ReadOptions, jsonl, webdataset
from tests.range_server import RangeServer, serve
from tests.range_server import served as server  # noqa: F401  (a fixture)
from tests.source_factories import isolated_cache as cache  # noqa: F401  (autouse)
from tests.source_factories import write_jsonl, write_shards

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

SHARDS = 64
# a budget of about one shard: what the read-ahead plans before the first sample
# stays within a file or two whatever its ramp (requests before the first sample)
SMALL = ReadOptions(budget=4 << 10, max_range=4 << 10, max_gap=1 << 10, window=2 << 10)


def key(sample: dict) -> str:
    return f"{sample['__url__'].rsplit('/', 1)[-1]}#{sample['__key__']}"


def indexed(tmp_path, server, shards=SHARDS, per_shard=3) -> tuple[str, list[str], list[dict]]:
    """``shards`` tars served over HTTP, indexed with the command into the
    ``.distshard/`` folder the server serves beside them (HTTP is read-only)."""
    paths, expected = write_shards(tmp_path / "data", shards=shards, per_shard=per_shard)
    urls = [server.url(p) for p in paths]
    pattern = urls[0].rsplit("/", 1)[0] + f"/shard-{{000000..{shards - 1:06d}}}.tar"
    assert main(["index", pattern, "--out", str(tmp_path / "data" / ".distshard")]) == 0
    return pattern, urls, expected


def fresh_machine(monkeypatch, tmp_path, name: str) -> None:
    """A new per-machine cache and nothing kept in this process: a job on a fresh node."""
    from distshard.sources._lru import clear_all

    monkeypatch.setenv("DISTSHARD_CACHE", str(tmp_path / name))
    clear_all()


def requests_by_kind(server: RangeServer) -> dict[str, int]:
    """Requests since the last reset: HEAD, manifest, entry, data (range) GETs."""
    kinds: Counter = Counter()
    for method, path, _ in server.settle().log:
        if method != "GET":
            kinds[method] += 1
        elif path.endswith("manifest.json"):
            kinds["manifest"] += 1
        elif path.endswith(".idx"):
            kinds["entry"] += 1
        else:
            kinds["data"] += 1
    return dict(kinds)


def test_a_job_with_a_stored_index_asks_no_head_and_only_the_entries_it_reads(tmp_path, server, monkeypatch):
    pattern, urls, expected = indexed(tmp_path, server)
    assert sorted(os.listdir(tmp_path / "data" / ".distshard"))[-1] == "shard-000063.tar.webdataset." + (
        sorted(os.listdir(tmp_path / "data" / ".distshard"))[-1].split(".")[-2] + ".idx"
    )
    fresh_machine(monkeypatch, tmp_path, "node")
    server.reset_counters()
    source = webdataset(pattern)  # default options; no index=: found beside the shards
    pipe = source.dist_shard(rank=0, world_size=2)
    it = iter(pipe)
    got = [next(it)]
    before_first = requests_by_kind(server)
    assert before_first.get("HEAD", 0) == 0 and before_first["manifest"] == 1
    assert sum(before_first.values()) <= 4, before_first  # manifest, the first file's entry, its range (+ the lookup)
    got.extend(it)
    rank0 = requests_by_kind(server)
    files_read = {s["__url__"] for s in got}
    assert rank0.get("HEAD", 0) == 0 and rank0["manifest"] == 1
    assert rank0["entry"] == len(files_read) < SHARDS  # only the entries of the files it reads
    other = webdataset(pattern, read_options=SMALL).dist_shard(rank=1, world_size=2)
    got.extend(other)
    assert Counter(map(key, got)) == Counter(map(key, expected))
    assert "index stored at" in str(distshard.explain(pipe))


def test_a_file_changed_since_the_index_was_written_names_it_and_the_refresh(tmp_path, server, monkeypatch):
    pattern, urls, _ = indexed(tmp_path, server, shards=4, per_shard=5)
    changed = tmp_path / "data" / "shard-000002.tar"
    data = bytearray(changed.read_bytes())
    data[700] ^= 1
    changed.write_bytes(bytes(data))  # same size, new mtime: a new ETag
    os.utime(changed, ns=(changed.stat().st_atime_ns, changed.stat().st_mtime_ns + 10**9))
    fresh_machine(monkeypatch, tmp_path, "node")
    with pytest.raises(
        ValueError, match=r"shard-000002\.tar changed after the stored index.*python -m distshard index"
    ):
        list(webdataset(pattern).dist_shard())
    # the refresh command it names makes the source work again
    assert main(["index", pattern, "--out", str(tmp_path / "data" / ".distshard")]) == 0
    fresh_machine(monkeypatch, tmp_path, "node2")
    assert len(list(webdataset(pattern).dist_shard())) == sum(5 + s for s in range(4))


def test_a_file_missing_since_the_index_was_written_is_named(tmp_path, server, monkeypatch):
    pattern, urls, _ = indexed(tmp_path, server, shards=3, per_shard=4)
    (tmp_path / "data" / "shard-000001.tar").unlink()
    fresh_machine(monkeypatch, tmp_path, "node")
    with pytest.raises(FileNotFoundError, match=r"shard-000001\.tar"):
        list(webdataset(pattern).dist_shard())


def test_local_files_find_their_stored_index_and_refuse_a_stale_one(tmp_path, monkeypatch):
    paths, expected = write_jsonl(tmp_path / "j", files=3, lines=20)
    assert main(["index", str(tmp_path / "j" / "part-*.jsonl")]) == 0
    assert (tmp_path / "j" / ".distshard" / "manifest.json").exists()
    fresh_machine(monkeypatch, tmp_path, "node")
    source = jsonl(str(tmp_path / "j" / "part-*.jsonl"))
    assert sorted(map(json.dumps, source.dist_shard(shuffle=True))) == sorted(map(json.dumps, expected))
    assert source._stored is not None and source._indexed_here == 0
    # index= takes the folder: the files and their counts come from the manifest
    assert [x for x in jsonl(None, index=str(tmp_path / "j" / ".distshard")).dist_shard()] == expected
    os.utime(paths[1], ns=(0, 10**18))
    fresh_machine(monkeypatch, tmp_path, "node2")
    with pytest.raises(ValueError, match=r"part-001\.jsonl changed after the stored index.*python -m distshard index"):
        list(jsonl(str(tmp_path / "j" / "part-*.jsonl")).dist_shard())


def test_an_interrupted_build_goes_on_where_it_stopped(tmp_path, server, capsys):
    from distshard.sources.indexing import build_stored_index

    paths, _ = write_shards(tmp_path / "data", shards=6, per_shard=3)
    urls = [server.url(p) for p in paths]
    out = str(tmp_path / "data" / ".distshard")
    first = build_stored_index(urls[:4], out=out)
    assert first.built == 4
    server.reset_counters()
    second = build_stored_index(urls, out=out)  # the first four entries are there: only two built
    assert second.built == 2 and len(second.files) == 6
    assert requests_by_kind(server)["data"] == 2  # one range per new small shard, none for the others
    manifest = json.loads((tmp_path / "data" / ".distshard" / "manifest.json").read_text())
    assert manifest["format"] == "distshard-index" and manifest["version"] == 1
    assert [f["url"] for f in manifest["files"]] == urls  # (relative names only for files beside the folder)
    assert {"url", "format", "count", "size", "stamp", "entry"} <= set(manifest["files"][0])
    assert main(["index", urls[0], "--out", out]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""  # not a terminal: no progress line
    assert "6 files (0 indexed now)" in captured.out  # the earlier files stay listed


def test_without_a_stored_index_it_works_as_before_and_says_how_to_start_fast(tmp_path, server, caplog):
    paths, expected = write_shards(tmp_path / "data", shards=3, per_shard=4)
    urls = [server.url(p) for p in paths]
    caplog.set_level(logging.INFO, logger="distshard")
    pipe = webdataset(urls).dist_shard()
    assert Counter(map(key, pipe)) == Counter(map(key, expected))
    assert "python -m distshard index" in str(distshard.explain(pipe))
    assert any("python -m distshard index" in r.getMessage() and "indexed 3" in r.getMessage() for r in caplog.records)


def test_dataloader_workers_reuse_the_ranks_index(tmp_path, server, monkeypatch):
    """2 fork workers: the manifest is read once (by the rank), no HEAD, and every
    entry once at most; without a stored index, one HEAD per file (the rank's) and none in the workers."""
    from torch.utils.data import DataLoader

    pattern, urls, expected = indexed(tmp_path, server, shards=8, per_shard=3)
    fresh_machine(monkeypatch, tmp_path, "node")
    server.reset_counters()
    pipe = webdataset(pattern, read_options=SMALL).dist_shard()
    loader = DataLoader(pipe, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60)
    got = list(loader)
    assert Counter(map(key, got)) == Counter(map(key, expected))
    kinds = requests_by_kind(server)
    assert kinds.get("HEAD", 0) == 0 and kinds["manifest"] == 1 and kinds["entry"] <= 8, kinds
    (tmp_path / "data" / ".distshard" / "manifest.json").unlink()
    fresh_machine(monkeypatch, tmp_path, "node2")
    server.reset_counters()
    pipe = webdataset(pattern, read_options=SMALL).dist_shard()
    assert len(list(DataLoader(pipe, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60))) == 52
    kinds = requests_by_kind(server)
    assert kinds["HEAD"] == 8 and kinds["manifest"] == 1, kinds  # the rank's look for it, and its HEADs


def test_retries_and_a_slow_first_request_are_logged(tmp_path, caplog, monkeypatch):
    from distshard.sources import remote

    paths, expected = write_jsonl(tmp_path / "j", files=1, lines=30)
    monkeypatch.setattr(remote, "SLOW_FIRST_REQUEST", 0.0)
    remote.forget_clients()  # a client whose first answer is still to come
    caplog.set_level(logging.INFO, logger="distshard")
    with serve(tmp_path, fault_every=2, faults=("503",)) as server:
        source = jsonl([server.url(p) for p in paths], read_options=ReadOptions(retry_seconds=20))
        assert [x for x in source.dist_shard()] == expected
    messages = [r.getMessage() for r in caplog.records]
    retry = [m for m in messages if m.startswith("retrying")]
    assert retry and "part-000.jsonl" in retry[0] and "HTTP 503" in retry[0]
    assert any("bytes [" in m for m in retry)
    assert any("first request to http://" in m for m in messages)
    assert any(m.startswith("indexed 1 jsonl files in") for m in messages)


def test_parquet_finds_its_stored_index(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from distshard.sources import parquet

    for f in range(2):
        pq.write_table(pa.table({"i": list(range(f * 40, f * 40 + 40))}), tmp_path / f"t{f}.parquet", row_group_size=9)
    assert main(["index", str(tmp_path / "t*.parquet"), "--workers", "2"]) == 0  # processes for local files
    fresh_machine(monkeypatch, tmp_path, "node")
    source = parquet(str(tmp_path / "t*.parquet"), columns=["i"])
    assert sorted(row["i"] for row in source.dist_shard(shuffle=True)) == list(range(80))
    assert source._stored is not None and source._indexed_here == 0
