"""Remote Parquet files indexed from one request each: a suffix GET (``Range:
bytes=-N``) whose answer gives the file's identity (size from ``Content-Range``,
ETag / Last-Modified) and whose body holds the footer; a longer footer costs one
range more, checked against that identity; servers that ignore or refuse suffix
ranges still work. Against the loopback range server (tests/range_server.py),
counting its requests; the S3 side (moto, both clients) is in test_sources_s3.py."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

from distshard.sources import parquet
from tests.range_server import serve
from tests.range_server import served as server  # noqa: F401  (a fixture)
from tests.source_factories import isolated_cache as cache  # noqa: F401  (autouse)
from tests.source_factories import write_keyed_parquet

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")


def footer_length(path: Path) -> int:
    data = path.read_bytes()
    return int.from_bytes(data[-8:-4], "little") + 8


def file_requests(server, suffix: str = ".parquet") -> list[tuple[str, str | None]]:
    """(method, Range) of every request the server saw for the data files."""
    return [(method, asked) for method, path, asked in server.settle().log if path.endswith(suffix)]


def all_keys(source, world_size: int = 2) -> Counter:
    return Counter(
        row["k"] for rank in range(world_size) for row in source.dist_shard(rank=rank, world_size=world_size)
    )


def expected_keys(files: int, rows: int = 40) -> Counter:
    return Counter(f"f{f}-{i}" for f in range(files) for i in range(rows))


def test_a_cold_job_asks_one_suffix_get_per_file_for_identity_and_footer(tmp_path, server):
    """Issue 22 item 3: N remote files cost N requests before the first row (their
    identities and footers), not a HEAD and a footer range each (2N on the old path)."""
    from distshard.sources.formats.parquet import TAIL

    paths = write_keyed_parquet(tmp_path, files=5)
    source = parquet([server.url(p) for p in paths])
    assert source.counts() == [40] * 5
    assert file_requests(server) == [("GET", f"bytes=-{TAIL}")] * 5, server.log
    assert server.requests["HEAD"] == 0
    server.reset_counters()
    assert all_keys(source) == expected_keys(5)
    # the rows: column chunk ranges, each checked against the suffix answer's identity
    assert {method for method, _ in file_requests(server)} == {"GET"}
    assert all(not asked.startswith("bytes=-") for _, asked in file_requests(server))


def test_the_index_command_reads_a_remote_parquet_file_with_one_request(tmp_path, server):
    from distshard.__main__ import main

    paths = write_keyed_parquet(tmp_path / "data", files=4)
    pattern = server.url(tmp_path / "data") + "/part-{000..003}.parquet"
    assert main(["index", pattern, "--out", str(tmp_path / "stored")]) == 0
    assert [method for method, _ in file_requests(server)] == ["GET"] * 4, server.log
    server.reset_counters()
    source = parquet([server.url(p) for p in paths], index=str(tmp_path / "stored"))
    assert all_keys(source) == expected_keys(4)


def test_a_footer_longer_than_the_suffix_costs_one_range_more(tmp_path, server):
    from distshard.sources.formats.parquet import TAIL

    [path] = write_keyed_parquet(tmp_path, files=1, rows=20, columns=250, row_group_size=5)
    size, need = path.stat().st_size, footer_length(path)
    assert need > TAIL
    source = parquet(server.url(path), columns=["k"])
    assert source.counts() == [20]
    assert file_requests(server) == [("GET", f"bytes=-{TAIL}"), ("GET", f"bytes={size - need}-{size - TAIL - 1}")]
    assert all_keys(source) == expected_keys(1, rows=20)


def _rewrite(path: Path) -> None:
    """The same bytes under a new modification time: a new version (ETag, Last-Modified)."""
    data = path.read_bytes()
    stat = path.stat()
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.utime(tmp, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    os.replace(tmp, path)


@pytest.mark.parametrize("weak", [False, True], ids=["strong-etag", "weak-etag"])
def test_a_file_changed_after_the_suffix_get_is_refused_naming_it(tmp_path, weak):
    """The footer's second range is checked against the identity of the suffix
    answer (If-Match on a strong ETag; a weak one and Last-Modified compared):
    a file rewritten between the two raises naming it."""
    [path] = write_keyed_parquet(tmp_path, files=1, rows=20, columns=250, row_group_size=5)
    gets = Counter()

    def rewrite_before_the_second_get(served: Path) -> None:
        gets[served.name] += 1
        if served.name == path.name and gets[served.name] == 2:
            _rewrite(path)

    with serve(tmp_path, weak=weak, before_get=rewrite_before_the_second_get) as srv:
        with pytest.raises(ValueError, match=f"{path.name} changed after it was indexed"):
            parquet(srv.url(path)).counts()
        assert gets[path.name] == 2


def test_a_file_changed_between_its_footer_and_its_rows_is_refused(tmp_path, server):
    [path] = write_keyed_parquet(tmp_path, files=1)
    source = parquet(server.url(path))
    assert source.counts() == [40]  # one suffix GET: identity and footer
    _rewrite(path)
    with pytest.raises(ValueError, match=f"{path.name} changed after it was indexed"):
        list(source.dist_shard(rank=0, world_size=1))


def test_a_server_without_suffix_ranges_is_asked_as_before(tmp_path):
    """A 400 to ``bytes=-N``: HEAD and footer ranges, as before suffix GETs, and
    remembered for the host (later files do not try again)."""
    paths = write_keyed_parquet(tmp_path, files=3)
    with serve(tmp_path, suffix=False) as srv:
        first = parquet(srv.url(paths[0]))
        assert first.counts() == [40]
        assert [(m, a is not None and a.startswith("bytes=-")) for m, a in file_requests(srv)] == [
            ("GET", True),  # refused (400)
            ("HEAD", False),
            ("GET", False),  # the footer's range
        ]
        srv.reset_counters()
        source = parquet([srv.url(p) for p in paths])
        assert source.counts() == [40] * 3
        assert srv.requests["HEAD"] == 3 and not any((a or "").startswith("bytes=-") for _, a in file_requests(srv))
        assert all_keys(source) == expected_keys(3)


def test_a_server_that_ignores_range_hands_a_small_file_whole(tmp_path):
    """200 and the whole body to ``bytes=-N``: a file no longer than N is taken
    from it (one request); a longer one is not read whole, its identity is asked
    with a HEAD."""
    [small] = write_keyed_parquet(tmp_path / "small", files=1)
    [large] = write_keyed_parquet(tmp_path / "large", files=1, rows=20, columns=250, row_group_size=5)
    with serve(tmp_path, ranges=False) as srv:
        assert parquet(srv.url(small)).counts() == [40]
        assert [m for m, _ in file_requests(srv)] == ["GET"]
        assert srv.served == small.stat().st_size
        srv.reset_counters()
        with pytest.raises(ValueError, match="does not serve range requests"):
            parquet(srv.url(large)).counts()  # (random access needs ranges, as before)
        # the suffix answer's whole body was not taken: a HEAD, then the footer's range (refused)
        assert [m for m, _ in file_requests(srv)] == ["GET", "HEAD", "GET"]


def test_the_index_from_the_suffix_get_is_the_one_built_from_the_file(tmp_path, server):
    """Nested and dictionary columns, a footer in the suffix and one longer than it:
    the same counts, column chunk ranges, column names and footer bytes as the
    index pyarrow builds from the local file."""
    from distshard.sources.formats.parquet import ParquetFormat
    from distshard.sources.transport.files import FileAccess, FileRef, file_identity

    n = 30
    table = pa.table(
        {
            "id": list(range(n)),
            "tags": [[f"t{i % 3}"] * (i % 4) for i in range(n)],
            "point": [{"x": i, "y": [i, -i]} for i in range(n)],
            "word": pa.array([f"w{i % 5}" for i in range(n)]).dictionary_encode(),
            **{f"c{c}": list(range(n)) for c in range(300)},
        }
    )
    small, wide = tmp_path / "small.parquet", tmp_path / "wide.parquet"
    pq.write_table(table.select(["id", "tags", "point", "word"]), small, row_group_size=7)
    pq.write_table(table, wide, row_group_size=7)
    fmt, access = ParquetFormat(), FileAccess()
    for path in (small, wide):
        url = server.url(path)
        remote = fmt.build_index(FileRef(url, *fmt.identity(url, access)), access)
        local = fmt.build_index(FileRef(str(path), *file_identity(str(path))), access)
        assert (remote.count, remote.size) == (local.count, local.size) == (n, path.stat().st_size)
        assert remote.arrays == local.arrays and remote.strings == local.strings
    assert [m for m, _ in file_requests(server)] == ["GET", "GET", "GET"]  # small: 1, wide: 2


@pytest.mark.parametrize(
    "status, content_range, length, expected",
    [
        (206, "bytes 900-999/1000", "100", (900, 1000)),
        (206, "bytes 0-49/50", "50", (0, 50)),  # a file shorter than the suffix: whole
        (206, "bytes 0-99/1000", "100", None),  # bytes=-100 read as bytes=0-99
        (206, "bytes 900-998/1000", "99", None),
        (206, "bytes 900-999/*", "100", None),  # no total: no size
        (206, None, "100", None),
        (200, None, "80", (0, 80)),  # Range ignored, a small file: its whole body
        (200, None, "5000", None),  # Range ignored, a large file: not read whole
        (200, None, None, None),
        (416, "bytes */0", "0", None),
    ],
)
def test_what_a_suffix_answer_holds(status, content_range, length, expected):
    from distshard.sources.transport.responses import suffix_answer

    assert suffix_answer(status, content_range, length, 100) == expected
