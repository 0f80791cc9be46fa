"""The core below both front-ends (``distshard.core``), the source contract
(``distshard.protocol``) and its one adapter (``access.access_of``)."""

from __future__ import annotations

import gzip
import json
import pickle

import pytest
from torch.utils.data.datapipes.iter import IterableWrapper

import distshard
from distshard import context as _context
from distshard import datapipe as datapipe_module
from distshard.access import access_of
from distshard.core import PlanModel, ShardCore
from distshard.explaining import explain_model
from distshard.protocol import IdentifiedSource, PositionalSource, UnitSource, sequence_of


def test_options_are_frozen_and_replaced_whole():
    pipe = IterableWrapper(range(10)).dist_shard(rank=0, world_size=2, even="drop", multiple_of=2)
    before = pipe.core.options
    with pytest.raises(AttributeError):
        pipe.multiple_of = 1
    after = pipe.core.replace_options(multiple_of=1)
    assert (before.multiple_of, after.multiple_of, pipe.multiple_of) == (2, 1, 1)
    assert list(pipe) == [0, 2, 4, 6, 8]
    with pytest.raises(ValueError, match="multiple_of=0"):
        pipe.core.replace_options(multiple_of=0)
    with pytest.raises(TypeError, match="cannot change 'even'"):
        pipe.core.replace_options(even="pad")
    assert pipe.core.options is after  # a refused change leaves the options as they were


def test_set_shuffle_swaps_the_options_the_front_end_reports():
    pipe = IterableWrapper(list(range(8))).dist_shard(rank=0, world_size=1, shuffle=True)
    pipe.set_shuffle(False)
    assert (pipe.global_shuffle, pipe.core.options.shuffle, list(pipe)) == (False, False, list(range(8)))


def test_both_front_ends_share_the_core_and_its_repr():
    from distshard.nodes import DistShardNode

    pipe = IterableWrapper(list(range(6))).dist_shard(rank=1, world_size=2, even="drop", seed=3)
    node = DistShardNode(list(range(6)), rank=1, world_size=2, even="drop", seed=3)
    assert isinstance(pipe.core, ShardCore) and isinstance(node.core, ShardCore)
    assert repr(pipe) == "DistShardIterDataPipe(IterableWrapperIterDataPipe, even='drop', rank=1, world_size=2, seed=3)"
    assert repr(node) == "DistShardNode(list, even='drop', rank=1, world_size=2, seed=3)"


def test_the_core_carries_the_captured_rank_through_pickling(monkeypatch):
    pipe = IterableWrapper(range(4)).dist_shard()
    monkeypatch.setattr(_context, "dist_rank_world", lambda: (1, 2))
    # unpickling notes the captured rank for this process: put it back after the test,
    # or a later test's in-process worker would resolve to rank 1 of 2
    monkeypatch.setattr(_context, "_pickled", None)
    blob = pickle.dumps(pipe)
    assert pipe.core.captured is None  # captured in the copy, not here
    clone = pickle.loads(blob)
    assert clone.core.captured == (1, 2)


def test_explain_reads_the_plan_model():
    pipe = IterableWrapper(list(range(10))).shuffle().dist_shard(rank=0, world_size=2, even="pad")
    model = pipe.plan_model()
    assert isinstance(model, PlanModel)
    assert (model.total, model.epoch, model.even, model.pending, len(model.random_pipes)) == (10, 0, "pad", None, 1)
    assert str(explain_model(model)) == str(pipe.explain())
    assert not hasattr(datapipe_module, "EXPLAINER")


def test_the_protocol_names_what_file_sources_declare(tmp_path):
    plain = tmp_path / "a.jsonl"
    plain.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(5)))
    packed = tmp_path / "b.jsonl.gz"
    with gzip.open(packed, "wt") as out:
        out.write("".join(json.dumps({"i": i}) + "\n" for i in range(5)))
    source = distshard.jsonl([str(plain)])
    assert isinstance(source, PositionalSource)
    found = access_of(source)
    assert found is not None and found.random and len(found.sequence) == 5
    assert isinstance(found.sequence, IdentifiedSource)  # its sequence says which files, as they are
    assert [found.sequence[i]["i"] for i in range(5)] == list(range(5))
    compressed = distshard.jsonl([str(packed)])
    assert isinstance(compressed, UnitSource) and sequence_of(compressed) is None
    whole = access_of(compressed)
    assert whole is not None and whole.whole is not None and whole.whole.files == [str(packed)]
    assert access_of(compressed, whole=False) is None


def test_access_of_a_wrapper_and_of_a_bare_sequence():
    wrapped = access_of(IterableWrapper([1, 2, 3]))
    assert wrapped is not None and (wrapped.sequence, wrapped.copy_elements) == ([1, 2, 3], True)
    assert access_of([1, 2, 3]) is None  # a DataPipe's base is a pipe, never a bare list
    bare = access_of([1, 2, 3], bare=True)
    assert bare is not None and (bare.sequence, bare.copy_elements) == ([1, 2, 3], False)
    assert access_of(iter([1, 2]), bare=True) is None  # a stream


# -- the one load path ---------------------------------------------------------------------


class _Counted:
    """How often a state is parsed (``State.from_dict``) and written (``to_dict``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from distshard.state import State

        self.parsed = self.written = 0
        parse, write = State.from_dict.__func__, State.to_dict  # type: ignore[attr-defined]

        def from_dict(cls, state):
            self.parsed += 1
            return parse(cls, state)

        def to_dict(state):
            self.written += 1
            return write(state)

        monkeypatch.setattr(State, "from_dict", classmethod(from_dict))
        monkeypatch.setattr(State, "to_dict", to_dict)


def _slot_states(build, num_slots: int, took: int) -> list:
    states = []
    for slot in range(num_slots):
        shard = build(slot, num_slots)
        it = iter(shard)
        for _ in range(took):
            next(it)
        states.append(json.loads(json.dumps(shard.state_dict())))
    return states


def test_every_front_end_parses_what_was_saved_once_and_writes_nothing(monkeypatch):
    from torchdata.nodes import Loader

    from distshard.nodes import DistShardNode

    def pipe(slot, num_slots):
        return IterableWrapper(list(range(12))).dist_shard(rank=slot, world_size=num_slots)

    def node(slot, num_slots):
        return DistShardNode(list(range(12)), rank=slot, world_size=num_slots)

    def node_shards(slot, num_slots):  # a node iterated through a Loader, whose state_dict() it reports
        return _NodeShard(node(slot, num_slots))

    class _NodeShard:
        def __init__(self, shard):
            self.shard, self.loader = shard, Loader(shard)

        def __iter__(self):
            return iter(self.loader)

        def state_dict(self):
            return self.shard.state_dict()

    saved = _slot_states(pipe, 3, 2)  # every slot of a run of 3, as every rank saved it
    nodes_saved = _slot_states(node_shards, 3, 2)
    loaded = {
        "dist_shard": (IterableWrapper(list(range(12))).dist_shard(rank=0, world_size=2), saved),
        "StatefulPipeline": (
            distshard.StatefulPipeline(IterableWrapper(list(range(12))).dist_shard(rank=0, world_size=2)),
            [{"distshard_pipeline": 1, "shard": s} for s in saved],
        ),
        "DistShardNode": (node(0, 2), nodes_saved),
    }
    for name, (front, states) in loaded.items():
        counted = _Counted(monkeypatch)
        front.load_state_dict(states)
        assert (name, counted.parsed, counted.written) == (name, 3, 0)
        monkeypatch.undo()
    # what the three slots left (6 of 12 taken: 0..5), split afresh over 2 slots
    assert list(loaded["dist_shard"][0]) == [6, 8, 10]
    assert list(loaded["StatefulPipeline"][0]) == [6, 8, 10]
    assert list(Loader(loaded["DistShardNode"][0])) == [6, 8, 10]


def test_the_core_takes_what_was_saved_to_one_typed_state():
    from distshard.state import State

    states = _slot_states(lambda s, n: IterableWrapper(list(range(12))).dist_shard(rank=s, world_size=n), 2, 1)
    core = IterableWrapper(list(range(12))).dist_shard(rank=0, world_size=1).core
    assert core.load_saved({"loader": {"workers": states}}, lambda: None, False) is True
    assert isinstance(core.pending, State) and not core.pending.is_slot
    assert (core.pending.remaining.to_list(), core.pending.total) == ([[2, 12]], 10)
    with pytest.raises(distshard.StateMismatchError, match=r"no distshard state found: expected a dict, got int"):
        core.load_saved(3, lambda: None, False)
    assert core.pending is not None and core.pending.total == 10  # a refusal left the loaded state as it was
