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

import asyncio
import contextlib
import io
import logging
import random
import time
from typing import Any

from ..errors import UnsupportedError
from .answers import RemoteReadError, Transient, check_status, http_stamp, looks_transient
from .files import FileAccess, FileRef
from .remote import Client

__all__ = ["Body", "open_body", "streams"]

log = logging.getLogger("distshard")

CHUNK = 1 << 20  # the most bytes one read of a body hands over


def streams(client: Client) -> bool:
    """Whether ``client``'s store is read here with one streamed GET per file."""
    return client.kind in ("http", "s3")


class Body(io.RawIOBase):
    """The body of one GET as a non-seekable raw stream (``read``, ``readinto``,
    ``tell``); ``size`` and ``stamp`` are the file's identity from the response."""

    def __init__(self, client: Client, url: str, response: Any, size: int, stamp: str, timeout: float) -> None:
        super().__init__()
        self.client, self.url, self.response = client, url, response
        self.size, self.stamp = size, stamp
        self.timeout = timeout
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
            if self.response is None:
                raise _Cut(f"{self.url}: the body ended at byte {self.pos} of {self.size}")
            self.pending = self._next(min(CHUNK, max(want, 64 << 10)))
        take = self.pending[:want]
        self.pending = self.pending[len(take) :]
        buffer[: len(take)] = take
        self.pos += len(take)
        return len(take)

    def _next(self, n: int) -> bytes:
        future = self.client.submit(asyncio.wait_for(_read(self.client, self.response, n), self.timeout))
        try:
            data = future.result(self.timeout + 30)
        except Exception as exc:  # noqa: BLE001 - a cut or stalled body: the caller starts the file again
            future.cancel()
            raise _Cut(
                f"{self.url}: the body stopped at byte {self.pos} of {self.size}: {type(exc).__name__}: {exc}"
            ) from None
        if not data:
            raise _Cut(f"{self.url}: the body ended at byte {self.pos} of {self.size}")
        return bytes(data)

    def finish(self, limit: int = CHUNK) -> None:
        """Read what is left of the body when it is at most ``limit`` bytes (a
        tar's end-of-archive padding), so that the connection serves the next file."""
        if self.response is None or self.size - self.pos - len(self.pending) > limit:
            return
        with contextlib.suppress(_Cut):
            while self.pos < self.size:
                self.pos += len(self.pending) or len(self._next(self.size - self.pos))
                self.pending = b""

    def close(self) -> None:
        if not self.closed:
            response, self.response = self.response, None
            if response is not None:
                self.client.submit(_close(self.client, response, self.pos >= self.size))
        super().close()


class _Cut(Exception):
    """A body that stopped before its end: the file is read again."""


async def _read(client: Client, response: Any, n: int) -> bytes:
    """Up to ``n`` bytes of the body (fewer at its end only): the pieces the
    connection hands over are gathered here, so the reading thread waits once."""
    read = response.content.read if client.kind == "http" else response["Body"].read
    parts, got = [], 0
    while got < n:
        piece = await read(n - got)
        if not piece:
            break
        parts.append(piece)
        got += len(piece)
    return b"".join(parts)


async def _close(client: Client, response: Any, whole: bool) -> None:
    if client.kind == "http":
        if whole:  # read to its end: the connection serves the next request
            response.release()
        else:
            response.close()
    else:
        response["Body"].close()


async def _open(client: Client, url: str) -> tuple[Any, int, str]:
    if client.kind == "http":
        fs = client.fs
        session = await fs.set_session()
        kw = dict(fs.kwargs)
        headers = dict(kw.pop("headers", None) or {})
        headers["Accept-Encoding"] = "identity"
        kw.setdefault("allow_redirects", True)
        r = await session.get(fs.encode_url(url), headers=headers, **kw)
        try:
            check_status(url, r.status, "the whole file")
            size = r.headers.get("Content-Length")
            if size is None or r.headers.get("Content-Encoding", "identity") not in ("identity", ""):
                raise UnsupportedError(f"{url}: the server does not report the file's size; random access needs it")
            return r, int(size), http_stamp(r.headers)
        except BaseException:
            r.close()
            raise
    response = await client.s3_object(url, "get_object", "the whole file")
    stamp = str(response.get("ETag") or response.get("VersionId") or "")
    return response, int(response["ContentLength"]), stamp


async def _start(client: Client, url: str) -> tuple[Any, int, str, bytes]:
    """The response, the identity, and the body's first :data:`CHUNK` bytes (a
    small file whole: its response is then released, and ``None``)."""
    response, size, stamp = await _open(client, url)
    try:
        first = await _read(client, response, min(size, CHUNK))
    except BaseException:
        await _close(client, response, False)
        raise
    if len(first) >= size:
        await _close(client, response, True)
        response = None
    return response, size, stamp, first


def open_body(url: str, access: FileAccess) -> Body:
    """The body of one GET of ``url`` (its opening and first :data:`CHUNK` bytes
    retried): one wait on the client's event loop for a small file."""
    client = access.client(url)
    if not isinstance(client, Client):  # the direct S3 client: the index command streams through s3fs
        client = client.fallback
    options = access.options
    response, size, stamp, first = client.run(
        client._retrying(url, "the whole file", lambda: _start(client, url), options), f"{url}: the whole file", options
    )
    body = Body(client, url, response, size, stamp, options.timeout)
    body.pending = first
    return body


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
        log.warning("retrying %s the whole file (attempt %d failed: %s)", url, attempt, failure)
        time.sleep(delay * (0.5 + random.random() / 2))
        delay = min(delay * 2, 5.0)
