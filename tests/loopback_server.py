"""What the tests' HTTP servers share (``range_server.RangeServer``,
``s3_proxy.S3Proxy``): an HTTP/1.1 server on 127.0.0.1, a port of its own, in a
thread of its own, https when given a certificate and its key (the handshake in
the accepting thread, bounded), quiet about clients that go away mid-answer."""

from __future__ import annotations

import http.server
import ssl
import threading
from typing import Any, TypeVar

__all__ = ["LoopbackServer"]

S = TypeVar("S", bound="LoopbackServer")


class LoopbackServer(http.server.ThreadingHTTPServer):
    """``handler`` on 127.0.0.1 (``server_address[1]``: its port); ``tls``:
    ``(certificate, key)`` files for https. ``start()`` serves in a daemon thread,
    ``stop()`` ends it."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, handler: type[http.server.BaseHTTPRequestHandler], tls: tuple[str, str] | None = None) -> None:
        super().__init__(("127.0.0.1", 0), handler)
        self.scheme = "http"
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.socket = context.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)
            self.scheme = "https"
        self._thread: threading.Thread | None = None

    def get_request(self) -> Any:
        sock, address = super().get_request()
        if isinstance(sock, ssl.SSLSocket):
            sock.settimeout(10)
            try:
                sock.do_handshake()  # in the handler's thread would be nicer; bounded here
            except (OSError, ssl.SSLError):
                sock.close()
                raise
            sock.settimeout(None)
        return sock, address

    def start(self: S) -> S:
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that goes away mid-answer (a cancelled read, a reset) is no error of the server's."""
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)
