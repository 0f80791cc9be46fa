r"""A job on a gloo group (:mod:`harness` re-exports it).

``Job``, ``run_job``, ``GroupRun``: a fresh gloo group of ranks on 127.0.0.1
    (``distshard.verify.run_on_group``, every wait bounded). Every rank runs
    ``prepare`` (imports, data), meets the others at a barrier, ``build``\ s its
    pipeline (if one rank fails, all skip: the DataLoader's iterator makes a
    collective), iterates it through ``DataLoader(num_workers=K, fork)`` for
    ``epochs`` epochs (``set_epoch`` between them), joins the workers and
    returns what it kept and measured. A script subclasses ``Job`` where it differs.
``reporting``, ``SelfReporting``, ``worker_init``: the last stage of every pipeline
    writes, when a worker's iteration ends, its counts (``harness_meters.count``),
    CPU, bytes read, peak RSS and yield count for its rank to collect;
    ``GroupRun.total`` sums ranks and workers.
"""

from __future__ import annotations

import json
import os
import resource
import tempfile
import time
import traceback
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from torch.utils.data import IterableDataset, get_worker_info
from torch.utils.data.datapipes.datapipe import IterDataPipe

from harness_meters import Meter, _delta, counts, rchar

# -- the workers' reports --------------------------------------------------------------------
EPOCH = 0  # the epoch the rank iterates (its forked workers inherit it)
_BASE: dict[str, Any] = {}  # set by worker_init in a worker


def worker_init(_: int = 0) -> None:
    """``worker_init_fn``: a worker's counts, CPU and reads are counted from here
    (without it, from the start of its iteration)."""
    _BASE.update(pid=os.getpid(), counts=counts(), cpu=time.process_time(), rchar=rchar())


class _Reporting:
    """The last stage: counts what this copy yields and, when its iteration ends (or
    fails), writes this process's figures to ``outdir``."""

    def __init__(self, inner: Any, outdir: str, rank: int, extra: Callable[[], dict] | None = None) -> None:
        self.inner, self.outdir, self.rank, self.extra = inner, outdir, rank, extra

    def __iter__(self) -> Iterator[Any]:
        start = {"counts": counts(), "cpu": time.process_time(), "rchar": rchar()}
        base = _BASE if _BASE.get("pid") == os.getpid() else start
        yielded = 0
        try:
            for item in self.inner:
                yielded += 1
                yield item
        finally:
            info = get_worker_info()
            worker = -1 if info is None else info.id
            now = time.process_time()
            record = {"rank": self.rank, "worker": worker, "pid": os.getpid(), "epoch": EPOCH, "yielded": yielded,
                      "counts": _delta(counts(), base["counts"]), "cpu_s": now - base["cpu"],
                      "iter_cpu_s": now - start["cpu"], "rchar": rchar() - base["rchar"],
                      "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                      **(self.extra() if self.extra is not None else {})}
            name = f"r{self.rank}-w{worker}-e{EPOCH}-p{os.getpid()}-{time.monotonic_ns()}.json"
            (Path(self.outdir) / name).write_text(json.dumps(record))


class ReportPipe(_Reporting, IterDataPipe):
    """For DataPipes: stays a DataPipe, so that the DataLoader still shards and seeds its graph."""


class ReportDataset(_Reporting, IterableDataset):
    """For the peers' iterable datasets."""


class SelfReporting:
    """A mixin for a dataset whose loader must get it as itself (litdata's
    ``StreamingDataLoader`` refuses any other dataset): ``reporting`` leaves it
    unwrapped and hands it the stage, which its ``__iter__`` then goes through."""

    report_stage: _Reporting | None = None

    def __iter__(self) -> Iterator[Any]:
        items = super().__iter__()  # type: ignore[misc]
        if self.report_stage is None:
            return items
        self.report_stage.inner = _stepping(items)
        return iter(self.report_stage)


def _stepping(items: Iterator[Any]) -> Iterator[Any]:
    """``items`` by ``next`` alone (litdata's dataset is its own iterator: ``iter()``
    on it would come back to ``SelfReporting.__iter__``)."""
    while True:
        try:
            item = next(items)
        except StopIteration:
            return
        yield item


def reporting(inner: Any, outdir: str, rank: int, extra: Callable[[], dict] | None = None) -> Any:
    """``inner`` with the reporting stage after it (inside it, for a ``SelfReporting`` dataset)."""
    if isinstance(inner, SelfReporting):
        inner.report_stage = _Reporting(None, outdir, rank, extra)
        return inner
    return (ReportPipe if isinstance(inner, IterDataPipe) else ReportDataset)(inner, outdir, rank, extra)


# -- a job on a gloo group -------------------------------------------------------------------
@dataclass
class Job:
    """What every rank of a group does (see the module docstring); a script
    subclasses it with its pipeline. Fields travel to the ranks (picklable); keep
    big data out of what ``build`` attaches to the pipeline."""

    world_size: int = 4
    num_workers: int = 2
    batch_size: int | None = None
    epochs: int = 1
    timeout: float = 120.0  # seconds an epoch may take (the DataLoader's timeout too)
    steps: int | None = None  # stop an epoch after this many kept items
    window_includes_build: bool = True  # the measured window starts before ``build``, else right after it
    report: bool = True  # append the reporting stage (every worker reports)
    worker_init: bool = False  # count a worker from its start, not from its iteration's
    torchrun_env: bool = False  # set RANK, WORLD_SIZE, LOCAL_RANK, ... as torchrun would

    worker_extra: Callable[[], dict] | None = None  # a module-level function: more figures for a worker's report

    def prepare(self, rank: int) -> None:
        """Before the window: imports, data."""

    def build(self, rank: int) -> Any:
        """The pipeline (a DataPipe or a dataset), or a ready loader if ``loader`` is overridden."""
        raise NotImplementedError

    def describe(self, pipe: Any) -> Any:
        """Something to say about the built pipeline (in the window, after ``build``)."""
        return None

    def loader(self, pipe: Any) -> Iterable[Any]:
        from torch.utils.data import DataLoader

        return DataLoader(pipe, batch_size=self.batch_size, num_workers=self.num_workers,
                          multiprocessing_context="fork" if self.num_workers else None, timeout=self.timeout,
                          worker_init_fn=worker_init if self.worker_init else None)

    def keep(self, item: Any, values: list) -> None:
        """What to keep of one item the loader yields."""
        values.append(item)

    def close(self, iterator: Any) -> None:
        """Stop and join the loader's workers (so that ``RUSAGE_CHILDREN`` counts them)."""
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()

    def figures(self) -> dict[str, Any]:
        """More figures of this rank for its result (after the last epoch), e.g. what ``keep`` timed."""
        return {}


def _rank_main(rank: int, world_size: int, job: Job, outdir: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    global EPOCH
    if job.torchrun_env:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1")
    mine = Path(outdir) / f"rank{rank}"
    mine.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"rank": rank, "values": [], "error": None}
    job.prepare(rank)
    dist.barrier()
    meter = Meter() if job.window_includes_build else None
    pipe = None
    try:
        pipe = job.build(rank)
        if job.report:
            pipe = reporting(pipe, str(mine), rank, job.worker_extra)
        out["info"] = job.describe(pipe)
    except BaseException:  # noqa: BLE001 - reported
        out["error"] = traceback.format_exc()
        pipe = None
    built = torch.tensor([0 if pipe is None else 1])
    dist.all_reduce(built, op=dist.ReduceOp.MIN)
    if not built.item():
        out["error"] = out["error"] or "another rank failed to build its pipeline"
        return out
    meter = meter or Meter()
    out["rank_rchar"] = meter.rchar()  # a rank's reads while building; later, its workers' batches come through pipes
    iterator = None
    try:
        loader = job.loader(pipe)
        for epoch in range(job.epochs):
            if job.epochs > 1:
                import distshard

                distshard.set_epoch(pipe, epoch)
            EPOCH = epoch
            values: list = []
            out["values"].append(values)
            iterator = iter(loader)
            for item in iterator:
                job.keep(item, values)
                if job.steps is not None and len(values) >= job.steps:
                    break
            job.close(iterator)
            iterator = None
    except BaseException:  # noqa: BLE001 - reported, e.g. the classic recipe on bad data
        out["error"] = traceback.format_exc()
    finally:
        if iterator is not None:
            job.close(iterator)
        del iterator
    out.update(meter.read())
    out.update(job.figures())
    out["workers"] = [json.loads(p.read_text()) for p in sorted(mine.glob("*.json"))]
    return out


@dataclass
class GroupRun:
    """What the ranks of one group returned (``ranks``, by rank), and what went wrong."""

    ranks: list[dict[str, Any]]
    errors: list[str]
    world_size: int
    expected_workers: int | None = None  # worker reports a rank must have (None: no reports)
    seconds: float = 0.0

    @classmethod
    def of(cls, data: dict[str, Any]) -> GroupRun:
        """Back from JSON (``asdict`` of one, through a child process)."""
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    @property
    def measured(self) -> list[dict[str, Any]]:
        return [r for r in self.ranks if "wall_s" in r]

    @property
    def complete(self) -> bool:
        """Every rank ran to its end and every worker reported."""
        return len(self.measured) == self.world_size and (
            self.expected_workers is None or all(len(r["workers"]) == self.expected_workers for r in self.measured))

    @property
    def workers(self) -> list[dict[str, Any]]:
        return [w for r in self.measured for w in r["workers"]]

    @property
    def cpu_s(self) -> float:
        return sum(r["cpu_s"] for r in self.measured)

    @property
    def wall_s(self) -> float | None:
        return max((r["wall_s"] for r in self.measured), default=None)

    @property
    def rss_mib(self) -> float:
        """Peak RSS of every rank and worker, summed (forked workers share pages: an over-count)."""
        return (sum(r["rank_maxrss_kib"] for r in self.measured) + sum(w["maxrss_kib"] for w in self.workers)) / 1024

    @property
    def read_bytes(self) -> int:
        """Bytes the ranks read while building plus what their workers read."""
        return sum(r["rank_rchar"] for r in self.measured) + sum(w["rchar"] for w in self.workers)

    def total(self, name: str = "decodes") -> int:
        """``name`` counted in every process of the job."""
        total = 0
        for r in self.measured:
            if name in r["shared_counts"]:
                total += r["shared_counts"][name]
            else:
                total += r["rank_counts"].get(name, 0) + sum(w["counts"].get(name, 0) for w in r["workers"])
        return total

    def values(self) -> list[Any]:
        """Everything every rank kept, over all epochs."""
        return [v for r in self.ranks for epoch in r["values"] for v in epoch]


def run_job(job: Job) -> GroupRun:
    """``job`` on a fresh gloo group; bounded by ``job.timeout`` per epoch."""
    from distshard.verify import run_on_group

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-") as outdir:
        outcomes = run_on_group(_rank_main, world_size=job.world_size, timeout=job.timeout * job.epochs,
                                args=(job, outdir))
    expected = job.num_workers * job.epochs if job.report else None
    ranks, errors = [], []
    for outcome in outcomes:
        value = outcome.value
        if outcome.error or value is None:
            errors.append(f"rank {outcome.rank}: {outcome.error or 'no result'}")
            continue
        ranks.append(value)
        if value["error"]:
            errors.append(f"rank {outcome.rank}: {value['error']}")
        if expected is not None and "wall_s" in value and len(value["workers"]) != expected:
            errors.append(f"rank {outcome.rank}: {len(value['workers'])} worker reports, expected {expected}")
    return GroupRun(ranks, errors, job.world_size, expected, time.perf_counter() - started)
