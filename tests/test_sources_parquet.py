"""distshard.parquet on real files with several row groups (needs pyarrow)."""

from __future__ import annotations

import builtins
import pickle
import random
import sys

import pytest

from distshard.sources import parquet
from tests.source_factories import isolated_cache as cache  # noqa: F401  (autouse)
from tests.source_factories import write_parquet_rows

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def test_rows_in_order_and_at_random(tmp_path):
    urls, expected = write_parquet_rows(tmp_path / "t")
    assert pq.ParquetFile(urls[0]).num_row_groups == 8  # several row groups
    source = parquet(str(tmp_path / "t" / "part-*.parquet"))
    assert list(source) == expected
    sequence = pickle.loads(pickle.dumps(source.__distshard_sequence__()))
    assert len(sequence) == len(expected) == len(source)
    order = list(range(len(expected)))
    random.Random(2).shuffle(order)
    assert [sequence[i] for i in order] == [expected[i] for i in order]
    assert "3 Parquet files, 159 samples, random access by row group" in source.describe()


def test_columns_select(tmp_path):
    urls, expected = write_parquet_rows(tmp_path / "t", files=2)
    source = parquet(urls, columns=["text", "id"])
    wanted = [{"text": row["text"], "id": row["id"]} for row in expected]
    assert list(source) == wanted
    sequence = source.__distshard_sequence__()
    assert [sequence[i] for i in range(len(sequence))] == wanted
    with pytest.raises(ValueError, match=r"part-0\.parquet: no column 'nope'"):
        list(parquet(urls, columns=["nope"]))
    with pytest.raises(ValueError, match="no column 'nope'"):
        parquet(urls, columns=["nope"]).__distshard_sequence__()[0]
    with pytest.raises(TypeError):
        parquet(urls, columns="text")


def test_a_row_group_is_decoded_once_while_its_rows_are_read(tmp_path, monkeypatch):
    urls, expected = write_parquet_rows(tmp_path / "t", files=1, rows=21, row_group_size=7)
    sequence = parquet(urls).__distshard_sequence__()
    decoded = []
    real = pq.ParquetFile.read_row_group
    monkeypatch.setattr(
        pq.ParquetFile, "read_row_group", lambda self, i, **kw: decoded.append(i) or real(self, i, **kw)
    )
    assert [sequence[i] for i in range(21)] == expected
    assert decoded == [0, 1, 2]
    row = sequence[0]
    row["id"] = "mutated by the user"
    assert sequence[0] == expected[0]  # the cached rows are not shared with the caller


def test_changed_file_is_refused(tmp_path):
    import os

    urls, _ = write_parquet_rows(tmp_path / "t", files=1)
    sequence = parquet(urls).__distshard_sequence__()
    table = pa.table({"id": [1], "text": ["x"], "score": [0.0], "tags": [["a"]]})
    pq.write_table(table, urls[0])
    os.utime(urls[0], ns=(1, 1))
    with pytest.raises(ValueError, match=r"part-0\.parquet changed after it was indexed"):
        sequence[0]


def test_missing_pyarrow_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name == "pyarrow" or name.startswith("pyarrow."):
            raise ImportError("No module named 'pyarrow'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    for name in [m for m in sys.modules if m == "pyarrow" or m.startswith("pyarrow.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=r"pip install distshard\[parquet\]"):
        parquet("whatever.parquet")


def test_shuffle_decodes_each_row_group_about_once_per_slot(tmp_path):
    from distshard.sources.formats.parquet import decodes

    urls, expected = write_parquet_rows(tmp_path / "t", files=4, rows=100, row_group_size=10)  # 40 row groups
    source = parquet(urls, columns=["id", "text"])
    before = decodes()
    got = [row["id"] for rank in range(2) for row in source.dist_shard(rank=rank, world_size=2, shuffle=True)]
    assert sorted(got) == sorted(row["id"] for row in expected)
    groups = sum(-(-(100 + 3 * f) // 10) for f in range(4))
    assert decodes() - before <= groups + 1  # the row group the two slots share is decoded by both
    assert got[:10] != sorted(got[:10])


def test_rows_report_their_stored_bytes_for_cost_weighted_mixing(tmp_path):
    urls, _ = write_parquet_rows(tmp_path / "t", files=1, rows=30, row_group_size=7)
    sequence = parquet(urls, columns=["text"]).__distshard_sequence__()
    ref, index = sequence.file_index(0)
    sizes = sequence.fmt.sample_sizes(index)
    meta = pq.ParquetFile(urls[0]).metadata
    text = [k for k in range(meta.num_columns) if meta.row_group(0).column(k).path_in_schema == "text"][0]
    assert len(sizes) == 30
    assert sum(sizes) == sum(meta.row_group(g).column(text).total_compressed_size for g in range(meta.num_row_groups))
