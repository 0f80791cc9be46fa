"""bench_mix's rows: what each one builds on a rank (distshard, torchdata.nodes, HF
datasets), the job every rank of a gloo group runs, and ``run_variant`` / ``run_peer``
(bench_mix runs the latter in the peers' venv by name, ``harness.launch``)."""

from __future__ import annotations

import multiprocessing
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import harness
from mix_data import (
    GLOBAL_BATCH,
    NAMES,
    NUM_WORKERS,
    RANK_BATCH,
    SEED,
    WEIGHTS,
    WORLD_SIZE,
    Decode,
    make_records,
    mix_options,
)


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
    if key == "distshard_nodes":
        return build_distshard_nodes(data, decode, steps)
    if key.startswith("distshard"):
        return build_distshard(key, data, decode, steps)
    if key in ("nodes", "nodes_default"):
        return build_nodes(key, data, decode, rank, world_size, steps)
    if key in ("hf", "hf_uneven"):
        return build_hf(key, data, decode, rank, world_size, steps)
    raise ValueError(f"unknown variant {key!r}")


def build_distshard_nodes(data: dict[str, list], decode: Decode, steps: int) -> Any:
    """Row ``distshard_nodes``: the rank's share of ``distshard.mix`` (undecoded) in
    torchdata.nodes' ``ParallelMapper`` → ``Batcher`` → ``Loader``."""
    from torch.utils.data.datapipes.iter import IterableWrapper
    from torchdata.nodes import Batcher, Loader, ParallelMapper

    import distshard

    weights = dict(zip(NAMES, WEIGHTS, strict=True))
    sources = {name: IterableWrapper(records, deepcopy=False) for name, records in data.items()}
    node = distshard.DistShardNode(distshard.mix(sources, weights, samples=steps * GLOBAL_BATCH),
                                   even="drop", multiple_of=RANK_BATCH)
    node = ParallelMapper(node, decode, num_workers=NUM_WORKERS, method="process",
                          multiprocessing_context="fork", prebatch=RANK_BATCH)
    return Loader(Batcher(node, batch_size=RANK_BATCH))


def build_distshard(key: str, data: dict[str, list], decode: Decode, steps: int) -> Any:
    """The other distshard rows: ``distshard.mix`` of the decoded sources (the row's
    ``weights=`` / ``cost=``), ``dist_shard``, a forking ``DataLoader``."""
    from torch.utils.data import DataLoader
    from torch.utils.data.datapipes.iter import IterableWrapper

    import distshard

    sources = {name: IterableWrapper(records).map(decode) for name, records in data.items()}
    pipe = distshard.mix(sources, samples=steps * GLOBAL_BATCH, **mix_options(key, data, steps)).dist_shard(
        even="drop", multiple_of=RANK_BATCH)
    workers = BY_KEY[key].workers
    collate = {} if key == "distshard_tensors" else {"collate_fn": list}
    return DataLoader(pipe, batch_size=RANK_BATCH, num_workers=workers,
                      multiprocessing_context="fork" if workers else None, **collate)


def build_nodes(key: str, data: dict[str, list], decode: Decode, rank: int, world_size: int, steps: int) -> Any:
    """Rows ``nodes`` / ``nodes_default``: torchdata.nodes' ``MultiNodeWeightedSampler``
    over the rank's slices, ``Take`` of its share, ``ParallelMapper``, ``Batcher``, ``Loader``."""
    from torchdata.nodes import (
        Batcher,
        IterableWrapper,
        Loader,
        MultiNodeWeightedSampler,
        ParallelMapper,
        StopCriteria,
    )

    Take = _take_node()
    weights = dict(zip(NAMES, WEIGHTS, strict=True))
    nodes = {name: IterableWrapper(records[rank::world_size]) for name, records in data.items()}
    node = MultiNodeWeightedSampler(nodes, weights, stop_criteria=StopCriteria.CYCLE_FOREVER,
                                    rank=rank, world_size=world_size, seed=SEED)
    node = Take(node, steps * RANK_BATCH)
    node = ParallelMapper(node, decode, num_workers=NUM_WORKERS, method="process",
                          multiprocessing_context="fork", prebatch=RANK_BATCH if key == "nodes" else None)
    return Loader(Batcher(node, batch_size=RANK_BATCH))


def build_hf(key: str, data: dict[str, list], decode: Decode, rank: int, world_size: int, steps: int) -> Any:
    """Rows ``hf`` / ``hf_uneven``: HF ``interleave_datasets`` of iterable datasets,
    ``split_dataset_by_node``, ``.map(decode)``, ``.take`` of a worker's share, a ``DataLoader``."""
    from datasets import Dataset, interleave_datasets
    from datasets.distributed import split_dataset_by_node
    from torch.utils.data import DataLoader

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
