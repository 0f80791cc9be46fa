"""``distshard.verify``: run a pipeline on a real gloo group and check exactly-once.

Each rank is its own process (started with ``rank_start_method``); it joins a gloo
group through a file store in a temporary directory, with gloo bound to the
loopback interface (nothing listens beyond 127.0.0.1), builds the pipeline with
the user's ``build()``, iterates it through torch's DataLoader (or torchdata's
StatefulDataLoader) with ``num_workers`` workers, performs one ``all_reduce`` per
element as a DDP training step would, and sends back the key of what each slot
yielded. One more process iterates ``build()`` unsharded (a single slot) for the
reference. The parent only waits: ``timeout`` bounds the whole run, the user's
code included, and processes still alive after it (and their DataLoader workers)
are killed, so a hang or an exit becomes a report with an ``error``, never a
stuck caller nor a false verdict.

Elements are compared by :func:`distshard.keys.key`, a SHA-256 digest of a canonical encoding of
their value (:func:`canonical`), never by ``repr``.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections import Counter
from datetime import timedelta
from typing import Any, Callable, Literal

import torch
from torch.utils.data import get_worker_info
from torch.utils.data.datapipes.datapipe import IterDataPipe

from . import context as _context
from .datapipe import shards_in
from .errors import OptionError, OptionTypeError
from .gloo_runs import (
    FACTORY_FAILED,
    RankOutcome,
    child_setup,
    failure_text,
    free_port,
    run_on_group,
    run_processes,
    send_result,
)
from .guard import check_timeout
from .keys import canonical, display, key
from .plan import Even, check_even
from .verify_report import VerifyReport, fill_report

__all__ = [
    "FactoryPath",
    "RankOutcome",
    "VerifyReport",
    "canonical",
    "free_port",
    "key",
    "run_on_group",
    "verify",
]

_AUTO = "auto"


def _build(build: Callable[[], Any]) -> IterDataPipe:
    """Call the factory; an error here (it cannot be imported or called, or returns
    no pipeline) is the same in every process, so the parent stops the run at the first."""
    try:
        pipe = build()
        if not isinstance(pipe, IterDataPipe):
            raise OptionTypeError(
                f"{getattr(build, 'path', build)!r} returned {type(pipe).__name__}, not an IterDataPipe: the "
                "factory must return the pipeline each rank iterates, e.g. "
                "IterableWrapper(records).dist_shard(even='drop').map(decode) (not a list, a DataLoader "
                "or a StatefulPipeline)"
            )
    except BaseException as exc:
        setattr(exc, FACTORY_FAILED, True)
        raise
    return pipe


def _reference_main(
    build: Callable[[], IterDataPipe], epochs: int, num_slots: int, results: Any, env: dict[str, str]
) -> None:
    child_setup(env)
    send_result(results, "reference", lambda: _reference(build, epochs, num_slots))


# -- verify ---------------------------------------------------------------------------


def _set_epoch(pipe: IterDataPipe, epoch: int) -> None:
    """``set_epoch`` on the pipeline's dist_shard pipes; a baseline being checked may have none."""
    for shard in shards_in(pipe):
        shard.set_epoch(epoch)


class _TagWithWorker:
    """Appended to the pipeline: ``element -> (worker_id, key(element))``.

    The worker id comes from torch, not from distshard, so the harness does not
    trust the code it checks.
    """

    def __call__(self, element: Any) -> tuple[int, str]:
        info = get_worker_info()
        # a string survives the DataLoader's default_convert (which turns tuples into lists)
        return (0 if info is None else info.id), key(element)


class FactoryPath:
    """``pkg.module:function`` as a picklable pipeline factory: the module is imported
    and the function called only where the factory is called (in the processes of
    :func:`verify`), so a module that hangs or exits on import is bounded too.

    Example:
        >>> build = FactoryPath("tests.builds:dicts_drop")  # doctest: +SKIP
        >>> distshard.verify(build, world_size=2)  # doctest: +SKIP
    """

    def __init__(self, path: str) -> None:
        module, sep, attribute = path.partition(":")
        if not sep or not module or not attribute:
            raise OptionError(f"{path!r} is not of the form pkg.module:function (note the colon)")
        self.path, self.cwd = path, os.getcwd()

    def __repr__(self) -> str:
        return f"FactoryPath({self.path!r})"

    def check_module(self) -> None:
        """Raise ``ImportError`` if the module does not exist, looking for it without
        running any of its code (or its packages'), so a typo is reported at once."""
        import importlib.machinery
        import importlib.util

        module_name = self.path.partition(":")[0]
        parts = module_name.split(".")
        if parts[0] in sys.modules:
            return
        found = importlib.machinery.PathFinder.find_spec(parts[0], [self.cwd, *sys.path])
        if found is None:
            if importlib.util.find_spec(parts[0]) is not None:  # found by another finder: it knows
                return
            raise ImportError(f"could not import {module_name!r}: No module named {parts[0]!r}")
        for depth in range(1, len(parts)):
            if found.submodule_search_locations is None:  # a plain module: the import says why
                return
            found = importlib.machinery.PathFinder.find_spec(parts[depth], list(found.submodule_search_locations))
            if found is None:
                raise ImportError(f"could not import {module_name!r}: No module named {'.'.join(parts[: depth + 1])!r}")

    def load(self) -> Callable[[], IterDataPipe]:
        """Import the module and return the callable, with a clear error for every way it fails."""
        module_name, _, attribute = self.path.partition(":")
        if self.cwd not in sys.path:
            sys.path.insert(0, self.cwd)
        try:
            factory: Any = importlib.import_module(module_name)
        except ImportError as exc:
            raise ImportError(f"could not import {module_name!r}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - the user's module raised while importing
            raise RuntimeError(f"importing {module_name!r} raised {type(exc).__name__}: {exc}") from None
        for name in attribute.split("."):
            try:
                factory = getattr(factory, name)
            except AttributeError:
                raise AttributeError(f"{module_name!r} has no attribute {attribute!r}") from None
        if not callable(factory):
            raise OptionTypeError(f"{self.path} is a {type(factory).__name__}, not a callable that builds the pipeline")
        return factory

    def __call__(self) -> IterDataPipe:
        return self.load()()


_UNCLOSED: list = []  # a rank's iterators that failed, closed when the process exits


def _verify_rank(
    rank: int,
    world_size: int,
    build: Callable[[], IterDataPipe],
    num_workers: int,
    start_method: str,
    deadline: float,
    epochs: int,
    loader: str,
    step_collective: bool | None,
) -> tuple[str | None, list]:
    """One rank of :func:`verify`: returns ``(error, [(epoch, slot, key), ...])``,
    keeping what was seen before an error. Every wait ends by ``deadline``."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    def wait(work: Any) -> None:
        work.wait(timeout=timedelta(seconds=max(0.01, deadline - time.monotonic())))

    seen: list[tuple[int, int, str]] = []
    iterator = None
    pipe = _build(build)  # the factory's own failure: raised, and the parent stops the run
    try:
        if step_collective is None:  # by default, step when an even guarantee is checked
            shards = shards_in(pipe)
            step_collective = bool(shards) and shards[0].even is not None
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
                kwargs.update(multiprocessing_context=start_method, timeout=max(1.0, deadline - time.monotonic()))
            data_loader = loader_cls(tagged, **kwargs)
            batches = lambda: iter(data_loader)  # noqa: E731
        grad = torch.zeros(4)
        slots_per_rank = max(1, num_workers)
        for epoch in range(epochs):
            _set_epoch(pipe, epoch)
            iterator = batches()
            for worker_id, element_key in iterator:
                seen.append((epoch, rank * slots_per_rank + worker_id, element_key))
                if step_collective:
                    wait(dist.all_reduce(grad, async_op=True))  # what a DDP backward does every step
            # DDP code then checkpoints / evaluates in lock step: a rank with more
            # batches meets a different collective here and fails or times out.
            wait(dist.barrier(async_op=True))
    except BaseException:  # noqa: BLE001 - reported with what was seen
        # closing a loader whose workers hang takes seconds: report first, close at exit
        _UNCLOSED.append(iterator)
        return failure_text(), seen
    return None, seen


def _estimated_reads(shards: list, num_slots: int) -> str:
    if not shards:
        return f"no dist_shard in the pipeline: every slot may read everything ({num_slots}x)"
    shard = shards[0]
    if shard.mode == "sized_units" or shard.read_plan().sequence is not None:
        return "1 read per element (random access)"
    if shard.mode == "units":
        return "whole units per slot; leftover units read by a few slots"
    return f"{num_slots} reads per element of the stream (every slot walks it)"


def _reference(
    build: Callable[[], IterDataPipe], epochs: int, num_slots: int
) -> tuple[list[Counter], tuple[str | None, int], dict[str, str], str]:
    """The unsharded stream of every epoch (keys counted), the ``even`` and
    ``multiple_of`` of its dist_shard, a readable name for every key, and how the
    pipeline reads."""
    with _context.forced_distributed(0, 1):
        pipe = _build(build)
        shards = shards_in(pipe)
        even = shards[0].even if shards else None
        multiple = shards[0].multiple_of if shards else 1
        for shard in shards:  # one slot of whole batches would leave out N % multiple_of: the whole stream
            shard.core.replace_options(multiple_of=1)
        reads = _estimated_reads(shards, num_slots)
        counters = []
        names: dict[str, str] = {}
        for epoch in range(epochs):
            _set_epoch(pipe, epoch)
            counter: Counter = Counter()
            for element in pipe:
                element_key = key(element)
                counter[element_key] += 1
                if element_key not in names:
                    names[element_key] = display(element)
            counters.append(counter)
    return counters, (even, multiple), names, reads


def verify(
    build: Callable[[], IterDataPipe],
    *,
    world_size: int,
    num_workers: int = 0,
    even: Even | str = _AUTO,
    start_method: str = "fork",
    rank_start_method: str = "spawn",
    timeout: float = 60.0,
    epochs: int = 1,
    loader: Literal["torch", "stateful", "none"] = "torch",
    step_collective: bool | None = None,
    progress: Callable[[str], None] | None = None,
) -> VerifyReport:
    """Run ``build()`` on every rank of a real gloo group and check exactly-once.

    Elements are compared by :func:`key` (a digest of their value), against the unsharded
    stream that one more process reads with ``build()`` as a single slot.

    Args:
        build: a picklable zero-argument callable (a module-level function, a :class:`FactoryPath`) that
            returns the pipeline, ``dist_shard`` included, as each rank builds it (called in children only).
        world_size: ranks to start, each a process joined to a gloo group on 127.0.0.1.
        num_workers: DataLoader workers per rank (0: the rank iterates itself).
        even: which ``even`` guarantee to check; by default the one of the pipeline's ``dist_shard``.
        start_method: how DataLoader workers start: ``fork``, ``spawn`` or ``forkserver``.
        rank_start_method: how the ranks and the reference run start: ``spawn`` (a fresh interpreter each) or
            ``forkserver`` (after ``set_forkserver_preload(["torch", "distshard"])``: forks of one import).
        timeout: seconds (finite, positive) for the whole run, ``build`` and the reference run included: the
            collectives and the DataLoader time out by then, processes alive 2 s later are killed (an ``error``).
        epochs: epochs to run; ``set_epoch(e)`` is called on the pipeline's ``dist_shard`` before each.
        loader: ``"torch"`` (``torch.utils.data.DataLoader``), ``"stateful"`` (torchdata's ``StatefulDataLoader``)
            or ``"none"``: the pipe iterated in the rank's process (``num_workers`` is then ignored).
        step_collective: one ``all_reduce`` per element, as DDP does per step, so unequal counts fail
            (or time out) as a training job would. By default on when an ``even`` guarantee is checked.
        progress: called about every 2 seconds with a status line while waiting.

    Returns a :class:`VerifyReport`: ``report.ok`` is the verdict, ``report.violated`` says the data shows a
    violation, ``report.error`` that the run could not complete (the factory raised, exited or hung, a rank
    crashed, the timeout). ``print(distshard.verify(build, world_size=2).summary())`` shows it.
    """
    started = time.monotonic()
    timeout = check_timeout(timeout)
    deadline = started + timeout
    checked, step_collective = _checked_arguments(world_size, num_workers, epochs, loader, even, step_collective)
    report = VerifyReport(world_size, num_workers, checked, epochs)
    got = run_processes(
        rank_start_method,
        world_size,
        _verify_rank,
        (build, num_workers, start_method, deadline, epochs, loader, step_collective),
        deadline,
        timeout,
        progress,
        reference=(_reference_main, (build, epochs, report.num_slots)),
    )
    fill_report(report, got, auto=even == _AUTO)
    report.seconds = time.monotonic() - started
    return report


def _checked_arguments(
    world_size: int, num_workers: int, epochs: int, loader: str, even: Even | str, step_collective: bool | None
) -> tuple[Even, bool | None]:
    """``verify``'s arguments, checked: ``(the even guarantee to check, step_collective)``."""
    _context.check_rank_world(0, world_size)
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise OptionError(f"num_workers={num_workers!r} must be a non-negative int")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise OptionError(f"epochs={epochs!r} must be a positive int")
    if loader not in ("torch", "stateful", "none"):
        raise OptionError(f"loader={loader!r} must be 'torch', 'stateful' or 'none'")
    checked: Even = None
    if even != _AUTO:
        checked = check_even(even)
        if step_collective is None:
            step_collective = checked is not None
    return checked, step_collective
