"""bench_mix's analysis of a row: the global stream reconstructed and checked against
the unsharded mix, the deviations per global batch and per training step, each element
once per pass, a bounds row's prefix bound, and the medians over rounds."""

from __future__ import annotations

from collections import Counter
from typing import Any

import harness
from mix_data import (
    GLOBAL_BATCH,
    NAMES,
    RANK_BATCH,
    TOKENS,
    WEIGHTS,
    WORLD_SIZE,
    make_records,
    mix_options,
    phases,
    tokens,
)
from mix_rows import Variant


# -- analysis ----------------------------------------------------------------------------------
def expected_stream(key: str, sizes: list[int], steps: int) -> list[tuple[int, int]]:
    """A distshard row's global stream, unsharded, in this process (no decode)."""
    from torch.utils.data.datapipes.iter import IterableWrapper

    import distshard

    data = {name: make_records(name, n) for name, n in zip(NAMES, sizes, strict=True)}
    sources = {name: IterableWrapper(records) for name, records in data.items()}
    mixed = distshard.mix(sources, samples=steps * GLOBAL_BATCH, **mix_options(key, data, steps))
    return [(NAMES.index(r["source"]), r["idx"]) for r in mixed]


def prefix_bound(key: str, order: list[tuple[int, int]], steps: int) -> dict[str, Any]:
    """A bounds row's own promise, over every prefix of its global stream: for the
    phased row, each source's count within 1 of its share counted from the phase's
    start; for the cost row, each source's tokens within the largest record's
    tokens of its share of the prefix's tokens (the issue's bound: (sources - 1) x)."""
    if key == "distshard_phases":
        starts = [start for start, _ in phases(steps)] + [len(order)]
        worst = 0.0
        for (start, weights), end in zip(phases(steps), starts[1:], strict=True):
            total = sum(weights.values())
            counts = [0] * len(NAMES)
            for p, (sid, _) in enumerate(order[start:end], 1):
                counts[sid] += 1
                worst = max(worst, max(abs(c - p * weights[n] / total) for c, n in zip(counts, NAMES, strict=True)))
        return {"worst": worst, "bound": 1.0, "unit": "elements", "strict": True}
    largest = max(high for _, high in TOKENS.values())
    total = sum(WEIGHTS)
    cost, own, worst = 0, [0] * len(NAMES), 0.0
    for sid, index in order:
        c = tokens(NAMES[sid], index)
        cost += c
        own[sid] += c
        worst = max(worst, max(abs(o - cost * w / total) for o, w in zip(own, WEIGHTS, strict=True)))
    counts = Counter(sid for sid, _ in order)
    return {"worst": worst / largest, "bound": 1.0, "issue_bound": float(len(NAMES) - 1), "unit": "largest cost",
            "strict": False, "token_shares": [o / cost for o in own],
            "sample_shares": [counts[s] / len(order) for s in range(len(NAMES))]}


def reconstruct(ranks: list[dict[str, Any]], workers: int, total: int) -> list | None:
    """distshard's global order from what the ranks received. With ``multiple_of`` the
    batches of step ``t`` over the ranks are the positions ``[t G, (t + 1) G)``, in rank
    order (``plan.chunk_slot``), whatever the workers; checked against the unsharded mix."""
    order: list = [None] * total
    for value in ranks:
        rank = value["rank"]
        for t, batch in enumerate(value["batches"]):
            for j, element in enumerate(batch):
                position = t * GLOBAL_BATCH + rank * RANK_BATCH + j
                if position >= total:
                    return None
                order[position] = tuple(element)
    return None if any(e is None for e in order) else order


def deviations(batches: list[list[tuple[int, int]]]) -> list[float]:
    """Per source, the worst ``|count − size × weight|`` over the batches."""
    total = sum(WEIGHTS)
    worst = [0.0] * len(NAMES)
    for batch in batches:
        counts = Counter(s for s, _ in batch)
        for s, w in enumerate(WEIGHTS):
            worst[s] = max(worst[s], abs(counts[s] - len(batch) * w / total))
    return worst


def per_pass(delivered: list[tuple[int, int]], sizes: list[int]) -> dict[str, Any]:
    """Each element of a source delivered ⌊d/n⌋ or ⌈d/n⌉ times?"""
    out: dict[str, Any] = {"left_out": 0, "beyond": 0, "per_source": {}}
    by_source = Counter(s for s, _ in delivered)
    counts = Counter((s, i) for s, i in delivered)
    for s, (name, n) in enumerate(zip(NAMES, sizes, strict=True)):
        d = by_source[s]
        low, high = d // n, -(-d // n)
        seen = [counts[(s, i)] for i in range(n)]
        left = sum(max(0, low - c) for c in seen)
        beyond = sum(max(0, c - high) for c in seen)
        out["per_source"][name] = {"delivered": d, "n": n, "min": min(seen), "max": max(seen),
                                   "left_out": left, "beyond": beyond}
        out["left_out"] += left
        out["beyond"] += beyond
    return out


def analyze(variant: Variant, run: dict[str, Any], sizes: list[int], steps: int,
            expected: list | None) -> dict[str, Any]:
    group = harness.GroupRun.of({"ranks": [], "world_size": WORLD_SIZE, **run})
    ranks = [{"rank": v["rank"], "batches": v["values"][0] if v["values"] else []}
             for v in sorted(group.measured, key=lambda v: v["rank"])]
    row: dict[str, Any] = {"errors": group.errors}
    complete = (len(ranks) == WORLD_SIZE and not row["errors"]
                and all(len(v["batches"]) == steps for v in ranks))
    row["complete"] = complete
    if not ranks:
        return row
    delivered = [tuple(e) for v in ranks for batch in v["batches"] for e in batch]
    row["delivered"] = len(delivered)
    row["decodes"] = group.total("decodes")
    row["reads_per_delivered"] = row["decodes"] / max(1, len(delivered))
    row["cpu_s"] = group.cpu_s
    row["wall_s"] = group.wall_s
    if not complete:
        return row
    steps_batches = [[tuple(e) for v in ranks for e in v["batches"][t]] for t in range(steps)]
    row["step_deviation"] = deviations(steps_batches)
    if variant.key.startswith("distshard"):
        order = reconstruct(ranks, variant.workers, steps * GLOBAL_BATCH)
        row["same_stream"] = order is not None and order == expected
        if variant.bounds and order is not None:
            row["prefix"] = prefix_bound(variant.key, order, steps)
        windows = ([order[i:i + GLOBAL_BATCH] for i in range(0, len(order), GLOBAL_BATCH)]
                   if order is not None else steps_batches)
        row["global_deviation"] = deviations(windows)
    else:
        row["same_stream"] = None  # no global stream to compare with
        row["global_deviation"] = row["step_deviation"]
    row["passes"] = per_pass(delivered, sizes)
    return row


def summarize(variant: Variant, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of CPU / wall over rounds; everything else from round 1 (and checked equal)."""
    if runs and "skipped" in runs[0]:
        return {"key": variant.key, "skipped": runs[0]["skipped"]}
    good = [r for r in runs if r.get("complete")]
    summary: dict[str, Any] = {"key": variant.key, "rounds": runs, "left_out": harness.left_out(runs, good)}
    if not good:
        summary["errors"] = [e for r in runs for e in r.get("errors", [])] or ["no complete round"]
        return summary
    first = good[0]
    for name in ("reads_per_delivered", "global_deviation", "step_deviation", "same_stream", "passes",
                 "delivered", "decodes", "prefix"):
        if name in first:
            summary[name] = first[name]
    summary["stable"] = all(r["global_deviation"] == first["global_deviation"]
                            and r["passes"] == first["passes"] for r in good)
    summary["reads_max"] = max(r["reads_per_delivered"] for r in good)
    summary["cpu_s"] = harness.median(r["cpu_s"] for r in good)
    summary["cpu_all"] = [r["cpu_s"] for r in good]
    summary["wall_s"] = harness.median(r["wall_s"] for r in good)
    return summary
