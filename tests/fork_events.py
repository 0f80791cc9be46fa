"""The two events ``tests/test_fork_safety.py`` and ``tests/fork_slow_fs.py``
share: a module of its own, so the filesystem module (imported afresh by each
test) does not import a test file."""

from __future__ import annotations

import threading

FORKING = threading.Event()  # set when a fork starts, while the test is armed (test_fork_safety._ARMED)
IMPORTING = threading.Event()  # set by tests/fork_slow_fs.py when its import has begun
