"""The oracle of fit="best" by brute force (pure Python: imported by the pure tests,
the pack tests and the model-based test's spawned processes alike)."""

from __future__ import annotations

from itertools import accumulate


def prefix_of(counts: list[int], extra: int = 0) -> list[int]:
    return [0, *accumulate(c + extra for c in counts)]


def windows_of(counts: list[int], window_tokens: int | None, window_documents: int | None) -> list[list[int]]:
    """The oracle's windows: lists of document indices."""
    if window_documents is not None:
        return [list(range(a, min(a + window_documents, len(counts)))) for a in range(0, len(counts), window_documents)]
    assert window_tokens is not None
    out: dict[int, list[int]] = {}
    for k, start in enumerate(prefix_of(counts)[:-1]):
        out.setdefault(start // window_tokens, []).append(k)
    return list(out.values())


def reference_best_fit(
    counts: list[int], L: int, window_tokens: int | None = None, window_documents: int | None = None
) -> list[list[tuple[int, int, int]]]:
    """Best-fit decreasing by brute force: per window, the pieces of L, then every
    remainder (largest first, ties in document order) into the open bin with the least
    room that takes it (ties: the bin whose room changed last), else a new bin."""
    blocks = []
    for docs in windows_of(counts, window_tokens, window_documents):
        for k in docs:
            blocks += [[(k, q * L, (q + 1) * L)] for q in range(counts[k] // L)]
        items = sorted((k for k in docs if counts[k] % L), key=lambda k: -(counts[k] % L))
        bins: list[list] = []
        rooms: list[int] = []
        stamps: list[int] = []
        for clock, k in enumerate(items):
            size = counts[k] % L
            fits = [i for i in range(len(bins)) if rooms[i] >= size]
            if fits:
                i = min(fits, key=lambda i: (rooms[i], -stamps[i]))
            else:
                i = len(bins)
                bins.append([])
                rooms.append(L)
                stamps.append(0)
            bins[i].append((k, counts[k] - size, counts[k]))
            rooms[i] -= size
            stamps[i] = clock + 1
        blocks += bins
    return blocks


def concat_layout(counts: list[int], L: int) -> list[list[tuple[int, int, int]]]:
    """fit="concat" by definition: the documents' tokens concatenated and cut into L,
    each block's segments ``(document, lo, hi)`` in order."""
    stream = [(k, t) for k, c in enumerate(counts) for t in range(c)]
    layout = []
    for start in range(0, len(stream), L):
        part = stream[start : start + L]
        documents = list(dict.fromkeys(k for k, _ in part))
        layout.append(
            [(k, min(t for j, t in part if j == k), max(t for j, t in part if j == k) + 1) for k in documents]
        )
    return layout


def filled(docs: list[list[int]], layout: list[list[tuple[int, int, int]]], L: int, pad: int = 0) -> list[tuple]:
    """The blocks of ``layout`` (each block's ``(document, lo, hi)`` segments) filled
    with the documents' tokens (their eos appended already): ``(ids, positions, mask,
    segments)`` tuples, padded to ``L``."""
    out = []
    for segments in layout:
        ids: list[int] = []
        pos: list[int] = []
        seg: list[int] = []
        for number, (k, lo, hi) in enumerate(segments, 1):
            ids += docs[k][lo:hi]
            pos += range(lo, hi)
            seg += [number] * (hi - lo)
        short = L - len(ids)
        out.append(
            (
                tuple(ids + [pad] * short),
                tuple(pos + [0] * short),
                tuple([1] * len(ids) + [0] * short),
                tuple(seg + [0] * short),
            )
        )
    return out
