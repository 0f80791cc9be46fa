"""The read-ahead on real files: the bytes a reading slot holds (fetched or in
flight, gaps between samples included) measured against ``ReadOptions.budget``
over tiny and large samples, tar and JSON lines, local files and the loopback
HTTP range server (tests/range_server.py), in-process and in fork DataLoader
workers."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

import distshard  # noqa: F401  (registers .dist_shard)
from distshard.sources import ReadOptions, jsonl, webdataset
from distshard.sources.reading import fetch
from distshard.sources.reading.fetch import ReadAhead, Request
from distshard.sources.transport.files import FileAccess, FileRef, file_identity, open_random
from tests.range_server import served as server  # noqa: F401  (a fixture)
from tests.source_factories import isolated_cache as cache  # noqa: F401  (autouse)
from tests.source_factories import write_tiny_tar

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")


def long_lines(path: Path, lines: int, size: int, big: dict[int, int] | None = None) -> list[int]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as out:
        for i in range(lines):
            out.write(json.dumps({"i": i, "text": "x" * (big or {}).get(i, size)}) + "\n")
    return list(range(lines))


# (format, samples, sample size, larger samples, options): the two cases, and
# samples larger than the budget among small ones
CASES = {
    "tar-tiny": ("tar", 1500, 6, None, dict(budget=16 << 10, max_range=8192, max_gap=4096)),
    "jsonl-below-budget": ("jsonl", 120, 2500, None, dict(budget=12000, max_range=8192, max_gap=4096)),
    "tar-larger-than-budget": (
        "tar",
        60,
        300,
        {7: 40 << 10, 30: 20 << 10},
        dict(budget=16 << 10, max_range=8192, max_gap=4096),
    ),
    "jsonl-larger-than-budget": (
        "jsonl",
        80,
        700,
        {3: 30000, 50: 13000},
        dict(budget=12000, max_range=4096, max_gap=2048),
    ),
}


def make(case: str, folder: Path) -> tuple[Path, list, int]:
    """The file of ``case``, what it holds, and its largest sample's bytes."""
    kind, n, size, big, _ = CASES[case]
    if kind == "tar":
        path = folder / "data" / "tiny.tar"
        keys = write_tiny_tar(path, n, size, big)
        return path, keys, max([size, *(big or {}).values()])
    path = folder / "data" / "lines.jsonl"
    values = long_lines(path, n, size, big)
    return path, values, max([size, *(big or {}).values()]) + 30


def key(kind: str, sample) -> object:
    return sample["__key__"] if kind == "tar" else sample["i"]


@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffle"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_bytes_held_over_http_stay_within_the_budget(tmp_path, server, case, shuffle):
    kind, *_, options = CASES[case]
    path, expected, largest = make(case, tmp_path)
    read = ReadOptions(window=8192, **options)
    build = webdataset if kind == "tar" else jsonl
    source = build([server.url(path)], read_options=read)
    fetch.reset_stats()
    got = [key(kind, s) for r in range(2) for s in source.dist_shard(rank=r, world_size=2, shuffle=shuffle)]
    assert Counter(got) == Counter(expected)
    peak = fetch.STATS.peak_held
    assert 0 < peak <= max(read.budget, largest), (peak, read.budget, largest)
    assert fetch.STATS.held == 0


@pytest.mark.parametrize("case", sorted(CASES))
def test_bytes_held_reading_local_files_ahead_stay_within_the_budget(tmp_path, case):
    """A local file read through the read-ahead (what a source of local and
    remote files does), with gaps read through as for a remote one."""
    kind, *_, options = CASES[case]
    path, expected, largest = make(case, tmp_path)
    read = ReadOptions(window=8192, **options)
    access = FileAccess(read)
    source = (webdataset if kind == "tar" else jsonl)([str(path)], read_options=read)
    sequence = source.__distshard_sequence__()
    ref, index = sequence.file_index(0)
    handle = open_random(FileRef(str(path), *file_identity(str(path))), access)
    fetch.reset_stats()
    ahead = ReadAhead(read, lambda f: handle)
    got = [
        key(kind, sequence.fmt.parse(handle, index, j, ref, views))
        for j, views in ahead.run(Request(j, 0, sequence.fmt.spans(index, j)) for j in range(len(sequence)))
    ]
    assert got == expected
    assert 0 < fetch.STATS.peak_held <= max(read.budget, largest), (fetch.STATS.peak_held, read.budget, largest)


def peak_after(sample):
    """(the sample's key, this worker's peak bytes held so far)."""
    return (sample["__key__"], fetch.STATS.peak_held)


def test_bytes_held_per_dataloader_worker_stay_within_the_budget(tmp_path, server):
    from torch.utils.data import DataLoader

    path, expected, largest = make("tar-tiny", tmp_path)
    read = ReadOptions(window=8192, **CASES["tar-tiny"][-1])
    pipe = webdataset([server.url(path)], read_options=read).dist_shard(shuffle=True).map(peak_after)
    loader = DataLoader(pipe, batch_size=None, num_workers=2, multiprocessing_context="fork")
    got = list(loader)
    assert Counter(k for k, _ in got) == Counter(expected)
    peaks = [p for _, p in got]
    assert 0 < max(peaks) <= read.budget, (max(peaks), read.budget)


def test_remote_parquet_rows_take_only_the_read_aheads_requests(tmp_path, server):
    """pyarrow reads a row group's adjacent column chunks at once: served from the
    fetched chunks, not one more request per row group."""
    pytest.importorskip("pyarrow")
    from distshard.sources import parquet
    from tests.source_factories import write_parquet_rows

    paths, expected = write_parquet_rows(tmp_path / "data")
    source = parquet([server.url(p) for p in paths], read_options=ReadOptions(window=16 << 10, max_gap=4 << 10))
    source.counts()
    server.settle().reset_counters()
    fetch.reset_stats()
    assert sorted(map(repr, source.dist_shard(shuffle=True))) == sorted(map(repr, expected))
    assert server.settle().requests["GET"] == fetch.STATS.ranges


def write_shards(folder: Path, shards: int, samples: int, seed: int = 0) -> list[str]:
    """``shards`` tars of ``samples`` samples of 2–20 KB each (seeded); returns the keys."""
    import io
    import random
    import tarfile

    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    keys = []
    for s in range(shards):
        with tarfile.open(folder / f"shard-{s:03d}.tar", "w", format=tarfile.GNU_FORMAT) as tf:
            for i in range(samples):
                data = rng.randbytes(rng.randint(2 << 10, 20 << 10))
                info = tarfile.TarInfo(f"s{s:03d}_{i:04d}.jpg")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
                keys.append(f"s{s:03d}_{i:04d}")
    return keys


@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffle"])
def test_an_epoch_asks_few_ranges_a_file_in_order_or_shuffled(tmp_path, server, shuffle):
    """Issue 32: an epoch over remote tar shards (index cached; 4 slots, each a
    contiguous block of files) asks at most 4 range requests a shard plus one per
    4 MiB read, shuffled or not: the read-ahead plans through a file's upcoming
    spans (its extents) instead of a range per shuffle window it visits. Windows of
    128 KiB make about 8 a shard, as the 512 KiB default does on 4 MiB shards."""
    shards = 12
    keys = write_shards(tmp_path / "data", shards, 96)
    paths = sorted((tmp_path / "data").iterdir())
    total = sum(p.stat().st_size for p in paths)
    source = webdataset([server.url(p) for p in paths], read_options=ReadOptions(window=128 << 10))
    source.counts()
    list(source.dist_shard(rank=0, world_size=4))  # the index cached
    server.settle().reset_counters()
    got = [s["__key__"] for r in range(4) for s in source.dist_shard(rank=r, world_size=4, shuffle=shuffle)]
    assert Counter(got) == Counter(keys)  # exactly once (1,152 samples: 288 a slot, nothing dropped)
    gets = server.settle().requests["GET"]
    assert gets <= 4 * shards + total / (4 << 20), (gets, shards, total)
