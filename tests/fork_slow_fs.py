"""A filesystem whose module is still being imported when a fork starts
(``tests/test_fork_safety.py``): its import waits until the test's fork hook says
a fork is starting, and a moment more, so a fork that does not wait for the thread
importing it is made while the module's import lock is held by that thread."""

from __future__ import annotations

import time

from fsspec.spec import AbstractFileSystem

from tests.fork_events import FORKING, IMPORTING

IMPORTING.set()
FORKING.wait(60)
time.sleep(0.2)  # (a fork that does not wait is made meanwhile; one that waits is only later)


class SlowImportFileSystem(AbstractFileSystem):
    protocol = "slowimport"
