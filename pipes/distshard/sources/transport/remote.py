"""Remote files (``s3://``, ``gs://``, ``http(s)://``, ...) through fsspec.

fsspec is an optional extra: ``pip install distshard[remote]`` (``http(s)``;
it brings aiohttp) or ``distshard[s3]`` (s3fs), ``gcsfs`` for ``gs://``.
``storage_options`` are handed to the filesystem as fsspec takes them; the
environment (``AWS_*``, ...) keeps working as it does for fsspec. An ``s3://``
client is :mod:`.s3direct`'s (``http.client``, no s3fs on the path) when its
outcome is certainly s3fs's (``DISTSHARD_S3_CLIENT``: ``auto``, ``s3fs``,
``direct``; see :func:`.clients.client_for`, which makes each process's clients); what answers mean and the retries are
shared with it in :mod:`.answers`.

What this module adds to fsspec:

* **Range reads checked against the indexed identity.** A file's size and
  version (ETag, generation, modification time) are asked once per job, when
  the source is indexed, and travel with the pipe into the DataLoader workers.
  Every range response is then checked against them for free: HTTP and S3 send
  ``If-Match: <ETag>`` when the ETag is strong (the store answers 412 if the
  object changed) and the response's ``Content-Range`` total and ``ETag`` must
  match; a weak ETag (``W/"..."``, which ``If-Match`` cannot check) is compared
  on every response (weak comparison), and so is the Last-Modified recorded with
  it or alone; a changed file raises ``ValueError`` instead of mixing two versions. Other stores are checked
  once per process and file (a metadata request).
* **Retries.** Transient failures (5xx, 429, a reset connection, a short body,
  a timeout) are retried with exponential backoff, bounded in count and time
  (``ReadOptions.retries`` / ``retry_seconds`` / ``timeout``), then raise
  :class:`RemoteReadError` naming the URL and the byte range.
* **Fork safety.** Clients are per process (:mod:`.clients`: a forked child
  never uses, closes or garbage-collects what it inherited). What the parent
  learnt that holds no connection nor event loop is reused: an ``s3://`` client
  in the child is made from the parent's aiobotocore session
  (:meth:`Client.shareable_session`: its resolved credentials and the parsed
  service model, endpoint rules and partitions: about 0.4 s of CPU per process
  otherwise), with fresh locks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import re
import threading
from typing import Any, Awaitable, Callable, Mapping, TypeVar

from ...errors import UnsupportedError
from ..read_options import ReadOptions
from .responses import CONTENT_RANGE as _CONTENT_RANGE
from .responses import (
    RETRY_STATUS,
    Attempts,
    FirstRequest,
    RemoteReadError,
    RemoteReadTimeout,
    http_change,
    read_only,
    s3_error,
    wait_bound,
)
from .responses import Changed as _Changed
from .responses import Pending as _Pending
from .responses import Transient as _Transient
from .responses import check_content_range as _check_content_range
from .responses import check_status as _check_status
from .responses import exact as _exact
from .responses import http_stamp as _http_stamp
from .responses import missing as _missing
from .responses import strong_etag as _strong_etag
from .responses import suffix_answer as _suffix_answer

log = logging.getLogger("distshard")

__all__ = ["STATS", "Client", "RemoteReadError", "RemoteReadTimeout", "exact_cat", "reset_stats"]

T = TypeVar("T")

_DEFAULT = ReadOptions()


def _import_fsspec(url: str) -> Any:
    try:
        import fsspec
    except ImportError:
        raise ImportError(
            f"reading the remote URL {url!r} needs fsspec: `pip install distshard[remote]` "
            "(distshard[s3] for s3://; gcsfs for gs://)"
        ) from None
    return fsspec


class ClientStats:
    """What this process spent on clients (per process; a forked child starts at 0):
    ``filesystems`` made, ``sessions_reused`` (an ``s3://`` filesystem made from the
    session its parent process had, see the module docstring)."""

    __slots__ = ("filesystems", "sessions_reused")

    def __init__(self) -> None:
        self.filesystems = 0
        self.sessions_reused = 0

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


STATS = ClientStats()


def reset_stats() -> None:
    """A forked child starts at 0 (see :data:`STATS`)."""
    global STATS
    STATS = ClientStats()


def _fresh_locks(session: Any) -> Any:
    """``session`` (an aiobotocore session inherited through fork) with new locks
    where it holds one: refreshable credentials keep an ``asyncio.Lock`` that may be
    bound to the parent's event loop, or held by the parent's thread at the fork."""
    credentials: Any = getattr(session, "_credentials", None)
    make = getattr(credentials, "_create_lock", None)
    if make is not None and hasattr(credentials, "_refresh_lock"):
        credentials._refresh_lock = make()
    return session


# -- the client -----------------------------------------------------------------------------


async def _read_body(body: Any) -> bytes:
    """An S3 answer's whole body; a body cut on the way is transient (retried)."""
    try:
        data: bytes = await body.read()
        return data
    except Exception as exc:  # noqa: BLE001 - whatever the transport raised
        raise _Transient(f"the body was cut: {type(exc).__name__}: {exc}") from None


class Client:
    """fsspec's filesystem for one protocol and set of storage options, in one process.

    ``kind`` is ``http`` (``HTTPFileSystem``), ``s3`` (``s3fs``) or ``generic``
    (anything else fsspec reads: ``cat_file`` plus a metadata check per process
    and file). Blocking calls run on the filesystem's event loop."""

    def __init__(self, url: str, protocol: str, storage_options: dict[str, Any], inherited_session: Any = None) -> None:
        self.protocol = protocol
        self.storage_options = storage_options
        self.pid = os.getpid()
        fsspec = _import_fsspec(url)
        try:
            cls = fsspec.get_filesystem_class(protocol)
        except (ImportError, ValueError) as exc:
            hint = {
                "s3": "distshard[s3] (s3fs)",
                "s3a": "distshard[s3] (s3fs)",
                "gs": "gcsfs",
                "gcs": "gcsfs",
                "http": "distshard[remote] (aiohttp)",
                "https": "distshard[remote] (aiohttp)",
            }.get(protocol)
            more = f": `pip install {hint}`" if hint else ""
            raise ImportError(f"reading {url!r} needs the fsspec filesystem for {protocol}://{more} ({exc})") from None
        self.kind = (
            "http" if cls.__name__ == "HTTPFileSystem" else "s3" if cls.__name__ == "S3FileSystem" else "generic"
        )
        self._cls = cls
        # an s3 client of a forked child: the parent's aiobotocore session (see the module docstring)
        self._inherited = inherited_session if self.kind == "s3" and "session" not in storage_options else None
        self._fs: Any = None
        self._fs_lock = threading.Lock()  # threads that index files at once make one filesystem
        self._checked: dict[str, tuple[int, str]] = {}  # generic stores: identity checked per process
        self._semaphores: dict[int, asyncio.Semaphore] = {}
        self._first = FirstRequest(protocol)  # the first request is timed (a slow one is logged)
        self._no_suffix: set[str] = set()  # hosts (buckets) that did not answer a suffix range (see tail)

    @property
    def fs(self) -> Any:
        if self._fs is None:
            with self._fs_lock:
                if self._fs is None:
                    options = dict(self.storage_options)
                    if self._inherited is not None:
                        options["session"] = _fresh_locks(self._inherited)
                        STATS.sessions_reused += 1
                    self._fs = self._cls(skip_instance_cache=True, **options)
                    STATS.filesystems += 1
        return self._fs

    def warm(self) -> None:
        """Make the filesystem and, for ``http`` and ``s3``, its session and client
        (credentials resolved), as the first request would."""
        fs = self.fs
        if self.kind in ("http", "s3"):
            self.run(fs.set_session(), f"{self.protocol}://: starting the client")

    def shareable_session(self) -> Any:
        """What a forked child may build its own client from: the aiobotocore session
        of an ``s3`` filesystem that made its client (credentials resolved, service
        model parsed; no connection, no event loop), else ``None``."""
        fs = self._fs
        if self.kind != "s3" or fs is None or getattr(fs, "_s3", None) is None:
            return None
        return getattr(fs, "session", None)

    def made_filesystem(self) -> Any:
        """The filesystem if it was made (what a forked child keeps alive, never closing it), else ``None``."""
        return self._fs

    def path_of(self, url: str) -> str:
        return url if self.kind == "http" else self.fs._strip_protocol(url)

    # -- running coroutines on the filesystem's loop ------------------------------------------
    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        fs = self.fs
        loop = getattr(fs, "loop", None)
        if loop is None:
            from fsspec.asyn import get_loop

            loop = get_loop()
        return loop

    def submit(self, coro: Awaitable[T]) -> "concurrent.futures.Future[T]":
        return asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]

    def run(self, coro: Awaitable[T], what: str = "a request", options: ReadOptions = _DEFAULT) -> T:
        bound = wait_bound(options)
        future = self.submit(coro)
        try:
            return future.result(bound)
        except concurrent.futures.TimeoutError:
            if future.done():  # the request's own error
                raise
            future.cancel()
            raise RemoteReadTimeout(
                f"{what}: no answer within {bound:g} s (the client's event loop is stuck)"
            ) from None

    # -- identity ------------------------------------------------------------------------------
    def identity(self, url: str, options: ReadOptions = _DEFAULT) -> tuple[int, str]:
        """``(size, stamp)`` of ``url`` now: one metadata request (retried)."""
        return self.run(
            self._retrying(url, "metadata", lambda: self._identity(url), options), f"{url}: metadata", options
        )

    async def _identity(self, url: str) -> tuple[int, str]:
        if self.kind == "http":
            session = await self.fs.set_session()
            kw = dict(self.fs.kwargs)
            headers = dict(kw.pop("headers", None) or {})
            headers["Accept-Encoding"] = "identity"
            kw.setdefault("allow_redirects", True)
            async with session.head(self.fs.encode_url(url), headers=headers, **kw) as r:
                if r.status not in (403, 405):  # some signed URLs allow GET only: ask with a 1-byte range
                    _check_status(url, r.status, "metadata")
                    size = r.headers.get("Content-Length")
                    if size is None or r.headers.get("Content-Encoding", "identity") not in ("identity", ""):
                        raise UnsupportedError(
                            f"{url}: the server does not report the file's size; random access needs it"
                        )
                    return int(size), _http_stamp(r.headers)
            headers["Range"] = "bytes=0-0"
            async with session.get(self.fs.encode_url(url), headers=headers, **kw) as r:
                match = _CONTENT_RANGE.match(r.headers.get("Content-Range", "")) or re.match(
                    r"bytes \*/(\d+)", r.headers.get("Content-Range", "")
                )
                if r.status not in (206, 416) or match is None or not match.groups()[-1].isdigit():
                    _check_status(url, r.status, "metadata")
                    raise UnsupportedError(
                        f"{url}: the server reports no size (no Content-Range); random access needs it"
                    )
                await r.read()
                return int(match.groups()[-1]), _http_stamp(r.headers)
        if self.kind == "s3":
            head = await self.s3_object(url, "head_object", "metadata")
            return int(head["ContentLength"]), str(head.get("ETag") or head.get("VersionId") or "")
        info = await self._generic_info(url)
        return _identity_of(url, info)

    # -- identity and the file's last bytes, in one request ------------------------------------
    def tail(self, url: str, n: int, options: ReadOptions = _DEFAULT) -> tuple[int, str, bytes]:
        """``(size, stamp, last bytes)`` of ``url`` from one suffix GET (``Range:
        bytes=-n``, retried): the identity from the answer's headers, exactly as a
        HEAD gives it (the size from ``Content-Range``'s total), and the file's last
        ``min(n, size)`` bytes from its body. A store that ignores or refuses suffix
        ranges (remembered per host), and stores other than HTTP(S) and S3, are asked
        the identity the old way (:meth:`identity`), and the bytes are ``b""``."""
        host = url.split("://", 1)[-1].split("/", 1)[0]
        if self.kind in ("http", "s3") and host not in self._no_suffix:
            what = f"the last {n} bytes"
            found = self.run(self._retrying(url, what, lambda: self._tail(url, n), options), f"{url}: {what}", options)
            if found is not None:
                return found
            self._no_suffix.add(host)
            log.debug("%s answered no suffix range: its files' identities are asked with a HEAD", host)
        return (*self.identity(url, options), b"")

    async def _tail(self, url: str, n: int) -> tuple[int, str, bytes] | None:
        what = f"the last {n} bytes"
        if self.kind == "http":
            fs = self.fs
            session = await fs.set_session()
            kw = dict(fs.kwargs)
            headers = dict(kw.pop("headers", None) or {})
            headers["Range"] = f"bytes=-{n}"
            headers["Accept-Encoding"] = "identity"
            kw.setdefault("allow_redirects", True)
            async with session.get(fs.encode_url(url), headers=headers, **kw) as r:
                if r.status in (401, 403, 404) or r.status in RETRY_STATUS or r.status >= 500 and r.status != 501:
                    _check_status(url, r.status, what)
                found = None
                if r.headers.get("Content-Encoding", "identity") in ("identity", ""):
                    found = _suffix_answer(r.status, r.headers.get("Content-Range"), r.headers.get("Content-Length"), n)
                if found is None:
                    r.close()  # its body (maybe the whole file) is not wanted
                    return None
                try:
                    data = await r.read()
                except Exception as exc:  # noqa: BLE001 - a cut body: retried
                    raise _Transient(f"the body was cut: {type(exc).__name__}: {exc}") from None
                first, size = found
                return size, _http_stamp(r.headers), _exact(url, data, first, size)
        try:
            response = await self.s3_object(url, "get_object", what, Range=f"bytes=-{n}")
        except _Changed:  # InvalidRange: an empty object, or a store without suffix ranges
            return None
        except Exception as exc:
            meta = (getattr(exc, "response", None) or {}).get("ResponseMetadata") or {}
            if meta.get("HTTPStatusCode") in (400, 501):  # a store that does not take suffix ranges
                return None
            raise
        body = response["Body"]
        try:
            status = int((response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 200)
            length = response.get("ContentLength")
            found = _suffix_answer(status, response.get("ContentRange"), None if length is None else str(length), n)
            if found is None:
                return None
            data = await _read_body(body)
        finally:
            body.close()
        first, size = found
        return size, str(response.get("ETag") or response.get("VersionId") or ""), _exact(url, data, first, size)

    async def _generic_info(self, url: str) -> dict[str, Any]:
        fs = self.fs
        try:
            if getattr(fs, "async_impl", False):
                return await fs._info(self.path_of(url))
            return await asyncio.get_running_loop().run_in_executor(None, fs.info, self.path_of(url))
        except FileNotFoundError:
            raise _missing(url) from None

    async def _s3(self, bucket: str) -> Any:
        fs = self.fs
        await fs.set_session()
        return await fs.get_s3(bucket)

    async def s3_object(self, url: str, method: str, what: str, **extra: Any) -> Any:
        """One S3 call (``head_object`` / ``get_object``) on ``url``'s object, of the
        version the URL names if it names one; ``what`` names it in errors."""
        bucket, key, version = self.fs.split_path(self.path_of(url))
        call = getattr(await self._s3(bucket), method)
        if version:
            extra["VersionId"] = version
        kw = self.fs._get_s3_method_kwargs(call, Bucket=bucket, Key=key, **extra)
        return await _s3_call(url, what, call(**kw))

    # -- range reads ----------------------------------------------------------------------------
    def submit_range(
        self,
        url: str,
        start: int,
        stop: int,
        size: int | None,
        stamp: str | None,
        options: ReadOptions = _DEFAULT,
        stored: str | None = None,
    ) -> "_Pending":
        """Bytes ``[start, stop)`` of ``url``, checked against ``(size, stamp)``
        (the indexed identity; ``None`` skips the check; ``stored``: the stored
        index it came from, named when it is stale), retried; a future-like
        object (``result()``, ``cancel()``)."""
        what = f"bytes [{start}, {stop})"

        async def limited() -> tuple[bool, Any]:
            # a failure is returned, not raised: a read the caller no longer waits for
            # (cancelled after an earlier error) must not make asyncio print its error
            try:
                async with self._semaphore(options.concurrency):
                    return True, await self._retrying(
                        url, what, lambda: self._get(url, start, stop, size, stamp), options, stored
                    )
            except Exception as exc:  # noqa: BLE001 - raised by _Pending.result
                return False, exc

        return _Pending(self.submit(limited()), f"{url}: {what}", wait_bound(options))

    def read_range(
        self, url: str, start: int, stop: int, size: int | None, stamp: str | None, options: ReadOptions = _DEFAULT
    ) -> bytes:
        return self.submit_range(url, start, stop, size, stamp, options).result()

    def _semaphore(self, limit: int) -> asyncio.Semaphore:
        semaphore = self._semaphores.get(limit)
        if semaphore is None:
            semaphore = self._semaphores[limit] = asyncio.Semaphore(limit)
        return semaphore

    async def _get(self, url: str, start: int, stop: int, size: int | None, stamp: str | None) -> bytes:
        if stop <= start:
            return b""
        if self.kind == "http":
            return await self._get_http(url, start, stop, size, stamp)
        if self.kind == "s3":
            return await self._get_s3(url, start, stop, size, stamp)
        return await self._get_generic(url, start, stop, size, stamp)

    async def _get_http(self, url: str, start: int, stop: int, size: int | None, stamp: str | None) -> bytes:
        session = await self.fs.set_session()
        kw = dict(self.fs.kwargs)
        headers = dict(kw.pop("headers", None) or {})
        headers["Range"] = f"bytes={start}-{stop - 1}"
        headers["Accept-Encoding"] = "identity"
        etag = _strong_etag(stamp)
        if etag is not None:
            headers["If-Match"] = etag
        what = f"bytes [{start}, {stop})"
        async with session.get(self.fs.encode_url(url), headers=headers, **kw) as r:
            if r.status == 412:
                raise _Changed(f"the server's version no longer matches ETag {stamp}")
            _check_status(url, r.status, what)
            change = http_change(stamp, r.headers)
            if change is not None:
                raise _Changed(change)
            if r.status == 206:
                _check_content_range(url, r.headers.get("Content-Range"), start, stop, size)
            elif not (r.status == 200 and start == 0 and size is not None and stop == size):
                raise UnsupportedError(
                    f"{url}: asked for {what} and the server sent status {r.status} without "
                    "Content-Range: it does not serve range requests, which random access needs"
                )
            try:
                data = await r.read()
            except Exception as exc:  # noqa: BLE001 - a cut body: the aiohttp error is retried below
                raise _Transient(f"the body was cut: {type(exc).__name__}: {exc}") from None
        return _exact(url, data, start, stop)

    async def _get_s3(self, url: str, start: int, stop: int, size: int | None, stamp: str | None) -> bytes:
        extra: dict[str, Any] = {}
        etag = _strong_etag(stamp)
        if etag is not None:
            extra["IfMatch"] = etag
        what = f"bytes [{start}, {stop})"
        response = await self.s3_object(url, "get_object", what, Range=f"bytes={start}-{stop - 1}", **extra)
        body = response["Body"]
        try:
            seen = response.get("ETag")
            if etag is not None and seen and seen != etag:
                raise _Changed(f"ETag {stamp} -> {seen}")
            _check_content_range(url, response.get("ContentRange"), start, stop, size)
            data = await _read_body(body)
        finally:
            body.close()
        return _exact(url, data, start, stop)

    async def _get_generic(self, url: str, start: int, stop: int, size: int | None, stamp: str | None) -> bytes:
        if size is not None and url not in self._checked:  # once per process and file
            now = _identity_of(url, await self._generic_info(url))
            if now != (size, stamp):
                raise _Changed(f"size {size} -> {now[0]}, stamp {stamp} -> {now[1]}")
            self._checked[url] = now
        fs = self.fs
        try:
            if getattr(fs, "async_impl", False):
                data = await fs._cat_file(self.path_of(url), start=start, end=stop)
            else:
                data = await asyncio.get_running_loop().run_in_executor(
                    None, lambda: exact_cat(fs, self.path_of(url), start, stop, size)
                )
        except FileNotFoundError:
            raise _missing(url) from None
        except (ConnectionError, TimeoutError, asyncio.TimeoutError) as exc:
            raise _Transient(f"{type(exc).__name__}: {exc}") from None
        return _exact(url, data, start, stop)

    # -- whole small files and globs ----------------------------------------------------------------
    def cat(self, url: str, options: ReadOptions = _DEFAULT) -> bytes:
        size, stamp = self.identity(url, options)
        return self.read_range(url, 0, size, size, stamp, options) if size else b""

    def fetch(self, url: str, options: ReadOptions = _DEFAULT) -> bytes:
        """The whole object in one request (no metadata request first), retried;
        ``FileNotFoundError`` if there is none. For small files named by
        convention (a stored index's manifest and entries)."""
        return self.run(
            self._retrying(url, "the whole file", lambda: self._fetch(url), options), f"{url}: the whole file", options
        )

    async def _fetch(self, url: str) -> bytes:
        if self.kind == "http":
            session = await self.fs.set_session()
            kw = dict(self.fs.kwargs)
            headers = dict(kw.pop("headers", None) or {})
            headers["Accept-Encoding"] = "identity"
            async with session.get(self.fs.encode_url(url), headers=headers, **kw) as r:
                _check_status(url, r.status, "the whole file")
                try:
                    return bytes(await r.read())
                except Exception as exc:  # noqa: BLE001 - retried
                    raise _Transient(f"the body was cut: {type(exc).__name__}: {exc}") from None
        if self.kind == "s3":
            response = await self.s3_object(url, "get_object", "the whole file")
            body = response["Body"]
            try:
                return await _read_body(body)
            finally:
                body.close()
        fs = self.fs
        try:
            if getattr(fs, "async_impl", False):
                return bytes(await fs._cat_file(self.path_of(url)))
            return bytes(await asyncio.get_running_loop().run_in_executor(None, fs.cat_file, self.path_of(url)))
        except FileNotFoundError:
            raise _missing(url) from None

    # -- one streamed GET (the index command) ------------------------------------------------------
    def open_stream(self, url: str, options: ReadOptions = _DEFAULT) -> tuple["_LoopStream", int, str]:
        """One GET of the whole object, its opening retried: ``(stream, size,
        stamp)``, the identity from the response (as a HEAD would give it) and a
        stream whose ``read(n)`` returns up to ``n`` bytes of the body (fewer only
        at its end) and ``close(whole)`` releases it (HTTP(S) and S3 only)."""
        if self.kind not in ("http", "s3"):
            raise UnsupportedError(f"{url}: no streamed GET for {self.protocol}:// (index it by ranges)")
        response, size, stamp = self.run(
            self._retrying(url, "the whole file", lambda: self._open_whole(url), options),
            f"{url}: the whole file",
            options,
        )
        return _LoopStream(self, response, options.timeout), size, stamp

    async def _open_whole(self, url: str) -> tuple[Any, int, str]:
        if self.kind == "http":
            fs = self.fs
            session = await fs.set_session()
            kw = dict(fs.kwargs)
            headers = dict(kw.pop("headers", None) or {})
            headers["Accept-Encoding"] = "identity"
            kw.setdefault("allow_redirects", True)
            r = await session.get(fs.encode_url(url), headers=headers, **kw)
            try:
                _check_status(url, r.status, "the whole file")
                size = r.headers.get("Content-Length")
                if size is None or r.headers.get("Content-Encoding", "identity") not in ("identity", ""):
                    raise UnsupportedError(f"{url}: the server does not report the file's size; random access needs it")
                return r, int(size), _http_stamp(r.headers)
            except BaseException:
                r.close()
                raise
        response = await self.s3_object(url, "get_object", "the whole file")
        stamp = str(response.get("ETag") or response.get("VersionId") or "")
        return response, int(response["ContentLength"]), stamp

    def put(self, url: str, data: bytes) -> None:
        """Write a whole object (a stored index's entry or manifest)."""
        if self.kind == "http":
            raise read_only(url)
        try:
            self.fs.pipe_file(self.path_of(url), data)
        except FileNotFoundError as exc:
            raise _bucket_missing(url, exc) from None

    def list_identities(
        self, folder: str, prefix: str, last: str, options: ReadOptions = _DEFAULT
    ) -> dict[str, tuple[int, str]]:
        """``{name: (size, ETag)}`` of the objects of the S3 folder URL ``folder``
        whose names (after the folder's ``/``) start with ``prefix``, up to the name
        ``last``: ListObjectsV2 pages of 1,000 objects, the ETag as ``head_object``
        gives it (S3 only)."""
        if self.kind != "s3":
            raise UnsupportedError(f"{folder}: no listing of identities for {self.protocol}://")
        return self.run(
            self._retrying(folder, "a listing", lambda: self._list_identities(folder, prefix, last), options),
            f"{folder}: a listing",
            options,
        )

    async def _list_identities(self, folder: str, prefix: str, last: str) -> dict[str, tuple[int, str]]:
        bucket, key, _ = self.fs.split_path(self.path_of(folder.rstrip("/") + "/x"))
        key = key[:-1]  # the folder's key prefix, with its "/"
        s3 = await self._s3(bucket)
        found: dict[str, tuple[int, str]] = {}
        token: str | None = None
        while True:
            more = {"ContinuationToken": token} if token else {}
            page = await _s3_call(
                folder, "a listing", s3.list_objects_v2(Bucket=bucket, Prefix=key + prefix, Delimiter="/", **more)
            )
            objects = page.get("Contents") or []
            found.update((o["Key"][len(key) :], (int(o["Size"]), str(o.get("ETag") or ""))) for o in objects)
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token or (objects and objects[-1]["Key"] >= key + last):
                return found

    def glob(self, pattern: str) -> list[str]:
        fs = self.fs
        try:
            found = fs.glob(self.path_of(pattern))
        except FileNotFoundError as exc:
            raise _bucket_missing(pattern, exc) from None
        return sorted(fs.unstrip_protocol(p) if self.kind != "http" else p for p in found)

    # -- retries ------------------------------------------------------------------------------------
    async def _retrying(
        self,
        url: str,
        what: str,
        attempt: Callable[[], Awaitable[T]],
        options: ReadOptions,
        stored: str | None = None,
    ) -> T:
        attempts = Attempts(url, what, options, stored, self._first)
        while True:
            try:
                value = await asyncio.wait_for(attempt(), options.timeout)
                attempts.answered()
                return value
            except asyncio.TimeoutError:
                wait = attempts.failed(TimeoutError())
            except Exception as exc:  # noqa: BLE001 - classified (and raised when not transient) by Attempts
                wait = attempts.failed(exc)
            if wait is None:
                raise attempts.error()
            await asyncio.sleep(wait)


class _LoopStream:
    """The body of a response of :meth:`Client.open_stream`, read on the client's
    event loop: each ``read`` waits at most ``timeout`` (and 30 s more)."""

    def __init__(self, client: Client, response: Any, timeout: float) -> None:
        self.client, self.response, self.timeout = client, response, timeout

    def read(self, n: int) -> bytes:
        future = self.client.submit(asyncio.wait_for(self._read(n), self.timeout))
        try:
            return future.result(self.timeout + 30)
        except BaseException:
            future.cancel()
            raise

    async def _read(self, n: int) -> bytes:
        """Up to ``n`` bytes (fewer at the end only): the pieces the connection
        hands over are gathered here, so the reading thread waits once."""
        read = self.response.content.read if self.client.kind == "http" else self.response["Body"].read
        parts, got = [], 0
        while got < n:
            piece = await read(n - got)
            if not piece:
                break
            parts.append(piece)
            got += len(piece)
        return b"".join(parts)

    def close(self, whole: bool) -> None:
        self.client.submit(self._close(whole))

    async def _close(self, whole: bool) -> None:
        if self.client.kind == "http":
            if whole:  # read to its end: the connection serves the next request
                self.response.release()
            else:
                self.response.close()
        else:
            self.response["Body"].close()


async def _s3_call(url: str, what: str, call: Awaitable[Any]) -> Any:
    try:
        return await call
    except Exception as exc:
        response = getattr(exc, "response", None)
        if not isinstance(response, dict):
            raise
        code = str((response.get("Error") or {}).get("Code", ""))
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode", 0)
        meant = s3_error(url, what, code, status)
        if meant is None:
            raise
        raise meant from None


def _bucket_missing(url: str, exc: FileNotFoundError) -> FileNotFoundError:
    """What s3fs's ``FileNotFoundError`` meant: a missing bucket when the S3 error
    it was made from (its cause) says ``NoSuchBucket``, else ``exc`` itself."""
    response = getattr(exc.__cause__, "response", None)
    code = str(((response or {}).get("Error") or {}).get("Code", "")) if isinstance(response, dict) else ""
    return _missing(url, code) if code == "NoSuchBucket" else exc


def _identity_of(url: str, info: Mapping[str, Any]) -> tuple[int, str]:
    size = info.get("size")
    if size is None:
        raise UnsupportedError(f"{url}: the store does not report the file's size; random access needs it")
    for name in (
        "ETag",
        "etag",
        "generation",
        "version_id",
        "VersionId",
        "mtime",
        "LastModified",
        "last_modified",
        "updated",
        "Last-Modified",
        "md5Hash",
        "Content-MD5",
    ):
        if info.get(name):
            return int(size), str(info[name])
    return int(size), ""


def exact_cat(fs: Any, path: str, start: int, stop: int, size: int | None) -> bytes:
    """Bytes ``[start, stop)`` of ``path`` on a blocking fsspec filesystem, in one
    range request of exactly those bytes. fsspec's default ``cat_file`` opens a
    buffered file whose read-ahead cache fetches a whole block (5 MiB) past
    ``stop`` on every call (an epoch read 4-5x its bytes); opened with
    ``cache_type="none"`` the file fetches what is asked and nothing more (its
    size given, the open asks no metadata). A filesystem with its own
    ``cat_file`` reads ranges its own way."""
    from fsspec.spec import AbstractFileSystem

    if type(fs).cat_file is not AbstractFileSystem.cat_file:
        return bytes(fs.cat_file(path, start=start, end=stop))
    extra = {"size": size} if size is not None else {}
    with fs.open(path, "rb", cache_type="none", **extra) as f:
        f.seek(start)
        return bytes(f.read(stop - start))
