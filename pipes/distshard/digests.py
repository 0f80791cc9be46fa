"""Seeds and identity digests, in one place.

Every value made here is written somewhere that outlives the process, or decides an
order every process must agree on: seeds of the upstream random pipes and of the
shuffle orders (:func:`mix_seed`), the identities recorded in checkpoint states and
in cache keys (:func:`stable_digest`, :func:`code_digest`, :func:`blake2b_hex`),
the names of cache folders (:func:`sha256_hex`). So each must stay bit-identical
across processes, runs and versions: a state or a cache written today must keep
matching (``tests/test_digests.py`` pins values computed before this module existed).
None may depend on ``id()``, on ``hash()`` of strings or on default ``repr``s.

This module imports nothing of the package.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Any, Iterable, Sequence

__all__ = [
    "ListHead",
    "blake2b_hex",
    "code_digest",
    "crc32_chunks_hex",
    "crc32_hex",
    "crc32_of",
    "mix_seed",
    "salt",
    "sha256_hex",
    "stable_digest",
    "stable_text",
]

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_PRIMITIVES = (type(None), bool, int, float, str, bytes)


def mix_seed(*parts: int) -> int:
    """A well-mixed non-negative 63-bit seed from integers (SplitMix64 steps).

    Used to derive the seed of every upstream random pipe from ``(seed, epoch,
    index of the pipe)``; identical on every process, unlike ``hash()``.
    """
    state = _GOLDEN
    for part in parts:
        state = (state ^ (part & _MASK)) & _MASK
        state = (state + _GOLDEN) & _MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        state = z ^ (z >> 31)
    return state >> 1


def crc32_hex(data: bytes | memoryview) -> str:
    """CRC-32 of ``data`` as 8 hex digits: a fast digest where a collision costs no
    exactness (a salt, a summary of counts also checked another way)."""
    return f"{zlib.crc32(data):08x}"


def crc32_of(data: bytes | memoryview) -> int:
    """CRC-32 of ``data`` as an int: the checksum of stored bytes (the local range
    cache's chunks), where a damaged copy must be told from a good one."""
    return zlib.crc32(data)


def crc32_chunks_hex(chunks: Iterable[bytes | memoryview]) -> str:
    """:func:`crc32_hex` of the concatenation of ``chunks``, without joining them."""
    crc = 0
    for chunk in chunks:
        crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def salt(identity: str) -> int:
    """A per-source number mixed into seeds (CRC-32 of the reader's identity), so that
    two branches of one pipeline over different sources do not shuffle alike."""
    return zlib.crc32(identity.encode())


def blake2b_hex(data: bytes, size: int) -> str:
    """BLAKE2b of ``data`` with a ``size``-byte digest, in hex: identities in cache
    keys and states."""
    return hashlib.blake2b(data, digest_size=size).hexdigest()


def sha256_hex(data: bytes) -> str:
    """SHA-256 of ``data``, in hex: element keys and the range cache's folder names."""
    return hashlib.sha256(data).hexdigest()


def stable_text(value: Any, budget: list[int]) -> str | None:
    """A process-independent text for primitives and containers of them (at most
    ``budget[0]`` values, the first 8 items of each container), or ``None``."""
    budget[0] -= 1
    if budget[0] < 0:
        return None
    if isinstance(value, _PRIMITIVES):
        text = repr(value)
        return text if len(text) <= 200 else f"{text[:200]}...{len(text)}"
    if isinstance(value, ListHead):
        return _sequence_text("list", value.n, value.items, budget)
    if isinstance(value, (list, tuple)):
        return _sequence_text(type(value).__name__, len(value), value[:8], budget)
    if isinstance(value, dict):
        items = []
        for k, v in list(value.items())[:8]:
            kt, vt = stable_text(k, budget), stable_text(v, budget)
            if kt is None or vt is None:
                return None
            items.append(f"{kt}:{vt}")
        return "{" + ",".join(items) + "}"
    return None


class ListHead:
    """What :func:`stable_text` reads of a long list, without the list: its length
    ``n`` and its first 8 ``items`` (a list of files a lazy index holds in pages);
    its text is the whole list's."""

    def __init__(self, items: Sequence[Any], n: int) -> None:
        self.items, self.n = list(items[:8]), n


def _sequence_text(name: str, n: int, head: Sequence[Any], budget: list[int]) -> str | None:
    parts = [stable_text(v, budget) for v in head]
    texts = [part for part in parts if part is not None]
    return None if len(texts) < len(parts) else f"{name}({n}:{','.join(texts)})"


def stable_digest(*values: Any) -> str:
    """An 8-hex-digit digest of values, using only what is the same in every
    process: primitives and small containers of them by value, anything else by
    its type's qualified name."""
    texts = []
    for value in values:
        text = stable_text(value, [64])
        texts.append(text if text is not None else f"<{type(value).__module__}.{type(value).__qualname__}>")
    return crc32_hex("|".join(texts).encode())


def code_digest(fn: Any) -> str:
    """What names a function in a cache key: its qualified name and a digest of its
    code (a changed body gives another key)."""
    code = getattr(fn, "__code__", None)
    name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
    if code is None:
        return name
    body = code.co_code + repr(code.co_consts).encode() + repr(code.co_names).encode()
    return f"{name}:{blake2b_hex(body, 6)}"
