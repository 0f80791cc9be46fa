"""HTTP(S) requests over aiohttp, through fsspec's ``HTTPFileSystem`` (its session, its client options).

One coroutine per kind of request :class:`.remote.Client` makes on an ``http``
store: the identity (a HEAD, or a one-byte range where a signed URL allows GET
only), a suffix range (a file's identity and last bytes in one GET), a range
checked against the indexed identity (``If-Match`` with a strong ETag; the
answer's ETag, Last-Modified and ``Content-Range`` compared), a whole file and
the opening of a streamed GET. Every request asks ``Accept-Encoding: identity``
(a compressed body has another size) and follows redirects.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from ...errors import UnsupportedError
from .ranged import range_header
from .responses import (
    CONTENT_RANGE,
    RETRY_STATUS,
    Changed,
    Transient,
    check_content_range,
    check_status,
    exact,
    http_change,
    http_stamp,
    strong_etag,
    suffix_answer,
)

__all__ = ["http_identity", "http_open", "http_range", "http_suffix", "http_whole"]

_TOTAL_ONLY = re.compile(r"bytes \*/(\d+)")


def _request(fs: Any, session: Any, method: str, url: str, extra: Mapping[str, str]) -> Any:
    """One request of ``fs``'s session (``async with`` it, or await it): the
    filesystem's own headers and client options, ``extra`` headers over them."""
    kw = dict(fs.kwargs)
    headers = {**(kw.pop("headers", None) or {}), **extra, "Accept-Encoding": "identity"}
    kw.setdefault("allow_redirects", True)
    return (session.head if method == "HEAD" else session.get)(fs.encode_url(url), headers=headers, **kw)


def _identity_encoded(headers: Mapping[str, str]) -> bool:
    return headers.get("Content-Encoding", "identity") in ("identity", "")


async def _body(r: Any) -> bytes:
    try:
        return bytes(await r.read())
    except Exception as exc:  # noqa: BLE001 - a cut body: retried
        raise Transient(f"the body was cut: {type(exc).__name__}: {exc}") from None


async def http_identity(fs: Any, url: str) -> tuple[int, str]:
    """``(size, stamp)``: a HEAD; a one-byte range where the HEAD is refused (403, 405)."""
    session = await fs.set_session()
    async with _request(fs, session, "HEAD", url, {}) as r:
        if r.status not in (403, 405):  # some signed URLs allow GET only: ask with a 1-byte range
            check_status(url, r.status, "metadata")
            size = r.headers.get("Content-Length")
            if size is None or not _identity_encoded(r.headers):
                raise UnsupportedError(f"{url}: the server does not report the file's size; random access needs it")
            return int(size), http_stamp(r.headers)
    async with _request(fs, session, "GET", url, {"Range": "bytes=0-0"}) as r:
        said = r.headers.get("Content-Range", "")
        match = CONTENT_RANGE.match(said) or _TOTAL_ONLY.match(said)
        if r.status not in (206, 416) or match is None or not match.groups()[-1].isdigit():
            check_status(url, r.status, "metadata")
            raise UnsupportedError(f"{url}: the server reports no size (no Content-Range); random access needs it")
        await r.read()
        return int(match.groups()[-1]), http_stamp(r.headers)


async def http_suffix(fs: Any, url: str, n: int, what: str) -> tuple[int, str, bytes] | None:
    """``(size, stamp, last bytes)`` from a ``Range: bytes=-n`` GET, or ``None`` where it is not answered."""
    session = await fs.set_session()
    async with _request(fs, session, "GET", url, {"Range": f"bytes=-{n}"}) as r:
        if r.status in (401, 403, 404) or r.status in RETRY_STATUS or r.status >= 500 and r.status != 501:
            check_status(url, r.status, what)
        found = None
        if _identity_encoded(r.headers):
            found = suffix_answer(r.status, r.headers.get("Content-Range"), r.headers.get("Content-Length"), n)
        if found is None:
            r.close()  # its body (maybe the whole file) is not wanted
            return None
        data = await _body(r)
        first, size = found
        return size, http_stamp(r.headers), exact(url, data, first, size)


async def http_range(fs: Any, url: str, start: int, stop: int, size: int | None, stamp: str | None) -> bytes:
    """Bytes ``[start, stop)``, checked against ``(size, stamp)``."""
    session = await fs.set_session()
    extra = {"Range": range_header(start, stop)}
    etag = strong_etag(stamp)
    if etag is not None:
        extra["If-Match"] = etag
    what = f"bytes [{start}, {stop})"
    async with _request(fs, session, "GET", url, extra) as r:
        if r.status == 412:
            raise Changed(f"the server's version no longer matches ETag {stamp}")
        check_status(url, r.status, what)
        change = http_change(stamp, r.headers)
        if change is not None:
            raise Changed(change)
        if r.status == 206:
            check_content_range(url, r.headers.get("Content-Range"), start, stop, size)
        elif not (r.status == 200 and start == 0 and size is not None and stop == size):
            raise UnsupportedError(
                f"{url}: asked for {what} and the server sent status {r.status} without "
                "Content-Range: it does not serve range requests, which random access needs"
            )
        data = await _body(r)
    return exact(url, data, start, stop)


async def http_whole(fs: Any, url: str) -> bytes:
    """The whole file in one GET."""
    session = await fs.set_session()
    async with _request(fs, session, "GET", url, {}) as r:
        check_status(url, r.status, "the whole file")
        return await _body(r)


async def http_open(fs: Any, url: str) -> tuple[Any, int, str]:
    """The response of one GET of the whole file, its body unread, with ``(size, stamp)``."""
    session = await fs.set_session()
    r = await _request(fs, session, "GET", url, {})
    try:
        check_status(url, r.status, "the whole file")
        size = r.headers.get("Content-Length")
        if size is None or not _identity_encoded(r.headers):
            raise UnsupportedError(f"{url}: the server does not report the file's size; random access needs it")
        return r, int(size), http_stamp(r.headers)
    except BaseException:
        r.close()
        raise
