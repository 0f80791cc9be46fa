"""``distshard.pack(distshard.tokens(...), L)``: a Megatron corpus packed in place.

The token counts come from the ``.idx`` files (``distshard_token_counts()``), so
building the packing opens no ``.bin``; the blocks are those of the concatenation of
the sequences, every token once over ranks x workers, resumed elastically. Token dtypes:
a float corpus is refused from its ``.idx`` at construction; unsigned ids (a uint16
corpus as numpy arrays or, through ``torch.from_numpy``, as tensors; uint32, uint64)
are integer tokens, copied by value.
"""

from __future__ import annotations

import builtins
import json
import os
from collections import Counter

import numpy as np
import pytest

import distshard

from .helpers import as_worker
from .pack_blocks import key, oracle, tokens_of
from .source_factories import isolated_cache as cache  # noqa: F401  (autouse)
from .token_files import sequences_for, write_indexed


def corpus(tmp_path, pairs: int = 3, per_pair: int = 40) -> tuple[list[str], list[list[int]]]:
    prefixes, documents = [], []
    for p in range(pairs):
        sequences = sequences_for(per_pair, "uint16", seed=p)
        sequences = [s + np.uint16(100 * p) for s in sequences]  # distinct across pairs
        write_indexed(tmp_path / f"corpus-{p}", sequences, "uint16")
        prefixes.append(str(tmp_path / f"corpus-{p}"))
        documents += [[int(t) for t in s] for s in sequences]
    return prefixes, documents


@pytest.fixture
def bins_opened(monkeypatch):
    """The .bin files opened (by path) or read (by descriptor) from now on."""
    seen: list[str] = []
    fds: dict[int, str] = {}
    real_open, real_os_open, real_pread = builtins.open, os.open, os.pread

    def spy_open(file, *args, **kwargs):
        if str(file).endswith(".bin"):
            seen.append(str(file))
        return real_open(file, *args, **kwargs)

    def spy_os_open(path, *args, **kwargs):
        fd = real_os_open(path, *args, **kwargs)
        fds[fd] = str(path)
        return fd

    def spy_pread(fd, n, offset):
        if fds.get(fd, "").endswith(".bin"):
            seen.append(fds[fd])
        return real_pread(fd, n, offset)

    monkeypatch.setattr(builtins, "open", spy_open)
    monkeypatch.setattr(os, "open", spy_os_open)
    monkeypatch.setattr(os, "pread", spy_pread)
    return seen


def test_packing_a_token_corpus_reads_its_counts_from_the_idx_alone(tmp_path, bins_opened):
    prefixes, documents = corpus(tmp_path)
    bins_opened.clear()  # writing the corpus opened them
    packed = distshard.pack(distshard.tokens(prefixes), 16, eos=65535)
    assert packed.total_tokens == sum(len(d) + 1 for d in documents)
    assert bins_opened == []  # the plan is known before the first block, without a data pass
    assert [key(b) for b in packed] == oracle(documents, 16, eos=65535)
    assert bins_opened  # the blocks did read the .bin files


@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffle"])
def test_every_token_once_over_slots_and_an_elastic_resume(tmp_path, shuffle):
    prefixes, documents = corpus(tmp_path)
    expected = Counter(t for d in documents for t in d)

    def make():
        # (rank and world size explicit: an earlier test may have left a process group up)
        return distshard.pack(distshard.tokens(prefixes), 8).dist_shard(shuffle=shuffle, seed=3, rank=0, world_size=1)

    read: list = []
    states = []
    for worker in range(4):  # 2 ranks x 2 workers, simulated; each slot stops after 3 blocks
        rank, wid = divmod(worker, 2)
        with as_worker(wid, 2):
            pipe = distshard.StatefulPipeline(
                distshard.pack(distshard.tokens(prefixes), 8).dist_shard(
                    shuffle=shuffle, seed=3, rank=rank, world_size=2
                )
            )
            it = iter(pipe)
            read += [key(next(it)) for _ in range(3)]
            states.append(json.loads(json.dumps(pipe.state_dict())))
    merged = distshard.merge_states(states)
    for worker in range(3):  # resumed on 1 rank x 3 workers
        with as_worker(worker, 3):
            pipe = distshard.StatefulPipeline(make())
            pipe.load_state_dict(merged)
            read += [key(b) for b in pipe]
    assert tokens_of(read) == expected
    assert len(read) == len(oracle(documents, 8))


# -- token dtypes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, code", [("float32", 7), ("float64", 6)])
def test_a_float_corpus_is_refused_at_construction_naming_the_pair_and_its_dtype(tmp_path, bins_opened, dtype, code):
    write_indexed(tmp_path / "ints", sequences_for(10, "int32"), "int32")
    write_indexed(tmp_path / "floats", sequences_for(10, dtype), dtype)
    bins_opened.clear()
    source = distshard.tokens([str(tmp_path / "ints"), str(tmp_path / "floats")])
    with pytest.raises(TypeError, match=rf"floats\.idx: dtype code {code} \({dtype}\).*not token ids.*integer dtype"):
        distshard.pack(source, 8)
    assert bins_opened == []  # refused from the .idx alone, before a block
    assert len(source.lengths()) == 20  # lengths() still reads any dtype (mix(cost=...))


def high_corpus(tmp_path, dtype: str = "uint16") -> tuple[str, list[list[int]]]:
    """A pair of ids up to 65,535 (the top half of uint16 included: a signed reading would wrap them)."""
    sequences = [np.array([65535 - i, 40000 + i, *range(i % 5)], dtype) for i in range(30)]
    write_indexed(tmp_path / "high", sequences, dtype)
    return str(tmp_path / "high"), [[int(t) for t in s] for s in sequences]


@pytest.mark.parametrize("how", ["numpy", "map-from-numpy", "tokens-from-numpy"])
def test_a_uint16_corpus_packs_as_numpy_arrays_and_as_tensors(tmp_path, how):
    import torch

    prefix, documents = high_corpus(tmp_path)
    source = distshard.tokens(prefix)
    if how == "map-from-numpy":
        source = source.map(torch.from_numpy)
    picker = torch.from_numpy if how == "tokens-from-numpy" else None
    packed = distshard.pack(source, 8, tokens=picker, eos=0)
    assert packed._counts.how == ("source" if how == "numpy" else "counted")
    assert [key(b) for b in packed] == oracle(documents, 8, eos=0)
    got = []
    for rank in range(2):
        got += [
            key(b)
            for b in distshard.pack(source, 8, tokens=picker, eos=0).dist_shard(rank=rank, world_size=2, shuffle=True)
        ]
    assert sorted(got) == sorted(oracle(documents, 8, eos=0))
    if how != "numpy":  # torch.from_numpy keyed by name and torch's version: found again
        assert distshard.pack(source, 8, tokens=picker)._counts.how == "cache"


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "uint64"])
@pytest.mark.parametrize("kind", ["numpy", "tensor"])
def test_unsigned_token_ids_are_integer_tokens(dtype, kind):
    import torch
    from torch.utils.data.datapipes.iter import IterableWrapper

    top = {"uint16": 65535, "uint32": 4_294_967_295, "uint64": (1 << 63) - 1}[dtype]
    documents = [[top - i, i, 7] for i in range(9)]
    arrays = [np.array(d, dtype) for d in documents]
    docs = arrays if kind == "numpy" else [torch.from_numpy(a) for a in arrays]
    assert [key(b) for b in distshard.pack(IterableWrapper(docs), 4)] == oracle(documents, 4)


@pytest.mark.parametrize("kind", ["numpy", "tensor"])
def test_a_uint64_id_an_int64_block_cannot_hold_is_refused(kind):
    import torch
    from torch.utils.data.datapipes.iter import IterableWrapper

    arrays = [np.array([1, 2], np.uint64), np.array([3, 1 << 63], np.uint64)]
    docs = arrays if kind == "numpy" else [torch.from_numpy(a) for a in arrays]
    with pytest.raises(ValueError, match=r"token 1 of document 1 is 9223372036854775808 \(uint64\), above"):
        distshard.pack(IterableWrapper(docs), 4)


@pytest.mark.parametrize("bad", [1 << 63, -(1 << 63) - 1])
def test_a_list_id_an_int64_block_cannot_hold_is_refused_naming_it(bad):
    from torch.utils.data.datapipes.iter import IterableWrapper

    pipe = distshard.pack(IterableWrapper([[1, 2], [3, bad, 4]]), 2)
    with pytest.raises(ValueError, match=rf"token 1 of document 1 is {bad}, outside the ids an int64 block holds"):
        list(pipe)


def test_best_fit_over_a_token_corpus_reads_the_idx_alone_and_resumes_elastically(tmp_path, bins_opened):
    """fit="best" plans from the .idx counts (no .bin opened), keeps every sequence of at
    most a block whole, and an elastic resume gives every token once."""
    from .packing_oracle import reference_best_fit

    prefixes, documents = corpus(tmp_path)
    bins_opened.clear()
    packed = distshard.pack(distshard.tokens(prefixes), 16, fit="best", window=64)
    assert len(packed) == len(reference_best_fit([len(d) for d in documents], 16, 64))
    assert bins_opened == []
    read, states = [], []
    for worker in range(4):  # 2 ranks x 2 workers, simulated; each slot stops after 2 blocks
        rank, wid = divmod(worker, 2)
        with as_worker(wid, 2):
            pipe = distshard.StatefulPipeline(
                distshard.pack(distshard.tokens(prefixes), 16, fit="best", window=64).dist_shard(
                    shuffle=True, seed=3, rank=rank, world_size=2
                )
            )
            it = iter(pipe)
            read += [key(next(it)) for _ in range(2)]
            states.append(json.loads(json.dumps(pipe.state_dict())))
    merged = distshard.merge_states(states)
    for worker in range(3):
        with as_worker(worker, 3):
            pipe = distshard.StatefulPipeline(
                distshard.pack(distshard.tokens(prefixes), 16, fit="best", window=64).dist_shard(
                    shuffle=True, seed=3, rank=0, world_size=1
                )
            )
            pipe.load_state_dict(merged)
            read += [key(b) for b in pipe]
    assert tokens_of(read) == Counter(t for d in documents for t in d)
    assert len(read) == len(packed)
    whole = {tuple(d) for d in documents if 0 < len(d) <= 16}  # (an empty one holds no segment)
    in_blocks = set()
    for ids, _, _, segments in read:
        for s in set(segments) - {0}:
            in_blocks.add(tuple(t for t, g in zip(ids, segments, strict=True) if g == s))
    assert whole <= in_blocks  # every sequence of at most 16 tokens is one segment of one block
