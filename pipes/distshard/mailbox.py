"""The epoch mailbox: how ``set_epoch`` in the process that runs a DataLoader reaches
the copies of a pipe that its worker processes hold.

torch's DataLoader hands every worker a copy of the dataset once, when it starts
the workers. With ``persistent_workers=True`` those copies live across epochs, and
nothing torch sends at an epoch start says which epoch it is: a DataPipe gets a
random shared seed (``set_seed``), an ``IterableDataset`` (``StatefulPipeline``)
only a new ``iter()``. So every ``dist_shard`` pipe carries a :class:`Mailbox`, a
cell of five integers in shared memory: ``set_epoch`` in the loader's process
writes the epoch there, and a worker's copy reads it when a new iterator starts
(never in the middle of one: an iteration keeps the epoch it started with).
Nothing is allocated per epoch: a cell is a slot of a small shared file mapped once
per process (one descriptor per process, whatever the number of pipes).

Rules, so that exactly the right copies hear each other:

* Only DataLoader workers read a mailbox; any other process applies ``set_epoch``
  to its own copy directly. A worker writes only the ``resumed`` note below.
* A cell is written only by the process that created it. A copy that reaches a
  process by fork, or by the pickling that starts a process (spawn, forkserver),
  keeps its sender's cell, so a worker hears the process that started it. Before
  that process writes, forks, or sends the copy to workers of its own, the copy
  gets a cell of this process: ranks forked from one notebook never hear each
  other, and their workers hear their own rank.
* A copy made by an ordinary pickle (``copy.deepcopy``, ``pickle.dumps`` outside
  of starting a process) is another pipe: it gets a cell of its own.

Two more things a worker must know, and cannot be told otherwise:

* ``loads``: states loaded into the loader's copy after the workers started (a
  state has no fixed size, so it cannot reach them): such a worker refuses to start
  an iteration it would get wrong.
* ``resumed``: the one note a worker writes, into its sender's cell: a state of
  epoch ``e`` was loaded into it (StatefulDataLoader loads states in its workers).
  Workers started later for epoch ``e`` do not have that state, and would run epoch
  ``e`` from its start again (StatefulDataLoader starts such workers by itself after
  loading a state saved at the end of an epoch): they refuse. ``set_epoch`` in the
  loader's process reads the note away.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import weakref
from dataclasses import dataclass
from multiprocessing.context import get_spawning_popen
from typing import Any

from torch.utils.data import get_worker_info

from .forks import at_fork

__all__ = ["EPOCH_LIMIT", "Mailbox", "News"]

EPOCH_LIMIT = 2**63  # epochs are kept in a signed 64-bit integer
_GENERATION, _EPOCH, _LOADS, _RESUMED, _RESUMED_EPOCH = range(5)
_CELL = 5  # integers per cell
_ARENA_BYTES = mmap.PAGESIZE * 4


class _Arena:
    """A shared file of cells, mapped in this process. Created by ``owner``, which
    alone allocates and frees its cells; other processes map it by descriptor."""

    def __init__(self, fd: int | None = None, owner: int | None = None) -> None:
        if fd is None:
            where = "/dev/shm" if os.path.isdir("/dev/shm") else None
            fd, name = tempfile.mkstemp(prefix="distshard-epochs-", dir=where)
            os.unlink(name)  # nothing to clean up, whatever happens to the process
            os.ftruncate(fd, _ARENA_BYTES)
        self.fd, self.owner = fd, os.getpid() if owner is None else owner
        self.map = mmap.mmap(fd, _ARENA_BYTES)  # MAP_SHARED: forked children share it too
        self.ints = memoryview(self.map).cast("q")
        self.free = list(range(len(self.ints) // _CELL - 1, -1, -1))
        self.sent: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()

    def handle_for(self, popen: Any) -> Any:
        """The descriptor, as the process being started receives it (once per process)."""
        if popen not in self.sent:
            self.sent[popen] = popen.DupFd(popen.duplicate_for_child(self.fd))
        return self.sent[popen]


_arenas: list[_Arena] = []  # this process's own arenas (a forked child starts without: _forget_arenas)
_mapped: dict[tuple[int, int], _Arena] = {}  # (owner, fd) -> arena received from a sender


def _allocate(seen: tuple[int, int, int]) -> tuple[_Arena, int]:
    arena = next((a for a in _arenas if a.free), None)
    if arena is None:
        arena = _Arena()
        _arenas.append(arena)
    slot = arena.free.pop() * _CELL
    ints = arena.ints
    ints[slot + _GENERATION], ints[slot + _LOADS], ints[slot + _RESUMED] = seen
    ints[slot + _EPOCH] = ints[slot + _RESUMED_EPOCH] = 0
    return arena, slot


def _release(arena: _Arena, slot: int) -> None:
    if arena.owner == os.getpid():
        arena.free.append(slot // _CELL)


@dataclass(frozen=True)
class News:
    """What the loader's process posted since a copy last looked."""

    epoch: int | None  # the epoch set_epoch posted, if it posted since
    loads: int  # states loaded into the loader's copy since
    resumed: int | None  # the epoch of a state another worker loaded, if the note is unread


class Mailbox:
    """One pipe copy's view of its shared cell ``[generation, epoch, loads, resumed,
    resumed epoch]``."""

    def __init__(self, seen: tuple[int, int, int] = (0, 0, 0), by_pickle: bool = False) -> None:
        self.seen = seen  # (generation, loads, resumed) this copy has taken into account
        self.by_pickle = by_pickle  # arrived by an ordinary pickle, not with a process start
        self._arena: _Arena | None = None
        self._slot = 0
        self._home()
        _live.add(self)

    def _home(self) -> None:
        """Give this copy a cell of the current process, unless it has one."""
        if self._arena is not None and self._arena.owner == os.getpid():
            return
        self._arena, self._slot = _allocate(self.seen)
        weakref.finalize(self, _release, self._arena, self._slot)

    @property
    def own(self) -> bool:
        """The cell was created by this process: nobody else writes it."""
        return self._arena is not None and self._arena.owner == os.getpid()

    # -- the loader's process (never a DataLoader worker) ------------------------------
    def post_epoch(self, epoch: int) -> None:
        self._home()
        ints, slot = self._arena.ints, self._slot  # type: ignore[union-attr]
        ints[slot + _EPOCH] = epoch  # before the generation: who sees the one sees the other
        ints[slot + _GENERATION] += 1
        self.seen = (ints[slot + _GENERATION], self.seen[1], ints[slot + _RESUMED])  # the note is read

    def post_load(self) -> None:
        self._home()
        ints, slot = self._arena.ints, self._slot  # type: ignore[union-attr]
        ints[slot + _LOADS] += 1
        self.seen = (self.seen[0], ints[slot + _LOADS], self.seen[2])

    # -- a worker ------------------------------------------------------------------
    def post_resumed(self, epoch: int) -> None:
        """Note, in the sender's cell, that a state of ``epoch`` was loaded into this
        worker (several workers may write at once: they write the same epoch, and the
        count changes whichever increment lands)."""
        ints, slot = self._arena.ints, self._slot  # type: ignore[union-attr]
        ints[slot + _RESUMED_EPOCH] = epoch
        ints[slot + _RESUMED] += 1
        self.seen = (self.seen[0], self.seen[1], ints[slot + _RESUMED])  # its own note: not news to it

    def news(self) -> News:
        """What was posted since this copy last looked; marks the epoch as seen (not
        the rest: a refused iteration is refused again next time)."""
        ints, slot = self._arena.ints, self._slot  # type: ignore[union-attr]
        while True:
            generation, epoch, loads = ints[slot + _GENERATION], ints[slot + _EPOCH], ints[slot + _LOADS]
            resumed, resumed_epoch = ints[slot + _RESUMED], ints[slot + _RESUMED_EPOCH]
            if ints[slot + _GENERATION] == generation and ints[slot + _RESUMED] == resumed:
                break
        if generation != self.seen[0]:  # a new epoch from the loader's process: the note is older
            self.seen = (generation, self.seen[1], resumed)
            return News(epoch, loads - self.seen[1], None)
        return News(None, loads - self.seen[1], resumed_epoch if resumed != self.seen[2] else None)

    # -- pickling ------------------------------------------------------------------
    def __reduce__(self) -> tuple:
        popen = get_spawning_popen()
        if popen is None:  # an ordinary pickle: another pipe, with a cell of its own
            return Mailbox, (self.seen, True)
        if get_worker_info() is None:
            self._home()
        arena = self._arena
        assert arena is not None
        return _attached, (arena.handle_for(popen), arena.owner, self._slot, self.seen)

    def __deepcopy__(self, memo: dict) -> "Mailbox":
        return Mailbox(self.seen, True)


def _attached(handle: Any, owner: int, slot: int, seen: tuple[int, int, int]) -> Mailbox:
    """A copy in a process being started (spawn, forkserver): its sender's cell."""
    fd = handle.detach()
    arena = _mapped.get((owner, fd))
    if arena is None:
        arena = _mapped[(owner, fd)] = _Arena(fd, owner)
    box = Mailbox.__new__(Mailbox)
    box.seen, box.by_pickle, box._arena, box._slot = seen, False, arena, slot
    _live.add(box)
    return box


_live: "weakref.WeakSet[Mailbox]" = weakref.WeakSet()


def _before_fork() -> None:
    """A forked child (a DataLoader worker) shares its parent's cells: first make
    every copy here use a cell of this process (see the module docstring)."""
    if get_worker_info() is not None:  # a worker keeps hearing its own parent
        return
    pid = os.getpid()
    for box in list(_live):
        if box._arena is not None and box._arena.owner != pid:
            box._home()


def _forget_arenas() -> None:
    """In a forked child: the parent's arenas are the parent's."""
    global _arenas
    _arenas = []


at_fork(_forget_arenas, before=_before_fork)
