"""Pipeline factories for the tests that run in other processes (they must be
importable by name in spawned processes, hence a module of their own)."""

from __future__ import annotations

import torch
from torch.utils.data.datapipes.iter import IterableWrapper

import distshard  # noqa: F401  (registers .dist_shard)


def records(n: int) -> list[dict]:
    return [{"id": f"rec-{i:04d}", "value": i % 5} for i in range(n)]


def decode(record: dict) -> dict:
    return {**record, "decoded": record["id"].upper()}


def strings_none():
    return IterableWrapper([f"s{i}" for i in range(1000)]).dist_shard()


def dicts_drop():
    return IterableWrapper(records(103)).shuffle().dist_shard(even="drop").map(decode)


def dicts_pad():
    return IterableWrapper(records(103)).shuffle().dist_shard(even="pad").map(decode)


def tensors_none():
    return IterableWrapper([torch.tensor([i, i * i]) for i in range(37)]).dist_shard()


def evens_drop():
    return IterableWrapper(list(range(0, 2000, 2))).dist_shard(even="drop")


def duplicated_pad():
    return IterableWrapper([i % 4 for i in range(50)]).dist_shard(even="pad")


def per_rank_seeded_shuffle():
    """Every rank seeds torch differently, as ``torch.manual_seed(rank)`` code does."""
    import torch.distributed as dist

    torch.manual_seed(1234 + (dist.get_rank() if dist.is_initialized() else 0))
    return IterableWrapper(records(301)).shuffle().dist_shard()


def _batch_and_count(batch):
    return [len(batch), sum(len(r["id"]) for r in batch)]


def ddp_batches(even: str | None):
    """34 records over 3 ranks x 2 workers with batch(5) per worker: without
    ``even`` the slots hold 6,6,6,6,5,5 records, so ranks get 4/4/2 batches."""
    return IterableWrapper(records(34)).shuffle().dist_shard(even=even).map(decode).batch(5)


def ddp_batches_drop():
    return ddp_batches("drop")


def ddp_batches_pad():
    return ddp_batches("pad")


def ddp_batches_uneven():
    return ddp_batches(None)


def sharding_filter_unsynced():
    """torch's recipe sharded by hand, iterated without a DataLoader, with
    per-rank seeds: duplicates and missing elements, as the DESIGN measured."""
    import torch.distributed as dist
    from torch.utils.data.graph_settings import apply_sharding

    pipe = IterableWrapper(list(range(200))).shuffle().sharding_filter()
    if dist.is_initialized():
        torch.manual_seed(dist.get_rank())
        apply_sharding(pipe, dist.get_world_size(), dist.get_rank())
    return pipe
