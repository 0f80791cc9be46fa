"""What an answer from a store means: shared by every remote client.

The HTTP(S) and ``s3fs`` clients of :mod:`.remote`, the direct S3 client of
:mod:`.s3direct` and the index command's streamed GET (:mod:`.streamed`) read
answers the same way: the version an answer names (:func:`http_stamp`,
:func:`http_change`, :func:`strong_etag`), a status or an S3 error code turned
into a missing file, a refusal, a changed file or a transient failure
(:func:`check_status`, :func:`s3_error`), a ``Content-Range`` and a body checked
against the range asked (:func:`check_content_range`, :func:`exact`), one
request's retries (:class:`Attempts`: the same bounds, backoff and messages
whichever client runs them) and a client's first request, timed whatever its
answer (:class:`FirstRequest`).
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import random
import re
import threading
import time
from typing import Any, Callable, Mapping

from ...errors import DistshardError, SourceChangedError, SourceMissingError, UnsupportedError
from ...waits import WaitTimeout
from ..read_options import ReadOptions

__all__ = [
    "CONTENT_RANGE",
    "Attempts",
    "Changed",
    "Deferred",
    "FirstRequest",
    "MissingBucketError",
    "Pending",
    "RemoteReadError",
    "RemoteReadTimeout",
    "RETRY",
    "SLOW_FIRST_REQUEST",
    "StoreUnreachable",
    "Transient",
    "Unreached",
    "changed_error",
    "check_content_range",
    "check_status",
    "exact",
    "http_change",
    "http_stamp",
    "index_command",
    "looks_transient",
    "missing",
    "no_connection",
    "READ_ONLY",
    "read_only",
    "s3_error",
    "strong_etag",
    "suffix_answer",
    "wait_bound",
]

log = logging.getLogger("distshard")


class RemoteReadError(DistshardError, OSError):
    """A remote read that kept failing after its retries (names the URL and range)."""


class StoreUnreachable(RemoteReadError):
    """A remote request none of whose attempts reached the store: every one failed
    to connect (connection refused, unknown host, no route)."""


class RemoteReadTimeout(RemoteReadError, WaitTimeout):
    """A remote request whose answer did not come within its bound (:func:`wait_bound`):
    the event loop that runs it is stuck or gone (names the URL and range)."""


def wait_bound(options: ReadOptions) -> float:
    """The longest a caller waits for one request's answer: its retries take at
    most ``retry_seconds`` plus one attempt (``timeout``); twice that, and 30 s
    more, leaves room for the requests queued before it (``concurrency``)."""
    return 2 * (options.retry_seconds + options.timeout) + QUEUE_SLACK


QUEUE_SLACK = 30.0


class Transient(Exception):
    """A failure worth retrying."""


class Changed(Exception):
    """The store says the object is no longer the indexed version."""


class Unreached(Transient):
    """A request that could not connect to the store (retried; see :func:`no_connection`)."""


#: what a failure to connect is called by aiohttp, botocore and the standard library
_NO_CONNECTION = {"ClientConnectorError", "EndpointConnectionError", "ConnectionRefusedError", "gaierror"}


def no_connection(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure to connect to the store at all (no answer of any
    kind): refused, unknown host, no route to it."""
    if isinstance(exc, Unreached) or {cls.__name__ for cls in type(exc).__mro__} & _NO_CONNECTION:
        return True
    return isinstance(exc, OSError) and exc.errno in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH)


class MissingBucketError(SourceMissingError):
    """An S3 answer ``NoSuchBucket``: the bucket a URL names does not exist (at this
    endpoint), so neither does any file in it (``bucket`` names it)."""

    def __init__(self, url: str) -> None:
        self.url, self.bucket = url, url.split("://", 1)[-1].split("/", 1)[0]
        super().__init__(
            f"{url}: no such bucket {self.bucket!r} (the store says it does not exist): check the "
            "bucket's name in the URL and the endpoint_url in storage_options"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.url,)


def missing(url: str, code: str = "") -> FileNotFoundError:
    """A missing file; ``code`` an S3 error code (``NoSuchBucket``: its bucket is missing)."""
    if code == "NoSuchBucket":
        return MissingBucketError(url)
    return SourceMissingError(f"{url}: no such file (named by the source's urls)")


READ_ONLY = ("http", "https", "hf")  # stores distshard never writes to


def read_only(url: str) -> UnsupportedError:
    """A write asked of an http(s) or hf:// URL (read-only): where to write instead."""
    if url.split("://", 1)[0].lower() == "hf":
        return UnsupportedError(
            f"cannot write {url}: hf:// (the Hugging Face Hub) is read-only: give --out a local folder or an "
            "object store location (s3://, gs://) and pass it to the source as index="
        )
    return UnsupportedError(
        f"cannot write {url}: http(s) URLs are read-only; give --out a local folder or an "
        "object store location (s3://, gs://) and serve it beside the files"
    )


def index_command(location: str, refresh: bool = True) -> str:
    """The command that refreshes (``refresh``) or completes the stored index at
    ``location``: run on that folder or into it, or, for an index served over
    http(s) (read-only), into a local folder served there afterwards."""
    if location.split("://", 1)[0].lower() == "hf":
        return "`python -m distshard index URLS --out DIR` into a folder DIR (hf:// is read-only), then index=DIR"
    if location.split("://", 1)[0].lower() in ("http", "https"):
        return (
            "`python -m distshard index URLS --out DIR` into a local folder DIR (http(s) is read-only), "
            f"then serve DIR as {location}"
        )
    return (
        f"`python -m distshard index {location}`" if refresh else f"`python -m distshard index URLS --out {location}`"
    )


def changed_error(url: str, what: str, stored: str | None = None) -> ValueError:
    """A file that is no longer the indexed version; ``stored``: the stored index
    (``python -m distshard index``) its identity came from, whose refresh is named."""
    if stored is not None:  # the entry's URL: the index is its folder
        location = stored.rsplit("/", 1)[0]
        return SourceChangedError(
            f"{url} changed after the stored index at {location} was written ({what}); refusing to read it "
            f"with a stale index: refresh it with {index_command(location)}"
        )
    return SourceChangedError(
        f"{url} changed after it was indexed ({what}); refusing to read it with a stale index: "
        "build the source again (the index is rebuilt for the new file)"
    )


CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")
RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}
S3_RETRY_CODES = {
    "SlowDown",
    "InternalError",
    "ServiceUnavailable",
    "RequestTimeout",
    "Throttling",
    "ThrottlingException",
    "RequestTimeTooSkewed",
    "500",
    "502",
    "503",
    "504",
}


def http_stamp(headers: Mapping[str, str]) -> str:
    """The version an HTTP answer names: a strong ETag alone; a weak one
    (``W/"..."``, which ``If-Match`` cannot check) with `` lm:`` and the
    Last-Modified; else ``lm:`` and the Last-Modified."""
    etag, modified = headers.get("ETag") or "", headers.get("Last-Modified") or ""
    if etag and strong_etag(etag) is None and modified:
        return f"{etag} lm:{modified}"
    return etag or (f"lm:{modified}" if modified else "")


def stamp_parts(stamp: str) -> tuple[str, str]:
    """``(ETag, Last-Modified)`` of a stamp made by :func:`http_stamp` (``""`` for none)."""
    if stamp.startswith("lm:"):
        return "", stamp[3:]
    etag, _, modified = stamp.partition(" lm:")
    return etag, modified


def opaque(etag: str) -> str:
    """An ETag without its weakness marker: weak comparison (RFC 9110 8.8.3.2)."""
    return etag[2:] if etag.startswith("W/") else etag


def http_change(stamp: str | None, headers: Mapping[str, str]) -> str | None:
    """What tells that an HTTP answer is of another version than ``stamp`` (the
    indexed one), or ``None``: a strong ETag compared exactly, a weak one by weak
    comparison, the Last-Modified recorded with a weak ETag or alone compared."""
    if not stamp:
        return None
    etag, modified = stamp_parts(stamp)
    seen = headers.get("ETag")
    if etag and seen and (seen != etag if strong_etag(etag) else opaque(seen) != opaque(etag)):
        return f"ETag {etag} -> {seen}"
    seen_modified = headers.get("Last-Modified")
    if modified and seen_modified and seen_modified != modified:
        return f"Last-Modified {modified} -> {seen_modified}"
    return None


def strong_etag(stamp: str | None) -> str | None:
    """The ETag to send as ``If-Match`` (a strong one, ``"..."``), if ``stamp`` is one."""
    if stamp and stamp.startswith('"') and stamp.endswith('"') and len(stamp) >= 2:
        return stamp
    return None


class Pending:
    """The future of a range read (see ``Client.submit_range``)."""

    __slots__ = ("future", "what", "bound")

    def __init__(self, future: "concurrent.futures.Future[tuple[bool, Any]]", what: str, bound: float) -> None:
        self.future, self.what, self.bound = future, what, bound

    def result(self, timeout: float | None = None) -> bytes:
        """The bytes; waits at most ``timeout`` (default: the read's bound), then
        raises :class:`RemoteReadTimeout`."""
        limit = self.bound if timeout is None else timeout
        try:
            ok, value = self.future.result(limit)
        except concurrent.futures.TimeoutError:
            raise RemoteReadTimeout(
                f"{self.what}: no answer within {limit:g} s (the client's event loop is stuck)"
            ) from None
        if not ok:
            raise value
        return value

    def cancel(self) -> bool:
        return self.future.cancel()


def looks_transient(exc: BaseException) -> bool:
    names = {cls.__name__ for cls in type(exc).__mro__}
    transient = {
        "ClientError",
        "ClientConnectionError",
        "ClientPayloadError",
        "ServerDisconnectedError",
        "ClientOSError",
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "IncompleteReadError",
        "ResponseStreamingError",
        "HTTPClientError",
        "ConnectionError",
        "TimeoutError",
        "ProtocolError",
    }
    if "ClientResponseError" in names:
        return getattr(exc, "status", 0) in RETRY_STATUS
    return (
        bool(names & transient)
        or isinstance(exc, OSError)
        and not isinstance(exc, (FileNotFoundError, PermissionError))
    )


def check_status(url: str, status: int, what: str) -> None:
    if status in (200, 206):
        return
    if status == 404:
        raise missing(url)
    if status in (401, 403):
        raise PermissionError(
            f"{url}: access denied (HTTP {status}) reading {what}: check the credentials "
            "or headers given in storage_options"
        )
    if status == 416:
        raise Changed(f"the server says {what} is beyond the end of the file (HTTP 416)")
    if status in RETRY_STATUS or status >= 500:
        raise Transient(f"HTTP {status}")
    raise ValueError(f"{url}: HTTP {status} reading {what}")


def check_content_range(url: str, header: str | None, start: int, stop: int, size: int | None) -> None:
    match = CONTENT_RANGE.match(header or "")
    if match is None:
        raise UnsupportedError(
            f"{url}: asked for bytes [{start}, {stop}) and the answer has no Content-Range "
            f"({header!r}): the server does not serve range requests"
        )
    first, last, total = int(match.group(1)), int(match.group(2)), match.group(3)
    if size is not None and total != "*" and int(total) != size:
        raise Changed(f"size {size} -> {total}")
    if (first, last + 1) != (start, stop):
        raise Changed(f"asked for bytes [{start}, {stop}), the server sent [{first}, {last + 1})")


def suffix_answer(status: int, content_range: str | None, length: str | None, n: int) -> tuple[int, int] | None:
    """What the answer to a suffix range (``Range: bytes=-n``) holds: ``(first
    byte, file size)`` when its body is the file's last ``min(n, size)`` bytes (a
    206 whose ``Content-Range`` is exactly that suffix, with the total; or a 200 of
    at most ``n`` bytes: the whole file, from a server that ignores ``Range``), else
    ``None``: a server that refuses or misreads suffix ranges, or a whole body too
    large to want, whose file's identity is then asked the old way (a HEAD)."""
    if status == 206:
        match = CONTENT_RANGE.match(content_range or "")
        if match is None or match.group(3) == "*":
            return None
        first, last, total = int(match.group(1)), int(match.group(2)), int(match.group(3))
        if last != total - 1 or first != max(0, total - n):
            return None
        return first, total
    if status == 200 and length is not None and length.strip().isdigit() and int(length) <= n:
        return 0, int(length)
    return None


def exact(url: str, data: bytes, start: int, stop: int) -> bytes:
    if len(data) != stop - start:
        raise Transient(f"a short body: {len(data)} of {stop - start} bytes")
    return bytes(data)


def s3_error(url: str, what: str, code: str, status: int) -> Exception | None:
    """What an S3 error answer (its ``Code`` and HTTP status) means: a changed
    object, a missing one, a refusal, a transient failure, or ``None`` (none of
    these: the caller raises the store's own error)."""
    if code in ("PreconditionFailed", "412") or status == 412:
        return Changed("the store's version no longer matches the indexed ETag")
    if code in ("NoSuchKey", "NoSuchBucket", "404", "NotFound") or status == 404:
        return missing(url, code)
    if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch") or status == 403:
        return PermissionError(
            f"{url}: access denied ({code or status}) reading {what}: check the credentials in "
            "storage_options or the environment"
        )
    if code == "InvalidRange" or status == 416:
        return Changed(f"{what} is beyond the end of the object")
    if code in S3_RETRY_CODES or status >= 500 or status == 429:
        return Transient(f"{code or status}")
    return None


#: the attribute a retry's log record carries: the request retried (URL and what was asked)
RETRY = "distshard_retry"

#: seconds after which a client's first request in this process is logged as slow
SLOW_FIRST_REQUEST = 2.0


class FirstRequest:
    """A client's first request in this process, timed from the start of its first
    attempt to that attempt's outcome, whatever it is: an answer, an error status
    (the 404 of the look for a stored index's manifest, usually a job's first
    request), a failure to connect, no answer. Logged as a WARNING when it took
    :data:`SLOW_FIRST_REQUEST` seconds or more (the client's set-up included:
    connection, TLS, credentials); later requests are not timed."""

    __slots__ = ("protocol", "pending", "lock")

    def __init__(self, protocol: str) -> None:
        self.protocol, self.pending, self.lock = protocol, True, threading.Lock()

    def done(self, attempts: Attempts, failure: BaseException | None = None) -> None:
        """The outcome of an attempt of ``attempts`` (``failure`` ``None``: answered)."""
        if not self.pending:
            return
        with self.lock:
            if not self.pending:
                return
            self.pending = False
        seconds = time.monotonic() - attempts.started
        if seconds < SLOW_FIRST_REQUEST:
            return
        if failure is None:
            outcome = "answered"
        elif isinstance(failure, (TimeoutError, concurrent.futures.TimeoutError)) and not str(failure):
            outcome = f"no answer within {attempts.options.timeout:g} s"
        else:
            outcome = f"failed: {type(failure).__name__}: {failure}"
        log.warning(
            "the first request to %s:// in this process took %.1f s (%s %s: %s; client set-up included)",
            self.protocol,
            seconds,
            attempts.url,
            attempts.what,
            outcome,
        )


class Attempts:
    """One request's retries, whichever client runs them: each failure is
    classified (:meth:`failed`: a changed file, a missing one, a refusal or a bad
    argument raise at once; a transient one is recorded), the next wait is given
    (exponential backoff from 50 ms, jittered, at most 5 s) while ``retries`` and
    ``retry_seconds`` allow, then :meth:`error` names the URL, what was asked,
    the attempts and the last failure. ``first``: the client's :class:`FirstRequest`,
    told every outcome (:meth:`answered`, :meth:`failed`)."""

    __slots__ = ("url", "what", "options", "stored", "started", "delay", "failures", "first", "reached")

    def __init__(
        self, url: str, what: str, options: ReadOptions, stored: str | None = None, first: FirstRequest | None = None
    ) -> None:
        self.url, self.what, self.options, self.stored = url, what, options, stored
        self.started = time.monotonic()
        self.delay = 0.05
        self.failures: list[str] = []
        self.first = first
        self.reached = False  # whether an attempt got further than failing to connect

    def answered(self) -> None:
        """An attempt succeeded."""
        if self.first is not None:
            self.first.done(self)

    def failed(self, exc: BaseException) -> float | None:
        """Record ``exc`` (raised from here when it is not worth retrying); the
        seconds to wait before the next attempt, or ``None`` when none is left."""
        if self.first is not None:
            self.first.done(self, exc)
        if isinstance(exc, Changed):
            raise changed_error(self.url, str(exc), self.stored) from None
        if isinstance(exc, Transient):
            self.failures.append(str(exc))
        elif isinstance(exc, (TimeoutError, concurrent.futures.TimeoutError)):
            self.failures.append(f"no answer within {self.options.timeout:g} s")
        elif isinstance(exc, (ValueError, FileNotFoundError, PermissionError, ImportError, TypeError)):
            raise exc
        elif isinstance(exc, Exception) and looks_transient(exc):
            self.failures.append(f"{type(exc).__name__}: {exc}")
        else:
            raise exc
        self.reached = self.reached or not no_connection(exc)
        elapsed = time.monotonic() - self.started
        if len(self.failures) > self.options.retries or elapsed + self.delay > self.options.retry_seconds:
            return None
        log.warning(
            "retrying %s %s (attempt %d failed: %s)",
            self.url,
            self.what,
            len(self.failures),
            self.failures[-1],
            extra={RETRY: f"{self.url} {self.what}"},
        )
        wait = self.delay * (0.5 + random.random() / 2)
        self.delay = min(self.delay * 2, 5.0)
        return wait

    def error(self) -> RemoteReadError:
        n = len(self.failures)
        if not self.reached:
            return StoreUnreachable(
                f"{self.url}: {self.what}: could not connect to the store ({n} attempt{'s' if n != 1 else ''} in "
                f"{time.monotonic() - self.started:.1f} s; last: {self.failures[-1] if self.failures else '?'}): "
                "check the host in the URL, the endpoint_url in storage_options and the network"
            )
        return RemoteReadError(
            f"{self.url}: {self.what}: {n} attempt{'s' if n != 1 else ''} failed in "
            f"{time.monotonic() - self.started:.1f} s (retries={self.options.retries}, retry_seconds="
            f"{self.options.retry_seconds:g}); last: {self.failures[-1] if self.failures else '?'}"
        )


class Deferred:
    """A future-like read (``result()``, ``cancel()``) that runs when its result is
    first asked for (local files: no thread, one ``pread`` per range at the moment
    it is needed)."""

    __slots__ = ("_read", "_value", "_error")

    def __init__(self, read: Callable[[], bytes]) -> None:
        self._read: Callable[[], bytes] | None = read
        self._value: bytes | None = None
        self._error: BaseException | None = None

    def result(self, timeout: float | None = None) -> bytes:
        read, self._read = self._read, None
        if read is not None:
            try:
                self._value = read()
            except BaseException as exc:  # noqa: BLE001 - raised to every caller
                self._error = exc
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def cancel(self) -> bool:
        self._read = None
        return True
