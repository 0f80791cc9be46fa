"""The lazy expansion of a brace pattern against the eager one it stands for."""

from __future__ import annotations

import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from distshard.digests import ListHead, stable_digest, stable_text
from distshard.sources.transport.brace_list import BraceList, lazy_braceexpand
from distshard.sources.transport.urls import braceexpand

_WORD = st.text(alphabet="abxyz./-_0123456789:", max_size=4)


@st.composite
def _range(draw: st.DrawFn) -> str:
    first = draw(st.integers(-12, 30))
    last = draw(st.integers(-12, 30))
    pad = draw(st.sampled_from(["", "0", "00"]))
    step = draw(st.sampled_from(["", "..2", "..3", "..0", "..-2"]))
    return "{" + (pad + str(first) if first >= 0 else str(first)) + ".." + str(last) + step + "}"


_GROUP = st.one_of(_range(), st.lists(_WORD, min_size=2, max_size=4).map(lambda ws: "{" + ",".join(ws) + "}"))
_PATTERN = st.lists(st.one_of(_WORD, _GROUP), max_size=4).map("".join)


@settings(max_examples=400, deadline=None)
@given(_PATTERN, st.data())
def test_lazy_is_the_eager_expansion(pattern: str, data: st.DataObject) -> None:
    lazy = lazy_braceexpand(pattern)
    eager = braceexpand(pattern)
    if lazy is None:  # a pattern the lazy form does not cover: the caller expands it eagerly
        return
    assert len(lazy) == len(eager)
    assert list(lazy) == eager
    assert [lazy[k] for k in range(-len(eager), len(eager))] == eager + eager
    start, stop = data.draw(st.integers(-40, 40)), data.draw(st.integers(-40, 40))
    step = data.draw(st.sampled_from([1, 2, -1, -3]))
    assert lazy[start:stop:step] == eager[start:stop:step]
    assert lazy == eager and eager == lazy
    assert pickle.loads(pickle.dumps(lazy)) == lazy
    assert stable_text(ListHead(lazy, len(lazy)), [64]) == stable_text(eager, [64])


def test_shard_patterns_are_covered_and_small() -> None:
    lazy = BraceList("s3://bench/data/shard-{0000000..9999999}.tar")
    assert len(lazy) == 10**7
    assert lazy[0] == "s3://bench/data/shard-0000000.tar" and lazy[-1] == "s3://bench/data/shard-9999999.tar"
    assert len(pickle.dumps(lazy)) < 200
    assert stable_digest(ListHead(lazy, len(lazy))) == stable_digest(
        ListHead(["s3://bench/data/shard-%07d.tar" % k for k in range(8)], 10**7)
    )
    assert BraceList("x{0..3}") == BraceList("x{0,1,2,3}")
    assert BraceList("x{0..3}") != BraceList("x{0..4}") and BraceList("x{0..3}") != ["x0", "x1", "x2", "x9"]


def test_uncovered_patterns_fall_back() -> None:
    for pattern in ["a{b,{c,d}}", "{a..e}", "{x}", "lit\\{a,b\\}", "{{a,b}}"]:
        assert lazy_braceexpand(pattern) is None
