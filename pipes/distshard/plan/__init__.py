"""Pure arithmetic of the partition: which slot owns which position, how many
elements each slot yields under every ``even`` mode, what ``"pad"`` repeats, and
the streaming selector that does all of this without knowing the stream length.

Nothing here imports torch; everything is property-tested in ``tests/test_plan.py``.
One module per concern, every name importable from here (``distshard.plan``):
``slots`` (the stride split, the counts, the streaming selector), ``splits`` (chunks,
blocks, leftover units), ``permutation``, ``remaining`` (what a run leaves), ``carry``.

Terms
-----
*position*
    The 0-based index of an element in the stream that reaches ``dist_shard``
    (never its value).
*slot*
    One of the ``num_slots = world_size * num_workers`` copies of the pipeline;
    ``slot = rank * num_workers + worker_id``.
*round*
    Positions ``[q * num_slots, (q + 1) * num_slots)``; slot ``s`` owns the
    position ``q * num_slots + s`` of every round.
"""

from __future__ import annotations

from ..digests import mix_seed  # the seeds, re-exported where they once were defined
from .carry import (
    carry_after,
    carry_consumed,
    carry_end,
    carry_left,
    carry_reads,
    carry_share,
    carry_summary,
    carry_window,
)
from .permutation import Permutation, UnitOrder, prefix_sums
from .remaining import MAX_BAND, LeftAfter, Remaining, left_after_blocks, left_after_chunks, left_after_round_robin
from .slots import (
    ALL_EVEN_MODES,
    CARRY,
    EVEN_MODES,
    Even,
    StreamTooShort,
    check_even,
    check_multiple,
    dropped_count,
    pad_position,
    padded_count,
    select_stream,
    slot_count,
    slot_of,
    slot_positions,
)
from .splits import (
    block_positions,
    block_range,
    block_runs,
    chunk_positions,
    chunk_runs,
    chunk_slot,
    leftover_share,
    select_chunks,
    stride_runs,
)

__all__ = [
    "mix_seed",
    "prefix_sums",
    "Even",
    "EVEN_MODES",
    "CARRY",
    "ALL_EVEN_MODES",
    "check_even",
    "check_multiple",
    "slot_of",
    "slot_count",
    "dropped_count",
    "pad_position",
    "padded_count",
    "slot_positions",
    "StreamTooShort",
    "select_stream",
    "chunk_slot",
    "chunk_runs",
    "chunk_positions",
    "select_chunks",
    "block_range",
    "block_positions",
    "leftover_share",
    "stride_runs",
    "block_runs",
    "Permutation",
    "UnitOrder",
    "Remaining",
    "MAX_BAND",
    "left_after_round_robin",
    "left_after_blocks",
    "left_after_chunks",
    "LeftAfter",
    "carry_consumed",
    "carry_end",
    "carry_window",
    "carry_share",
    "carry_after",
    "carry_reads",
    "carry_left",
    "carry_summary",
]
