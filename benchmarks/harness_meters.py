"""Per-process meters (:mod:`harness` re-exports them).

``count``, ``counts``, ``share_counts``: per-process counters (``decodes``, ...);
    where workers cannot report (torchdata.nodes' mappers), ``share_counts`` makes
    the rank and what it forks add into one shared counter.
``Meter``: user + sys CPU of a rank and its joined workers (``RUSAGE_SELF`` +
    ``RUSAGE_CHILDREN``), wall, peak RSS and bytes read (``/proc/self/io``).
"""

from __future__ import annotations

import gc
import resource
import time
from collections import Counter
from typing import Any

# -- counting ------------------------------------------------------------------------------
_COUNTS: Counter = Counter()  # this process's
_SHARED: dict[str, Any] = {}  # name -> a shared counter of the rank and what it forks (share_counts)


def count(name: str = "decodes", k: int = 1) -> None:
    """Count ``k`` more ``name`` in this process (and in the shared total, if any)."""
    _COUNTS[name] += k
    shared = _SHARED.get(name)
    if shared is not None:
        with shared.get_lock():
            shared.value += k


def counts() -> dict[str, int]:
    """This process's counts so far."""
    return dict(_COUNTS)


def share_counts(*names: str) -> None:
    """From now on ``count(name)`` also adds into a counter in shared memory, which
    the processes this one forks inherit: call it in a rank before its workers fork."""
    import ctypes
    import multiprocessing

    for name in names:
        _SHARED[name] = multiprocessing.get_context("fork").Value(ctypes.c_longlong, 0)


def _delta(now: dict[str, int], then: dict[str, int]) -> dict[str, int]:
    return {name: value - then.get(name, 0) for name, value in now.items() if value != then.get(name, 0)}


# -- CPU, RSS, bytes read, wall -------------------------------------------------------------
def rchar() -> int:
    """Bytes this process passed to read()/pread() so far."""
    with open("/proc/self/io", "rb") as f:
        for line in f:
            if line.startswith(b"rchar:"):
                return int(line.split()[1])
    return 0


def _cpu(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


class Meter:
    """What a rank spends from its creation on: its own CPU, its joined children's
    CPU (a DataLoader's workers, once joined), wall, process time, counts, reads.
    It collects garbage first, so that no window pays for a full collection of what
    was made before it (imports, data): in a short window one such collection of
    the ~170,000 objects a rank holds (~50 ms) would land in some rows and not others."""

    def __init__(self) -> None:
        gc.collect()
        self.self0 = resource.getrusage(resource.RUSAGE_SELF)
        self.children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.counts0, self.rchar0 = counts(), rchar()
        self.pt0, self.wall0 = time.process_time(), time.perf_counter()

    def rchar(self) -> int:
        return rchar() - self.rchar0

    def read(self) -> dict[str, Any]:
        wall, pt = time.perf_counter() - self.wall0, time.process_time() - self.pt0
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        rank_cpu, workers_cpu = _cpu(own) - _cpu(self.self0), _cpu(children) - _cpu(self.children0)
        return {"wall_s": wall, "rank_process_time_s": pt, "rank_cpu_s": rank_cpu, "workers_cpu_s": workers_cpu,
                "cpu_s": rank_cpu + workers_cpu, "rank_counts": _delta(counts(), self.counts0),
                "rank_maxrss_kib": own.ru_maxrss,
                "shared_counts": {name: value.value for name, value in _SHARED.items()}}
