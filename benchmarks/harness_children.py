"""The peers' venv and child processes (:mod:`harness` re-exports them).

``peers_python``, ``setup_peers``: the benchmark-only venv ``benchmarks/.venv``.
``launch``, ``child``, ``add_child_args``, ``child_env``, ``kill_tree``: running a
    script's function in a fresh process tree with either venv's interpreter, its
    result back as JSON (the script's ``--run SPEC --out PATH``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PEERS_VENV = HERE / ".venv"
REQUIREMENTS = HERE / "requirements-peers.txt"
NO_PEERS = "no benchmark venv (benchmarks/.venv): run benchmarks/bench_files.py --setup-peers"


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
