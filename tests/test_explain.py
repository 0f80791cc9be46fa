"""explain() and the notebook view: what a user sees before running."""

from torch.utils.data.datapipes.iter import IterableWrapper

import distshard  # noqa: F401  (registers .dist_shard)


class _Stream:
    def __iter__(self):
        return iter(range(100))


def decode(x):
    return x


def keep(x):
    return x % 3 > 0


def test_fast_path_with_pushdown_reads_once():
    shard = IterableWrapper(list(range(1000))).map(decode).dist_shard(rank=1, world_size=4, even="drop")
    found = shard.explain()
    text = str(found)
    assert found.reads_per_element == 1.0 and found.decodes_per_element == 1.0
    assert "rank 1 of 4, from the rank= / world_size= arguments" in text
    assert "per slot: [250, 250, 250, 250]" in text
    assert "pushdown: map(decode)" in text
    assert "warnings: none" in text


def test_stream_with_a_map_below_a_shuffle_warns_with_the_fix(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "8")
    shard = IterableWrapper(_Stream()).map(decode).shuffle().dist_shard()
    pipeline = shard.map(decode).filter(keep).shuffle()
    found = shard.explain(pipeline)
    text = str(found)
    assert "rank 2 of 8, from the RANK / WORLD_SIZE environment" in text
    assert found.reads_per_element == 8.0 and found.decodes_per_element == 8.0
    assert any("map(decode) sits below Shuffler" in w and "8x" in w for w in found.warnings)
    assert any("Filter after dist_shard" in w and "stop_together" in w for w in found.warnings)
    assert any("shuffle() after dist_shard" in w for w in found.warnings)
    assert "seeded identically on every slot" in text


def test_default_context_warns(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    found = IterableWrapper(range(10)).dist_shard().explain()
    assert any("no distributed context found" in w for w in found.warnings)


def test_pad_and_units_plans_are_spelled_out():
    pad = str(IterableWrapper(range(10)).dist_shard(rank=3, world_size=4, even="pad").explain())
    assert "even='pad' repeats 2 elements in all; this slot repeats position 3" in pad
    units = IterableWrapper(["a", "b", "c"]).dist_shard(rank=1, world_size=2, expand=list, sizes=[1, 1, 1])
    text = str(units.explain())
    assert "contiguous element block [2, 3)" in text


def test_html_for_notebooks_escapes_and_lists_warnings():
    shard = IterableWrapper(_Stream()).map(decode).shuffle().dist_shard(rank=0, world_size=2)
    page = shard._repr_html_()
    assert page.startswith("<div") and "<b>warnings</b><ul>" in page and "<li" in page
