"""The environment record (:mod:`harness` re-exports it): ``Session``, the header
line and the ``--json`` dump's environment record (command, versions, cores, load
average before and after), and ``command_line``, ``loadavg``, ``versions``.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any


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
