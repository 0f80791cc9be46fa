"""``distshard.verify``: run a pipeline on a real gloo group and check exactly-once.

Each rank is its own process (started with ``rank_start_method``); it joins a gloo
group on 127.0.0.1 at a free port, builds the pipeline with the user's
``build()``, iterates it through torch's DataLoader (or torchdata's
StatefulDataLoader) with ``num_workers`` workers, performs one ``all_reduce`` per
element as a DDP training step would, and sends back what each slot yielded.
The parent compares the multiset against the unsharded stream (``build()``
iterated in the parent as a single slot). Every wait is bounded by ``timeout``;
processes still alive after it are killed, so a hang becomes a report with an
``error``, never a stuck caller.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import socket
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Hashable, Literal

from torch.utils.data import get_worker_info
from torch.utils.data.datapipes.datapipe import IterDataPipe

from . import context as _context
from .datapipe import shards_in
from .plan import dropped_count, padded_count

__all__ = ["RankOutcome", "VerifyReport", "canonical", "free_port", "run_on_group", "verify"]

_AUTO = "auto"


def canonical(value: Any) -> Hashable:
    """A hashable, value-based key for an element (tensors, dicts, lists included),
    so that multisets of arbitrary records can be compared across processes."""
    import torch

    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), tuple(value.flatten().tolist()))
    if isinstance(value, dict):
        items = sorted(((canonical(k), canonical(v)) for k, v in value.items()), key=repr)
        return ("dict", tuple(items))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(canonical(v) for v in value))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted((canonical(v) for v in value), key=repr)))
    try:
        hash(value)
    except TypeError:
        return ("repr", repr(value))
    return (type(value).__name__, value)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _set_epoch(pipe: IterDataPipe, epoch: int) -> None:
    """``set_epoch`` on the pipeline's dist_shard pipes; a baseline being checked may have none."""
    for shard in shards_in(pipe):
        shard.set_epoch(epoch)


class _TagWithWorker:
    """Appended to the pipeline: ``element -> (worker_id, repr(canonical(element)))``.

    The worker id comes from torch, not from distshard, so the harness does not
    trust the code it checks.
    """

    def __call__(self, element: Any) -> tuple[int, Hashable]:
        info = get_worker_info()
        # a string survives the DataLoader's default_convert (which turns tuples into lists)
        return (0 if info is None else info.id), repr(canonical(element))


@dataclass
class RankOutcome:
    """What one rank of :func:`run_on_group` returned, or why it did not."""

    rank: int
    value: Any = None
    error: str | None = None  # a traceback, or why no result came


def _group_main(rank: int, world_size: int, port: int, timeout: float,
                fn: Callable[..., Any], args: tuple, results: Any) -> None:
    import torch.distributed as dist

    warnings.filterwarnings("ignore", message="This DataLoader will create")
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
            world_size=world_size, timeout=timedelta(seconds=timeout),
        )
        results.put((rank, fn(rank, world_size, *args), None))
    except BaseException:  # noqa: BLE001 - reported to the parent, which decides
        results.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_group(
    fn: Callable[..., Any],
    *,
    world_size: int,
    args: tuple = (),
    timeout: float = 60.0,
    start_method: str = "spawn",
    progress: Callable[[str], None] | None = None,
) -> list[RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` on every rank of a fresh gloo group.

    Each rank is a new process (``start_method``) that joins a gloo group on
    127.0.0.1 at a free port with ``init_process_group(rank=..., world_size=...)``
    and no ``RANK`` / ``WORLD_SIZE`` in its environment, as ``mp.spawn`` code does.
    ``fn`` and ``args`` must be picklable; ``fn``'s return value comes back.
    Never waits longer than about ``timeout`` (plus start-up slack): ranks still
    running then are killed and reported with an ``error``. ``progress``, if
    given, is called about every 2 seconds with a short status line.
    """
    _context.check_rank_world(0, world_size)
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_group_main, args=(rank, world_size, port, timeout, fn, args, results))
        for rank in range(world_size)
    ]
    env_backup = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
    try:
        for proc in procs:
            proc.start()
    finally:
        os.environ.update(env_backup)
    outcomes: dict[int, RankOutcome] = {}
    started = time.monotonic()
    deadline = started + timeout + 30.0  # interpreter start-up gets slack
    reported = started
    while len(outcomes) < world_size:
        now = time.monotonic()
        remaining = deadline - now
        if remaining <= 0:
            break
        if progress is not None and now - reported >= 2.0:
            reported = now
            progress(f"{len(outcomes)}/{world_size} ranks done, {now - started:.0f}s elapsed")
        try:
            rank, value, error = results.get(timeout=min(remaining, 1.0))
        except queue_module.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
            continue
        outcomes[rank] = RankOutcome(rank, value, error)
    for proc in procs:
        proc.join(timeout=max(0.1, min(10.0, deadline - time.monotonic())))
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10.0)
    timed_out = time.monotonic() >= deadline
    for rank in range(world_size):
        if rank not in outcomes:
            code = procs[rank].exitcode
            why = (f"was still running after {timeout:.0f}s (a hang) and was killed" if timed_out and code in (None, -9)
                   else f"died with exit code {code} before sending a result (a crash or a kill)")
            outcomes[rank] = RankOutcome(rank, error=f"rank {rank} sent no result: it {why}")
    return [outcomes[rank] for rank in range(world_size)]


def _verify_rank(rank: int, world_size: int, build: Callable[[], IterDataPipe],
                 num_workers: int, start_method: str, timeout: float, epochs: int,
                 loader: str, step_collective: bool) -> tuple[str | None, list]:
    """One rank of :func:`verify`: returns ``(error, [(epoch, slot, key), ...])``,
    keeping what was seen before an error."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    seen: list[tuple[int, int, str]] = []
    try:
        pipe = build()
        tagged = pipe.map(_TagWithWorker())
        if loader == "none":
            batches: Callable[[], Any] = lambda: iter(tagged)  # noqa: E731
        else:
            if loader == "stateful":
                from torchdata.stateful_dataloader import StatefulDataLoader as loader_cls
            else:
                loader_cls = DataLoader
            kwargs: dict[str, Any] = {"batch_size": None, "num_workers": num_workers}
            if num_workers:
                kwargs.update(multiprocessing_context=start_method, timeout=timeout)
            data_loader = loader_cls(tagged, **kwargs)
            batches = lambda: iter(data_loader)  # noqa: E731
        grad = torch.zeros(4)
        slots_per_rank = max(1, num_workers)
        for epoch in range(epochs):
            _set_epoch(pipe, epoch)
            for worker_id, key in batches():
                seen.append((epoch, rank * slots_per_rank + worker_id, key))
                if step_collective:
                    dist.all_reduce(grad)  # what a DDP backward does every step
            # DDP code then checkpoints / evaluates in lock step: a rank with more
            # batches meets a different collective here and fails or times out.
            dist.barrier()
    except BaseException:  # noqa: BLE001 - reported with what was seen
        return traceback.format_exc(), seen
    return None, seen


@dataclass
class VerifyReport:
    """What ``verify`` saw. ``ok`` is the verdict; ``summary()`` reads well."""

    world_size: int
    num_workers: int
    even: str | None
    epochs: int
    expected: int = 0  # elements of one epoch of the unsharded stream
    received: int = 0  # elements all slots yielded, all epochs
    per_rank: list[int] = field(default_factory=list)
    per_slot: list[int] = field(default_factory=list)
    duplicates: dict[str, int] = field(default_factory=dict)  # element's repr -> extra copies
    missing: dict[str, int] = field(default_factory=dict)  # element's repr -> copies missing
    duplicate_count: int = 0
    missing_count: int = 0
    allowed_duplicates: int = 0  # even="pad" repeats these many per epoch
    allowed_missing: int = 0  # even="drop" drops these many per epoch
    seconds: float = 0.0
    error: str | None = None
    seen: list[tuple[int, int, str]] = field(default_factory=list, repr=False)

    @property
    def num_slots(self) -> int:
        return self.world_size * max(1, self.num_workers)

    @property
    def ranks_equal(self) -> bool:
        return len(set(self.per_rank)) <= 1

    @property
    def slots_equal(self) -> bool:
        return len(set(self.per_slot)) <= 1

    @property
    def violated(self) -> bool:
        """The data shows an exactly-once violation (duplicates or missing beyond
        what ``even`` allows, or unequal slots under ``even``), error or not."""
        if self.duplicate_count != self.allowed_duplicates * self.epochs:
            return True
        if self.error is None and self.missing_count != self.allowed_missing * self.epochs:
            return True
        return self.even is not None and not self.slots_equal and self.error is None

    @property
    def ok(self) -> bool:
        """Exactly-once held: nothing duplicated or missing beyond what ``even``
        documents, and with ``even`` set, every slot yielded the same count."""
        if self.error is not None:
            return False
        if self.duplicate_count != self.allowed_duplicates * self.epochs:
            return False
        if self.missing_count != self.allowed_missing * self.epochs:
            return False
        return self.even is None or self.slots_equal

    def summary(self) -> str:
        lines = [
            f"world_size={self.world_size} num_workers={self.num_workers} even={self.even!r} "
            f"epochs={self.epochs}: {self.received} received, {self.expected} per epoch expected "
            f"({self.seconds:.1f}s)",
            f"  per rank: {self.per_rank}",
            f"  per slot: {self.per_slot}",
            f"  duplicates: {self.duplicate_count} (allowed by even: {self.allowed_duplicates * self.epochs})"
            + (f" e.g. {_examples(self.duplicates)}" if self.duplicates else ""),
            f"  missing: {self.missing_count} (allowed by even: {self.allowed_missing * self.epochs})"
            + (f" e.g. {_examples(self.missing)}" if self.missing else ""),
        ]
        if self.error:
            lines.append("  error: " + self.error.strip().splitlines()[-1])
        lines.append("  verdict: " + ("EXACTLY-ONCE" if self.ok else "VIOLATED"))
        return "\n".join(lines)


def _examples(counts: dict[str, int], limit: int = 3) -> str:
    return ", ".join(f"{k} x{v}" for k, v in list(counts.items())[:limit])


def _reference(
    build: Callable[[], IterDataPipe], epochs: int
) -> tuple[list[Counter], str | None, dict[str, str]]:
    """The unsharded stream of every epoch, the ``even`` of its dist_shard, and a
    readable name (``repr``, shortened) for every key."""
    with _context.forced_distributed(0, 1):
        pipe = build()
        shards = shards_in(pipe)
        even = shards[0].even if shards else None
        counters = []
        names: dict[str, str] = {}
        for epoch in range(epochs):
            _set_epoch(pipe, epoch)
            counter: Counter = Counter()
            for element in pipe:
                key = repr(canonical(element))
                counter[key] += 1
                if key not in names:
                    text = repr(element)
                    names[key] = text if len(text) <= 60 else text[:57] + "..."
            counters.append(counter)
    return counters, even, names


def verify(
    build: Callable[[], IterDataPipe],
    *,
    world_size: int,
    num_workers: int = 0,
    even: Literal["drop", "pad"] | None | str = _AUTO,
    start_method: str = "fork",
    rank_start_method: str = "spawn",
    timeout: float = 60.0,
    epochs: int = 1,
    loader: Literal["torch", "stateful", "none"] = "torch",
    step_collective: bool | None = None,
    progress: Callable[[str], None] | None = None,
) -> VerifyReport:
    """Run ``build()`` on every rank of a real gloo group and check exactly-once.

    Args:
        build: a picklable zero-argument callable (a module-level function) that
            returns the pipeline, ``dist_shard`` included, as each rank builds it.
        world_size: ranks to start, each a process joined to a gloo group on 127.0.0.1.
        num_workers: DataLoader workers per rank (0: the rank iterates itself).
        even: which ``even`` guarantee to check; by default the one of the
            pipeline's ``dist_shard``.
        start_method: how DataLoader workers start: ``fork``, ``spawn`` or ``forkserver``.
        rank_start_method: how the rank processes start.
        timeout: seconds any wait may take (the gloo timeout too); past it the
            report has an ``error`` and leftover processes are killed.
        epochs: epochs to run; ``set_epoch(e)`` is called on the pipeline's
            ``dist_shard`` before each.
        loader: ``"torch"`` for ``torch.utils.data.DataLoader``, ``"stateful"``
            for torchdata's ``StatefulDataLoader``, ``"none"`` to iterate the pipe
            directly in the rank's process (``num_workers`` is then ignored).
        step_collective: do one ``all_reduce`` per element, as DDP does per step,
            so unequal counts fail (or time out) as a training job would. By
            default on when an ``even`` guarantee is checked.
        progress: called about every 2 seconds with a status line while waiting.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is the verdict.

    Example:
        >>> report = distshard.verify(build, world_size=2, num_workers=2)  # doctest: +SKIP
        >>> print(report.summary())  # doctest: +SKIP
    """
    started = time.monotonic()
    _context.check_rank_world(0, world_size)
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers={num_workers!r} must be a non-negative int")
    if loader not in ("torch", "stateful", "none"):
        raise ValueError(f"loader={loader!r} must be 'torch', 'stateful' or 'none'")
    references, detected_even, names = _reference(build, epochs)
    if even == _AUTO:
        even = detected_even
    if step_collective is None:
        step_collective = even is not None
    report = VerifyReport(world_size, num_workers, even, epochs)  # type: ignore[arg-type]
    per_epoch = sum(references[0].values())
    report.expected = per_epoch
    report.allowed_missing = dropped_count(report.num_slots, per_epoch, even)  # type: ignore[arg-type]
    report.allowed_duplicates = padded_count(report.num_slots, per_epoch, even)  # type: ignore[arg-type]

    ranks = run_on_group(
        _verify_rank, world_size=world_size, timeout=timeout, start_method=rank_start_method,
        progress=progress,
        args=(build, num_workers, start_method, timeout, epochs, loader, step_collective),
    )
    outcomes: dict[int, tuple[str | None, list]] = {}
    errors = []
    for outcome in ranks:
        error, seen = outcome.value if outcome.value is not None else (None, [])
        error = outcome.error or error
        if error:
            errors.append(f"rank {outcome.rank}: {error}")
        outcomes[outcome.rank] = (error, seen)
    report.error = "\n".join(errors) or None

    report.per_rank = [0] * world_size
    report.per_slot = [0] * report.num_slots
    received: list[Counter] = [Counter() for _ in range(epochs)]
    for rank, (_, seen) in outcomes.items():
        report.per_rank[rank] = len(seen)
        for epoch, slot, key in seen:
            if 0 <= slot < report.num_slots:
                report.per_slot[slot] += 1
            received[epoch][key] += 1
        report.seen.extend(seen)
    report.received = sum(report.per_rank)
    for got, want in zip(received, references):
        for key, n in (got - want).items():
            name = names.get(key, key)
            report.duplicates[name] = report.duplicates.get(name, 0) + n
            report.duplicate_count += n
        for key, n in (want - got).items():
            name = names.get(key, key)
            report.missing[name] = report.missing.get(name, 0) + n
            report.missing_count += n
    report.seconds = time.monotonic() - started
    return report
