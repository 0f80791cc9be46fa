"""The pipes above a DataPipe ``dist_shard``: their identity, and how their randomness
is seeded so that every slot sees the same stream.

:class:`Upstream` keeps what one walk of the graph found (a walk pickles every pipe's
data, so it is made once, at construction): the identity of the chain (pickled with
the pipe, so DataLoader workers need not walk again) and the random pipes (per
process: valid in fork workers, found again in spawned ones). It never holds the
source itself: the DataPipe drops its source from the graph walks of torch's that
need none of it (``DistShardIterDataPipe.__getstate__``), and so must this.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from torch.utils.data.datapipes.datapipe import IterDataPipe
from torch.utils.data.datapipes.iter.utils import IterableWrapperIterDataPipe

from .access import EpochReader
from .digests import mix_seed
from .graph import random_pipes
from .protocol import own_identity
from .readers import RandomAccessReader, Reader, stable_digest

__all__ = ["Upstream", "chain_identity"]


def chain_identity(pipes: Iterable[Any]) -> str:
    """A process-independent identity of an upstream graph (``pipes``, walked): the
    pipes' types, a mix's or weighted sample's own identity (seeds, weights), and for
    ``IterableWrapper``s what they wrap (see ``readers.base``)."""
    parts = []
    for pipe in pipes:
        part = type(pipe).__qualname__
        own = own_identity(pipe)
        if own is not None:
            part += f"({own})"
        elif isinstance(pipe, IterableWrapperIterDataPipe):
            data: Any = pipe.iterable
            size = len(data) if hasattr(data, "__len__") else None
            sample = (data[0], data[-1]) if type(data) in (list, tuple, range) and data else ()
            part += f"({type(data).__qualname__}:{size}:{stable_digest(*sample)})"
        parts.append(part)
    return ">".join(parts)


class Upstream:
    """The identity of a shard's upstream graph and its random pipes, seeded from
    ``(base, epoch)`` and the identity (see the module doc)."""

    def __init__(self, source: IterDataPipe, walked: list[Any]) -> None:
        self.identity = chain_identity(walked)
        self.randoms: list | None = random_pipes(source, walked)  # per process, never pickled

    def random_pipes(self, source: IterDataPipe) -> list:
        """The upstream pipes with ``set_seed``, found again in a process that got the
        shard by pickle."""
        if self.randoms is None:
            self.randoms = random_pipes(source)
        return self.randoms

    def seed(self, source: IterDataPipe, base: int, epoch: int) -> None:
        """Seed the random pipes above ``source`` for ``epoch``."""
        salt = int(stable_digest(self.identity), 16)
        for index, pipe in enumerate(self.random_pipes(source)):
            pipe.set_seed(mix_seed(base, epoch, index, salt))

    def epoch_readers(
        self, source: IterDataPipe, base: int, running: int, reader: Callable[[], Reader]
    ) -> Callable[[int], RandomAccessReader]:
        """``even="carry"``: the reader of another epoch's stream, built and read with
        the upstream seeded for that epoch, then seeded back for the ``running`` epoch
        (a view may take its seeds when it is made, or at every access: a mix seeds its
        sources' passes lazily). The running epoch is fixed when the iteration starts:
        a ``set_epoch`` during it takes effect at the next iteration only."""
        made: dict[int, RandomAccessReader] = {}

        def reader_for(epoch: int) -> RandomAccessReader:
            if epoch not in made:
                self.seed(source, base, epoch)
                try:
                    made[epoch] = EpochReader(
                        reader(), lambda: self.seed(source, base, epoch), lambda: self.seed(source, base, running)
                    )
                finally:
                    self.seed(source, base, running)
            return made[epoch]

        return reader_for

    def __getstate__(self) -> dict[str, Any]:
        return {"identity": self.identity, "randoms": None}
