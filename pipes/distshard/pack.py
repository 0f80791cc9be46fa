"""``distshard.pack``: documents of token ids packed into blocks of ``seq_len`` tokens,
as a positional source that is the same at any world size.

With ``fit="concat"`` (the default) block ``b`` is tokens ``[b*L, (b+1)*L)`` of the
concatenation of the documents (each followed by ``eos`` when given); with
``fit="best"`` whole documents are placed into blocks by a best-fit decreasing over
windows of documents (see :class:`distshard.packing.BestPacking`). Every block carries
``segment_ids`` (1.. per document in the block, 0 on padding, Grain's convention).
The documents' token counts come from one pass at
construction (or from the source itself: a source with ``distshard_token_counts()``
gives them without reading a document, as ``distshard.tokens`` does from its
``.idx``), cached on disk for distshard file sources, keyed by the files' identities
(see :mod:`distshard.sources.formats.index_cache`) and what the maps and the token picker compute
(:mod:`distshard.callkeys`; counts a block finds wrong delete their entry), so the plan
(see :mod:`distshard.packing`) is known before the first block. A block reads only the
documents it spans: by position when the source has random access (a list, a file
source, below 1:1 maps), else by walking the stream up to them; consecutive blocks of
one window of ``fit="best"`` ask for their documents together, in ascending order.

``.dist_shard()`` after ``pack`` reads it like any random-access source
(``__distshard_sequence__``): every block once per epoch, ``even``, ``multiple_of``,
``shuffle=True`` (a permutation of the blocks), resume and elastic resume by block
position; ``distshard.mix`` mixes packed sources block by block.
"""

from __future__ import annotations

import logging
import numbers
from collections import deque
from itertools import islice
from typing import Any, Iterable, Iterator

import torch
from torch.utils.data.datapipes.datapipe import IterDataPipe

from . import packing as arithmetic
from .digests import code_digest, mix_seed
from .errors import OptionError, OptionTypeError, UnsupportedError
from .graph import Pushdown, plan_pushdown, random_pipes
from .pack_tokens import Counts, Picker, as_ids, find_counts, pick_tokens, picker_name
from .packing import BestPacking, Group, Packing, ReadGroups, Segments
from .plan import Permutation
from .readers import SequenceReader

__all__ = ["PackIterDataPipe", "PackSequence", "ShuffledPackIterDataPipe", "pack"]

_END = object()
_ORDERS_KEPT = 2  # document orders per process: this epoch's and the one even="carry" reads the tail of
FITS = ("concat", "best")
WINDOW_BLOCKS = 256  # fit="best"'s default window: 256 blocks' worth of tokens (padding about 1/256)
AnyPacking = Packing | BestPacking

log = logging.getLogger("distshard")


def _check_int(name: str, value: object, low: int | None, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise OptionTypeError(f"{name}={value!r} must be an int ({what}), got {type(value).__name__}")
    value = int(value)
    if low is not None and value < low:
        raise OptionError(f"{name}={value} must be at least {low} ({what})")
    return value


def _check_fit(
    fit: object, window: object, window_documents: object, seq_len: int
) -> tuple[str, int | None, int | None]:
    """``(fit, window, window_documents)`` checked; ``fit="best"`` without a window
    gets ``WINDOW_BLOCKS`` blocks' worth of tokens."""
    if not isinstance(fit, str):
        raise OptionTypeError(f"fit={fit!r} must be one of {FITS}, got {type(fit).__name__}")
    if fit not in FITS:
        raise OptionError(
            f"fit={fit!r} is not one of {FITS}: 'concat' cuts the concatenation, 'best' keeps documents whole"
        )
    given = {"window": window, "window_documents": window_documents}
    if fit == "concat":
        named = [name for name, value in given.items() if value is not None]
        if named:
            raise OptionError(f"{named[0]}= applies to fit='best' only (fit='concat' cuts the concatenation): drop it")
        return fit, None, None
    if window is not None and window_documents is not None:
        raise OptionError("give window= (tokens) or window_documents= (documents), not both")
    if window_documents is not None:
        return fit, None, _check_int("window_documents", window_documents, 1, "documents per best-fit window")
    if window is None:
        return fit, WINDOW_BLOCKS * seq_len, None
    return fit, _check_int("window", window, 1, "tokens per best-fit window"), None


class PackIterDataPipe(IterDataPipe):
    r"""Documents packed into blocks of ``seq_len`` tokens (see :func:`distshard.pack`)."""

    def __init__(
        self,
        source: IterDataPipe,
        seq_len: int,
        *,
        tokens: str | Picker | None = None,
        eos: int | None = None,
        pad: int = 0,
        shuffle_documents: bool = False,
        seed: int | None = None,
        fit: str = "concat",
        window: int | None = None,
        window_documents: int | None = None,
    ) -> None:
        if not isinstance(source, IterDataPipe):
            raise OptionTypeError(
                f"pack() needs an IterDataPipe of documents, got {type(source).__name__}; wrap it with IterableWrapper"
            )
        self.seq_len = _check_int("seq_len", seq_len, 1, "tokens per block")
        if tokens is not None and not isinstance(tokens, str) and not callable(tokens):
            raise OptionTypeError(
                f"tokens={tokens!r} must be None (each document is its token ids), a field name or a function "
                f"document -> token ids, got {type(tokens).__name__}"
            )
        self.tokens = tokens
        self.eos = None if eos is None else _check_int("eos", eos, None, "the token id that ends every document")
        self.pad = _check_int("pad", pad, None, "the token id of padding")
        if not isinstance(shuffle_documents, bool):
            raise OptionTypeError(f"shuffle_documents={shuffle_documents!r} must be True or False")
        self.shuffle_documents = shuffle_documents
        self.seed = None if seed is None else _check_int("seed", seed, 0, "the base seed of the document order")
        self.fit, self.window, self.window_documents = _check_fit(fit, window, window_documents, self.seq_len)
        randoms = random_pipes(source)
        if randoms:
            raise UnsupportedError(
                f"pack() needs its documents in one fixed order, but {type(randoms[0]).__name__} upstream "
                "reorders them every epoch (the token counts would not match the documents): remove it and "
                "pass shuffle_documents=True, or shuffle the blocks with .dist_shard(shuffle=True)"
            )
        self.source = source
        self._counts = find_counts(source, tokens, self.eos is not None)
        self._orders: dict[int, AnyPacking] = {}  # per process: packings of document orders, by seed
        self._received: int | None = None
        self._epoch = 0
        self._identity = (
            f"pack seq_len={self.seq_len} eos={self.eos} pad={self.pad} tokens={picker_name(tokens)} "
            f"shuffle_documents={shuffle_documents} seed={self.seed or 0} documents={self.documents} "
            f"tokens={self.total_tokens} counts={self._counts.digest}"
        )
        if self.fit != "concat":  # (a concat pack's identity is what it always was: its states still load)
            self._identity += f" fit={self.fit} window={self.window} window_documents={self.window_documents}"

    def _pick(self, document: Any, k: int) -> Any:
        return pick_tokens(self.tokens, document, k)

    # -- sizes ------------------------------------------------------------------------
    @property
    def documents(self) -> int:
        return self._counts.tokens.documents

    @property
    def total_tokens(self) -> int:
        """Tokens of all documents, their eos included (padding not)."""
        return self._counts.tokens.total

    def packing(self) -> AnyPacking:
        """The blocks of the current document order."""
        return self._packing(self._order_seed())

    def _order_seed(self) -> int | None:
        return None

    def _packing(self, seed: int | None) -> AnyPacking:
        key = -1 if seed is None else seed
        found = self._orders.get(key)
        if found is None:
            counts = self._counts.tokens if seed is None else self._counts.tokens.permuted(self.order(seed))
            if len(self._orders) >= _ORDERS_KEPT:
                self._orders.pop(next(iter(self._orders)))
            if self.fit == "best":
                found = BestPacking(
                    counts, self.seq_len, window_tokens=self.window, window_documents=self.window_documents
                )
            else:
                found = Packing(counts, self.seq_len)
            self._orders[key] = found
        return found

    def order(self, seed: int) -> Permutation:
        """The document order of seed ``seed``: the ``k``-th document packed is ``order(seed)(k)``."""
        return Permutation(self.documents, seed)

    def __len__(self) -> int:
        if self.fit == "concat":
            return -(-self.total_tokens // self.seq_len)
        return self.packing().blocks

    def distshard_identity(self) -> str:
        return self._identity

    # -- the protocol with dist_shard ------------------------------------------------------
    def __distshard_sequence__(self) -> "PackSequence":
        return PackSequence(self)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        sequence = PackSequence(self)
        yield from sequence.distshard_read(range(len(sequence)))

    def describe(self) -> str:
        packing = self.packing()
        order = " in a per-epoch seeded order" if self.shuffle_documents else ""
        average = packing.total / packing.blocks if packing.blocks else 0.0
        if packing.fit == "best":
            padding = f"{packing.padding} padding at the ends of blocks, whole documents (best fit)"
        else:
            padding = f"{packing.padding} padding in the last block"
        return (
            f"{packing.blocks:,} blocks of {self.seq_len} tokens packed from {self.documents:,} documents{order} "
            f"({packing.total:,} tokens{' with eos' if self.eos is not None else ''}, {padding}; about "
            f"{self.documents / max(packing.blocks, 1):.3g} documents and {average:.0f} real tokens a block)"
        )

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_orders"] = {}  # per process
        if IterDataPipe.getstate_hook is not None:
            return IterDataPipe.getstate_hook(state)
        return state

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seq_len={self.seq_len}, documents={self.documents})"


class ShuffledPackIterDataPipe(PackIterDataPipe):
    r"""``pack(..., shuffle_documents=True)``: the documents are packed in a seeded
    order that changes every epoch. The order of an epoch is a pure function of
    ``(seed, received, epoch)``, ``received`` being the last value handed to
    :meth:`set_seed` (``dist_shard`` hands one per epoch, the same on every slot)."""

    @property
    def distshard_length_varies(self) -> bool:
        """fit="best" over a new document order every epoch packs a new number of blocks."""
        return self.fit == "best"

    def set_seed(self, seed: int) -> "ShuffledPackIterDataPipe":
        self._received = int(seed)
        return self

    def set_epoch(self, epoch: int) -> "ShuffledPackIterDataPipe":
        self._epoch = int(epoch)
        return self

    def _order_seed(self) -> int | None:
        return mix_seed(self.seed or 0, self._received or 0, self._epoch)


class _Documents:
    """Reads documents by index, in the order asked: by position when the source has
    random access (below 1:1 maps), else by walking the stream (restarted when an
    earlier document is asked for)."""

    def __init__(self, source: IterDataPipe, counts: Counts) -> None:
        self.source = source
        self.counts = counts
        self.plan: Pushdown = plan_pushdown(source, True)
        self.random = self.plan.sequence is not None

    def read(self, indices: Iterator[int]) -> Iterator[Any]:
        if self.random:
            elements = SequenceReader(self.plan.sequence, self.plan.copy_elements).read(indices)
            return map(self.plan.apply, elements) if self.plan.maps else iter(elements)
        return self._walk(indices)

    def _walk(self, indices: Iterator[int]) -> Iterator[Any]:
        stream: Iterator[Any] | None = None
        at = 0  # the index of the next document of the stream
        for index in indices:
            if stream is None or index < at:
                stream, at = iter(self.source), 0
            document = next(islice(stream, index - at, None), _END)
            if document is _END:
                raise self.counts.stale(
                    f"{type(self.source).__name__} ended before document {index}, which was counted when pack() "
                    "was built"
                )
            at = index + 1
            yield document


class PackSequence:
    """The blocks of a :class:`PackIterDataPipe` as a positional sequence (what
    ``dist_shard`` and ``mix`` read). Block ``b`` reads only the documents it spans;
    a document spanning consecutive blocks read together is read once."""

    distshard_blocks = True  # a slot's blocks are contiguous: a document at a boundary is read by one slot
    distshard_shuffle_kind = "a global permutation of the blocks (each block reads only the documents it spans)"

    def __init__(self, pipe: PackIterDataPipe) -> None:
        self.pipe = pipe
        self._documents: _Documents | None = None
        self._arange: Any = None  # 0 .. seq_len - 1, the positions a segment adds its start to

    def _docs(self) -> _Documents:
        if self._documents is None:
            self._documents = _Documents(self.pipe.source, self.pipe._counts)
        return self._documents

    @property
    def distshard_length_varies(self) -> bool:
        return bool(getattr(self.pipe, "distshard_length_varies", False))

    def __len__(self) -> int:
        return len(self.pipe)

    def __getitem__(self, block: int) -> dict[str, torch.Tensor]:
        if not 0 <= block < len(self):
            raise IndexError(f"block {block} is outside [0, {len(self)})")
        return next(iter(self.distshard_read([block])))

    def distshard_identity(self) -> str:
        docs = self._docs()
        if docs.random:
            below = SequenceReader(docs.plan.sequence).identity()
        else:
            below = f"stream:{type(docs.plan.base).__qualname__}"
        maps = ",".join(code_digest(m.fn) for m in docs.plan.maps)
        return f"{self.pipe.distshard_identity()} maps=[{maps}] of {below}"

    def describe(self) -> str:
        return self.pipe.describe()

    def distshard_order(self, seed: int) -> Permutation:
        if not self._docs().random:
            raise UnsupportedError(
                f"shuffle=True over pack() of a stream ({type(self._docs().plan.base).__name__}, no random access) "
                "would walk the documents again for every block; give pack a random-access source (a list, "
                "a distshard file source or distshard.tokens, with only .map() in between), or shuffle=False"
            )
        return Permutation(len(self), seed)

    def distshard_read(self, positions: Iterable[int], shuffled: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """The blocks at ``positions``, in order. Documents are asked of the source as
        the blocks need them, in one reader (a file source reads ahead in ranges):
        per :class:`distshard.packing.ReadGroups`, a group's documents ascending."""
        pipe = self.pipe
        seed = pipe._order_seed()
        packing = pipe._packing(seed)
        order = pipe.order(seed) if seed is not None else None
        groups = ReadGroups(packing, iter(positions))
        pending: deque[Group] = deque()
        wanted: deque[int] = deque()

        def take() -> bool:
            group = groups.take()
            if group is None:
                return False
            pending.append(group)
            wanted.extend(group[1] if order is None else map(order, group[1]))
            return True

        def indices() -> Iterator[int]:
            while wanted or take():
                if wanted:
                    yield wanted.popleft()

        documents = self._docs().read(indices())
        held: dict[int, Any] = {}
        try:
            while pending or take():
                blocks, reads = pending.popleft()
                yield from self._group(blocks, reads, held, documents, packing, order)
        finally:
            close = getattr(documents, "close", None)
            if close is not None:
                close()

    def _group(
        self,
        blocks: list[tuple[int, Segments]],
        reads: list[int],
        held: dict[int, Any],
        documents: Iterator[Any],
        packing: AnyPacking,
        order: Permutation | None,
    ) -> Iterator[dict[str, torch.Tensor]]:
        """The blocks of one group: its documents read in ascending order as far as
        each block needs them, dropped after their last block (those of the last
        block are held over for the next group)."""
        last = {k: i for i, (_, segments) in enumerate(blocks) for k, _, _ in segments}
        reading = iter(reads)
        for i, (block, segments) in enumerate(blocks):
            for k, _, _ in segments:
                while k not in held:
                    r = next(reading)
                    held[r] = self._tokens(next(documents), r, packing, order)
            yield self._block([(held[k], lo, hi) for k, lo, hi in segments], block, packing)
            if i < len(blocks) - 1:
                for k, _, _ in segments:
                    if last[k] == i:
                        held.pop(k, None)
        keep = {k for k, _, _ in blocks[-1][1]}
        for k in [k for k in held if k not in keep]:
            del held[k]

    def _tokens(self, document: Any, k: int, packing: AnyPacking, order: Permutation | None) -> Any:
        index = order(k) if order is not None else k
        tokens = as_ids(self.pipe._pick(document, index), index)
        expected = packing.count(k) - (self.pipe.eos is not None)
        if len(tokens) != expected:
            raise self.pipe._counts.stale(
                f"document {index} holds {len(tokens)} tokens but {expected} were counted when pack() was built"
            )
        return tokens

    def _block(self, parts: list[tuple[Any, int, int]], block: int, packing: AnyPacking) -> dict[str, torch.Tensor]:
        """The block of ``parts`` (tokens ``[lo, hi)`` of each document, the eos past
        its tokens). Built in numpy arrays when numpy is installed (a fraction of
        torch's cost per small operation) and handed over as tensors without a copy."""
        L, eos = self.pipe.seq_len, self.pipe.eos
        np = arithmetic.numpy_module()  # looked up at each call: a test takes numpy away
        if self._arange is None or len(self._arange) < L:
            self._arange = np.arange(L, dtype=np.int64) if np is not None else torch.arange(L)

        def zeros() -> Any:
            return np.zeros(L, dtype=np.int64) if np is not None else torch.zeros(L, dtype=torch.long)

        ids, positions, segments, mask = zeros(), zeros(), zeros(), zeros()
        at = 0
        for segment, (tokens, lo, hi) in enumerate(parts, 1):
            n = len(tokens)
            real = min(hi, n)
            if real > lo:  # (a tensor's or a memory map's tokens as a plain array: slicing it is cheap)
                plain = (
                    tokens if np is None else tokens.numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
                )
                ids[at : at + real - lo] = plain[lo:real]
            if hi > n:  # the document's eos
                assert eos is not None  # counts hold an eos only when one is given
                ids[at + real - lo] = eos
            positions[at : at + hi - lo] = self._arange[: hi - lo] + lo
            segments[at : at + hi - lo] = segment
            at += hi - lo
        mask[:at] = 1
        ids[at:] = self.pipe.pad  # padding: the last block of fit="concat", the end of a block of fit="best"
        block_ = {"input_ids": ids, "position_ids": positions, "loss_mask": mask, "segment_ids": segments}
        return {name: torch.from_numpy(a) for name, a in block_.items()} if np is not None else block_

    def __getstate__(self) -> dict[str, Any]:
        return {"pipe": self.pipe, "_documents": None, "_arange": None}

    def __repr__(self) -> str:
        return f"PackSequence({len(self)} blocks of {self.pipe.seq_len})"


def pack(
    source: IterDataPipe,
    seq_len: int,
    *,
    tokens: str | Picker | None = None,
    eos: int | None = None,
    pad: int = 0,
    shuffle_documents: bool = False,
    seed: int | None = None,
    fit: str = "concat",
    window: int | None = None,
    window_documents: int | None = None,
) -> PackIterDataPipe:
    r"""Pack the documents of ``source`` into blocks of ``seq_len`` tokens.

    With ``fit="concat"`` block ``b`` is tokens ``[b*seq_len, (b+1)*seq_len)`` of the concatenation of the
    documents (each followed by ``eos`` when given); only the last block is padded. With ``fit="best"`` whole
    documents are placed into blocks by a best-fit decreasing within windows of documents in source order (a
    document longer than ``seq_len`` gives pieces of ``seq_len`` and its remainder is placed like a document),
    and a block that no further document fits is padded at its end (docs/packing.md). The blocks are defined by
    the counts alone, the same at any world size; no token is dropped or repeated.

    A block is a dict of 1-D int64 tensors of ``seq_len``: ``input_ids``; ``position_ids``, each token's index
    in its document (0 where a document starts); ``loss_mask``, 1 on tokens and 0 on padding; ``segment_ids``,
    1, 2, ... for the documents (or pieces) of the block in order and 0 on padding (Grain's convention;
    :func:`distshard.packed_collate` turns them into ``cu_seqlens``).

    A positional source: ``.dist_shard()`` gives every block once per epoch, with ``even``, ``multiple_of``,
    ``shuffle=True`` (of the blocks), resume and elastic resume; a block reads only the documents it spans.

    Args:
        source: an IterDataPipe of documents in a fixed order (no ``shuffle()`` upstream: use
            ``shuffle_documents``). Random access (a list, a distshard file source, ``distshard.tokens``, with
            only ``.map()`` in between) lets a block read its documents directly; a stream is walked to them.
        seq_len: tokens per block (at least 1).
        tokens: where a document's token ids are: ``None`` (the document is them: a list or tuple of ints, a
            1-D integer numpy array or tensor, signed or unsigned), a field name (``document[tokens]``) or a
            function ``document -> token ids``.
        eos: a token id appended to every document, or ``None``. ``pad``: the token id of padding.
        shuffle_documents: pack the documents in a seeded order that changes every epoch (from ``(seed,
            epoch)``, through ``dist_shard``'s seeding); ``seed``: the base seed of that order (``None``: 0).
        fit: ``"concat"`` (cut the concatenation) or ``"best"`` (whole documents).
        window: ``fit="best"``: the documents whose first token lies in the same stretch of ``window`` tokens
            of the concatenation are placed together (default ``256 * seq_len``: about 0.4 % padding);
            ``window_documents``: windows of this many documents instead.

    The token counts come from one pass over the documents at construction (or ``source.distshard_token_counts()``
    without reading them), cached under ``$DISTSHARD_CACHE`` for distshard file sources.

    Example:
        >>> docs = IterableWrapper([[1, 2, 3], [4], [5, 6], [7]])
        >>> [b["input_ids"].tolist() for b in distshard.pack(docs, 4, eos=0)]
        [[1, 2, 3, 0], [4, 0, 5, 6], [0, 7, 0, 0]]
        >>> [b["input_ids"].tolist() for b in distshard.pack(docs, 4, eos=0, fit="best")]
        [[1, 2, 3, 0], [5, 6, 0, 0], [4, 0, 7, 0]]
    """
    cls = ShuffledPackIterDataPipe if shuffle_documents is True else PackIterDataPipe
    order: dict[str, Any] = {"shuffle_documents": shuffle_documents, "seed": seed}
    fitting: dict[str, Any] = {"fit": fit, "window": window, "window_documents": window_documents}
    return cls(source, seq_len, tokens=tokens, eos=eos, pad=pad, **order, **fitting)
