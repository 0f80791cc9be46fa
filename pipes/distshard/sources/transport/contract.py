"""What every remote client offers (:class:`Transport`), whichever store it reads.

:func:`.clients.client_for` returns one of :class:`.remote.Client` (fsspec: aiohttp
for HTTP(S), s3fs for S3, any other filesystem), :class:`.s3direct.DirectS3Client`
(S3 over ``http.client``, SigV4) or :class:`.hub.HubClient` (``hf://``); the
callers (:mod:`.files`, :mod:`.streamed`, the stored index, the read-ahead) see
this Protocol only. Every answer is checked and retried as :mod:`.responses` says.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ..read_options import ReadOptions
from .responses import Pending

__all__ = ["Stream", "Transport"]

_DEFAULT = ReadOptions()


@runtime_checkable
class Stream(Protocol):
    """The body of one streamed GET (:meth:`Transport.open_stream`)."""

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes of the body (fewer only at its end)."""

    def close(self, whole: bool) -> None:
        """Release the body; ``whole``: it was read to its end (its connection may serve the next request)."""


@runtime_checkable
class Transport(Protocol):
    """One process's client of one protocol and set of storage options.

    ``kind``: ``http``, ``s3``, ``hf`` or ``generic`` (what fsspec reads with a
    metadata check per process and file). A ``(size, stamp)`` pair is a file's
    identity: its size and version (ETag, generation, modification time, the
    Hub's sha256), as one metadata request gives it."""

    kind: str
    protocol: str
    storage_options: dict[str, Any]

    @property
    def fs(self) -> Any:
        """The fsspec filesystem of the same options (what lists, writes and deletes beyond the reads)."""

    def warm(self) -> None:
        """Start what the first request would (imports, session, credentials)."""

    def shareable_session(self) -> Any:
        """What a forked child may build its own client from (no connection, no event loop), else ``None``."""

    def made_filesystem(self) -> Any:
        """The filesystem if it was made (a forked child keeps it alive, never closing it), else ``None``."""

    def identity(self, url: str, options: ReadOptions = _DEFAULT) -> tuple[int, str]:
        """``(size, stamp)`` of ``url`` now: one metadata request (retried)."""

    def tail(self, url: str, n: int, options: ReadOptions = _DEFAULT) -> tuple[int, str, bytes]:
        """``(size, stamp, last bytes)`` from one suffix GET where the store answers one, else ``b""`` as the bytes."""

    def submit_range(
        self,
        url: str,
        start: int,
        stop: int,
        size: int | None,
        stamp: str | None,
        options: ReadOptions = _DEFAULT,
        stored: str | None = None,
    ) -> Pending:
        """Bytes ``[start, stop)`` of ``url`` checked against ``(size, stamp)`` (``None``: unchecked), retried;
        ``stored`` names the stored index the identity came from; a future-like object."""

    def read_range(
        self, url: str, start: int, stop: int, size: int | None, stamp: str | None, options: ReadOptions = _DEFAULT
    ) -> bytes:
        """:meth:`submit_range`'s bytes, waited for."""

    def cat(self, url: str, options: ReadOptions = _DEFAULT) -> bytes:
        """The whole file, checked against its identity (a metadata request, then one range)."""

    def fetch(self, url: str, options: ReadOptions = _DEFAULT) -> bytes:
        """The whole object in one request (no metadata request first), retried; ``FileNotFoundError`` if none."""

    def open_stream(self, url: str, options: ReadOptions = _DEFAULT) -> tuple[Stream, int, str]:
        """One GET of the whole object, its opening retried: ``(stream, size, stamp)``."""

    def put(self, url: str, data: bytes) -> None:
        """Write a whole object (a stored index's entry or manifest)."""

    def glob(self, pattern: str) -> list[str]:
        """The URLs matching ``pattern``, sorted."""

    def list_identities(
        self, folder: str, prefix: str, last: str, options: ReadOptions = _DEFAULT
    ) -> dict[str, tuple[int, str]]:
        """``{name: (size, stamp)}`` of the objects in ``folder`` whose names start with ``prefix``, up to ``last``."""
