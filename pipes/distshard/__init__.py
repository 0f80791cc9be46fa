"""distshard: rank- and worker-aware sharding for PyTorch ``IterDataPipe`` pipelines.

Importing it registers ``.dist_shard()`` on every ``IterDataPipe``::

    import distshard
    from torch.utils.data.datapipes.iter import IterableWrapper

    dp = IterableWrapper(records).shuffle().dist_shard(even="drop").map(decode).batch(32)
"""

import logging
import sys
from typing import TYPE_CHECKING, Any

if __name__ == "distshard" and sys.argv[:2] == ["-m", "index"]:  # `python -m distshard index ...`:
    from .__main__ import index_command_alone  # the command needs no torch, whose import takes seconds

    _status = index_command_alone()
    if _status is not None:
        sys.exit(_status)

from .checkpoint import LoaderCheckpoint
from .collate import packed_collate
from .context import ShardContext, UnknownRankError, current_context
from .datapipe import DistShardIterDataPipe, set_epoch
from .errors import (
    DistshardError,
    OptionError,
    OptionTypeError,
    ResumeOrderError,
    SetupError,
    SourceChangedError,
    SourceDataError,
    SourceMissingError,
    StateMismatchError,
    UnsupportedError,
)
from .explaining import Explanation, explain
from .graph import positional
from .guard import stop_together
from .merging import merge_states
from .mix import mix
from .pack import pack
from .sample import weighted_sample
from .sources import ReadOptions, RemoteReadError, jsonl, parquet, tokens, webdataset
from .stateful import StatefulPipeline, gather_states
from .verify import VerifyReport, verify
from .waits import WaitTimeout

__all__ = [
    "DistShardIterDataPipe",
    "DistShardNode",
    "DistshardError",
    "Explanation",
    "LoaderCheckpoint",
    "OptionError",
    "OptionTypeError",
    "ResumeOrderError",
    "SetupError",
    "SourceChangedError",
    "SourceDataError",
    "SourceMissingError",
    "StateMismatchError",
    "UnsupportedError",
    "WaitTimeout",
    "ReadOptions",
    "RemoteReadError",
    "ShardContext",
    "StatefulPipeline",
    "UnknownRankError",
    "VerifyReport",
    "current_context",
    "explain",
    "jsonl",
    "parquet",
    "tokens",
    "webdataset",
    "gather_states",
    "merge_states",
    "mix",
    "pack",
    "packed_collate",
    "positional",
    "set_epoch",
    "stop_together",
    "verify",
    "weighted_sample",
]

__version__ = "0.1.0"

# retries, index builds, slow first requests: silent unless the application configures logging
logging.getLogger("distshard").addHandler(logging.NullHandler())

if TYPE_CHECKING:  # type checkers see the class; at run time it is imported on first use
    from .nodes import DistShardNode


def __getattr__(name: str) -> Any:
    # torchdata.nodes is imported only by those who use it
    if name == "DistShardNode":
        from .nodes import DistShardNode

        return DistShardNode
    raise AttributeError(f"module 'distshard' has no attribute {name!r}")
