"""Remote shards through fsspec, against a local HTTP server (127.0.0.1) that
honours Range and HEAD requests and counts the bytes it serves: a slot
transfers its own samples' bytes, the index build transfers headers only."""

from __future__ import annotations

import builtins
import http.server
import random
import re
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Iterator
from urllib.parse import unquote

import pytest

from distshard.sources import jsonl, parquet, webdataset
from distshard.verify import run_on_group
from tests import source_factories
from tests.source_factories import isolated_cache as cache  # noqa: F401  (autouse)
from tests.source_factories import write_jsonl, write_shards

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")


class CountingServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path) -> None:
        super().__init__(("127.0.0.1", 0), RangeHandler)
        self.root = root
        self.lock = threading.Lock()
        self.served = 0
        self.requests = Counter()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{Path(path).relative_to(self.root).as_posix()}"


class RangeHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as two writes
    server: CountingServer

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self.respond(body=False)

    def do_GET(self) -> None:
        self.respond(body=True)

    def respond(self, body: bool) -> None:
        path = self.server.root / unquote(self.path.split("?", 1)[0].lstrip("/"))
        if not path.is_file():
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        st = path.stat()
        start, end, status = 0, st.st_size, 200
        wanted = self.headers.get("Range")
        if wanted:
            match = re.fullmatch(r"bytes=(\d+)-(\d*)", wanted.strip())
            assert match, wanted
            start = int(match.group(1))
            end = min(st.st_size, int(match.group(2)) + 1) if match.group(2) else st.st_size
            status = 206
        self.send_response(status)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{st.st_size}-{st.st_mtime_ns}"')
        self.send_header("Content-Type", "application/octet-stream")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{st.st_size}")
        self.end_headers()
        with self.server.lock:
            self.server.requests[self.command] += 1
        if body:
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read(end - start)
            self.wfile.write(data)
            with self.server.lock:
                self.server.served += len(data)


@pytest.fixture
def server(tmp_path) -> Iterator[CountingServer]:
    srv = CountingServer(tmp_path)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=10)


def remote_shards(tmp_path, server, shards=4, per_shard=30):
    paths, expected = write_shards(tmp_path / "data", shards=shards, per_shard=per_shard)
    urls = [server.url(p) for p in paths]
    expected = [{**s, "__url__": urls[paths.index(s["__url__"])]} for s in expected]
    return urls, expected, sum(Path(p).stat().st_size for p in paths)


def test_remote_iteration_equals_local(tmp_path, server):
    urls, expected, _ = remote_shards(tmp_path, server)
    assert list(webdataset(urls)) == expected


def test_random_order_reads_transfer_about_the_dataset_once(tmp_path, server):
    urls, expected, total = remote_shards(tmp_path, server)
    server.served = 0
    sequence = webdataset(urls).__distshard_sequence__()  # cold: the index walks the headers
    index_bytes = server.served
    order = list(range(len(sequence)))
    random.Random(3).shuffle(order)
    for i in order:
        assert sequence[i] == expected[i]
    assert index_bytes < 0.5 * total
    print(f"served {server.served / total:.3f} x the dataset, {dict(server.requests)}")
    assert server.served <= 1.10 * total, (server.served, total)


@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffle"])
def test_four_ranks_two_workers_transfer_each_byte_about_once(tmp_path, server, cache, shuffle):
    urls, expected, total = remote_shards(tmp_path, server, shards=6, per_shard=25)
    server.served = 0
    outcomes = run_on_group(source_factories.rank_reads, world_size=4, timeout=180,
                            args=(urls, str(cache), shuffle))
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    got = Counter(key for o in outcomes for key in o.value)
    assert got == Counter(source_factories.sample_key(s) for s in expected)  # exactly once
    print(f"served {server.served / total:.3f} x the dataset, {dict(server.requests)}")
    assert server.served <= 1.10 * total, (server.served, total)


def test_remote_jsonl(tmp_path, server):
    paths, expected = write_jsonl(tmp_path / "j", files=2, lines=40)
    urls = [server.url(p) for p in paths]
    source = jsonl(urls)
    assert list(source) == expected
    server.served = 0
    sequence = jsonl(urls).__distshard_sequence__()
    order = list(range(len(sequence)))
    random.Random(4).shuffle(order)
    assert [sequence[i] for i in order] == [expected[i] for i in order]
    assert server.served <= 2.05 * sum(Path(p).stat().st_size for p in paths)  # a scan, then each line


def test_remote_parquet(tmp_path, server):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"i": list(range(40)), "s": [str(i) for i in range(40)]})
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, row_group_size=8)
    source = parquet(server.url(str(path)), columns=["s"])
    assert list(source) == [{"s": str(i)} for i in range(40)]
    sequence = source.__distshard_sequence__()
    assert [sequence[i] for i in (39, 0, 17)] == [{"s": "39"}, {"s": "0"}, {"s": "17"}]


def test_missing_remote_file_is_named(tmp_path, server):
    with pytest.raises(FileNotFoundError, match="nothing.tar"):
        webdataset(server.url(str(tmp_path / "nothing.tar"))).counts()


def test_missing_fsspec_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_fsspec(name, *args, **kwargs):
        if name == "fsspec" or name.startswith("fsspec."):
            raise ImportError("No module named 'fsspec'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_fsspec)
    for name in [m for m in sys.modules if m == "fsspec" or m.startswith("fsspec.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=r"pip install distshard\[remote\]"):
        webdataset("s3://bucket/shard-000000.tar").counts()
