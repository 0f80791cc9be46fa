"""distshard.explain(pipeline) and the notebook view: what a user sees before running."""

import pytest
from torch.utils.data import DataLoader
from torch.utils.data.datapipes.iter import IterableWrapper

import distshard


class _Stream:
    def __iter__(self):
        return iter(range(100))


def decode(x):
    return x


def keep(x):
    return x % 3 > 0


def test_fast_path_with_pushdown_reads_once():
    shard = IterableWrapper(list(range(1000))).map(decode).dist_shard(rank=1, world_size=4, even="drop")
    found = distshard.explain(shard)
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
    found = distshard.explain(pipeline)
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
    found = distshard.explain(IterableWrapper(range(10)).dist_shard())
    assert any("no distributed context found" in w for w in found.warnings)


def test_pad_and_units_plans_are_spelled_out():
    pad = str(distshard.explain(IterableWrapper(range(10)).dist_shard(rank=3, world_size=4, even="pad")))
    assert "even='pad' repeats 2 elements in all; this slot repeats position 3" in pad
    units = IterableWrapper(["a", "b", "c"]).dist_shard(rank=1, world_size=2, expand=list, sizes=[1, 1, 1])
    text = str(distshard.explain(units))
    assert "contiguous element block [2, 3)" in text


def test_html_for_notebooks_escapes_and_lists_warnings():
    shard = IterableWrapper(_Stream()).map(decode).shuffle().dist_shard(rank=0, world_size=2)
    page = distshard.explain(shard)._repr_html_()
    assert page.startswith("<div") and "<b>warnings</b><ul>" in page and "<li" in page


def test_the_readme_call_takes_the_pipeline_or_what_wraps_it():
    assert callable(distshard.explain) and distshard.Explanation is type(
        distshard.explain(IterableWrapper(range(4)).dist_shard(rank=0, world_size=1))
    )
    pipeline = IterableWrapper(range(12)).map(decode).dist_shard(rank=1, world_size=3).filter(keep)
    text = str(distshard.explain(pipeline))
    assert "per slot: [4, 4, 4]" in text and "Filter after dist_shard" in text
    assert str(distshard.explain(distshard.StatefulPipeline(pipeline))) == text
    assert str(distshard.explain(DataLoader(pipeline, batch_size=None))) == text
    assert str(distshard.explain(DataLoader(distshard.StatefulPipeline(pipeline), batch_size=None))) == text


def test_several_dist_shards_are_each_explained():
    left = IterableWrapper(range(8)).dist_shard(rank=0, world_size=2)
    right = IterableWrapper(_Stream()).dist_shard(rank=0, world_size=2)
    found = distshard.explain(left.zip(right).shuffle())
    assert [part.reads_per_element for part in found.parts] == [1.0, 2.0]
    assert found.reads_per_element is None and found.context == found.parts[0].context
    text = str(found)
    assert "dist_shard 1 of 2: DistShardIterDataPipe(IterableWrapperIterDataPipe" in text
    assert "dist_shard 2 of 2: reads:" in text
    shuffles = [w for w in found.warnings if "shuffle() after dist_shard" in w]
    assert [w.split(":")[0] for w in shuffles] == ["dist_shard 1 of 2", "dist_shard 2 of 2"]


def test_explain_refuses_what_it_cannot_explain():
    with pytest.raises(ValueError, match="explain.. found no dist_shard in MapperIterDataPipe"):
        distshard.explain(IterableWrapper(range(3)).map(decode))
    with pytest.raises(TypeError, match="explain.. needs an IterDataPipe pipeline.*got list"):
        distshard.explain([1, 2])


def test_the_method_and_the_notebook_view_still_work():
    shard = IterableWrapper(range(10)).dist_shard(rank=0, world_size=2)
    assert str(shard.explain(shard.batch(2))) == str(distshard.explain(shard.batch(2)))
    assert shard._repr_html_() == distshard.explain(shard)._repr_html_()


# -- issue 15: explain's figures are what iteration yields, in every layout ----------------------

import re  # noqa: E402
from collections import Counter  # noqa: E402

from .helpers import as_worker  # noqa: E402
from .model_factories import jsonl_file  # noqa: E402


class _SizedStream:
    """A stream with a length and no random access."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self):
        return self.n


class _Unit:
    """expand(unit) of units of the given sizes, whose elements are their global positions."""

    def __init__(self, sizes):
        self.starts = [sum(sizes[:u]) for u in range(len(sizes))]
        self.sizes = sizes

    def __call__(self, unit):
        return list(range(self.starts[unit], self.starts[unit] + self.sizes[unit]))


def _unit_sizes(n):
    sizes, left = [], n
    while left:
        sizes.append(min(left, 1 + len(sizes) % 4))
        left -= sizes[-1]
    return sizes


def _source(kind, n, **options):
    """The pipe and how to read an element's position from it."""
    if kind == "list":
        return IterableWrapper(list(range(n))).dist_shard(**options), int
    if kind == "stream":
        return IterableWrapper(_SizedStream(n), deepcopy=False).dist_shard(**options), int
    if kind == "units":
        sizes = _unit_sizes(n)
        return IterableWrapper(list(range(len(sizes)))).dist_shard(expand=_Unit(sizes), sizes=sizes, **options), int
    return distshard.jsonl(jsonl_file(n)).dist_shard(**options), lambda value: int(value[1:])


EVENS = [(None, 1), ("drop", 1), ("drop", 4), ("pad", 1)]


@pytest.mark.parametrize("kind", ["list", "stream", "units", "jsonl"])
def test_explain_says_what_every_slot_yields(kind):
    """Over a grid of lengths, layouts (stride, chunks of multiple_of, blocks), even and
    shuffle: explain's per-slot counts, what is left out or repeated, the repeated
    position, the block and every slot's first positions are what the slots yield."""
    checked = Counter()
    for n in (0, 7, 61):
        for world, workers in ((1, 1), (2, 1), (2, 2), (3, 2)):
            for even, multiple in EVENS:
                for shuffle in (False,) if kind == "stream" else (False, True):
                    options = dict(world_size=world, even=even, multiple_of=multiple, shuffle=shuffle, seed=3)
                    slots = world * workers
                    everything = []
                    for slot in range(slots):
                        rank, worker = divmod(slot, workers)
                        with as_worker(worker, workers if workers > 1 else 0):
                            pipe, position = _source(kind, n, rank=rank, **options)
                            found = distshard.explain(pipe)
                            got = [position(x) for x in pipe]
                        where = f"{kind} n={n} {world}x{workers} {options} slot {slot}: {found}"
                        assert found.per_slot[slot] == len(got), where
                        assert found.first_positions[slot] == got[:8], where
                        text = str(found)
                        block = re.search(r"contiguous element block \[(\d+), (\d+)\)", text)
                        if block:
                            assert got[: int(block[2]) - int(block[1])] == list(range(int(block[1]), int(block[2]))), (
                                where
                            )
                        everything += got
                        repeat = re.search(r"this slot repeats position (\d+)", text)
                        if repeat:
                            assert got[-1] == int(repeat[1]), where
                        checked[found.layout] += 1
                    counts = Counter(everything)
                    assert found.left_out == n - len(counts), where
                    assert found.repeated == len(everything) - len(counts), where
                    assert all(c == 1 for c in counts.values()) or even == "pad", where
                    if even == "drop" and not shuffle:
                        assert set(range(n)) - set(counts) == set(range(n - found.left_out, n)), where
    layouts = {"list": {"stride", "chunks"}, "stream": {"stride", "chunks"}, "units": {"blocks"}, "jsonl": {"blocks"}}
    assert set(checked) == layouts[kind]


def test_explain_of_the_issue_s_example():
    """N = 61, W = 2, b = 4: 28 a slot, 5 left out, positions in whole batches."""
    text = str(
        distshard.explain(IterableWrapper(range(61)).dist_shard(rank=0, world_size=2, even="drop", multiple_of=4))
    )
    assert "per slot: [28, 28]" in text and "leaves out the last 5 positions" in text
    assert "s0: 0, 1, 2, 3, 8, 9, 10, 11 ...; s1: 4, 5, 6, 7, 12, 13, 14, 15 ..." in text
