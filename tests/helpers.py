"""Test helpers: run every slot of a sharded pipeline in this process.

``as_worker`` fakes the worker record torch's DataLoader installs in a worker,
so that the whole ranks x workers grid can be checked quickly in one process;
the real DataLoader workers and gloo groups are exercised in test_gloo.py and
test_dataloader.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch.utils.data._utils.worker as worker_module
from torch.utils.data._utils.worker import WorkerInfo

from distshard.stacks import Watchdog
from distshard.verify import canonical


@contextlib.contextmanager
def as_worker(worker_id: int, num_workers: int) -> Iterator[None]:
    """Run the block as if inside DataLoader worker ``worker_id`` of ``num_workers``."""
    previous = worker_module._worker_info
    if num_workers:
        worker_module._worker_info = WorkerInfo(id=worker_id, num_workers=num_workers, seed=0, dataset=None)  # type: ignore[arg-type]
    try:
        yield
    finally:
        worker_module._worker_info = previous


def run_slots(build: Callable[[int, int], Any], world_size: int, num_workers: int) -> dict[int, list]:
    """``{slot: elements}`` for every slot; ``build(rank, world_size)`` makes the pipe."""
    out: dict[int, list] = {}
    for rank in range(world_size):
        for worker_id in range(max(1, num_workers)):
            with as_worker(worker_id, num_workers):
                pipe = build(rank, world_size)
                out[rank * max(1, num_workers) + worker_id] = list(pipe)
    return out


def multiset(elements) -> Counter:
    return Counter(repr(canonical(x)) for x in elements)


def union(per_slot: dict[int, list]) -> Counter:
    total: Counter = Counter()
    for elements in per_slot.values():
        total += multiset(elements)
    return total


def kill_leftover_ranks(out: Path, script: str) -> None:
    """Kill the process group of any rank (and so its DataLoader workers) that wrote
    its pid to ``out/pid-*`` and is still alive running ``script``."""
    for pid_file in out.glob("pid-*"):
        pid = int(pid_file.read_text() or 0)
        try:  # only if the pid is still one of our ranks, not a reused one
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if script.encode() in cmdline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


@dataclass
class LaunchedRun:
    """What a launched job (torchrun, Lightning, Accelerate) left: its output folder, its exit
    status (``None``: killed after its wait) and its output."""

    out: Path
    returncode: int | None
    log: str

    def tail(self, lines: int = 40) -> str:
        text = [line for line in self.log.splitlines() if not line.startswith("frame #")]
        return "\n".join(text[-lines:])

    def rank_file(self, what: str, name: str, rank: int, suffix: str) -> Path:
        """``out/<name>-rank<rank><suffix>``; the test fails with the job's output if the rank left none."""
        path = self.out / f"{name}-rank{rank}{suffix}"
        if not path.exists():
            pytest.fail(
                f"{what} {name!r} left no result for rank {rank} (exit status {self.returncode}); output:\n{self.tail()}"
            )
        return path


def torchrun_command() -> list[str]:
    """torchrun of this interpreter's environment: its script, else the same entry point by module."""
    script = Path(sys.executable).with_name("torchrun")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "torch.distributed.run"]


# what launchers (torchrun, Lightning, Accelerate) set for the processes they start
LAUNCHER_VARIABLES = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "NODE_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "PL_GLOBAL_SEED",
    }
)


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a process a test starts as a user would by hand: this
    one's without any launcher's or Accelerate's variables, one thread a process,
    gloo on loopback, unbuffered, warnings off; then ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("ACCELERATE_")}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    env.update(extra)
    return env


@contextlib.contextmanager
def watched(expected: float, label: str) -> Iterator[Watchdog]:
    """The block, with a watchdog: if it runs past ``expected`` seconds, the stack of
    every process of this test (pytest's own, its gloo ranks, their DataLoader
    workers, any child) is dumped with py-spy into a file named on stderr, which
    pytest shows with the failure (``run_on_group`` also dumps before it kills at
    its timeout)."""
    dog = Watchdog(lambda: [os.getpid()], expected, label=label)
    try:
        with dog:
            yield dog
    finally:
        for path in dog.dumps:
            print(
                f"watchdog: {label} ran past its expected {expected:g}s; every process's stack: {path}", file=sys.stderr
            )


def wait_child(pid: int, seconds: float, why: str) -> int:
    """The exit code of the forked child ``pid``, waited for at most ``seconds``: a child
    still running then is killed and the test fails with ``why`` (never an unbounded wait)."""
    end = time.monotonic() + seconds
    done, status = os.waitpid(pid, os.WNOHANG)
    while not done and time.monotonic() < end:
        time.sleep(0.02)
        done, status = os.waitpid(pid, os.WNOHANG)
    if not done:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail(f"the forked child did not end within {seconds:.0f} s: {why}")
    return os.waitstatus_to_exitcode(status)
