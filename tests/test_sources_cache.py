"""The local range cache (``ReadOptions(cache_dir=..., cache_bytes=...)``) over
the loopback HTTP range server, counting the bytes it serves: later epochs read
the store about never, a rewritten file is never served from the cache,
eviction keeps the limit, and fork DataLoader workers sharing the cache yield
exactly the epoch's samples."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

import distshard
from distshard.sources import ReadOptions, jsonl, webdataset
from distshard.sources.reading import fetch
from distshard.sources.reading.cache import RangeCache
from tests.range_server import served as server  # noqa: F401  (a fixture)
from tests.source_factories import isolated_cache as cache  # noqa: F401  (autouse)
from tests.source_factories import sample_key, write_jsonl, write_shards

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")


def stored_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.glob("*/*") if p.is_file() and not p.name.startswith(".tmp-"))


def options(root: Path, **more) -> ReadOptions:
    return ReadOptions(window=16 << 10, max_gap=4 << 10, max_range=64 << 10, cache_dir=str(root), **more)


def test_a_second_epoch_reads_the_store_about_never_with_two_fork_workers(tmp_path, server):
    from torch.utils.data import DataLoader

    paths, expected = write_shards(tmp_path / "data", shards=6, per_shard=25)
    urls = [server.url(p) for p in paths]
    total = sum(Path(p).stat().st_size for p in paths)
    source = webdataset(urls, read_options=options(tmp_path / "ranges"))
    source.counts()  # the index, built once (its bytes are not an epoch's)
    pipe = source.dist_shard(shuffle=True).map(sample_key)
    loader = DataLoader(pipe, batch_size=None, num_workers=2, multiprocessing_context="fork")
    want = Counter(sample_key({**s, "__url__": urls[paths.index(s["__url__"])]}) for s in expected)
    served = []
    for epoch in range(3):
        server.settle().reset_counters()
        distshard.set_epoch(pipe, epoch)
        assert Counter(loader) == want  # exactly once, every epoch
        served.append(server.settle().served)
    assert served[0] <= 1.05 * total
    assert served[1] <= 0.05 * total and served[2] <= 0.05 * total, (served, total)
    assert 0 < stored_bytes(tmp_path / "ranges") <= 1.05 * total


@pytest.mark.parametrize("kind", ["webdataset", "jsonl"])
def test_a_rewritten_file_is_never_served_from_the_cache(tmp_path, server, kind):
    if kind == "webdataset":
        paths, _ = write_shards(tmp_path / "data", shards=2, per_shard=20)
    else:
        paths, _ = write_jsonl(tmp_path / "data", files=2, lines=60)
    build = webdataset if kind == "webdataset" else jsonl
    urls = [server.url(p) for p in paths]
    read = options(tmp_path / "ranges")
    before = list(build(urls, read_options=read).dist_shard())
    server.settle().reset_counters()
    assert list(build(urls, read_options=read).dist_shard()) == before  # from the cache
    # nothing from the store but the one look for a stored index beside the files (a 404)
    data_gets = [path for method, path, _ in server.settle().log if method == "GET" and ".distshard/" not in path]
    assert data_gets == []
    target = Path(paths[1])  # rewritten at the same size: only the identity (mtime, ETag) tells
    data = bytearray(target.read_bytes())
    at = len(data) // 2
    while data[at] in b'\n{}"\\' or data[at] >= 0x80:
        at += 1
    data[at] = ord("7") if data[at] != ord("7") else ord("8")
    stat = target.stat()
    tmp = target.with_name(target.name + ".new")
    tmp.write_bytes(bytes(data))
    os.utime(tmp, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    os.replace(tmp, target)
    server.reset_counters()
    fresh = build([str(p) for p in paths])  # the truth, read locally
    after = list(build(urls, read_options=read).dist_shard())
    local = [{**s, "__url__": urls[paths.index(s["__url__"])]} if "__url__" in s else s for s in fresh]
    assert after == local  # the new version, never a byte of the old one
    assert after != before
    assert server.settle().by_path[target.name] > 0  # the rewritten file came from the store


def test_eviction_keeps_the_limit_and_the_most_recently_used(tmp_path, server):
    paths, expected = write_shards(tmp_path / "data", shards=4, per_shard=30)
    urls = [server.url(p) for p in paths]
    sizes = [Path(p).stat().st_size for p in paths]
    limit = int(max(sizes) * 1.5)
    root = tmp_path / "ranges"
    read = options(root, cache_bytes=limit)
    source = webdataset(urls, read_options=read)
    for _ in range(2):
        got = [sample_key(s) for s in source.dist_shard()]
        assert Counter(got) == Counter(sample_key({**s, "__url__": urls[paths.index(s["__url__"])]}) for s in expected)
        assert 0 < stored_bytes(root) <= limit
    last = webdataset(urls[-1:], read_options=read)  # the file read last is still there
    server.settle().reset_counters()
    assert len(list(last.dist_shard())) == 33
    assert server.settle().served == 0
    first = webdataset(urls[:1], read_options=read)  # the least recently used was evicted
    assert len(list(first.dist_shard())) == 30
    assert server.settle().served > 0
    assert stored_bytes(root) <= limit


def test_the_cache_serves_only_its_own_version_and_checks_its_options(tmp_path):
    cache = RangeCache(str(tmp_path / "c"), 1 << 20)
    one = cache.file("https://h/a.tar", 100, '"v1"')
    assert one is not None
    one.store(10, 50, bytes(range(40)))
    assert one.find(20, 30) == (10, 50) and one.read((10, 50), 20, 30) == bytes(range(10, 20))
    assert cache.file("https://h/a.tar", 100, '"v2"').find(20, 30) is None
    assert cache.file("https://h/a.tar", 101, '"v1"').find(20, 30) is None
    assert cache.file("https://h/b.tar", 100, '"v1"').find(20, 30) is None
    assert cache.file("https://h/a.tar", 100, "") is None  # no version named: not cached
    other = RangeCache(str(tmp_path / "c"), 1 << 20).file("https://h/a.tar", 100, '"v1"')  # another process
    assert other is not None and other.find(10, 50) == (10, 50)
    with pytest.raises(TypeError, match="cache_dir"):
        ReadOptions(cache_dir=3)
    with pytest.raises(ValueError, match="cache_bytes"):
        ReadOptions(cache_bytes=0)
    assert ReadOptions(cache_dir=tmp_path).cache_dir == str(tmp_path)


def test_parquet_rows_come_from_the_cache_in_later_epochs(tmp_path, server):
    pytest.importorskip("pyarrow")
    from distshard.sources import parquet
    from tests.source_factories import write_parquet_rows

    paths, expected = write_parquet_rows(tmp_path / "data")
    urls = [server.url(p) for p in paths]
    source = parquet(urls, read_options=options(tmp_path / "ranges"))
    source.counts()
    pipe = source.dist_shard(shuffle=True)
    for epoch in range(2):
        server.settle().reset_counters()
        fetch.reset_stats()
        pipe.set_epoch(epoch)
        assert sorted(map(repr, pipe)) == sorted(map(repr, expected))
        # the read-ahead's ranges only: pyarrow's reads across adjacent column chunks are served
        # from them (they were one more request per row group), then from the cache
        assert server.settle().requests["GET"] == (fetch.STATS.ranges if epoch == 0 else 0)
    assert fetch.STATS.cached > 0


def test_spans_from_the_cache_count_against_the_window_so_a_cached_epoch_does_not_run_far_ahead(tmp_path):
    from distshard.sources.reading.fetch import ReadAhead, Request

    cache = RangeCache(str(tmp_path / "c"), 1 << 30)
    stored = cache.file("https://h/a.bin", 1 << 20, '"v1"')
    assert stored is not None
    stored.store(0, 1 << 20, bytes(i % 251 for i in range(1 << 20)))

    class Unreachable:
        def submit(self, start, stop):
            raise AssertionError(f"asked the store for [{start}, {stop})")

    pulled = []

    def requests():
        for k in range(1024):
            pulled.append(k)
            yield Request(k, 0, [(k * 1024, (k + 1) * 1024)])

    read = ReadOptions(budget=64 << 10, first_range=8 << 10, max_range=16 << 10, max_gap=0, window=16 << 10)
    run = ReadAhead(read, lambda f: Unreachable(), caches=lambda f: stored).run(requests())
    k, views = next(run)
    assert k == 0 and bytes(views[0]) == bytes(i % 251 for i in range(1024))
    assert len(pulled) <= 2 * (8 << 10) // 1024 + 1  # the first window's worth, not the whole epoch
    rest = list(run)
    assert [k for k, _ in rest] == list(range(1, 1024))
    assert bytes(rest[-1][1][0]) == bytes(i % 251 for i in range(1023 * 1024, 1 << 20))
