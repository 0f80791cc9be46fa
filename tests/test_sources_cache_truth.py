"""The local range cache never outlives the truth (issue 28, items 1, 2, 6, 7): a
stored index whose file was rewritten or deleted on the store is refused even
when every byte of it is in the cache (HTTP: one HEAD per file and process; S3:
one listing per folder, both clients); a cache entry corrupted in place or
truncated is dropped, fetched again, stored again and logged; a dataset copied
with its ``.distshard/`` to another prefix keeps its stored entries; plain
iteration of a file source refuses a changed file as the sharded path does.
Against the loopback HTTP range server and moto's S3 server (both clients)."""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from pathlib import Path

import pytest

import distshard
from distshard.sources import ReadOptions, jsonl, webdataset
from distshard.sources.transport.lru import clear_all
from tests.range_server import served as server  # noqa: F401  (a fixture)
from tests.source_factories import fresh_machine, write_jsonl, write_shards
from tests.source_factories import isolated_cache as cache  # noqa: F401  (autouse)
from tests.stored_factories import indexed, key, requests_by_kind

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")


def cached(root: Path, **more) -> ReadOptions:
    return ReadOptions(window=16 << 10, max_gap=4 << 10, max_range=64 << 10, cache_dir=str(root), **more)


def rewrite_same_size(path: Path) -> None:
    """One byte of a tar member's payload changed: same size, a new mtime (a new ETag)."""
    data = bytearray(path.read_bytes())
    data[700] ^= 1
    stat = path.stat()
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))


def entries(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("*/*") if p.is_file() and not p.name.startswith(".tmp-"))


def test_a_stale_stored_index_is_refused_even_when_the_cache_holds_every_byte(tmp_path, server, monkeypatch):
    """Over HTTP (no listing): the first cache hit of a file in a process costs one
    HEAD of that file; a rewritten file raises the stale-index error, a deleted one
    FileNotFoundError, though the cache holds all their bytes and would serve them."""
    pattern, urls, expected = indexed(tmp_path, server, shards=4, per_shard=5)
    read = cached(tmp_path / "ranges")
    fresh_machine(monkeypatch, tmp_path, "job1")
    assert Counter(map(key, webdataset(pattern, read_options=read).dist_shard())) == Counter(map(key, expected))
    fresh_machine(monkeypatch, tmp_path, "job2")  # the cache is what persists
    server.settle().reset_counters()
    it = iter(webdataset(pattern, read_options=read).dist_shard())
    got = [next(it)]
    before_first = requests_by_kind(server)
    assert before_first == {"manifest": 1, "entry": 1, "HEAD": 1}, before_first  # the data from the cache
    got.extend(it)
    assert Counter(map(key, got)) == Counter(map(key, expected))
    assert requests_by_kind(server) == {"manifest": 1, "entry": 1, "HEAD": 4}  # one HEAD per file, no data

    rewrite_same_size(tmp_path / "data" / "shard-000002.tar")
    fresh_machine(monkeypatch, tmp_path, "job3")
    got = []
    with pytest.raises(
        ValueError, match=r"shard-000002\.tar changed after the stored index.*python -m distshard index"
    ):
        got.extend(webdataset(pattern, read_options=read).dist_shard())
    assert {s["__url__"].rsplit("/", 1)[-1] for s in got} <= {"shard-000000.tar", "shard-000001.tar"}

    (tmp_path / "data" / "shard-000001.tar").unlink()
    fresh_machine(monkeypatch, tmp_path, "job4")
    got = []
    with pytest.raises(FileNotFoundError, match=r"shard-000001\.tar.*python -m distshard index"):
        got.extend(webdataset(pattern, read_options=read).dist_shard())
    assert {s["__url__"].rsplit("/", 1)[-1] for s in got} <= {"shard-000000.tar"}


def test_without_a_stored_index_the_jobs_own_heads_confirm_what_the_cache_serves(tmp_path, server, monkeypatch):
    """The identity a job asks for itself (one HEAD per file when it is built) is
    the store's now: a rewritten file keys another cache directory, a deleted one
    is named when the source is built; nothing more is asked per cache hit."""
    paths, expected = write_shards(tmp_path / "data", shards=3, per_shard=4)
    urls = [server.url(p) for p in paths]
    read = cached(tmp_path / "ranges")
    assert len(list(webdataset(urls, read_options=read).dist_shard())) == len(expected)
    clear_all()  # the next job on this machine (its indexes cached: no header walk)
    server.settle().reset_counters()
    assert len(list(webdataset(urls, read_options=read).dist_shard())) == len(expected)
    assert requests_by_kind(server) == {"manifest": 1, "HEAD": 3}  # the look for a stored index, the job's HEADs
    rewrite_same_size(Path(paths[1]))
    fresh_machine(monkeypatch, tmp_path, "job3")
    fresh = [s["jpg"] for s in webdataset(paths)]
    assert [s["jpg"] for s in webdataset(urls, read_options=read).dist_shard()] == fresh
    Path(paths[2]).unlink()
    fresh_machine(monkeypatch, tmp_path, "job4")
    with pytest.raises(FileNotFoundError, match=r"shard-000002\.tar"):
        webdataset(urls, read_options=read).dist_shard()


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_a_damaged_cache_entry_is_dropped_fetched_again_stored_again_and_logged(tmp_path, server, caplog, damage):
    paths, expected = write_jsonl(tmp_path / "data", files=2, lines=40)
    urls = [server.url(p) for p in paths]
    read = cached(tmp_path / "ranges")
    assert list(jsonl(urls, read_options=read).dist_shard()) == expected
    stored = entries(tmp_path / "ranges")
    assert stored
    victim = stored[0]
    data = bytearray(victim.read_bytes())
    if damage == "flipped":  # in place, same length: a digit of a value changed
        at = len(data) - 10
        while chr(data[at]) not in "0123456789":
            at -= 1
        data[at] = ord("1") if data[at] != ord("1") else ord("2")
    else:
        del data[-7:]
    victim.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING, logger="distshard")
    server.settle().reset_counters()
    clear_all()
    assert list(jsonl(urls, read_options=read).dist_shard()) == expected  # never a damaged byte
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and str(victim) in warned[0] and "damaged" in warned[0], warned
    assert server.settle().requests["GET"] == 1 + 1  # the look for a stored index; the damaged range, once
    assert victim.exists() and victim.stat().st_size == len(victim.read_bytes())
    ledger = int((tmp_path / "ranges" / ".ledger").read_text())
    assert ledger == sum(p.stat().st_size for p in entries(tmp_path / "ranges"))
    caplog.clear()
    server.reset_counters()
    clear_all()
    assert list(jsonl(urls, read_options=read).dist_shard()) == expected  # replaced: the next epoch is served
    assert server.settle().requests["GET"] == 1 and not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("where", ["local", "http-stored"])
def test_plain_iteration_refuses_a_changed_file_as_the_sharded_path_does(tmp_path, server, monkeypatch, where):
    """Issue 28, item 7: once ``len()`` counted the files, plain iteration (no
    ``dist_shard``) checks each file's identity before its first sample: a changed
    file raises the same error as the sharded path, never new samples under the old
    count; untouched, it yields exactly what ``len()`` says."""
    paths, expected = write_jsonl(tmp_path / "data", files=3, lines=10)
    if where == "local":
        urls = list(paths)
    else:
        from distshard.__main__ import main

        urls = [server.url(p) for p in paths]
        assert main(["index", *urls, "--out", str(tmp_path / "data" / ".distshard")]) == 0
        fresh_machine(monkeypatch, tmp_path, "node")
    source = jsonl(urls)
    assert len(source) == len(expected) and list(source) == expected
    changed = Path(paths[1])
    with open(changed, "a", encoding="utf-8") as f:
        f.write(json.dumps({"f": 1, "i": "new"}) + "\n")
    got = []
    refresh = "python -m distshard index" if where != "local" else "build the source again"
    with pytest.raises(ValueError, match=rf"part-001\.jsonl changed after .*{refresh}") as plain:
        got.extend(source)
    assert got == expected[:10]  # the first file's samples, none of the changed one's
    with pytest.raises(ValueError, match=rf"part-001\.jsonl changed after .*{refresh}") as sharded:
        list(source.dist_shard())
    assert type(plain.value) is type(sharded.value)


def test_a_local_copy_with_its_stored_index_says_its_entries_are_not_used_until_refreshed(
    tmp_path, monkeypatch, caplog
):
    """Issue 28, item 6: a folder copied with its ``.distshard/`` (mtimes kept, so
    the stamps match, but an mtime does not identify the bytes): the entries are not
    used, and ``describe()``, ``explain()`` and a WARNING say so and name the
    refresh, which makes the copy's index its own."""
    import shutil

    from distshard.__main__ import main
    from distshard.sources.formats.jsonl import JsonlFormat

    paths, expected = write_jsonl(tmp_path / "a", files=2, lines=10)
    assert main(["index", str(tmp_path / "a" / "part-*.jsonl")]) == 0
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # copy2: mtimes kept
    built = []
    real = JsonlFormat.build_index
    monkeypatch.setattr(JsonlFormat, "build_index", lambda self, ref, *a: built.append(ref.url) or real(self, ref, *a))
    fresh_machine(monkeypatch, tmp_path, "node")
    caplog.set_level(logging.WARNING, logger="distshard")
    source = jsonl(str(tmp_path / "b" / "part-*.jsonl"))
    pipe = source.dist_shard()
    assert list(pipe) == expected
    assert len(built) == 2  # each file indexed by the job itself
    words = f"was written for the files at {tmp_path / 'a'} (a copy of the dataset?)"
    assert words in source.describe() and words in str(distshard.explain(pipe))
    assert f"python -m distshard index {tmp_path / 'b' / '.distshard'}" in source.describe()
    assert [r for r in caplog.records if r.levelno == logging.WARNING and words in r.getMessage()]
    assert main(["index", str(tmp_path / "b" / ".distshard")]) == 0  # the refresh it names
    fresh_machine(monkeypatch, tmp_path, "node2")
    built.clear()
    again = jsonl(str(tmp_path / "b" / "part-*.jsonl"))
    assert list(again.dist_shard()) == expected and built == []
    assert "written for" not in again.describe() and "index stored at" in again.describe()
