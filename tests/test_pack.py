"""distshard.pack: documents packed into blocks of seq_len tokens, the same at any
world size, every token once per epoch, resumable and elastic."""

from __future__ import annotations

import json
import os
import random
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.datapipes.iter import IterableWrapper

import distshard

from .helpers import as_worker
from .model_factories import Stream
from .pack_blocks import FIELDS, best_oracle, key, oracle, tokens_of


def corpus(n: int = 23, seed: int = 0, low: int = 0, high: int = 13) -> list[list[int]]:
    """Documents of distinct token ids: document i holds 1000*i + j."""
    rng = random.Random(seed)
    return [[1000 * i + j for j in range(rng.randint(low, high))] for i in range(n)]


class Counting:
    """Documents by position, counting each position's reads in ``reads``."""

    __distshard_positional__ = True

    def __init__(self, docs: list, reads: Counter) -> None:
        self.docs, self.reads = docs, reads

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        self.reads[i] += 1
        return self.docs[i]


# -- what a block is --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["list", "tuple", "numpy", "uint16", "tensor", "field", "function"])
@pytest.mark.parametrize("seq_len, eos", [(1, None), (4, None), (5, -1), (16, 7), (64, None)])
def test_a_block_is_its_stretch_of_the_concatenation(kind, seq_len, eos):
    docs = corpus(low=0, high=9) if kind != "uint16" else [[j % 60000 for j in d] for d in corpus()]
    wrap = {
        "list": lambda d: d,
        "tuple": tuple,
        "numpy": lambda d: np.array(d, dtype=np.int64),
        "uint16": lambda d: np.array(d, dtype=np.uint16),
        "tensor": lambda d: torch.tensor(d, dtype=torch.int32),
        "field": lambda d: {"ids": d, "text": "x"},
        "function": lambda d: {"nested": {"ids": d}},
    }[kind]
    tokens = {"field": "ids", "function": lambda doc: doc["nested"]["ids"]}.get(kind)
    packed = distshard.pack(IterableWrapper([wrap(d) for d in docs]), seq_len, tokens=tokens, eos=eos, pad=-9)
    got = [key(b) for b in packed]
    assert got == oracle(docs, seq_len, eos, pad=-9)
    assert len(packed) == len(got)
    assert all(sum(b[2]) == seq_len for b in got[:-1])  # padding only in the last block


def test_position_ids_restart_where_each_document_starts():
    blocks = [key(b) for b in distshard.pack(IterableWrapper([[1, 2, 3], [4, 5], [6, 7, 8, 9]]), 4, eos=0)]
    assert blocks == [
        ((1, 2, 3, 0), (0, 1, 2, 3), (1, 1, 1, 1), (1, 1, 1, 1)),
        ((4, 5, 0, 6), (0, 1, 2, 0), (1, 1, 1, 1), (1, 1, 1, 2)),
        ((7, 8, 9, 0), (1, 2, 3, 4), (1, 1, 1, 1), (1, 1, 1, 1)),  # the cut document: a segment of its own
    ]


def test_an_empty_corpus_packs_into_no_block():
    assert list(distshard.pack(IterableWrapper([[], []]), 4)) == []
    assert len(distshard.pack(IterableWrapper([]), 4)) == 0


# -- every block once, the same at any world size -----------------------------------------------


def _slots(build, world: int, workers: int) -> dict[int, list]:
    out = {}
    for rank in range(world):
        for worker in range(max(1, workers)):
            with as_worker(worker, workers):
                out[rank * max(1, workers) + worker] = [key(b) for b in build(rank, world)]
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("even", [None, "drop", "pad", "carry"])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("fit", ["concat", "best"])
def test_every_block_once_at_every_world_size(world, workers, even, shuffle, fit):
    docs = corpus(31, seed=world)
    window = 20 if fit == "best" else None
    expected = oracle(docs, 6, eos=-1) if fit == "concat" else best_oracle(docs, 6, -1, window=window)

    def build(rank, world_size):
        return distshard.pack(IterableWrapper(docs), 6, eos=-1, fit=fit, window=window).dist_shard(
            rank=rank, world_size=world_size, even=even, shuffle=shuffle
        )

    per_slot = _slots(build, world, workers)
    got = Counter(b for blocks in per_slot.values() for b in blocks)
    S, N = world * max(1, workers), len(expected)
    assert set(got) <= set(expected)
    if even is None:
        assert got == Counter(expected)
    elif even == "pad":
        assert {len(v) for v in per_slot.values()} == {-(-N // S)} and set(got) == set(expected)
    else:  # drop, and carry's epoch 0 (whole rounds): nothing repeated (blocks of a lone eos repeat in the oracle)
        assert {len(v) for v in per_slot.values()} == {N // S} and got <= Counter(expected)
    if even is None and not shuffle:
        # the same blocks in the same order as one process reads them
        assert [b for s in sorted(per_slot) for b in per_slot[s]] == expected


def test_every_token_once_with_multiple_of():
    docs = corpus(40, seed=3)
    per_slot = _slots(
        lambda r, w: distshard.pack(IterableWrapper(docs), 5).dist_shard(
            rank=r, world_size=w, even="drop", multiple_of=2
        ),
        2,
        2,
    )
    counts = {len(v) for v in per_slot.values()}
    assert len(counts) == 1 and counts.pop() % 2 == 0
    got = Counter(b for v in per_slot.values() for b in v)
    assert max(got.values()) == 1 and set(got) <= set(oracle(docs, 5))


@pytest.mark.parametrize("shuffle", [False, True])
def test_real_dataloader_workers(shuffle):
    """Two ranks (explicit) x two forked DataLoader workers: every block once."""
    docs = corpus(37, seed=5)
    got = []
    for rank in range(2):
        pipe = distshard.pack(IterableWrapper(docs), 8, eos=-1).dist_shard(rank=rank, world_size=2, shuffle=shuffle)
        loader = DataLoader(pipe, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60)
        got += [key(b) for b in loader]
    assert Counter(got) == Counter(oracle(docs, 8, eos=-1))


def test_shuffle_permutes_blocks_and_each_block_reads_only_its_documents():
    docs = corpus(30, seed=8, low=1, high=20)
    reads: Counter = Counter()
    packed = distshard.pack(IterableWrapper(Counting(docs, reads)), 7)
    reads.clear()  # the counting pass
    plan = packed.packing()
    spans = Counter(k for b in range(plan.blocks) for k, _, _ in plan.segments(b))
    got = []
    for rank in range(3):
        got += [key(b) for b in packed.dist_shard(rank=rank, world_size=3, shuffle=True, seed=4)]
    assert Counter(got) == Counter(oracle(docs, 7))
    assert got != oracle(docs, 7)  # permuted
    assert all(reads[d] <= spans[d] for d in reads)  # a document is read only by the blocks spanning it
    assert set(reads) == {d for d, doc in enumerate(docs) if doc}


def test_unshuffled_slots_read_each_document_about_once():
    docs = corpus(60, seed=2, low=1, high=12)
    reads: Counter = Counter()
    packed = distshard.pack(IterableWrapper(Counting(docs, reads)), 16)
    reads.clear()
    for rank in range(4):
        list(packed.dist_shard(rank=rank, world_size=4))
    assert set(reads) == set(range(len(docs)))
    assert sum(reads.values()) <= len(docs) + 3  # at most the documents at the 3 slot boundaries twice


# -- resume and elastic resume --------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("even", [None, "drop", "pad"])
@pytest.mark.parametrize("fit", ["concat", "best"])
def test_elastic_resume_is_exact(shuffle, even, fit):
    docs = corpus(50, seed=9, high=17)
    window = 7 if fit == "best" else None
    expected = oracle(docs, 5, eos=-1) if fit == "concat" else best_oracle(docs, 5, -1, window_documents=window)

    def build(rank, world):
        return distshard.pack(IterableWrapper(docs), 5, eos=-1, fit=fit, window_documents=window).dist_shard(
            rank=rank, world_size=world, shuffle=shuffle, even=even, seed=3
        )

    consumed, states = [], []
    for rank in range(2):
        for worker in range(2):
            with as_worker(worker, 2):
                pipe = build(rank, 2)
                it = iter(pipe)
                consumed += [key(next(it)) for _ in range(2 + rank + worker)]
                states.append(pipe.state_dict())
    merged = distshard.merge_states(states)
    rest = []
    for rank in range(3):
        pipe = build(rank, 3)
        pipe.load_state_dict(json.loads(json.dumps(merged)))
        rest += [key(b) for b in pipe]
    got = Counter(consumed + rest)
    assert set(got) <= set(expected)
    if even is None:
        assert got == Counter(expected)
    else:  # (blocks of a lone eos repeat in the oracle of fit="best")
        assert all(n <= Counter(expected)[b] * (1 if even == "drop" else 2) for b, n in got.items())
    if even == "pad":
        assert set(got) == set(expected)


def test_a_slot_resumes_from_its_own_state():
    docs = corpus(20, seed=1)
    pipe = distshard.pack(IterableWrapper(docs), 4).dist_shard(rank=1, world_size=2)
    whole = [key(b) for b in pipe]
    it = iter(pipe)
    first = [key(next(it)) for _ in range(3)]
    state = pipe.state_dict()
    again = distshard.pack(IterableWrapper(docs), 4).dist_shard(rank=1, world_size=2)
    again.load_state_dict(state)
    assert first + [key(b) for b in again] == whole


@pytest.mark.parametrize(
    "other",
    [
        dict(seq_len=5),
        dict(eos=-1),
        dict(shuffle_documents=True),
        dict(pad=-3),
        dict(docs=1),
    ],
)
def test_a_state_of_another_packing_is_refused(other):
    docs = corpus(30, seed=4, low=4, high=4)  # every document 4 tokens: many packings have the same block count
    pipe = distshard.pack(IterableWrapper(docs), 4).dist_shard(rank=0, world_size=2)
    it = iter(pipe)
    next(it)
    state = pipe.state_dict()
    options = {"seq_len": 4, **other}
    changed = options.pop("docs", None)
    data = docs if changed is None else [docs[1], docs[0], *docs[2:]][:-1] + [docs[-1][:3] + [5]]
    seq_len = options.pop("seq_len")
    fresh = distshard.pack(IterableWrapper(data), seq_len, **options).dist_shard(rank=0, world_size=2)
    with pytest.raises(ValueError, match="source|another pipeline"):
        fresh.load_state_dict(state)
        next(iter(fresh))


# -- shuffle_documents ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fit", ["concat", "best"])
def test_shuffle_documents_changes_the_blocks_every_epoch_and_keeps_every_token(fit):
    docs = corpus(40, seed=6)
    all_tokens = Counter(t for d in docs for t in d) + Counter({-1: len(docs)})
    epochs = []
    for epoch in range(3):
        per_world = []
        for world in (1, 3):
            got = []
            for rank in range(world):
                pipe = distshard.pack(
                    IterableWrapper(docs), 6, eos=-1, shuffle_documents=True, seed=2, fit=fit, window=None
                ).dist_shard(rank=rank, world_size=world, shuffle=fit == "best")
                pipe.set_epoch(epoch)
                got += [key(b) for b in pipe]
            assert tokens_of(got) == all_tokens
            per_world.append(sorted(got))
        assert per_world[0] == per_world[1]  # the same blocks at any world size
        epochs.append(per_world[0])
    assert epochs[0] != epochs[1] != epochs[2]
    if fit == "concat":  # padding only in the last block: every block but one is full
        assert sum(1 for b in epochs[0] if 0 in b[2]) <= 1
        return
    # whole documents: a document of at most 6 tokens (its eos included) lies in one block
    short = {d for d, doc in enumerate(docs) if 0 < len(doc) < 6}  # (an empty one holds only its eos, -1)
    for blocks in epochs:
        where = Counter(
            d for ids, _, mask, _ in blocks for d in {t // 1000 for t, m in zip(ids, mask, strict=True) if m and t >= 0}
        )
        assert {where[d] for d in short} == {1}


@pytest.mark.parametrize("fit", ["concat", "best"])
def test_shuffle_documents_resumes_mid_epoch_elastically(fit):
    """The epoch's own packing (with fit="best" its own number of blocks too) is rebuilt
    from (seed, epoch) by the new run: every token of epoch 1 once over both runs."""
    docs = corpus(45, seed=7)

    def build(rank, world):
        return distshard.pack(IterableWrapper(docs), 7, shuffle_documents=True, fit=fit).dist_shard(
            rank=rank, world_size=world, shuffle=True
        )

    consumed, states = [], []
    for rank in range(2):
        pipe = build(rank, 2)
        pipe.set_epoch(1)
        it = iter(pipe)
        consumed += [key(next(it)) for _ in range(3)]
        states.append(pipe.state_dict())
    merged = distshard.merge_states(states)
    for rank in range(4):
        pipe = build(rank, 4)
        pipe.set_epoch(1)
        pipe.load_state_dict(merged)
        consumed += [key(b) for b in pipe]
    alone = build(0, 1)
    alone.set_epoch(1)
    assert tokens_of(consumed) == Counter(t for d in docs for t in d)
    assert Counter(consumed) == Counter(key(b) for b in alone)


def test_shuffle_documents_memory_per_document():
    """The plan: the source's counts and a checkpoint every 128 documents; a shuffled
    order the counts again, in their dtype (4 bytes a document for int32)."""
    import tracemalloc

    counts = np.full(200_000, 37, dtype=np.int32)

    class Counted(IterableWrapper):
        def distshard_token_counts(self):
            return counts

    tracemalloc.start()
    packed = distshard.pack(Counted([]), 2048, shuffle_documents=True)
    base = tracemalloc.get_traced_memory()[0]
    packed.packing()
    shuffled = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert packed._counts.tokens.counts is counts and packed._counts.tokens.nbytes <= 8 * (len(counts) // 128 + 2)
    assert shuffled <= 5 * len(counts)  # the counts in the shuffled order (int32: 4 bytes a document)


# -- sources ---------------------------------------------------------------------------------------------


def test_a_stream_of_documents_is_walked_and_refuses_shuffle():
    docs = corpus(25, seed=11)
    source = IterableWrapper(Stream(docs), deepcopy=False)
    got = []
    for rank in range(3):
        got += [key(b) for b in distshard.pack(source, 6).dist_shard(rank=rank, world_size=3)]
    assert Counter(got) == Counter(oracle(docs, 6))
    with pytest.raises(ValueError, match="shuffle=True over pack.*stream"):
        next(iter(distshard.pack(source, 6).dist_shard(rank=0, world_size=3, shuffle=True)))


def test_token_counts_from_the_source_read_no_document():
    docs = corpus(12, seed=12)
    reads = []

    class Tokens(IterableWrapper):
        def distshard_token_counts(self):
            return np.array([len(d) for d in docs], dtype=np.int32)

    class Logged:
        __distshard_positional__ = True

        def __len__(self):
            return len(docs)

        def __getitem__(self, i):
            reads.append(i)
            return np.array(docs[i], dtype=np.int32)

    packed = distshard.pack(Tokens(Logged()), 5, eos=-1)
    assert reads == [] and packed._counts.how == "source"
    assert [key(b) for b in packed] == oracle(docs, 5, eos=-1)


def test_counts_of_a_file_source_are_cached_by_the_files_identity(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTSHARD_CACHE", str(tmp_path / "cache"))
    docs = corpus(30, seed=13)
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"ids": d}) + "\n" for d in docs))
    first = distshard.pack(distshard.jsonl(str(path)), 8, tokens="ids")
    again = distshard.pack(distshard.jsonl(str(path)), 8, tokens="ids", eos=-1)
    assert (first._counts.how, again._counts.how) == ("counted", "cache")
    got = []
    for rank in range(2):
        got += [key(b) for b in again.dist_shard(rank=rank, world_size=2, shuffle=True)]
    assert Counter(got) == Counter(oracle(docs, 8, eos=-1))
    # a changed file is a new identity: counted again, never read with stale counts
    docs[0] = docs[0] + [1, 2, 3]
    path.write_text("".join(json.dumps({"ids": d}) + "\n" for d in docs))
    os.utime(path, ns=(1, 1))
    changed = distshard.pack(distshard.jsonl(str(path)), 8, tokens="ids")
    assert changed._counts.how == "counted"
    assert [key(b) for b in changed] == oracle(docs, 8)


def test_documents_that_change_after_counting_raise():
    docs = corpus(10, seed=14, low=2, high=6)
    packed = distshard.pack(IterableWrapper(docs, deepcopy=False), 4)
    docs[3].append(99)
    with pytest.raises(ValueError, match="document 3 holds .* were counted"):
        list(packed)


def test_a_mix_of_packed_sources_mixes_blocks_exactly():
    a, b = corpus(20, seed=15), [[-(1000 * i + j) - 1 for j in range(5)] for i in range(12)]
    expected = list(
        distshard.mix(
            {"a": distshard.pack(IterableWrapper(a), 4), "b": distshard.pack(IterableWrapper(b), 4)},
            {"a": 3, "b": 1},
            stop="first_exhausted",
        )
    )
    expected = [key(x) for x in expected]
    assert Counter(expected) <= Counter(oracle(a, 4) + oracle(b, 4))
    got = []
    for rank in range(3):
        for worker in range(2):
            with as_worker(worker, 2):
                mixed = distshard.mix(
                    {"a": distshard.pack(IterableWrapper(a), 4), "b": distshard.pack(IterableWrapper(b), 4)},
                    {"a": 3, "b": 1},
                    stop="first_exhausted",
                )
                got += [key(x) for x in mixed.dist_shard(rank=rank, world_size=3, shuffle=True)]
    assert Counter(got) == Counter(expected)


def test_the_nodes_front_end_reads_packed_blocks():
    from torchdata.nodes import Loader

    docs = corpus(27, seed=16)
    got = []
    for rank in range(2):
        node = distshard.DistShardNode(distshard.pack(IterableWrapper(docs), 6), rank=rank, world_size=2, shuffle=True)
        got += [key(b) for b in Loader(node)]
    assert Counter(got) == Counter(oracle(docs, 6))


# -- bad input ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, error, message",
    [
        (dict(seq_len=0), ValueError, r"seq_len=0 must be at least 1"),
        (dict(seq_len=-3), ValueError, r"seq_len=-3"),
        (dict(seq_len=True), TypeError, r"seq_len=True must be an int"),
        (dict(seq_len=4.0), TypeError, r"seq_len=4.0"),
        (dict(seq_len="4"), TypeError, r"seq_len='4'"),
        (dict(eos=True), TypeError, r"eos=True"),
        (dict(pad=None), TypeError, r"pad=None"),
        (dict(tokens=3), TypeError, r"tokens=3"),
        (dict(shuffle_documents=1), TypeError, r"shuffle_documents=1"),
        (dict(seed=-1), ValueError, r"seed=-1"),
    ],
)
def test_bad_arguments_are_refused_naming_the_value(args, error, message):
    options = {"seq_len": 4, **args}
    seq_len = options.pop("seq_len")
    with pytest.raises(error, match=message):
        distshard.pack(IterableWrapper([[1, 2]]), seq_len, **options)


@pytest.mark.parametrize(
    "docs, tokens, error, message",
    [
        ([{"ids": [1]}, {"text": "x"}], "ids", ValueError, r"document 1 has no field 'ids'.*'text'"),
        ([[1, 2]], "ids", TypeError, r"document 0 is a list, not a mapping with a field 'ids'"),
        ([[1, 2.5]], None, TypeError, r"token 1 of document 0 is 2.5 \(float\)"),
        ([[1], [True]], None, TypeError, r"token 0 of document 1 is True \(bool\)"),
        (["hello"], None, TypeError, r"document 0's tokens are a str \('hello'\)"),
        ([np.array([1.0, 2.0])], None, TypeError, r"document 0's tokens are a 1-D numpy array of float64"),
        ([torch.tensor([[1, 2]])], None, TypeError, r"document 0's tokens are a 2-D tensor"),
        ([{"ids": None}], "ids", TypeError, r"document 0's tokens are a NoneType"),
    ],
)
def test_bad_documents_are_refused_at_construction(docs, tokens, error, message):
    with pytest.raises(error, match=message):
        distshard.pack(IterableWrapper(docs), 4, tokens=tokens)


def test_a_shuffle_upstream_is_refused():
    with pytest.raises(ValueError, match="fixed order.*shuffle_documents=True"):
        distshard.pack(IterableWrapper([[1], [2]]).shuffle(), 4)


def test_not_a_datapipe_is_refused():
    with pytest.raises(TypeError, match="IterDataPipe of documents, got list"):
        distshard.pack([[1, 2]], 4)


# -- explain ---------------------------------------------------------------------------------------------------


def test_explain_says_tokens_blocks_padding_and_what_a_block_reads():
    docs = corpus(30, seed=17)
    text = str(distshard.explain(distshard.pack(IterableWrapper(docs), 8, eos=-1).dist_shard(rank=1, world_size=2)))
    packed = distshard.pack(IterableWrapper(docs), 8, eos=-1)
    plan = packed.packing()
    assert f"{plan.blocks} blocks of 8 tokens" in text
    assert f"{plan.padding} padding tokens in the last block" in text
    assert "blocks per slot" in text
    first = -(-plan.blocks // 2)
    d0, d1 = plan.documents_of(first)
    assert f"block {first} reads documents {d0}..{d1}" in text


def test_shuffle_documents_in_real_dataloader_workers():
    """Forked workers seed the document order alike (dist_shard seeds it, whatever
    torch's DataLoader handed them): every token once, the same blocks as in-process."""
    docs = corpus(33, seed=18)
    got, alone = [], []
    for rank in range(2):
        pipe = distshard.pack(IterableWrapper(docs), 8, eos=-1, shuffle_documents=True, seed=5).dist_shard(
            rank=rank, world_size=2
        )
        pipe.set_epoch(1)
        loader = DataLoader(pipe, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60)
        got += [key(b) for b in loader]
    single = distshard.pack(IterableWrapper(docs), 8, eos=-1, shuffle_documents=True, seed=5).dist_shard(
        rank=0, world_size=1
    )
    single.set_epoch(1)
    alone = [key(b) for b in single]
    assert Counter(got) == Counter(alone)
    assert tokens_of(got) == Counter(t for d in docs for t in d) + Counter({-1: len(docs)})


# -- fit="best": whole documents ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "seq_len, eos, window, window_documents",
    [(4, None, None, None), (5, -1, 12, None), (8, 7, None, 5), (1, None, 3, None), (16, -1, 40, None)],
)
def test_best_blocks_are_whole_documents_by_best_fit(seq_len, eos, window, window_documents):
    docs = corpus(40, seed=21, low=0, high=19)
    packed = distshard.pack(
        IterableWrapper(docs), seq_len, eos=eos, pad=-9, fit="best", window=window, window_documents=window_documents
    )
    got = [key(b) for b in packed]
    assert got == best_oracle(docs, seq_len, eos, -9, window, window_documents)
    assert len(packed) == len(got)
    assert tokens_of(got) == tokens_of(oracle(docs, seq_len, eos))  # the same tokens as concat, each once


def test_best_cuts_only_documents_longer_than_a_block():
    docs = [[100 * i + j for j in range(n)] for i, n in enumerate([3, 9, 2, 4, 1, 6, 4, 3])]
    blocks = [key(b) for b in distshard.pack(IterableWrapper(docs), 4, fit="best")]
    runs = Counter()  # how many blocks hold tokens of each document
    for ids, _, mask, segments in blocks:
        runs.update({t // 100 for t, m in zip(ids, mask, strict=True) if m})
        assert list(segments) == sorted(segments, key=lambda s: (s == 0, s))  # 1, 1, 2, ..., then padding 0
    assert {d for d, n in runs.items() if n > 1} == {1, 5}  # 9 and 6 tokens: the only ones longer than 4
    assert runs[1] == 3 and runs[5] == 2  # 4 + 4 + 1, 4 + 2


@pytest.mark.parametrize(
    "first, second",
    [
        (dict(), dict(fit="best")),
        (dict(fit="best"), dict()),
        (dict(fit="best"), dict(fit="best", window=64)),
        (dict(fit="best", window=64), dict(fit="best", window_documents=64)),
    ],
    ids=["concat-to-best", "best-to-concat", "window", "window-kind"],
)
def test_a_state_of_another_fit_or_window_is_refused(first, second):
    docs = corpus(30, seed=4, low=4, high=4)  # every document 4 tokens: every fit and window packs 30 blocks
    assert len(distshard.pack(IterableWrapper(docs), 4, **first)) == len(
        distshard.pack(IterableWrapper(docs), 4, **second)
    )
    pipe = distshard.pack(IterableWrapper(docs), 4, **first).dist_shard(rank=0, world_size=2)
    it = iter(pipe)
    next(it)
    state = pipe.state_dict()
    fresh = distshard.pack(IterableWrapper(docs), 4, **second).dist_shard(rank=0, world_size=2)
    with pytest.raises(ValueError, match="source|another pipeline"):
        fresh.load_state_dict(state)
        next(iter(fresh))


def test_carry_and_mix_refuse_a_length_that_changes_every_epoch():
    packed = distshard.pack(IterableWrapper(corpus(20, seed=24)), 6, fit="best", shuffle_documents=True)
    with pytest.raises(ValueError, match="even='carry' needs the same length every epoch"):
        next(iter(packed.dist_shard(rank=0, world_size=2, even="carry")))
    with pytest.raises(ValueError, match="changes its length from epoch to epoch"):
        distshard.mix({"a": packed, "b": IterableWrapper([1, 2])}, {"a": 1, "b": 1}).dist_shard(rank=0, world_size=1)
    fixed = distshard.pack(IterableWrapper(corpus(20, seed=24)), 6, fit="best")  # one packing: carry works
    assert len(list(fixed.dist_shard(rank=0, world_size=1, even="carry"))) == len(fixed)


def test_best_over_a_stream_walks_it_forward():
    """The documents a window's blocks hold come in any order; a slot asks for a
    window's documents together, ascending, so a stream is walked once per slot."""
    docs = corpus(40, seed=25, low=1, high=12)
    walks = []

    class Walked:
        def __iter__(self):
            walks.append(1)
            return iter(docs)

    source = IterableWrapper(Walked(), deepcopy=False)
    packed = distshard.pack(source, 6, fit="best", window=30)
    walks.clear()  # the counting pass
    got = []
    for rank in range(2):
        got += [key(b) for b in packed.dist_shard(rank=rank, world_size=2)]
    assert Counter(got) == Counter(best_oracle(docs, 6, window=30))
    assert len(walks) <= 2


def test_best_slots_read_each_document_about_once():
    docs = corpus(80, seed=26, low=1, high=30)
    reads: Counter = Counter()
    packed = distshard.pack(IterableWrapper(Counting(docs, reads)), 8, fit="best", window=48)
    reads.clear()
    for rank in range(4):
        list(packed.dist_shard(rank=rank, world_size=4))
    longer = sum(1 for d in docs if len(d) > 8)
    assert set(reads) == set(range(len(docs)))
    # once, except documents of a window that two slots share, and long ones whose pieces another slot has
    assert sum(reads.values()) <= len(docs) + 3 * 6 + longer


def test_a_mix_of_best_packs_mixes_blocks_exactly():
    a, b = corpus(30, seed=27, high=9), [[-(1000 * i + j) - 1 for j in range(1 + i % 6)] for i in range(20)]

    def make():
        return distshard.mix(
            {
                "a": distshard.pack(IterableWrapper(a), 5, fit="best"),
                "b": distshard.pack(IterableWrapper(b), 5, fit="best"),
            },
            {"a": 2, "b": 1},
            stop="first_exhausted",
        )

    expected = Counter(key(x) for x in make())
    assert expected <= Counter(best_oracle(a, 5) + best_oracle(b, 5))
    got = []
    for rank in range(2):
        got += [key(x) for x in make().dist_shard(rank=rank, world_size=2, shuffle=True)]
    assert Counter(got) == expected


def test_best_in_real_dataloader_workers():
    docs = corpus(37, seed=28, low=0, high=20)
    got = []
    for rank in range(2):
        pipe = distshard.pack(IterableWrapper(docs), 8, eos=-1, fit="best", window=32).dist_shard(
            rank=rank, world_size=2, shuffle=True
        )
        loader = DataLoader(pipe, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60)
        got += [key(b) for b in loader]
    assert Counter(got) == Counter(best_oracle(docs, 8, -1, window=32))


@pytest.mark.parametrize(
    "args, error, message",
    [
        (dict(fit="first"), ValueError, r"fit='first' is not one of \('concat', 'best'\)"),
        (dict(fit=None), TypeError, r"fit=None must be one of"),
        (dict(window=64), ValueError, r"window= applies to fit='best' only"),
        (dict(window_documents=3), ValueError, r"window_documents= applies to fit='best' only"),
        (dict(fit="best", window=0), ValueError, r"window=0 must be at least 1"),
        (dict(fit="best", window=2.5), TypeError, r"window=2.5 must be an int"),
        (dict(fit="best", window_documents=0), ValueError, r"window_documents=0 must be at least 1"),
        (dict(fit="best", window=8, window_documents=2), ValueError, r"not both"),
    ],
)
def test_bad_fit_arguments_are_refused_naming_the_value(args, error, message):
    with pytest.raises(error, match=message):
        distshard.pack(IterableWrapper([[1, 2]]), 4, **args)


def test_explain_says_how_best_fit_packed():
    docs = corpus(30, seed=29)
    text = str(distshard.explain(distshard.pack(IterableWrapper(docs), 8, fit="best").dist_shard(rank=0, world_size=2)))
    plan = distshard.pack(IterableWrapper(docs), 8, fit="best").packing()
    assert f"{plan.blocks} blocks of 8 tokens" in text
    assert "best fit" in text and f"{plan.padding} padding tokens" in text


# -- packed_collate ----------------------------------------------------------------------------------------


def collate_reference(blocks):
    """cu_seqlens, max_seqlen and the flattened positions, token by token."""
    starts, positions, at = [], [], 0
    for block in blocks:
        segments = block["segment_ids"].tolist()
        for i, s in enumerate(segments):
            if i == 0 or s != segments[i - 1]:
                starts.append(at)
            positions.append(at - starts[-1])
            at += 1
    bounds = starts + [at]
    return bounds, max(b - a for a, b in zip(bounds, bounds[1:], strict=False)), positions


@pytest.mark.parametrize("fit", ["concat", "best"])
@pytest.mark.parametrize("seq_len", [1, 5, 16])
def test_packed_collate_is_the_reference(fit, seq_len):
    docs = corpus(25, seed=30, low=0, high=22)
    blocks = list(distshard.pack(IterableWrapper(docs), seq_len, eos=-1, fit=fit))
    for size in (1, 3, len(blocks)):
        batch = blocks[:size]
        got = distshard.packed_collate(batch)
        bounds, longest, positions = collate_reference(batch)
        assert got["cu_seqlens"].dtype == torch.int32 and got["cu_seqlens"].tolist() == bounds
        assert got["max_seqlen"] == longest and isinstance(got["max_seqlen"], int)
        assert got["flat_position_ids"].shape == (1, size * seq_len)
        assert got["flat_position_ids"].tolist() == [positions]
        for name in FIELDS:
            assert torch.equal(got[name], torch.stack([b[name] for b in batch]))
        # HF finds its sequences where the flattened positions are 0: the same ones
        assert torch.nonzero(got["flat_position_ids"][0] == 0).reshape(-1).tolist() == bounds[:-1]
        # and a stacked batch (the default collate's) gives the same
        stacked = {name: torch.stack([b[name] for b in batch]) for name in FIELDS}
        again = distshard.packed_collate(stacked)
        assert again["cu_seqlens"].tolist() == bounds and torch.equal(
            again["flat_position_ids"], got["flat_position_ids"]
        )


def test_packed_collate_in_a_dataloader():
    docs = corpus(30, seed=31, low=1, high=14)
    pipe = distshard.pack(IterableWrapper(docs), 8, fit="best").dist_shard(rank=0, world_size=1)
    loader = DataLoader(pipe, batch_size=4, collate_fn=distshard.packed_collate)
    batches = list(loader)
    assert sum(b["input_ids"].shape[0] for b in batches) == len(pipe)
    for b in batches:
        assert int(b["cu_seqlens"][-1]) == b["input_ids"].numel()


@pytest.mark.parametrize(
    "batch, error, message",
    [
        ([], ValueError, r"got no blocks"),
        ("blocks", TypeError, r"takes a list of blocks"),
        ([{"input_ids": torch.zeros(3)}], ValueError, r"missing \['position_ids', 'loss_mask', 'segment_ids'\]"),
    ],
)
def test_packed_collate_refuses_what_is_not_blocks(batch, error, message):
    with pytest.raises(error, match=message):
        distshard.packed_collate(batch)


def test_without_numpy_blocks_are_built_in_torch_alike(monkeypatch):

    from distshard import packing

    docs = corpus(20, seed=32, low=0, high=9)
    tensors = [torch.tensor(d, dtype=torch.int64) for d in docs]
    fast = [key(b) for b in distshard.pack(IterableWrapper(tensors), 5, eos=-1, pad=-9)]
    monkeypatch.setattr(packing, "numpy_module", lambda: None)  # the arithmetic and the blocks
    assert (
        [key(b) for b in distshard.pack(IterableWrapper(tensors), 5, eos=-1, pad=-9)] == fast == oracle(docs, 5, -1, -9)
    )


def test_the_length_of_best_with_shuffle_documents_is_the_epochs_or_refused():
    docs = corpus(45, seed=34, low=1, high=13)

    def build(seed):
        return distshard.pack(IterableWrapper(docs), 7, fit="best", window=30, shuffle_documents=True).dist_shard(
            rank=0, world_size=1, seed=seed
        )

    lengths = set()
    for epoch in range(4):
        pipe = build(5)
        pipe.set_epoch(epoch)
        assert len(pipe) == len(list(pipe))  # asked before the epoch starts: the epoch's own
        lengths.add(len(pipe))
    assert len(lengths) > 1  # (the number of blocks does change with the epoch here)
    with pytest.raises(TypeError, match="no length before its epoch starts.*dist_shard\\(seed=...\\)"):
        len(build(None))
