"""Remote files (``s3://``, ``gs://``, ``http(s)://``, ...) through fsspec.

fsspec is an optional extra: ``pip install distshard[remote]`` (``http(s)``;
it brings aiohttp) or ``distshard[s3]`` (s3fs), ``gcsfs`` for ``gs://``.
``storage_options`` are handed to the filesystem as fsspec takes them; the
environment (``AWS_*``, ...) keeps working as it does for fsspec. An ``s3://``
client is :mod:`.s3direct`'s (``http.client``, no s3fs on the path) when its
outcome is certainly s3fs's (``DISTSHARD_S3_CLIENT``: ``auto``, ``s3fs``,
``direct``; see :func:`.clients.client_for`, which makes each process's clients); what answers mean
(:mod:`.responses`), the retries and what the clients share (:mod:`.ranged`) are written once for both.
HTTP(S) requests are :mod:`.over_http`'s (aiohttp, through fsspec's session).

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
import threading
from typing import Any, Awaitable, Callable, Mapping, TypeVar

from ...errors import UnsupportedError
from ..read_options import ReadOptions
from .over_http import http_identity, http_open, http_range, http_suffix, http_whole
from .ranged import Ranged, check_range_answer, range_header, retried_async, s3_stamp
from .responses import (
    Attempts,
    Changed,
    FirstRequest,
    RemoteReadError,
    RemoteReadTimeout,
    Transient,
    exact,
    missing,
    read_only,
    s3_error,
    strong_etag,
    suffix_answer,
    wait_bound,
)

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
        raise Transient(f"the body was cut: {type(exc).__name__}: {exc}") from None


class Client(Ranged):
    """fsspec's filesystem for one protocol and set of storage options, in one process.

    ``kind`` is ``http`` (``HTTPFileSystem``), ``s3`` (``s3fs``) or ``generic``
    (anything else fsspec reads: ``cat_file`` plus a metadata check per process
    and file). Blocking calls run on the filesystem's event loop."""

    def __init__(self, url: str, protocol: str, storage_options: dict[str, Any], inherited_session: Any = None) -> None:
        self.protocol = protocol
        self.storage_options = storage_options
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

    def _retrying(
        self, url: str, what: str, attempt: Callable[[], Awaitable[T]], options: ReadOptions, stored: str | None = None
    ) -> Awaitable[T]:
        return retried_async(Attempts(url, what, options, stored, self._first), attempt, options.timeout)

    def _retried(
        self, url: str, what: str, attempt: Callable[[], Any], options: ReadOptions, stored: str | None = None
    ) -> Any:
        return self.run(self._retrying(url, what, attempt, options, stored), f"{url}: {what}", options)

    def _in_background(
        self, url: str, what: str, attempt: Callable[[], Any], options: ReadOptions, stored: str | None
    ) -> concurrent.futures.Future[tuple[bool, Any]]:
        async def limited() -> tuple[bool, Any]:
            # a failure is returned, not raised: a read the caller no longer waits for
            # (cancelled after an earlier error) must not make asyncio print its error
            try:
                async with self._semaphore(options.concurrency):
                    return True, await self._retrying(url, what, attempt, options, stored)
            except Exception as exc:  # noqa: BLE001 - raised by Pending.result
                return False, exc

        return self.submit(limited())

    def _semaphore(self, limit: int) -> asyncio.Semaphore:
        semaphore = self._semaphores.get(limit)
        if semaphore is None:
            semaphore = self._semaphores[limit] = asyncio.Semaphore(limit)
        return semaphore

    def suffix_host(self, url: str) -> str | None:
        """HTTP(S) and S3 are asked suffix ranges (see :meth:`.ranged.Ranged.tail`), other stores not."""
        return super().suffix_host(url) if self.kind in ("http", "s3") else None

    # -- one attempt of each request ------------------------------------------------------------
    async def _identity(self, url: str, options: ReadOptions) -> tuple[int, str]:
        if self.kind == "http":
            return await http_identity(self.fs, url)
        if self.kind == "s3":
            return s3_stamp_of(await self.s3_object(url, "head_object", "metadata"))
        return _identity_of(url, await self._generic_info(url))

    async def _suffix(self, url: str, n: int, what: str, options: ReadOptions) -> tuple[int, str, bytes] | None:
        if self.kind == "http":
            return await http_suffix(self.fs, url, n, what)
        try:
            response = await self.s3_object(url, "get_object", what, Range=f"bytes=-{n}")
        except Changed:  # InvalidRange: an empty object, or a store without suffix ranges
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
            found = suffix_answer(status, response.get("ContentRange"), None if length is None else str(length), n)
            if found is None:
                return None
            data = await _read_body(body)
        finally:
            body.close()
        first, size = found
        return size, s3_stamp(response), exact(url, data, first, size)

    async def _get(
        self, url: str, start: int, stop: int, size: int | None, stamp: str | None, options: ReadOptions
    ) -> bytes:
        if self.kind == "http":
            return await http_range(self.fs, url, start, stop, size, stamp)
        if self.kind == "s3":
            return await self._get_s3(url, start, stop, size, stamp)
        return await self._get_generic(url, start, stop, size, stamp)

    async def _get_s3(self, url: str, start: int, stop: int, size: int | None, stamp: str | None) -> bytes:
        etag = strong_etag(stamp)
        extra: dict[str, Any] = {"IfMatch": etag} if etag is not None else {}
        what = f"bytes [{start}, {stop})"
        response = await self.s3_object(url, "get_object", what, Range=range_header(start, stop), **extra)
        body = response["Body"]
        try:
            check_range_answer(url, start, stop, size, stamp, response.get("ETag"), response.get("ContentRange"))
            data = await _read_body(body)
        finally:
            body.close()
        return exact(url, data, start, stop)

    async def _get_generic(self, url: str, start: int, stop: int, size: int | None, stamp: str | None) -> bytes:
        if size is not None and url not in self._checked:  # once per process and file
            now = _identity_of(url, await self._generic_info(url))
            if now != (size, stamp):
                raise Changed(f"size {size} -> {now[0]}, stamp {stamp} -> {now[1]}")
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
            raise missing(url) from None
        except (ConnectionError, TimeoutError, asyncio.TimeoutError) as exc:
            raise Transient(f"{type(exc).__name__}: {exc}") from None
        return exact(url, data, start, stop)

    async def _fetch(self, url: str, options: ReadOptions) -> bytes:
        if self.kind == "http":
            return await http_whole(self.fs, url)
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
            raise missing(url) from None

    async def _open(self, url: str, options: ReadOptions) -> tuple[_LoopStream, int, str]:
        if self.kind == "http":
            response, size, stamp = await http_open(self.fs, url)
        else:
            response = await self.s3_object(url, "get_object", "the whole file")
            size, stamp = s3_stamp_of(response)
        return _LoopStream(self, response, options.timeout), size, stamp

    async def _listing(self, folder: str, prefix: str, last: str, options: ReadOptions) -> dict[str, tuple[int, str]]:
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

    # -- the store's own calls --------------------------------------------------------------------
    async def _generic_info(self, url: str) -> dict[str, Any]:
        fs = self.fs
        try:
            if getattr(fs, "async_impl", False):
                return await fs._info(self.path_of(url))
            return await asyncio.get_running_loop().run_in_executor(None, fs.info, self.path_of(url))
        except FileNotFoundError:
            raise missing(url) from None

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

    # -- what only some stores do -----------------------------------------------------------------
    def open_stream(self, url: str, options: ReadOptions = _DEFAULT) -> tuple[_LoopStream, int, str]:
        """One GET of the whole object (HTTP(S) and S3 only): see :meth:`.ranged.Ranged.open_stream`."""
        if self.kind not in ("http", "s3"):
            raise UnsupportedError(f"{url}: no streamed GET for {self.protocol}:// (index it by ranges)")
        return super().open_stream(url, options)

    def list_identities(
        self, folder: str, prefix: str, last: str, options: ReadOptions = _DEFAULT
    ) -> dict[str, tuple[int, str]]:
        """See :meth:`.ranged.Ranged.list_identities` (S3 only)."""
        if self.kind != "s3":
            raise UnsupportedError(f"{folder}: no listing of identities for {self.protocol}://")
        return super().list_identities(folder, prefix, last, options)

    def put(self, url: str, data: bytes) -> None:
        """Write a whole object (a stored index's entry or manifest)."""
        if self.kind == "http":
            raise read_only(url)
        try:
            self.fs.pipe_file(self.path_of(url), data)
        except FileNotFoundError as exc:
            raise _bucket_missing(url, exc) from None

    def glob(self, pattern: str) -> list[str]:
        fs = self.fs
        try:
            found = fs.glob(self.path_of(pattern))
        except FileNotFoundError as exc:
            raise _bucket_missing(pattern, exc) from None
        return sorted(fs.unstrip_protocol(p) if self.kind != "http" else p for p in found)


def s3_stamp_of(head: Mapping[str, Any]) -> tuple[int, str]:
    """``(size, stamp)`` of a botocore answer (``head_object``, ``get_object``)."""
    return int(head["ContentLength"]), s3_stamp(head)


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
    return missing(url, code) if code == "NoSuchBucket" else exc


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
