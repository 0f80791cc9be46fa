"""Factories and rank functions for tests/test_verify.py, test_cli.py and
test_guard.py: they run in spawned processes, so they live in an importable module.

``HANG_ON_IMPORT``: when this variable is set, importing the module hangs (only
the child processes of ``check`` should ever import it).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
import sys
import time

import numpy as np
import torch
from torch.utils.data.datapipes.iter import IterableWrapper

import distshard  # noqa: F401  (registers .dist_shard)

HANG_ON_IMPORT = "DISTSHARD_TEST_HANG_ON_IMPORT"
if os.environ.get(HANG_ON_IMPORT):
    time.sleep(3600)


def _in_group() -> bool:
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_world_size() > 1


def _half(records: list) -> list:
    """What a buggy reader yields: as many records, but only every second one, twice."""
    return [records[i - i % 2] for i in range(len(records))]


# -- records that defeat repr --------------------------------------------------------


def long_arrays(n: int = 40) -> list:
    """numpy shortens these in repr to ``array([0., 0., 0., ..., 0., 0., 0.])``."""
    arrays = []
    for i in range(n):
        array = np.zeros(5000)
        array[2500] = i
        arrays.append(array)
    return arrays


class Plain:
    """A record whose repr is the default ``<... object at 0x...>``."""

    def __init__(self, i: int) -> None:
        self.i = i
        self.payload = {"name": f"item-{i}", "tags": [i % 3, i % 5]}


class Slotted:
    __slots__ = ("a", "b")

    def __init__(self, a, b) -> None:
        self.a, self.b = a, b


@dataclasses.dataclass
class Point:
    x: float
    y: float


def plain_objects(n: int = 30) -> list:
    return [Plain(i) for i in range(n)]


def arrays_half():
    """Reads half the long arrays on a real group (each twice): repr could not tell."""
    records = long_arrays()
    return IterableWrapper(_half(records) if _in_group() else records).dist_shard()


def objects_ok():
    """A correct pipeline over records with default reprs (different in every process)."""
    return IterableWrapper(plain_objects()).dist_shard(even="drop")


def objects_half():
    records = plain_objects()
    return IterableWrapper(_half(records) if _in_group() else records).dist_shard()


def samples() -> list:
    """Values whose keys must be the same in every process (sets of strings too,
    whose iteration order depends on PYTHONHASHSEED)."""
    return [
        None,
        True,
        1,
        1.0,
        0.1 + 0.2,
        0.3,
        -0.0,
        float("nan"),
        2**100,
        1 + 2j,
        "s",
        b"s",
        (1, 2),
        [1, 2],
        {"b": {"y": 2, "x": 1}, "a": 1},
        {"alpha", "beta", "gamma", "delta"},
        frozenset({"x", "y"}),
        torch.arange(6).reshape(2, 3),
        torch.tensor([0.5], dtype=torch.bfloat16),
        np.arange(6).reshape(3, 2),
        np.float32(0.5),
        np.array(["a", None], dtype=object),
        Plain(3),
        Slotted(1, [2]),
        Point(1.0, 2.0),
    ]


def print_sample_keys() -> None:
    """Called in a fresh interpreter by test_verify.py."""
    from distshard.verify import key

    print("\n".join(key(value) for value in samples()))


# -- check: factories that hang, exit or raise ---------------------------------------


def hangs():
    time.sleep(3600)


def exits_zero():
    sys.exit(0)


def os_exit_three():
    os._exit(3)


def raises():
    raise RuntimeError("this factory is broken on purpose")


def _sleep_in_group(element):
    if _in_group():
        time.sleep(3600)
    return element


def hangs_in_ranks():
    """Builds fine, and its reference run finishes; a map hangs on the ranks."""
    return IterableWrapper(list(range(20))).dist_shard().map(_sleep_in_group)


def _exit_in_group(element):
    if _in_group():
        os._exit(0)
    return element


def exits_in_ranks():
    """The ranks end with status 0 in the middle of the epoch."""
    return IterableWrapper(list(range(20))).dist_shard().map(_exit_in_group)


def strings():
    return IterableWrapper([f"s{i}" for i in range(40)]).dist_shard()


# -- sockets of a rank (test_verify.py) ------------------------------------------------


def _address(text: str) -> str:
    raw = bytes.fromhex(text)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))


def listening_addresses(pid: int | str = "self") -> list[str]:
    """The local addresses the process listens on (TCP, IPv4 and IPv6), from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as handle:
            next(handle)
            for line in handle:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    address, _, port = fields[1].partition(":")
                    found.append(f"{_address(address)}:{int(port, 16)}")
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.rpartition(":")[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def sockets_while_loading(rank, world_size, workers):
    """The rank's listening sockets while a DataLoader over a DataPipe (which makes
    its own gloo group) is being iterated, with one collective done."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    kwargs = {"multiprocessing_context": "fork", "timeout": 30} if workers else {}
    loader = DataLoader(strings(), batch_size=None, num_workers=workers, **kwargs)
    iterator = iter(loader)
    next(iterator)
    dist.all_reduce(torch.zeros(1))
    found = listening_addresses()
    del iterator
    dist.barrier()
    return found


# -- stop_together's resources (test_guard.py) -----------------------------------------


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def fds_over_wrappers(rank, world_size, wrappers):
    """Open fds after the first and after the last of ``wrappers`` stop_together
    wrappers, each iterated for one short epoch."""
    counts = []
    for _ in range(wrappers):
        guarded = distshard.stop_together(list(range(3 + rank)), timeout=30)
        steps = sum(1 for _ in guarded)
        assert steps == 3 and guarded.unused_per_rank == list(range(world_size)), (steps, guarded.unused_per_rank)
        counts.append(_open_fds())
    return counts[0], counts[-1]


# -- even="carry": the epochs as one stream ----------------------------------------------------


def carry_shuffled():
    """23 strings an epoch, shuffle=True and a fixed seed: 4 slots leave a tail every epoch."""
    return IterableWrapper([f"s{i}" for i in range(23)]).dist_shard(even="carry", shuffle=True, seed=4)


def carry_under_the_loaders_seed():
    """29 strings an epoch, shuffle=True and seed=None: under a DataLoader the order
    of every epoch must not follow the loader's new seed (its tail is read next epoch)."""
    return IterableWrapper([f"t{i}" for i in range(29)]).dist_shard(even="carry", shuffle=True)
