"""distshard: rank- and worker-aware sharding for PyTorch ``IterDataPipe`` pipelines.

Importing it registers ``.dist_shard()`` on every ``IterDataPipe``::

    import distshard
    from torch.utils.data.datapipes.iter import IterableWrapper

    dp = IterableWrapper(records).shuffle().dist_shard(even="drop").map(decode).batch(32)
"""

from .context import ShardContext, current_context
from .datapipe import DistShardIterDataPipe
from .verify import VerifyReport, verify

__all__ = [
    "DistShardIterDataPipe",
    "ShardContext",
    "VerifyReport",
    "current_context",
    "verify",
]

__version__ = "0.1.0"
