r"""What every benchmark script shares, once; a script keeps its contenders (the
pipelines it compares), its targets and its own analysis.

``Job``, ``run_job``, ``GroupRun``: a fresh gloo group of ranks on 127.0.0.1
    (``distshard.verify.run_on_group``, every wait bounded). Every rank runs
    ``prepare`` (imports, data), meets the others at a barrier, ``build``\ s its
    pipeline (if one rank fails, all skip: the DataLoader's iterator makes a
    collective), iterates it through ``DataLoader(num_workers=K, fork)`` for
    ``epochs`` epochs (``set_epoch`` between them), joins the workers and
    returns what it kept and measured. A script subclasses ``Job`` where it differs.
``count``, ``share_counts``: per-process counters (``decodes``, ...). The last
    stage of every pipeline (``reporting``) writes, when a worker's iteration
    ends, its counts, CPU, bytes read, peak RSS and yield count for its rank to
    collect; ``GroupRun.total`` sums ranks and workers. Where workers cannot
    report (torchdata.nodes' mappers), ``share_counts`` makes the rank and what
    it forks add into one shared counter.
``Meter``: user + sys CPU of a rank and its joined workers (``RUSAGE_SELF`` +
    ``RUSAGE_CHILDREN``), wall, peak RSS and bytes read (``/proc/self/io``).
``exactly_once``, ``epochs_check``: the delivered multiset against the expected
    one, with what ``even`` allows, or over several epochs of ``drop`` / ``carry``.
``burn``, ``Decode``, ``calibrate``: the counted busy-loop decode, calibrated once.
``peers_python``, ``setup_peers``, ``launch``, ``child``: the benchmark-only venv
    ``benchmarks/.venv`` and running a script's function in a fresh process tree
    with either venv's interpreter, its result back as JSON.
``Session``, ``table``, ``Col``: the header line and the ``--json`` dump's
    environment record; the one Markdown table printer (text left, numbers right,
    ``—`` for nothing, ``✓`` / ``✗``, counts with thousands separators).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import platform
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from torch.utils.data import IterableDataset, get_worker_info
from torch.utils.data.datapipes.datapipe import IterDataPipe

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PEERS_VENV = HERE / ".venv"
REQUIREMENTS = HERE / "requirements-peers.txt"
NO_PEERS = "no benchmark venv (benchmarks/.venv): run benchmarks/bench_files.py --setup-peers"

warnings.filterwarnings("ignore", message=".*torchdata.*", category=UserWarning)
warnings.filterwarnings("ignore", message="This DataLoader will create")


class IterOnly:
    """An iterable with no ``__len__`` / ``__getitem__``: forces streaming."""

    def __init__(self, iterable: Iterable[Any]) -> None:
        self.iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        return iter(self.iterable)


# -- counting ------------------------------------------------------------------------------
_COUNTS: Counter = Counter()  # this process's
_SHARED: dict[str, Any] = {}  # name -> a shared counter of the rank and what it forks (share_counts)


def count(name: str = "decodes", k: int = 1) -> None:
    """Count ``k`` more ``name`` in this process (and in the shared total, if any)."""
    _COUNTS[name] += k
    shared = _SHARED.get(name)
    if shared is not None:
        with shared.get_lock():
            shared.value += k


def counts() -> dict[str, int]:
    """This process's counts so far."""
    return dict(_COUNTS)


def share_counts(*names: str) -> None:
    """From now on ``count(name)`` also adds into a counter in shared memory, which
    the processes this one forks inherit: call it in a rank before its workers fork."""
    import ctypes
    import multiprocessing

    for name in names:
        _SHARED[name] = multiprocessing.get_context("fork").Value(ctypes.c_longlong, 0)


def _delta(now: dict[str, int], then: dict[str, int]) -> dict[str, int]:
    return {name: value - then.get(name, 0) for name, value in now.items() if value != then.get(name, 0)}


# -- CPU, RSS, bytes read, wall -------------------------------------------------------------
def rchar() -> int:
    """Bytes this process passed to read()/pread() so far."""
    with open("/proc/self/io", "rb") as f:
        for line in f:
            if line.startswith(b"rchar:"):
                return int(line.split()[1])
    return 0


def _cpu(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


class Meter:
    """What a rank spends from its creation on: its own CPU, its joined children's
    CPU (a DataLoader's workers, once joined), wall, process time, counts, reads.
    It collects garbage first, so that no window pays for a full collection of what
    was made before it (imports, data): in a short window one such collection of
    the ~170,000 objects a rank holds (~50 ms) would land in some rows and not others."""

    def __init__(self) -> None:
        gc.collect()
        self.self0 = resource.getrusage(resource.RUSAGE_SELF)
        self.children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.counts0, self.rchar0 = counts(), rchar()
        self.pt0, self.wall0 = time.process_time(), time.perf_counter()

    def rchar(self) -> int:
        return rchar() - self.rchar0

    def read(self) -> dict[str, Any]:
        wall, pt = time.perf_counter() - self.wall0, time.process_time() - self.pt0
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        rank_cpu, workers_cpu = _cpu(own) - _cpu(self.self0), _cpu(children) - _cpu(self.children0)
        return {"wall_s": wall, "rank_process_time_s": pt, "rank_cpu_s": rank_cpu, "workers_cpu_s": workers_cpu,
                "cpu_s": rank_cpu + workers_cpu, "rank_counts": _delta(counts(), self.counts0),
                "rank_maxrss_kib": own.ru_maxrss,
                "shared_counts": {name: value.value for name, value in _SHARED.items()}}


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


# -- exactly-once ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Once:
    """Delivered against expected: how many extra and how many missing, and how
    many of each ``even`` allows."""

    duplicates: int
    missing: int
    allowed_duplicates: int = 0
    allowed_missing: int = 0

    @property
    def ok(self) -> bool:
        return self.duplicates <= self.allowed_duplicates and self.missing <= self.allowed_missing

    def cell(self, error: str | None = None) -> str:
        """``✓`` (with what ``even`` dropped or repeated), or ``✗`` with the counts and the error."""
        if self.ok and not error:
            allowed = [f"drop {self.missing}"] * bool(self.missing) + [f"pad {self.duplicates}"] * bool(self.duplicates)
            return "✓" + (f" ({', '.join(allowed)})" if allowed else "")
        parts = [f"{self.duplicates} dup, {self.missing} missing"] if self.duplicates or self.missing else []
        if error:
            parts.append(("error: " + error_line(error))[:100])
        return "✗ " + "; ".join(parts)


def exactly_once(got: Iterable[Any], expected: Iterable[Any], *, even: str | None = None, slots: int = 1) -> Once:
    """The multiset ``got`` against ``expected`` (each element once), with what
    ``even`` allows over ``slots`` slots: ``"drop"`` up to ``N mod slots`` missing,
    ``"pad"`` up to ``slots - N mod slots`` repeated (none when ``slots`` divides N)."""
    got = got if isinstance(got, Counter) else Counter(got)
    expected = expected if isinstance(expected, Counter) else Counter(expected)
    tail = sum(expected.values()) % slots
    return Once(sum((got - expected).values()), sum((expected - got).values()),
                allowed_duplicates=(slots - tail) % slots if even == "pad" else 0,
                allowed_missing=tail if even == "drop" else 0)


def epochs_check(got: Counter, keys: Sequence[Any], workers: list[dict[str, Any]], *, epochs: int, even: str,
                 unit: int, slots: int) -> dict[str, Any]:
    """Several epochs of ``keys`` (each epoch's stream in this order) with ``even``
    ``"drop"`` (every epoch leaves out its last ``N mod unit``) or ``"carry"``
    (epoch ``e`` takes ``[U floor(eN/U), U floor((e+1)N/U))`` of the concatenated
    streams, ``U = unit``): the per-slot counts of every epoch (from the workers'
    reports) and the delivered multiset ``got`` against what ``even`` promises."""
    n = len(keys)
    if even == "carry":
        wanted = Counter(keys[g % n] for g in range(unit * (epochs * n // unit)))
    else:
        wanted = Counter(k for _ in range(epochs) for k in keys[:n // unit * unit])
    per_epoch: dict[int, list[int]] = {}
    for record in workers:
        per_epoch.setdefault(record["epoch"], []).append(record["yielded"])
    every = Counter({k: epochs for k in keys})
    delivered = sum(got.values())
    tail = epochs * n % unit if even == "carry" else 0  # the last epoch's tail opens the next epoch
    return {"per_epoch_slots": {e: sorted(c) for e, c in sorted(per_epoch.items())},
            "equal_slots": len(per_epoch) == epochs and all(len(c) == slots and len(set(c)) == 1
                                                            for c in per_epoch.values()),
            "delivered": delivered, "exact": got == wanted,
            "left_for_next_epoch": epochs * n - delivered if even == "carry" else 0,
            "dropped": sum((every - got).values()) - tail, "padded": sum((got - every).values())}


def slot_counts(per_epoch_slots: dict[Any, list[int]]) -> str:
    """``250 / 250 / 251``: every epoch's per-slot count (``min–max`` if they differ)."""
    return " / ".join(str(c[0]) if len(set(c)) == 1 else f"{min(c)}–{max(c)}" for c in per_epoch_slots.values())


def error_line(text: str) -> str:
    """The ``SomeError: message`` line of a traceback (torch appends notes after it)."""
    lines = text.strip().splitlines()
    for line in reversed(lines):
        if re.match(r"^[\w.]+(Error|Exception|Interrupt|Exit)\b", line):
            return line
    return lines[-1] if lines else text


def left_out(runs: Sequence[dict[str, Any]], good: Sequence[dict[str, Any]]) -> str | None:
    """What a row's medians leave out: ``"1 of 3 rounds failed: TimeoutError: ..."``
    when some rounds of a row failed and others did not (a row whose rounds all
    failed says so in its table cell), else ``None``. Print it under the table: a
    failed round is never hidden."""
    failed = [r for r in runs if r not in good]
    if not failed or not good:
        return None
    first = (failed[0].get("errors") or ["no complete run"])[0]
    return f"{len(failed)} of {len(runs)} rounds failed and are left out of its medians: {error_line(first)[:200]}"


def print_left_out(rows: Iterable[dict[str, Any]], label: Callable[[dict[str, Any]], str]) -> None:
    """One line per row whose medians left failed rounds out (see :func:`left_out`)."""
    for row in rows:
        if row.get("left_out"):
            print(f"\n{label(row)}: {row['left_out']}")


# -- the calibrated decode ----------------------------------------------------------------------
def burn(iters: int, seed: int | bytes) -> bytes:
    """Deterministic CPU work: ``iters`` chained BLAKE2b digests."""
    digest = seed if isinstance(seed, bytes) else seed.to_bytes(8, "little", signed=True)
    for _ in range(iters):
        digest = hashlib.blake2b(digest, digest_size=16).digest()
    return digest


class Decode:
    """A decode that burns ``iters`` digests of CPU and counts its calls (``decodes``);
    a script's subclass turns its element into a seed and returns what it decodes to."""

    def __init__(self, iters: int) -> None:
        self.iters = iters

    def work(self, seed: int | bytes) -> None:
        count("decodes")
        if self.iters:
            burn(self.iters, seed)


def calibrate(target_s: float, make: Callable[[int], Callable[[int], Any]] | None = None) -> tuple[int, float]:
    """``(iters, seconds)``: how many chained digests burn ``target_s`` of CPU, and
    what one call of ``make(iters)`` (the script's decode; default ``burn``) then
    costs: the median of 5 rounds of ~0.15 s."""
    probe, calls, start = 256, 0, time.process_time()
    while time.process_time() - start < 0.15:
        burn(probe, calls)
        calls += 1
    iters = max(1, round(target_s / ((time.process_time() - start) / (calls * probe))))
    decode = make(iters) if make is not None else (lambda i: burn(iters, i))
    per_round = max(20, round(0.15 / target_s))
    samples = []
    for round_index in range(5):
        start = time.process_time()
        for i in range(per_round):
            decode(round_index * per_round + i)
        samples.append((time.process_time() - start) / per_round)
    return iters, statistics.median(samples)


# -- timing in one process ---------------------------------------------------------------------
@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The garbage collector off inside the block (back on after, if it was)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def rounds(items: Sequence[Any], n: int, reverse_odd: bool = False) -> Iterator[tuple[int, list[Any]]]:
    """``(round, order)``: every item once a round, the order rotated by one each round
    (and reversed every other round with ``reverse_odd``), so that machine noise
    spreads over all of them."""
    items = list(items)
    for r in range(n):
        shift = r % len(items)
        order = items[shift:] + items[:shift]
        yield r, order[::-1] if reverse_odd and r % 2 else order


def choose(only: str | None, known: dict[str, Any], parser: Any) -> list[Any]:
    """The items ``--only a,b`` names (all without it); an unknown name is a usage error."""
    if not only:
        return list(known.values())
    names = [name for name in only.split(",") if name]
    unknown = [name for name in names if name not in known]
    if unknown:
        parser.error(f"--only: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    return [known[name] for name in names]


def read_plan(pipe: Any) -> Any:
    """The read plan of the first ``dist_shard`` in ``pipe`` (``None`` without one):
    ``.sequence`` is set when it indexes its positions, ``.maps`` when maps moved below it."""
    from distshard.datapipe import shards_in

    shards = shards_in(pipe)
    return shards[0].read_plan() if shards else None


# -- the peers' venv and child processes ---------------------------------------------------------
def peers_python() -> Path | None:
    python = PEERS_VENV / "bin" / "python"
    return python if python.exists() else None


def setup_peers() -> int:
    """Create ``benchmarks/.venv`` and install the peers (torch pinned in the same command)."""
    if not peers_python():
        subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
        base = Path(sys.base_prefix) / "bin" / "python3"
        if not peers_python() and base.exists():
            subprocess.run([str(base), "-m", "venv", str(PEERS_VENV)], check=True)
    return subprocess.run([str(peers_python()), "-m", "pip", "install", "-r", str(REQUIREMENTS)]).returncode


def child_env(cache: str, paths: Sequence[str] = ()) -> dict[str, str]:
    """A child's environment: no torchrun variables, distshard and the benchmarks
    importable, an empty ``$DISTSHARD_CACHE`` / ``$HF_HOME`` under ``cache``, offline."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "pipes"), str(HERE), *paths])
    env.update(DISTSHARD_CACHE=cache, HF_HOME=os.path.join(cache, "hf"), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore")
    return env


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it (a gloo group's ranks sit in
    process groups of their own, so killing the child's group would miss them)."""
    import signal

    from distshard.stacks import descendants

    for each in reversed(descendants(pid)):
        with contextlib.suppress(OSError):
            os.kill(each, signal.SIGKILL)


def launch(script: str | Path, func: str, kwargs: dict[str, Any], *, peers: bool = False, timeout: float,
           grace: float = 120.0, cache: str | None = None, paths: Sequence[str] = (),
           expected: float | None = None) -> dict[str, Any]:
    """``func(**kwargs)`` of ``script`` in a fresh process tree (the peers' venv with
    ``peers``, else this interpreter), through its ``--run`` (see ``child``); what it
    returned, ``{"skipped": ...}`` without the peers' venv, or ``{"errors": [...]}``.
    ``cache``: its ``$DISTSHARD_CACHE`` (default: an empty one).

    A watchdog (``distshard.stacks.Watchdog``) dumps the stack of every process of
    the tree (the child, its ranks, their DataLoader workers) with py-spy when the
    child runs past ``expected`` seconds (default: no early dump), and again before
    the tree is killed at ``timeout + grace``; the result's ``"stacks"`` lists the
    files and its errors name them."""
    from distshard.stacks import Watchdog

    python = peers_python() if peers else Path(sys.executable)
    if python is None:
        return {"skipped": NO_PEERS}
    limit = timeout + grace
    with tempfile.TemporaryDirectory(prefix="bench-child-") as tmp:
        spec, out, err = Path(tmp) / "spec.json", Path(tmp) / "result.json", Path(tmp) / "stderr"
        spec.write_text(json.dumps({"func": func, "kwargs": kwargs}))
        command = [str(python), str(Path(script).resolve()), "--run", str(spec), "--out", str(out)]
        with err.open("w") as stderr:
            proc = subprocess.Popen(command, env=child_env(cache or tmp, paths), stdout=subprocess.DEVNULL,
                                    stderr=stderr, text=True)
        watchdog = Watchdog(lambda: [proc.pid], expected if expected is not None and expected < limit else None,
                            label=f"{Path(script).stem}-{func}")
        try:
            with watchdog:
                proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            path = watchdog.fire(f"timed out after {limit:.0f}s")
            kill_tree(proc.pid)  # before the child is reaped: its pid still names the tree
            proc.wait(timeout=30)
            return {"errors": [f"timed out after {limit:.0f}s; the stacks of its processes: {path}"],
                    "stacks": [str(p) for p in watchdog.dumps]}
        except BaseException:  # Ctrl-C: leave no tree behind
            kill_tree(proc.pid)
            proc.wait(timeout=30)
            raise
        late = {"stacks": [str(p) for p in watchdog.dumps]} if watchdog.dumps else {}
        if not out.exists():
            return {"errors": [f"exit {proc.returncode}: {err.read_text()[-2000:]}"], **late}
        return {**json.loads(out.read_text()), **late}


def add_child_args(parser: Any) -> None:
    """The internal ``--run SPEC --out PATH`` of a script that ``launch`` runs."""
    import argparse

    parser.add_argument("--run", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)


def child(spec: Path, out: Path, namespace: dict[str, Any]) -> int:
    """The child's side of ``launch``: call the function ``spec`` names in
    ``namespace`` (the script's globals), write its result (or the traceback) as JSON."""
    request = json.loads(spec.read_text())
    try:
        result = namespace[request["func"]](**request["kwargs"])
    except BaseException:  # noqa: BLE001 - reported
        result = {"errors": [traceback.format_exc()]}
    out.write_text(json.dumps(result, default=repr))
    return 0


# -- the environment record ---------------------------------------------------------------------
def command_line() -> str:
    """The command that ran this script, as a user would type it."""
    exe = Path(sys.executable)
    try:
        shown = os.path.relpath(exe) if exe.is_relative_to(Path.cwd()) else str(exe)
    except ValueError:
        shown = str(exe)
    flags = ["-O"] if sys.flags.optimize else []
    return shlex.join([shown, *flags, *sys.argv])


def loadavg() -> float | None:
    """The 1-minute load average (other processes compete for the cores), if known."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def versions(*names: str) -> dict[str, str]:
    """The installed versions of ``names`` (those installed)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in names:
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found


def _load(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


class Session:
    """One run of a script: when it started, the load average then, the header line
    and the ``--json`` dump's environment record."""

    def __init__(self) -> None:
        self.started, self.load_before = time.perf_counter(), loadavg()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def environment(self) -> dict[str, Any]:
        return {"command": command_line(), "python": platform.python_version(),
                **versions("torch", "torchdata", "distshard"), "platform": platform.platform(),
                "cpu_count": os.cpu_count(), "loadavg_1min_before": self.load_before,
                "loadavg_1min_after": loadavg(), "elapsed_s": self.elapsed}

    def header(self, *facts: str) -> str:
        """``command — versions, cores, load average before / after; facts``."""
        env = self.environment()
        return (f"`{env['command']}` — Python {env['python']}, torch {env['torch']}, torchdata {env['torchdata']}, "
                f"distshard {env['distshard']}, os.cpu_count()={env['cpu_count']}, 1-min load average "
                f"{_load(self.load_before)} before / {_load(env['loadavg_1min_after'])} after"
                + "".join(f"; {fact}" for fact in facts if fact))

    def dump(self, path: Path | None, **payload: Any) -> None:
        """``--json PATH``: the environment record and ``payload``."""
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"environment": self.environment(), **payload}, indent=2, default=repr) + "\n")


# -- the one table printer -------------------------------------------------------------------------
@dataclass(frozen=True)
class Col:
    """A column: its title and how its numbers read. ``digits`` (floats: that many
    decimals; ints always with thousands separators), ``suffix`` (``×``, `` ms``),
    ``signed`` (a ``+`` on positive numbers), or ``fmt`` (a function of the value).
    Numeric columns (``digits`` or ``fmt``) are right-aligned unless ``right`` says."""

    title: str
    digits: int | None = None
    suffix: str = ""
    signed: bool = False
    fmt: Callable[[Any], str] | None = None
    right: bool | None = None

    @property
    def numeric(self) -> bool:
        return self.right if self.right is not None else (self.digits is not None or self.fmt is not None)

    def cell(self, value: Any) -> str:
        if value is None:
            return "—"
        if isinstance(value, str):
            return value
        if isinstance(value, bool):
            return "✓" if value else "✗"
        if self.fmt is not None:
            return self.fmt(value)
        sign = "+" if self.signed else ""
        if isinstance(value, int):
            return f"{value:{sign},}{self.suffix}"
        return f"{value:{sign}.{2 if self.digits is None else self.digits}f}{self.suffix}"


def table(columns: Sequence[Col | str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table. A row's cells: ``None`` → ``—``, ``True`` / ``False`` → ``✓`` /
    ``✗``, numbers by their column, strings as they are; a row shorter than the
    columns (a failed or skipped row: its label and what happened) is padded with
    empty cells."""
    cols = [c if isinstance(c, Col) else Col(c) for c in columns]
    lines = ["| " + " | ".join(c.title for c in cols) + " |",
             "|" + "|".join("---:" if c.numeric else "---" for c in cols) + "|"]
    for row in rows:
        cells = [col.cell(value) for col, value in zip(cols, row, strict=False)]
        lines.append("| " + " | ".join(cells + [""] * (len(cols) - len(cells))) + " |")
    return "\n".join(lines)


def ratio(value: float | None) -> str:
    """A ratio whose size varies over orders of magnitude: ``0.98×``, ``64.9×``, ``9,029×``."""
    if value is None:
        return "—"
    if value >= 100:
        return f"{value:,.0f}×"
    return f"{value:.1f}×" if value >= 10 else f"{value:.2f}×"


def seconds(value: float) -> str:
    """A duration in the unit that reads best: ``113 µs``, ``9.41 ms``, ``2.89 s``."""
    if value >= 1:
        return f"{value:.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.3g} ms"
    return f"{value * 1e6:.3g} µs"


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")
