"""Remote shards through fsspec, against a loopback range server
(tests/range_server.py: Range, HEAD, ETag, If-Match, injected faults, counts):
few large requests, a cold index without a round trip per header, the identity
asked once per job, retries, a rewritten file refused, storage_options, and no
hang after fork."""

from __future__ import annotations

import builtins
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from distshard.sources import ReadOptions, RemoteReadError, jsonl, parquet, webdataset
from distshard.verify import run_on_group
from tests import source_factories
from tests.range_server import self_signed, serve
from tests.range_server import served as server  # noqa: F401  (a fixture)
from tests.source_factories import isolated_cache as cache  # noqa: F401  (autouse)
from tests.source_factories import write_jsonl, write_shards

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

ROOT = Path(__file__).resolve().parent.parent


def remote_shards(tmp_path, server, shards=4, per_shard=30):
    paths, expected = write_shards(tmp_path / "data", shards=shards, per_shard=per_shard)
    urls = [server.url(p) for p in paths]
    expected = [{**s, "__url__": urls[paths.index(s["__url__"])]} for s in expected]
    return urls, expected, sum(Path(p).stat().st_size for p in paths)


def test_remote_iteration_equals_local(tmp_path, server):
    urls, expected, total = remote_shards(tmp_path, server)
    assert [sample for sample in webdataset(urls)] == expected  # (list() would ask len(): an index)
    assert server.settle().requests["GET"] == len(urls) and server.served == total  # one range per small shard


def test_cold_index_and_reads_take_few_large_requests(tmp_path, server):
    urls, expected, total = remote_shards(tmp_path, server)
    sequence = webdataset(urls).__distshard_sequence__()  # cold: one pass over each tar in large ranges
    # never one per header; one GET looked for a stored index beside the shards (404)
    assert dict(server.settle().requests) == {"HEAD": len(urls), "GET": len(urls) + 1}
    assert server.served == total
    server.reset_counters()
    assert list(sequence.distshard_read(range(len(sequence)))) == expected
    # one range per shard, no metadata request; the first range is at most first_range (the read
    # starts small), so one shard may take two
    assert dict(server.settle().requests) in ({"GET": len(urls)}, {"GET": len(urls) + 1})
    assert server.served <= total
    server.reset_counters()
    some = [3, 90, 4, 5, 91, 2]
    assert list(sequence.distshard_read(some)) == [expected[i] for i in some]  # in the order asked
    # the first sample's range alone (nothing else is asked until it is answered), then
    # one range of each file for the rest
    assert server.requests["GET"] <= 3


def test_random_order_single_reads_transfer_about_the_dataset_once(tmp_path, server):
    urls, expected, total = remote_shards(tmp_path, server)
    sequence = webdataset(urls).__distshard_sequence__()
    server.reset_counters()
    import random

    order = list(range(len(sequence)))
    random.Random(3).shuffle(order)
    for i in order:
        assert sequence[i] == expected[i]
    assert server.settle().served <= 1.05 * total and server.requests["HEAD"] == 0


@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffle"])
def test_two_ranks_two_workers_exactly_once_with_the_identity_asked_once(tmp_path, server, cache, shuffle):
    urls, expected, total = remote_shards(tmp_path, server, shards=6, per_shard=25)
    options = ReadOptions(window=16 << 10, max_gap=4 << 10)  # small windows: tiny shards, 4 slots
    outcomes = run_on_group(
        source_factories.rank_reads, world_size=2, timeout=180, args=(urls, str(cache), shuffle, options)
    )
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    got = Counter(key for o in outcomes for key in o.value)
    assert got == Counter(source_factories.sample_key(s) for s in expected)  # exactly once
    server.settle()
    heads = Counter(path for method, path, _ in server.log if method == "HEAD")
    # once per job: the ranks split it, the 4 workers ask nothing (a retried HEAD at most)
    assert len(heads) == len(urls) and sum(heads.values()) <= len(urls) + 1, heads
    epoch = server.served - total  # the cold index read each shard once
    assert epoch <= (1.0 if not shuffle else 1.0 + 3 * 16 / (total / 1024)) * total, (epoch, total)
    # (+ 2: each rank looks for a stored index beside the shards once)
    assert server.requests["GET"] <= len(urls) + (4 if not shuffle else 4 * 12) + len(urls) + 2


def test_transient_faults_are_retried_and_the_epoch_stays_exact(tmp_path):
    paths, expected = write_shards(tmp_path / "data", shards=4, per_shard=20)
    with serve(tmp_path, fault_every=2) as server:  # every other GET: 500, 503, a reset body, a short body
        urls = [server.url(p) for p in paths]
        options = ReadOptions(max_range=4 << 10, budget=32 << 10, max_gap=1 << 10, window=8 << 10, retry_seconds=20)
        source = webdataset(urls, read_options=options)
        got = [s["__key__"] for r in range(2) for s in source.dist_shard(rank=r, world_size=2, shuffle=True)]
        assert sorted(got) == sorted(s["__key__"] for s in expected)
        assert set(server.faulted) == {"500", "503", "reset", "short"}, server.faulted
        assert list(webdataset(urls, read_options=options)) == [
            {**s, "__url__": urls[paths.index(s["__url__"])]} for s in expected
        ]


def test_retries_are_bounded_and_name_the_url_and_range(tmp_path):
    paths, _ = write_shards(tmp_path / "data", shards=1, per_shard=5)
    with serve(tmp_path) as server:
        url = server.url(paths[0])
        source = webdataset([url], read_options=ReadOptions(retries=2, retry_seconds=5))
        source.counts()
        server.fault_every, server.faults = 1, ("503",)
        started = time.monotonic()
        with pytest.raises(RemoteReadError, match=r"shard-000000\.tar: bytes \[\d+, \d+\): 3 attempts failed.*503"):
            list(source.dist_shard())
        assert time.monotonic() - started < 5


def test_a_second_source_over_the_same_files_reads_with_its_own_options(tmp_path):
    # the per-process cache of open handles was keyed by storage_options alone: the second
    # source read through the first one's handle, with its ReadOptions (asked retries=1, got 6)
    paths, _ = write_shards(tmp_path / "data", shards=1, per_shard=5)
    with serve(tmp_path) as server:
        url = server.url(paths[0])
        assert len(list(webdataset([url]).dist_shard())) == 5  # retries=6 (the default): its handle is cached
        strict = webdataset([url], read_options=ReadOptions(retries=1, retry_seconds=5))
        strict.counts()
        server.fault_every, server.faults = 1, ("503",)
        with pytest.raises(RemoteReadError, match=r"shard-000000\.tar: bytes \[\d+, \d+\): 2 attempts failed.*503"):
            list(strict.dist_shard())


def _rewrite_same_size(path: Path) -> None:
    """Replace the file as an object store replaces an object: at once (never a
    half-written file), the same size, a new ETag."""
    data = bytearray(path.read_bytes())
    data[-600] = (data[-600] + 1) % 256 if data[-600] not in b'\n{}"' else data[-600]
    stat = path.stat()
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(bytes(data))
    os.utime(tmp, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    os.replace(tmp, path)


@pytest.mark.parametrize("kind", ["jsonl", "webdataset", "parquet"])
def test_a_file_rewritten_during_the_epoch_raises_instead_of_mixing_versions(tmp_path, server, kind):
    small = ReadOptions(budget=1024, max_range=512, max_gap=0, window=1024, timeout=20)  # little read ahead
    if kind == "jsonl":
        paths, _ = write_jsonl(tmp_path / "j", files=1, lines=60)
        source = jsonl([server.url(p) for p in paths], read_options=small)
    elif kind == "webdataset":
        paths, _ = write_shards(tmp_path / "t", shards=1, per_shard=40)
        source = webdataset([server.url(p) for p in paths], read_options=small)
    else:
        pa = pytest.importorskip("pyarrow")
        pq = pytest.importorskip("pyarrow.parquet")
        paths = [str(tmp_path / "t.parquet")]
        pq.write_table(pa.table({"i": list(range(400))}), paths[0], row_group_size=20)
        source = parquet([server.url(p) for p in paths], read_options=small)
    it = iter(source.dist_shard())
    for _ in range(3):
        next(it)
    _rewrite_same_size(Path(paths[0]))
    with pytest.raises(ValueError, match="changed after it was indexed"):
        for _ in it:
            pass


@pytest.mark.parametrize("kind", ["jsonl", "webdataset"])
def test_a_file_rewritten_behind_weak_etags_raises(tmp_path, kind):
    """Issue 21: a server that sends weak ETags (``W/"..."``) and no If-Match
    support; the file is rewritten at the same size mid-epoch. The weak validator
    (and the Last-Modified) is compared on every response."""
    small = ReadOptions(budget=1024, max_range=512, max_gap=0, window=1024, timeout=20)
    with serve(tmp_path, weak=True) as server:
        if kind == "jsonl":
            paths, expected = write_jsonl(tmp_path / "j", files=1, lines=60)
            source = jsonl([server.url(p) for p in paths], read_options=small)
        else:
            paths, _ = write_shards(tmp_path / "t", shards=1, per_shard=40)
            source = webdataset([server.url(p) for p in paths], read_options=small)
        it = iter(source.dist_shard())
        got = [next(it) for _ in range(3)]
        _rewrite_same_size(Path(paths[0]))
        with pytest.raises(ValueError, match="changed after it was indexed.*ETag W/"):
            got.extend(it)
        if kind == "jsonl":
            assert got == expected[: len(got)]  # read ahead before the rewrite: the old version only


def test_weak_etags_and_last_modified_are_compared():
    from distshard.sources.transport.responses import http_change
    from distshard.sources.transport.responses import http_stamp as _http_stamp

    lm1, lm2 = "Tue, 01 Dec 2026 10:00:00 GMT", "Tue, 01 Dec 2026 10:00:01 GMT"
    weak = _http_stamp({"ETag": 'W/"v1"', "Last-Modified": lm1})
    assert http_change(weak, {"ETag": 'W/"v1"', "Last-Modified": lm1}) is None
    assert http_change(weak, {"ETag": '"v1"', "Last-Modified": lm1}) is None  # weak comparison
    assert "ETag" in http_change(weak, {"ETag": 'W/"v2"', "Last-Modified": lm2})
    assert "Last-Modified" in http_change(weak, {"ETag": 'W/"v1"', "Last-Modified": lm2})
    assert "Last-Modified" in http_change(weak, {"Last-Modified": lm2})
    strong = _http_stamp({"ETag": '"v1"', "Last-Modified": lm1})
    assert strong == '"v1"' and http_change(strong, {"ETag": 'W/"v1"'}) is not None
    assert http_change(_http_stamp({"Last-Modified": lm1}), {"Last-Modified": lm2}) is not None


def test_storage_options_reach_fsspec(tmp_path):
    paths, expected = write_jsonl(tmp_path / "j", files=2, lines=10)
    with serve(tmp_path, require={"Authorization": "Bearer sesame"}) as server:
        urls = [server.url(p) for p in paths]
        with pytest.raises(PermissionError, match="storage_options"):
            jsonl(urls).counts()
        options = {"headers": {"Authorization": "Bearer sesame"}}
        source = jsonl(urls, storage_options=options)
        assert list(source) == expected
        assert sorted(
            map(json.dumps, (x for r in range(2) for x in source.dist_shard(rank=r, world_size=2)))
        ) == sorted(map(json.dumps, expected))
        index = tmp_path / "index.json"
        index.write_text(json.dumps({"shardlist": [{"url": Path(p).name, "nsamples": 10} for p in paths[:1]]}))
        shards, _ = write_shards(tmp_path / "s", shards=1, per_shard=10)
        (tmp_path / "shard-000000.tar").write_bytes(Path(shards[0]).read_bytes())
        index.write_text(json.dumps({"shardlist": [{"url": "shard-000000.tar", "nsamples": 10}]}))
        wds = webdataset(None, index=server.url(index), storage_options=options)
        assert len(list(wds.dist_shard())) == 10


def test_a_server_without_head_is_asked_with_a_one_byte_range(tmp_path):
    paths, expected = write_jsonl(tmp_path / "j", files=1, lines=12)
    with serve(tmp_path, head=False) as server:
        source = jsonl([server.url(p) for p in paths])
        assert len(source) == 12 and [x for x in source.dist_shard()] == expected
        assert ("GET", "/j/part-000.jsonl", "bytes=0-0") in server.log


def test_remote_jsonl(tmp_path, server):
    paths, expected = write_jsonl(tmp_path / "j", files=2, lines=40)
    urls = [server.url(p) for p in paths]
    source = jsonl(urls)
    assert list(source) == expected
    server.reset_counters()
    got = [x for r in range(3) for x in jsonl(urls).dist_shard(rank=r, world_size=3, shuffle=True)]
    assert sorted(map(json.dumps, got)) == sorted(map(json.dumps, expected))
    total = sum(Path(p).stat().st_size for p in paths)
    assert server.settle().served <= 2.05 * total  # a scan, then each line about once


def test_remote_parquet_decodes_each_row_group_about_once(tmp_path, server):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from distshard.sources.formats.parquet import decodes

    table = pa.table({"i": list(range(400)), "s": [str(i) * 20 for i in range(400)]})
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, row_group_size=20)
    url = server.url(path)
    source = parquet(url, columns=["s"])
    assert list(source) == [{"s": str(i) * 20} for i in range(400)]
    before = decodes()
    got = [
        row["s"] for r in range(2) for row in parquet(url, columns=["s"]).dist_shard(rank=r, world_size=2, shuffle=True)
    ]
    assert sorted(got) == sorted(str(i) * 20 for i in range(400))
    assert decodes() - before <= 20 + 1  # 20 row groups, one shared by the two slots at most


def test_missing_remote_file_is_named(tmp_path, server):
    with pytest.raises(FileNotFoundError, match="nothing.tar"):
        webdataset(server.url(tmp_path / "nothing.tar")).counts()


def test_missing_fsspec_names_the_extra(monkeypatch):
    from distshard.sources.transport import clients

    real_import = builtins.__import__

    def no_fsspec(name, *args, **kwargs):
        if name == "fsspec" or name.startswith("fsspec."):
            raise ImportError("No module named 'fsspec'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_fsspec)
    for name in [m for m in sys.modules if m == "fsspec" or m.startswith("fsspec.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(clients, "_CLIENTS", {})
    with pytest.raises(ImportError, match=r"pip install distshard\[remote\]"):
        webdataset("s3://bucket/shard-000000.tar").counts()


# -- fork safety ------------------------------------------------------------------------------------
# A forked child shares its parent's sockets and its event loop's epoll set (one kernel object
# for both): a child that closes an inherited aiohttp connection (its garbage collection, or the
# finalizers its exit runs) removes the parent's socket from the parent's epoll set, or, over TLS,
# sends the server a close_notify on it, and the parent's next request on that pooled connection
# never gets its answer. ``clients._after_fork_in_child`` keeps what the child inherited alive and
# detaches those finalizers. The parent's requests after the forks are made with no retry, so
# that a connection a child spoilt fails them (within ``timeout``) instead of being retried away.
FORK_SCRIPT = r"""
import gc, os, sys, threading
from pathlib import Path
sys.path.insert(0, {root!r})
import aiohttp, fsspec  # before distshard: fsspec's fork hook runs before distshard's, and empties its caches
from tests.range_server import RangeHandler, RangeServer
from tests.source_factories import write_shards
import distshard
from distshard.sources import ReadOptions
from torch.utils.data import DataLoader

root = Path({folder!r})
os.environ["DISTSHARD_CACHE"] = str(root / "cache")
OPEN, LOCK = set(), threading.Lock()  # the server's connections not ended yet, by the client's port

class Tracked(RangeHandler):
    def setup(self):
        super().setup()
        with LOCK:
            OPEN.add(self.client_address[1])

    def finish(self):
        with LOCK:
            OPEN.discard(self.client_address[1])
        super().finish()

def still_open(ports):  # a child that closed one over TLS told the server so (close_notify): it ended it
    with LOCK:
        return ports <= OPEN

server = RangeServer(root, scheme={scheme!r}, certfile={cert!r}, keyfile={key!r})
server.RequestHandlerClass = Tracked
server.start()
paths, _ = write_shards(root / "a", shards=4, per_shard=10)
more, _ = write_shards(root / "b", shards=2, per_shard=10)
urls, others = [server.url(p) for p in paths], [server.url(p) for p in more]
once = ReadOptions(retries=0, timeout=20)  # a request a child spoilt fails, within 20 s, instead of being retried

async def get_client(**kwargs):  # idle connections kept 10 minutes: the parent's are still pooled after its forks
    connector = aiohttp.TCPConnector(keepalive_timeout=600)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=20), **kwargs)

store = {{"get_client": get_client}}

def user_read(url):  # a filesystem of the user's, held by fsspec's instance cache alone; one GET
    return len(fsspec.filesystem("http", **store).cat_file(url, start=0, end=100))

def collect(sample):  # what any long epoch does in a worker: a garbage collection
    gc.collect()
    return sample["__key__"]

source = distshard.webdataset(urls, storage_options=store)
print("before", len(source), user_read(urls[0]), flush=True)  # both hold pooled connections now
with LOCK:
    pooled = set(OPEN)  # the parent's, idle
loader = DataLoader(source.dist_shard().map(collect), batch_size=None, num_workers=2,
                    multiprocessing_context="fork")
print("epoch", len(list(loader)), flush=True)
if os.fork() == 0:  # a child that ends as a program does: its exit runs the finalizers it inherited
    gc.collect()
    sys.exit(0)
os.wait()
print("pooled", still_open(pooled), flush=True)
print("after", len(distshard.webdataset(others, storage_options=store, read_options=once)), user_read(urls[1]), flush=True)
"""


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_no_hang_in_the_parent_after_fork_workers(tmp_path, scheme):
    """The parent's pooled connections outlive its fork children: DataLoader workers
    that collect garbage, and a child that exits through the interpreter's shutdown;
    for distshard's clients and for a filesystem of the user's in fsspec's cache."""
    cert = key = None
    env = dict(os.environ)
    if scheme == "https":
        made = self_signed(tmp_path)
        if made is None:
            pytest.skip("no openssl command to make a test certificate")
        cert, key = made
        env["SSL_CERT_FILE"] = cert  # aiohttp reads it at import
    script = FORK_SCRIPT.format(root=str(ROOT), folder=str(tmp_path), scheme=scheme, cert=cert, key=key)
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the parent hung after its fork children ended: {exc.stdout!r}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["before", "46", "100", "epoch", "46", "pooled", "True", "after", "21", "100"], (
        done.stdout
    )


def test_a_mix_of_remote_sources_reads_each_through_its_read_ahead(tmp_path, server):
    """A mix hands each file source the indices of its picks at once: a slot's share
    of a remote source is fetched in a few large ranges, not a round trip per sample
    (with every 5th response faulty: retried, exactly)."""
    from torch.utils.data.datapipes.iter import IterableWrapper

    import distshard

    server.fault_every = 5
    web_urls, web = remote_shards(tmp_path, server, shards=3, per_shard=40)[:2]
    paths, lines = write_jsonl(tmp_path / "j", files=2, lines=50)
    options = ReadOptions(retry_seconds=20)

    def pipe(rank: int):
        sources = {
            "web": webdataset(web_urls, read_options=options),
            "text": jsonl([server.url(p) for p in paths], read_options=options),
            "ids": IterableWrapper([f"id{i}" for i in range(30)]),
        }
        return distshard.mix(sources, {"web": 2, "text": 2, "ids": 1}, stop="first_exhausted").dist_shard(
            rank=rank, world_size=2, shuffle=True, seed=4
        )

    whole = list(
        distshard.mix(
            {
                "web": IterableWrapper(web),
                "text": IterableWrapper(lines),
                "ids": IterableWrapper([f"id{i}" for i in range(30)]),
            },
            {"web": 2, "text": 2, "ids": 1},
            stop="first_exhausted",
        )
    )
    pipes = [pipe(rank) for rank in range(2)]  # indexes the files (HEAD + GET per file)
    server.settle()
    server.reset_counters()
    got = [element for p in pipes for element in p]

    def key(element):
        return repr(sorted(element.items())) if isinstance(element, dict) else repr(element)

    assert Counter(map(key, got)) == Counter(map(key, whole)) and len(got) == len(whole)
    samples = sum(1 for e in got if isinstance(e, dict))
    gets = server.settle().requests["GET"]
    # per sample it was one GET each (plus retries); read ahead: a few ranges per file and slot
    assert gets <= 2 * 2 * (len(web_urls) + len(paths)), (gets, samples)
    assert server.faulted and sum(server.faulted.values()) < gets


def test_threads_that_index_at_once_share_one_filesystem():
    """Indexing threads ask a fresh client for its filesystem at once: they must get
    one (with two, an S3 request asked the second, whose session did not exist)."""
    import threading

    from distshard.sources.transport.remote import Client

    made = []

    class SlowFileSystem:
        def __init__(self, **options) -> None:
            time.sleep(0.05)  # a wide window for a second thread
            made.append(self)

    client = Client("http://127.0.0.1/x", "http", {})
    client._cls = SlowFileSystem
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(client.fs)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(made) == 1 and len({id(fs) for fs in seen}) == 1


class _RangeFile:
    """A buffered file of :class:`_RangeFS` (fsspec's ``AbstractBufferedFile``): one GET per fetch."""

    @staticmethod
    def make(fs, path, **kwargs):
        from fsspec.spec import AbstractBufferedFile

        class File(AbstractBufferedFile):
            def _fetch_range(self, start, end):
                import urllib.request

                asked = urllib.request.Request(f"http://{self.path}", headers={"Range": f"bytes={start}-{end - 1}"})
                with urllib.request.urlopen(asked, timeout=30) as answer:
                    return answer.read()

        return File(fs, path, **kwargs)


def _range_fs():
    """A blocking fsspec filesystem over the range server that keeps fsspec's default
    ``cat_file`` (a buffered open), as HfFileSystem and many others do."""
    import fsspec
    from fsspec.spec import AbstractFileSystem

    class RangeFS(AbstractFileSystem):
        protocol = "distshardrange"

        def info(self, path, **kwargs):
            import urllib.request

            path = self._strip_protocol(path)
            with urllib.request.urlopen(urllib.request.Request(f"http://{path}", method="HEAD"), timeout=30) as r:
                return {
                    "name": path,
                    "size": int(r.headers["Content-Length"]),
                    "type": "file",
                    "ETag": r.headers["ETag"],
                }

        def _open(self, path, mode="rb", block_size=None, autocommit=True, cache_options=None, **kwargs):
            return _RangeFile.make(self, path, mode=mode, block_size=block_size, cache_options=cache_options, **kwargs)

    fsspec.register_implementation(RangeFS.protocol, RangeFS, clobber=True)
    return RangeFS.protocol


def test_a_buffered_fsspec_filesystem_reads_exact_ranges(tmp_path):
    # fsspec's default cat_file opened a read-ahead file that fetched 5 MiB past every range's end:
    # an epoch of a 2 MiB file read through 256 KiB ranges transferred about 4x its bytes
    protocol = _range_fs()
    path = tmp_path / "big.jsonl"
    lines = [{"i": i, "text": "x" * 1000} for i in range(2000)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with serve(tmp_path) as server:
        url = f"{protocol}://" + server.url(path).split("://", 1)[1]
        options = ReadOptions(max_range=256 << 10, first_range=256 << 10, budget=1 << 20)
        source = jsonl([url], read_options=options)
        assert len(source) == len(lines)
        server.reset_counters()
        assert [row["i"] for row in source.dist_shard()] == list(range(2000))
        size = path.stat().st_size
        assert server.settle().requests["GET"] >= 8 and server.served <= 1.10 * size, (server.served, size)
