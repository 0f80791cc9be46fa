"""A packed document's token ids and the counts ``pack`` plans with: the token picker
(a field, a function, the document itself), the checks of token ids (lists, numpy arrays,
tensors; unsigned 64-bit ids that an int64 block cannot hold), and the per-document counts,
found from the source (``distshard_token_counts()``), the on-disk cache (file sources, keyed
by the files' identities and what the maps and the picker compute) or one pass."""

from __future__ import annotations

import logging
import numbers
import os
import sys
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import torch
from torch.utils.data.datapipes.datapipe import IterDataPipe

from .callkeys import Unkeyable, call_key
from .digests import blake2b_hex, code_digest, crc32_chunks_hex
from .errors import OptionError, OptionTypeError, SourceChangedError, SourceDataError
from .graph import plan_pushdown
from .packing import TokenCounts

Picker = Callable[[Any], Any]
_COUNTS_FORMAT = "pack-counts"
_COUNTS_VERSION = 2  # 2: keyed by what the maps and the token picker compute (callkeys), not by their names

log = logging.getLogger("distshard")


def picker_name(tokens: str | Picker | None) -> str:
    if tokens is None:
        return "document"
    if isinstance(tokens, str):
        return f"field {tokens!r}"
    return f"fn {code_digest(tokens)}"


def describe_value(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


class Counts:
    """The per-document token counts (the eos not included) and the plan's prefix
    sums, in a holder that torch's graph walk does not pickle (it keeps only
    attribute values that are pipes or collections)."""

    def __init__(self, counts: Sequence[int], eos: bool, how: str, entry: str | None = None) -> None:
        self.tokens = TokenCounts(counts, 1 if eos else 0)
        self.how = how  # "source" (distshard_token_counts), "cache", "counted"
        self.entry = entry  # the cache entry they were read from or written to, if any
        self.longest = int(_extreme(counts, max)) if len(counts) else 0
        # the CRC-32 of the prefix sums (int64), as states have always recorded it: computed in chunks
        self.digest = crc32_chunks_hex(self.tokens.prefix_chunks())

    def stale(self, problem: str) -> SourceChangedError:
        """The error for counts a block found wrong (``problem`` says how), after
        deleting their cache entry so that the next ``pack()`` counts again instead of
        reading the same wrong counts in every later job."""
        if self.entry is None:
            return SourceChangedError(
                f"{problem}: the documents changed (or come in another order); build the pack again"
            )
        try:
            os.unlink(self.entry)
        except FileNotFoundError:
            pass  # another reader of the same counts dropped it first
        except OSError as exc:
            return SourceChangedError(
                f"{problem}: the documents are not those counted {_HOW[self.how]} {self.entry}, which could not be "
                f"deleted ({exc}); delete it, then build the pack again"
            )
        return SourceChangedError(
            f"{problem}: the documents are not those counted {_HOW[self.how]} {self.entry} (the documents changed, "
            "or a map or the token picker computes what its key does not show); that entry is now deleted: build the "
            "pack again and it counts them again"
        )


_HOW = {"cache": "in the cached entry", "counted": "at construction and cached in"}


def find_counts(source: IterDataPipe, tokens: str | Picker | None, eos: bool) -> Counts:
    """From the source (``distshard_token_counts()``, documents as they are), the
    cache (file sources) or one pass over the documents."""
    own = getattr(source, "distshard_token_counts", None)
    if tokens is None and callable(own):
        counts = own()
        _check_counts(counts, type(source).__name__)
        return Counts(counts, eos, "source")
    key = _cache_key(source, tokens)
    if key is not None:
        from .sources.formats.file_index import FileIndex
        from .sources.formats.index_cache import cache_path, obtain
        from .sources.transport.files import FileRef

        def build(ref: FileRef) -> FileIndex:
            from array import array

            counted = _count(source, tokens)
            return FileIndex(
                _COUNTS_FORMAT,
                ref.url,
                ref.size or 0,
                ref.stamp or "",
                len(counted),
                {"counts": array("q", counted)},
            )

        ref = FileRef(f"distshard-pack://{key}", 0, key)
        index, built = obtain(_COUNTS_FORMAT, ref, build)
        assert index is not None
        how = "counted" if built is not None else "cache"
        return Counts(index.arrays["counts"], eos, how, str(cache_path(_COUNTS_FORMAT, ref)))
    return Counts(_count(source, tokens), eos, "counted")


def _cache_key(source: IterDataPipe, tokens: str | Picker | None) -> str | None:
    """A key for the on-disk cache when the documents come from a distshard file
    source (below 1:1 maps): the files' identities (path or URL, size, mtime or
    ETag) and what the maps and the token picker compute (:func:`.callkeys.call_key`);
    else ``None`` (counted every time): no file source, or a map or picker that
    cannot be keyed faithfully (logged at DEBUG)."""
    from .sources.pipe import FileSourceIterDataPipe
    from .sources.transport.files import key_of

    plan = plan_pushdown(source, True)
    base = plan.base
    if not isinstance(base, FileSourceIterDataPipe) or not base.random_access:
        return None
    behaviour = _behaviour_key(plan.maps, tokens)
    if behaviour is None:
        return None
    refs = base.prepare()
    if any(ref.size is None for ref, _ in refs):
        return None
    parts = [
        str(_COUNTS_VERSION),
        type(base.fmt).__qualname__,
        repr(getattr(base.fmt, "columns", None)),
        *(f"{key_of(ref.url)}\0{ref.size}\0{ref.stamp}\0{count}" for ref, count in refs),
        behaviour,
    ]
    return blake2b_hex("\n".join(parts).encode("utf-8", "surrogatepass"), 16)


def _count(source: IterDataPipe, tokens: str | Picker | None) -> list[int]:
    """One pass over the documents: each one's token count, its tokens checked."""
    out = []
    for k, document in enumerate(source):
        out.append(len(_checked_tokens(pick_tokens(tokens, document, k), k)))
    return out


def pick_tokens(tokens: str | Picker | None, document: Any, k: int) -> Any:
    """The token ids ``tokens`` picks from document ``k`` (a field, a function, or the document itself)."""
    if tokens is None:
        return document
    if isinstance(tokens, str):
        if not isinstance(document, Mapping):
            raise OptionTypeError(
                f"document {k} is a {type(document).__name__}, not a mapping with a field {tokens!r}; pass "
                "tokens=None when each document is its token ids, or a function document -> token ids"
            )
        try:
            return document[tokens]
        except KeyError:
            fields = sorted(map(str, document))[:8]
            raise OptionError(
                f"document {k} has no field {tokens!r} (its fields: {fields}); pass tokens= the field that "
                "holds the token ids"
            ) from None
    return tokens(document)


def _behaviour_key(maps: Sequence[Any], tokens: str | Picker | None) -> str | None:
    """What the 1:1 ``maps`` and the token picker compute, as a cache key
    (:func:`.callkeys.call_key` of each: class, function, columns); ``None`` when one
    of them cannot be keyed faithfully (the counts are then not cached)."""
    named: list[tuple[str, Any]] = [
        (f"the map {describe_value(m.fn)}", (type(m), m.fn, m.input_col, m.output_col)) for m in maps
    ]
    named.append((f"tokens={describe_value(tokens)}", tokens))
    keys = []
    for name, value in named:
        try:
            keys.append(call_key(value))
        except Unkeyable as why:
            log.debug(
                "pack(): the token counts are not cached (counted at every construction): %s cannot be keyed "
                "faithfully: %s",
                name,
                why,
            )
            return None
    return ",".join(keys)


def _check_counts(counts: Any, where: str) -> None:
    if not (hasattr(counts, "__len__") and hasattr(counts, "__getitem__")):
        raise OptionTypeError(
            f"{where}.distshard_token_counts() returned {type(counts).__name__}, not a sequence of ints"
        )
    dtype = getattr(counts, "dtype", None)
    if dtype is not None and getattr(dtype, "kind", "i") not in "iu":
        raise OptionTypeError(
            f"{where}.distshard_token_counts() returned counts of dtype {dtype}; they must be integers"
        )
    low = _extreme(counts, min) if len(counts) else 0
    if low < 0:
        raise SourceDataError(f"{where}.distshard_token_counts() returned a negative count: {low}")


def _extreme(values: Any, which: Callable[[Any], Any]) -> Any:
    """``min`` or ``max`` of a sequence, by numpy's when it is an array (no loop in Python)."""
    own = getattr(values, which.__name__, None)
    return own() if callable(own) else which(values)


#: the tensor dtypes of token ids: every integer one (torch's unsigned 16-, 32- and 64-bit ones where it has them,
#: as torch.from_numpy makes of a uint16 Megatron corpus), never bool, floats or complex
_INTEGER_DTYPES = frozenset(
    {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8}
    | {d for d in (getattr(torch, f"uint{bits}", None) for bits in (16, 32, 64)) if isinstance(d, torch.dtype)}
)
_INT64_MAX = (1 << 63) - 1


def _checked_tokens(tokens: Any, k: int) -> Any:
    """``tokens`` if they are token ids (a list or tuple of ints, a 1-D integer numpy
    array or tensor, signed or unsigned); else ``TypeError`` naming the document and
    the value (``ValueError`` for an unsigned 64-bit id above what an int64 block holds)."""
    if isinstance(tokens, (list, tuple)):
        if any(type(t) is not int for t in tokens):
            for j, t in enumerate(tokens):
                if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                    raise OptionTypeError(
                        f"token {j} of document {k} is {describe_value(t)} ({type(t).__name__}); token ids "
                        "must be ints: tokenize the documents first (e.g. with .map(...) before pack)"
                    )
        return tokens
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.dtype not in _INTEGER_DTYPES:
            raise OptionTypeError(
                f"document {k}'s tokens are a {tokens.dim()}-D tensor of {tokens.dtype}; give a 1-D integer tensor"
            )
        if tokens.dtype is getattr(torch, "uint64", None):
            _check_int64(tokens.cpu().numpy(), k)
        return tokens
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(tokens, numpy.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise OptionTypeError(
                f"document {k}'s tokens are a {tokens.ndim}-D numpy array of {tokens.dtype}; give a 1-D integer array"
            )
        if tokens.dtype.kind == "u" and tokens.dtype.itemsize == 8:
            _check_int64(tokens, k)
        return tokens
    raise OptionTypeError(
        f"document {k}'s tokens are a {type(tokens).__name__} ({describe_value(tokens)}); give token ids: a list "
        "of ints, a 1-D integer numpy array or tensor (tokenize first; pass tokens= a field or a function to "
        "pick them from a document)"
    )


def _check_int64(tokens: Any, k: int) -> None:
    """Unsigned 64-bit ``tokens`` (a numpy array) whose ids fit the int64 blocks, else
    ``ValueError`` naming the first one that does not: a copy would wrap it silently."""
    above = tokens > tokens.dtype.type(_INT64_MAX)  # uint64 against uint64: exact under numpy 1 and 2
    if bool(above.any()):
        j = int(above.nonzero()[0][0])
        raise OptionError(
            f"token {j} of document {k} is {int(tokens[j])} (uint64), above {_INT64_MAX}, the largest id an int64 "
            "block holds: give token ids below 2**63"
        )


def _check_list_int64(tokens: Sequence[int], k: int) -> None:
    """A list of ints that an int64 block holds, else ``ValueError`` naming the first id
    that it does not (torch's own error names no token and no document)."""
    for j, t in enumerate(tokens):
        if not -_INT64_MAX - 1 <= t <= _INT64_MAX:
            raise OptionError(
                f"token {j} of document {k} is {t}, outside the ids an int64 block holds "
                f"({-_INT64_MAX - 1}..{_INT64_MAX}): give token ids below 2**63"
            )


def as_ids(tokens: Any, k: int) -> Any:
    """A document's token ids, checked: a 1-D integer tensor or numpy array (as given,
    no copy; a list becomes a tensor)."""
    if isinstance(tokens, (list, tuple)):
        if not tokens:
            return torch.empty(0, dtype=torch.long)
        try:
            out = torch.tensor(tokens)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            _checked_tokens(tokens, k)  # names the value
            _check_list_int64(tokens, k)
            raise
        if out.dtype is not torch.long or out.dim() != 1:
            _checked_tokens(tokens, k)
            raise OptionTypeError(f"document {k}'s tokens are not a flat list of ints")
        return out
    return _checked_tokens(tokens, k)
