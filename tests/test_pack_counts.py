"""The token counts cache of ``distshard.pack`` over file sources: keyed by what the maps
and the token picker compute, not by their names; a callable that cannot be keyed is
not cached; counts a block finds wrong drop their entry, so the next job counts again.
"""

from __future__ import annotations

import functools
import json
import logging
import operator
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

import distshard

from .pack_blocks import key, oracle
from .source_factories import isolated_cache as cache  # noqa: F401  (autouse)

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 2  # read by limited(): a global its code names


def write_docs(path: Path, n: int = 24) -> list[dict]:
    """Documents ``{"ids": [...], "other": [...]}`` of 1 to 6 and 2 to 9 distinct tokens."""
    docs = [
        {"ids": [100 * i + j for j in range(1 + i % 6)], "other": [-100 * i - j for j in range(2 + i % 8)]}
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return docs


def entries(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "index").glob("*.pack-counts.*.idx"))


# -- callables that count differently but look alike by name ---------------------------------


def same_named_classes() -> tuple[object, object]:
    """Instances of two classes of the same module and name, with other code."""
    made = []
    for width in (1, 2):
        scope: dict = {}
        exec(f"class Tokens:\n    def __call__(self, d):\n        return d['ids'] * {width}\n", scope)
        scope["Tokens"].__module__ = "corpus_tools"
        made.append(scope["Tokens"]())
    return made[0], made[1]


def ids(d: dict) -> list:
    return d["ids"]


def other(d: dict) -> list:
    return d["other"]


def cut(d: dict, n: int) -> list:
    return d["ids"][:n]


def cut_first(n: int, d: dict) -> list:
    return d["ids"][:n]


def closure(n: int):
    def picked(d):
        return d["ids"][:n]

    return picked


def with_default(n: int):
    def picked(d, n=n):
        return d["ids"][:n]

    return picked


def with_kwdefault(n: int):
    def picked(d, *, n=n):
        return d["ids"][:n]

    return picked


class Cut:
    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, d: dict) -> list:
        return d["ids"][: self.n]

    def pick(self, d: dict) -> list:
        return d["ids"][: self.n]


def limited(d: dict) -> list:
    return d["ids"][:LIMIT]


PAIRS = {
    "classes of one name": same_named_classes,
    "partials of two functions": lambda: (functools.partial(ids), functools.partial(other)),
    "partial arguments": lambda: (functools.partial(cut, n=1), functools.partial(cut, n=3)),
    "partial positional arguments": lambda: (functools.partial(cut_first, 1), functools.partial(cut_first, 3)),
    "closure cells": lambda: (closure(1), closure(4)),
    "defaults": lambda: (with_default(1), with_default(4)),
    "keyword defaults": lambda: (with_kwdefault(1), with_kwdefault(4)),
    "instances' state": lambda: (Cut(1), Cut(3)),
    "bound methods": lambda: (Cut(1).pick, Cut(3).pick),
    "builtins": lambda: (operator.itemgetter("ids"), operator.itemgetter("other")),
}


@pytest.mark.parametrize("where", ["map", "tokens"])
@pytest.mark.parametrize("pair", list(PAIRS))
def test_callables_that_count_differently_get_their_own_counts(tmp_path, where, pair):
    docs = write_docs(tmp_path / "docs.jsonl")
    first, second = PAIRS[pair]()

    def packed(fn):
        source = distshard.jsonl(str(tmp_path / "docs.jsonl"))
        return distshard.pack(source.map(fn), 4) if where == "map" else distshard.pack(source, 4, tokens=fn)

    assert packed(first)._counts.how == "counted"
    again = packed(second)
    assert again._counts.how == "counted"  # never the first one's counts
    assert [key(b) for b in again] == oracle([second(d) for d in docs], 4)
    assert packed(second)._counts.how == "cache"  # and a callable that computes alike finds its own


def test_a_global_the_code_names_is_part_of_the_key(tmp_path, monkeypatch):
    docs = write_docs(tmp_path / "docs.jsonl")
    source = distshard.jsonl(str(tmp_path / "docs.jsonl"))
    assert distshard.pack(source.map(limited), 4)._counts.how == "counted"
    monkeypatch.setattr(sys.modules[__name__], "LIMIT", 5)
    again = distshard.pack(source.map(limited), 4)
    assert again._counts.how == "counted"
    assert [key(b) for b in again] == oracle([d["ids"][:5] for d in docs], 4)


def test_the_map_columns_are_part_of_the_key(tmp_path):
    docs = write_docs(tmp_path / "docs.jsonl")
    source = distshard.jsonl(str(tmp_path / "docs.jsonl"))
    assert distshard.pack(source.map(sorted, input_col="ids"), 4, tokens="ids")._counts.how == "counted"
    again = distshard.pack(source.map(sorted, input_col="other", output_col="ids"), 4, tokens="ids")
    assert again._counts.how == "counted"
    assert [key(b) for b in again] == oracle([sorted(d["other"]) for d in docs], 4)


STOPS = frozenset({"alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta"})


def stopped(d: dict) -> list:
    return [t for t in d["ids"] if t % 7 not in {1, 3, 5}] if "alpha" in STOPS else []


def cross_process_packs(path: str) -> dict[str, str]:
    """How each pack found its counts (run in this process and in a fresh one)."""
    source = distshard.jsonl(path)
    made = {
        "function": distshard.pack(source.map(stopped), 4),
        "lambda": distshard.pack(
            source.map(lambda d: [t for t in d["ids"] if str(t)[-1] not in {"1", "2", "3", "4", "5", "6", "7"}]), 4
        ),
        "partial": distshard.pack(source, 4, tokens=functools.partial(cut, n=2)),
        "instance": distshard.pack(source, 4, tokens=Cut(3)),
        "builtin": distshard.pack(source, 4, tokens=operator.itemgetter("other")),
    }
    return {name: pack._counts.how for name, pack in made.items()}


def test_a_key_is_the_same_in_another_process(tmp_path, cache):  # noqa: F811
    """The cache is found again by the next job: another interpreter, another hash seed."""
    write_docs(tmp_path / "docs.jsonl")
    seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    script = f"import json, tests.test_pack_counts as t; print(json.dumps(t.cross_process_packs({str(tmp_path / 'docs.jsonl')!r})))"
    env = {**os.environ, "PYTHONHASHSEED": seed, "DISTSHARD_CACHE": str(cache)}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert set(json.loads(done.stdout.splitlines()[-1]).values()) == {"counted"}
    assert cross_process_packs(str(tmp_path / "docs.jsonl")) == dict.fromkeys(
        ["function", "lambda", "partial", "instance", "builtin"], "cache"
    )


class Locked:
    """A picker holding a lock: its state cannot be read, so it cannot be keyed."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __call__(self, d: dict) -> list:
        with self.lock:
            return d["ids"]


def test_a_callable_that_cannot_be_keyed_is_counted_every_time_and_logged(tmp_path, cache, caplog):  # noqa: F811
    docs = write_docs(tmp_path / "docs.jsonl")
    source = distshard.jsonl(str(tmp_path / "docs.jsonl"))
    with caplog.at_level(logging.DEBUG, logger="distshard"):
        first = distshard.pack(source, 4, tokens=Locked())
        again = distshard.pack(source.map(Locked()), 4)
    assert (first._counts.how, again._counts.how) == ("counted", "counted")
    assert entries(cache) == []
    said = [r.getMessage() for r in caplog.records if "not cached" in r.getMessage()]
    assert len(said) == 2 and all("_thread.lock" in s and "cannot be keyed faithfully" in s for s in said), said
    assert "tokens=" in said[0] and "the map" in said[1]
    assert [key(b) for b in again] == oracle([d["ids"] for d in docs], 4)


# -- counts a block finds wrong ------------------------------------------------------------------


def from_environment(d: dict) -> list:
    """Tokens cut at $PACK_TEST_CUT: what decides the count is outside anything a key reads."""
    return d["ids"][: int(os.environ["PACK_TEST_CUT"])]


def blocks_in_a_worker(pipe) -> list:
    loader = DataLoader(pipe, batch_size=None, num_workers=1, multiprocessing_context="fork", timeout=60)
    blocks = iter(loader)
    try:
        return list(blocks)
    finally:
        blocks._shutdown_workers()  # type: ignore[attr-defined]  # now, not when the traceback that holds it is collected


@pytest.mark.parametrize("read", ["in-process", "dataloader-worker"])
@pytest.mark.parametrize("changed", ["after-caching", "after-counting"])
def test_counts_found_wrong_drop_their_entry_and_the_next_pack_counts_again(
    tmp_path, cache, monkeypatch, read, changed
):  # noqa: F811
    docs = write_docs(tmp_path / "docs.jsonl")
    source = distshard.jsonl(str(tmp_path / "docs.jsonl"))
    monkeypatch.setenv("PACK_TEST_CUT", "2")
    stale = distshard.pack(source.map(from_environment), 4)
    assert stale._counts.how == "counted" and len(entries(cache)) == 1
    monkeypatch.setenv("PACK_TEST_CUT", "5")
    if changed == "after-caching":  # a later job reads the counts of another behaviour from the cache
        stale = distshard.pack(source.map(from_environment), 4)
        assert stale._counts.how == "cache"
    iterate = list if read == "in-process" else blocks_in_a_worker
    with pytest.raises(
        distshard.errors.SourceChangedError, match=r"holds \d+ tokens but \d+ were counted.*pack-counts.*is now deleted"
    ):
        iterate(stale.dist_shard(rank=0, world_size=1))
    assert entries(cache) == []
    fresh = distshard.pack(source.map(from_environment), 4)
    assert fresh._counts.how == "counted"
    assert [key(b) for b in fresh] == oracle([d["ids"][:5] for d in docs], 4)


def test_counts_not_cached_say_so_without_a_deleted_entry():
    from torch.utils.data.datapipes.iter import IterableWrapper

    docs = [[1, 2, 3], [4, 5]]
    packed = distshard.pack(IterableWrapper(docs, deepcopy=False), 2)
    docs[1].append(6)
    with pytest.raises(distshard.errors.SourceChangedError, match="document 1 holds 3 tokens but 2") as raised:
        list(packed)
    assert "deleted" not in str(raised.value) and "build the pack again" in str(raised.value)
