"""``distshard.packed_collate``: a batch of packed blocks with the metadata that
variable-length attention takes (FlashAttention's varlen kernels, HF's packed
sequences, FlexAttention's document masks)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .errors import OptionError, OptionTypeError

__all__ = ["packed_collate"]

_FIELDS = ("input_ids", "position_ids", "loss_mask", "segment_ids")


def _stacked(batch: Sequence[Mapping[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if isinstance(batch, Mapping):
        out = {name: torch.as_tensor(batch[name]) for name in batch}
    elif isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        if not batch:
            raise OptionError("packed_collate() got no blocks: give a list of blocks from distshard.pack")
        out = {name: torch.stack([torch.as_tensor(block[name]) for block in batch]) for name in batch[0]}
    else:
        raise OptionTypeError(
            f"packed_collate() takes a list of blocks (dicts of 1-D tensors) or a dict of stacked 2-D tensors, "
            f"got {type(batch).__name__}"
        )
    missing = [name for name in _FIELDS if name not in out]
    if missing:
        raise OptionError(
            f"packed_collate() needs the blocks of distshard.pack (fields {list(_FIELDS)}); missing {missing}"
        )
    shape = out["segment_ids"].shape
    if len(shape) != 2 or any(out[name].shape != shape for name in _FIELDS):
        raise OptionError(
            f"packed_collate() needs blocks of one length: {[tuple(out[name].shape) for name in _FIELDS]}"
        )
    return out


def packed_collate(
    batch: Sequence[Mapping[str, torch.Tensor]] | Mapping[str, torch.Tensor],
) -> dict[str, Any]:
    r"""Stack blocks of :func:`distshard.pack` into a batch with the metadata of
    variable-length attention over its sequences.

    Every segment of every block (a document, a piece of one, or the block's
    padding) is one sequence of the batch flattened to ``B * L`` tokens (the THD
    layout), in order. Padding is a sequence of its own (its ``loss_mask`` is 0), so
    ``cu_seqlens[-1] == B * L`` and ``input_ids.view(-1)`` needs no gather.

    Use it as a DataLoader's ``collate_fn`` (it takes a list of blocks) or on a batch
    the default collate stacked (a dict of ``(B, L)`` tensors).

    Returns:
        a dict with the blocks' ``input_ids``, ``position_ids``, ``loss_mask`` and
        ``segment_ids`` stacked to ``(B, L)``, and

        * ``cu_seqlens``: int32 of ``S + 1`` offsets, the start of each of the ``S``
          sequences in the flattened batch and then ``B * L`` (FlashAttention's
          ``cu_seqlens_q`` / ``cu_seqlens_k``);
        * ``max_seqlen``: the longest sequence, an ``int`` (``max_seqlen_q`` / ``_k``);
        * ``flat_position_ids``: int64 of ``(1, B * L)``, each token's index in its
          sequence, 0 at every start in ``cu_seqlens``: what HF's packed-sequence
          attention takes (``model(input_ids=ids.view(1, -1),
          position_ids=flat_position_ids)``; HF finds the sequences where it is 0,
          the same ones). A piece of a document that an earlier block holds the start
          of restarts at 0 here, while its block's ``position_ids`` go on counting.

    Example:
        >>> blocks = distshard.pack(IterableWrapper([[1, 2, 3], [4, 5], [6]]), 4, fit="best")
        >>> batch = distshard.packed_collate(list(blocks))
        >>> batch["cu_seqlens"].tolist(), batch["max_seqlen"]
        ([0, 3, 4, 6, 8], 3)
    """
    stacked = _stacked(batch)
    out: dict[str, Any] = dict(stacked)
    segments = stacked["segment_ids"]
    rows, length = segments.shape
    flat = segments.reshape(-1)
    starts = torch.ones(flat.numel(), dtype=torch.bool)
    if flat.numel():
        starts[1:] = flat[1:] != flat[:-1]
        starts[::length] = True  # every block starts a sequence
    first = torch.nonzero(starts).reshape(-1)
    cu_seqlens = torch.cat([first, torch.tensor([flat.numel()])]).to(torch.int32)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.long)
    out["cu_seqlens"] = cu_seqlens
    out["max_seqlen"] = int(lengths.max()) if lengths.numel() else 0
    at = torch.arange(flat.numel(), dtype=torch.long)
    out["flat_position_ids"] = (at - torch.repeat_interleave(first, lengths)).reshape(1, rows * length)
    return out
