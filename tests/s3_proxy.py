"""A faulty S3 in front of a real one: an HTTP/1.1 proxy on 127.0.0.1 that forwards
every request to an S3 API (moto's server) and, every ``fault_every``-th GET,
answers instead with a fault: ``503 SlowDown`` (S3's XML error), a reset
connection, or a body cut short (the full ``Content-Length`` announced, half
sent). With ``region`` set it plays AWS's region redirect: a request signed for
another region gets ``301 PermanentRedirect`` with ``x-amz-bucket-region``.
With ``tls`` (a certificate and its key) it speaks https. Counts requests by
method and faults by kind; reaches nothing beyond 127.0.0.1.
"""

from __future__ import annotations

import http.client
import http.server
import re
import socket
import struct
import threading
from collections import Counter
from typing import Any

from tests.loopback_server import LoopbackServer

__all__ = ["S3Proxy"]

FAULTS = ("slowdown", "reset", "short")
_SCOPE = re.compile(r"Credential=[^/]+/\d{8}/([^/]+)/s3/aws4_request")


class S3Proxy(LoopbackServer):
    request_queue_size = 128

    def __init__(
        self,
        upstream: str,
        fault_every: int = 0,
        faults: tuple[str, ...] = FAULTS,
        region: str | None = None,
        tls: tuple[str, str] | None = None,
    ) -> None:
        super().__init__(_Handler, tls)  # tls: (certificate, key) for https
        host, _, port = upstream.split("://", 1)[1].rstrip("/").partition(":")
        self.upstream = (host, int(port or 80))
        self.fault_every = fault_every
        self.faults = faults
        self.region = region
        self.lock = threading.Lock()
        self.gets = 0
        self.faulted: Counter = Counter()
        self.requests: Counter = Counter()
        self.redirected = 0

    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.server_address[1]}"

    def next_fault(self, method: str) -> str | None:
        with self.lock:
            self.requests[method] += 1
            if method != "GET" or not self.fault_every:
                return None
            self.gets += 1
            if self.gets % self.fault_every == 0:
                kind = self.faults[(self.gets // self.fault_every) % len(self.faults)]
                self.faulted[kind] += 1
                return kind
        return None


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # headers and body are two writes: with Nagle's algorithm the body would wait for
    # the client's delayed ACK of the headers (up to 40 ms a request, as no store does)
    disable_nagle_algorithm = True
    server: S3Proxy

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _forward(self) -> None:
        server = self.server
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        if server.region is not None:
            scope = _SCOPE.search(self.headers.get("Authorization") or "")
            if scope is not None and scope.group(1) != server.region:
                with server.lock:
                    server.redirected += 1
                xml = (
                    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>PermanentRedirect</Code>'
                    b"<Message>The bucket you are attempting to access must be addressed using the specified "
                    b"endpoint.</Message></Error>"
                )
                self.send_response(301)
                self.send_header("x-amz-bucket-region", server.region)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(0 if self.command == "HEAD" else len(xml)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(xml)
                return
        fault = server.next_fault(self.command)
        if fault == "slowdown":
            xml = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code><Message>Reduce your request rate.</Message></Error>'
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(xml)))
            self.end_headers()
            self.wfile.write(xml)
            return
        if fault == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()
            return
        upstream = http.client.HTTPConnection(*server.upstream, timeout=30)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "keep-alive")}
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            data = response.read()
            self.send_response(response.status)
            for name, value in response.getheaders():
                if name.lower() not in (
                    "connection",
                    "keep-alive",
                    "transfer-encoding",
                    "content-length",
                    "date",
                    "server",
                ):
                    self.send_header(name, value)
            announced = response.getheader("Content-Length")
            self.send_header("Content-Length", announced if self.command == "HEAD" and announced else str(len(data)))
            self.end_headers()
            if self.command == "HEAD":
                return
            if fault == "short" and len(data) > 1:
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            self.wfile.write(data)
        finally:
            upstream.close()

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward
