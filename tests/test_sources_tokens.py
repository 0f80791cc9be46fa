"""distshard.tokens on Megatron-LM indexed datasets the tests write from the format's
specification (tests/token_files.py): every dtype, pairs named every way, exact
multisets through dist_shard (shuffle, resume, elastic resume, DataLoader workers, a
gloo group, both front-ends), remote over a loopback range server, the token counts
from the .idx alone, and every malformed pair refused naming the file."""

from __future__ import annotations

import builtins
import json
import os
import struct
from collections import Counter
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

import distshard
from distshard.verify import run_on_group
from tests.source_factories import isolated_cache as cache  # noqa: F401  (autouse)
from tests.token_files import DTYPES, as_tuple, sequences_for, write_indexed


def corpus(folder: Path, pairs: int = 3, count: int = 40, dtype: str = "uint16") -> tuple[list[str], list[tuple]]:
    """``pairs`` datasets ``folder/part-N`` (``count + 7 N`` sequences each); the
    prefixes and every sequence in order, as tuples."""
    prefixes: list[str] = []
    expected: list[tuple] = []
    for p in range(pairs):
        sequences = sequences_for(count + 7 * p, dtype, seed=p)
        prefix = str(folder / f"part-{p}")
        write_indexed(prefix, sequences, dtype)
        prefixes.append(prefix)
        expected.extend(as_tuple(s) for s in sequences)
    return prefixes, expected


def tuples(elements) -> Counter:
    return Counter(as_tuple(x) for x in elements)


# -- the format ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_reads_back_what_was_written(tmp_path, dtype):
    sequences = sequences_for(30, dtype)
    write_indexed(tmp_path / "c", sequences, dtype)
    source = distshard.tokens(str(tmp_path / "c"))
    got = list(source)
    assert [as_tuple(x) for x in got] == [as_tuple(s) for s in sequences]
    assert all(isinstance(x, np.ndarray) and x.ndim == 1 and x.dtype == np.dtype(dtype) for x in got)
    sequence = source.__distshard_sequence__()
    order = [29, 0, 3, 17, 1, 28]
    assert [as_tuple(sequence[i]) for i in order] == [as_tuple(sequences[i]) for i in order]
    element = sequence[5]
    element[0] = 1  # the caller's own memory: writable, no fetched range behind it
    assert element.flags.owndata and element.flags.writeable
    assert list(source.lengths()) == [len(s) for s in sequences] and source.lengths().dtype == np.int64


def test_a_pair_is_named_by_either_file_its_prefix_a_glob_or_a_brace_pattern_each_once(tmp_path):
    prefixes, expected = corpus(tmp_path, pairs=3)
    by = {
        "prefixes": prefixes,
        "bins": [p + ".bin" for p in prefixes],
        "idxs": [p + ".idx" for p in prefixes],
        "glob of both": str(tmp_path / "part-*"),
        "glob of bins": str(tmp_path / "part-*.bin"),
        "brace": str(tmp_path / "part-{0..2}.{bin,idx}"),
    }
    for how, urls in by.items():
        source = distshard.tokens(urls)
        assert source.urls == prefixes, how
        assert [as_tuple(x) for x in source] == expected, how
    assert [as_tuple(x) for x in distshard.tokens([prefixes[2], prefixes[0] + ".idx"])] == (
        expected[-54:] + expected[:40]
    )
    with pytest.raises(ValueError, match="names no dataset"):
        distshard.tokens(".bin")


def test_multimodal_modes_and_documents_of_several_sequences_are_read(tmp_path):
    sequences = sequences_for(12, "int32")
    write_indexed(tmp_path / "mm", sequences, "int32", documents=[0, 3, 3, 10, 12], modes=[i % 2 for i in range(12)])
    source = distshard.tokens(str(tmp_path / "mm.idx"))
    assert [as_tuple(x) for x in source] == [as_tuple(s) for s in sequences]
    assert tuples(x for r in range(2) for x in source.dist_shard(rank=r, world_size=2, shuffle=True)) == tuples(
        sequences
    )


def test_an_empty_dataset_yields_nothing(tmp_path):
    write_indexed(tmp_path / "empty", [], "uint16", documents=[0])
    source = distshard.tokens(str(tmp_path / "empty"))
    assert list(source) == [] and len(source) == 0 and list(source.lengths()) == []
    assert list(source.dist_shard(even="pad")) == []


def _idx(path: Path) -> bytes:
    return path.read_bytes()


def _write(path: Path, data: bytes) -> None:
    path.write_bytes(data)


@pytest.mark.parametrize(
    "damage,match",
    [
        (lambda b, i: (b, b"NOTMEGA\x00\x00" + i[9:]), r"c\.idx: starts with b'NOTMEGA.*not a Megatron-LM indexed"),
        (lambda b, i: (b, i[:9] + struct.pack("<Q", 2) + i[17:]), r"c\.idx: MMIDIDX version 2; .* reads version 1"),
        (lambda b, i: (b, i[:17] + bytes([9]) + i[18:]), r"c\.idx: dtype code 9 is none of .*8 uint16"),
        (lambda b, i: (b, i[:20]), r"c\.idx: 20 bytes, shorter than the 34-byte MMIDIDX header.*truncated"),
        (
            lambda b, i: (b, i[:-5]),
            r"c\.idx: \d+ bytes, but its header announces 10 sequences .* truncated; write both",
        ),
        (lambda b, i: (b, i + b"\x00" * 3), r"c\.idx: \d+ bytes, but 10 sequences .* corrupt"),
        (lambda b, i: (b[:-2], i), r"c\.bin: \d+ bytes, but .*c\.idx puts sequence 9 at .* truncated or belongs"),
        (lambda b, i: (b + b"\x00\x00", i), r"c\.bin: \d+ bytes, but the sequences of .*c\.idx end at .* not match"),
    ],
    ids=["magic", "version", "dtype", "short-header", "truncated", "trailing", "short-bin", "long-bin"],
)
def test_a_malformed_pair_is_refused_naming_the_file_and_the_fix(tmp_path, damage, match):
    write_indexed(tmp_path / "c", sequences_for(10, "uint16"), "uint16")
    bin_path, idx_path = tmp_path / "c.bin", tmp_path / "c.idx"
    data, index = damage(bin_path.read_bytes(), idx_path.read_bytes())
    bin_path.write_bytes(data)
    idx_path.write_bytes(index)
    with pytest.raises(ValueError, match=match):
        len(distshard.tokens(str(tmp_path / "c")))
    with pytest.raises(ValueError, match=match):
        list(distshard.tokens(str(tmp_path / "c.bin")))


def test_document_indices_out_of_order_are_refused(tmp_path):
    write_indexed(tmp_path / "c", sequences_for(5, "uint8"), "uint8", documents=[0, 3, 2, 5])
    with pytest.raises(ValueError, match=r"c\.idx: its document indices are not sequence numbers in increasing"):
        len(distshard.tokens(str(tmp_path / "c")))


@pytest.mark.parametrize("missing", [".bin", ".idx"])
def test_a_missing_file_of_a_pair_is_named_with_its_partner(tmp_path, missing):
    write_indexed(tmp_path / "c", sequences_for(5, "uint8"), "uint8")
    os.unlink(tmp_path / f"c{missing}")
    source = distshard.tokens(str(tmp_path / "c.bin"))
    with pytest.raises(FileNotFoundError, match=rf"c\{missing}: no such file\. .*reads .* as the pair .*c\.bin \+ "):
        len(source)
    with pytest.raises(FileNotFoundError, match=rf"c\{missing}: no such file"):
        list(source)


def test_a_changed_idx_is_never_read_with_its_stale_index(tmp_path):
    """Same .bin, another split into sequences: the cached index keys on both files."""
    tokens = np.arange(10, dtype="uint16")
    write_indexed(tmp_path / "c", [tokens[:3], tokens[3:]], "uint16")
    assert [len(x) for x in distshard.tokens(str(tmp_path / "c")).__distshard_sequence__()] == [3, 7]
    bin_stat = os.stat(tmp_path / "c.bin")
    write_indexed(tmp_path / "c", [tokens[:5], tokens[5:]], "uint16")
    os.utime(tmp_path / "c.bin", ns=(bin_stat.st_atime_ns, bin_stat.st_mtime_ns))  # the .bin looks untouched
    source = distshard.tokens(str(tmp_path / "c"))
    assert [len(x) for x in source.__distshard_sequence__()] == [5, 5]
    assert [len(x) for x in source] == [5, 5]


def test_a_bin_rewritten_during_the_epoch_raises(tmp_path):
    prefixes, _ = corpus(tmp_path, pairs=1, count=30)
    it = iter(distshard.tokens(prefixes).dist_shard())
    next(it)
    data = bytearray(Path(prefixes[0] + ".bin").read_bytes())
    data[-1] ^= 1
    Path(prefixes[0] + ".bin").write_bytes(bytes(data))
    os.utime(prefixes[0] + ".bin", ns=(1, 1))
    with pytest.raises(ValueError, match=r"part-0\.bin changed after it was indexed"):
        list(it)


def test_a_sequence_read_at_random_reads_exactly_its_bytes(tmp_path, monkeypatch):
    prefixes, expected = corpus(tmp_path, pairs=1, count=30)
    sequence = distshard.tokens(prefixes).__distshard_sequence__()
    reads: list[tuple[int, int]] = []
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, off: reads.append((off, n)) or real(fd, n, off))
    assert as_tuple(sequence[17]) == expected[17]
    assert [n for _, n in reads] == [2 * (len(expected[17]) - 1)]  # one pread of its tokens (uint16)


def test_token_counts_come_from_the_idx_without_reading_a_bin(tmp_path, monkeypatch):
    prefixes, expected = corpus(tmp_path, pairs=2)
    real_open, real_os_open = builtins.open, os.open

    def refuse_bin(opener):
        def spy(path, *args, **kwargs):
            if str(path).endswith(".bin"):  # (a chmod would not stop root)
                raise AssertionError(f"{path} opened")
            return opener(path, *args, **kwargs)

        return spy

    monkeypatch.setattr(builtins, "open", refuse_bin(real_open))
    monkeypatch.setattr(os, "open", refuse_bin(real_os_open))
    source = distshard.tokens(prefixes)
    assert list(source.lengths()) == [len(t) - 1 for t in expected]
    assert list(source.distshard_token_counts()) == list(source.lengths())
    assert source.__distshard_sequence__().sample_bytes() == [2 * (len(t) - 1) for t in expected]


# -- through dist_shard --------------------------------------------------------------------------
@pytest.mark.parametrize("even", [None, "drop", "pad"])
@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffle"])
def test_slots_read_every_sequence_once(tmp_path, even, shuffle):
    from tests.helpers import as_worker

    prefixes, expected = corpus(tmp_path, pairs=3)
    source = distshard.tokens(prefixes)
    slots = []
    for rank in range(3):
        for worker in range(2):
            with as_worker(worker, 2):
                slots.append(
                    [as_tuple(x) for x in source.dist_shard(rank=rank, world_size=3, even=even, shuffle=shuffle)]
                )
    got = Counter(x for slot in slots for x in slot)
    n, s = len(expected), 6
    if even is None:
        assert got == Counter(expected)
    elif even == "drop":
        assert {len(slot) for slot in slots} == {n // s} and not got - Counter(expected)
        assert sum((Counter(expected) - got).values()) == n % s
    else:
        assert {len(slot) for slot in slots} == {-(-n // s)} and not Counter(expected) - got


def test_shuffle_changes_with_the_epoch_and_keeps_the_multiset(tmp_path):
    prefixes, expected = corpus(tmp_path, pairs=2)
    pipe = distshard.tokens(prefixes).dist_shard(shuffle=True)
    orders = []
    for epoch in range(2):
        distshard.set_epoch(pipe, epoch)
        orders.append([as_tuple(x) for x in pipe])
    assert Counter(orders[0]) == Counter(orders[1]) == Counter(expected)
    assert orders[0] != orders[1] and orders[0] != expected


@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffle"])
def test_resume_and_elastic_resume_are_exact(tmp_path, shuffle):
    prefixes, expected = corpus(tmp_path, pairs=3)
    source = distshard.tokens(prefixes)
    got: list = []
    states = []
    for rank in range(2):  # two ranks take 11 each, then checkpoint
        pipe = source.dist_shard(rank=rank, world_size=2, shuffle=shuffle, seed=5)
        it = iter(pipe)
        got.extend(as_tuple(next(it)) for _ in range(11))
        states.append(json.loads(json.dumps(pipe.state_dict())))
    own = distshard.tokens(prefixes).dist_shard(rank=1, world_size=2, shuffle=shuffle, seed=5)
    own.load_state_dict(states[1])  # the same layout from its own state
    rest_of_1 = [as_tuple(x) for x in own]
    merged = distshard.merge_states(states)
    for rank in range(3):  # the rest on three ranks
        pipe = distshard.tokens(prefixes).dist_shard(rank=rank, world_size=3, shuffle=shuffle, seed=5)
        pipe.load_state_dict(merged)
        got.extend(as_tuple(x) for x in pipe)
    assert Counter(got) == Counter(expected)
    # (a multiset: sequences of equal tokens, the empty ones, stand in several pairs)
    whole_of_1 = [
        as_tuple(x) for x in distshard.tokens(prefixes).dist_shard(rank=1, world_size=2, shuffle=shuffle, seed=5)
    ]
    assert Counter(got[11:22]) + Counter(rest_of_1) == Counter(whole_of_1)


def test_a_state_of_other_token_files_is_refused(tmp_path):
    prefixes, _ = corpus(tmp_path / "a", pairs=2)
    others, _ = corpus(tmp_path / "b", pairs=2, count=41)
    pipe = distshard.tokens(prefixes).dist_shard()
    next(iter(pipe))
    other = distshard.tokens(others).dist_shard()
    with pytest.raises(ValueError):
        other.load_state_dict(pipe.state_dict())


def test_fork_workers_and_the_nodes_front_end_are_exact(tmp_path):
    from torch.utils.data import DataLoader
    from torchdata.nodes import Loader

    prefixes, expected = corpus(tmp_path, pairs=3)
    source = distshard.tokens(prefixes)
    got = []
    for rank in range(2):
        pipe = source.dist_shard(rank=rank, world_size=2, shuffle=True).map(as_tuple)
        loader = DataLoader(pipe, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60)
        got += [tuple(x) for x in loader]  # (the loader's default_convert makes lists of tuples)
    assert Counter(got) == Counter(expected)
    nodes = [
        as_tuple(x)
        for rank in range(3)
        for x in Loader(distshard.DistShardNode(source, rank=rank, world_size=3, shuffle=True, even="pad"))
    ]
    assert not Counter(expected) - Counter(nodes) and len(nodes) == 3 * -(-len(expected) // 3)


def gloo_reads(rank: int, world_size: int, prefixes: list[str], cache: str) -> list[tuple]:
    """On a gloo rank: what this rank's 2 DataLoader workers yield (the source is
    built on every rank: construction indexes the pairs collectively)."""
    from torch.utils.data import DataLoader

    os.environ["DISTSHARD_CACHE"] = cache
    pipe = distshard.tokens(prefixes).dist_shard(shuffle=True, even="drop").map(as_tuple)
    return [
        tuple(x) for x in DataLoader(pipe, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60)
    ]


def test_two_gloo_ranks_with_two_workers_each_read_every_sequence_once(tmp_path, cache):
    prefixes, expected = corpus(tmp_path, pairs=3)
    outcomes = run_on_group(gloo_reads, world_size=2, timeout=180, args=(prefixes, str(cache)))
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    got = Counter(x for o in outcomes for x in o.value)
    assert {len(o.value) for o in outcomes} == {2 * (len(expected) // 4)}
    assert not got - Counter(expected) and sum((Counter(expected) - got).values()) == len(expected) % 4


def test_mix_weighs_token_files_by_their_tokens(tmp_path):
    prefixes, expected = corpus(tmp_path, pairs=1, count=60)
    source = distshard.tokens(prefixes)
    words = [f"w{i}" for i in range(30)]
    from torch.utils.data.datapipes.iter import IterableWrapper

    mixed = distshard.mix(
        {"tokens": source, "words": IterableWrapper(words)},
        {"tokens": 1, "words": 1},
        stop="first_exhausted",
        cost={"tokens": source.lengths(), "words": [4] * len(words)},
    )
    got = list(mixed.dist_shard(rank=0, world_size=1))
    arrays = [as_tuple(x) for x in got if isinstance(x, np.ndarray)]
    assert arrays == expected[: len(arrays)] and arrays
    wide, _ = corpus(tmp_path / "wide", pairs=1, dtype="int64")
    by_bytes = distshard.mix({"a": source, "b": distshard.tokens(wide)}, {"a": 1, "b": 1}, cost="bytes")
    assert by_bytes.cost_kind == "bytes"
    assert list(by_bytes.costs[0]) == [2 * (len(t) - 1) for t in expected]  # stored bytes, from the .idx


# -- object storage --------------------------------------------------------------------------------
@pytest.fixture
def server(tmp_path) -> Iterator:
    pytest.importorskip("fsspec")
    pytest.importorskip("aiohttp")
    from tests.range_server import serve

    with serve(tmp_path) as srv:
        yield srv


def test_over_http_few_requests_the_identity_once_and_exact(tmp_path, server):
    from distshard.sources import ReadOptions

    prefixes, expected = corpus(tmp_path / "data", pairs=3, count=200)
    urls = [server.url(p + ".bin") for p in prefixes]
    options = ReadOptions(window=1 << 10, max_gap=256)
    source = distshard.tokens(urls, read_options=options)
    assert [as_tuple(x) for x in source] == expected  # plain iteration
    server.reset_counters()
    sequence = distshard.tokens(urls, read_options=options).__distshard_sequence__()  # warm cache: identities only
    # one GET looked for a stored index beside the files (404: `distshard index` skips token pairs)
    assert dict(server.settle().requests) == {"HEAD": 2 * len(urls), "GET": 1}
    server.reset_counters()
    got = [as_tuple(x) for x in sequence.distshard_read(range(len(sequence)))]
    assert got == expected
    assert dict(server.settle().requests) == {"GET": len(urls)}  # one range a .bin, nothing else
    assert server.served == sum(os.path.getsize(p + ".bin") for p in prefixes)
    server.reset_counters()
    shuffled = [
        as_tuple(x)
        for rank in range(2)
        for x in distshard.tokens(urls, read_options=options).dist_shard(rank=rank, world_size=2, shuffle=True)
    ]
    assert Counter(shuffled) == Counter(expected)
    assert server.settle().requests["HEAD"] == 2 * 2 * len(urls)  # each source built asks once a file
    assert not [path for method, path, _ in server.log if method == "GET" and path.endswith(".idx")]


def test_over_http_a_rewritten_bin_is_refused(tmp_path, server):
    from distshard.sources import ReadOptions

    prefixes, _ = corpus(tmp_path / "data", pairs=1, count=300)
    small = ReadOptions(budget=1024, max_range=512, max_gap=0, window=1024)
    it = iter(distshard.tokens(server.url(prefixes[0]), read_options=small).dist_shard())
    for _ in range(3):
        next(it)
    data = bytearray(Path(prefixes[0] + ".bin").read_bytes())
    data[-1] ^= 1
    Path(prefixes[0] + ".bin").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"part-0\.bin.*changed"):
        list(it)


def test_on_s3_through_fork_workers_is_exact(tmp_path):
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    import boto3

    from tests.moto_server import start_moto

    server, endpoint = start_moto()
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    try:
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        client.create_bucket(Bucket="tok")
        prefixes, expected = corpus(tmp_path, pairs=2, dtype="int32")
        for prefix in prefixes:
            for suffix in (".bin", ".idx"):
                client.put_object(
                    Bucket="tok", Key=f"c/{Path(prefix).name}{suffix}", Body=Path(prefix + suffix).read_bytes()
                )
        from torch.utils.data import DataLoader

        source = distshard.tokens("s3://tok/c/*.idx", storage_options={"endpoint_url": endpoint})
        assert source.urls == ["s3://tok/c/part-0", "s3://tok/c/part-1"]
        got = [
            tuple(x)
            for rank in range(2)
            for x in DataLoader(
                source.dist_shard(rank=rank, world_size=2, shuffle=True).map(as_tuple),
                batch_size=None,
                num_workers=2,
                multiprocessing_context="fork",
                timeout=60,
            )
        ]
        assert Counter(got) == Counter(expected)
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.parametrize("window", [1, 8, 40, 1 << 10, 1 << 20])
def test_shuffle_windows_follow_the_byte_window_rule(tmp_path, window):
    from distshard.sources.formats.file_index import byte_windows

    write_indexed(tmp_path / "c", sequences_for(300, "int32", seed=window), "int32")
    sequence = distshard.tokens(str(tmp_path / "c")).__distshard_sequence__()
    _, index = sequence.file_index(0)
    pointers, lengths = index.arrays["pointers"], index.arrays["lengths"]
    rule = byte_windows(300, lambda i: (pointers[i], pointers[i] + 4 * lengths[i]), window)
    assert list(sequence.fmt.windows(index, window)) == list(rule)
