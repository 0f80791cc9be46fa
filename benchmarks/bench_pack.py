"""Packing tokens into fixed-length blocks over 4 gloo ranks × 2 workers:
``distshard.pack`` (``fit="concat"`` and ``fit="best"``) against Hugging Face
``group_texts``, litdata's ``TokensLoader`` and Grain's ``FirstFitPackIterDataset``
and ``BestFitPackIterDataset``, in one run, on two tokenized corpora; and planning
10⁸ documents by simulation.

The corpora
-----------
``uniform``: ``DOCS`` documents (``--quick``: fewer) of 20 to 8,000 tokens (log-uniform).
``web``: ``WEB_DOCS`` documents of a web-text-like length distribution: 97 % log-normal
around a median of 400 tokens (σ = 1), 3 % a Pareto tail (α = 1.1 from 2,000 tokens),
clipped to 16–100,000 tokens. Token ``t`` of the concatenation has id ``t`` (int32), so
a multiset of delivered ids says exactly what was lost or repeated, and the block a
token came in says which documents were cut. Each is written once per run as a flat
``tokens.bin`` (int32) and ``lengths.npy``, read in place by every row
(memory-mapped): distshard through a 30-line source that exposes the documents by
position and their lengths (``distshard_token_counts()``, what ``distshard.tokens``
reads from Megatron's ``.idx``); litdata from the chunks its ``optimize(...,
item_loader=TokensLoader())`` wrote (not timed); HF from an Arrow ``Dataset`` of the
documents (not timed); Grain from the same memory map, documents pre-split into
pieces of at most ``L`` (its packers take no longer sequence).

The rows (blocks of ``L = 1024`` tokens, batches of 8 blocks, 4 ranks × 2 workers; each
on a fresh gloo group on 127.0.0.1)
--------------------------------------------------------------------------------------
(a) ``distshard.pack(docs, L).dist_shard()``: ``even=None`` (every token; slot
    counts within 1 block) and ``even="drop"`` (equal blocks per slot); ``fit="best"``
    (whole documents, the default window of 256 blocks' worth of tokens).
    ``DataLoader(num_workers=2)`` on every rank.
(b) HF ``datasets`` 4.8.5 (benchmark venv): ``Dataset.from_dict(docs)
    .to_iterable_dataset(num_shards=8).map(group_texts, batched=True)`` (the
    ``group_texts`` of HF's run_clm example: each map batch of 1,000 documents is
    concatenated and cut, its remainder dropped), ``split_dataset_by_node``.
(c) litdata 0.2.76 (benchmark venv): ``StreamingDataset(chunks,
    item_loader=TokensLoader(block_size=L))``, ``StreamingDataLoader``.
(d) Grain 0.2.18 (benchmark venv), its documented recipe: ``MapDataset.source(pieces)
    [rank::4].to_iter_dataset()``, ``FirstFitPackIterDataset`` or
    ``BestFitPackIterDataset(length_struct={"input_ids": L}, num_packing_bins=8)``,
    ``.batch(8).mp_prefetch(MultiprocessingOptions(num_workers=2))`` (each worker packs
    its slice of the rank's pieces).

Metrics: tokens delivered / tokens in the corpus (real tokens, padding excluded),
tokens repeated, padding fraction of what was delivered, documents cut (delivered
in more than one block, or not whole; in brackets those of at most ``L`` tokens, which
a whole-document packer need not cut), blocks per rank, CPU per token (user + sys of
the ranks and their workers / delivered tokens) and, for distshard and Grain, CPU
per token in one process (the whole corpus packed and batched without workers, after
the imports: the packer's own cost, without the start of worker processes). Resume:
distshard's rows are also run as a training job that checkpoints mid-epoch
(``StatefulDataLoader``, ``gather_states``) on 4 ranks × 2 workers and resumes on 3
ranks × 2 workers: every token of the corpus once over the two runs (the peers'
were not run so: none resumes on another world size).

Planning at scale (``--plan-only`` runs it alone): ``pack()`` of 10⁸ documents whose
counts the source gives (what ``distshard.tokens`` reads from an ``.idx``), in a
fresh process: time to the first block's documents, the plan's bytes per document
and the process's peak RSS (which also holds the simulated counts: 4 bytes a
document, a memory map of the ``.idx`` in real use). Targets: ``fit="concat"`` ≤ 2 s
of CPU and ≤ 1 GB of peak RSS at 10⁸ documents; ``fit="best"`` ≤ 24 bytes per
document and ≤ 10 s of CPU at 10⁷.

The corpora are made in ``pack_corpus.py``, the rows run in ``pack_rows.py``; this
script plans by simulation, analyses what the rows delivered and prints the tables.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

from torch.utils.data.datapipes.datapipe import IterDataPipe

import harness
from harness import Col
from pack_corpus import SEQ_LEN, corpus_lengths, make_corpus
from pack_rows import (
    DISTSHARD,
    GRAIN,
    NUM_WORKERS,
    WORLD_SIZE,
    one_process,
    prepare_peers,
    resume_check,
    run_row,
)

# re-exported: one_process, prepare_peers and run_row are called in a child by name (harness.launch)
__all__ = ["one_process", "prepare_peers", "run_row"]

DOCS, QUICK_DOCS = 1_000, 400
WEB_DOCS, QUICK_WEB_DOCS = 2_000, 800
CORPORA = ("uniform", "web")
PLAN_DOCS, QUICK_PLAN_DOCS = 100_000_000, 10_000_000
BEST_PLAN_DOCS = 10_000_000
ROWS = ("distshard", "distshard-drop", "distshard-best", "hf", "litdata", "grain-ff", "grain-bf")
ONE_PROCESS = ("distshard", "distshard-best", *GRAIN)
LABELS = {
    "distshard": "distshard `pack(docs, L).dist_shard()`",
    "distshard-drop": "distshard `pack(docs, L).dist_shard(even=\"drop\")`",
    "distshard-best": "distshard `pack(docs, L, fit=\"best\").dist_shard()`",
    "hf": "HF `group_texts` + `split_dataset_by_node`",
    "litdata": "litdata `TokensLoader(block_size=L)`",
    "grain-ff": "Grain `FirstFitPackIterDataset` (8 bins)",
    "grain-bf": "Grain `BestFitPackIterDataset` (8 bins)",
}


# -- planning 10^8 documents ----------------------------------------------------------------------------
def plan_scale(docs: int, shuffle: bool = False, fit: str = "concat") -> dict[str, Any]:
    """In a fresh process: ``pack()`` over ``docs`` documents whose counts the source gives."""
    import resource

    import numpy as np

    import distshard

    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the interpreter, torch, numpy, distshard
    counts = np.random.default_rng(1).integers(20, 8001, docs, dtype=np.int32)

    class Counted(IterDataPipe):
        def distshard_token_counts(self) -> Any:
            return counts

        def __iter__(self) -> Iterator[Any]:
            return iter(())

    start, cpu = time.perf_counter(), time.process_time()
    packed = distshard.pack(Counted(), 2048, shuffle_documents=shuffle, fit=fit)
    plan = packed.packing()
    first = plan.segments(plan.blocks // 2)
    seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    # the plan: the counts' checkpoints and a best fit's placement; a shuffled order's counts are the plan's own
    plan_bytes = plan.nbytes + (plan.counts.counts.nbytes if shuffle else 0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"docs": docs, "blocks": plan.blocks, "seconds": seconds, "cpu_s": cpu_s, "fit": fit,
            "plan_bytes_per_doc": plan_bytes / docs, "plan_mib": plan_bytes / 2**20, "peak_rss_mib": peak / 1024,
            "base_rss_mib": base_rss / 1024, "counts_mib": counts.nbytes / 2**20, "first": len(first),
            "padding": plan.padding / max(plan.blocks * 2048, 1), "shuffle": shuffle, "loadavg": harness.loadavg()}


WINDOWS = (32, 64, 128, 256, 512, 1024)  # fit="best"'s window, in blocks' worth of tokens


def window_sweep(quick: bool = False) -> dict[str, list[float]]:
    """fit="best"'s padding on each corpus for each window of ``WINDOWS`` (the plan alone)."""
    from distshard.packing import BestPacking, TokenCounts

    out = {}
    for kind in CORPORA:
        docs = (QUICK_DOCS if quick else DOCS) if kind == "uniform" else (QUICK_WEB_DOCS if quick else WEB_DOCS)
        counts = TokenCounts(corpus_lengths(kind, docs))
        plans = [BestPacking(counts, SEQ_LEN, window_tokens=w * SEQ_LEN) for w in WINDOWS]
        out[kind] = [plan.padding / (plan.blocks * SEQ_LEN) for plan in plans]
    return out


# -- analysis -----------------------------------------------------------------------------------------------
def documents_cut(ids: Any, per_block: Any, lengths: Any) -> tuple[int, int]:
    """(documents cut, of them at most ``L`` tokens long): a document is cut when its
    delivered tokens lie in more than one block or some of them were not delivered."""
    import numpy as np

    offsets = np.concatenate([[0], np.cumsum(lengths)])
    docs = np.searchsorted(offsets, ids, side="right") - 1
    block = np.repeat(np.arange(len(per_block)), per_block)
    pairs = np.unique(docs.astype(np.int64) * (len(per_block) + 1) + block)
    blocks_of = np.bincount(pairs // (len(per_block) + 1), minlength=len(lengths))
    delivered = np.bincount(docs, minlength=len(lengths))
    cut = (blocks_of > 1) | (delivered < lengths)
    return int(cut.sum()), int((cut & (lengths <= SEQ_LEN)).sum())


def analyze(run: dict[str, Any], lengths: Any) -> dict[str, Any]:
    import numpy as np

    corpus_tokens = int(lengths.sum())
    if "skipped" in run or "ranks" not in run:
        return {"error": run.get("skipped") or "; ".join(run.get("errors", ["no result"]))[-300:]}
    group = harness.GroupRun.of(run)
    if group.errors or not group.complete:
        return {"error": "; ".join(group.errors or ["incomplete"])[-300:]}

    def decoded(name: str) -> Any:
        parts = [np.frombuffer(base64.b64decode(r[name]), dtype=np.int32) for r in run["ranks"]]
        return np.concatenate(parts) if parts else np.zeros(0, np.int32)

    ids, per_block = decoded("ids"), decoded("per_block")
    seen = np.bincount(ids, minlength=corpus_tokens) if len(ids) else np.zeros(corpus_tokens, np.int64)
    delivered = int(len(ids))
    block_tokens = sum(r["block_tokens"] for r in run["ranks"])
    wall = group.wall_s or float("nan")
    cut, cut_short = documents_cut(ids, per_block, lengths)
    return {
        "delivered": delivered, "distinct": int((seen > 0).sum()), "repeated": int((seen[seen > 1] - 1).sum()),
        "coverage": int((seen > 0).sum()) / corpus_tokens, "padding": sum(r["padding"] for r in run["ranks"]),
        "padding_fraction": sum(r["padding"] for r in run["ranks"]) / max(block_tokens, 1),
        "documents_cut": cut, "documents_cut_short": cut_short,
        "blocks_per_rank": [r["blocks"] for r in run["ranks"]], "wall_s": wall, "cpu_s": group.cpu_s,
        "tokens_per_s": delivered / wall if delivered else None,
        "cpu_ns_per_token": group.cpu_s / delivered * 1e9 if delivered else None,
        "errors": run.get("errors") or group.errors,
    }


COLUMNS = [Col("row"), Col("tokens delivered / corpus", 4), Col("tokens repeated", 0), Col("padding", 4),
           Col("documents cut (≤ L)"), Col("blocks per rank"), Col("CPU per token", fmt=lambda v: f"{v:.0f} ns"),
           Col("CPU per token, one process"), Col("elastic resume")]


def run_corpus(kind: str, root: str, rows: list[str], args: Any) -> dict[str, Any]:
    """Every row on one corpus: the 4 × 2 run, the one-process run, the elastic resume."""
    import numpy as np

    corpus = make_corpus(root, (QUICK_DOCS if args.quick else DOCS) if kind == "uniform" else
                         (QUICK_WEB_DOCS if args.quick else WEB_DOCS), kind=kind)
    lengths = np.load(os.path.join(root, "lengths.npy"))
    if any(r in ("hf", "litdata") for r in rows):
        prepared = harness.launch(__file__, "prepare_peers", {"root": root}, peers=True, timeout=args.timeout)
        if not prepared.get("ok"):
            print(f"# peers not prepared: {prepared}", file=sys.stderr)
    results: dict[str, Any] = {}
    for key in rows:
        t0 = time.perf_counter()
        peers = key not in DISTSHARD
        run = (run_row(key, root, args.timeout) if not peers else
               harness.launch(__file__, "run_row", {"key": key, "root": root, "timeout": args.timeout}, peers=True,
                              timeout=args.timeout))
        results[key] = analyze(run, lengths)
        resume = resume_check(root, key, args.timeout) if not peers else None
        results[key]["resume"] = _resume_cell(resume, corpus["tokens"], key == "distshard-drop")
        if key in ONE_PROCESS:
            alone = harness.launch(__file__, "one_process", {"key": key, "root": root}, peers=peers,
                                   timeout=args.timeout)
            results[key]["one_process"] = alone
        print(f"#   {kind} {key} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return {"corpus": corpus, "rows": results}


def _one_process_cell(alone: dict[str, Any] | None) -> str:
    if not alone:
        return "not run"
    if "cpu_s" not in alone:
        return "failed: " + harness.error_line(str(alone))[:60]
    return f"{alone['cpu_s'] / max(alone['delivered'], 1) * 1e9:.0f} ns"


def _table(corpus: dict[str, Any], rows: list[str], results: dict[str, Any]) -> str:
    cells = []
    for key in rows:
        r = results[key]
        if "delivered" not in r:
            cells.append([LABELS[key], "failed: " + harness.error_line(r.get("error", ""))])
            continue
        cells.append([LABELS[key], r["coverage"], r["repeated"], r["padding_fraction"],
                      f"{r['documents_cut']} ({r['documents_cut_short']})",
                      " / ".join(map(str, r["blocks_per_rank"])), r["cpu_ns_per_token"],
                      _one_process_cell(r.get("one_process")), r["resume"]])
    return harness.table(COLUMNS, cells)


def _plan_line(plan: dict[str, Any]) -> str:
    if "seconds" not in plan:
        return f"planning: failed: {plan}"
    what = f"fit={plan['fit']!r}" + (", shuffle_documents=True" if plan["shuffle"] else "")
    return (f"planning {plan['docs']:,} documents ({what}): {plan['seconds']:.2f} s wall ({plan['cpu_s']:.2f} s CPU) "
            f"to the first block's documents ({plan['blocks']:,} blocks of 2048, padding {plan['padding']:.2%}); "
            f"the plan {plan['plan_mib']:,.1f} MiB ({plan['plan_bytes_per_doc']:.2f} bytes per document); peak RSS "
            f"{plan['peak_rss_mib']:,.0f} MiB = interpreter with torch {plan['base_rss_mib']:,.0f} MiB + the simulated "
            f"counts {plan['counts_mib']:,.0f} MiB (a memory map of the .idx in real use) + the plan and what building "
            f"it held; 1-min load average {plan['loadavg']:.1f}")


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_DOCS} documents, planning 10^7 documents")
    parser.add_argument("--only", default="", help="comma-separated rows: " + ",".join(ROWS))
    parser.add_argument("--corpus", default="", help="comma-separated corpora: " + ",".join(CORPORA))
    parser.add_argument("--plan-only", action="store_true", help="only the planning simulation")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds a row may take")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the raw numbers")
    harness.add_child_args(parser)
    args = parser.parse_args(None if argv is None else list(argv))
    if args.run:
        return harness.child(args.run, args.out, globals())
    session = harness.Session()
    rows = [] if args.plan_only else harness.choose(args.only, {r: r for r in ROWS}, parser)
    kinds = [] if args.plan_only else harness.choose(args.corpus, {c: c for c in CORPORA}, parser)
    corpora: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-pack-") as root:
        for kind in kinds if rows else []:
            corpora[kind] = run_corpus(kind, os.path.join(root, kind), rows, args)
    big = QUICK_PLAN_DOCS if args.quick else PLAN_DOCS
    plans = [harness.launch(__file__, "plan_scale", {"docs": n, "shuffle": s, "fit": f}, timeout=args.timeout)
             for n, s, f in ((big, False, "concat"), (QUICK_PLAN_DOCS, True, "concat"),
                             (BEST_PLAN_DOCS, False, "best"), (QUICK_PLAN_DOCS // 10, True, "best"))]
    print(session.header(f"blocks of {SEQ_LEN}; {WORLD_SIZE} gloo ranks × {NUM_WORKERS} workers; one round"))
    print()
    for kind, done in corpora.items():
        c = done["corpus"]
        print(f"corpus {kind!r}: {c['docs']:,} documents, {c['tokens']:,} tokens, median {c['median']:.0f}, longest "
              f"{c['longest']:,}, {c['longer_than_L']} longer than {SEQ_LEN}")
        print()
        print(_table(c, rows, done["rows"]))
        print()
    for plan in plans:
        print(_plan_line(plan))
    sweep = window_sweep(args.quick)
    for kind, padding in sweep.items():
        print(f"fit='best' padding on {kind!r} by window (blocks of {SEQ_LEN}): "
              + ", ".join(f"{w}: {p:.2%}" for w, p in zip(WINDOWS, padding, strict=True)))
    session.dump(args.json, corpora=corpora, plans=plans, windows=sweep)
    return 0


def _resume_cell(resume: dict[str, Any] | None, corpus_tokens: int, drop: bool) -> str:
    import numpy as np

    if resume is None:
        return "not run"
    if "ids" not in resume:
        return "✗ " + harness.error_line("; ".join(map(str, resume.get("errors", []))))[:80]
    ids = np.concatenate([np.frombuffer(base64.b64decode(x), dtype=np.int32) for x in resume["ids"]])
    seen = np.bincount(ids, minlength=corpus_tokens)
    repeated, missing = int((seen[seen > 1] - 1).sum()), int((seen == 0).sum())
    exact = repeated == 0 and (missing == 0 or drop)
    return f"{'✓' if exact else '✗'} 4×2 → 3×2: {repeated} repeated, {missing} not delivered"


if __name__ == "__main__":
    sys.exit(main())
