"""pytest-xdist's ``-n auto`` (what ``make test`` runs): one worker per core this process may
use. xdist's own count is psutil's physical cores, which on a VM whose vCPUs are hyperthreads
of fewer cores starts fewer workers than there are CPUs to run them; the affinity mask is what
the scheduler gives us (a 2-core CI machine: 2 workers). ``-n 0`` or no ``-n`` runs in one process."""

from __future__ import annotations

import os
from typing import Iterator

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook takes the number from there
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    return max(1, len(usable))


# -- the ranks of run_on_group / verify: forks of a server that imported torch once ----------
#
# A rank started with "spawn" (the library's default) is a fresh interpreter that imports torch,
# about 2 s of CPU each; the suite starts hundreds. Here the default is "forkserver": each rank
# is a fork of one clean, single-threaded server per xdist worker that imported torch and
# distshard once (the ranks still join a real gloo group, DataLoader workers start as the test
# says). Tests marked ``spawn_ranks`` keep the library's default, so that path stays covered;
# a test that passes its own start method gets it. Only modules without import-time effects the
# tests count are preloaded (tests.verify_factories has a module that hangs on import).

RANK_PRELOAD = ["torch", "torch.distributed", "torch.utils.data", "distshard", "distshard.verify"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "spawn_ranks: run_on_group/verify start ranks with the library's default (spawn)"
    )
    config.addinivalue_line(
        "markers", "watched(seconds): every process's stack on file if a test runs past ``seconds`` (helpers.watched)"
    )
    import multiprocessing

    multiprocessing.get_context("forkserver").set_forkserver_preload(RANK_PRELOAD)


@pytest.fixture(scope="session", autouse=True)
def _forkserver_started_clean() -> None:
    """Started before any test changes the environment: the server keeps the one it started with
    (the ranks get the caller's, see gloo_runs.child_setup; DataLoader workers get the server's)."""
    import multiprocessing.forkserver

    multiprocessing.forkserver.ensure_running()


@pytest.fixture(autouse=True)
def _ranks_fork_from_a_preloaded_server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("spawn_ranks") is not None:
        return
    import importlib

    verify_module = importlib.import_module("distshard.verify")  # distshard.verify is also the function

    # the functions' own defaults, so every reference to them (from ... import run_on_group) sees it
    monkeypatch.setitem(verify_module.run_on_group.__kwdefaults__, "start_method", "forkserver")
    monkeypatch.setitem(verify_module.verify.__kwdefaults__, "rank_start_method", "forkserver")


@pytest.fixture(autouse=True)
def _watchdog(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test marked ``watched(seconds)`` (a module's ``pytestmark``, usually its group's timeout) runs
    under a watchdog: past ``seconds``, every process's stack is on file (see helpers.watched)."""
    marker = request.node.get_closest_marker("watched")
    if marker is None:
        yield
        return
    from .helpers import watched

    with watched(marker.args[0], request.node.name):
        yield
