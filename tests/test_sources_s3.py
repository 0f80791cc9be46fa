"""s3:// sources against a real S3 API: moto's server on 127.0.0.1 (started and
stopped here), reached with ``storage_options`` (and through the environment,
which keeps working): exact through DataLoader workers, a rewritten object
refused, globs. Every test runs on both clients (``DISTSHARD_S3_CLIENT``: the
direct one of ``sources/transport/s3direct.py`` and s3fs), but those about s3fs's
sessions."""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

import distshard  # noqa: E402
from distshard.sources import ReadOptions  # noqa: E402
from tests.helpers import wait_child  # noqa: E402
from tests.s3_fixtures import BUCKET, Requests, bucket, endpoint, key_of, loader_keys, no_real_aws, upload  # noqa: E402,F401
from tests.s3_fixtures import s3_client as s3_client  # noqa: E402,F401  (autouse)
from tests.source_factories import isolated_cache as cache  # noqa: E402,F401  (autouse)
from tests.source_factories import write_jsonl, write_keyed_parquet, write_shards  # noqa: E402

S3FS_ONLY = {  # about aiobotocore's sessions, which the direct client does not have
    "test_a_process_makes_one_session_and_fork_workers_reuse_the_ranks",
    "test_a_remote_source_starts_its_client_in_the_background_and_a_fork_waits_for_it",
    "test_an_inherited_session_gets_fresh_credential_locks",
}


def pytest_generate_tests(metafunc):
    if "s3_client" in metafunc.fixturenames:
        kinds = ["s3fs"] if metafunc.function.__name__ in S3FS_ONLY else ["direct", "s3fs"]
        metafunc.parametrize("s3_client", kinds, indirect=True)


@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffle"])
def test_webdataset_on_s3_through_fork_workers_is_exact(tmp_path, bucket, endpoint, shuffle):
    paths, expected = write_shards(tmp_path, shards=4, per_shard=12)
    urls = upload(bucket, paths, "train")
    options = {"endpoint_url": endpoint}
    source = distshard.webdataset(f"s3://{BUCKET}/train/shard-*.tar", storage_options=options)
    assert source.urls == urls  # a glob through s3fs
    keyed = [f"{urls[paths.index(s['__url__'])]}#{s['__key__']}" for s in expected]
    got = [
        key
        for rank in range(2)
        for key in loader_keys(source.dist_shard(rank=rank, world_size=2, shuffle=shuffle).map(key_of))
    ]
    assert Counter(got) == Counter(keyed)


def test_jsonl_and_parquet_on_s3_and_the_environment_keeps_working(tmp_path, bucket, endpoint, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    paths, expected = write_jsonl(tmp_path / "j", files=2, lines=15)
    urls = upload(bucket, paths, "text")
    options = {"endpoint_url": endpoint}
    source = distshard.jsonl(urls, storage_options=options)
    assert sorted(map(json.dumps, (x for r in range(3) for x in source.dist_shard(rank=r, world_size=3)))) == sorted(
        map(json.dumps, expected)
    )
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"i": list(range(50))}), table, row_group_size=8)
    [purl] = upload(bucket, [str(table)], "tables")
    rows = distshard.parquet(purl, storage_options=options).dist_shard(shuffle=True)
    assert sorted(row["i"] for row in rows) == list(range(50))
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)  # no storage_options: fsspec's own configuration
    assert [x for x in distshard.jsonl(urls)] == expected


def test_an_object_rewritten_during_the_epoch_raises(tmp_path, bucket, endpoint):
    paths, _ = write_jsonl(tmp_path / "j", files=1, lines=80)
    [url] = upload(bucket, paths, "changing")
    small = ReadOptions(budget=1024, max_range=512, max_gap=0, window=1024)
    it = iter(distshard.jsonl(url, storage_options={"endpoint_url": endpoint}, read_options=small).dist_shard())
    for _ in range(3):
        next(it)
    data = Path(paths[0]).read_bytes().replace(b'"f": 0', b'"f": 7')
    bucket.put_object(Bucket=BUCKET, Key="changing/part-000.jsonl", Body=data)  # same size, new ETag
    with pytest.raises(ValueError, match="changed after it was indexed"):
        for _ in it:
            pass


def test_a_missing_object_is_named(bucket, endpoint):
    with pytest.raises(FileNotFoundError, match="nothing.tar"):
        distshard.webdataset(f"s3://{BUCKET}/nothing.tar", storage_options={"endpoint_url": endpoint}).counts()


def test_the_first_request_is_timed_whatever_its_answer(tmp_path, bucket, endpoint, monkeypatch, caplog):
    """Issue 28 (5), on both clients: without a stored index the look for its
    manifest (NoSuchKey) is the first request, and the one timed (here every first
    request counts as slow), named with its answer, once."""
    from distshard.sources.transport import responses as answers

    paths, expected = write_jsonl(tmp_path / "j", files=1, lines=4)
    [url] = upload(bucket, paths, "first")
    monkeypatch.setattr(answers, "SLOW_FIRST_REQUEST", 0.0)
    caplog.set_level(logging.WARNING, logger="distshard")
    assert list(distshard.jsonl(url, storage_options={"endpoint_url": endpoint}).dist_shard()) == expected
    first = [m for m in caplog.messages if "first request" in m]
    assert len(first) == 1, first
    assert f"s3://{BUCKET}/first/.distshard/manifest.json the whole file" in first[0], first
    assert "no such file" in first[0], first


def test_the_index_command_names_a_missing_bucket_and_could_not_run(tmp_path, bucket, endpoint, capsys):
    """Issue 28 (8), on both clients: a bucket that does not exist is named as such
    (not "no such file"), and the command could not run (2), before any file is
    read when its files, its glob or its --out are in that bucket."""
    from distshard.__main__ import main

    paths, _ = write_jsonl(tmp_path / "j", files=1, lines=3)
    [url] = upload(bucket, paths, "there")
    options = json.dumps({"endpoint_url": endpoint})
    gone = "s3://no-such-bucket/t"
    for args in (
        [f"{gone}/part-{{0..2}}.jsonl"],  # the look for an index beside them
        [f"{gone}/part-*.jsonl"],  # the listing
        [f"{gone}/part-{{0..2}}.jsonl", "--out", str(tmp_path / "index")],  # the files themselves
        [url, "--out", f"{gone}/index"],  # where it would be written
    ):
        assert main(["index", *args, "--storage-options", options]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("could not run: s3://no-such-bucket/") and err.count("\n") == 1, err
        assert "no such bucket 'no-such-bucket'" in err and "no such file" not in err, err
        assert "others" not in err
    assert not (tmp_path / "index").exists()


def test_a_stored_index_on_s3_starts_with_no_head_and_reads_only_its_entries(tmp_path, bucket, endpoint, monkeypatch):
    """Issue 22: 64 shards indexed once with the command (one GET a shard, the index
    stored in the bucket beside them: one pack of entries and the manifest); a job on
    a fresh machine asks no HEAD, at most 4 requests before its first sample, and
    fetches the entries of the files it reads in one range of the pack."""
    from distshard.__main__ import main
    from distshard.sources.transport.lru import clear_all

    paths, expected = write_shards(tmp_path, shards=64, per_shard=2)
    upload(bucket, paths, "many")
    options = {"endpoint_url": endpoint}
    pattern = f"s3://{BUCKET}/many/shard-{{000000..000063}}.tar"
    counted = Requests()
    werkzeug = logging.getLogger("werkzeug")
    werkzeug.addHandler(counted)
    werkzeug.setLevel(logging.INFO)
    try:
        assert main(["index", pattern, "--storage-options", json.dumps(options)]) == 0
        # one GET a shard; the look for an earlier manifest, the pack and the manifest written
        assert counted.kinds() == {"data": 64, "manifest": 1, "PUT": 2}, counted.kinds()
        counted.lines.clear()
        assert main(["index", pattern, "--storage-options", json.dumps(options)]) == 0  # nothing changed
        # (issue 33: the unchanged files are checked by one listing of their folder, not a HEAD each)
        assert counted.kinds() == {"listing": 1, "manifest": 1, "PUT": 1}, counted.kinds()
    finally:
        werkzeug.removeHandler(counted)
        werkzeug.setLevel(logging.ERROR)
    keys = {o["Key"] for o in bucket.list_objects_v2(Bucket=BUCKET)["Contents"]}
    assert "many/.distshard/manifest.json" in keys and sum(k.endswith(".pack") for k in keys) == 1
    monkeypatch.setenv("DISTSHARD_CACHE", str(tmp_path / "fresh"))
    clear_all()
    counted = Requests()
    werkzeug.addHandler(counted)
    werkzeug.setLevel(logging.INFO)
    small = ReadOptions(budget=2 << 10, max_range=2 << 10, max_gap=512, window=1 << 10)
    try:
        it = iter(
            distshard.webdataset(pattern, storage_options=options, read_options=small).dist_shard(rank=0, world_size=2)
        )
        got = [next(it)]
        before_first = counted.kinds()
        got.extend(it)
        rank0 = counted.kinds()
    finally:
        werkzeug.removeHandler(counted)
        werkzeug.setLevel(logging.ERROR)
    assert before_first["HEAD"] == 0 and before_first["manifest"] == 1 and sum(before_first.values()) <= 4, before_first
    files = {s["__url__"] for s in got}
    assert before_first["data"] >= 1 and rank0["data"] >= len(files)
    assert rank0["HEAD"] == 0 and rank0["manifest"] == 1 and rank0["entry"] == 1 and len(files) < 64, rank0
    rest = list(distshard.webdataset(pattern, storage_options=options).dist_shard(rank=1, world_size=2))
    assert Counter(f"{s['__url__'].rsplit('/', 1)[-1]}#{s['__key__']}" for s in got + rest) == Counter(
        f"{Path(s['__url__']).name}#{s['__key__']}" for s in expected
    )


def test_a_refresh_on_s3_lists_each_folder_instead_of_a_head_per_file(tmp_path, bucket, endpoint, monkeypatch):
    """Issue 33: ``python -m distshard index <stored index>`` on S3 checks the files an
    earlier build listed by the listing of their folder (ListObjectsV2: 1,000 objects
    with sizes and ETags a request): no HEAD. A rewritten object is indexed again, a
    deleted one is named; a store that refuses the listing gets a HEAD a file instead."""
    from distshard.__main__ import main
    from distshard.errors import DistshardError
    from distshard.sources.stored import indexing
    from distshard.sources.stored.manifest import listing
    from distshard.sources.transport.files import FileAccess

    paths, _ = write_shards(tmp_path / "a", shards=6, per_shard=2)
    urls = upload(bucket, paths, "two/a") + upload(
        bucket, write_shards(tmp_path / "b", shards=3, per_shard=1)[0], "two/b"
    )
    options = json.dumps({"endpoint_url": endpoint})
    location = f"s3://{BUCKET}/two/.distshard"
    assert main(["index", *urls, "--out", location, "--storage-options", options]) == 0
    (_, kinds) = _counted(lambda: main(["index", location, "--storage-options", options]))
    assert kinds == {"listing": 2, "manifest": 1, "PUT": 1}, kinds  # one listing per folder, no HEAD

    bucket.put_object(Bucket=BUCKET, Key="two/a/shard-000001.tar", Body=Path(paths[0]).read_bytes())  # rewritten
    (_, kinds) = _counted(lambda: main(["index", location, "--storage-options", options]))
    assert kinds == {"listing": 2, "data": 1, "manifest": 1, "PUT": 2}, kinds  # the rewritten one read again
    stored = listing(location, FileAccess(storage_options={"endpoint_url": endpoint}))  # (every file, any version)
    rewritten = next(f for f in stored["files"] if f["url"].endswith("a/shard-000001.tar"))
    assert rewritten["count"] == 2 and rewritten["size"] == Path(paths[0]).stat().st_size

    bucket.delete_object(Bucket=BUCKET, Key="two/a/shard-000004.tar")
    with pytest.raises(DistshardError, match="shard-000004.tar"):
        indexing.build_stored_index([location], storage_options={"endpoint_url": endpoint})

    def refused(*args, **kwargs):
        raise PermissionError("AccessDenied: s3:ListBucket")

    bucket.put_object(Bucket=BUCKET, Key="two/a/shard-000004.tar", Body=Path(paths[4]).read_bytes())
    monkeypatch.setattr(indexing, "confirm", refused)
    (_, kinds) = _counted(lambda: main(["index", location, "--storage-options", options]))
    assert kinds == {"HEAD": 9, "manifest": 1, "PUT": 1}, kinds  # (shard-000004 is the version indexed)


def _tables(bucket, tmp_path: Path, prefix: str, files: int, columns: int = 1, rows: int = 30) -> list[str]:
    """``files`` Parquet objects whose rows are distinct (``f<file>-<row>`` in column ``k``)."""
    pytest.importorskip("pyarrow")
    paths = write_keyed_parquet(tmp_path / prefix, files, rows=rows, columns=columns, row_group_size=7)
    return upload(bucket, [str(p) for p in paths], prefix)


def _counted(run):
    """What ``run()`` returns and the requests moto saw meanwhile, by kind."""
    counted = Requests()
    werkzeug = logging.getLogger("werkzeug")
    werkzeug.addHandler(counted)
    werkzeug.setLevel(logging.INFO)
    try:
        return run(), counted.kinds()
    finally:
        werkzeug.removeHandler(counted)
        werkzeug.setLevel(logging.ERROR)


def test_a_cold_parquet_job_on_s3_asks_one_request_per_object(tmp_path, bucket, endpoint):
    """Issue 22 item 3: each object's identity (ETag, the size from Content-Range)
    and footer come from one suffix GET: N objects, N requests before the first
    row (not a HEAD and a range each); a footer longer than the suffix costs one
    range more; the rows exact."""
    urls = _tables(bucket, tmp_path, "cold", files=4)
    [wide] = _tables(bucket, tmp_path, "wide", files=1, columns=300, rows=14)
    options = {"endpoint_url": endpoint}
    source = distshard.parquet(urls, storage_options=options)
    counts, kinds = _counted(source.counts)
    assert counts == [30] * 4
    assert kinds == {"data": 4, "manifest": 1}, kinds  # (the look for a stored index beside them)
    got = Counter(row["k"] for r in range(2) for row in source.dist_shard(rank=r, world_size=2))
    assert got == Counter(f"f{f}-{i}" for f in range(4) for i in range(30))
    counts, kinds = _counted(distshard.parquet(wide, ["k"], storage_options=options).counts)
    assert counts == [14] and kinds == {"data": 2, "manifest": 1}, kinds
    rows = distshard.parquet(wide, ["k"], storage_options=options).dist_shard(rank=0, world_size=1)
    assert Counter(row["k"] for row in rows) == Counter(f"f0-{i}" for i in range(14))


def test_a_parquet_object_rewritten_after_its_suffix_get_is_refused(tmp_path, bucket, endpoint):
    """The range after the suffix GET (a footer longer than it) is checked against
    the suffix answer's ETag: an object rewritten in between raises naming it."""
    from distshard.sources.formats.parquet import ParquetFormat
    from distshard.sources.transport.files import FileAccess, FileRef

    [wide] = _tables(bucket, tmp_path, "rewritten", files=1, columns=300, rows=14)
    fmt, access = ParquetFormat(), FileAccess(storage_options={"endpoint_url": endpoint})
    ref = FileRef(wide, *fmt.identity(wide, access))
    key = wide.split(f"s3://{BUCKET}/", 1)[1]
    body = bytearray(bucket.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    body[100] ^= 1
    bucket.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))  # the same size, a new ETag
    with pytest.raises(ValueError, match=f"{re.escape(wide)} changed after it was indexed"):
        fmt.build_index(ref, access)


def test_a_parquet_job_on_s3_is_exact_through_faults(tmp_path, bucket, endpoint):
    """503 SlowDown, resets and cut bodies every third GET, suffix GETs included."""
    from tests.s3_proxy import S3Proxy

    urls = _tables(bucket, tmp_path, "faulty", files=5)
    proxy = S3Proxy(endpoint, fault_every=3).start()
    try:
        source = distshard.parquet(
            urls, storage_options={"endpoint_url": proxy.endpoint}, read_options=ReadOptions(retry_seconds=30)
        )
        got = Counter(row["k"] for r in range(2) for row in source.dist_shard(rank=r, world_size=2))
    finally:
        proxy.stop()
    assert got == Counter(f"f{f}-{i}" for f in range(5) for i in range(30))
    assert proxy.faulted and proxy.requests["HEAD"] == 0, (proxy.faulted, proxy.requests)


_MADE: Counter = Counter()  # what this process made; a forked worker starts from its parent's counts


def _counting(monkeypatch, cls, name: str, what: str) -> None:
    real = getattr(cls, name)

    def counted(*args, **kwargs):
        _MADE[what] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(cls, name, counted)


def _with_counts(sample: dict) -> tuple[str, int, tuple[int, int, int]]:
    import os

    return key_of(sample), os.getpid(), (_MADE["sessions"], _MADE["credentials"], _MADE["model files"])


def test_a_process_makes_one_session_and_fork_workers_reuse_the_ranks(tmp_path, bucket, endpoint, monkeypatch):
    """Issue 22 item 3: the aiobotocore session (credentials resolved, service model
    parsed) is made once per process, and a forked DataLoader worker builds its own
    client from its rank's instead of resolving again; exact all the same."""
    import aiobotocore.credentials
    import aiobotocore.session
    import botocore.loaders
    from torch.utils.data import DataLoader

    from distshard.sources.transport import clients

    _counting(monkeypatch, aiobotocore.session.AioSession, "__init__", "sessions")
    _counting(monkeypatch, aiobotocore.credentials.AioCredentialResolver, "load_credentials", "credentials")
    _counting(monkeypatch, botocore.loaders.JSONFileLoader, "load_file", "model files")
    _MADE.clear()
    clients.forget_clients()  # this process's first client from here on
    paths, expected = write_shards(tmp_path, shards=6, per_shard=5)
    urls = upload(bucket, paths, "reuse")
    keyed = [f"{urls[paths.index(s['__url__'])]}#{s['__key__']}" for s in expected]
    source = distshard.webdataset(urls, storage_options={"endpoint_url": endpoint})
    assert Counter(map(key_of, source.dist_shard(rank=0, world_size=1))) == Counter(keyed)  # every file, here
    assert _MADE["sessions"] == 1 and _MADE["credentials"] == 1, _MADE  # once in this process
    rank = (_MADE["sessions"], _MADE["credentials"], _MADE["model files"])
    loader = DataLoader(
        source.dist_shard(rank=0, world_size=1).map(_with_counts),
        batch_size=None,
        num_workers=2,
        multiprocessing_context="fork",
        timeout=60,
    )
    got = list(loader)
    by_pid = {pid: tuple(counts) for _, pid, counts in got}
    assert len(by_pid) == 2 and all(counts == rank for counts in by_pid.values()), (rank, by_pid)
    assert Counter(k for k, _, _ in got) == Counter(keyed)


def test_a_remote_source_starts_its_client_in_the_background_and_a_fork_waits_for_it(
    tmp_path, bucket, endpoint, monkeypatch
):
    """Built outside a process group, a source begins its client (imports, session,
    credentials) in a thread at once; its first request reuses it (one session in
    the process), and a fork made meanwhile waits for that thread."""
    import os

    import aiobotocore.session
    from torch.utils.data import DataLoader

    from distshard.sources.transport import clients

    _counting(monkeypatch, aiobotocore.session.AioSession, "__init__", "sessions")
    _MADE.clear()
    clients.forget_clients()
    paths, expected = write_shards(tmp_path, shards=3, per_shard=4)
    urls = upload(bucket, paths, "warm")
    source = distshard.webdataset(urls, storage_options={"endpoint_url": endpoint})
    pid = os.fork()  # at once: the thread may still be importing or making the session
    if pid == 0:  # the child: nothing half done inherited, so it reads on its own
        code = 1
        try:
            code = 0 if len(list(source)) == len(expected) else 2
        finally:
            os._exit(code)
    assert wait_child(pid, 60, "it waits for the warming thread its parent ran") == 0
    assert not any(t.is_alive() for t in clients._WARMING.values())  # the fork waited for it
    assert _MADE["sessions"] == 1, _MADE
    keyed = [f"{urls[paths.index(s['__url__'])]}#{s['__key__']}" for s in expected]
    loader = DataLoader(source.dist_shard().map(key_of), batch_size=None, num_workers=2, multiprocessing_context="fork")
    assert Counter(loader) == Counter(keyed)
    assert _MADE["sessions"] == 1, _MADE  # still the one made in the background


def test_an_inherited_session_gets_fresh_credential_locks():
    """Refreshable credentials hold an asyncio.Lock that the parent may hold or have
    bound to its event loop at the fork: a child's client gets a new one."""
    import asyncio

    from aiobotocore.credentials import AioRefreshableCredentials

    from distshard.sources.transport import remote

    async def refresh():
        return {"access_key": "a", "secret_key": "b", "token": None, "expiry_time": "2100-01-01T00:00:00Z"}

    credentials = AioRefreshableCredentials.create_from_metadata(
        {"access_key": "a", "secret_key": "b", "token": None, "expiry_time": "2100-01-01T00:00:00Z"}, refresh, "test"
    )
    held = credentials._refresh_lock
    asyncio.run(held.acquire())  # held by the parent at the fork

    class Session:
        _credentials = credentials

    remote._fresh_locks(Session())
    assert credentials._refresh_lock is not held and not credentials._refresh_lock.locked()
