"""What the benchmark scripts share: the streaming-only source and the header's
command line."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator


class IterOnly:
    """An iterable with no ``__len__`` / ``__getitem__``: forces streaming."""

    def __init__(self, iterable: Iterable[Any]) -> None:
        self.iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        return iter(self.iterable)


def command_line() -> str:
    """The command that ran this script, as a user would type it."""
    exe = Path(sys.executable)
    try:
        shown = os.path.relpath(exe) if exe.is_relative_to(Path.cwd()) else str(exe)
    except ValueError:
        shown = str(exe)
    flags = ["-O"] if sys.flags.optimize else []
    return shlex.join([shown, *flags, *sys.argv])


def environment() -> dict[str, Any]:
    """What a JSON dump of results records about where it was measured."""
    import platform

    import torch
    import torchdata

    import distshard

    return {
        "command": command_line(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchdata": torchdata.__version__,
        "distshard": distshard.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Dump a benchmark's raw numbers (``--json PATH``)."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=repr) + "\n")
