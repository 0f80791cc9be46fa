"""pytest-xdist's ``-n auto`` (what ``make test`` runs): one worker per core this process may
use. xdist's own count is psutil's physical cores, which on a VM whose vCPUs are hyperthreads
of fewer cores starts fewer workers than there are CPUs to run them; the affinity mask is what
the scheduler gives us (a 2-core CI machine: 2 workers). ``-n 0`` or no ``-n`` runs in one process."""

from __future__ import annotations

import os

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook takes the number from there
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    return max(1, len(usable))
