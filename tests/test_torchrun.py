"""A real two-node torchrun job on this machine: two torchrun agents meet at a
c10d rendezvous on 127.0.0.1 as two nodes of 2 processes each (4 ranks), every
rank iterating a shuffled, ``even="drop"`` dist_shard pipeline through 2 fork
DataLoader workers with one all_reduce per element (tests/torchrun_worker.py).

The agents run in process groups of their own and are killed in ``finally``
(torchrun starts each rank in a session of its own, so the ranks' groups are
killed too, from the pids they record), so the test cannot hang or leave
processes behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from distshard.verify import free_port

from .helpers import child_env, kill_leftover_ranks, torchrun_command

WORKER = Path(__file__).with_name("torchrun_worker.py")
NODES, PROCS, WORKERS = 2, 2, 2
WORLD = NODES * PROCS
SLOTS = WORLD * WORKERS
N = 1003  # 1003 % 8 == 3 records dropped by even="drop"
WAIT = 120  # seconds for the whole job
GRACE = 10  # seconds left to the other node once one node failed

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="uses fork DataLoader workers, loopback gloo and killpg"
)


def _agent_env() -> dict[str, str]:
    return child_env()


def _tail(path: Path, lines: int = 30) -> str:
    """The ranks' tracebacks (torch prefixes them ``[rankN]:``) and the end of an
    agent's output, without the C++ stack frames of c10d warnings."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "<no output>"
    text = [line for line in text if not line.startswith("frame #")]
    ranks = [line for line in text if re.match(r"\[rank\d+\]:", line)]
    rest = [line for line in text if not re.match(r"\[rank\d+\]:", line)]
    return "\n".join(ranks[-lines:] + ["..."] + rest[-lines:])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop(agents: list[subprocess.Popen], out: Path) -> None:
    running = [a for a in agents if a.poll() is None]
    for a in running:  # SIGTERM first: the agent then stops its ranks itself
        try:
            os.killpg(a.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    for a in running:
        try:
            a.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for a in agents:
        try:
            os.killpg(a.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            a.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    kill_leftover_ranks(out, WORKER.name)


def test_two_torchrun_nodes_consume_every_record_exactly_once(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    command = torchrun_command() + [
        "--nnodes",
        str(NODES),
        "--nproc-per-node",
        str(PROCS),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        f"distshard-{uuid.uuid4().hex[:12]}",
        "--local-addr",
        "127.0.0.1",
        "--max-restarts",
        "0",
        str(WORKER),
        str(out),
        str(N),
    ]
    env = _agent_env()
    agents: list[subprocess.Popen] = []
    logs: list[Path] = []
    timed_out = False
    try:
        for node in range(NODES):
            log = tmp_path / f"agent{node}.log"
            logs.append(log)
            with open(log, "wb") as f:
                agents.append(
                    subprocess.Popen(
                        command,
                        env=env,
                        cwd=tmp_path,
                        stdin=subprocess.DEVNULL,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + WAIT
        while None in [a.poll() for a in agents]:  # poll every agent, every time
            if time.monotonic() > deadline:
                timed_out = True
                break
            if any(a.returncode not in (None, 0) for a in agents):
                # One node failed: torchrun does not tell the other one, whose ranks
                # may wait in a collective (torch's DataLoader makes a new gloo group
                # in iter(loader), with the 30 min default timeout), so cut it short.
                deadline = min(deadline, time.monotonic() + GRACE)
            time.sleep(0.1)
    finally:
        _stop(agents, out)

    def context() -> str:
        parts = [
            f"agent {i} exit code {a.returncode}:\n{_tail(log)}"
            for i, (a, log) in enumerate(zip(agents, logs, strict=True))
        ]
        for path in sorted(out.glob("rank*.json")):
            error = json.loads(path.read_text()).get("error")
            if error:
                parts.append(f"{path.name} error:\n{error}")
        return "\n\n".join(parts)

    codes = [a.returncode for a in agents]
    assert not timed_out and codes == [0] * NODES, (
        f"the torchrun agents exited with {codes}"
        + (
            f" (killed: the job did not finish in time, {WAIT} s at most and {GRACE} s after a node failed)"
            if timed_out
            else ""
        )
        + f"\n\n{context()}"
    )

    files = {int(p.stem[len("rank") :]): p for p in out.glob("rank*.json")}
    assert sorted(files) == list(range(WORLD)), context()
    results = {r: json.loads(p.read_text()) for r, p in files.items()}
    assert all(res["error"] is None for res in results.values()), context()

    # The ranks are 0..3, as torch.distributed and torchrun's environment agree,
    # on two nodes of two local ranks each.
    assert sorted(res["rank"] for res in results.values()) == list(range(WORLD))
    for r, res in results.items():
        assert res["rank"] == r and res["world_size"] == WORLD
        assert res["env"]["RANK"] == str(r) and res["env"]["WORLD_SIZE"] == str(WORLD)
    nodes = Counter((res["env"]["GROUP_RANK"], res["env"]["LOCAL_RANK"]) for res in results.values())
    assert nodes == Counter({(str(g), str(local)): 1 for g in range(NODES) for local in range(PROCS)})

    # Inside the workers, dist_shard resolved the rank from the inherited group.
    per_slot: Counter = Counter()
    for r, res in results.items():
        for e in res["elements"]:
            assert e["source"] == "torch.distributed" and e["ctx_rank"] == r, e
            assert e["num_slots"] == SLOTS and e["slot"] == r * WORKERS + e["worker"], e
            assert e["decoded"] == e["id"].upper(), e
            per_slot[e["slot"]] += 1

    # Every rank took the same number of steps, every slot N // 8 elements.
    counts = [len(results[r]["elements"]) for r in range(WORLD)]
    assert counts == [N // SLOTS * WORKERS] * WORLD, counts
    assert all(results[r]["steps"] == counts[r] for r in range(WORLD))
    assert per_slot == {s: N // SLOTS for s in range(SLOTS)}, per_slot

    # The union is the epoch minus exactly N % 8 records, with no duplicates.
    epoch = Counter((f"rec-{i:04d}", i % 7) for i in range(N))
    seen = Counter((e["id"], e["value"]) for res in results.values() for e in res["elements"])
    assert max(seen.values()) == 1, [k for k, c in seen.items() if c > 1]
    assert not seen - epoch, seen - epoch
    assert sum((epoch - seen).values()) == N % SLOTS, sorted(epoch - seen)

    # The shuffle ran (in the same order on every slot, or the above would fail).
    for r, res in results.items():
        for worker in range(WORKERS):
            ids = [e["id"] for e in res["elements"] if e["worker"] == worker]
            assert ids != sorted(ids), f"rank {r} worker {worker} read its records in order"
