"""A direct S3 client over ``http.client``, for configurations whose outcome is certain.

``import s3fs`` brings aiobotocore, botocore and aiohttp (about 0.4 s of CPU),
and its session resolves credentials and parses the service model (about 0.3 s
more) before the first request; every forked DataLoader worker then pays
aiobotocore's CPU per request. When the storage options and the environment
leave no doubt about where a request goes and how it is signed (an explicit
endpoint, or real AWS with an explicit region; explicit credentials or
``anon=True``; no proxy, profile, AWS config or fsspec configuration that could
change it: :func:`direct_config` names the reason otherwise), reads go through
this client instead: Signature V4 (:mod:`.sigv4`) over keep-alive
``http.client`` connections, one per thread and host, on a thread pool as large
as the largest ``ReadOptions.concurrency`` asked. It reaches the same objects
s3fs would, with the same addressing (path style on a custom endpoint; virtual
hosts on AWS for DNS-compatible buckets), the same identity (HEAD:
``ContentLength`` and the ``ETag`` header as botocore returns it, quotes
included), the same checks of every answer and the same retries
(:mod:`.answers`); a bucket in another region is followed once on real AWS
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
(:class:`_Process`); a forked child makes its own, and keeps the parent's
referenced, never using or closing them.
"""

from __future__ import annotations

import concurrent.futures
import configparser
import fnmatch
import hashlib
import http.client
import logging
import os
import re
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, TypeVar
from urllib.parse import unquote_plus
from xml.etree import ElementTree

from ..read_options import ReadOptions
from .responses import (
    Attempts,
    Changed,
    FirstRequest,
    Pending,
    Transient,
    Unreached,
    check_content_range,
    exact,
    no_connection,
    s3_error,
    strong_etag,
    suffix_answer,
    wait_bound,
)
from .sigv4 import EMPTY_SHA256, Credentials, canonical_query, encode_key, sign

__all__ = ["ENV", "Config", "DirectS3Client", "direct_config"]

log = logging.getLogger("distshard")

T = TypeVar("T")

#: the largest object written with one PUT (S3's limit): larger ones go through s3fs (multipart)
PUT_LIMIT = 5 << 30

#: the environment variable that picks the S3 client: ``auto``, ``s3fs`` or ``direct``
ENV = "DISTSHARD_S3_CLIENT"

_DEFAULT = ReadOptions()

# storage options that do not change what a read reaches or how it is signed
# (s3fs's S3FileSystem and fsspec's AbstractFileSystem arguments), with the
# values they may take (None: any)
_HARMLESS: dict[str, tuple[Any, ...] | None] = {
    "skip_instance_cache": None,
    "use_listings_cache": None,
    "listings_expiry_time": None,
    "max_paths": None,
    "default_block_size": None,
    "default_fill_cache": None,
    "default_cache_type": None,
    "max_concurrency": None,
    "fixed_upload_size": None,
    "local_expiry_check": None,
    "use_ssl": (True,),
    "requester_pays": (False,),
    "version_aware": (False,),
    "cache_regions": (False,),
    "s3_additional_kwargs": (None,),
}
_CREDENTIALS = ("key", "secret", "token", "anon")
# AWS_* variables that change nothing here beyond what direct_config reads
_AWS_VARIABLES = {
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",  # botocore does not read it (checked: tests/test_sources_s3direct.py)
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_CA_BUNDLE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_EC2_METADATA_DISABLED",
    "AWS_METADATA_SERVICE_TIMEOUT",
    "AWS_METADATA_SERVICE_NUM_ATTEMPTS",
    "AWS_MAX_ATTEMPTS",
    "AWS_RETRY_MODE",
}
_PROXIES = ("http_proxy", "https_proxy", "all_proxy")
# keys of an AWS config file's [default] profile that change nothing here
_CONFIG_KEYS = {"aws_access_key_id", "aws_secret_access_key", "aws_session_token", "region", "output"}
_AWS_REGION = re.compile(r"^(us|eu|ap|sa|ca|me|af|il|mx)(-gov)?-[a-z]+-\d+$")
_CN_REGION = re.compile(r"^cn-[a-z]+-\d+$")
_VIRTUAL_BUCKET = re.compile(r"^[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$")
_IP = re.compile(r"^\d+\.\d+\.\d+\.\d+$")
_CODE = re.compile(rb"<Code>([^<]*)</Code>")
_MESSAGE = re.compile(rb"<Message>([^<]*)</Message>")


@dataclass(frozen=True)
class Config:
    """Where the direct client sends a request and how it signs it.

    ``scheme``, ``host``, ``port``: the endpoint (``aws`` set: real AWS, the host
    then per bucket and region, ``domain`` its partition's); ``region``: the
    signing region; ``credentials``: ``None`` sends unsigned requests
    (``anon=True``); ``ca_bundle``: the certificates of https (``AWS_CA_BUNDLE``,
    else certifi's when importable, else the system's); ``follow_regions``: a
    bucket answered from another region is asked there (real AWS)."""

    scheme: str
    host: str
    port: int | None
    region: str
    credentials: Credentials | None
    aws: bool = False
    domain: str = "amazonaws.com"
    ca_bundle: str | None = None
    follow_regions: bool = False

    def address(self, bucket: str, key: str, region: str) -> tuple[str, str]:
        """``(Host header, path)`` of an object (``key`` empty: the bucket), as botocore addresses it."""
        path = encode_key(key)
        if not self.aws:
            return self._host_header(self.host), f"/{bucket}/{path}" if key else f"/{bucket}"
        base = "s3.amazonaws.com" if region == "us-east-1" else f"s3.{region}.{self.domain}"
        if _VIRTUAL_BUCKET.match(bucket) and not _IP.match(bucket):
            return f"{bucket}.{base}", f"/{path}"
        return base, f"/{bucket}/{path}" if key else f"/{bucket}"

    def _host_header(self, host: str) -> str:
        default = 443 if self.scheme == "https" else 80
        return host if self.port in (None, default) else f"{host}:{self.port}"


def direct_config(storage_options: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> Config | str:
    """The direct client's :class:`Config` for these ``storage_options`` and
    ``environ`` (default ``os.environ``), or why it is not eligible: it is only
    when the outcome is certainly the one s3fs and botocore would reach."""
    env = os.environ if environ is None else environ
    options = dict(storage_options or {})
    for name, value in options.items():
        if name in _CREDENTIALS or name in ("endpoint_url", "client_kwargs", "config_kwargs"):
            continue
        if name not in _HARMLESS:
            return f"the storage option {name!r} (only key, secret, token, anon, endpoint_url, client_kwargs are read)"
        allowed = _HARMLESS[name]
        if allowed is not None and value not in allowed and not (value == {} and None in allowed):
            return f"the storage option {name}={value!r}"
    config_kwargs = options.get("config_kwargs") or {}
    if not isinstance(config_kwargs, Mapping) or set(config_kwargs) - {"max_pool_connections"}:
        return f"config_kwargs {config_kwargs!r} (only max_pool_connections)"
    client_kwargs = options.get("client_kwargs") or {}
    if not isinstance(client_kwargs, Mapping) or set(client_kwargs) - {"endpoint_url", "region_name"}:
        return f"client_kwargs {client_kwargs!r} (only endpoint_url and region_name)"
    if "endpoint_url" in client_kwargs and options.get("endpoint_url"):
        return "endpoint_url given twice (in storage_options and client_kwargs)"
    for name in env:
        upper = name.upper()
        if upper.startswith("AWS_") and upper not in _AWS_VARIABLES and env[name]:
            return f"the environment variable {name}"
        if upper.startswith("FSSPEC_S3"):
            return f"the environment variable {name} (fsspec configuration)"
        if name.lower() in _PROXIES and env[name]:
            return f"a proxy ({name} is set)"
    if env.get("AWS_PROFILE"):
        return "AWS_PROFILE is set (a profile's settings are botocore's to read)"
    fsspec_dir = env.get("FSSPEC_CONFIG_DIR") or os.path.join(os.path.expanduser("~"), ".config", "fsspec")
    if os.path.isdir(fsspec_dir) and os.listdir(fsspec_dir):
        return f"fsspec configuration files in {fsspec_dir}"

    # credentials
    credentials: Credentials | None
    if options.get("anon"):
        if any(options.get(name) for name in ("key", "secret", "token")):
            return "anon=True with credentials"
        credentials = None
    elif options.get("key") or options.get("secret") or options.get("token"):
        key, secret, token = options.get("key"), options.get("secret"), options.get("token")
        if not (isinstance(key, str) and key and isinstance(secret, str) and secret):
            return "key and secret are not both given in storage_options"
        if token is not None and not isinstance(token, str):
            return "a token that is not a string"
        credentials = Credentials(key, secret, token)
    elif env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        credentials = Credentials(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], env.get("AWS_SESSION_TOKEN"))
    else:
        return "no explicit credentials (key and secret in storage_options, AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or anon=True)"

    # endpoint and region
    endpoint = options.get("endpoint_url") or client_kwargs.get("endpoint_url")
    endpoint = endpoint or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    region = client_kwargs.get("region_name") or env.get("AWS_DEFAULT_REGION")
    config_file = env.get("AWS_CONFIG_FILE") or os.path.join(os.path.expanduser("~"), ".aws", "config")
    if os.path.exists(config_file):
        if not (endpoint and region):
            return f"the AWS config file {config_file} with no explicit endpoint and region"
        reason = _config_file_reason(config_file)
        if reason is not None:
            return reason
    ca_bundle = env.get("AWS_CA_BUNDLE") or _certifi()
    if endpoint:
        if not isinstance(endpoint, str):
            return f"endpoint_url {endpoint!r} is not a string"
        match = re.match(r"^(https?)://([^/:?#\[\]@]+)(?::(\d+))?/?$", endpoint.strip())
        if match is None:
            return f"the endpoint {endpoint!r} (only scheme://host[:port] is read directly)"
        scheme, host, port = match.group(1), match.group(2).lower(), match.group(3)
        return Config(
            scheme, host, int(port) if port else None, str(region or "us-east-1"), credentials, ca_bundle=ca_bundle
        )
    if not region:
        return "real AWS with no explicit region (client_kwargs region_name or AWS_DEFAULT_REGION)"
    region = str(region)
    if _AWS_REGION.match(region):
        domain = "amazonaws.com"
    elif _CN_REGION.match(region):
        domain = "amazonaws.com.cn"
    else:
        return f"the region {region!r} (a partition read through botocore)"
    return Config(
        "https", "", None, region, credentials, aws=True, domain=domain, ca_bundle=ca_bundle, follow_regions=True
    )


def _config_file_reason(path: str) -> str | None:
    parser = configparser.RawConfigParser()
    try:
        parser.read(path)
    except configparser.Error as exc:
        return f"the AWS config file {path} could not be read ({type(exc).__name__})"
    if parser.has_section("default"):
        for key in parser.options("default"):
            if key not in _CONFIG_KEYS:
                return f"the AWS config file {path} sets {key}"
    return None


def _certifi() -> str | None:
    try:
        import certifi
    except ImportError:
        return None
    return str(certifi.where())


class _Process:
    """What the client holds in one process: its pool and its connections, by thread and host."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.size = 0
        self.connections: dict[tuple[int, str], http.client.HTTPConnection] = {}
        self.ssl: ssl.SSLContext | None = None


_ORPHANS: list[_Process] = []  # what forked children inherited: kept referenced, never used nor closed


class _Answer:
    __slots__ = ("status", "headers", "body", "stream")

    def __init__(self, status: int, headers: http.client.HTTPMessage, body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body
        self.stream: _DirectStream | None = None  # the unread body of a streamed GET


class _DirectStream:
    """The body of a streamed GET, read in the calling thread; its connection
    goes back to the thread's pool when the body was read whole."""

    def __init__(
        self, state: _Process, host: str, response: http.client.HTTPResponse, conn: http.client.HTTPConnection
    ) -> None:
        self.state, self.host, self.response, self.conn = state, host, response, conn

    def read(self, n: int) -> bytes:
        parts, got = [], 0
        while got < n:
            piece = self.response.read(n - got)
            if not piece:
                break
            parts.append(piece)
            got += len(piece)
        return b"".join(parts)

    def close(self, whole: bool) -> None:
        if self.state.pid != os.getpid():  # a forked child: never the parent's socket
            return
        if whole and not self.response.will_close and self.response.isclosed():
            key = (threading.get_ident(), self.host)
            with self.state.lock:
                if key not in self.state.connections:
                    self.state.connections[key] = self.conn
                    return
        self.conn.close()


class DirectS3Client:
    """Reads S3 objects over ``http.client`` (see the module docstring): the
    interface of :class:`.remote.Client` (``kind``, ``identity``, ``tail``,
    ``submit_range``, ``read_range``, ``cat``, ``fetch``, ``put``, ``glob``,
    ``warm``); ``fallback`` makes the s3fs client that large writes and other
    globs go to."""

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
        self._process = _Process()
        self._first = FirstRequest(protocol)  # the first request is timed (a slow one is logged)
        self._no_suffix: set[str] = set()  # buckets that did not answer a suffix range (see tail)

    def __repr__(self) -> str:
        return f"DirectS3Client({self.protocol}://, {self.config.scheme}://{self.config.host or 'aws'}, {self.config.region})"

    # -- per process ----------------------------------------------------------------------------
    @property
    def process(self) -> _Process:
        state = self._process
        if state.pid != os.getpid():  # a forked child: its own pool and connections
            _ORPHANS.append(state)
            state = self._process = _Process()
        return state

    def _pool(self, size: int) -> concurrent.futures.ThreadPoolExecutor:
        state = self.process
        pool = state.pool
        if pool is None or state.size < size:
            with state.lock:
                if state.pool is None or state.size < size:
                    old = state.pool
                    state.pool = concurrent.futures.ThreadPoolExecutor(size, thread_name_prefix="distshard-s3")
                    state.size = size
                    if old is not None:
                        old.shutdown(wait=False)  # what it was given still runs
                pool = state.pool
        assert pool is not None
        return pool

    def _connection(self, state: _Process, host: str) -> tuple[http.client.HTTPConnection, bool]:
        key = (threading.get_ident(), host)
        conn = state.connections.get(key)
        if conn is not None:
            return conn, False
        config = self.config
        name, _, port_text = host.partition(":")
        port = int(port_text) if port_text else config.port
        if config.scheme == "https":
            if state.ssl is None:
                state.ssl = ssl.create_default_context(cafile=config.ca_bundle)
            conn = http.client.HTTPSConnection(config.host or name, port, timeout=60.0, context=state.ssl)
        else:
            conn = http.client.HTTPConnection(config.host or name, port, timeout=60.0)
        with state.lock:
            state.connections[key] = conn
        return conn, True

    def _drop(self, state: _Process, host: str, conn: http.client.HTTPConnection) -> None:
        with state.lock:
            if state.connections.get((threading.get_ident(), host)) is conn:
                del state.connections[(threading.get_ident(), host)]
        conn.close()

    def warm(self) -> None:
        """Nothing to start (no imports, no session): the https context at most."""
        state = self.process
        if self.config.scheme == "https" and state.ssl is None:
            state.ssl = ssl.create_default_context(cafile=self.config.ca_bundle)

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
            sent = dict(headers)
            if self.config.credentials is not None:
                payload = hashlib.sha256(data).hexdigest() if data is not None else EMPTY_SHA256
                sent = sign(method, host, path, query or [], sent, self.config.credentials, region, payload=payload)
            else:
                sent["host"] = host
            target = path
            if query:
                target += "?" + canonical_query(query)
            for fresh_try in (False, True):
                conn, fresh = self._connection(state, host)
                conn.timeout = options.timeout
                if conn.sock is not None:
                    conn.sock.settimeout(options.timeout)
                try:
                    conn.request(method, target, body=data, headers=sent)
                    response = conn.getresponse()
                    if stream and response.status in (200, 206):
                        with state.lock:  # the body's own until it is read
                            state.connections.pop((threading.get_ident(), host), None)
                        answer = _Answer(response.status, response.headers, b"")
                        answer.stream = _DirectStream(state, host, response, conn)
                        return answer
                    body = response.read()
                except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
                    self._drop(state, host, conn)
                    if fresh or fresh_try:
                        raise Transient(f"{type(exc).__name__}: {exc}") from None
                    continue  # a kept-alive connection the server had closed: once more on a new one
                except ssl.SSLCertVerificationError as exc:
                    self._drop(state, host, conn)
                    raise PermissionError(
                        f"{url}: the certificate of {host} was not verified ({exc.verify_message}): give the "
                        "bundle that signs it in AWS_CA_BUNDLE"
                    ) from None
                except http.client.IncompleteRead as exc:
                    self._drop(state, host, conn)
                    raise Transient(f"the body was cut: {len(exc.partial)} bytes of {exc.expected} more") from None
                except (http.client.HTTPException, OSError) as exc:
                    self._drop(state, host, conn)
                    if isinstance(exc, TimeoutError):
                        raise
                    kind = Unreached if no_connection(exc) else Transient
                    raise kind(f"{type(exc).__name__}: {exc}") from None
                if response.will_close:
                    self._drop(state, host, conn)
                break
            answer = _Answer(response.status, response.headers, body)
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

    def _refuse(self, url: str, what: str, answer: _Answer) -> None:
        """Raise what a non-2xx answer means (see :func:`.answers.s3_error`)."""
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

    def _retrying(
        self, url: str, what: str, attempt: Callable[[], T], options: ReadOptions, stored: str | None = None
    ) -> T:
        attempts = Attempts(url, what, options, stored, self._first)
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

    # -- the interface --------------------------------------------------------------------------
    def _botocores(self, url: str) -> bool:
        """Whether ``url`` names a bucket botocore addresses its own way (an ARN:
        access points, Object Lambda, multi-region; an S3 Express directory bucket,
        ``--x-s3``): such a URL goes through the s3fs client."""
        bucket = self._split(url)[0]
        return ":" in bucket or bucket.endswith("--x-s3")

    def identity(self, url: str, options: ReadOptions = _DEFAULT) -> tuple[int, str]:
        """``(size, stamp)`` of ``url`` now: one HEAD (retried); the stamp is the
        ETag as botocore returns it (quotes included), else the version id."""
        if self._botocores(url):
            return self.fallback.identity(url, options)

        def head() -> tuple[int, str]:
            answer = self._send("HEAD", url, "metadata", {}, options)
            self._refuse(url, "metadata", answer)
            size = answer.headers.get("Content-Length")
            if size is None:
                raise Transient("a HEAD answer without Content-Length")
            return int(size), str(answer.headers.get("ETag") or answer.headers.get("x-amz-version-id") or "")

        return self._retrying(url, "metadata", head, options)

    def tail(self, url: str, n: int, options: ReadOptions = _DEFAULT) -> tuple[int, str, bytes]:
        """``(size, stamp, last bytes)`` of ``url`` from one suffix GET (``Range:
        bytes=-n``, retried), as :meth:`.remote.Client.tail`: the identity as
        :meth:`identity` gives it (the size from ``Content-Range``'s total), the
        file's last ``min(n, size)`` bytes; a store that does not answer suffix
        ranges is asked with a HEAD (remembered per bucket), and the bytes are ``b""``."""
        if self._botocores(url):
            return self.fallback.tail(url, n, options)
        bucket = self._split(url)[0]
        if bucket not in self._no_suffix:
            what = f"the last {n} bytes"
            found = self._retrying(url, what, lambda: self._tail(url, n, what, options), options)
            if found is not None:
                return found
            self._no_suffix.add(bucket)
            log.debug("s3://%s answered no suffix range: its objects' identities are asked with a HEAD", bucket)
        return (*self.identity(url, options), b"")

    def _tail(self, url: str, n: int, what: str, options: ReadOptions) -> tuple[int, str, bytes] | None:
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
        stamp = str(answer.headers.get("ETag") or answer.headers.get("x-amz-version-id") or "")
        return size, stamp, exact(url, data, first, size)

    def _get(self, url: str, start: int, stop: int, size: int | None, stamp: str | None, options: ReadOptions) -> bytes:
        what = f"bytes [{start}, {stop})"
        headers = {"Range": f"bytes={start}-{stop - 1}"}
        etag = strong_etag(stamp)
        if etag is not None:
            headers["If-Match"] = etag
        answer = self._send("GET", url, what, headers, options)
        self._refuse(url, what, answer)
        seen = answer.headers.get("ETag")
        if etag is not None and seen and seen != etag:
            raise Changed(f"ETag {stamp} -> {seen}")
        check_content_range(url, answer.headers.get("Content-Range"), start, stop, size)
        return exact(url, answer.body, start, stop)

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
        """Bytes ``[start, stop)`` of ``url`` checked against ``(size, stamp)``,
        retried, on the pool; a future-like object (``result()``, ``cancel()``)."""
        if self._botocores(url):
            return self.fallback.submit_range(url, start, stop, size, stamp, options, stored)
        what = f"bytes [{start}, {stop})"

        def run() -> tuple[bool, Any]:
            if stop <= start:
                return True, b""
            try:
                return True, self._retrying(
                    url, what, lambda: self._get(url, start, stop, size, stamp, options), options, stored
                )
            except Exception as exc:  # noqa: BLE001 - raised by Pending.result
                return False, exc

        return Pending(self._pool(options.concurrency).submit(run), f"{url}: {what}", wait_bound(options))

    def read_range(
        self, url: str, start: int, stop: int, size: int | None, stamp: str | None, options: ReadOptions = _DEFAULT
    ) -> bytes:
        return self.submit_range(url, start, stop, size, stamp, options).result()

    def cat(self, url: str, options: ReadOptions = _DEFAULT) -> bytes:
        size, stamp = self.identity(url, options)
        return self.read_range(url, 0, size, size, stamp, options) if size else b""

    def fetch(self, url: str, options: ReadOptions = _DEFAULT) -> bytes:
        """The whole object in one GET (retried); ``FileNotFoundError`` if there is none."""
        if self._botocores(url):
            return self.fallback.fetch(url, options)

        def get() -> bytes:
            answer = self._send("GET", url, "the whole file", {}, options)
            self._refuse(url, "the whole file", answer)
            length = answer.headers.get("Content-Length")
            if length is not None and int(length) != len(answer.body):
                raise Transient(f"a short body: {len(answer.body)} of {length} bytes")
            return bytes(answer.body)

        return self._retrying(url, "the whole file", get, options)

    def open_stream(self, url: str, options: ReadOptions = _DEFAULT) -> tuple[_DirectStream, int, str]:
        """One GET of the whole object, its opening retried: ``(stream, size,
        stamp)`` as :meth:`.remote.Client.open_stream` (the index command)."""
        if self._botocores(url):
            return self.fallback.open_stream(url, options)

        def start() -> tuple[_DirectStream, int, str]:
            answer = self._send("GET", url, "the whole file", {}, options, stream=True)
            self._refuse(url, "the whole file", answer)
            assert answer.stream is not None
            size = answer.headers.get("Content-Length")
            if size is None:
                answer.stream.close(False)
                raise Transient("a GET answer without Content-Length")
            stamp = str(answer.headers.get("ETag") or answer.headers.get("x-amz-version-id") or "")
            return answer.stream, int(size), stamp

        return self._retrying(url, "the whole file", start, options)

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

        self._retrying(url, "a write", attempt, options)

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
        names = self._retrying(
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

    def list_identities(
        self, folder: str, prefix: str, last: str, options: ReadOptions = _DEFAULT
    ) -> dict[str, tuple[int, str]]:
        """``{name: (size, ETag)}`` of the objects of the folder URL ``folder`` whose
        names (after the folder's ``/``) start with ``prefix``, up to the name
        ``last``: ListObjectsV2 pages of 1,000 objects (``/`` delimited), the ETag as
        a HEAD gives it (quotes included)."""
        if self._botocores(folder):
            return dict(self.fallback.list_identities(folder, prefix, last, options))
        bucket, key = self._split(folder.rstrip("/") + "/")

        def listing() -> dict[str, tuple[int, str]]:
            found: dict[str, tuple[int, str]] = {}
            for objects, _ in self._pages(folder, bucket, key + prefix, options, 1000):
                found.update((name[len(key) :], (size, etag)) for name, size, etag in objects)
                if objects and objects[-1][0] >= key + last:
                    break  # (names come in order: the rest lie after the last one wanted)
            return found

        return self._retrying(folder, "a listing", listing, options)

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
