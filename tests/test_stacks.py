"""The watchdog: a job that passes its time leaves every process's stack in a file
(py-spy), named where the failure is reported, before it is killed."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.utils.data import DataLoader, IterableDataset

from distshard import stacks
from distshard.verify import run_on_group

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(stacks.py_spy() is None, reason="py-spy is in the test extra")

# a child that forks a grandchild; both sleep forever in functions named for the test to find
SLEEPER = """
import os, sys, time

def grandchild_sleeps_here():
    while True:
        time.sleep(1000)

def child_sleeps_here():
    print("ready", flush=True)
    while True:
        time.sleep(1000)

if os.fork() == 0:
    grandchild_sleeps_here()
child_sleeps_here()
"""


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        yield proc
    finally:
        for pid in reversed(stacks.descendants(proc.pid)):
            subprocess.run(["kill", "-9", str(pid)], check=False)
        proc.wait(timeout=30)


def test_a_dump_names_the_function_every_process_of_the_tree_sleeps_in(sleeper, tmp_path):
    tree = stacks.descendants(sleeper.pid)
    assert len(tree) == 2 and tree[0] == sleeper.pid
    path = stacks.dump([sleeper.pid], tmp_path / "stacks.txt", title="test")
    text = path.read_text()
    assert f"## pid {tree[0]}:" in text and f"## pid {tree[1]}:" in text
    assert "child_sleeps_here" in text and "grandchild_sleeps_here" in text


def test_the_watchdog_dumps_once_a_job_passes_its_expected_time(sleeper, tmp_path):
    with stacks.Watchdog(lambda: [sleeper.pid], 0.2, label="a sleeper", directory=str(tmp_path)) as dog:
        end = time.monotonic() + 120
        while not dog.dumps and time.monotonic() < end:  # no timing assert: just wait for the dump
            time.sleep(0.1)
    assert len(dog.dumps) == 1 and dog.dumps[0].parent == tmp_path and "a-sleeper" in dog.dumps[0].name
    assert "grandchild_sleeps_here" in dog.dumps[0].read_text()


def test_a_job_that_ends_in_time_leaves_no_dump(tmp_path):
    with stacks.Watchdog(lambda: [], 600, directory=str(tmp_path)) as dog:
        pass
    assert dog.dumps == [] and list(tmp_path.iterdir()) == []


class _Stuck(IterableDataset):
    def __iter__(self):
        worker_sleeps_here()
        yield 0


def worker_sleeps_here():
    while True:
        time.sleep(1000)


def _rank_waits_for_its_worker(rank, world_size):
    return list(DataLoader(_Stuck(), batch_size=None, num_workers=1, multiprocessing_context="fork"))


@pytest.mark.timeout(180)
def test_run_on_group_dumps_ranks_and_workers_before_it_kills_them_at_its_timeout():
    outcomes = run_on_group(_rank_waits_for_its_worker, world_size=1, timeout=20)
    error = outcomes[0].error
    assert error is not None and "killed" in error and "stacks" in error, error
    path = Path(error.rsplit(": ", 1)[1].strip())
    try:
        text = path.read_text()
        assert "worker_sleeps_here" in text  # the DataLoader worker
        assert "_rank_waits_for_its_worker" in text  # the rank, waiting for it
    finally:
        path.unlink()


def stuck_child_function():
    while True:
        time.sleep(1000)


@pytest.mark.timeout(180)
def test_a_benchmark_child_past_its_timeout_is_dumped_then_killed(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import harness
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    script = tmp_path / "stuck.py"
    script.write_text(
        "import sys, time\nfrom pathlib import Path\nimport harness\n\n"
        "def stuck():\n    benchmark_sleeps_here()\n\n"
        "def benchmark_sleeps_here():\n    while True:\n        time.sleep(1000)\n\n"
        "sys.exit(harness.child(Path(sys.argv[2]), Path(sys.argv[4]), globals()))\n"
    )
    done = harness.launch(script, "stuck", {}, timeout=20, grace=0)
    assert len(done["errors"]) == 1 and "timed out after 20s" in done["errors"][0], done
    path = Path(done["stacks"][0])
    try:
        assert str(path) in done["errors"][0] and "benchmark_sleeps_here" in path.read_text()
    finally:
        path.unlink()
