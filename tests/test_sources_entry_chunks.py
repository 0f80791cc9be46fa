"""The stored index's entry chunks are planned by the one coalescer
(``sources/coalesce.py``): property-tested against the greedy grouping the entry
packs used to write themselves, on packs as ``python -m distshard index`` writes
them (entries disjoint, in byte order), and against the chunk rules."""

from __future__ import annotations

from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from distshard.sources.stored.entry_packs import GAP_BYTES, RANGE_BYTES, PackedEntries, pack_entry

Member = tuple[str, int, int]


def _greedy(entries: list[str]) -> dict[str, list[Member]]:
    """The grouping ``entry_packs._chunks`` wrote before it asked ``coalesce``."""
    by_pack: dict[str, list[Member]] = {}
    for entry in dict.fromkeys(entries):
        pack, rest = entry.rsplit("#", 1)
        start, stop = (int(x) for x in rest.split("-"))
        by_pack.setdefault(pack, []).append((entry, start, stop))
    out: dict[str, list[Member]] = {}
    for members in by_pack.values():
        members.sort(key=lambda m: (m[1], m[2]))
        chunk: list[Member] = []
        lo = hi = 0
        for member in members:
            if not chunk or member[2] - lo > RANGE_BYTES or member[1] - hi > GAP_BYTES:
                chunk, lo, hi = [], member[1], member[2]
            chunk.append(member)
            hi = max(hi, member[2])
            out[member[0]] = chunk
    return out


@st.composite
def _packs(draw: st.DrawFn) -> list[str]:
    entries: list[str] = []
    for pack in range(draw(st.integers(1, 3))):
        at = 0
        sizes = st.integers(1, 3 * RANGE_BYTES // 2) if draw(st.booleans()) else st.integers(1, 200_000)
        for _ in range(draw(st.integers(1, 30))):
            at += draw(st.sampled_from([0, 0, 1, GAP_BYTES, GAP_BYTES + 1, draw(st.integers(0, 4 * GAP_BYTES))]))
            size = draw(sizes)
            entries.append(pack_entry(f"s3://b/idx/pack-{pack}", at, at + size))
            at += size
    kept = draw(st.lists(st.sampled_from(entries), min_size=1, max_size=len(entries)))
    return kept


@settings(max_examples=300, deadline=None)
@given(_packs())
def test_chunks_through_the_coalescer_are_the_greedy_chunks(entries: list[str]) -> None:
    packed = PackedEntries(entries + [None])
    old = _greedy(entries)
    for entry in entries:
        assert packed.chunk(entry) == old[entry]


@settings(max_examples=300, deadline=None)
@given(_packs())
def test_a_chunk_is_one_range_within_the_limits(entries: list[str]) -> None:
    packed = PackedEntries(entries)
    for entry in entries:
        chunk = packed.chunk(entry)
        assert any(m[0] == entry for m in chunk)
        lo, hi = chunk[0][1], max(m[2] for m in chunk)
        assert len(chunk) == 1 or hi - lo <= RANGE_BYTES
        assert all(b[1] - a[2] <= GAP_BYTES for a, b in pairwise(chunk))
        assert all(packed.chunk(m[0]) is chunk for m in chunk)  # one chunk, one request, whoever asks
