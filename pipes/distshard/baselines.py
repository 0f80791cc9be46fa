"""What users run today, kept here to compare against (demo, benchmarks, notebook).

``ClassicModuloIterDataPipe`` is the widely copied ``DistributedIterableDataset``
recipe: a slot keeps an element when ``(value + shift) % num_slots == 0``, where
``value`` is the element itself. It is *not* registered as a functional.
"""

from __future__ import annotations

from typing import Iterator, TypeVar

from torch.utils.data import get_worker_info
from torch.utils.data.datapipes.datapipe import IterDataPipe

from .context import resolve_distributed

T = TypeVar("T")


class ClassicModuloIterDataPipe(IterDataPipe[T]):
    """The classic per-value modulo recipe (for comparison only: it is wrong on
    anything but consecutive integers, and every slot reads the whole stream)."""

    def __init__(self, source_datapipe: IterDataPipe[T]) -> None:
        super().__init__()
        self.source_datapipe = source_datapipe

    def __iter__(self) -> Iterator[T]:
        rank, world_size, _ = resolve_distributed()
        info = get_worker_info()
        num_workers = info.num_workers if info is not None else 1
        worker_id = info.id if info is not None else 0
        num_slots = world_size * num_workers
        shift = rank * num_workers + worker_id
        for value in self.source_datapipe:
            if (value + shift) % num_slots == 0:  # type: ignore[operator]
                yield value
