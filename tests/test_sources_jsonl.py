"""distshard.jsonl on real files: unicode, blank lines, CRLF, a BOM, no final
newline; bad lines named by file, line number and byte offset."""

from __future__ import annotations

import bz2
import gzip
import json
import pickle
import random

import pytest

from distshard.sources import jsonl
from tests.source_factories import isolated_cache as cache  # noqa: F401  (autouse)
from tests.source_factories import write_jsonl


def all_items(sequence):
    return [sequence[i] for i in range(len(sequence))]


def test_odd_lines(tmp_path):
    path = tmp_path / "odd.jsonl"
    path.write_bytes(
        b'\xef\xbb\xbf{"a": 1}\r\n'  # BOM, CRLF
        b"\n"  # blank
        b"   \t \r\n"  # whitespace only
        + '"été 漢字 🎉"\n'.encode()  # unicode
        + b'[1, 2, {"b": null}]\n'
        b"3.5\n"
        b"  true  \n"  # surrounding spaces
        b'{"last": "no newline"}'
    )
    expected = [{"a": 1}, "été 漢字 🎉", [1, 2, {"b": None}], 3.5, True, {"last": "no newline"}]
    source = jsonl(str(path))
    assert list(source) == expected
    sequence = source.__distshard_sequence__()
    assert all_items(sequence) == expected
    assert [sequence[i] for i in (5, 0, 3, 1, 4, 2)] == [expected[i] for i in (5, 0, 3, 1, 4, 2)]
    assert "1 JSON-lines file, 6 samples, random access by line" in source.describe()


def test_many_files_random_order_and_pickle(tmp_path):
    urls, expected = write_jsonl(tmp_path / "data", files=4, lines=30)
    source = jsonl(str(tmp_path / "data" / "part-*.jsonl"))
    assert source.urls == urls
    assert list(source) == expected
    sequence = pickle.loads(pickle.dumps(source.__distshard_sequence__()))
    order = list(range(len(expected)))
    random.Random(1).shuffle(order)
    assert [sequence[i] for i in order] == [expected[i] for i in order]
    assert sequence.counts == (30, 31, 32, 33)


def test_empty_and_blank_only_files(tmp_path):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "blank.jsonl").write_bytes(b"\n\n  \r\n")
    (tmp_path / "one.jsonl").write_bytes(b"1\n")
    source = jsonl([str(tmp_path / n) for n in ("empty.jsonl", "blank.jsonl", "one.jsonl")])
    assert list(source) == [1]
    assert all_items(source.__distshard_sequence__()) == [1]


def test_bad_line_names_file_line_and_byte(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"ok": 1}\n\n{"ok": 2}\r\n{"broken": \n{"ok": 3}\n')
    # the bad line is line 4 and starts at byte 10 + 1 + 11 = 22
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 4, byte 22: invalid JSON"):
        list(jsonl(str(path)))
    sequence = jsonl(str(path)).__distshard_sequence__()
    assert sequence[3] == {"ok": 3}
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 4, byte 22: invalid JSON"):
        sequence[2]


def test_invalid_utf8_is_named(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'"ok"\n"caf\xe9"\n')
    with pytest.raises(ValueError, match=r"latin1\.jsonl: line 2, byte 5: not UTF-8"):
        list(jsonl(str(path)))


@pytest.mark.parametrize("suffix,pack", [(".jsonl.gz", gzip.compress), (".jsonl.bz2", bz2.compress)])
def test_compressed_files_stream_whole(tmp_path, suffix, pack):
    urls, expected = write_jsonl(tmp_path / "src", files=2, lines=10)
    packed = []
    for url in urls:
        target = tmp_path / (url.rsplit("/", 1)[-1].replace(".jsonl", "") + suffix)
        target.write_bytes(pack(open(url, "rb").read()))
        packed.append(str(target))
    source = jsonl(packed)
    assert list(source) == expected
    assert source.__distshard_sequence__() is None
    units, expand = source.__distshard_units__()
    assert [v for u in units for v in expand(u)] == expected
    assert source.counts() == [10, 11]
    assert "whole-file streaming (compressed)" in source.describe()


def test_bad_line_in_a_compressed_file(tmp_path):
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(gzip.compress(b"1\n{\n"))
    with pytest.raises(ValueError, match=r"bad\.jsonl\.gz: line 2, byte 2 of the decompressed stream"):
        list(jsonl(str(path)))


def test_value_written_by_json_dumps_round_trips(tmp_path):
    values = [{"k": i, "s": "\u2028 line separator inside a string", "n": None} for i in range(5)]
    path = tmp_path / "ls.jsonl"
    path.write_text("".join(json.dumps(v, ensure_ascii=False) + "\n" for v in values), encoding="utf-8")
    source = jsonl(str(path))
    assert list(source) == values == all_items(source.__distshard_sequence__())


def test_lines_report_their_stored_bytes(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"a": 1}\n\n"xyz"\r\n')
    sequence = jsonl(str(path)).__distshard_sequence__()
    _, index = sequence.file_index(0)
    assert list(sequence.fmt.sample_sizes(index)) == [8, 6]  # the line without its line end ("\r" kept)
