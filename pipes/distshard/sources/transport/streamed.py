"""One streamed GET per remote file: what ``python -m distshard index`` reads.

A remote file is indexed from a single request: a GET of the whole object whose
response gives the file's identity (its size, and the ETag / Last-Modified the
store sends, exactly as a HEAD would: see :func:`.answers.http_stamp`) and whose
body is parsed as it flows (tar headers, JSON-line offsets), in pieces of at
most :data:`CHUNK` bytes: the file is never held whole, and no HEAD comes first.
The body belongs to that one response, so it is one version of the file.

A failure while the body flows (a reset, a timeout, a 5xx on opening) starts the
file again (``ReadOptions.retries`` / ``retry_seconds``); a missing file raises
``FileNotFoundError`` naming it. Stores other than HTTP(S) and S3 have no
streamed path here: their files are indexed as a job indexes them (a metadata
request, then ranges).
"""

from __future__ import annotations

import contextlib
import io
import logging
import random
import time
from typing import Any

from .contract import Transport
from .files import FileAccess, FileRef
from .responses import RETRY, RemoteReadError, Transient, looks_transient

__all__ = ["Body", "open_body", "streams"]

log = logging.getLogger("distshard")

CHUNK = 1 << 20  # the most bytes one read of a body hands over


def streams(client: Transport) -> bool:
    """Whether ``client``'s store is read here with one streamed GET per file."""
    return client.kind in ("http", "s3")


class Body(io.RawIOBase):
    """The body of one GET as a non-seekable raw stream (``read``, ``readinto``,
    ``tell``); ``size`` and ``stamp`` are the file's identity from the response.
    ``stream``: what the client's ``open_stream`` returned (``read(n)``: up to
    ``n`` bytes, fewer only at the end; ``close(whole)``)."""

    def __init__(self, url: str, stream: Any, size: int, stamp: str) -> None:
        super().__init__()
        self.url, self.stream = url, stream
        self.size, self.stamp = size, stamp
        self.pos = 0
        self.pending = b""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        want = min(len(buffer), self.size - self.pos)
        if want <= 0:
            return 0
        if not self.pending:
            if self.stream is None:
                raise _Cut(f"{self.url}: the body ended at byte {self.pos} of {self.size}")
            self.pending = self._next(min(CHUNK, max(want, 64 << 10)))
        take = self.pending[:want]
        self.pending = self.pending[len(take) :]
        buffer[: len(take)] = take
        self.pos += len(take)
        return len(take)

    def _next(self, n: int) -> bytes:
        try:
            data = self.stream.read(n)
        except Exception as exc:  # noqa: BLE001 - a cut or stalled body: the caller starts the file again
            raise _Cut(
                f"{self.url}: the body stopped at byte {self.pos} of {self.size}: {type(exc).__name__}: {exc}"
            ) from None
        if not data:
            raise _Cut(f"{self.url}: the body ended at byte {self.pos} of {self.size}")
        return bytes(data)

    def finish(self, limit: int = CHUNK) -> None:
        """Read what is left of the body when it is at most ``limit`` bytes (a
        tar's end-of-archive padding), so that the connection serves the next file."""
        if self.stream is None or self.size - self.pos - len(self.pending) > limit:
            return
        with contextlib.suppress(_Cut):
            while self.pos < self.size:
                self.pos += len(self.pending) or len(self._next(self.size - self.pos))
                self.pending = b""

    def close(self) -> None:
        if not self.closed:
            stream, self.stream = self.stream, None
            if stream is not None:
                stream.close(self.pos >= self.size)
        super().close()


class _Cut(Exception):
    """A body that stopped before its end: the file is read again."""


def open_body(url: str, access: FileAccess) -> Body:
    """The body of one GET of ``url`` (its opening retried): the client's
    ``open_stream`` (both clients of :func:`.clients.client_for` have it)."""
    client = access.client(url)
    stream, size, stamp = client.open_stream(url, access.options)
    return Body(url, stream, size, stamp)


def index_streamed(fmt: Any, url: str, access: FileAccess) -> tuple[FileRef, Any]:
    """``(ref with the identity of the response, the file's index)`` from one
    streamed GET; the file is read again after a cut body, within the retry bounds."""
    options = access.options
    started, delay, attempt = time.monotonic(), 0.05, 0
    while True:
        body = open_body(url, access)
        try:
            ref = FileRef(url, body.size, body.stamp)
            index = fmt.index_stream(io.BufferedReader(body, CHUNK), ref)
            body.finish()
            return ref, index
        except (_Cut, Transient) as exc:
            failure: BaseException = exc
        except (ValueError, FileNotFoundError, PermissionError, TypeError):
            raise
        except Exception as exc:  # noqa: BLE001 - connection errors of aiohttp / botocore
            if not looks_transient(exc):
                raise
            failure = exc
        finally:
            body.close()
        attempt += 1
        if attempt > options.retries or time.monotonic() - started + delay > options.retry_seconds:
            raise RemoteReadError(
                f"{url}: the whole file: {attempt} attempt{'s' if attempt != 1 else ''} failed in "
                f"{time.monotonic() - started:.1f} s; last: {failure}"
            )
        log.warning(
            "retrying %s the whole file (attempt %d failed: %s)",
            url,
            attempt,
            failure,
            extra={RETRY: f"{url} the whole file"},
        )
        time.sleep(delay * (0.5 + random.random() / 2))
        delay = min(delay * 2, 5.0)
