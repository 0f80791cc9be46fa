"""A loopback object-store stand-in: an HTTP/1.1 server on 127.0.0.1 that serves
the files under a root directory with ``Range`` requests, strong ``ETag``\\ s,
``If-Match`` (412 on a changed file), suffix ranges (``bytes=-N``: the last N
bytes, or the whole file when it is shorter; ``suffix=False`` answers them 400,
as servers without them do; ``ranges=False`` ignores ``Range`` and sends 200
with the whole file), ``HEAD`` (or, with ``weak=True``, weak
``ETag``\\ s and no ``If-Match`` support, as some proxies and CDNs answer); that can wait before every
response (an object store's first-byte latency), cap its bandwidth, inject
faults (a 500 / 503, a connection reset in the middle of a body, a short body)
and counts what it serves. Used by the remote tests, the model-based history
test and ``benchmarks/bench_remote.py``; it reaches nothing beyond 127.0.0.1.
"""

from __future__ import annotations

import http.server
import os
import re
import socket
import struct
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import unquote

import pytest

from tests.loopback_server import LoopbackServer

__all__ = ["FirstSampleMark", "RangeServer", "before_first_mark", "serve"]

FAULTS = ("500", "503", "reset", "short")


class RangeServer(LoopbackServer):
    """See the module docstring. ``latency`` seconds before each response;
    ``bandwidth`` bytes per second per response (``None``: no cap);
    ``fault_every`` makes every n-th GET fail (cycling through ``faults``);
    ``require`` names headers every request must carry (else 403); ``weak``
    sends weak ETags (``W/"..."``) and ignores ``If-Match``; ``before_get(path)``
    runs before every GET is answered (a test that rewrites a file mid-epoch), and
    ``on_head(path)`` before every HEAD (what asks a file's identity); ``suffix``
    and ``ranges``: see the module docstring."""

    request_queue_size = 256

    def __init__(
        self,
        root: Path,
        latency: float = 0.0,
        bandwidth: float | None = None,
        fault_every: int = 0,
        faults: tuple[str, ...] = FAULTS,
        scheme: str = "http",
        certfile: str | None = None,
        keyfile: str | None = None,
        require: dict[str, str] | None = None,
        head: bool = True,
        weak: bool = False,
        before_get: Any = None,
        on_head: Any = None,
        suffix: bool = True,
        ranges: bool = True,
    ) -> None:
        super().__init__(RangeHandler, (certfile, keyfile) if scheme == "https" else None)  # type: ignore[arg-type]
        self.root = Path(root)
        self.latency = latency
        self.bandwidth = bandwidth
        self.fault_every = fault_every
        self.faults = faults
        self.require = dict(require or {})  # headers a request must carry (else 403)
        self.head = head  # False: HEAD answers 405, as some signed URLs do
        self.weak = weak
        self.before_get = before_get
        self.on_head = on_head
        self.suffix = suffix  # False: a suffix range (bytes=-N) is answered 400
        self.ranges = ranges  # False: Range is ignored (200, the whole file)
        self.lock = threading.Lock()
        self.reset_counters()

    def reset_counters(self) -> None:
        with self.lock:
            self.served = 0  # body bytes sent
            self.requests: Counter = Counter()  # by method
            self.gets = 0  # GETs seen (fault schedule)
            self.faulted: Counter = Counter()
            self.fault_log: list[tuple[str, str | None, str]] = []  # (path, Range, fault) of every faulted GET
            self.suffix_faults: list[str] = []  # faults for the next suffix GETs (bytes=-N), one each, first
            self.by_path: Counter = Counter()
            self.log: list[tuple[str, str, str | None]] = []  # (method, path, Range) of every request
            self.active = 0

    @property
    def total_requests(self) -> int:
        return sum(self.requests.values())

    def settle(self, timeout: float = 10.0) -> "RangeServer":
        """Wait until no response is being written (a client may have its bytes
        before the server thread counts them)."""
        deadline = time.monotonic() + timeout
        while self.active and time.monotonic() < deadline:
            time.sleep(0.005)
        return self

    def url(self, path: str | os.PathLike) -> str:
        relative = Path(path).resolve().relative_to(self.root.resolve()).as_posix()
        return f"{self.scheme}://127.0.0.1:{self.server_address[1]}/{relative}"

    def next_fault(self, asked: str | None = None) -> str | None:
        """The fault the next GET gets, if any (thread-safe); ``asked``: its ``Range``
        (a suffix GET takes the first of ``suffix_faults`` before the schedule)."""
        with self.lock:
            if self.suffix_faults and (asked or "").strip().startswith("bytes=-"):
                kind = self.suffix_faults.pop(0)
                self.faulted[kind] += 1
                return kind
            self.gets += 1
            if self.fault_every and self.gets % self.fault_every == 0:
                kind = self.faults[(self.gets // self.fault_every) % len(self.faults)]
                self.faulted[kind] += 1
                return kind
        return None


class RangeHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: RangeServer

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        if not self.server.head:
            with self.server.lock:
                self.server.requests["HEAD"] += 1
            self._empty(405)
            return
        self.respond(body=False)

    def do_GET(self) -> None:
        self.respond(body=True)

    def _empty(self, status: int, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def respond(self, body: bool) -> None:
        server = self.server
        with server.lock:
            server.requests[self.command] += 1
            server.log.append((self.command, self.path, self.headers.get("Range")))
            server.active += 1
        try:
            self._respond(body)
        finally:
            with server.lock:
                server.active -= 1

    def _respond(self, body: bool) -> None:
        server = self.server
        if server.latency:
            time.sleep(server.latency)
        if any(self.headers.get(name) != value for name, value in server.require.items()):
            self._empty(403)
            return
        fault = server.next_fault(self.headers.get("Range")) if body else None
        if fault is not None:
            with server.lock:
                server.fault_log.append((self.path, self.headers.get("Range"), fault))
        if fault in ("500", "503"):
            self._empty(int(fault))
            return
        path = server.root / unquote(self.path.split("?", 1)[0].lstrip("/"))
        if body and server.before_get is not None:
            server.before_get(path)
        if not body and server.on_head is not None:
            server.on_head(path)
        try:
            st = path.stat()
            if not path.is_file():
                raise FileNotFoundError
        except OSError:
            self._empty(404)
            return
        etag = f'"{st.st_size}-{st.st_mtime_ns}"'
        if server.weak:
            etag = f"W/{etag}"
        wanted = None if server.weak else self.headers.get("If-Match")
        if wanted and wanted.strip() not in ("*", etag):
            self._empty(412, {"ETag": etag})
            return
        start, end, status = 0, st.st_size, 200
        asked = self.headers.get("Range") if server.ranges else None
        if asked:
            match = re.fullmatch(r"bytes=(\d+)-(\d*)", asked.strip())
            last = re.fullmatch(r"bytes=-(\d+)", asked.strip()) if server.suffix else None
            if last is not None:  # the last N bytes (the whole file when it is shorter)
                start, end = max(0, st.st_size - int(last.group(1))), st.st_size
                if int(last.group(1)) == 0 or st.st_size == 0:
                    self._empty(416, {"Content-Range": f"bytes */{st.st_size}"})
                    return
            elif match is None:
                self._empty(400)
                return
            else:
                start = int(match.group(1))
                end = min(st.st_size, int(match.group(2)) + 1) if match.group(2) else st.st_size
            if start >= st.st_size:
                self._empty(416, {"Content-Range": f"bytes */{st.st_size}"})
                return
            status = 206
        self.send_response(status)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", etag)
        self.send_header("Last-Modified", self.date_time_string(st.st_mtime))
        self.send_header("Content-Type", "application/octet-stream")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{st.st_size}")
        self.end_headers()
        if not body:
            return
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(end - start)
        if len(data) != end - start:  # the file changed under us: a short body, and no keep-alive
            fault = "short"
        with server.lock:
            server.by_path[path.name] += 1
        if fault in ("reset", "short") and (len(data) > 1 or len(data) != end - start):
            half = data[: len(data) // 2] if len(data) == end - start else data
            self.wfile.write(half)
            self.wfile.flush()
            with server.lock:
                server.served += len(half)
            if fault == "reset":  # RST, not FIN: a connection reset in the middle of the body
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return
        self._send(data)

    def _send(self, data: bytes) -> None:
        server = self.server
        if not server.bandwidth:
            self.wfile.write(data)
        else:
            step = 64 << 10
            started = time.monotonic()
            for at in range(0, len(data), step):
                self.wfile.write(data[at : at + step])
                ahead = (at + step) / server.bandwidth - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
        with server.lock:
            server.served += len(data)


class serve:
    """``with serve(root, latency=...) as server:`` a started :class:`RangeServer`."""

    def __init__(self, root: Path, **options: object) -> None:
        self.server = RangeServer(root, **options)  # type: ignore[arg-type]

    def __enter__(self) -> RangeServer:
        return self.server.start()

    def __exit__(self, *exc: object) -> None:
        self.server.stop()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[RangeServer]:
    """A :class:`RangeServer` over the test's ``tmp_path`` for the test's duration
    (``from tests.range_server import served as server`` makes it a ``server`` fixture)."""
    with serve(tmp_path) as srv:
        yield srv


def self_signed(folder: Path) -> tuple[str, str] | None:
    """A certificate and key for 127.0.0.1 made with the ``openssl`` command, or
    ``None`` if there is none."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        return None
    cert, key = folder / "cert.pem", folder / "key.pem"
    done = subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "2",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        capture_output=True,
        timeout=60,
    )
    return (str(cert), str(key)) if done.returncode == 0 else None


MARK = "/first-sample-mark/"


class FirstSampleMark:
    """A ``.map()`` that, at the first sample a process yields, asks ``server`` for
    :data:`MARK` (a 404 it logs), so the server's log shows which requests came
    before a process's first sample (picklable: DataLoader workers of any start)."""

    def __init__(self, server: RangeServer) -> None:
        self.url = f"{server.scheme}://127.0.0.1:{server.server_address[1]}{MARK}"
        self.pid: int | None = None

    def __call__(self, sample: Any) -> Any:
        if self.pid != os.getpid():
            import urllib.error
            import urllib.request

            self.pid = os.getpid()
            try:
                urllib.request.urlopen(f"{self.url}{self.pid}", timeout=30).close()
            except urllib.error.HTTPError:
                pass
        return sample


def before_first_mark(server: RangeServer) -> list[tuple[str, str, str | None]]:
    """The requests the server's log holds before the first :class:`FirstSampleMark`."""
    log = server.settle().log
    at = next((i for i, (_, path, _) in enumerate(log) if path.startswith(MARK)), len(log))
    return log[:at]
