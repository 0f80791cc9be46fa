"""A direct S3 client over ``http.client``, for configurations whose outcome is certain.

``import s3fs`` brings aiobotocore, botocore and aiohttp (about 0.4 s of CPU),
and its session resolves credentials and parses the service model (about 0.3 s
more) before the first request; every forked DataLoader worker then pays
aiobotocore's CPU per request. When the storage options and the environment
leave no doubt about where a request goes and how it is signed (an explicit
endpoint, or real AWS with an explicit region; explicit credentials or
``anon=True``; no proxy, profile, AWS config or fsspec configuration that could
change it: :func:`.s3config.direct_config` names the reason otherwise), reads go through
this client instead: Signature V4 (:mod:`.sigv4`) over keep-alive
``http.client`` connections, one per thread and host, on a thread pool as large
as the largest ``ReadOptions.concurrency`` asked. It reaches the same objects
s3fs would, with the same addressing (path style on a custom endpoint; virtual
hosts on AWS for DNS-compatible buckets), the same identity (HEAD:
``ContentLength`` and the ``ETag`` header as botocore returns it, quotes
included), the same checks of every answer and the same retries
(:mod:`.responses`, :mod:`.ranged`); a bucket in another region is followed once on real AWS
(``x-amz-bucket-region``) and remembered.

Writes (the index command's packs and manifest) are one signed PUT each, so
an index command whose reads are direct never imports s3fs; an s3fs client is
made on first use, off the job's path, for what this client does not do: an
object larger than one PUT takes (multipart), globs other than the common one
(wildcards in the last segment only, listed here: see
:meth:`DirectS3Client.glob`), ``--prune``. ``DISTSHARD_S3_CLIENT`` picks: ``auto`` (the default: this client
when eligible, else s3fs), ``s3fs`` (always s3fs), ``direct`` (this client, or
a ``ValueError`` naming why not).

Fork safety: the pool and the connections belong to the process that made them
(:mod:`.s3pool`); a forked child makes its own, and keeps the parent's
referenced, never using or closing them.
"""

from __future__ import annotations

import concurrent.futures
import fnmatch
import functools
import hashlib
import http.client
import inspect
import logging
import re
import ssl
import threading
from typing import Any, Callable, Iterator, TypeVar, cast
from urllib.parse import unquote_plus
from xml.etree import ElementTree

from ..read_options import ReadOptions
from .ranged import Ranged, check_range_answer, range_header, retried, s3_stamp
from .responses import (
    Attempts,
    FirstRequest,
    Transient,
    Unreached,
    exact,
    no_connection,
    s3_error,
    strong_etag,
    suffix_answer,
)
from .s3config import Config
from .s3pool import Connections, PerProcess
from .sigv4 import EMPTY_SHA256, canonical_query, sign

__all__ = ["DirectS3Client", "PUT_LIMIT"]

log = logging.getLogger("distshard")

F = TypeVar("F", bound=Callable[..., Any])

#: the largest object written with one PUT (S3's limit): larger ones go through s3fs (multipart)
PUT_LIMIT = 5 << 30

_CODE = re.compile(rb"<Code>([^<]*)</Code>")
_MESSAGE = re.compile(rb"<Message>([^<]*)</Message>")

_DEFAULT = ReadOptions()


class _Answer:
    __slots__ = ("status", "headers", "body", "stream")

    def __init__(self, status: int, headers: http.client.HTTPMessage, body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body
        self.stream: _DirectStream | None = None  # the unread body of a streamed GET


class _DirectStream:
    """The body of a streamed GET, read in the calling thread; its connection
    goes back to the thread's pool when the body was read whole."""

    def __init__(
        self, held: Connections, host: str, response: http.client.HTTPResponse, conn: http.client.HTTPConnection
    ) -> None:
        self.held, self.host, self.response, self.conn = held, host, response, conn

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes (fewer at the end only): ``HTTPResponse.read(n)`` reads
        through a buffered reader of the socket, which returns short only at its end."""
        return self.response.read(n)

    def close(self, whole: bool) -> None:
        reusable = whole and not self.response.will_close and self.response.isclosed()
        self.held.give_back(self.host, self.conn, reusable)


def _through_s3fs(method: F) -> F:
    """``method`` of :class:`DirectS3Client`, but through the s3fs client where the
    URL names a bucket botocore addresses its own way (see :meth:`DirectS3Client._botocores`)."""
    name = method.__name__
    rest = list(inspect.signature(method).parameters.values())[2:]  # after self and the URL

    @functools.wraps(method)
    def routed(self: DirectS3Client, url: str, *args: Any, **kwargs: Any) -> Any:
        if self._botocores(url):  # every argument handed on, the defaults included
            given = [*args, *(kwargs.pop(p.name, p.default) for p in rest[len(args) :])]
            return getattr(self.fallback, name)(url, *given)
        return method(self, url, *args, **kwargs)

    return cast(F, routed)


class DirectS3Client(Ranged):
    """Reads S3 objects over ``http.client`` (see the module docstring): the
    :class:`.contract.Transport` of :class:`.ranged.Ranged`, each request one
    blocking exchange in the calling thread (ranges: on the pool); ``fallback``
    makes the s3fs client that large writes, other globs and buckets botocore
    addresses its own way go to."""

    kind = "s3"

    def __init__(
        self, protocol: str, storage_options: dict[str, Any], config: Config, fallback: Callable[[], Any]
    ) -> None:
        self.protocol = protocol
        self.storage_options = storage_options
        self.config = config
        self._make_fallback = fallback
        self._fallback: Any = None
        self._fallback_lock = threading.Lock()
        self._regions: dict[str, str] = {}  # buckets answered from another region (real AWS)
        self._held = PerProcess()
        self._first = FirstRequest(protocol)  # the first request is timed (a slow one is logged)
        self._no_suffix: set[str] = set()  # buckets that did not answer a suffix range (see tail)

    def __repr__(self) -> str:
        return f"DirectS3Client({self.protocol}://, {self.config.scheme}://{self.config.host or 'aws'}, {self.config.region})"

    # -- per process ----------------------------------------------------------------------------
    @property
    def process(self) -> Connections:
        """The pool and connections of this process (:mod:`.s3pool`)."""
        return self._held.current

    def warm(self) -> None:
        """Nothing to start (no imports, no session): the https context at most."""
        if self.config.scheme == "https":
            self.process.ssl_of(self.config)

    def shareable_session(self) -> None:
        return None

    def made_filesystem(self) -> Any:
        """The s3fs client's filesystem if it was made (see :meth:`.remote.Client.made_filesystem`)."""
        return self._fallback.made_filesystem() if self._fallback is not None else None

    @property
    def fallback(self) -> Any:
        """The s3fs client (:class:`.remote.Client`) of the same options, made on first use."""
        if self._fallback is None:
            with self._fallback_lock:
                if self._fallback is None:
                    self._fallback = self._make_fallback()
        return self._fallback

    @property
    def fs(self) -> Any:
        """The s3fs filesystem of the same options (what writes, lists and deletes,
        as :attr:`.remote.Client.fs`): made on first use, off a job's read path."""
        return self.fallback.fs

    # -- one request ----------------------------------------------------------------------------
    def _split(self, url: str) -> tuple[str, str]:
        path = url.split("://", 1)[1] if "://" in url else url
        trail = path[len(path.rstrip("/")) :]
        path = path.rstrip("/").lstrip("/")
        bucket, _, key = path.partition("/")
        key = key.partition("?versionId=")[0] + (trail if key else "")
        return bucket, key

    def _send(
        self,
        method: str,
        url: str,
        what: str,
        headers: dict[str, str],
        options: ReadOptions,
        query: list[tuple[str, str]] | None = None,
        bucket_key: tuple[str, str] | None = None,
        stream: bool = False,
        data: bytes | None = None,
    ) -> _Answer:
        """One request (a region redirect followed once; a stale kept-alive
        connection replaced once), with the body ``data`` if given (its SHA-256 signed); the
        answer read whole, but a successful one's with ``stream`` (its ``stream``
        then reads it, on its own connection)."""
        bucket, key = bucket_key or self._split(url)
        state = self.process
        for redirect in (False, True):
            region = self._regions.get(bucket, self.config.region)
            host, path = self.config.address(bucket, key, region)
            sent = self._signed(method, host, path, query, headers, region, data)
            target = path + ("?" + canonical_query(query) if query else "")
            answer = self._exchange(state, url, host, method, target, sent, options, stream, data)
            moved = answer.headers.get("x-amz-bucket-region")
            if (
                self.config.follow_regions
                and not redirect
                and answer.status in (301, 307, 400)
                and moved
                and moved != region
            ):
                log.debug("s3://%s is in %s, not %s: asked there", bucket, moved, region)
                self._regions[bucket] = moved
                continue
            return answer
        return answer

    def _signed(
        self,
        method: str,
        host: str,
        path: str,
        query: list[tuple[str, str]] | None,
        headers: dict[str, str],
        region: str,
        data: bytes | None,
    ) -> dict[str, str]:
        """The headers sent: signed (SigV4, the body's SHA-256 with them), or unsigned with ``anon=True``."""
        sent = dict(headers)
        if self.config.credentials is None:
            sent["host"] = host
            return sent
        payload = hashlib.sha256(data).hexdigest() if data is not None else EMPTY_SHA256
        return sign(method, host, path, query or [], sent, self.config.credentials, region, payload=payload)

    def _exchange(
        self,
        state: Connections,
        url: str,
        host: str,
        method: str,
        target: str,
        sent: dict[str, str],
        options: ReadOptions,
        stream: bool,
        data: bytes | None,
    ) -> _Answer:
        """One request on this thread's connection to ``host`` (a kept-alive one the
        server had closed: once more on a new one); what failed on the way is sorted
        (transient, unreached, a certificate refused)."""
        for fresh_try in (False, True):
            conn, fresh = state.connection(host, self.config)
            conn.timeout = options.timeout
            if conn.sock is not None:
                conn.sock.settimeout(options.timeout)
            try:
                conn.request(method, target, body=data, headers=sent)
                response = conn.getresponse()
                if stream and response.status in (200, 206):
                    state.hand_over(host)
                    answer = _Answer(response.status, response.headers, b"")
                    answer.stream = _DirectStream(state, host, response, conn)
                    return answer
                body = response.read()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
                state.drop(host, conn)
                if fresh or fresh_try:
                    raise Transient(f"{type(exc).__name__}: {exc}") from None
                continue  # a kept-alive connection the server had closed: once more on a new one
            except ssl.SSLCertVerificationError as exc:
                state.drop(host, conn)
                raise PermissionError(
                    f"{url}: the certificate of {host} was not verified ({exc.verify_message}): give the "
                    "bundle that signs it in AWS_CA_BUNDLE"
                ) from None
            except http.client.IncompleteRead as exc:
                state.drop(host, conn)
                raise Transient(f"the body was cut: {len(exc.partial)} bytes of {exc.expected} more") from None
            except (http.client.HTTPException, OSError) as exc:
                state.drop(host, conn)
                if isinstance(exc, TimeoutError):
                    raise
                kind = Unreached if no_connection(exc) else Transient
                raise kind(f"{type(exc).__name__}: {exc}") from None
            if response.will_close:
                state.drop(host, conn)
            return _Answer(response.status, response.headers, body)
        raise AssertionError("unreachable")  # (the second try returns or raises)

    def _refuse(self, url: str, what: str, answer: _Answer) -> None:
        """Raise what a non-2xx answer means (see :func:`.responses.s3_error`)."""
        if answer.status in (200, 206):
            return
        found = _CODE.search(answer.body or b"")
        code = found.group(1).decode("utf-8", "replace") if found else ""
        meant = s3_error(url, what, code, answer.status)
        if meant is not None:
            raise meant
        said = _MESSAGE.search(answer.body or b"")
        parts = [f"HTTP {answer.status}", code, said.group(1).decode("utf-8", "replace") if said else ""]
        region = answer.headers.get("x-amz-bucket-region")
        if region:
            parts.append(f"(the bucket is in {region}: give client_kwargs={{'region_name': {region!r}}})")
        raise ValueError(f"{url}: {' '.join(p for p in parts if p)} reading {what}")

    # -- how its requests run: in this thread, or on the pool -------------------------------------
    def _retried(
        self, url: str, what: str, attempt: Callable[[], Any], options: ReadOptions, stored: str | None = None
    ) -> Any:
        return retried(Attempts(url, what, options, stored, self._first), attempt)

    def _in_background(
        self, url: str, what: str, attempt: Callable[[], Any], options: ReadOptions, stored: str | None
    ) -> concurrent.futures.Future[tuple[bool, Any]]:
        def run() -> tuple[bool, Any]:
            try:
                return True, retried(Attempts(url, what, options, stored, self._first), attempt)
            except Exception as exc:  # noqa: BLE001 - raised by Pending.result
                return False, exc

        return self.process.pool_of(options.concurrency).submit(run)

    def suffix_host(self, url: str) -> str:
        """A refused suffix range is remembered per bucket."""
        return self._split(url)[0]

    def _botocores(self, url: str) -> bool:
        """Whether ``url`` names a bucket botocore addresses its own way (an ARN:
        access points, Object Lambda, multi-region; an S3 Express directory bucket,
        ``--x-s3``): such a URL goes through the s3fs client."""
        bucket = self._split(url)[0]
        return ":" in bucket or bucket.endswith("--x-s3")

    # -- the interface (:class:`.ranged.Ranged`'s; a bucket botocore addresses its own way through s3fs) --
    identity = _through_s3fs(Ranged.identity)
    tail = _through_s3fs(Ranged.tail)
    submit_range = _through_s3fs(Ranged.submit_range)
    fetch = _through_s3fs(Ranged.fetch)
    open_stream = _through_s3fs(Ranged.open_stream)
    list_identities = _through_s3fs(Ranged.list_identities)

    def _stamp(self, answer: _Answer) -> str:
        """The ETag as botocore returns it (quotes included), else the version id."""
        return s3_stamp(answer.headers, "x-amz-version-id")

    def _identity(self, url: str, options: ReadOptions) -> tuple[int, str]:
        answer = self._send("HEAD", url, "metadata", {}, options)
        self._refuse(url, "metadata", answer)
        size = answer.headers.get("Content-Length")
        if size is None:
            raise Transient("a HEAD answer without Content-Length")
        return int(size), self._stamp(answer)

    def _suffix(self, url: str, n: int, what: str, options: ReadOptions) -> tuple[int, str, bytes] | None:
        answer = self._send("GET", url, what, {"Range": f"bytes=-{n}"}, options, stream=True)
        if answer.status in (400, 416, 501):  # an empty object, or a store without suffix ranges
            return None
        self._refuse(url, what, answer)
        stream = answer.stream
        assert stream is not None
        found = suffix_answer(
            answer.status, answer.headers.get("Content-Range"), answer.headers.get("Content-Length"), n
        )
        if found is None:
            stream.close(False)  # its body (maybe the whole object) is not wanted
            return None
        first, size = found
        try:
            data = stream.read(size - first)
        except (http.client.HTTPException, OSError) as exc:
            stream.close(False)
            raise Transient(f"the body was cut: {type(exc).__name__}: {exc}") from None
        stream.close(len(data) == size - first)
        return size, self._stamp(answer), exact(url, data, first, size)

    def _get(self, url: str, start: int, stop: int, size: int | None, stamp: str | None, options: ReadOptions) -> bytes:
        what = f"bytes [{start}, {stop})"
        headers = {"Range": range_header(start, stop)}
        etag = strong_etag(stamp)
        if etag is not None:
            headers["If-Match"] = etag
        answer = self._send("GET", url, what, headers, options)
        self._refuse(url, what, answer)
        check_range_answer(
            url, start, stop, size, stamp, answer.headers.get("ETag"), answer.headers.get("Content-Range")
        )
        return exact(url, answer.body, start, stop)

    def _fetch(self, url: str, options: ReadOptions) -> bytes:
        answer = self._send("GET", url, "the whole file", {}, options)
        self._refuse(url, "the whole file", answer)
        length = answer.headers.get("Content-Length")
        if length is not None and int(length) != len(answer.body):
            raise Transient(f"a short body: {len(answer.body)} of {length} bytes")
        return bytes(answer.body)

    def _open(self, url: str, options: ReadOptions) -> tuple[_DirectStream, int, str]:
        answer = self._send("GET", url, "the whole file", {}, options, stream=True)
        self._refuse(url, "the whole file", answer)
        assert answer.stream is not None
        size = answer.headers.get("Content-Length")
        if size is None:
            answer.stream.close(False)
            raise Transient("a GET answer without Content-Length")
        return answer.stream, int(size), self._stamp(answer)

    def _listing(self, folder: str, prefix: str, last: str, options: ReadOptions) -> dict[str, tuple[int, str]]:
        bucket, key = self._split(folder.rstrip("/") + "/")
        found: dict[str, tuple[int, str]] = {}
        for objects, _ in self._pages(folder, bucket, key + prefix, options, 1000):
            found.update((name[len(key) :], (size, etag)) for name, size, etag in objects)
            if objects and objects[-1][0] >= key + last:
                break  # (names come in order: the rest lie after the last one wanted)
        return found

    def put(self, url: str, data: bytes, options: ReadOptions = _DEFAULT) -> None:
        """Write a whole object (the index command's packs and manifest) with one
        signed PUT (its body's SHA-256 signed), retried; one larger than a single
        PUT takes (:data:`PUT_LIMIT`), or a bucket botocore addresses its own way,
        through s3fs."""
        if self._botocores(url) or len(data) > PUT_LIMIT:
            self.fallback.put(url, data)
            return

        def attempt() -> None:
            answer = self._send("PUT", url, "a write", {}, options, data=data)
            self._refuse(url, "a write", answer)

        self._retried(url, "a write", attempt, options)

    def glob(self, pattern: str, options: ReadOptions = _DEFAULT, max_keys: int = 1000) -> list[str]:
        """The URLs matching ``pattern``, as s3fs's glob finds them: when the
        wildcards (``*``, ``?``, ``[...]``) are in the last segment only, one
        ListObjectsV2 listing (``/`` delimited, from the stem before the first
        wildcard; continued) whose objects and common prefixes are matched as
        fsspec matches them; any other pattern (``**``, wildcards in folders or
        the bucket, a trailing ``/``) through s3fs itself."""
        parts = _simple_glob(pattern)
        if parts is None:
            return list(self.fallback.glob(pattern))
        bucket, folder, segment = parts
        stem = segment[: min(i for i in (segment.find(c) for c in "*?[") if i >= 0)]
        base = f"{folder}/" if folder else ""
        names = self._retried(
            pattern, "a listing", lambda: self._list(pattern, bucket, base + stem, options, max_keys), options
        )
        found = {name for name in names if name[len(base) :] and fnmatch.fnmatchcase(name[len(base) :], segment)}
        return sorted(f"s3://{bucket}/{name}" for name in found)

    def _list(self, url: str, bucket: str, prefix: str, options: ReadOptions, max_keys: int) -> list[str]:
        """Keys and common prefixes (without their ``/``) under ``prefix``, one level."""
        names: list[str] = []
        for objects, prefixes in self._pages(url, bucket, prefix, options, max_keys):
            names += [key for key, _, _ in objects]
            names += [p[:-1] for p in prefixes if p.endswith("/")]
        return names

    def _pages(
        self, url: str, bucket: str, prefix: str, options: ReadOptions, max_keys: int
    ) -> Iterator[tuple[list[tuple[str, int, str]], list[str]]]:
        """ListObjectsV2 under ``prefix``, ``/`` delimited, page by page (continued):
        ``([(key, size, ETag)], [common prefix])`` each, names decoded."""
        token: str | None = None
        while True:
            query = [("list-type", "2"), ("prefix", prefix), ("delimiter", "/"), ("encoding-type", "url")]
            if max_keys != 1000:
                query.append(("max-keys", str(max_keys)))
            if token is not None:
                query.append(("continuation-token", token))
            answer = self._send("GET", url, "a listing", {}, options, query=query, bucket_key=(bucket, ""))
            self._refuse(url, "a listing", answer)
            try:
                root = ElementTree.fromstring(answer.body)
            except ElementTree.ParseError as exc:
                raise Transient(f"a listing that is not XML: {exc}") from None
            fields: dict[str, list[str]] = {}
            objects: list[dict[str, str]] = []
            prefixes: list[dict[str, str]] = []
            for child in root:
                tag = child.tag.rsplit("}", 1)[-1]
                if tag in ("Contents", "CommonPrefixes"):
                    inner = {item.tag.rsplit("}", 1)[-1]: item.text or "" for item in child}
                    (objects if tag == "Contents" else prefixes).append(inner)
                else:
                    fields.setdefault(tag, []).append(child.text or "")
            # keys come URL-encoded when the answer says so (as botocore decodes them)
            decode = unquote_plus if fields.get("EncodingType") == ["url"] else str
            yield (
                [(decode(o.get("Key", "")), int(o.get("Size") or 0), o.get("ETag", "")) for o in objects],
                [decode(p.get("Prefix", "")) for p in prefixes],
            )
            if (fields.get("IsTruncated") or ["false"])[0].strip().lower() != "true":
                return
            token = (fields.get("NextContinuationToken") or [""])[0]
            if not token:
                raise Transient("a truncated listing without a continuation token")


def _simple_glob(pattern: str) -> tuple[str, str, str] | None:
    """``(bucket, folder, last segment)`` of a pattern whose wildcards are in its
    last segment only (see :meth:`DirectS3Client.glob`), else ``None``."""
    path = pattern.split("://", 1)[1] if "://" in pattern else pattern
    if path.endswith("/") or "**" in path or "?versionId=" in path:
        return None
    path = path.lstrip("/")
    bucket, _, rest = path.partition("/")
    if not rest or any(c in bucket for c in "*?["):
        return None
    folder, _, segment = rest.rpartition("/")
    if any(c in folder for c in "*?[") or not any(c in segment for c in "*?["):
        return None
    return bucket, folder, segment
