"""The stored index (issue 22): ``python -m distshard index`` writes per-file
entries and a manifest beside the data; a source finds it by itself and starts
with no metadata request per file, fetching only the entries of the files it
reads; a stale or missing file raises naming it (and the refresh command);
DataLoader workers reuse what the rank learnt; logging. Against the loopback
HTTP range server (requests counted by kind) and local files."""

from __future__ import annotations

import json
import logging
import os
from collections import Counter

import pytest

import distshard
from distshard.__main__ import main
from distshard.sources import ReadOptions, jsonl, webdataset
from distshard.sources.stored.manifest import listing
from tests.range_server import serve
from tests.range_server import served as server  # noqa: F401  (a fixture)
from tests.source_factories import fresh_machine, write_jsonl, write_shards
from tests.source_factories import isolated_cache as cache  # noqa: F401  (autouse)
from tests.stored_factories import SHARDS, indexed, key, requests_by_kind

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

# a budget of about one shard: what the read-ahead plans before the first sample
# stays within a file or two whatever its ramp (requests before the first sample)
SMALL = ReadOptions(budget=4 << 10, max_range=4 << 10, max_gap=1 << 10, window=2 << 10)


def test_the_command_asks_one_request_per_file_and_packs_the_entries(tmp_path, server):
    paths, expected = write_shards(tmp_path / "data", shards=SHARDS, per_shard=3)
    pattern = server.url(paths[0]).rsplit("/", 1)[0] + f"/shard-{{000000..{SHARDS - 1:06d}}}.tar"
    server.reset_counters()
    assert main(["index", pattern, "--out", str(tmp_path / "data" / ".distshard"), "--workers", "8"]) == 0
    # one streamed GET a file, whole (no Range, no HEAD), nothing else
    assert requests_by_kind(server) == {"data": SHARDS}
    assert all(rng is None for _, _, rng in server.log)
    folder = sorted(os.listdir(tmp_path / "data" / ".distshard"))
    assert len(folder) == 2 and folder[0].startswith("entries-") and folder[0].endswith(".pack"), folder
    manifest = listing(str(tmp_path / "data" / ".distshard"))
    assert manifest["version"] == 3 and manifest["packs"] == [folder[0]]  # (small: its columns and pages inline)
    assert [f["url"] for f in manifest["files"]] == [server.url(p) for p in paths]  # (served, stored locally)
    at = [(f["at"], f["len"]) for f in manifest["files"]]  # in the files' order, one after the other
    assert at[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(at, at[1:], strict=False))
    assert sum(f["count"] for f in manifest["files"]) == len(expected)


def test_a_job_with_a_stored_index_asks_no_head_and_packed_entries_in_few_requests(tmp_path, server, monkeypatch):
    pattern, urls, expected = indexed(tmp_path, server)
    fresh_machine(monkeypatch, tmp_path, "node")
    server.reset_counters()
    source = webdataset(pattern)  # default options; no index=: found beside the shards
    pipe = source.dist_shard(rank=0, world_size=2)
    it = iter(pipe)
    got = [next(it)]
    before_first = requests_by_kind(server)
    assert before_first.get("HEAD", 0) == 0 and before_first["manifest"] == 1
    assert before_first == {"manifest": 1, "entry": 1, "data": 1}, before_first  # the manifest, the entries, a range
    got.extend(it)
    rank0 = requests_by_kind(server)
    files_read = {s["__url__"] for s in got}
    assert rank0.get("HEAD", 0) == 0 and rank0["manifest"] == 1
    assert rank0["entry"] == 1 and len(files_read) < SHARDS  # the entries of its files come in one range
    assert rank0["data"] <= 2 * len(files_read), rank0  # (the read-ahead ramps its ranges up)
    other = webdataset(pattern, read_options=SMALL).dist_shard(rank=1, world_size=2)
    got.extend(other)
    assert Counter(map(key, got)) == Counter(map(key, expected))
    assert "index stored at" in str(distshard.explain(pipe))


def pack_ranges(log) -> list[tuple[str, int, int]]:
    """``(pack, start, stop)`` of every range a range server's ``log`` holds of a pack."""
    out = []
    for method, path, rng in log:
        if method == "GET" and path.endswith(".pack"):
            start, last = rng.split("=")[1].split("-")
            out.append((path, int(start), int(last) + 1))
    return out


def chunks_of(sizes: list[int], limit: int) -> int:
    """How many ranges of at most ``limit`` bytes the entries of ``sizes`` (one after
    the other in a pack) take, a range closed when the next entry would pass it."""
    count, used = 0, limit
    for size in sizes:
        if used + size > limit:
            count, used = count + 1, 0
        used += size
    return count


def entries_in_few_ranges(tmp_path, server, monkeypatch) -> tuple[str, list[dict], int]:
    """SHARDS tars indexed, ``packs.RANGE_BYTES`` set to about 8 entries, a fresh machine:
    ``(pattern, expected samples, the ranges the entries take)``."""
    from distshard.sources.stored import entry_packs as packs

    pattern, urls, expected = indexed(tmp_path, server, shards=SHARDS, per_shard=3)
    sizes = [f["len"] for f in listing(str(tmp_path / "data" / ".distshard"))["files"]]
    monkeypatch.setattr(packs, "RANGE_BYTES", 8 * max(sizes))  # 8 entries a range at least
    fresh_machine(monkeypatch, tmp_path, "node")
    server.reset_counters()
    return pattern, expected, chunks_of(sizes, 8 * max(sizes))


def test_a_slot_fetches_the_entries_of_its_files_ahead_in_few_ranges(tmp_path, server, monkeypatch):
    """Entries bigger than one range, a shuffled slot over every file (its order's
    lookups, its read-ahead's entries asked ahead): each range of entries is asked
    once, so the slot asks exactly as many as the entries take (at most SHARDS // 8),
    whatever the order and the load, and no byte of the pack twice."""
    pattern, expected, ranges = entries_in_few_ranges(tmp_path, server, monkeypatch)
    got = list(webdataset(pattern, read_options=SMALL).dist_shard(shuffle=True))
    assert Counter(map(key, got)) == Counter(map(key, expected))
    kinds = requests_by_kind(server)
    assert kinds.get("HEAD", 0) == 0 and kinds["manifest"] == 1
    assert kinds["entry"] == ranges <= SHARDS // 8, (kinds, ranges)
    asked = sorted(pack_ranges(server.log))
    assert all(stop <= start for (_, _, stop), (_, start, _) in zip(asked, asked[1:], strict=False)), asked


@pytest.mark.parametrize("threads", [1, 8])
def test_lookups_in_any_order_and_at_once_ask_each_range_of_entries_once(tmp_path, monkeypatch, threads):
    """Whoever looks an entry up first (any file, any order, threads at once against a
    slow store), it comes with the same range of its neighbours, and a lookup of one on
    its way waits for it: the lookups of every file ask exactly the ranges the entries
    take, each once."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    with serve(tmp_path, latency=0.02) as slow:
        pattern, expected, ranges = entries_in_few_ranges(tmp_path, slow, monkeypatch)
        sequence = webdataset(pattern).__distshard_sequence__()
        slow.settle().reset_counters()
        order = list(range(SHARDS))
        random.Random(threads).shuffle(order)
        with ThreadPoolExecutor(threads) as pool:
            counts = [index.count for _, index in pool.map(sequence.file_index, order)]
        assert sum(counts) == len(expected)
        assert requests_by_kind(slow) == {"entry": ranges}
        asked = sorted(pack_ranges(slow.log))
        assert all(stop <= start for (_, _, stop), (_, start, _) in zip(asked, asked[1:], strict=False)), asked


@pytest.mark.parametrize("how", ["ahead", "first"])
def test_entries_whose_request_ahead_failed_are_asked_again_when_read(tmp_path, caplog, how):
    """A range of entries asked ahead (a slot's read-ahead, or the rank's before its
    workers start) that fails is not the lookup's error: the lookup asks it again
    (logged for the rank's), and gets the right bytes."""
    import time

    from distshard.sources.stored import entry_packs as packs
    from distshard.sources.transport.files import FileAccess

    pack = tmp_path / "entries.pack"
    pack.write_bytes(bytes(range(200)) * 3)
    access = FileAccess(ReadOptions(retries=0))
    with serve(tmp_path, fault_every=1, faults=("500",)) as failing:
        entries = [packs.pack_entry(failing.url(pack), start, start + 200) for start in (0, 200, 400)]
        chunks = packs.PackedEntries(entries)
        with caplog.at_level(logging.INFO, logger="distshard"):
            if how == "ahead":
                packs.fetch_ahead(entries[:1], chunks, access)
                end = time.monotonic() + 30
                while entries[0] in packs._PENDING and time.monotonic() < end:  # until its answer came
                    time.sleep(0.01)
            else:
                assert packs.fetch_first(entries[:1], chunks, access) == {}
                assert "were not fetched ahead" in caplog.text
        assert failing.settle().faulted["500"] == 1 and entries[0] not in packs._PENDING
        failing.fault_every = 0
        assert packs.fetch_packed(entries[2], chunks, access) == bytes(range(200))
        assert [rng for _, path, rng in failing.settle().log if path.endswith(".pack")] == ["bytes=0-599"] * 2


def test_a_file_changed_since_the_index_was_written_names_it_and_the_refresh(tmp_path, server, monkeypatch):
    pattern, urls, _ = indexed(tmp_path, server, shards=4, per_shard=5)
    changed = tmp_path / "data" / "shard-000002.tar"
    data = bytearray(changed.read_bytes())
    data[700] ^= 1
    changed.write_bytes(bytes(data))  # same size, new mtime: a new ETag
    os.utime(changed, ns=(changed.stat().st_atime_ns, changed.stat().st_mtime_ns + 10**9))
    fresh_machine(monkeypatch, tmp_path, "node")
    with pytest.raises(
        ValueError, match=r"shard-000002\.tar changed after the stored index.*python -m distshard index"
    ):
        list(webdataset(pattern).dist_shard())
    # the refresh command it names makes the source work again
    assert main(["index", pattern, "--out", str(tmp_path / "data" / ".distshard")]) == 0
    fresh_machine(monkeypatch, tmp_path, "node2")
    assert len(list(webdataset(pattern).dist_shard())) == sum(5 + s for s in range(4))


def test_a_file_missing_since_the_index_was_written_is_named(tmp_path, server, monkeypatch):
    pattern, urls, _ = indexed(tmp_path, server, shards=3, per_shard=4)
    (tmp_path / "data" / "shard-000001.tar").unlink()
    fresh_machine(monkeypatch, tmp_path, "node")
    with pytest.raises(FileNotFoundError, match=r"shard-000001\.tar"):
        list(webdataset(pattern).dist_shard())


def test_local_files_find_their_stored_index_and_refuse_a_stale_one(tmp_path, monkeypatch):
    paths, expected = write_jsonl(tmp_path / "j", files=3, lines=20)
    assert main(["index", str(tmp_path / "j" / "part-*.jsonl")]) == 0
    assert (tmp_path / "j" / ".distshard" / "manifest.json").exists()
    fresh_machine(monkeypatch, tmp_path, "node")
    source = jsonl(str(tmp_path / "j" / "part-*.jsonl"))
    assert sorted(map(json.dumps, source.dist_shard(shuffle=True))) == sorted(map(json.dumps, expected))
    assert source._stored is not None and source._indexed_here == 0
    # index= takes the folder: the files and their counts come from the manifest
    assert [x for x in jsonl(None, index=str(tmp_path / "j" / ".distshard")).dist_shard()] == expected
    os.utime(paths[1], ns=(0, 10**18))
    fresh_machine(monkeypatch, tmp_path, "node2")
    with pytest.raises(ValueError, match=r"part-001\.jsonl changed after the stored index.*python -m distshard index"):
        list(jsonl(str(tmp_path / "j" / "part-*.jsonl")).dist_shard())


def test_an_interrupted_build_goes_on_where_it_stopped(tmp_path, server, capsys, monkeypatch):
    from distshard.sources.stored import indexing
    from distshard.sources.stored.indexing import build_stored_index

    paths, _ = write_shards(tmp_path / "data", shards=6, per_shard=3)
    urls = [server.url(p) for p in paths]
    out = str(tmp_path / "data" / ".distshard")
    first = build_stored_index(urls[:4], out=out)
    assert first.built == 4
    server.reset_counters()
    second = build_stored_index(urls, out=out)  # the first four are listed and unchanged: only two read
    assert second.built == 2 and len(second.files) == 6
    assert requests_by_kind(server) == {"HEAD": 4, "data": 2}  # a look at each listed file, a GET for each new one
    manifest = listing(str(tmp_path / "data" / ".distshard"))
    assert manifest["format"] == "distshard-index" and manifest["version"] == 3
    assert [f["url"] for f in manifest["files"]] == urls  # (relative names only for files beside the folder)
    assert {"url", "format", "count", "size", "stamp", "pack", "at", "len"} <= set(manifest["files"][0])
    assert len(manifest["packs"]) == 2  # the first build's pack, kept, and the second's
    assert main(["index", urls[0], "--out", out]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""  # not a terminal: no progress line
    assert "6 files (0 indexed now)" in captured.out  # the earlier files stay listed

    # interrupted (Ctrl-C) after the third file: the packs written so far are listed, the rerun reads the rest
    paths, expected = write_shards(tmp_path / "more", shards=8, per_shard=2)
    urls = [server.url(p) for p in paths]
    out = str(tmp_path / "more" / ".distshard")
    real, seen = indexing._index_one, []

    def interrupted(url, *args):
        if len(seen) == 3:
            raise KeyboardInterrupt
        seen.append(url)
        return real(url, *args)

    monkeypatch.setattr(indexing, "FLUSH_SECONDS", 0.0)  # a pack (and the manifest) after every file
    monkeypatch.setattr(indexing, "MANIFEST_SHARE", float("inf"))
    monkeypatch.setattr(indexing, "_index_one", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_stored_index(urls, out=out, workers=1)
    listed = listing(str(tmp_path / "more" / ".distshard"))["files"]
    assert [f["url"] for f in listed] == urls[:3]
    monkeypatch.setattr(indexing, "_index_one", real)
    server.reset_counters()
    assert build_stored_index(urls, out=out).built == 5
    assert requests_by_kind(server) == {"HEAD": 3, "data": 5}
    assert Counter(map(key, webdataset(urls, index=out).dist_shard())) == Counter(map(key, expected))

    # manifests that may take no time at all (MANIFEST_SHARE 0): the first pack's, then only the last
    # (a long build's manifests grow with its files: not one at every pack); interrupted, the rerun
    # goes on from the first
    paths, expected = write_shards(tmp_path / "rare", shards=8, per_shard=2)
    urls = [server.url(p) for p in paths]
    out = str(tmp_path / "rare" / ".distshard")
    written: list[str] = []
    write = indexing.manifest.write

    def counted(url, data, access=None):
        if url.endswith("manifest.json"):
            written.append(url)
        return write(url, data, access) if access is not None else write(url, data)

    monkeypatch.setattr(indexing, "MANIFEST_SHARE", 0.0)
    monkeypatch.setattr(indexing.manifest, "write", counted)
    seen.clear()
    monkeypatch.setattr(indexing, "_index_one", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_stored_index(urls, out=out, workers=1)
    assert len(written) == 1 and [f["url"] for f in listing(out)["files"]] == urls[:1]
    monkeypatch.setattr(indexing, "_index_one", real)
    written.clear()
    assert build_stored_index(urls, out=out, workers=1).built == 7 and len(written) == 2
    assert [f["url"] for f in listing(out)["files"]] == urls
    assert Counter(map(key, webdataset(urls, index=out).dist_shard())) == Counter(map(key, expected))


def test_an_index_of_format_version_1_still_loads_and_a_newer_one_is_refused(tmp_path, server, monkeypatch):
    """A manifest written by the previous release (one entry object per file) is read
    as before; a version this distshard does not know names the refresh command."""
    from distshard.sources.formats.index_cache import dumps
    from distshard.sources.formats.tar import TarFormat
    from distshard.sources.stored.manifest import entry_name
    from distshard.sources.transport.files import FileRef, file_identity

    paths, expected = write_shards(tmp_path / "data", shards=3, per_shard=4)
    urls = [server.url(p) for p in paths]
    folder = tmp_path / "data" / ".distshard"
    folder.mkdir()
    files = []
    for url in urls:
        ref = FileRef(url, *file_identity(url))
        index = TarFormat().build_index(ref)
        name = entry_name("webdataset", url.rsplit("/", 1)[-1])
        (folder / name).write_bytes(dumps(index))
        files.append(
            {
                "url": url,
                "format": "webdataset",
                "count": index.count,
                "size": ref.size,
                "stamp": ref.stamp,
                "entry": name,
            }
        )
    (folder / "manifest.json").write_text(json.dumps({"format": "distshard-index", "version": 1, "files": files}))
    fresh_machine(monkeypatch, tmp_path, "node")
    server.reset_counters()
    assert Counter(map(key, webdataset(urls).dist_shard())) == Counter(map(key, expected))
    kinds = requests_by_kind(server)
    assert kinds.get("HEAD", 0) == 0 and kinds["manifest"] == 1 and kinds["entry"] == 3, kinds
    # the command over it keeps the unchanged files' entries where they are, in a version 3 manifest
    assert main(["index", *urls, "--out", str(folder)]) == 0
    manifest = listing(str(folder))
    assert manifest["version"] == 3 and [f["entry"] for f in manifest["files"]] == [f["entry"] for f in files]
    fresh_machine(monkeypatch, tmp_path, "node2")
    assert Counter(map(key, webdataset(urls).dist_shard())) == Counter(map(key, expected))
    (folder / "manifest.json").write_text(json.dumps({"format": "distshard-index", "version": 9, "files": []}))
    with pytest.raises(ValueError, match=r"manifest version 9.*python -m distshard index"):
        webdataset(urls).counts()


def test_without_a_stored_index_it_works_as_before_and_says_how_to_start_fast(tmp_path, server, caplog):
    paths, expected = write_shards(tmp_path / "data", shards=3, per_shard=4)
    urls = [server.url(p) for p in paths]
    caplog.set_level(logging.INFO, logger="distshard")
    pipe = webdataset(urls).dist_shard()
    assert Counter(map(key, pipe)) == Counter(map(key, expected))
    assert "python -m distshard index" in str(distshard.explain(pipe))
    assert any("python -m distshard index" in r.getMessage() and "indexed 3" in r.getMessage() for r in caplog.records)


def test_dataloader_workers_reuse_the_ranks_index(tmp_path, server, monkeypatch):
    """2 fork workers: the manifest is read once (by the rank), no HEAD, and every
    entry once at most; without a stored index, one HEAD per file (the rank's) and none in the workers."""
    from torch.utils.data import DataLoader

    pattern, urls, expected = indexed(tmp_path, server, shards=8, per_shard=3)
    fresh_machine(monkeypatch, tmp_path, "node")
    server.reset_counters()
    pipe = webdataset(pattern, read_options=SMALL).dist_shard()
    loader = DataLoader(pipe, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60)
    got = list(loader)
    assert Counter(map(key, got)) == Counter(map(key, expected))
    kinds = requests_by_kind(server)
    assert kinds.get("HEAD", 0) == 0 and kinds["manifest"] == 1 and kinds["entry"] <= 8, kinds
    (tmp_path / "data" / ".distshard" / "manifest.json").unlink()
    fresh_machine(monkeypatch, tmp_path, "node2")
    server.reset_counters()
    pipe = webdataset(pattern, read_options=SMALL).dist_shard()
    assert len(list(DataLoader(pipe, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60))) == 52
    kinds = requests_by_kind(server)
    assert kinds["HEAD"] == 8 and kinds["manifest"] == 1, kinds  # the rank's look for it, and its HEADs


def test_retries_and_a_slow_first_request_are_logged(tmp_path, caplog, monkeypatch):
    from distshard.sources.transport import clients
    from distshard.sources.transport import responses as answers

    paths, expected = write_jsonl(tmp_path / "j", files=1, lines=30)
    monkeypatch.setattr(answers, "SLOW_FIRST_REQUEST", 0.0)
    clients.forget_clients()  # a client whose first answer is still to come
    caplog.set_level(logging.INFO, logger="distshard")
    with serve(tmp_path, fault_every=2, faults=("503",)) as server:
        source = jsonl([server.url(p) for p in paths], read_options=ReadOptions(retry_seconds=20))
        assert [x for x in source.dist_shard()] == expected
    messages = [r.getMessage() for r in caplog.records]
    retry = [m for m in messages if m.startswith("retrying")]
    assert retry and "part-000.jsonl" in retry[0] and "HTTP 503" in retry[0]
    assert any("bytes [" in m for m in retry)
    assert any("first request to http://" in m for m in messages)
    assert any(m.startswith("indexed 1 jsonl files in") for m in messages)


def test_the_first_request_is_timed_whatever_its_answer(tmp_path, caplog, monkeypatch):
    """Issue 28 (5): without a stored index a job's first request is the look for
    its manifest, answered 404; that request is the one timed (and logged when
    slow: here every first request is), named with its answer, and only once."""
    from distshard.sources.transport import clients
    from distshard.sources.transport import responses as answers

    paths, expected = write_jsonl(tmp_path / "j", files=2, lines=5)
    monkeypatch.setattr(answers, "SLOW_FIRST_REQUEST", 0.0)
    clients.forget_clients()  # a client whose first answer is still to come
    caplog.set_level(logging.WARNING, logger="distshard")
    with serve(tmp_path) as server:
        source = jsonl([server.url(p) for p in paths])
        assert Counter(map(json.dumps, source.dist_shard())) == Counter(map(json.dumps, expected))
        assert server.log[0][:2] == ("GET", "/j/.distshard/manifest.json")  # the first request: a 404
    first = [r.getMessage() for r in caplog.records if "first request" in r.getMessage()]
    assert len(first) == 1, first
    assert "/j/.distshard/manifest.json the whole file" in first[0] and "no such file" in first[0], first


def test_parquet_finds_its_stored_index(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from distshard.sources import parquet

    for f in range(2):
        pq.write_table(pa.table({"i": list(range(f * 40, f * 40 + 40))}), tmp_path / f"t{f}.parquet", row_group_size=9)
    assert main(["index", str(tmp_path / "t*.parquet"), "--workers", "2"]) == 0  # processes for local files
    fresh_machine(monkeypatch, tmp_path, "node")
    source = parquet(str(tmp_path / "t*.parquet"), columns=["i"])
    assert sorted(row["i"] for row in source.dist_shard(shuffle=True)) == list(range(80))
    assert source._stored is not None and source._indexed_here == 0


def test_the_command_reads_a_file_again_after_a_cut_body_and_weak_etags_are_compared(tmp_path, monkeypatch):
    """A store that cuts bodies and fails requests: the command retries each file
    whole (still one GET a file that went through); a store with weak ETags: the
    stored identity (ETag and Last-Modified) is compared on every range, and a
    changed file names the refresh command."""
    paths, expected = write_shards(tmp_path / "data", shards=6, per_shard=3)
    out = str(tmp_path / "data" / ".distshard")
    with serve(tmp_path, fault_every=3, faults=("reset", "short", "503")) as faulty:
        urls = [faulty.url(p) for p in paths]
        assert main(["index", *urls, "--out", out, "--workers", "2"]) == 0
        assert faulty.faulted and faulty.requests["GET"] == 6 + sum(faulty.faulted.values())
    with serve(tmp_path, weak=True) as weak:
        urls = [weak.url(p) for p in paths]
        assert main(["index", *urls, "--out", out]) == 0
        stamps = [f["stamp"] for f in listing(str(tmp_path / "data" / ".distshard"))["files"]]
        assert all(s.startswith('W/"') and " lm:" in s for s in stamps[-6:]), stamps
        fresh_machine(monkeypatch, tmp_path, "node")
        assert Counter(map(key, webdataset(urls, index=out).dist_shard())) == Counter(map(key, expected))
        changed = tmp_path / "data" / "shard-000004.tar"
        os.utime(changed, ns=(changed.stat().st_atime_ns, changed.stat().st_mtime_ns + 5 * 10**9))
        fresh_machine(monkeypatch, tmp_path, "node2")
        with pytest.raises(
            ValueError, match=r"shard-000004\.tar changed after the stored index.*python -m distshard index"
        ):
            list(webdataset(urls, index=out).dist_shard())
