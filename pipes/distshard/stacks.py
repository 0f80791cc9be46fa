"""The stacks of a process tree, written to a file before a hung job is killed.

A job that passes its time (a gloo group of ranks, each with DataLoader workers; a
benchmark's child process tree) is killed; what every process was doing then is
the only trace of why. :func:`dump` writes every process's Python stack (with
``py-spy dump``, when py-spy is installed: it reads a process's memory, so it
sees a process stuck in C code or holding the GIL too) into a file whose path the
caller names in its error. :class:`Watchdog` does it once when a job passes its
expected time while it still runs, so a stall leaves its stacks even if a later
timeout (a DataLoader's) ends it another way. Linux (``/proc``) only; elsewhere
the file says why it has no stacks. Nothing here raises: a dump that fails says
so in the file.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

__all__ = ["Watchdog", "descendants", "dump", "py_spy"]

_log = logging.getLogger("distshard")
_PER_PROCESS = 20.0  # seconds one py-spy dump may take


def py_spy() -> str | None:
    """The py-spy executable: next to this interpreter (a venv's ``bin``), else on ``PATH``."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def _parents() -> dict[int, int]:
    """``{pid: parent pid}`` of every process ``/proc`` shows."""
    parents = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after its last ')'
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1:
            parents[int(entry.name)] = int(fields[1])
    return parents


def descendants(*roots: int) -> list[int]:
    """``roots`` and every process below them (children, their children, ...), roots first."""
    try:
        parents = _parents()
    except OSError:
        return list(roots)
    children: dict[int, list[int]] = {}
    for pid, parent in sorted(parents.items()):
        children.setdefault(parent, []).append(pid)
    found: list[int] = []
    todo = list(roots)
    while todo:
        pid = todo.pop(0)
        if pid in found:
            continue
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "(gone)"


def _dumps(spy: str | None, pids: list[int]) -> list[str]:
    """Every process's ``py-spy dump``, all at once (each within about 20 seconds)."""
    if spy is None:
        return ["py-spy is not installed (pip install py-spy): no stack\n"] * len(pids)
    started: list[subprocess.Popen[str] | str] = []
    for pid in pids:
        try:
            started.append(
                subprocess.Popen(
                    [spy, "dump", "--pid", str(pid)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )
            )
        except OSError as exc:
            started.append(f"py-spy could not run: {exc}\n")
    end = time.monotonic() + _PER_PROCESS
    out = []
    for proc in started:
        if isinstance(proc, str):
            out.append(proc)
            continue
        try:
            stdout, stderr = proc.communicate(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            out.append(f"py-spy dump did not answer within {_PER_PROCESS:g}s\n")
            continue
        if proc.returncode:
            first = stderr.strip().splitlines()[:1]
            out.append(f"py-spy dump failed (exit {proc.returncode}): {first[0] if first else ''}\n")
        else:
            out.append(stdout)
    return out


def dump(pids: Iterable[int], path: str | os.PathLike[str] | None = None, *, title: str = "") -> Path:
    """Write the stack of every process in ``pids`` (each one's whole tree: pass the
    roots) to ``path`` (default: a new ``distshard-stacks-*.txt`` in the temporary
    directory) and return the path. Within about 20 seconds: the processes are
    dumped at once."""
    if path is None:
        handle, name = tempfile.mkstemp(prefix="distshard-stacks-", suffix=".txt")
        os.close(handle)
        path = name
    target = Path(path)
    tree = descendants(*pids)
    names = [_cmdline(pid) for pid in tree]
    stacks = _dumps(py_spy(), tree)
    with target.open("a") as out:
        out.write(f"# {title or 'stacks'}: {len(tree)} processes, {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        for pid, name, stack in zip(tree, names, stacks, strict=True):
            out.write(f"\n## pid {pid}: {name}\n{stack}")
    return target


class Watchdog:
    """Dump the stacks of ``pids()`` (roots; their trees are included) once, when
    ``expected`` seconds pass before :meth:`stop` (``None``: never by itself); :meth:`fire` dumps at once (call
    it before killing a job at its timeout). ``dumps`` lists the files written.
    Use it as a context manager: started on entry, stopped on exit."""

    def __init__(
        self,
        pids: Callable[[], Iterable[int]],
        expected: float | None,
        *,
        label: str = "job",
        directory: str | None = None,
    ) -> None:
        self.pids, self.expected, self.label, self.directory = pids, expected, label, directory
        self.dumps: list[Path] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(0.0 if expected is None else expected, self._late)
        self._timer.daemon = True

    def start(self) -> Watchdog:
        if self.expected is not None:
            self._timer.start()
        return self

    def stop(self) -> None:
        """No dump from now on; a dump under way is waited for (within about two minutes)."""
        self._timer.cancel()
        if self._timer.is_alive():
            self._timer.join(timeout=120.0)

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _late(self) -> None:
        path = self.fire(f"{self.label} still running after its expected {self.expected:g}s")
        _log.warning("%s passed its expected %ss; the stacks of its processes: %s", self.label, self.expected, path)

    def fire(self, why: str) -> Path:
        """Dump now (``why`` heads the file) and return the file."""
        with self._lock:
            prefix = "distshard-stacks-" + re.sub(r"[^\w.-]+", "-", self.label) + "-"
            handle, name = tempfile.mkstemp(prefix=prefix, suffix=".txt", dir=self.directory)
            os.close(handle)
            path = dump(self.pids(), name, title=why)
            self.dumps.append(path)
            return path
