"""``run_on_group``: a function on every rank of a fresh gloo group on 127.0.0.1, each rank
its own process (``spawn`` or ``forkserver``) joined through a file store, with gloo on the
loopback interface and the caller's environment less ``RANK`` / ``WORLD_SIZE``. The whole
run is bounded: processes still running past the timeout are killed with their DataLoader
workers (their stacks dumped first when py-spy is installed) and reported, never waited
for. ``distshard.verify`` runs its ranks and its reference run through it."""

from __future__ import annotations

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
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

from . import context as _context
from . import stacks
from .guard import check_timeout

FACTORY_FAILED = "distshard_factory_failed"  # marks an exception of the factory itself: the run stops at the first
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


def failure_text() -> str:
    """The traceback of the exception being handled, ending with a line that says
    what happened when the code called ``sys.exit``."""
    text = traceback.format_exc()
    exc = sys.exc_info()[1]
    if isinstance(exc, SystemExit):
        text += f"called sys.exit({exc.code!r}) instead of returning\n"
    return text


def child_setup(env: dict[str, str]) -> None:
    """First thing in a child: a process group of its own, the caller's environment ``env``."""
    if hasattr(os, "setpgrp"):
        os.setpgrp()  # a process group of its own, so a kill reaches its DataLoader workers too
    if os.environ != env:  # a forkserver's child has the server's environment, not the caller's
        os.environ.clear()
        os.environ.update(env)
    for name in ("RANK", "WORLD_SIZE"):  # as mp.spawn code: the group comes from the arguments
        os.environ.pop(name, None)
    warnings.filterwarnings("ignore", message="This DataLoader will create")


def send_result(results: Any, who: Any, call: Callable[[], Any]) -> None:
    """``call()``'s value, or its traceback (and whether the factory itself failed, see
    ``FACTORY_FAILED``), onto the ``results`` queue as ``who``'s report."""
    try:
        value = call()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which decides
        results.put((who, None, failure_text(), bool(getattr(exc, FACTORY_FAILED, False))))
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

    child_setup(env)
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
        send_result(results, rank, call)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_processes(
    start_method: str,
    world_size: int,
    fn: Callable[..., Any],
    args: tuple,
    deadline: float,
    timeout: float,
    progress: Callable[[str], None] | None,
    reference: tuple[Callable[..., None], tuple] | None = None,
) -> dict[Any, tuple[Any, str | None]]:
    """Start the ranks (and the ``reference`` process, which reports as "reference"), collect ``{who: (value, error)}``
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
        target, arguments = reference  # one more process, "reference": target(*arguments, results, env)
        procs["reference"] = ctx.Process(target=target, args=(*arguments, results, env))
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


def who_label(who: Any) -> str:
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
    return f"{who_label(who)} sent no result: it {why}"


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
    got = run_processes(start_method, world_size, fn, args, time.monotonic() + timeout, timeout, progress)
    return [RankOutcome(rank, *got[rank]) for rank in range(world_size)]
