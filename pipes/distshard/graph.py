"""Walking the DataPipe graph upstream of ``dist_shard``.

torch discovers a pipeline's graph by pickling it with hooks
(``torch.utils.data.graph.traverse_dps``); we use the same walk so that we see
exactly what torch's DataLoader sees when it applies sharding and seeds.
"""

from __future__ import annotations

from torch.utils.data.datapipes.datapipe import IterDataPipe
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
