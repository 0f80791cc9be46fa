"""``python -m distshard index --prune``: the packs of entries no manifest names any more,
older than the grace period, are deleted; the packs the new manifest names (whatever
their age) and unnamed young ones stay; a job reading the new manifest is exact and
finds every entry it needs. On a local folder (ages set with ``os.utime``) and on S3
(moto's server on 127.0.0.1; ages from the store's own ``LastModified``)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from collections import Counter
from pathlib import Path

import pytest

import distshard
from distshard.__main__ import main
from distshard.sources.stored import pruning
from tests.source_factories import fresh_machine, write_jsonl
from tests.source_factories import isolated_cache as cache  # noqa: F401  (autouse)

HOUR = 3600


def write_part(folder: Path, name: str, version: int) -> list[dict]:
    """A JSON-lines file whose lines (and size) change with ``version``."""
    lines = [{"file": name, "version": version, "i": i} for i in range(5 + version)]
    (folder / name).write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return lines


def packs_in(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("entries-*.pack")}


def read_all(source) -> list[str]:
    """Every line of ``source`` over 2 ranks, as JSON."""
    return [json.dumps(x, sort_keys=True) for rank in range(2) for x in source.dist_shard(rank=rank, world_size=2)]


def expected_lines(*parts: list[dict]) -> Counter:
    return Counter(json.dumps(x, sort_keys=True) for part in parts for x in part)


def test_prune_on_a_local_folder_keeps_named_and_young_packs(tmp_path, monkeypatch, capsys, caplog):
    data = tmp_path / "data"
    data.mkdir()
    index = data / ".distshard"
    pattern = str(data / "part-*.jsonl")
    a, b = write_part(data, "part-a.jsonl", 0), write_part(data, "part-b.jsonl", 0)
    write_part(data, "part-c.jsonl", 0)
    assert main(["index", pattern]) == 0
    first = packs_in(index)  # a, b and c; a and b stay in it throughout
    write_part(data, "part-c.jsonl", 1)
    assert main(["index", pattern]) == 0
    second = packs_in(index) - first  # c again: named until c changes once more
    write_part(data, "part-c.jsonl", 2)
    assert main(["index", pattern]) == 0
    third = packs_in(index) - first - second  # c's third version: young when pruned
    assert len(first) == len(second) == len(third) == 1
    old = time.time() - 2 * HOUR
    for name in first | second:
        os.utime(index / name, (old, old))
    c = write_part(data, "part-c.jsonl", 3)
    capsys.readouterr()
    assert main(["index", pattern, "--prune"]) == 0
    fourth = packs_in(index) - first - second - third
    # named (however old), unnamed but younger than an hour, and the new one; the old unnamed one is gone
    assert packs_in(index) == first | third | fourth and len(fourth) == 1
    assert "1 stale packs deleted, 1 younger than 3600 s kept" in capsys.readouterr().out
    fresh_machine(monkeypatch, tmp_path, "job")
    caplog.set_level(logging.INFO, logger="distshard")
    source = distshard.jsonl(pattern)
    assert Counter(read_all(source)) == expected_lines(a, b, c)
    assert source._stored is not None and source._indexed_here == 0
    assert "is not there" not in caplog.text  # every entry came from a pack the manifest names
    # a grace of 0 deletes the young unnamed pack too, and nothing the manifest names
    assert main(["index", pattern, "--prune", "--prune-after", "0"]) == 0
    assert packs_in(index) == first | fourth


def test_prune_after_alone_or_negative_is_refused_before_anything_is_built(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    write_part(data, "part-a.jsonl", 0)
    assert main(["index", str(data / "part-a.jsonl"), "--prune-after", "10"]) == 2
    assert "--prune-after is the grace period of --prune: add --prune" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["index", str(data / "part-a.jsonl"), "--prune", "--prune-after", "-1"])
    from distshard.sources.stored.indexing import build_stored_index

    with pytest.raises(ValueError, match=r"prune_after=-1"):
        build_stored_index([str(data / "part-a.jsonl")], prune_after=-1)
    with pytest.raises(TypeError, match=r"prune_after='1'"):
        build_stored_index([str(data / "part-a.jsonl")], prune_after="1")
    assert not (data / ".distshard").exists()


def test_prune_deletes_the_columns_and_pages_of_version_3_manifests_no_manifest_names(tmp_path, monkeypatch):
    """Every manifest written names its own columns and pages (not inline here: small pages,
    no inlining); those of an earlier one, older than the grace period, go with --prune."""
    from distshard.sources.stored import manifest3

    monkeypatch.setattr(manifest3, "PAGE_SIZE", 4)
    monkeypatch.setattr(manifest3, "INLINE_BYTES", 0)
    paths, expected = write_jsonl(tmp_path / "j", files=6, lines=2)
    folder = tmp_path / "j" / ".distshard"
    pattern = str(tmp_path / "j" / "part-*.jsonl")
    assert main(["index", pattern]) == 0
    first = {p.name for p in folder.glob("[cp]*-*.bin")}
    assert len(first) == 2
    Path(paths[2]).write_text('{"f": 2, "i": 0, "text": "again"}\n', encoding="utf-8")
    old = time.time() - 7200
    for name in first:
        os.utime(folder / name, (old, old))
    assert main(["index", pattern, "--prune"]) == 0
    now = {p.name for p in folder.glob("[cp]*-*.bin")}
    assert len(now) == 2 and not now & first  # the earlier manifest's objects are gone, the new one's kept
    head = json.loads((folder / "manifest.json").read_text())
    assert {head["columns"]["object"], head["pages"]["object"]} == now
    now_expected = [v for v in expected if v["f"] != 2] + [{"f": 2, "i": 0, "text": "again"}]
    assert Counter(map(json.dumps, distshard.jsonl(pattern).dist_shard())) == Counter(map(json.dumps, now_expected))


# -- S3 (moto) -------------------------------------------------------------------------------------

S3 = all(importlib.util.find_spec(name) is not None for name in ("s3fs", "moto", "boto3"))
if S3:
    from tests.test_sources_s3 import BUCKET, bucket, endpoint, no_real_aws  # noqa: F401  (fixtures)


@pytest.mark.skipif(not S3, reason="needs s3fs and moto")
def test_prune_on_s3_keeps_named_and_young_packs(tmp_path, bucket, endpoint, monkeypatch, caplog):  # noqa: F811
    options = json.dumps({"endpoint_url": endpoint})
    local = tmp_path / "parts"
    local.mkdir()
    prefix = "text"

    def upload(name: str, version: int) -> list[dict]:
        lines = write_part(local, name, version)
        bucket.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=(local / name).read_bytes())
        return lines

    def packs() -> dict[str, float]:
        listed = bucket.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/.distshard/").get("Contents", [])
        return {
            o["Key"].rsplit("/", 1)[-1]: o["LastModified"].timestamp()
            for o in listed
            if o["Key"].rsplit("/", 1)[-1].startswith("entries-")
        }

    pattern = f"s3://{BUCKET}/{prefix}/part-*.jsonl"
    a, b = upload("part-a.jsonl", 0), upload("part-b.jsonl", 0)
    upload("part-c.jsonl", 0)
    assert main(["index", pattern, "--storage-options", options]) == 0
    first = set(packs())
    upload("part-c.jsonl", 1)
    assert main(["index", pattern, "--storage-options", options]) == 0
    second = set(packs()) - first
    time.sleep(2.1)  # the store's LastModified counts seconds: the third pack is younger by 2 at least
    upload("part-c.jsonl", 2)
    assert main(["index", pattern, "--storage-options", options]) == 0
    third = set(packs()) - first - second
    assert len(first) == len(second) == len(third) == 1
    # the ages are measured at a clock pinned half a second after the third pack was written
    young = packs()[next(iter(third))]
    monkeypatch.setattr(pruning, "_now", lambda: young + 0.5)
    c = upload("part-c.jsonl", 3)
    assert main(["index", pattern, "--storage-options", options, "--prune", "--prune-after", "1"]) == 0
    fourth = set(packs()) - first - second - third
    assert set(packs()) == first | third | fourth and len(fourth) == 1
    fresh_machine(monkeypatch, tmp_path, "job")
    caplog.set_level(logging.INFO, logger="distshard")
    source = distshard.jsonl(pattern, storage_options={"endpoint_url": endpoint})
    assert Counter(read_all(source)) == expected_lines(a, b, c)
    assert source._stored is not None and source._indexed_here == 0
    assert "is not there" not in caplog.text
