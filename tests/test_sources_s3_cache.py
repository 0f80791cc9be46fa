"""The local range cache over a stored index on S3 (issue 28, item 1), through both
clients against moto's server: a job whose cache holds every byte confirms the
manifest's identities with one listing per folder (made by the rank before its
DataLoader workers start, never a HEAD per object), and an object rewritten or
deleted since the index was written is refused, not served from the cache."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

import distshard  # noqa: E402
from distshard.__main__ import main  # noqa: E402
from distshard.sources import ReadOptions  # noqa: E402
from tests.s3_fixtures import BUCKET, Requests, bucket, endpoint, no_real_aws, upload  # noqa: E402,F401
from tests.s3_fixtures import s3_client as s3_client  # noqa: E402,F401  (autouse)
from tests.source_factories import (
    fresh_machine,  # noqa: E402
    write_shards,  # noqa: E402
)


def pytest_generate_tests(metafunc):
    if "s3_client" in metafunc.fixturenames:
        metafunc.parametrize("s3_client", ["direct", "s3fs"], indirect=True)


class Counted(Requests):
    """moto's requests by kind, a listing (``?list-type=2``) a kind of its own
    (``Requests`` counts it so)."""


def counting() -> Counted:
    counted = Counted()
    werkzeug = logging.getLogger("werkzeug")
    werkzeug.addHandler(counted)
    werkzeug.setLevel(logging.INFO)
    return counted


def stop_counting(counted: Counted) -> None:
    werkzeug = logging.getLogger("werkzeug")
    werkzeug.removeHandler(counted)
    werkzeug.setLevel(logging.ERROR)


def keys(samples) -> Counter:
    return Counter(f"{s['__url__'].rsplit('/', 1)[-1]}#{s['__key__']}" for s in samples)


def test_a_stale_stored_index_on_s3_is_refused_though_the_cache_holds_its_bytes(
    tmp_path, bucket, endpoint, monkeypatch
):
    from torch.utils.data import DataLoader

    paths, expected = write_shards(tmp_path / "data", shards=4, per_shard=3)
    upload(bucket, paths, "c")
    options = {"endpoint_url": endpoint}
    pattern = f"s3://{BUCKET}/c/shard-{{000000..000003}}.tar"
    assert main(["index", pattern, "--storage-options", json.dumps(options)]) == 0
    read = ReadOptions(window=16 << 10, max_gap=4 << 10, max_range=64 << 10, cache_dir=str(tmp_path / "ranges"))

    def job(name: str, workers: int = 0):
        fresh_machine(monkeypatch, tmp_path, name)
        pipe = distshard.webdataset(pattern, storage_options=options, read_options=read).dist_shard()
        if not workers:
            return pipe
        return DataLoader(pipe, batch_size=None, num_workers=workers, multiprocessing_context="fork", timeout=60)

    want = keys({**s, "__url__": Path(s["__url__"]).name} for s in expected)
    assert keys(job("job1")) == want
    counted = counting()
    try:
        it = iter(job("job2", workers=2))
        got = [next(it)]
        before_first = counted.kinds()
        got.extend(it)
        everything = counted.kinds()
    finally:
        stop_counting(counted)
    assert keys(got) == want
    # the manifest, one listing (the rank's, before its workers start), the entries; the data from the cache
    assert before_first["listing"] == 1 and before_first.get("HEAD", 0) == 0, before_first
    assert sum(before_first.values()) <= 4, before_first
    assert everything == {"manifest": 1, "listing": 1, "entry": everything["entry"]}, everything

    data = bytearray(Path(paths[2]).read_bytes())
    data[700] ^= 1  # same size, another MD5: a new ETag
    bucket.put_object(Bucket=BUCKET, Key="c/shard-000002.tar", Body=bytes(data))
    got = []
    with pytest.raises(
        ValueError, match=r"shard-000002\.tar changed after the stored index.*python -m distshard index"
    ):
        got.extend(job("job3"))
    assert {s["__url__"].rsplit("/", 1)[-1] for s in got} <= {"shard-000000.tar", "shard-000001.tar"}

    bucket.put_object(Bucket=BUCKET, Key="c/shard-000002.tar", Body=Path(paths[2]).read_bytes())  # its ETag again
    assert keys(job("job3b")) == want
    bucket.delete_object(Bucket=BUCKET, Key="c/shard-000001.tar")
    with pytest.raises(FileNotFoundError, match=r"shard-000001\.tar.*python -m distshard index"):
        list(job("job4", workers=2))


def test_a_dataset_copied_with_its_stored_index_keeps_its_entries(tmp_path, bucket, endpoint, monkeypatch):
    """Issue 28, item 6: data and ``.distshard/`` copied to another prefix (the same
    ETags: S3's MD5 of the bytes): the entries are matched by size and ETag, no file
    is indexed by the job, and ``describe()`` says where the index was written for."""
    from distshard.sources.formats.tar import TarFormat

    paths, expected = write_shards(tmp_path / "data", shards=3, per_shard=2)
    upload(bucket, paths, "a")
    options = {"endpoint_url": endpoint}
    assert main(["index", f"s3://{BUCKET}/a/shard-*.tar", "--storage-options", json.dumps(options)]) == 0
    for item in bucket.list_objects_v2(Bucket=BUCKET, Prefix="a/")["Contents"]:
        bucket.copy_object(Bucket=BUCKET, Key="b/" + item["Key"][2:], CopySource={"Bucket": BUCKET, "Key": item["Key"]})
    built = []
    real = TarFormat.build_index
    monkeypatch.setattr(TarFormat, "build_index", lambda self, ref, *a: built.append(ref.url) or real(self, ref, *a))
    fresh_machine(monkeypatch, tmp_path, "node")
    source = distshard.webdataset(f"s3://{BUCKET}/b/shard-*.tar", storage_options=options)
    assert keys(source.dist_shard(shuffle=True)) == keys({**s, "__url__": Path(s["__url__"]).name} for s in expected)
    assert built == [] and source._indexed_here == 0
    assert f"index stored at s3://{BUCKET}/b/.distshard (written for s3://{BUCKET}/a: its entries matched" in (
        source.describe()
    )
