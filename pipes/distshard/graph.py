"""Walking the DataPipe graph upstream of ``dist_shard``: sharding pipes that
would shard twice, random pipes to seed, and the pushdown of selection below
1:1 maps down to a random-access source.

torch discovers a pipeline's graph by pickling it with hooks
(``torch.utils.data.graph.traverse_dps``); we use the same walk so that we see
exactly what torch's DataLoader sees when it applies sharding and seeds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data.datapipes.datapipe import IterDataPipe
from torch.utils.data.datapipes.iter.callable import MapperIterDataPipe
from torch.utils.data.datapipes.iter.utils import IterableWrapperIterDataPipe
from torch.utils.data.graph import DataPipe, traverse_dps
from torch.utils.data.graph_settings import (
    _is_random_datapipe,
    _is_sharding_datapipe,
    get_all_graph_pipes,
)


def upstream_pipes(source: IterDataPipe) -> list[DataPipe]:
    """Every pipe ``source`` reads from, ``source`` included, each once, in a
    deterministic order (the order of torch's own traversal)."""
    return get_all_graph_pipes(traverse_dps(source))


def check_no_sharding(source: IterDataPipe) -> None:
    """Raise ``RuntimeError`` if a sharding pipe sits upstream of a new ``dist_shard``.

    Sharding twice keeps ``1 / S²`` of the data: a ``sharding_filter`` or another
    ``dist_shard`` upstream is always a mistake.
    """
    for pipe in upstream_pipes(source):
        if _is_sharding_datapipe(pipe):
            raise RuntimeError(
                f"dist_shard() was applied downstream of {type(pipe).__name__}, which "
                "already shards the stream; sharding twice loses data. Remove the "
                f"{type(pipe).__name__} (dist_shard splits over ranks and DataLoader "
                "workers by itself) or this dist_shard."
            )


def random_pipes(source: IterDataPipe) -> list[DataPipe]:
    """The upstream pipes with a ``set_seed`` method (e.g. ``shuffle()``), in
    traversal order; every copy of the pipeline finds them in the same order."""
    return [pipe for pipe in upstream_pipes(source) if _is_random_datapipe(pipe)]


@dataclass
class Pushdown:
    """How a slot reads the stream that reaches ``dist_shard``.

    ``base`` is the pipe whose positions are counted: the source itself, or,
    with pushdown, the first pipe upstream that is not a 1:1 ``map``. ``maps``
    are the 1:1 maps between ``base`` and ``dist_shard`` (upstream first); a slot
    applies them to its own elements only, which gives the same elements in the
    same order as running them on every element. ``sequence`` is set when
    ``base`` wraps something with random access (``__len__`` + ``__getitem__``),
    so a slot can index its positions instead of walking the stream.
    """

    base: IterDataPipe
    maps: list[MapperIterDataPipe] = field(default_factory=list)
    sequence: Any = None
    copy_elements: bool = False

    def apply(self, element: Any) -> Any:
        for mapper in self.maps:
            element = mapper._apply_fn(element)
        return element


def random_access(pipe: IterDataPipe) -> tuple[Any, bool]:
    """``(sequence, deepcopy)`` if ``pipe`` is an ``IterableWrapper`` over an object
    with ``__len__`` and ``__getitem__`` (list, tuple, range, a ``MapDataPipe``, a
    tensor, ...) that is not a mapping; else ``(None, False)``."""
    if type(pipe) is not IterableWrapperIterDataPipe:
        return None, False
    iterable = pipe.iterable
    if isinstance(iterable, (Mapping, str, bytes)) or not (
        hasattr(iterable, "__len__") and hasattr(iterable, "__getitem__")
    ):
        return None, False
    return iterable, bool(pipe.deepcopy)


def plan_pushdown(source: IterDataPipe, enabled: bool) -> Pushdown:
    """Find the base, the 1:1 maps above it and random access, for ``source``.

    Only ``map`` (``MapperIterDataPipe`` and its subclasses such as ``collate``)
    is crossed: ``filter``, ``batch``, ``shuffle``, flat-maps and anything else
    may change how many elements there are or their order, so selection never
    moves past them. ``enabled=False`` crosses nothing (maps with side effects).
    """
    maps: list[MapperIterDataPipe] = []
    base = source
    if enabled:
        while isinstance(base, MapperIterDataPipe):
            maps.append(base)
            base = base.datapipe
    sequence, copy_elements = random_access(base)
    return Pushdown(base, maps[::-1], sequence, copy_elements)
