"""The stored index's manifest, format version 3 (issue 33 items 1-2): a head, binary
columns every rank reads, pages of files a slot fetches as it reaches them.

Round trips of the encoding (property-tested), a version 2 manifest still read and
upgraded in place by ``python -m distshard index PATH/.distshard``, a slot fetching
only the pages of its files, a pipe pickled for a spawned worker carrying the head
and not the files (and the worker fetching its own pages, exactly), a stale file
refused (``--prune`` deleting the columns and pages no manifest names: in
``test_index_prune.py``)."""

from __future__ import annotations

import json
import os
import pickle
from collections import Counter
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distshard.__main__ import main
from distshard.sources import jsonl
from distshard.sources.stored import manifest, manifest3, paged
from distshard.sources.stored.indexing import build_stored_index
from distshard.sources.stored.manifest import StoredFile, listing
from distshard.sources.stored.paged import Stored3, StoredSummary
from tests.source_factories import fresh_machine, write_jsonl
from tests.source_factories import isolated_cache as cache  # noqa: F401  (autouse)


@pytest.fixture(autouse=True)
def fresh_indexes():
    """Every test opens its indexes as a fresh process would."""
    paged.forget()
    yield
    paged.forget()


@pytest.fixture
def paged_out(monkeypatch):
    """Small pages, never inline: the columns and pages are objects of their own."""
    monkeypatch.setattr(manifest3, "PAGE_SIZE", 4)
    monkeypatch.setattr(manifest3, "INLINE_BYTES", 0)


def dumped(values) -> Counter:
    return Counter(json.dumps(v, sort_keys=True) for v in values)


_name = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\n"), min_size=1, max_size=12)
_file = st.tuples(
    _name,
    st.text(max_size=40),  # stamp
    st.integers(0, 2**40),  # count
    st.integers(0, 2**63 - 1),  # size
    st.sampled_from(["webdataset", "jsonl", "parquet"]),
    st.one_of(st.tuples(st.integers(0, 2), st.integers(0, 2**40), st.integers(0, 2**20)), _name),
)


@settings(max_examples=60, deadline=None)
@given(files=st.lists(_file, max_size=40), page_size=st.integers(1, 9), inline=st.booleans())
def test_the_columns_and_pages_round_trip(files, page_size, inline):
    root = "s3://bucket/data"
    location = root + "/.distshard"
    stored, records = [], []
    for name, stamp, count, size, fmt, entry in files:
        if isinstance(entry, tuple):
            pack, at, length = entry
            ref = f"{location}/entries-b-{pack}.pack#{at}-{at + length}"
            records.append((name, stamp, pack, at, length))
        else:
            ref = f"{location}/{entry}"
            records.append((name, stamp, entry))
        stored.append(StoredFile(f"{root}/{name}", fmt, count, size, stamp, ref))
    old = manifest3.PAGE_SIZE, manifest3.INLINE_BYTES
    manifest3.PAGE_SIZE, manifest3.INLINE_BYTES = page_size, (1 << 30) if inline else 0
    try:
        encoded = manifest3.encode(root, "b", stored, records, ["entries-b-0.pack", "entries-b-1.pack", "x"])
    finally:
        manifest3.PAGE_SIZE, manifest3.INLINE_BYTES = old
    head = json.loads(encoded.head)
    manifest3.check_head("here", head)
    assert head["files"] == len(files) and head["samples"] == sum(f[2] for f in files)
    assert bool(encoded.objects) is not inline
    columns_bytes = encoded.objects.get("columns-b.bin") or __import__("base64").b64decode(head["columns"]["data"])
    columns = manifest3.decode_columns("here", head, columns_bytes)
    assert list(columns["count"]) == [f[2] for f in files] and list(columns["size"]) == [f[3] for f in files]
    formats = head["formats"]
    chosen = columns["format"] if "format" in columns else [0] * len(files)
    assert [formats[k] for k in chosen] == [f[4] for f in files]
    got = []
    for k in range(head["pages"]["count"]):
        if inline:
            got += manifest3.checked_page("here", k, head["pages"]["data"][k], page_size, len(files))
        else:
            at = columns["page_at"]
            data = encoded.objects["pages-b.bin"][at[k] : at[k + 1]]
            got += manifest3.decode_page("here", k, data, columns["page_crc"][k], page_size, len(files))
    assert got == records
    assert head["urls"] == manifest3.names_digest(f.url for f in stored)


def test_a_damaged_page_or_column_is_refused(tmp_path, paged_out):
    paths, _ = write_jsonl(tmp_path / "j", files=9, lines=2)
    assert main(["index", str(tmp_path / "j" / "part-*.jsonl")]) == 0
    folder = tmp_path / "j" / ".distshard"
    (pages,) = folder.glob("pages-*.bin")
    data = bytearray(pages.read_bytes())
    data[5] ^= 1
    pages.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"page 0 is malformed"):
        list(jsonl(str(tmp_path / "j" / "part-*.jsonl")).dist_shard())
    paged.forget()
    (columns,) = folder.glob("columns-*.bin")
    columns.write_bytes(columns.read_bytes()[:-1])
    with pytest.raises(ValueError, match=r"not the columns its manifest names"):
        len(jsonl(str(tmp_path / "j" / "part-*.jsonl")))


def test_the_command_writes_version_3_and_a_source_over_its_files_reads_it_lazily(tmp_path, paged_out):
    paths, expected = write_jsonl(tmp_path / "j", files=10, lines=3)
    assert main(["index", str(tmp_path / "j" / "part-*.jsonl")]) == 0
    folder = tmp_path / "j" / ".distshard"
    head = json.loads((folder / "manifest.json").read_text())
    assert head["version"] == 3 and head["files"] == 10 and head["pages"]["count"] == 3  # (4 files a page)
    assert {p.name.split("-")[0] for p in folder.iterdir()} == {"manifest.json", "entries", "columns", "pages"}
    listed = listing(str(folder))["files"]
    assert [f["url"] for f in listed] == [os.path.basename(p) for p in paths]  # (relative to the root)
    source = jsonl(str(tmp_path / "j" / "part-*.jsonl"))
    assert dumped(source.dist_shard(shuffle=True)) == dumped(expected)
    assert isinstance(source._summary, StoredSummary) and isinstance(source._stored, Stored3)


def _pages_of(values) -> set[int]:
    return {v["f"] // 4 for v in values}


def test_a_slot_fetches_only_the_pages_of_the_files_it_reads(tmp_path, paged_out, monkeypatch):
    paths, expected = write_jsonl(tmp_path / "j", files=40, lines=3)
    assert main(["index", str(tmp_path / "j" / "part-*.jsonl")]) == 0
    asked: list[tuple[str, int, int]] = []
    read_range = paged.read_range

    def counted(url, start, stop, access):
        asked.append((os.path.basename(url).split("-")[0], start, stop))
        return read_range(url, start, stop, access)

    monkeypatch.setattr(paged, "read_range", counted)
    seen: Counter = Counter()
    for rank in range(10):
        paged.forget()
        asked.clear()
        fresh_machine(monkeypatch, tmp_path, f"rank{rank}")
        got = list(jsonl(str(tmp_path / "j" / "part-*.jsonl")).dist_shard(rank=rank, world_size=10))
        seen.update(dumped(got))
        (index,) = paged._OPENED.values()
        # the pages of the files the slot read, each once, one range request each; nothing else
        assert sorted(index.fetched) == sorted(_pages_of(got)) and len(asked) == len(index.fetched)
        assert {kind for kind, _, _ in asked} == {"pages"}
        assert len(index.fetched) < 10  # (of 10 pages)
    assert seen == dumped(expected)


def test_a_version_2_manifest_is_still_read_and_upgraded_in_place(tmp_path, paged_out, monkeypatch):
    paths, expected = write_jsonl(tmp_path / "j", files=7, lines=3)
    folder = tmp_path / "j" / ".distshard"
    assert main(["index", str(tmp_path / "j" / "part-*.jsonl")]) == 0
    files = list(manifest.load(str(folder)).files.values())
    for old in folder.glob("[cp]*-*.bin"):
        old.unlink()
    (folder / "manifest.json").write_bytes(manifest.dumps(str(folder), files))  # as version 2 wrote it
    assert listing(str(folder))["version"] == 2
    paged.forget()
    fresh_machine(monkeypatch, tmp_path, "v2")
    source = jsonl(str(tmp_path / "j" / "part-*.jsonl"))
    assert dumped(source.dist_shard()) == dumped(expected)
    assert not isinstance(source._stored, Stored3) and source._indexed_here == 0
    built = build_stored_index([str(folder)])  # `python -m distshard index PATH/.distshard`
    assert built.built == 0 and len(built.files) == 7  # nothing read again: the same entries
    upgraded = listing(str(folder))
    assert upgraded["version"] == 3
    assert [(f["url"], f["count"], f["stamp"]) for f in upgraded["files"]] == [
        (os.path.basename(f.url), f.count, f.stamp) for f in files
    ]
    fresh_machine(monkeypatch, tmp_path, "v3")
    source = jsonl(str(tmp_path / "j" / "part-*.jsonl"))
    assert dumped(source.dist_shard()) == dumped(expected) and isinstance(source._summary, StoredSummary)


def test_a_file_changed_since_a_version_3_index_is_refused(tmp_path, paged_out, monkeypatch):
    paths, expected = write_jsonl(tmp_path / "j", files=9, lines=3)
    assert main(["index", str(tmp_path / "j" / "part-*.jsonl")]) == 0
    os.utime(paths[5], ns=(0, 10**18))
    fresh_machine(monkeypatch, tmp_path, "node")
    with pytest.raises(ValueError, match=r"part-005\.jsonl changed after the stored index.*python -m distshard index"):
        list(jsonl(str(tmp_path / "j" / "part-*.jsonl")).dist_shard())


def _pickled_pipe(tmp_path: Path, files: int) -> tuple[bytes, list]:
    write_jsonl(tmp_path / f"j{files}", files=files, lines=1)
    assert main(["index", str(tmp_path / f"j{files}" / "part-*.jsonl")]) == 0
    pipe = jsonl(str(tmp_path / f"j{files}" / "part-*.jsonl")).dist_shard(rank=1, world_size=4)
    first = list(pipe)  # (the rank has read: its pages and columns are here)
    return pickle.dumps(pipe), first


def test_a_pipe_pickled_for_a_spawned_worker_carries_the_head_not_the_files(tmp_path, paged_out):
    small, _ = _pickled_pipe(tmp_path, 40)
    data, read = _pickled_pipe(tmp_path, 400)
    # 400 files' URLs alone are about 28 kB: the pickle stays the size it is at 40 files
    assert len(data) < len(small) + 512, (len(small), len(data))
    assert b"part-150.jsonl" not in data and b"part-399.jsonl" not in data  # (a file it read, one it did not)
    paged.forget()  # as in a spawned process: nothing opened
    again = pickle.loads(data)
    assert dumped(again) == dumped(read)
    (index,) = paged._OPENED.values()
    assert sorted(index.fetched) == sorted(_pages_of(read))  # its own pages only


@pytest.mark.parametrize("named", ["part-*.jsonl", "part-{000..023}.jsonl"])
def test_spawned_and_forked_dataloader_workers_read_exactly(tmp_path, paged_out, named):
    from torch.utils.data import DataLoader

    paths, expected = write_jsonl(tmp_path / "j", files=24, lines=2)
    assert main(["index", str(tmp_path / "j" / "part-*.jsonl")]) == 0
    for start in ("spawn", "fork"):
        got: Counter = Counter()
        for rank in range(2):
            pipe = jsonl(str(tmp_path / "j" / named)).dist_shard(rank=rank, world_size=2)
            loader = DataLoader(pipe, batch_size=None, num_workers=2, multiprocessing_context=start)
            got.update(dumped(loader))
        assert got == dumped(expected), start


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, 2**32 - 1), max_size=50), code=st.sampled_from("IQ"))
def test_a_columns_starts_are_its_prefix_sums_and_pickle_as_its_counts(counts, code):
    column = paged.ColumnArray(code, counts)
    column.source = ("nowhere", {}, None, "count")
    starts = paged.starts_of(column)
    assert list(starts) == [sum(counts[:k]) for k in range(len(counts))]
    assert isinstance(starts, paged.StartsArray) and starts.counts is column


def _made(monkeypatch) -> list[int]:
    """Counts the URLs a brace pattern's lazy list makes (one entry per URL made)."""
    from distshard.sources.transport.brace_list import BraceList

    made: list[int] = []
    item = BraceList._item

    def counted(self, k):
        made.append(k)
        return item(self, k)

    monkeypatch.setattr(BraceList, "_item", counted)
    return made


def test_a_source_given_the_indexed_pattern_matches_it_as_a_pattern(tmp_path, paged_out, monkeypatch):
    paths, expected = write_jsonl(tmp_path / "j", files=12, lines=3)
    assert main(["index", str(tmp_path / "j" / "part-*.jsonl")]) == 0
    head = json.loads((tmp_path / "j" / ".distshard" / "manifest.json").read_text())
    pattern = str(tmp_path / "j" / "part-{000..011}.jsonl")
    assert head["pattern"] == pattern  # (the command saw that its listing is this one range)
    made = _made(monkeypatch)
    monkeypatch.setattr(manifest3, "names_digest", lambda names: pytest.fail("the URLs were digested"))
    seen: Counter = Counter()
    for rank in range(3):
        paged.forget()
        fresh_machine(monkeypatch, tmp_path, f"rank{rank}")
        source = jsonl(pattern)
        seen.update(dumped(source.dist_shard(rank=rank, world_size=3, shuffle=True)))
        assert isinstance(source._summary, StoredSummary)
    assert seen == dumped(expected)
    assert set(made) == {0}, made  # only the first URL (where the index is looked for): never the twelve


def test_another_pattern_or_a_changed_index_is_not_taken_for_the_index(tmp_path, paged_out, monkeypatch):
    paths, expected = write_jsonl(tmp_path / "j", files=12, lines=3)
    assert main(["index", str(tmp_path / "j" / "part-*.jsonl")]) == 0
    by_file = {os.path.basename(p): [] for p in paths}
    for value in expected:
        by_file[f"part-{value['f']:03d}.jsonl"].append(value)
    # fewer files than the index: not its summary; the files it names, exactly, from the index's entries
    fresh_machine(monkeypatch, tmp_path, "fewer")
    source = jsonl(str(tmp_path / "j" / "part-{001..010}.jsonl"))
    wanted = [v for k in range(1, 11) for v in by_file[f"part-{k:03d}.jsonl"]]
    assert dumped(source.dist_shard()) == dumped(wanted)
    assert not isinstance(source._summary, StoredSummary) and source._indexed_here == 0
    # the same files in another order: not the index's order, so not its summary either
    fresh_machine(monkeypatch, tmp_path, "reversed")
    source = jsonl(str(tmp_path / "j" / "part-{011..000}.jsonl"))
    assert dumped(source.dist_shard()) == dumped(expected) and not isinstance(source._summary, StoredSummary)
    # a file changed since the index: refused, given as a pattern as given as a glob
    os.utime(paths[7], ns=(0, 10**18))
    fresh_machine(monkeypatch, tmp_path, "changed")
    with pytest.raises(ValueError, match=r"part-007\.jsonl changed after the stored index.*python -m distshard index"):
        list(jsonl(str(tmp_path / "j" / "part-{000..011}.jsonl")).dist_shard())
    # a file added and the index rebuilt: the old pattern is no longer the index's files
    write_jsonl(tmp_path / "j", files=13, lines=3)
    assert main(["index", str(tmp_path / "j" / "part-*.jsonl")]) == 0
    assert json.loads((tmp_path / "j" / ".distshard" / "manifest.json").read_text())["pattern"].endswith(
        "part-{000..012}.jsonl"
    )
    fresh_machine(monkeypatch, tmp_path, "grown")
    source = jsonl(str(tmp_path / "j" / "part-{000..011}.jsonl"))
    assert dumped(source.dist_shard()) == dumped(expected) and not isinstance(source._summary, StoredSummary)


@pytest.mark.parametrize("whole_bytes", [64 << 20, 300, 1])
def test_reading_every_page_takes_few_requests_and_checks_each(tmp_path, paged_out, monkeypatch, whole_bytes):
    """A refresh (and a match by URL) reads every page: in requests of up to
    WHOLE_BYTES of pages (issue 33: a refresh of 10^6 files in about 1,000 listing
    requests, not one more a page), each page still checked by its CRC."""
    write_jsonl(tmp_path / "j", files=40, lines=1)
    assert main(["index", str(tmp_path / "j" / "part-*.jsonl")]) == 0
    folder = tmp_path / "j" / ".distshard"
    expected = dict(manifest.load(str(folder)).files)
    monkeypatch.setattr(paged, "WHOLE_BYTES", whole_bytes)
    asked: list[tuple[int, int]] = []
    read_range = paged.read_range

    def counted(url, start, stop, access):
        asked.append((start, stop))
        return read_range(url, start, stop, access)

    monkeypatch.setattr(paged, "read_range", counted)
    paged.forget()
    stored = manifest.load(str(folder))
    assert dict(stored.files) == dict(expected)
    (pages,) = folder.glob("pages-*.bin")
    size = pages.stat().st_size
    # consecutive, disjoint, the whole object once; as few as the limit allows (one page at least a request)
    assert [a for a, _ in asked] == [0] + [b for _, b in asked[:-1]] and asked[-1][1] == size
    assert len(asked) == (1 if whole_bytes >= size else 10 if whole_bytes == 1 else len(asked))
    at = stored.index.columns()["page_at"]
    largest = max(b - a for a, b in pairwise(at))
    assert all(b - a <= max(whole_bytes, largest) for a, b in asked)
    built = build_stored_index([str(folder)])  # `python -m distshard index PATH/.distshard`: the refresh
    assert built.built == 0 and len(built.files) == 40
    pages = folder / json.loads((folder / "manifest.json").read_text())["pages"]["object"]
    data = bytearray(pages.read_bytes())
    data[size // 2] ^= 1
    pages.write_bytes(bytes(data))
    paged.forget()
    with pytest.raises(ValueError, match=r"page \d+ is malformed"):
        dict(manifest.load(str(folder)).files)
