"""``distshard.pack(distshard.tokens(...), L)``: a Megatron corpus packed in place.

The token counts come from the ``.idx`` files (``distshard_token_counts()``), so
building the packing opens no ``.bin``; the blocks are those of the concatenation of
the sequences, every token once over ranks x workers, resumed elastically.
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
from .source_factories import isolated_cache as cache  # noqa: F401  (autouse)
from .test_pack import key, oracle, tokens_of
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
