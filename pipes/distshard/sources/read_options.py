"""How a file source reads: read-ahead, coalescing, the shuffle window, retries.

One frozen, picklable :class:`ReadOptions` travels with the source into every
DataLoader worker. The defaults suit object stores (10–50 ms before the first
byte of every request) and local disks alike; see the README's "Object storage"
section for what each one trades.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from ..errors import OptionError, OptionTypeError

__all__ = ["ReadOptions"]

MiB = 1 << 20


@dataclass(frozen=True)
class ReadOptions:
    """Tunables of a file source's reads (``distshard.webdataset(..., read_options=ReadOptions(...))``).

    Args:
        budget: bytes a reading slot (one per DataLoader worker) may hold in
            fetched or in-flight ranges ahead of use, the gaps those ranges
            read through (tar headers, padding, unwanted bytes up to
            ``max_gap``) included. Memory stays within it, except that one
            sample larger than the budget is still read whole (alone, once
            nothing else is held).
        max_range: the largest range request coalescing makes (a sample larger
            than this is still one request).
        max_gap: two spans of one file share a request when at most this many
            unwanted bytes lie between them (remote files). Keep it below
            ``window``, so that a slot never downloads another slot's windows.
        window: bytes of a shuffle window. With ``shuffle=True`` a file source
            visits its files in a permuted order, each file's windows (runs of
            consecutive samples of about this many bytes; a Parquet row group)
            in a permuted order and each window's samples in a permuted order:
            a slot reads each file it touches in big ranges. Changing it changes
            the order, so a checkpoint taken with another window is refused.
        concurrency: range requests a reading slot keeps in flight (remote).
        retries: attempts after the first for a transient failure (5xx, 429, a
            reset connection, a short body, a timeout).
        retry_seconds: the most time spent retrying one request.
        timeout: seconds one request may take before it counts as failed.
        cache_dir: a local folder that keeps fetched ranges of remote files for
            later epochs (``None``: no cache). Entries are keyed by URL, the
            file's identity (size and ETag / generation / modification time: a
            rewritten file never finds them) and byte range, written atomically
            and shared by the processes of a node (workers, ranks); a file whose
            identity names no version is not cached. The bytes served from it
            are those of the version the job indexed.
        cache_bytes: the most bytes ``cache_dir`` holds (16 GiB): past it the
            least recently used ranges are removed.
        first_range: the bytes a slot's first plan of reads asks for: the read-ahead
            starts with ranges this small and doubles them per plan up to
            ``max_range``, its window of bytes held widening by every byte
            delivered up to ``budget`` (a slow start: the first samples come
            after one small request, not behind the slot's whole share).
    """

    budget: int = 64 * MiB
    max_range: int = 8 * MiB
    max_gap: int = 64 << 10
    window: int = 512 << 10
    concurrency: int = 8
    retries: int = 6
    retry_seconds: float = 60.0
    timeout: float = 60.0
    first_range: int = 256 << 10
    cache_dir: str | None = None
    cache_bytes: int = 16 << 30

    def __post_init__(self) -> None:
        if self.cache_dir is not None:
            if not isinstance(self.cache_dir, (str, os.PathLike)):
                raise OptionTypeError(
                    f"ReadOptions(cache_dir={self.cache_dir!r}) must be a folder (a str or path), or None for no cache"
                )
            object.__setattr__(self, "cache_dir", os.fspath(self.cache_dir))
        for item in fields(self):
            if item.name == "cache_dir":
                continue
            value = getattr(self, item.name)
            number = (int, float) if item.type in ("float", float) else (int,)
            if isinstance(value, bool) or not isinstance(value, number):
                raise OptionTypeError(
                    f"ReadOptions({item.name}={value!r}) must be a{'' if number == (int,) else ' real'} "
                    f"number{' of bytes' if item.name in _BYTES else ''}"
                )
            low = 0 if item.name in ("retries", "max_gap", "retry_seconds") else 1
            if value < low or value != value:
                raise OptionError(f"ReadOptions({item.name}={value!r}) must be at least {low}")
        if self.max_gap >= self.window:
            raise OptionError(
                f"ReadOptions(max_gap={self.max_gap}) must be below window={self.window}: "
                "a larger gap would make a slot download the windows of other slots"
            )

    def token(self) -> str:
        """What of these options changes which position means which element (the
        shuffle order): part of the source's identity in checkpoints."""
        return f"w{self.window}"


_BYTES = ("budget", "max_range", "first_range", "max_gap", "window", "cache_bytes")
