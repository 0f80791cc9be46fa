"""What a job with a stored index asks before a rank's first sample (issue 22): the
manifest (the rank, once), the entries of the files its DataLoader workers read
first (the rank, once, before the workers start: they reuse them, never a second
round of requests) and one range of data per worker (the read-ahead asks its next
ranges once its first is answered): 1 + 1 + workers requests whatever the number of
shards. Counted by the loopback range server, with real DataLoader workers; the
first sample of each process noted in the server's log by a ``.map()``."""

from __future__ import annotations

from collections import Counter

import pytest
from torch.utils.data import DataLoader

from distshard.sources import ReadOptions, webdataset
from distshard.sources.stored.manifest import listing
from tests.range_server import FirstSampleMark, RangeServer, before_first_mark, serve
from tests.source_factories import fresh_machine
from tests.source_factories import isolated_cache as cache  # noqa: F401  (autouse)
from tests.test_sources_stored import indexed, key, kinds_of, requests_by_kind

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")


# the default read-ahead: what is counted is what comes before the first sample (the
# manifest, the entries, each worker's first range), whatever the ranges after it; small
# ranges would only make the epoch a round trip per sample (28 s at 64 shards)
READS = ReadOptions()


@pytest.fixture
def slow_server(tmp_path):
    """A range server that waits 20 ms before every response (an object store's first
    byte): what each process asks first has time to show in the log."""
    with serve(tmp_path, latency=0.02) as server:
        yield server


@pytest.mark.parametrize("shards, per_shard", [(4, 40), (64, 3)])
def test_a_rank_asks_four_requests_before_its_first_sample_and_its_workers_no_entry(
    tmp_path, slow_server: RangeServer, monkeypatch, shards, per_shard
):
    """2 ranks (one after the other here) x 2 fork workers, few big shards and many
    small ones: before a rank's first sample, the manifest, one range of entries
    (the rank's, for both workers) and at most one range of data per worker; over
    the epoch the workers ask no entry: the rank's range held all the files they read."""
    pattern, urls, expected = indexed(tmp_path, slow_server, shards=shards, per_shard=per_shard)
    got: list[dict] = []
    for rank in (0, 1):
        fresh_machine(monkeypatch, tmp_path, f"node{rank}")
        slow_server.reset_counters()
        pipe = (
            webdataset(pattern, read_options=READS)
            .dist_shard(rank=rank, world_size=2)
            .map(FirstSampleMark(slow_server))
        )
        loader = DataLoader(pipe, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60)
        got.extend(loader)
        first = kinds_of(before_first_mark(slow_server))
        assert sum(first.values()) <= 4, first
        assert first["manifest"] == 1 and first["entry"] == 1 and 1 <= first["data"] <= 2, first
        epoch = requests_by_kind(slow_server)
        assert epoch.get("HEAD", 0) == 0 and epoch["manifest"] == 1, epoch
        assert epoch["entry"] == 1, epoch  # the rank's: its workers asked none
    assert Counter(map(key, got)) == Counter(map(key, expected))


def test_first_files_far_apart_in_the_pack_take_a_range_each_and_no_entry_twice(tmp_path, slow_server, monkeypatch):
    """Entries of a slot's first file and of the next slot's more than a range apart
    (``packs.RANGE_BYTES`` of about 4 entries): the rank asks one range around each
    (at once), and no byte of the pack is asked twice over the epoch (the workers
    ask only the entries the rank did not fetch)."""

    from distshard.sources.stored import entry_packs as packs

    pattern, urls, expected = indexed(tmp_path, slow_server, shards=64, per_shard=3)
    sizes = [f["len"] for f in listing(str(tmp_path / "data" / ".distshard"))["files"]]
    monkeypatch.setattr(packs, "RANGE_BYTES", 4 * max(sizes))
    fresh_machine(monkeypatch, tmp_path, "node")
    slow_server.reset_counters()
    pipe = webdataset(pattern, read_options=READS).dist_shard(rank=0, world_size=2).map(FirstSampleMark(slow_server))
    got = list(DataLoader(pipe, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60))
    first = kinds_of(before_first_mark(slow_server))
    assert first["manifest"] == 1 and first["entry"] == 2 and 1 <= first["data"] <= 2, first
    asked = sorted(
        tuple(int(x) for x in rng.split("=")[1].split("-"))
        for _, path, rng in slow_server.log
        if path.endswith(".pack")
    )
    assert all(stop < start for (_, stop), (start, _) in zip(asked, asked[1:], strict=False)), asked  # disjoint
    every = Counter(map(key, expected))
    assert Counter(map(key, got)) <= every and len(got) == len(expected) // 2


def test_pickled_persistent_workers_reuse_the_ranks_entries_every_epoch(tmp_path, slow_server, monkeypatch):
    """forkserver workers (the pipe pickled, as under spawn) that persist across
    epochs: the rank fetches the entries once before they start; the second epoch
    asks neither manifest nor entry (and the rank does not fetch them again for
    workers that already have them)."""
    pattern, urls, expected = indexed(tmp_path, slow_server, shards=16, per_shard=3)
    fresh_machine(monkeypatch, tmp_path, "node")
    slow_server.reset_counters()
    pipe = webdataset(pattern, read_options=READS).dist_shard()
    loader = DataLoader(
        pipe, batch_size=None, num_workers=2, multiprocessing_context="forkserver", persistent_workers=True, timeout=60
    )
    for epoch in range(2):
        pipe.set_epoch(epoch)
        assert Counter(map(key, loader)) == Counter(map(key, expected))
        kinds = requests_by_kind(slow_server)
        assert kinds.get("HEAD", 0) == 0, kinds
        assert (kinds.get("manifest", 0), kinds.get("entry", 0)) == ((1, 1) if epoch == 0 else (0, 0)), kinds
        slow_server.reset_counters()


def test_without_a_stored_index_the_rank_asks_nothing_more(tmp_path, slow_server, monkeypatch):
    """No stored index: the rank indexes the files as before (a HEAD each) and asks
    nothing for its workers before they start; they ask no entry."""
    pattern, urls, expected = indexed(tmp_path, slow_server, shards=8, per_shard=3)
    (tmp_path / "data" / ".distshard" / "manifest.json").unlink()
    fresh_machine(monkeypatch, tmp_path, "node")
    source = webdataset(pattern, read_options=READS)
    pipe = source.dist_shard()
    slow_server.reset_counters()
    loader = DataLoader(pipe, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60)
    assert Counter(map(key, loader)) == Counter(map(key, expected))
    assert set(requests_by_kind(slow_server)) == {"data"}
    assert source.__distshard_sequence__()._fetched_entries == {}


def test_a_file_changed_since_the_index_is_named_by_the_workers_too(tmp_path, slow_server, monkeypatch):
    """The entries the rank fetched are checked like fetched ones: a file rewritten
    since the index still raises in the DataLoader naming it and the refresh command."""
    import os

    pattern, urls, _ = indexed(tmp_path, slow_server, shards=4, per_shard=5)
    changed = tmp_path / "data" / "shard-000000.tar"
    data = bytearray(changed.read_bytes())
    data[700] ^= 1
    changed.write_bytes(bytes(data))
    os.utime(changed, ns=(changed.stat().st_atime_ns, changed.stat().st_mtime_ns + 10**9))
    fresh_machine(monkeypatch, tmp_path, "node")
    pipe = webdataset(pattern, read_options=ReadOptions()).dist_shard()
    loader = DataLoader(pipe, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60)
    with pytest.raises(
        ValueError, match=r"shard-000000\.tar changed after the stored index.*python -m distshard index"
    ):
        list(loader)
