"""Mixing sources by weight over 4 gloo ranks × 2 workers: ``distshard.mix`` against
torchdata.nodes' ``MultiNodeWeightedSampler`` and Hugging Face
``interleave_datasets`` + ``split_dataset_by_node``, in one run, on the same data.

The data and the job
--------------------
Three random-access sources of small records (dicts with a source name, an index
and a short text), ``web`` / ``code`` / ``math`` = 20,000 / 5,000 / 2,000
records, mixed 70 / 20 / 10 (``--quick``: 4,000 / 1,000 / 400). The job takes
``STEPS = 100`` steps (``--quick``: 20) of a global batch of 256, i.e. a per-rank
batch of 64 on ``WORLD_SIZE = 4`` ranks: 25,600 draws, so ``code`` and ``math``
are each taken more than once over (5,120 draws of 5,000; 2,560 of 2,000) and
every row must cycle them. ``decode`` is the same everywhere: a calibrated busy
loop (~50 µs of CPU, chained BLAKE2b) that counts its calls in a counter shared
by the rank and the processes it forks.

Every row runs on a real gloo group on 127.0.0.1 (``harness.run_job``, each rank
a spawned process, a fresh group per row and round); the decode runs
in 2 worker processes per rank:

(a) ``distshard``
    ``distshard.mix({name: IterableWrapper(records).map(decode)}, weights,
    samples=25_600).dist_shard(even="drop", multiple_of=64)`` through
    ``DataLoader(batch_size=64, num_workers=2, collate_fn=list)`` on every rank:
    lists of 64 ``(source, index)``, what the peers' rows deliver.
(a') the same with the DataLoader's ``default_collate`` (two tensors a batch,
    which workers pass through shared memory), and with ``num_workers=0``
    (decode in the rank): diagnostic rows, see "per training step" below.
(a'') ``DistShardNode(distshard.mix(records...))`` (the rank's share of the mix,
    undecoded) → ``ParallelMapper(decode, 2, "process", prebatch=64)`` →
    ``Batcher(64)`` → ``Loader``: distshard's mix in torchdata.nodes' loader.
(p) the pipeline of (a) in two weight phases (70 / 20 / 10, then 30 / 30 / 40
    from position 12,900), and weighted by cost (every record's token count:
    70 / 20 / 10 of the tokens): a table of their own, with their own bound over
    every prefix of the reconstructed global stream (a phase's counts within 1 of
    its shares counted from its start; a source's tokens within the largest
    record's tokens of its share of the tokens).
(b) torchdata.nodes 0.11 (dev venv)
    every rank builds its own nodes over its slice ``records[rank::4]`` of each
    source: ``MultiNodeWeightedSampler(nodes, weights,
    stop_criteria=CYCLE_FOREVER, seed=0)`` (it seeds each rank from ``(seed,
    rank)`` itself), ``Take(6400)`` (a 20-line node written here: torchdata 0.11
    has none; it ends the stream at the rank's share, so no read-ahead is decoded
    past the 100th step), ``ParallelMapper(decode, num_workers=2,
    method="process", prebatch=64)`` (``prebatch`` sends 64 records per message
    to the workers, which costs less CPU than one message per record for
    records this small), ``Batcher(64)``, ``Loader``.
(b') the same with ``ParallelMapper``'s default (no ``prebatch``).
(c) HF ``datasets`` 4.8.5 (the benchmark-only venv ``benchmarks/.venv``, run as a
    subprocess with that interpreter, numbers back as JSON)
    each source ``Dataset.from_dict(columns).to_iterable_dataset(num_shards=8)``,
    ``interleave_datasets(sources, probabilities=[.7, .2, .1], seed=rank,
    stopping_strategy="all_exhausted")`` (a seed per rank: with one seed every
    rank draws the same sequence of sources), ``split_dataset_by_node``,
    ``.map(decode)``, ``DataLoader(batch_size=64, num_workers=2)``. 8 shards
    divide 4 ranks × 2 workers, HF's best case: each worker reads its own shard
    of every source. ``.take(3200)`` stops every worker at its share (HF's
    ``take`` counts per DataLoader worker), so no read-ahead is decoded past the
    100th step.
(c') the same with 20 / 5 / 2 shards (``interleave`` keeps the smallest count,
    2, which 4 ranks do not divide): every rank reads every example and keeps
    one in 4, so here every rank uses the same ``seed=0`` (with a seed per rank
    the ranks would skip over different streams and overlap);
    ``.take(12800)`` (it counts before the skip).

Metrics
-------
reads / delivered
    decode calls in every process of the job / elements the ranks received in
    the 100 steps.
worst deviation per global batch of 256
    per source, the largest ``|count − 256 × weight|`` over the 100 global
    batches. A global batch is 256 consecutive positions of the global stream.
    For distshard the global stream exists, so it is reconstructed: slot
    ``s = rank × 2 + worker`` holds positions ``s, s + 8, s + 16, …``
    (``dist_shard``'s layout) and the DataLoader alternates its workers' batches;
    the reconstruction is checked against the unsharded ``mix`` (column "same
    stream"). The peers have no global stream: their global batch of a step is
    the 4 ranks' batches of that step, concatenated.
per training step
    the same deviation for what a step actually gets: the 4 ranks' batches of
    that step, concatenated, for every row. With DataLoader workers a rank's
    step-``t`` batch is 64 elements of *one* worker (``t mod 2``), so a step of
    distshard holds the positions of slots 0, 2, 4, 6 (or 1, 3, 5, 7) of 512
    consecutive positions, not 256 consecutive ones; row (a') has one slot per
    rank, so its steps are consecutive windows.
each element once per pass
    per source, with ``d`` elements delivered out of ``n``, every element must
    have been delivered ``⌊d/n⌋`` or ``⌈d/n⌉`` times (a pass is complete before
    the next one starts repeating it). Otherwise: how many elements a completed
    pass left out, and how many deliveries exceed ``⌈d/n⌉``.
CPU s / wall s
    user + sys CPU of every rank and its worker processes (``RUSAGE_SELF`` +
    ``RUSAGE_CHILDREN`` of each rank, from just before the pipeline is built to
    its workers joined), summed over the ranks; the slowest rank's wall time.
    Median over rounds (interleaved, 3 by default).

Targets for (a): reads 1.00 per delivered element, deviation ≤ 1 element per
source per global batch, CPU ≤ the best peer's; for (p): reads 1.00 and the prefix
bounds. Nothing is asserted: this is a benchmark, not a test.

How to run
----------
::

    .venv/bin/python benchmarks/bench_files.py --setup-peers   # once: benchmarks/.venv with the peers
    .venv/bin/python benchmarks/bench_mix.py                   # 3 rounds: ~3-4 min on 2 cores
    .venv/bin/python benchmarks/bench_mix.py --quick           # smaller sources, 20 steps, 1 round
    .venv/bin/python benchmarks/bench_mix.py --only distshard,hf --json mix.json

Without the peers' venv the HF rows say so.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

import harness
from harness import Col

WORLD_SIZE, NUM_WORKERS = 4, 2
GLOBAL_BATCH = 256
RANK_BATCH = GLOBAL_BATCH // WORLD_SIZE
NAMES = ("web", "code", "math")
WEIGHTS = (0.7, 0.2, 0.1)
SIZES = (20_000, 5_000, 2_000)
STEPS = 100
QUICK_SIZES, QUICK_STEPS = (4_000, 1_000, 400), 20
ROUNDS = 3
DECODE_TARGET_S = 50e-6
SEED = 0
TARGET_DEVIATION = 1.0
PHASE_WEIGHTS = (0.3, 0.3, 0.4)


# -- decode: a calibrated busy loop, counted over the rank and its workers -------------
class Decode(harness.Decode):
    """``record -> (source id, index)`` (or a dict, for HF's ``map``) after ~50 µs of CPU."""

    def __init__(self, iters: int, as_dict: bool = False) -> None:
        super().__init__(iters)
        self.as_dict = as_dict

    def __call__(self, record: dict[str, Any]) -> Any:
        sid = NAMES.index(record["source"])
        index = int(record["idx"])
        self.work(sid * 10_000_000 + index + len(record["text"]))
        return {"sid": sid, "idx": index} if self.as_dict else (sid, index)


def calibration_decode(iters: int) -> Any:
    """What ``harness.calibrate`` times: the decode of one record."""
    decode, record = Decode(iters), {"source": "web", "idx": 0, "text": "x" * 40}
    return lambda i: decode(record)


TOKENS = {"web": (60, 240), "code": (200, 800), "math": (20, 120)}  # (fewest, most) tokens a record


def tokens(name: str, k: int) -> int:
    """A record's token count (deterministic, spread over the source's range): the
    per-element cost of the cost-weighted rows."""
    low, high = TOKENS[name]
    return low + (k * 2654435761 + len(name)) % (high - low + 1)


def make_records(name: str, n: int) -> list[dict[str, Any]]:
    return [{"source": name, "idx": k, "text": f"{name} record {k:06d}: lorem ipsum dolor",
             "tokens": tokens(name, k)} for k in range(n)]


def phases(steps: int) -> list[tuple[int, dict[str, float]]]:
    """The phased rows' weights: 70 / 20 / 10, then from the middle 30 / 30 / 40
    (an annealing mix), the boundary inside a global batch."""
    return [(0, dict(zip(NAMES, WEIGHTS, strict=True))), (steps * GLOBAL_BATCH // 2 + 100, dict(zip(NAMES, PHASE_WEIGHTS, strict=True)))]


def mix_options(key: str, data: dict[str, list], steps: int) -> dict[str, Any]:
    """``weights=`` and ``cost=`` of a distshard row."""
    if key == "distshard_phases":
        return {"weights": phases(steps)}
    if key == "distshard_cost":
        return {"weights": dict(zip(NAMES, WEIGHTS, strict=True)),
                "cost": {name: [r["tokens"] for r in records] for name, records in data.items()}}
    return {"weights": dict(zip(NAMES, WEIGHTS, strict=True))}


# -- the rows ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    venv: str  # "dev" or "peers"
    code: str
    workers: int = NUM_WORKERS
    target: bool = False
    diagnostic: bool = False
    bounds: bool = False  # a phased or cost-weighted row: its own prefix bound, in a table of its own


VARIANTS = [
    Variant("distshard", "**distshard**", "dev",
            '`distshard.mix(sources, {"web": .7, "code": .2, "math": .1}, samples=steps * 256)'
            '.dist_shard(even="drop", multiple_of=64)` → `DataLoader(batch_size=64, num_workers=2, collate_fn=list)` '
            "(lists of 64 `(source, index)`, as the peers' rows deliver)", target=True),
    Variant("distshard_tensors", "distshard, `default_collate` (diagnostic)", "dev",
            "the same with the DataLoader's default collate: two tensors a batch, passed from the workers "
            "through shared memory", diagnostic=True),
    Variant("distshard_k1", "distshard, `num_workers=0` (diagnostic)", "dev",
            "the same with `num_workers=0`: decode in the rank, 1 slot per rank", workers=0, diagnostic=True),
    Variant("distshard_nodes", "distshard through torchdata.nodes", "dev",
            "`DistShardNode(distshard.mix(records, ...), even='drop', multiple_of=64)` → "
            "`ParallelMapper(decode, 2, 'process', prebatch=64)` → `Batcher(64)` → `Loader`: the peers' loader, "
            "distshard's mix", workers=1),
    Variant("distshard_phases", "distshard, two phases", "dev",
            "the target row's pipeline with `weights=[(0, {.7, .2, .1}), (12,900, {.3, .3, .4})]` "
            "(`--quick`: from 2,660)", bounds=True),
    Variant("distshard_cost", "distshard, cost-weighted", "dev",
            "the target row's pipeline with `cost={name: token counts}`: 70 / 20 / 10 of the tokens", bounds=True),
    Variant("nodes", "torchdata.nodes 0.11 `MultiNodeWeightedSampler`", "dev",
            "`MultiNodeWeightedSampler({name: IterableWrapper(records[rank::4])}, weights, CYCLE_FOREVER)` → "
            "`Take(6400)` → `ParallelMapper(decode, 2, 'process', prebatch=64)` → `Batcher(64)` → `Loader`"),
    Variant("nodes_default", "torchdata.nodes 0.11, `ParallelMapper` default", "dev",
            "the same without `prebatch`: one message per record to the workers"),
    Variant("hf", "HF datasets 4.8.5, 8 shards per source", "peers",
            "`interleave_datasets(sources, probabilities=[.7, .2, .1], seed=rank, "
            "stopping_strategy='all_exhausted')` → `split_dataset_by_node` → `.map(decode)` → `.take(3200)` → "
            "`DataLoader(batch_size=64, num_workers=2)`"),
    Variant("hf_uneven", "HF datasets 4.8.5, 20 / 5 / 2 shards", "peers",
            "the same with `seed=0` on every rank (its skip needs one stream) and `.take(12800)`: 2 shards "
            "(the smallest count) do not divide 4 ranks"),
]
BY_KEY = {v.key: v for v in VARIANTS}


def import_libraries(key: str) -> None:
    """Imports before the measured window."""
    if key.startswith("distshard"):
        import distshard  # noqa: F401
    elif key.startswith("nodes"):
        import torchdata.nodes  # noqa: F401
    elif key.startswith("hf"):
        import datasets  # noqa: F401
        import datasets.distributed  # noqa: F401


def build(key: str, data: dict[str, list], decode: Decode, rank: int, world_size: int, steps: int) -> Any:
    """What rank ``rank`` iterates: an iterable of batches."""
    from torch.utils.data import DataLoader

    weights = dict(zip(NAMES, WEIGHTS, strict=True))
    if key == "distshard_nodes":
        from torch.utils.data.datapipes.iter import IterableWrapper
        from torchdata.nodes import Batcher, Loader, ParallelMapper

        import distshard

        sources = {name: IterableWrapper(records, deepcopy=False) for name, records in data.items()}
        node = distshard.DistShardNode(distshard.mix(sources, weights, samples=steps * GLOBAL_BATCH),
                                       even="drop", multiple_of=RANK_BATCH)
        node = ParallelMapper(node, decode, num_workers=NUM_WORKERS, method="process",
                              multiprocessing_context="fork", prebatch=RANK_BATCH)
        return Loader(Batcher(node, batch_size=RANK_BATCH))
    if key.startswith("distshard"):
        from torch.utils.data.datapipes.iter import IterableWrapper

        import distshard

        sources = {name: IterableWrapper(records).map(decode) for name, records in data.items()}
        pipe = distshard.mix(sources, samples=steps * GLOBAL_BATCH, **mix_options(key, data, steps)).dist_shard(
            even="drop", multiple_of=RANK_BATCH)
        workers = BY_KEY[key].workers
        collate = {} if key == "distshard_tensors" else {"collate_fn": list}
        return DataLoader(pipe, batch_size=RANK_BATCH, num_workers=workers,
                          multiprocessing_context="fork" if workers else None, **collate)
    if key in ("nodes", "nodes_default"):
        from torchdata.nodes import (
            Batcher,
            IterableWrapper,
            Loader,
            MultiNodeWeightedSampler,
            ParallelMapper,
            StopCriteria,
        )

        Take = _take_node()
        nodes = {name: IterableWrapper(records[rank::world_size]) for name, records in data.items()}
        node = MultiNodeWeightedSampler(nodes, weights, stop_criteria=StopCriteria.CYCLE_FOREVER,
                                        rank=rank, world_size=world_size, seed=SEED)
        node = Take(node, steps * RANK_BATCH)
        node = ParallelMapper(node, decode, num_workers=NUM_WORKERS, method="process",
                              multiprocessing_context="fork", prebatch=RANK_BATCH if key == "nodes" else None)
        return Loader(Batcher(node, batch_size=RANK_BATCH))
    if key in ("hf", "hf_uneven"):
        from datasets import Dataset, interleave_datasets
        from datasets.distributed import split_dataset_by_node

        shards = (8, 8, 8) if key == "hf" else (20, 5, 2)
        sources = [Dataset.from_dict({column: [r[column] for r in records] for column in ("source", "idx", "text")})
                   .to_iterable_dataset(num_shards=k) for (name, records), k in zip(data.items(), shards, strict=True)]
        # a seed per rank decorrelates the ranks' draws; where split_dataset_by_node skips,
        # every rank must draw the same stream (one seed), or the ranks' shares overlap
        ds = interleave_datasets(sources, probabilities=list(WEIGHTS), seed=SEED + rank if key == "hf" else SEED,
                                 stopping_strategy="all_exhausted")
        ds = split_dataset_by_node(ds, rank=rank, world_size=world_size)
        ds = ds.map(Decode(decode.iters, as_dict=True), remove_columns=["source", "text"])
        per_worker = steps * RANK_BATCH // NUM_WORKERS
        # take() counts per DataLoader worker, and before split_dataset_by_node's skip when it skips
        ds = ds.take(per_worker if key == "hf" else per_worker * world_size)
        return DataLoader(ds, batch_size=RANK_BATCH, num_workers=NUM_WORKERS, multiprocessing_context="fork")
    raise ValueError(f"unknown variant {key!r}")


def _take_node() -> type:
    from torchdata.nodes import BaseNode

    class Take(BaseNode):
        """The first ``n`` items of ``source`` (torchdata 0.11 has no such node)."""

        def __init__(self, source: Any, n: int) -> None:
            super().__init__()
            self.source, self.n, self.taken = source, n, 0

        def reset(self, initial_state: dict | None = None) -> None:
            super().reset(initial_state)
            self.source.reset(None if initial_state is None else initial_state["source"])
            self.taken = 0 if initial_state is None else initial_state["taken"]

        def next(self) -> Any:
            if self.taken >= self.n:
                raise StopIteration
            self.taken += 1
            return next(self.source)

        def get_state(self) -> dict:
            return {"source": self.source.state_dict(), "taken": self.taken}

    return Take


def pairs(batch: Any) -> list[tuple[int, int]]:
    """``[(source id, index), ...]`` of one batch, whatever the loader collated."""
    if isinstance(batch, dict):  # HF rows through default_collate
        return list(zip(batch["sid"].tolist(), batch["idx"].tolist(), strict=True))
    if isinstance(batch, (list, tuple)) and len(batch) == 2 and hasattr(batch[0], "tolist"):
        return list(zip(batch[0].tolist(), batch[1].tolist(), strict=True))  # tuples through default_collate
    return [(int(s), int(i)) for s, i in batch]  # torchdata's Batcher: a list of tuples


def close(iterator: Any) -> None:
    """Stop and join the worker processes (so that RUSAGE_CHILDREN counts them)."""
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()  # a DataLoader's
    if "torchdata.nodes" in sys.modules:  # torchdata.nodes: its mapper iterators join their processes
        import gc

        from torchdata.nodes.map import _ParallelMapperIter

        for obj in gc.get_objects():
            if type(obj) is _ParallelMapperIter:  # not isinstance: it would probe every object's class
                obj._shutdown()
    for child in multiprocessing.active_children():
        child.join(timeout=10)


@dataclass
class MixJob(harness.Job):
    """Every rank makes the data (before the window), builds row ``key``'s loader and
    takes ``steps`` batches; decodes are counted in a counter the rank shares with
    the processes it forks (torchdata.nodes' mappers do not report)."""

    key: str = "distshard"
    sizes: list[int] = field(default_factory=list)
    iters: int = 0
    report: bool = False

    def prepare(self, rank: int) -> None:
        import_libraries(self.key)
        self.data = {name: make_records(name, n) for name, n in zip(NAMES, self.sizes, strict=True)}  # they exist before the job
        harness.share_counts("decodes")

    def build(self, rank: int) -> Any:
        return build(self.key, self.data, Decode(self.iters), rank, self.world_size, self.steps)

    def loader(self, built: Any) -> Any:
        from torch.utils.data import DataLoader

        if isinstance(built, DataLoader):
            built.timeout = self.timeout if built.num_workers else 0
        return built

    def keep(self, batch: Any, values: list) -> None:
        values.append(pairs(batch))

    def close(self, iterator: Any) -> None:
        close(iterator)


def run_variant(key: str, sizes: list[int], steps: int, iters: int, timeout: float) -> dict[str, Any]:
    """One gloo group, one row: what every rank returned."""
    return asdict(harness.run_job(MixJob(key=key, sizes=sizes, steps=steps, iters=iters, timeout=timeout,
                                         world_size=WORLD_SIZE, num_workers=NUM_WORKERS)))


def run_peer(key: str, sizes: list[int], steps: int, iters: int, timeout: float) -> dict[str, Any]:
    """``run_variant`` in the peers' venv, with the peers' versions."""
    return {**run_variant(key, sizes, steps, iters, timeout), "versions": harness.versions("torch", "torchdata", "datasets")}


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


# -- the table -------------------------------------------------------------------------------
def _dev(values: list[float]) -> str:
    return " / ".join(f"{v:.1f}" for v in values)


def _once(row: dict[str, Any]) -> str:
    passes = row["passes"]
    if not passes["left_out"] and not passes["beyond"]:
        return "✓"
    parts = []
    if passes["left_out"]:
        worst = [f"{name} {p['left_out']}" for name, p in passes["per_source"].items() if p["left_out"]]
        parts.append(f"{passes['left_out']} left out of a completed pass ({', '.join(worst)})")
    if passes["beyond"]:
        parts.append(f"{passes['beyond']} extra repeats")
    return "✗ " + "; ".join(parts)


def targets(row: dict[str, Any], best_peer_cpu: float | None) -> dict[str, Any]:
    reads_ok = f"{row['reads_max']:.2f}" == "1.00"
    deviation = max(row["global_deviation"])
    step = max(row["step_deviation"])
    cpu_ok = best_peer_cpu is not None and row["cpu_s"] <= best_peer_cpu
    return {"reads": reads_ok, "deviation": deviation <= TARGET_DEVIATION,
            "deviation_per_step": step <= TARGET_DEVIATION, "cpu": cpu_ok if best_peer_cpu is not None else None}


COLUMNS = [Col("row"), Col("pipeline (per rank)"), Col("reads / delivered", 2),
           Col("worst deviation per global batch of 256 (web / code / math)", right=True),
           Col("same, per training step as delivered", right=True), Col("same stream"),
           Col("each element once per pass"), Col("CPU s", 2), Col("wall s", 2), Col("targets")]
BOUNDS_COLUMNS = [Col("row"), Col("pipeline (per rank)"), Col("reads / delivered", 2),
                  Col("worst prefix deviation", right=True), Col("bound"), Col("same stream"),
                  Col("each element once per pass"), Col("CPU s", 2), Col("wall s", 2)]


def _failed(row: dict[str, Any], default: str) -> str:
    return "failed: " + harness.error_line((row.get("errors") or [default])[0])[:140]


def table(rows: list[dict[str, Any]], best_peer_cpu: float | None) -> str:
    cells = []
    for row in rows:
        variant = BY_KEY[row["key"]]
        code = variant.code
        if "skipped" in row:
            cells.append([variant.label, code, f"not run: {row['skipped']}"])
            continue
        if "cpu_s" not in row:
            cells.append([variant.label, code, _failed(row, "?")])
            continue
        verdict = "—"
        if variant.target:
            t = targets(row, best_peer_cpu)
            words = [("reads", t["reads"]), ("deviation", t["deviation"]), ("CPU", t["cpu"])]
            met = [w for w, ok in words if ok]
            missed = [w for w, ok in words if ok is False]
            verdict = ("met: " + ", ".join(met) if met else "") + (
                ("; " if met else "") + "**missed**: " + ", ".join(missed) if missed else "")
            if not t["deviation_per_step"]:
                verdict += "; per step: **missed**"
        cells.append([variant.label, code, row["reads_per_delivered"], _dev(row["global_deviation"]),
                      _dev(row["step_deviation"]), row["same_stream"], _once(row), row["cpu_s"], row["wall_s"],
                      verdict])
    return harness.table(COLUMNS, cells)


def bounds_table(rows: list[dict[str, Any]]) -> str:
    """The phased and cost-weighted rows: their own prefix bound, reads, CPU."""
    cells = []
    for row in rows:
        variant = BY_KEY[row["key"]]
        if "cpu_s" not in row or "prefix" not in row:
            cells.append([variant.label, variant.code, _failed(row, "no global stream")])
            continue
        prefix = row["prefix"]
        if prefix["unit"] == "elements":
            worst = f"{prefix['worst']:.2f} elements (from each phase's start)"
            bound = "< 1 element: " + ("**met**" if prefix["worst"] < 1 else "**missed**")
        else:
            shares = " / ".join(f"{t:.1%}" for t in prefix["token_shares"])
            samples = " / ".join(f"{t:.1%}" for t in prefix["sample_shares"])
            worst = f"{prefix['worst']:.2f} × the largest record's tokens (token shares {shares}; sample shares {samples})"
            bound = (f"≤ 1 × (the issue's: ≤ {prefix['issue_bound']:g} ×): "
                     + ("**met**" if prefix["worst"] <= 1 else "**missed**"))
        cells.append([variant.label, variant.code, row["reads_per_delivered"], worst, bound, row["same_stream"],
                      _once(row), row["cpu_s"], row["wall_s"]])
    return harness.table(BOUNDS_COLUMNS, cells)


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"sources {'/'.join(map(str, QUICK_SIZES))}, {QUICK_STEPS} steps, 1 round")
    parser.add_argument("--rounds", type=int, default=None, help=f"interleaved rounds (default {ROUNDS})")
    parser.add_argument("--only", default="", help="comma-separated rows: " + ",".join(BY_KEY))
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds a row may take")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the raw numbers")
    harness.add_child_args(parser)  # internal: one row in the peers' venv
    args = parser.parse_args(None if argv is None else list(argv))
    if args.run:
        return harness.child(args.run, args.out, globals())
    return orchestrate(args, harness.choose(args.only, BY_KEY, parser))


def orchestrate(args: argparse.Namespace, chosen: list[Variant]) -> int:
    sizes, steps = (list(QUICK_SIZES), QUICK_STEPS) if args.quick else (list(SIZES), STEPS)
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else ROUNDS)
    session = harness.Session()
    iters, cost = harness.calibrate(DECODE_TARGET_S, calibration_decode)
    draws = steps * GLOBAL_BATCH
    expected = {v.key: expected_stream(v.key, sizes, steps) for v in chosen if v.key.startswith("distshard")}
    runs: dict[str, list[dict[str, Any]]] = {v.key: [] for v in chosen}
    peer_versions: dict[str, str] = {}
    for r, order in harness.rounds(chosen, rounds):
        for variant in order:
            t0 = time.perf_counter()
            if variant.venv == "dev":
                run = run_variant(variant.key, sizes, steps, iters, args.timeout)
            else:
                run = harness.launch(__file__, "run_peer", {"key": variant.key, "sizes": sizes, "steps": steps,
                                                            "iters": iters, "timeout": args.timeout},
                                     peers=True, timeout=args.timeout, grace=60)
                peer_versions.update(run.get("versions", {}))
            if "skipped" in run:
                runs[variant.key].append(run)
            else:
                runs[variant.key].append(analyze(variant, run, sizes, steps, expected.get(variant.key)))
            print(f"#   round {r + 1}/{rounds}: {variant.key} in {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
    rows = [summarize(v, runs[v.key]) for v in chosen]
    peers = [row["cpu_s"] for row in rows if "cpu_s" in row and not BY_KEY[row["key"]].key.startswith("distshard")]
    best_peer = min(peers) if peers else None
    print(session.header(
        f"sources {' / '.join(f'{n} {s:,}' for n, s in zip(NAMES, sizes, strict=True))}, weights "
        f"{' / '.join(f'{w:g}' for w in WEIGHTS)}; {steps} steps × global batch {GLOBAL_BATCH} = {draws:,} draws; "
        f"{WORLD_SIZE} gloo ranks × {NUM_WORKERS} workers; decode {cost * 1e6:.0f} µs CPU; {rounds} round(s), "
        "CPU medians"))
    print()
    print(table([row for row in rows if not BY_KEY[row["key"]].bounds], best_peer))
    print()
    bounded = [row for row in rows if BY_KEY[row["key"]].bounds]
    if bounded:
        print(bounds_table(bounded))
        print()
    harness.print_left_out(rows, lambda row: BY_KEY[row["key"]].label)
    elapsed = session.elapsed
    print(f"reads / delivered: decode calls in all processes / elements the 4 ranks received. Deviation: "
          f"per source, max over the {steps} global batches of |count − 256 × weight| (targets "
          f"{', '.join(f'{256 * w:g}' for w in WEIGHTS)}); distshard's global batches are 256 consecutive "
          f"positions of its reconstructed global stream (checked against the unsharded mix: same stream), "
          f"the peers' are the 4 ranks' batches of a step. Per training step: the 4 ranks' batches of a step, "
          f"for every row. CPU s: user+sys of the 4 ranks and their workers, median of {rounds}. "
          f"Targets for distshard: reads 1.00, deviation ≤ {TARGET_DEVIATION:g} per source per global batch, "
          f"CPU ≤ the best peer's ({'—' if best_peer is None else f'{best_peer:.2f} s'}). "
          f"Ideal CPU (decode once per draw): {draws * cost:.2f} s. Total {elapsed:.0f} s.")
    for row in rows:
        if BY_KEY[row["key"]].target and "cpu_s" in row:
            t = targets(row, best_peer)
            print(f"distshard: reads {row['reads_per_delivered']:.4f} per delivered element "
                  f"({'met' if t['reads'] else 'MISSED'}); worst deviation per global batch "
                  f"{max(row['global_deviation']):.1f} ({'met' if t['deviation'] else 'MISSED'}), per training "
                  f"step {max(row['step_deviation']):.1f} ({'met' if t['deviation_per_step'] else 'MISSED'}); "
                  f"CPU {row['cpu_s']:.2f} s vs best peer "
                  f"{'—' if best_peer is None else f'{best_peer:.2f} s'} "
                  f"({'met' if t['cpu'] else 'not measured' if t['cpu'] is None else 'MISSED'}).")
    session.dump(args.json, peers=peer_versions, sizes=sizes, steps=steps, weights=WEIGHTS, global_batch=GLOBAL_BATCH,
                 world_size=WORLD_SIZE, num_workers=NUM_WORKERS, decode_iters=iters, decode_cost_s=cost,
                 rounds=rounds, best_peer_cpu_s=best_peer,
                 rows=[{k: v for k, v in row.items() if k != "rounds"} | {"per_round": row.get("rounds", [])}
                       for row in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
