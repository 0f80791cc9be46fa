"""What torch's DataLoader did to one copy of a ``dist_shard`` DataPipe.

The DataLoader drives a DataPipe through hooks (``apply_sharding``, ``set_seed``) and
through the copies of it that its workers hold. A :class:`LoaderTrack` keeps what
those hooks and copies left behind: the split given by hand, the shared seed and
whether every rank has the same one, the workers of the loader iterating, a
framework that would lose data, and how ``set_epoch`` and loaded states reach the
workers' copies (the :class:`~distshard.mailbox.Mailbox`). It decides what a copy
running in a worker takes from the loader's process at the start of an iteration (the epoch
set there), and what it must refuse.
The ``torchdata.nodes`` front-end has no such loader and keeps none.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

from torch.utils.data import get_worker_info
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES

from . import frameworks, loaders
from .errors import OptionError, OptionTypeError, ResumeOrderError, SetupError
from .mailbox import Mailbox

__all__ = ["LoaderTrack"]


class LoaderTrack:
    """What the DataLoader did to one pipe (see the module doc)."""

    def __init__(self) -> None:
        self.mailbox = Mailbox()  # how set_epoch reaches persistent DataLoader workers' copies
        self.started_in: int | None = None  # pid of a worker that iterated a copy set_epoch cannot reach
        self.resumed_here: int | None = None  # the epoch of a state loaded in this worker's copy
        self.seed: int | None = None  # the seed the DataLoader shares with its workers
        self.seed_shared = False  # ... the same on every rank
        self.workers: int | None = None  # workers of the last DataLoader iterating the pipe
        self.sharding: dict[SHARDING_PRIORITIES, tuple[int, int]] = {}  # apply_sharding overrides
        self.refusal: str | None = None  # why the loader iterating the pipe would lose data
        self.position_unknown = False  # a worker iterates a resumed epoch again without the run that
        # resumed it: its state_dict() cannot say where the epoch stands (check_position_known)

    def sharded(
        self, num_of_instances: int, instance_id: int, group: SHARDING_PRIORITIES, captured: tuple[int, int] | None
    ) -> None:
        """Keep a split given by ``apply_sharding``, unless it is the DataLoader's own
        call (which ``dist_shard`` resolves by itself). ``TypeError`` / ``ValueError``
        for a split that is not one."""
        for name, value in (("num_of_instances", num_of_instances), ("instance_id", instance_id)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise OptionTypeError(f"{name}={value!r} must be an int")
        if num_of_instances < 1 or not 0 <= instance_id < num_of_instances:
            raise OptionError(f"instance_id={instance_id} must be in [0, num_of_instances={num_of_instances})")
        if group == SHARDING_PRIORITIES.DEFAULT and (num_of_instances, instance_id) == loaders.torch_split(captured):
            return
        self.sharding[group] = (num_of_instances, instance_id)

    def seeded(self, seed: int, shared: bool) -> None:
        """The DataLoader's ``set_seed``: its seed, whether every rank has it, its
        workers, and whether a framework around it would lose data."""
        self.seed, self.seed_shared = int(seed), shared
        loader_iter = loaders.iterating_loader()
        if loader_iter is not None:
            self.workers = max(1, int(loader_iter._num_workers))
        if "numpy" in sys.modules and "numpy.random" not in sys.modules and loaders.forking_loader():
            # every new worker seeds numpy.random, importing it (about 10 ms of CPU a
            # worker, every epoch) unless the process it forks from already has it
            import numpy.random  # noqa: F401
        self.refusal = frameworks.refusal_for_loader()

    def shared_seed(self, world_size: Callable[[], int]) -> int | None:
        """The DataLoader's seed if it may serve as the base: the same on every rank."""
        if self.seed is not None and (self.seed_shared or world_size() == 1):
            return self.seed
        return None

    def epoch_set(self, epoch: int) -> None:
        """``set_epoch`` was called: post it to the workers, or, in a worker, this copy knows it."""
        if get_worker_info() is None:
            self.mailbox.post_epoch(epoch)
        else:
            self.started_in = self.resumed_here = None
            self.position_unknown = False

    def state_loaded(self, epoch: int) -> None:
        """A state of ``epoch`` was loaded into this copy."""
        if get_worker_info() is None:
            self.mailbox.post_load()  # persistent workers started before cannot take it: they refuse
        elif not self.mailbox.own:  # a worker: StatefulDataLoader resumes it here
            self.resumed_here = epoch
            self.mailbox.post_resumed(epoch)  # workers started after this one do not have it

    def check_position_known(self, epoch: int, known: bool) -> None:
        """``state_dict``: refuse to report a position in ``epoch`` that this copy does
        not ``known`` (neither a loaded state waiting nor a run of the epoch) while its
        iteration runs again an epoch a worker resumed (see :meth:`take_loader_epoch`)."""
        if self.position_unknown and not known:
            raise ResumeOrderError(
                f"a state of epoch {epoch} was loaded into this DataLoader's workers, and this worker's "
                f"iteration of epoch {epoch} started after the one that resumed it, in a new worker "
                "(StatefulDataLoader starts one by itself after loading a state saved at the end of an epoch, "
                "unless persistent_workers=True) that does not have the state: it cannot say where the epoch "
                "stands: call set_epoch() with the next epoch before iterating the loader"
            )

    def iteration_started(self) -> None:
        """An iteration starts: remember a worker that iterates a copy nobody can reach."""
        if self.mailbox.by_pickle and self.mailbox.own and get_worker_info() is not None:
            self.started_in = os.getpid()

    def take_loader_epoch(
        self, epoch: Callable[[], int], apply_epoch: Callable[[int], None], pending: Callable[[], bool], refuse: bool
    ) -> bool:
        """When an iterator starts in a DataLoader worker: take the epoch that
        ``set_epoch`` set in the loader's process since this copy last looked (a
        persistent worker keeps its copy across epochs); ``refuse``: raise, at the
        first element, for an epoch this copy cannot get right. ``epoch`` and
        ``pending`` read the pipe's epoch and whether a loaded state waits for it.
        Returns whether the iteration runs again an epoch whose loaded state a run
        here (or in another worker) resumed, which its first element refuses."""
        info = get_worker_info()
        if info is None:
            return False
        box = self.mailbox
        if box.own:  # built here, or arrived by an ordinary pickle: nobody else posts to it
            if refuse and box.by_pickle and self.started_in == os.getpid():
                raise SetupError(
                    f"this dist_shard reached DataLoader worker {info.id} by an ordinary pickle, not with "
                    "the worker's start, so set_epoch in the loader's process cannot reach it, and this "
                    f"persistent worker would run epoch {epoch()} again: give the DataLoader the "
                    "pipeline itself (fork, spawn and forkserver workers hear set_epoch), or call "
                    "set_epoch in the worker before each epoch"
                )
            return False
        news = box.news()
        if news.loads and refuse:
            raise ResumeOrderError(
                f"load_state_dict was called on this pipeline in the DataLoader's process after its "
                f"persistent workers started (DataLoader worker {info.id} has its own copy, which the "
                "state cannot reach), so this worker would not resume it. Load the state before the "
                "DataLoader starts its workers, give the loader's own state to "
                "StatefulDataLoader.load_state_dict(), or create a new DataLoader"
            )
        if news.epoch is not None:
            apply_epoch(news.epoch)
            self.resumed_here = None
        now = epoch()
        again = not pending() and now in (news.resumed, self.resumed_here)
        if refuse and again:
            raise ResumeOrderError(
                f"a state of epoch {now} was loaded into this DataLoader's workers, and a new "
                f"iteration of epoch {now} started after the one that resumed it (StatefulDataLoader "
                "starts one by itself after loading a state saved at the end of an epoch); it would run "
                f"epoch {now} again: call set_epoch() with the next epoch before iterating the loader"
            )
        return again
