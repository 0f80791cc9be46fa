"""Pipeline factories for the tests that run in other processes (they must be
importable by name in spawned processes, hence a module of their own)."""

from __future__ import annotations

import time

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
    per-rank seeds: duplicates and missing elements (the trap dist_shard exists for)."""
    import torch.distributed as dist
    from torch.utils.data.graph_settings import apply_sharding

    pipe = IterableWrapper(list(range(200))).shuffle().sharding_filter()
    if dist.is_initialized():
        torch.manual_seed(dist.get_rank())
        apply_sharding(pipe, dist.get_world_size(), dist.get_rank())
    return pipe


# -- counting reads and decodes across processes (test_read_once.py) ------------------

import os  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Sequence  # noqa: E402

COUNT_DIR = "DISTSHARD_TEST_COUNT_DIR"
N_READ = 240


def _record(kind: str, key) -> None:
    directory = os.environ.get(COUNT_DIR)
    if directory:
        with open(os.path.join(directory, f"{kind}-{os.getpid()}"), "a") as handle:
            handle.write(f"{key}\n")


def counted(directory: str, kind: str) -> Counter:
    """How often each key was recorded as ``kind``, over all processes."""
    total: Counter = Counter()
    for name in os.listdir(directory):
        if name.startswith(kind + "-"):
            with open(os.path.join(directory, name)) as handle:
                total.update(line.strip() for line in handle)
    return total


class CountingSequence(Sequence):
    """A random-access source that records every element it is asked for."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index):
        if isinstance(index, slice):
            raise TypeError("no slicing: a slot must read single elements")
        if not 0 <= index < self.n:
            raise IndexError(index)
        _record("read", index)
        return index


class CountingStream:
    """A source without random access that records every element it produces."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for index in range(self.n):
            _record("read", index)
            yield index


def counting_decode(index: int) -> str:
    _record("decode", index)
    return f"item-{index:04d}"


def read_fast_path():
    return IterableWrapper(CountingSequence(N_READ), deepcopy=False).map(counting_decode).dist_shard()


def read_fast_path_shuffled():
    return (
        IterableWrapper(CountingSequence(N_READ), deepcopy=False)
        .map(counting_decode)
        .dist_shard(shuffle=True, even="drop")
    )


def read_pushdown():
    return IterableWrapper(CountingStream(N_READ), deepcopy=False).map(counting_decode).dist_shard(even="pad")


def read_no_pushdown():
    return IterableWrapper(CountingStream(N_READ), deepcopy=False).map(counting_decode).dist_shard(pushdown=False)


UNIT_SIZES = [0, 37, 5, 0, 61, 18, 40, 11, 29, 1, 38]  # 240 elements, empty units too


class CountingUnit(Sequence):
    """A unit's elements, decoded on access."""

    def __init__(self, unit: int) -> None:
        self.unit = unit
        self.offset = sum(UNIT_SIZES[:unit])

    def __len__(self) -> int:
        return UNIT_SIZES[self.unit]

    def __getitem__(self, index):
        if not 0 <= index < len(self):
            raise IndexError(index)
        return counting_decode(self.offset + index)


def expand_sequence(unit: int) -> CountingUnit:
    _record("open", unit)
    return CountingUnit(unit)


def expand_iterator(unit: int):
    _record("open", unit)
    offset = sum(UNIT_SIZES[:unit])
    for index in range(UNIT_SIZES[unit]):
        yield counting_decode(offset + index)


def unit_size(unit: int) -> int:
    return UNIT_SIZES[unit]


def read_units_sized_sequence():
    return (
        IterableWrapper(range(len(UNIT_SIZES)))
        .shuffle()
        .dist_shard(expand=expand_sequence, sizes=unit_size, even="drop")
    )


def read_units_sized_shuffled():
    return IterableWrapper(range(len(UNIT_SIZES))).dist_shard(expand=expand_sequence, sizes=UNIT_SIZES, shuffle=True)


def read_units_sized_iterator():
    return IterableWrapper(range(len(UNIT_SIZES))).dist_shard(expand=expand_iterator, sizes=UNIT_SIZES)


def read_units_whole_sequence():
    return IterableWrapper(range(len(UNIT_SIZES))).shuffle().dist_shard(expand=expand_sequence)


# -- resume, elastic resume and a killed rank (test_resume.py) ---------------------------

N_RESUME = 203


def resume_pipeline(even="drop"):
    """Shuffled upstream, decode after the shard, batches of 3."""
    return IterableWrapper(records(N_RESUME)).shuffle().dist_shard(even=even).map(decode).batch(3)


def _ids(batch):
    return [r["id"] for r in batch]


def run_and_checkpoint(rank, world_size, workers, steps, state=None, kill_rank=None, state_dir=None):
    """One rank of a training-like loop over a StatefulDataLoader.

    Loads ``state`` (a merged state) if given, runs ``steps`` steps (all of the
    epoch if None) with an all_reduce per step, and returns the ids it consumed
    and its loader state. With ``state_dir`` it saves that checkpoint to a file
    and goes on; ``kill_rank`` then SIGKILLs itself three steps later.
    """
    import json
    import signal

    import torch.distributed as dist
    from torchdata.stateful_dataloader import StatefulDataLoader

    pipeline = distshard.StatefulPipeline(resume_pipeline())
    if state is not None:
        pipeline.load_state_dict(state)
    kwargs = {"multiprocessing_context": "fork", "timeout": 60} if workers else {}
    loader = StatefulDataLoader(pipeline, batch_size=None, num_workers=workers, **kwargs)
    grad = torch.zeros(2)
    consumed = []
    iterator = iter(loader)
    step = 0
    for batch in iterator:
        consumed.extend(_ids(batch))
        dist.all_reduce(grad)
        step += 1
        if steps is not None and step == steps:
            if state_dir is None:
                return consumed, loader.state_dict()
            with open(f"{state_dir}/rank{rank}.json", "w") as handle:
                json.dump({"consumed": consumed, "state": loader.state_dict()}, handle)
        if kill_rank == rank and steps is not None and step == steps + 3:
            os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return consumed, loader.state_dict()


# -- stop_together (test_guard.py) -----------------------------------------------------


def _keep_for_rank(record):
    """A data-dependent filter that keeps a different share on every rank."""
    import torch.distributed as dist

    return int(record["id"][-4:]) % (dist.get_rank() + 2) != 0


def guarded_loop(rank, world_size, guard, workers):
    """A DDP-style loop over a filtered pipeline; returns (steps, unused, per-rank unused, total)."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    pipe = IterableWrapper(records(120)).dist_shard(even="drop").filter(_keep_for_rank).batch(2)
    kwargs = {"multiprocessing_context": "fork", "timeout": 30} if workers else {}
    loader = DataLoader(pipe, batch_size=None, num_workers=workers, **kwargs)
    total = sum(1 for _ in loader)
    loop = distshard.stop_together(loader, timeout=10) if guard else loader
    grad = torch.zeros(2)
    steps = 0
    for _ in loop:
        dist.all_reduce(grad)
        steps += 1
    dist.barrier()
    if guard:
        return steps, loop.unused, loop.unused_per_rank, total
    return steps, None, None, total


def not_a_pipeline_factory():
    raise RuntimeError("this factory is broken on purpose")


NOT_CALLABLE = 3


def _count_record(record: dict) -> dict:
    _record("decode", record["id"])
    return record


def resume_pipeline_counted():
    """``resume_pipeline`` with a map after the shard that records every record it sees."""
    return IterableWrapper(records(N_RESUME)).shuffle().dist_shard(even="drop").map(_count_record).batch(3)


def gather_after(rank, world_size, steps):
    """Consume ``steps`` batches, then merge every rank's state with the collective."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(
        distshard.StatefulPipeline(resume_pipeline()),
        batch_size=None,
        num_workers=2,
        multiprocessing_context="fork",
        timeout=60,
    )
    consumed, it = [], iter(loader)
    for _ in range(steps):
        consumed.extend(_ids(next(it)))
    return consumed, distshard.gather_states(loader.state_dict())


def guarded_subgroup(rank, world_size):
    """stop_together over a subgroup for three epochs (wrappers made anew or kept):
    ranks outside it never iterate the loop."""
    import torch.distributed as dist

    sub = dist.new_group(ranks=[0, 1])  # collective over all ranks
    if rank > 1:
        return None
    guarded = distshard.stop_together(range(3 + rank), group=sub, timeout=30)
    again = distshard.stop_together(range(4 + rank), group=sub, timeout=30)
    steps = [sum(1 for _ in guarded)]
    if rank == 1:  # rank 0 asks for its address first, as a rank that is ahead would
        time.sleep(1)
    return [*steps, sum(1 for _ in guarded), sum(1 for _ in again)]


def _counted_size(unit: int) -> int:
    _record("size", unit)
    return UNIT_SIZES[unit]


def sizes_once_per_job(rank, world_size, workers):
    """Unit mode with a sizes callable through a DataLoader with workers: returns
    what this rank yielded."""
    from torch.utils.data import DataLoader

    pipe = IterableWrapper(list(range(len(UNIT_SIZES)))).dist_shard(
        expand=expand_sequence, sizes=_counted_size, even="drop"
    )
    loader = DataLoader(pipe, batch_size=None, num_workers=workers, multiprocessing_context="fork")
    return [list(x) if isinstance(x, tuple) else x for x in loader]


# -- mixing (test_mix.py) ------------------------------------------------------------------


def mixed_sources(stop="first_exhausted"):
    web = IterableWrapper([f"web{i}" for i in range(140)])
    code = IterableWrapper([f"code{i}" for i in range(37)])
    math_ = IterableWrapper([f"math{i}" for i in range(23)])
    return distshard.mix({"web": web, "code": code, "math": math_}, {"web": 0.7, "code": 0.2, "math": 0.1}, stop=stop)


def mixed_first_exhausted_drop():
    return mixed_sources().dist_shard(even="drop")


def mixed_all_exhausted():
    return mixed_sources("all_exhausted").dist_shard()


def mixed_streams_shuffled():
    """Stream sources that shuffle: each pass of a source comes in a new order."""
    web = IterableWrapper([f"web{i}" for i in range(60)]).shuffle()
    math_ = IterableWrapper([f"math{i}" for i in range(7)]).shuffle()
    # an explicit seed: verify's unsharded reference then draws the same orders (with seed=None the
    # ranks use the DataLoader's shared seed, and the partial last pass holds other elements)
    return distshard.mix({"web": web, "math": math_}, {"web": 3, "math": 1}).dist_shard(seed=11)


def weighted_draws():
    return distshard.weighted_sample(
        IterableWrapper(list(range(50))), [1 + (i % 5) for i in range(50)], samples=301
    ).dist_shard(seed=7)


# -- issue 15: factories that return the wrong thing -------------------------------------


def returns_a_list():
    """Returns the records, not a pipeline over them."""
    return records(10)


def drop_multiple_of():
    """103 records over 2 x 2 slots in batches of 4: each slot keeps 24, 7 are left out."""
    return IterableWrapper(records(103)).dist_shard(even="drop", multiple_of=4)


def carry_strings():
    """23 strings over 2 x 2 slots with even="carry": each slot yields 5, the tail of 3 opens the next epoch."""
    return IterableWrapper([f"s{i}" for i in range(23)]).dist_shard(even="carry", shuffle=True, seed=4)
