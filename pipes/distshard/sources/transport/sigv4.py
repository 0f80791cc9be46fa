"""AWS Signature Version 4 for S3 requests (``hashlib`` and ``hmac`` only).

What :mod:`.s3direct` signs its requests with, and nothing more: the canonical
request by S3's rules (the path signed as sent, each key segment URI-encoded
once with ``/`` kept; the query sorted and encoded; every header sent signed
but those AWS leaves out), the signing key of a day, region and service, and
the ``Authorization`` header. ``tests/test_sigv4.py`` checks it against
botocore's ``S3SigV4Auth`` for random keys, queries, regions and credentials;
this module imports neither botocore nor anything of distshard.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Mapping, Sequence
from urllib.parse import quote

__all__ = ["EMPTY_SHA256", "Credentials", "encode_key", "sign", "signing_key"]

#: the SHA-256 of an empty body: what a GET, HEAD or list request signs as its payload
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"

# headers AWS never signs (botocore's SIGNED_HEADERS_BLACKLIST)
_UNSIGNED = frozenset(
    {
        "baggage",
        "connection",
        "expect",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "traceparent",
        "tracestate",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "user-agent",
        "x-amzn-trace-id",
    }
)


class Credentials:
    """An access key, its secret and, for temporary credentials, the session token."""

    __slots__ = ("key", "secret", "token")

    def __init__(self, key: str, secret: str, token: str | None = None) -> None:
        self.key, self.secret, self.token = key, secret, token or None

    def __repr__(self) -> str:  # never the secret
        return f"Credentials(key={self.key!r}, token={'yes' if self.token else 'no'})"


def encode_key(key: str) -> str:
    """An object key as S3 sends it in the path: every byte but unreserved ones
    and ``/`` percent-encoded once (UTF-8)."""
    return quote(key.encode("utf-8"), safe="/~")


def canonical_query(params: Sequence[tuple[str, str]]) -> str:
    """The query as signed and sent: each name and value encoded, sorted by name then value."""
    pairs = sorted((quote(k, safe="-_.~"), quote(str(v), safe="-_.~")) for k, v in params)
    return "&".join(f"{k}={v}" for k, v in pairs)


def signing_key(secret: str, day: str, region: str, service: str = "s3") -> bytes:
    """The key of one day (``YYYYMMDD``), region and service."""
    k = hmac.new(f"AWS4{secret}".encode(), day.encode(), hashlib.sha256).digest()
    for part in (region, service, "aws4_request"):
        k = hmac.new(k, part.encode(), hashlib.sha256).digest()
    return k


def sign(
    method: str,
    host: str,
    path: str,
    query: Sequence[tuple[str, str]],
    headers: Mapping[str, str],
    credentials: Credentials,
    region: str,
    *,
    payload: str = EMPTY_SHA256,
    now: float | None = None,
    service: str = "s3",
) -> dict[str, str]:
    """The headers to send for one request: ``headers`` plus ``host``,
    ``x-amz-date``, ``x-amz-content-sha256`` (``payload``: the body's SHA-256, or
    :data:`UNSIGNED_PAYLOAD`), ``x-amz-security-token`` when the credentials have
    one, and ``Authorization``. ``path`` is the path as sent (keys encoded by
    :func:`encode_key`); ``host`` as the ``Host`` header says it (a port only
    when not the scheme's default); ``now``: seconds since the epoch."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    out = {name.lower(): value for name, value in headers.items()}
    out.pop("authorization", None)
    out["host"] = host
    out["x-amz-date"] = stamp
    out["x-amz-content-sha256"] = payload
    if credentials.token:
        out["x-amz-security-token"] = credentials.token
    signed = sorted(name for name in out if name not in _UNSIGNED)
    canonical = "\n".join(
        [
            method.upper(),
            path or "/",
            canonical_query(query),
            "".join(f"{name}:{' '.join(out[name].split())}\n" for name in signed),
            ";".join(signed),
            payload,
        ]
    )
    day = stamp[:8]
    scope = f"{day}/{region}/{service}/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode("utf-8")).hexdigest()])
    signature = hmac.new(signing_key(credentials.secret, day, region, service), to_sign.encode(), hashlib.sha256)
    out["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={credentials.key}/{scope}, "
        f"SignedHeaders={';'.join(signed)}, Signature={signature.hexdigest()}"
    )
    return out
