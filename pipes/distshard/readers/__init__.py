"""Ways of reading the positions of a stream, one small module each, behind the
interface in :mod:`.base`. The DataPipe (``dist_shard``) and the ``torchdata.nodes``
front-end (``DistShardNode``) build one of these and hand it to
:mod:`distshard.engine`, which runs the plan; neither knows how a source is read.

* :class:`SequenceReader` (``sequence.py``): random access by index (lists, tensors,
  ``distshard.positional``, file sources with an index).
* :class:`StreamReader` (``stream.py``): anything iterable, walked once per slot and
  skipped in C.
* :class:`WholeUnitsReader`, :class:`SizedUnitsReader` (``units.py``): units (files,
  shards) expanded into elements, without or with per-unit counts;
  :class:`WholeFilesReader`: units that can only be streamed whole (compressed files).
"""

from .base import RandomAccessReader, Reader, stable_digest
from .sequence import SequenceReader
from .stream import StreamReader
from .units import SizedUnitsReader, WholeFilesReader, WholeUnitsReader, check_sizes, unit_sizes

__all__ = [
    "RandomAccessReader",
    "Reader",
    "SequenceReader",
    "SizedUnitsReader",
    "WholeFilesReader",
    "StreamReader",
    "WholeUnitsReader",
    "check_sizes",
    "stable_digest",
    "unit_sizes",
]
