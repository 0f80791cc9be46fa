"""What ``python -m distshard index`` says and its exit status (issue 28, item 8):
0 every file indexed; 1 files that could not be indexed (the others listed, or
nothing written, said as it is); 2 could not run (a store that cannot be reached,
access denied, a destination that cannot be written, refused before any file is
read); the library's retry warnings shown once per request, on their own line, and
counted in the summary; the hints for an index served over http(s) name a local
``--out``. In-process (``main([...])``), against the loopback range server; the S3
cases (a missing bucket) are in ``test_sources_s3.py``, on both clients."""

from __future__ import annotations

import os
import re
import sys
import threading

import pytest

from distshard.__main__ import main
from distshard.errors import SourceChangedError
from distshard.sources import webdataset
from distshard.verify import free_port
from tests.range_server import serve
from tests.range_server import served as server  # noqa: F401  (a fixture)
from tests.source_factories import isolated_cache as cache  # noqa: F401  (autouse)
from tests.source_factories import write_shards

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")


def test_a_store_that_cannot_be_reached_could_not_run(tmp_path, capsys):
    out = tmp_path / "index"
    pattern = f"http://127.0.0.1:{free_port()}/data/shard-{{000000..000002}}.tar"
    assert main(["index", pattern, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("could not run: ") == 1 and "could not connect to the store" in err, err
    assert "others" not in err and f"nothing was written to {out}" in err, err
    assert not out.exists()


def test_files_that_cannot_be_indexed_exit_1_and_say_what_was_kept(tmp_path, server, capsys):  # noqa: F811
    paths, _ = write_shards(tmp_path / "data", shards=3, per_shard=2)
    urls = [server.url(p) for p in paths]
    gone = urls[0].replace("shard-000000", "shard-000009")
    out = tmp_path / "index"
    assert main(["index", *urls, gone, "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"1 of 4 files could not be indexed (the manifest at {out} lists 3 files" in captured.err, captured.err
    assert f"{gone}: SourceMissingError" in captured.err and "could not run" not in captured.err
    # nothing indexed, nothing written: never "the others are in ..."
    empty = tmp_path / "empty"
    assert main(["index", gone, "--out", str(empty)]) == 1
    err = capsys.readouterr().err
    assert f"1 of 1 files could not be indexed (nothing was written to {empty})" in err, err
    assert "others" not in err and not empty.exists()


def test_a_destination_that_cannot_be_written_is_refused_before_any_file_is_read(tmp_path, server, capsys):  # noqa: F811
    paths, _ = write_shards(tmp_path / "data", shards=3, per_shard=2)
    urls = [server.url(p) for p in paths]
    server.reset_counters()
    assert main(["index", *urls]) == 2  # .distshard/ beside files served over HTTP: read-only
    err = capsys.readouterr().err
    assert "could not run: cannot write http://" in err and "http(s) URLs are read-only" in err, err
    (tmp_path / "a-file").write_text("")
    assert main(["index", *urls, "--out", str(tmp_path / "a-file" / "index")]) == 2
    err = capsys.readouterr().err
    assert f"could not run: cannot write {tmp_path / 'a-file' / 'index'}" in err, err
    assert server.settle().log == []  # refused before any request


def test_access_denied_stops_the_build_and_could_not_run(tmp_path, capsys, monkeypatch):
    from distshard.sources.stored import indexing

    # the files after the first wait until the build has heard of its failure (one thread:
    # at most the second file is under way then, and the six others are never read)
    heard, real_index, real_failed = threading.Event(), indexing._index_one, indexing._Build.failed

    def failed(build, *args):
        real_failed(build, *args)
        heard.set()

    def index_one(url, *args):
        if not url.endswith("shard-000000.tar"):
            assert heard.wait(60)
        return real_index(url, *args)

    monkeypatch.setattr(indexing._Build, "failed", failed)
    monkeypatch.setattr(indexing, "_index_one", index_one)
    paths, _ = write_shards(tmp_path / "data", shards=8, per_shard=2)
    with serve(tmp_path, require={"X-Token": "secret"}) as denying:
        urls = [denying.url(p) for p in paths]
        assert main(["index", *urls, "--out", str(tmp_path / "index"), "--workers", "1"]) == 2
        assert denying.settle().requests["GET"] <= 2  # the files not started when the first failed are not read
    err = capsys.readouterr().err
    assert err.startswith("could not run: ") and "access denied (HTTP 403)" in err, err
    assert "nothing was written" in err and not (tmp_path / "index").exists()


@pytest.mark.parametrize("terminal", [False, True])
def test_retries_are_shown_once_per_request_and_counted_in_the_summary(tmp_path, capsys, monkeypatch, terminal):
    paths, _ = write_shards(tmp_path / "data", shards=6, per_shard=2)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    with serve(tmp_path, fault_every=3, faults=("503",)) as faulty:  # the 3rd and 6th GET: a 503 each
        urls = [faulty.url(p) for p in paths]
        assert main(["index", *urls, "--out", str(tmp_path / "index"), "--workers", "1"]) == 0
    captured = capsys.readouterr()
    assert captured.out.endswith("; 2 retries of 2 requests\n"), captured.out
    warned = re.findall(r"warning: retrying (\S+) the whole file \(attempt 1 failed: HTTP 503\)\n", captured.err)
    assert warned == [urls[2], urls[4]], captured.err
    if not terminal:
        assert captured.err == "".join(
            f"warning: retrying {u} the whole file (attempt 1 failed: HTTP 503)\n" for u in warned
        )
    else:  # the progress line cleared before each warning and drawn again below it, then ended
        assert len(re.findall(r"\r\x1b\[2Kwarning: [^\n]*\n\r  \d/6 files", captured.err)) == 2, captured.err
        assert captured.err.endswith("\n") and "\r  6/6 files" in captured.err


def test_the_hints_for_an_index_served_over_http_name_a_local_out(tmp_path, server, monkeypatch):  # noqa: F811
    paths, _ = write_shards(tmp_path / "data", shards=3, per_shard=2)
    urls = [server.url(p) for p in paths]
    assert main(["index", *urls[:2], "--out", str(tmp_path / "data" / ".distshard")]) == 0  # served beside them
    location = urls[0].rsplit("/", 1)[0] + "/.distshard"
    local_out = f"`python -m distshard index URLS --out DIR` into a local folder DIR (http(s) is read-only), then serve DIR as {location}"
    source = webdataset(urls)
    assert len(source) == 3 * 2 + 3
    assert f"lacks 1 of these files; to add them: {local_out}" in source.describe(), source.describe()
    changed = tmp_path / "data" / "shard-000001.tar"
    os.utime(changed, ns=(changed.stat().st_atime_ns, changed.stat().st_mtime_ns + 10**9))  # a new ETag
    monkeypatch.setenv("DISTSHARD_CACHE", str(tmp_path / "node"))
    with pytest.raises(SourceChangedError) as refused:
        list(webdataset(urls[:2]).dist_shard())
    assert f"refresh it with {local_out}" in str(refused.value), refused.value
    assert "--out http" not in source.describe() + str(refused.value)
