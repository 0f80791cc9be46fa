"""The lazy expansion of a brace pattern against the eager one it stands for."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distshard.digests import ListHead, stable_digest, stable_text
from distshard.errors import OptionError
from distshard.sources.transport.brace_list import BraceList, lazy_braceexpand, pattern_of
from distshard.sources.transport.files import any_compressed, compression_of
from distshard.sources.transport.urls import braceexpand, expand_urls

_WORD = st.text(alphabet="abxyz./-_0123456789:", max_size=4) | st.sampled_from([".gz", ".tar", ".bz2", ".Zst"])


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
    assert lazy.holds_empty() == ("" in eager)
    assert all(item.endswith(lazy.tail()) for item in eager)
    assert any_compressed(lazy) == any(compression_of(url) is not None for url in eager)
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


@settings(max_examples=300, deadline=None)
@given(
    before=st.text(alphabet="ab/-_.:0123456789", max_size=8),
    after=st.text(alphabet="ab/-_.:0123456789", max_size=6),
    first=st.integers(0, 120),
    n=st.integers(1, 40),
    width=st.integers(0, 5),
    cut=st.integers(0, 3),
)
def test_the_pattern_of_a_numbered_listing_expands_to_exactly_it(before, after, first, n, width, cut) -> None:
    urls = [f"{before}{k:0{width}d}{after}" for k in range(first, first + n)]
    pattern = pattern_of(urls)
    if pattern is not None:  # (None is always allowed: the index then matches by its digest)
        assert list(BraceList(pattern)) == urls
    if not before[-1:].isdigit() and not any(c.isdigit() for c in after) and n > 1:
        assert pattern is not None, urls  # the command's own listings (shard-000..) are recognised
    gapped = urls[:cut] + urls[cut + 1 :]  # a file missing: no one-range pattern names the rest
    if 0 < cut < len(urls) - 1:
        assert pattern_of(gapped) is None


def test_pattern_of_refuses_what_no_range_names() -> None:
    assert pattern_of(["a0", "a2"]) is None  # a gap
    assert pattern_of(["a1", "a0"]) == "a{1..0}"  # (descending, as braceexpand counts down)
    assert pattern_of(["a0", "b1"]) is None and pattern_of(["a0"]) is None and pattern_of([]) is None
    assert pattern_of(["x/{a}0", "x/{a}1"]) is None  # (a brace in a name)


def test_expand_urls_gives_a_plain_pattern_lazily_and_the_rest_eagerly(tmp_path) -> None:
    lazy = expand_urls("s3://b/shard-{000..999}.tar")
    assert isinstance(lazy, BraceList) and lazy == braceexpand("s3://b/shard-{000..999}.tar")
    assert isinstance(expand_urls("s3://b/a{b,{c,d}}.tar"), list)  # (nested: not covered)
    assert expand_urls("a{0..1}::b{0..1}") == ["a0", "a1", "b0", "b1"]  # (several patterns: a list)
    (tmp_path / "f1.tar").write_bytes(b"")
    assert expand_urls(str(tmp_path / "f{1..1}*.tar")) == [str(tmp_path / "f1.tar")]  # (globbed)
    for empty in ["{,a}", "{,}"]:
        with pytest.raises(OptionError, match="names no file"):
            expand_urls(empty)
