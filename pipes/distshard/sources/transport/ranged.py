"""What every remote client writes once over its own requests.

:class:`.remote.Client` (fsspec: its requests are coroutines on the filesystem's
event loop) and :class:`.s3direct.DirectS3Client` (``http.client``: its requests
block a thread of its pool) differ in how one request is made and waited for;
the rest is :class:`Ranged`'s: a range read and a whole file over the file's
identity, the suffix GET of :meth:`Ranged.tail` and the stores that refuse it
(remembered), every request retried by one loop (:func:`retried`, or
:func:`retried_async` on an event loop) over :class:`.responses.Attempts`, and
what a ranged answer must hold (:func:`check_range_answer`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any, Awaitable, Callable, TypeVar

from ..read_options import ReadOptions
from .responses import Attempts, Changed, Pending, check_content_range, strong_etag, wait_bound

__all__ = ["Ranged", "check_range_answer", "range_header", "retried", "retried_async", "s3_stamp"]

log = logging.getLogger("distshard")

T = TypeVar("T")

_DEFAULT = ReadOptions()


def retried(attempts: Attempts, attempt: Callable[[], T]) -> T:
    """``attempt()`` until it answers, or :class:`.responses.Attempts` says no more (in this thread)."""
    while True:
        try:
            value = attempt()
            attempts.answered()
            return value
        except Exception as exc:  # noqa: BLE001 - classified (and raised when not transient) by Attempts
            wait = attempts.failed(exc)
        if wait is None:
            raise attempts.error()
        time.sleep(wait)


async def retried_async(attempts: Attempts, attempt: Callable[[], Awaitable[T]], timeout: float) -> T:
    """``await attempt()`` (each within ``timeout``) until it answers, or Attempts says no more."""
    while True:
        try:
            value = await asyncio.wait_for(attempt(), timeout)
            attempts.answered()
            return value
        except asyncio.TimeoutError:
            wait = attempts.failed(TimeoutError())
        except Exception as exc:  # noqa: BLE001 - classified (and raised when not transient) by Attempts
            wait = attempts.failed(exc)
        if wait is None:
            raise attempts.error()
        await asyncio.sleep(wait)


def range_header(start: int, stop: int) -> str:
    """The ``Range`` of bytes ``[start, stop)``."""
    return f"bytes={start}-{stop - 1}"


def check_range_answer(
    url: str, start: int, stop: int, size: int | None, stamp: str | None, seen: str | None, content_range: str | None
) -> None:
    """What an S3 answer to a range GET must hold: the ETag asked for (``If-Match``,
    when ``stamp`` is a strong one) and the ``Content-Range`` of those bytes of a
    file of ``size`` bytes."""
    etag = strong_etag(stamp)
    if etag is not None and seen and seen != etag:
        raise Changed(f"ETag {stamp} -> {seen}")
    check_content_range(url, content_range, start, stop, size)


def s3_stamp(fields: Any, version: str = "VersionId") -> str:
    """An S3 object's stamp, as botocore returns it: the ETag (quotes included), else its version id."""
    return str(fields.get("ETag") or fields.get(version) or "")


class Ranged:
    """The behaviour both clients share; each provides how one request is made
    (``_identity``, ``_get``, ``_fetch``, ``_open``, ``_listing``, ``_suffix``:
    the attempts, given the options), run and waited for (:meth:`_retried`,
    :meth:`_in_background`), and which host a suffix range is remembered for."""

    protocol: str
    _no_suffix: set[str]  # hosts (buckets) that did not answer a suffix range (see tail)

    # -- how a client runs its requests ------------------------------------------------------
    def _retried(
        self, url: str, what: str, attempt: Callable[[], Any], options: ReadOptions, stored: str | None = None
    ) -> Any:
        """``attempt`` retried, waited for here."""
        raise NotImplementedError

    def _in_background(
        self, url: str, what: str, attempt: Callable[[], Any], options: ReadOptions, stored: str | None
    ) -> concurrent.futures.Future[tuple[bool, Any]]:
        """``attempt`` retried, in the background: ``(True, value)`` or ``(False, error)``."""
        raise NotImplementedError

    def suffix_host(self, url: str) -> str | None:
        """What a refused suffix range is remembered for (``None``: suffix ranges are not asked)."""
        return url.split("://", 1)[-1].split("/", 1)[0]

    # -- what every client offers ------------------------------------------------------------
    def identity(self, url: str, options: ReadOptions = _DEFAULT) -> tuple[int, str]:
        """``(size, stamp)`` of ``url`` now: one metadata request (retried)."""
        found: tuple[int, str] = self._retried(url, "metadata", lambda: self._identity(url, options), options)
        return found

    def tail(self, url: str, n: int, options: ReadOptions = _DEFAULT) -> tuple[int, str, bytes]:
        """``(size, stamp, last bytes)`` of ``url`` from one suffix GET (``Range:
        bytes=-n``, retried): the identity from the answer's headers, exactly as a
        HEAD gives it (the size from ``Content-Range``'s total), and the file's last
        ``min(n, size)`` bytes from its body. A store that ignores or refuses suffix
        ranges (remembered per host or bucket), and stores that are not asked them,
        are asked the identity the old way (:meth:`identity`), and the bytes are ``b""``."""
        host = self.suffix_host(url)
        if host is not None and host not in self._no_suffix:
            what = f"the last {n} bytes"
            found: tuple[int, str, bytes] | None = self._retried(
                url, what, lambda: self._suffix(url, n, what, options), options
            )
            if found is not None:
                return found
            self._no_suffix.add(host)
            log.debug("%s answered no suffix range: its files' identities are asked with a HEAD", host)
        return (*self.identity(url, options), b"")

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
        """Bytes ``[start, stop)`` of ``url``, checked against ``(size, stamp)``
        (the indexed identity; ``None`` skips the check; ``stored``: the stored
        index it came from, named when it is stale), retried; a future-like
        object (``result()``, ``cancel()``)."""
        what = f"bytes [{start}, {stop})"
        if stop <= start:
            future: concurrent.futures.Future[tuple[bool, Any]] = concurrent.futures.Future()
            future.set_result((True, b""))
        else:
            get = lambda: self._get(url, start, stop, size, stamp, options)  # noqa: E731
            future = self._in_background(url, what, get, options, stored)
        return Pending(future, f"{url}: {what}", wait_bound(options))

    def read_range(
        self, url: str, start: int, stop: int, size: int | None, stamp: str | None, options: ReadOptions = _DEFAULT
    ) -> bytes:
        return self.submit_range(url, start, stop, size, stamp, options).result()

    def cat(self, url: str, options: ReadOptions = _DEFAULT) -> bytes:
        size, stamp = self.identity(url, options)
        return self.read_range(url, 0, size, size, stamp, options) if size else b""

    def fetch(self, url: str, options: ReadOptions = _DEFAULT) -> bytes:
        """The whole object in one request (no metadata request first), retried;
        ``FileNotFoundError`` if there is none. For small files named by
        convention (a stored index's manifest and entries)."""
        data: bytes = self._retried(url, "the whole file", lambda: self._fetch(url, options), options)
        return data

    def open_stream(self, url: str, options: ReadOptions = _DEFAULT) -> tuple[Any, int, str]:
        """One GET of the whole object, its opening retried: ``(stream, size,
        stamp)``, the identity from the response (as a HEAD would give it) and a
        stream whose ``read(n)`` returns up to ``n`` bytes of the body (fewer only
        at its end) and ``close(whole)`` releases it."""
        return self._retried(url, "the whole file", lambda: self._open(url, options), options)

    def list_identities(
        self, folder: str, prefix: str, last: str, options: ReadOptions = _DEFAULT
    ) -> dict[str, tuple[int, str]]:
        """``{name: (size, ETag)}`` of the objects of the S3 folder URL ``folder``
        whose names (after the folder's ``/``) start with ``prefix``, up to the name
        ``last``: ListObjectsV2 pages of 1,000 objects, the ETag as a HEAD gives it."""
        found: dict[str, tuple[int, str]] = self._retried(
            folder, "a listing", lambda: self._listing(folder, prefix, last, options), options
        )
        return found

    # -- one attempt of each (the client's own) ----------------------------------------------
    def _identity(self, url: str, options: ReadOptions) -> Any:
        raise NotImplementedError

    def _suffix(self, url: str, n: int, what: str, options: ReadOptions) -> Any:
        raise NotImplementedError

    def _get(self, url: str, start: int, stop: int, size: int | None, stamp: str | None, options: ReadOptions) -> Any:
        raise NotImplementedError

    def _fetch(self, url: str, options: ReadOptions) -> Any:
        raise NotImplementedError

    def _open(self, url: str, options: ReadOptions) -> Any:
        raise NotImplementedError

    def _listing(self, folder: str, prefix: str, last: str, options: ReadOptions) -> Any:
        raise NotImplementedError
