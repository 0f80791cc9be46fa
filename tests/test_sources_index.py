"""The per-file index: cached once, never trusted stale or corrupt, built once by
concurrent processes and split across the ranks of a real gloo group."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from collections import Counter
from pathlib import Path

import pytest

from distshard.sources import webdataset
from distshard.sources.formats.index_cache import cache_path
from distshard.sources.formats.tar import TarFormat
from distshard.sources.transport.files import FileRef, file_identity
from distshard.verify import run_on_group
from tests import source_factories
from tests.source_factories import isolated_cache as cache  # noqa: F401  (autouse)
from tests.source_factories import write_jsonl, write_shards


def fresh_process():
    """Forget what this process keeps (as a new worker would)."""
    from distshard.sources.transport.lru import clear_all

    clear_all()


@pytest.fixture
def builds(monkeypatch):
    seen: list[str] = []
    original = TarFormat.build_index

    def counted(self, ref, access):
        seen.append(ref.url)
        return original(self, ref, access)

    monkeypatch.setattr(TarFormat, "build_index", counted)
    return seen


def entry(url: str, fmt: str = "webdataset") -> Path:
    return cache_path(fmt, FileRef(url, *file_identity(url)))


def test_second_source_reads_the_cache(tmp_path, builds, monkeypatch):
    urls, expected = write_shards(tmp_path / "d", shards=3, per_shard=5)
    first = webdataset(urls).__distshard_sequence__()
    assert [first[i] for i in range(len(first))] == expected
    assert sorted(builds) == sorted(urls)  # once each: counting and offsets share the build
    fresh_process()
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(str(path)) or real_open(path, *a, **k))
    second = webdataset(urls).__distshard_sequence__()
    assert [second[i] for i in range(len(second))] == expected
    assert sorted(builds) == sorted(urls)  # nothing rebuilt
    assert sorted(p for p in opened if p.endswith(".tar")) == sorted(urls)  # one handle per shard, no walk


def test_count_only_reads_the_entry_header(tmp_path, builds):
    urls, _ = write_shards(tmp_path / "d", shards=1, per_shard=200)
    webdataset(urls).counts()
    size = entry(urls[0]).stat().st_size
    from distshard.sources.formats import index_cache as index_module

    reads = []
    real = index_module._read_entry
    index_module._read_entry = lambda path, header_only: reads.append(header_only) or real(path, header_only)
    try:
        assert webdataset(urls).counts() == [200]
    finally:
        index_module._read_entry = real
    assert reads == [True] and size > 1000


def test_changed_file_is_never_read_with_a_stale_index(tmp_path, builds):
    urls, expected = write_shards(tmp_path / "d", shards=2, per_shard=4)
    sequence = webdataset(urls).__distshard_sequence__()
    assert sequence[1] == expected[1]
    # rewrite shard 0 in place with other content of the very same size
    data = bytearray(Path(urls[0]).read_bytes())
    data[600:610] = b"0123456789"
    Path(urls[0]).write_bytes(bytes(data))
    os.utime(urls[0], ns=(10**18, 10**18))
    with pytest.raises(ValueError, match=r"shard-000000\.tar changed after it was indexed"):
        sequence[0]
    assert sequence[5] == expected[5]  # the other shard is untouched
    fresh_process()
    with pytest.raises(ValueError, match="changed after it was indexed"):
        sequence[2]  # a new process (a worker) opening the file checks it too
    # a new source indexes the new file instead of trusting the old entry
    grown, _ = write_shards(tmp_path / "e", shards=1, per_shard=9)
    os.replace(grown[0], urls[0])
    again = webdataset(urls).__distshard_sequence__()
    assert again.counts == (9, 5) and builds.count(urls[0]) == 2
    assert again[3]["__key__"] == "000/sample00003"


def test_corrupt_cache_entries_are_rebuilt(tmp_path, builds):
    urls, expected = write_shards(tmp_path / "d", shards=1, per_shard=30)
    webdataset(urls).counts()
    path = entry(urls[0])
    good = path.read_bytes()
    damages = {
        "flipped body byte": good[:-5] + bytes([good[-5] ^ 0xFF]) + good[-4:],
        "flipped header byte": good[:40] + bytes([good[40] ^ 0x01]) + good[41:],
        "cut short": good[: len(good) // 2],
        "empty": b"",
        "garbage": b"not an index at all" * 10,
    }
    for name, damaged in damages.items():
        path.write_bytes(damaged)
        fresh_process()
        before = len(builds)
        sequence = webdataset(urls).__distshard_sequence__()
        assert [sequence[i] for i in range(len(sequence))] == expected, name
        assert len(builds) == before + 1, name
        assert path.read_bytes() == good, name  # rewritten


def test_an_entry_of_another_file_is_not_used(tmp_path, builds):
    urls, _ = write_shards(tmp_path / "d", shards=2, per_shard=3)
    webdataset(urls).counts()
    entry(urls[0]).write_bytes(entry(urls[1]).read_bytes())  # a stray copy under the wrong name
    fresh_process()
    assert webdataset(urls).counts() == [3, 4] and builds.count(urls[0]) == 2


def test_concurrent_processes_build_each_index_once(tmp_path, cache):
    urls, _ = write_shards(tmp_path / "d", shards=6, per_shard=40)
    log = tmp_path / "builds.log"
    log.touch()
    ctx = mp.get_context("spawn")
    processes = 4
    barrier = ctx.Barrier(processes)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=source_factories.build_concurrently, args=(str(cache), urls, str(log), barrier, results))
        for _ in range(processes)
    ]
    for proc in procs:
        proc.start()
    try:
        results = [results.get(timeout=120) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    assert all(r == [40, 41, 42, 43, 44, 45] for r in results)
    built = Counter(line.split()[1] for line in log.read_text().splitlines())
    assert built == Counter(urls)  # every file once, whichever process built it


@pytest.mark.parametrize("shared", [True, False], ids=["shared-cache", "cache-per-rank"])
def test_ranks_split_the_index_build(tmp_path, cache, shared):
    urls, _ = write_shards(tmp_path / "d", shards=5, per_shard=10)
    log = tmp_path / "builds.log"
    log.touch()
    outcomes = run_on_group(
        source_factories.rank_indexes, world_size=2, timeout=120, args=(str(cache), urls, str(log), shared)
    )
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    assert [o.value["counts"] for o in outcomes] == [[10, 11, 12, 13, 14]] * 2
    lines = [line.split() for line in log.read_text().splitlines()]
    assert Counter(url for _, url in lines) == Counter(urls)  # each file indexed once in the job
    assert len({pid for pid, _ in lines}) == 2  # by both ranks
    assert all(all(o.value["present"]) for o in outcomes)  # entries exchanged when nothing is shared


def test_an_error_on_one_rank_is_raised_on_every_rank(tmp_path, cache):
    urls, _ = write_shards(tmp_path / "d", shards=3, per_shard=4)
    bad = Path(urls[1])
    bad.write_bytes(bad.read_bytes()[:1500])
    outcomes = run_on_group(source_factories.rank_error, world_size=2, timeout=120, args=(str(cache), urls))
    assert [o.error for o in outcomes] == [None, None]
    assert all(o.value.startswith("ValueError") and "shard-000001.tar: truncated tar" in o.value for o in outcomes)


def run_verify(tmp_path, monkeypatch, factory, urls, **kwargs):
    from distshard import verify

    monkeypatch.setenv("DISTSHARD_TEST_URLS", json.dumps(urls))
    return verify(factory, timeout=180, **kwargs)


@pytest.mark.parametrize(
    "factory", [source_factories.sharded_tar, source_factories.sharded_tar_shuffled], ids=["in-order", "shuffle"]
)
def test_exactly_once_through_dist_shard_on_gloo_with_workers(tmp_path, monkeypatch, factory):
    urls, _ = write_shards(tmp_path / "d", shards=5, per_shard=9)  # 55 samples, 8 slots
    report = run_verify(tmp_path, monkeypatch, factory, urls, world_size=4, num_workers=2)
    assert report.ok, report.summary()
    assert report.expected == 55 and report.per_slot == [6] * 8


def test_jsonl_exactly_once_with_pad(tmp_path, monkeypatch):
    urls, _ = write_jsonl(tmp_path / "j", files=3, lines=7)  # 24 lines, 4 slots
    report = run_verify(tmp_path, monkeypatch, source_factories.sharded_jsonl, urls, world_size=2, num_workers=2)
    assert report.ok, report.summary()
    assert report.per_slot == [6] * 4
