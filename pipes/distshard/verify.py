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
import multiprocessing as mp
import os
import queue as queue_module
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Literal

import torch
from torch.utils.data import get_worker_info
from torch.utils.data.datapipes.datapipe import IterDataPipe

from . import context as _context
from . import stacks
from .datapipe import shards_in
from .errors import OptionError, OptionTypeError
from .guard import check_timeout
from .keys import canonical, display, key
from .plan import Even, check_even, dropped_count, padded_count

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
_GRACE = 2.0  # seconds past the deadline for processes to report, then they are killed


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _loopback_interface() -> str:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` elsewhere)."""
    try:
        for name in sorted(os.listdir("/sys/class/net")):
            with open(f"/sys/class/net/{name}/type") as handle:
                if handle.read().strip() == "772":  # ARPHRD_LOOPBACK
                    return name
    except OSError:
        pass
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        names = []
    return "lo" if "lo" in names or "lo0" not in names else "lo0"


def _failure() -> str:
    """The traceback of the exception being handled, ending with a line that says
    what happened when the code called ``sys.exit``."""
    text = traceback.format_exc()
    exc = sys.exc_info()[1]
    if isinstance(exc, SystemExit):
        text += f"called sys.exit({exc.code!r}) instead of returning\n"
    return text


def _child_setup(env: dict[str, str]) -> None:
    if hasattr(os, "setpgrp"):
        os.setpgrp()  # a process group of its own, so a kill reaches its DataLoader workers too
    if os.environ != env:  # a forkserver's child has the server's environment, not the caller's
        os.environ.clear()
        os.environ.update(env)
    for name in ("RANK", "WORLD_SIZE"):  # as mp.spawn code: the group comes from the arguments
        os.environ.pop(name, None)
    warnings.filterwarnings("ignore", message="This DataLoader will create")


_FACTORY_FAILED = "distshard_factory_failed"  # marks an exception of the factory itself


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
        setattr(exc, _FACTORY_FAILED, True)
        raise
    return pipe


def _send(results: Any, who: Any, call: Callable[[], Any]) -> None:
    try:
        value = call()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which decides
        results.put((who, None, _failure(), bool(getattr(exc, _FACTORY_FAILED, False))))
    else:
        results.put((who, value, None, False))


def _group_main(
    rank: int,
    world_size: int,
    init_method: str,
    deadline: float,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
    env: dict[str, str],
) -> None:
    import torch.distributed as dist

    _child_setup(env)
    os.environ["GLOO_SOCKET_IFNAME"] = _loopback_interface()  # gloo listens on 127.0.0.1 only

    def call() -> Any:
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=max(0.1, deadline - time.monotonic())),
        )
        return fn(rank, world_size, *args)

    try:
        _send(results, rank, call)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _reference_main(
    build: Callable[[], IterDataPipe], epochs: int, num_slots: int, results: Any, env: dict[str, str]
) -> None:
    _child_setup(env)
    _send(results, "reference", lambda: _reference(build, epochs, num_slots))


def _run(
    start_method: str,
    world_size: int,
    fn: Callable[..., Any],
    args: tuple,
    deadline: float,
    timeout: float,
    progress: Callable[[str], None] | None,
    reference: tuple | None = None,
) -> dict[Any, tuple[Any, str | None]]:
    """Start the ranks (and the reference run), collect ``{who: (value, error)}``
    until ``deadline``, and leave no process behind."""
    ctx: Any = mp.get_context(start_method)  # a context of start_method's kind (typeshed knows only the base)
    results = ctx.Queue()
    store = tempfile.mkdtemp(prefix="distshard-group-")
    init_method = "file://" + os.path.join(store, "store")
    env = dict(os.environ)  # the caller's, now: under forkserver, children would get the server's
    procs: dict[Any, Any] = {
        rank: ctx.Process(target=_group_main, args=(rank, world_size, init_method, deadline, fn, args, results, env))
        for rank in range(world_size)
    }
    if reference is not None:
        procs["reference"] = ctx.Process(target=_reference_main, args=(*reference, results, env))
    try:
        for proc in procs.values():
            proc.start()
        got, fatal = _collect(procs, results, deadline, timeout, progress)
        # finished processes get up to 10 s to exit, never past the grace after the deadline;
        # after the factory's own failure the others would only fail alike: stopped at once
        # (a hang's stacks are dumped before the kill, not the factory's failure's)
        end = time.monotonic() if fatal else min(time.monotonic() + 10.0, deadline + _GRACE)
        killed, dumped = _stop(procs, end, dump=not fatal)
    finally:
        _stop(procs, time.monotonic())  # after an error (Ctrl-C too): kill at once
        shutil.rmtree(store, ignore_errors=True)
    for who, proc in procs.items():
        if who not in got:
            got[who] = (None, None if fatal else _no_result(who, proc.exitcode, who in killed, timeout, dumped))
    return got


def _collect(
    procs: dict[Any, Any], results: Any, deadline: float, timeout: float, progress: Callable[[str], None] | None
) -> tuple[dict[Any, tuple[Any, str | None]], bool]:
    """``{who: (value, error)}`` as the processes report, and whether the run stopped
    at the factory's own failure (then the others are not waited for)."""
    got: dict[Any, tuple[Any, str | None]] = {}
    reported = time.monotonic()
    while len(got) < len(procs):
        now = time.monotonic()
        if now >= deadline + _GRACE:
            break
        if progress is not None and now - reported >= 2.0:
            reported = now
            progress(f"{len(got)}/{len(procs)} processes done, {timeout - (deadline - now):.0f}s of {timeout:g}s")
        try:
            who, value, error, fatal = results.get(timeout=min(0.5, deadline + _GRACE - now))
        except queue_module.Empty:
            if not any(proc.is_alive() for proc in procs.values()) and results.empty():
                break
            continue
        got[who] = (value, error)
        if fatal:
            return got, True
    return got, False


def _stop(procs: dict[Any, Any], end: float, dump: bool = False) -> tuple[set, str | None]:
    """Wait until ``end`` for the processes to exit, then kill each one still running
    with its process group (its DataLoader workers); return who was killed and, with
    ``dump``, the file holding the stacks of every process still running (and of
    their workers) just before the kill."""
    for proc in procs.values():
        if proc.pid is not None:
            proc.join(timeout=max(0.0, end - time.monotonic()))
    alive = [proc.pid for proc in procs.values() if proc.pid is not None and proc.is_alive()]
    dumped = None
    if dump and alive and stacks.py_spy() is not None:  # without py-spy, a file of no stacks would only litter
        dumped = str(stacks.dump(alive, title="still running at the timeout"))
    killed = set()
    for who, proc in procs.items():
        if proc.pid is not None and proc.is_alive():
            killed.add(who)
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # unreaped, so the group is still its own
            except (AttributeError, OSError):
                proc.kill()
    for proc in procs.values():
        if proc.pid is not None:
            proc.join(timeout=5.0)
    return killed, dumped


def _who(who: Any) -> str:
    return "the reference run" if who == "reference" else f"rank {who}"


def _no_result(who: Any, code: int | None, killed: bool, timeout: float, dumped: str | None = None) -> str:
    if killed:
        why = f"was still running at the {timeout:g}s timeout (a hang, or too slow) and was killed"
        if dumped is not None:
            why += f"; the stacks of every process still running then (DataLoader workers too): {dumped}"
    elif code == 0:
        why = "exited with status 0 before sending a result (os._exit(0), or an unpicklable result)"
    elif code is not None and code > 0:
        why = f"exited with status {code} before sending a result (os._exit({code}) or a crash)"
    else:
        why = f"was killed by signal {-(code or 0)} before sending a result (a crash, or the OOM killer)"
    return f"{_who(who)} sent no result: it {why}"


@dataclass
class RankOutcome:
    """What one rank of :func:`run_on_group` returned, or why it did not."""

    rank: int
    value: Any = None
    error: str | None = None  # a traceback, or why no result came


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

    Each rank is a new process (``start_method``) that joins a gloo group with
    ``init_process_group(rank=..., world_size=...)`` through a file store in a
    temporary directory, with gloo on the loopback interface (no socket listens
    beyond 127.0.0.1) and the caller's environment less ``RANK`` / ``WORLD_SIZE``,
    as ``mp.spawn`` code does (under ``forkserver`` too, whose children would
    otherwise have the server's). ``fn`` and ``args`` must be picklable; ``fn``'s return
    value comes back. ``timeout`` (seconds, finite and positive) bounds the whole
    run: the group's collectives time out by then, and ranks still running about 2
    seconds later are killed with their DataLoader workers and reported with an
    ``error``, which names a file holding the stacks of every process still running
    just before the kill when py-spy is installed (see :mod:`distshard.stacks`). ``progress``, if given, is called about every 2 seconds with a
    short status line.

    Example:
        >>> outcomes = run_on_group(train_step, world_size=2, timeout=30)  # doctest: +SKIP
        >>> [o.value for o in outcomes if o.error is None]  # doctest: +SKIP
    """
    timeout = check_timeout(timeout)
    _context.check_rank_world(0, world_size)
    got = _run(start_method, world_size, fn, args, time.monotonic() + timeout, timeout, progress)
    return [RankOutcome(rank, *got[rank]) for rank in range(world_size)]


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
        return _failure(), seen
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


def _labels(names: dict[str, str]) -> dict[str, str]:
    """Display names, with a piece of the key where two distinct elements read alike."""
    uses = Counter(names.values())
    return {k: name if uses[name] == 1 else f"{name} #{k[:8]}" for k, name in names.items()}


@dataclass
class VerifyReport:
    """What ``verify`` saw. ``ok`` is the verdict; ``summary()`` reads well.

    ``violated`` says the data shows an exactly-once violation; ``error`` (with one
    line per failed process in ``reasons``) says the run could not complete, so the
    verdict is not ``ok`` without being a violation.
    """

    world_size: int
    num_workers: int
    even: Even
    epochs: int
    expected: int = 0  # elements of one epoch of the unsharded stream
    received: int = 0  # elements all slots yielded, all epochs
    per_rank: list[int] = field(default_factory=list)
    per_slot: list[int] = field(default_factory=list)
    duplicates: dict[str, int] = field(default_factory=dict)  # element's name -> extra copies
    missing: dict[str, int] = field(default_factory=dict)  # element's name -> copies missing
    duplicate_count: int = 0
    missing_count: int = 0  # under even="carry": beyond the carried tail
    allowed_duplicates: int = 0  # even="pad" repeats these many per epoch
    allowed_missing: int = 0  # even="drop" drops these many per epoch
    carried: int = 0  # even="carry": the last epoch's tail, which the next epoch yields first
    carried_elements: dict[str, int] = field(default_factory=dict)  # the tail's names, when nothing else is missing
    carried_received: int = 0  # even="carry": elements of the tail this run yielded instead of leaving them
    seconds: float = 0.0
    error: str | None = None  # tracebacks and reasons, one block per failed process
    reasons: list[str] = field(default_factory=list)  # one line per failed process
    reads: str = ""  # how the pipeline reads its source, from its dist_shard
    pipeline_even: Even = None  # the even= of the pipeline's own dist_shard
    multiple_of: int = 1  # the pipeline's multiple_of, when the even checked is its "drop"
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
        if self.error is None and (self.missing_count != self.allowed_missing * self.epochs or self.carried_received):
            return True
        return self.even is not None and not self.slots_equal and self.error is None

    @property
    def violations(self) -> list[str]:
        """Why ``violated`` is true, one line each (empty when it is not)."""
        out = []
        allowed = self.allowed_duplicates * self.epochs
        if self.duplicate_count != allowed:
            out.append(f"{self.duplicate_count} duplicates, where even={self.even!r} allows exactly {allowed}")
        allowed = self.allowed_missing * self.epochs
        if self.error is None and self.missing_count != allowed:
            beyond = f" beyond the carried tail of {self.carried}" if self.even == "carry" else ""
            out.append(
                f"{self.missing_count} missing{beyond}, where even={self.even!r} over {self.num_slots} slots "
                f"leaves out exactly {allowed}"
            )
        if self.error is None and self.carried_received:
            out.append(
                f"{self.carried_received} more received than the epochs' carry windows hold: even='carry' over "
                f"{self.num_slots} slots leaves the last epoch's tail of {self.carried} to open the next epoch"
            )
        if self.even is not None and not self.slots_equal and self.error is None:
            own = (
                ""
                if self.pipeline_even == self.even
                else f" (the pipeline's own dist_shard has even={self.pipeline_even!r})"
            )
            out.append(
                f"per-slot counts differ ({_counts(self.per_slot)}), where even={self.even!r} requires "
                f"every slot to yield the same{own}"
            )
        return out

    @property
    def ok(self) -> bool:
        """Exactly-once held: nothing duplicated or missing beyond what ``even``
        documents, and with ``even`` set, every slot yielded the same count."""
        return self.error is None and not self.violated

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
            + (f" e.g. {_examples(self.missing)}" if self.missing else "")
            + (" (the carried tail is among these)" if self.missing and self.even == "carry" else ""),
        ]
        if self.even == "carry":
            lines.append(
                f"  carried: {self.carried} (the last epoch's tail, which opens the next epoch)"
                + (f" e.g. {_examples(self.carried_elements)}" if self.carried_elements else "")
            )
        lines += [f"  violation: {why}" for why in self.violations]
        lines += [f"  error: {reason}" for reason in self.reasons[:4]]
        if len(self.reasons) > 4:
            lines.append(f"  error: ... and {len(self.reasons) - 4} more")
        lines.append("  verdict: " + ("EXACTLY-ONCE" if self.ok else "VIOLATED" if self.violated else "COULD NOT RUN"))
        return "\n".join(lines)


def _split_carried(report: VerifyReport) -> None:
    """Under ``even="carry"`` what the run did not yield is the last epoch's tail, which
    is not missing (it opens the next epoch), and what is missing beyond it. The tail's
    names are known when nothing else is missing; else the missing ones list it too."""
    not_received = report.missing_count
    report.missing_count = max(0, not_received - report.carried)
    report.carried_received = max(0, report.carried - not_received)
    if report.missing_count == 0:
        report.carried_elements, report.missing = report.missing, {}


def _counts(counts: list[int], limit: int = 16) -> str:
    return ", ".join(map(str, counts[:limit])) + (", ..." if len(counts) > limit else "")


def _examples(counts: dict[str, int], limit: int = 3) -> str:
    return ", ".join(f"{k} x{v}" for k, v in list(counts.items())[:limit])


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no message)"


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

    Elements are compared by :func:`key` (a digest of their value), against the
    unsharded stream that one more process reads with ``build()`` as a single slot.

    Args:
        build: a picklable zero-argument callable (a module-level function, or a
            :class:`FactoryPath`) that returns the pipeline, ``dist_shard``
            included, as each rank builds it. It is only called in child processes.
        world_size: ranks to start, each a process joined to a gloo group on 127.0.0.1.
        num_workers: DataLoader workers per rank (0: the rank iterates itself).
        even: which ``even`` guarantee to check; by default the one of the
            pipeline's ``dist_shard``.
        start_method: how DataLoader workers start: ``fork``, ``spawn`` or ``forkserver``.
        rank_start_method: how the rank processes (and the reference run) start:
            ``spawn`` (a fresh interpreter each), or ``forkserver``, which after
            ``multiprocessing.set_forkserver_preload(["torch", "distshard"])`` forks
            each from a server that imported them once (seconds of CPU less per rank).
        timeout: seconds (finite, positive) the whole run may take, the calls of
            ``build`` and the reference run included; the collectives and the
            DataLoader time out by then, processes still alive about 2 seconds later
            are killed, and the report has an ``error``.
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
        A :class:`VerifyReport`: ``report.ok`` is the verdict, ``report.violated``
        says the data shows a violation, ``report.error`` that the run could not
        complete (the factory raised, exited or hung, a rank crashed, the timeout).

    Example:
        >>> report = distshard.verify(build, world_size=2, num_workers=2)  # doctest: +SKIP
        >>> print(report.summary())  # doctest: +SKIP
    """
    started = time.monotonic()
    timeout = check_timeout(timeout)
    deadline = started + timeout
    checked, step_collective = _checked_arguments(world_size, num_workers, epochs, loader, even, step_collective)
    report = VerifyReport(world_size, num_workers, checked, epochs)
    got = _run(
        rank_start_method,
        world_size,
        _verify_rank,
        (build, num_workers, start_method, deadline, epochs, loader, step_collective),
        deadline,
        timeout,
        progress,
        reference=(build, epochs, report.num_slots),
    )
    _report_errors(report, got)
    received = _count_received(report, got)
    reference, _ = got["reference"]
    if reference is not None:  # without the unsharded stream there is nothing to compare with
        _compare_with_reference(report, reference, received, even == _AUTO)
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


def _report_errors(report: VerifyReport, got: dict[Any, tuple[Any, str | None]]) -> None:
    """Whether the run could complete: every process's error, labelled, into ``report``."""
    blocks = []
    for who in ["reference", *range(report.world_size)]:
        value, error = got[who]
        if who != "reference" and value is not None:
            error = error or value[0]
        if error:
            label = "" if error.startswith(_who(who)) else f"{_who(who)}: "  # tracebacks get a label
            blocks.append(label + error)
            report.reasons.append(label + _last_line(error))
    report.error = "\n".join(blocks) or None


def _count_received(report: VerifyReport, got: dict[Any, tuple[Any, str | None]]) -> list[Counter]:
    """What every rank and slot received (into ``report``), and the keys received in each epoch."""
    report.per_rank = [0] * report.world_size
    report.per_slot = [0] * report.num_slots
    received: list[Counter] = [Counter() for _ in range(report.epochs)]
    for rank in range(report.world_size):
        value, _ = got[rank]
        seen = value[1] if value is not None else []
        report.per_rank[rank] = len(seen)
        for epoch, slot, element_key in seen:
            if 0 <= slot < report.num_slots:
                report.per_slot[slot] += 1
            received[epoch][element_key] += 1
        report.seen.extend(seen)
    report.received = sum(report.per_rank)
    return received


def _compare_with_reference(report: VerifyReport, reference: Any, received: list[Counter], auto: bool) -> None:
    """The verdict: what was received against the unsharded stream, less what the
    guarantee checked allows to be missing or repeated (``auto``: the pipeline's own)."""
    references, (report.pipeline_even, multiple), names, report.reads = reference
    if auto:
        report.even = report.pipeline_even
    labels = _labels(names)
    per_epoch = sum(references[0].values())
    report.expected = per_epoch
    report.multiple_of = multiple if report.even == report.pipeline_even == "drop" else 1
    report.allowed_missing = dropped_count(report.num_slots, per_epoch, report.even, report.multiple_of)
    report.allowed_duplicates = padded_count(report.num_slots, per_epoch, report.even)
    pairs = list(zip(received, references, strict=False))
    if report.even == "carry":  # the epochs are one stream: compare everything, less the last tail
        unit, total = report.num_slots * multiple, per_epoch * report.epochs
        report.allowed_missing, report.carried = 0, total - unit * (total // unit)
        pairs = [(sum(received, Counter()), sum(references, Counter()))]
    for got_epoch, want in pairs:
        for counts, delta in ((report.duplicates, got_epoch - want), (report.missing, want - got_epoch)):
            for element_key, n in delta.items():
                name = labels.get(element_key, f"<not in the reference run #{element_key[:8]}>")
                counts[name] = counts.get(name, 0) + n
    report.duplicate_count = sum(report.duplicates.values())
    report.missing_count = sum(report.missing.values())
    if report.even == "carry":
        _split_carried(report)
