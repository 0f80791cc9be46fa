"""An object store on 127.0.0.1 for the benchmarks: moto's S3 server in its own
process (``MotoProcess``), reached through ``LatencyProxy``, a reverse proxy that
waits before every response (an object store's first-byte latency), can cap the
aggregate bandwidth of every response body (one token bucket for all
connections), and counts requests by kind (``HEAD``, ``GET`` of an object,
``LIST``, ``PUT``, ...) and body bytes, with the time each request arrived.

The proxy listens on several ports at once (``endpoints``): a benchmark gives each
rank its own endpoint, so that every request is attributed to the rank whose
processes made it (its DataLoader workers inherit its environment), and counts
what a rank asked before its first batch. Everything listens on 127.0.0.1 only;
every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

__all__ = ["LatencyProxy", "MotoProcess", "free_port", "kind_of"]

CHUNK = 64 << 10
HEAD_LIMIT = 64 << 10  # bytes of a request's or response's head


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kind_of(method: str, target: str) -> str:
    """``HEAD``, ``GET`` (an object), ``LIST`` (a bucket's listing), or the method."""
    if method != "GET":
        return method
    parts = urlsplit(target)
    query = parse_qs(parts.query, keep_blank_values=True)
    key = parts.path.lstrip("/").partition("/")[2]
    if not key or "list-type" in query or "delimiter" in query or "prefix" in query:
        return "LIST"
    return "GET"


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started it dies (Linux)."""
    with contextlib.suppress(Exception):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class MotoProcess:
    """``python -m moto.server`` on a free port of 127.0.0.1, in its own process
    (its work does not share the benchmark's interpreter); ``stop`` ends it."""

    def __init__(self, timeout: float = 30.0) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.timeout = timeout
        self.process: subprocess.Popen | None = None

    def start(self) -> MotoProcess:
        self.process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        preexec_fn=_die_with_parent)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"moto's server exited ({self.process.returncode}) before it answered")
            with contextlib.suppress(OSError):
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=2).close()
                return self
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"moto's server did not answer on {self.endpoint} within {self.timeout:.0f}s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

    def __enter__(self) -> MotoProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class Counts:
    """What one endpoint saw: requests and body bytes by kind, and ``[arrival
    time.time(), kind, body bytes]`` of every request in order."""

    requests: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    arrivals: list[list[Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"requests": dict(self.requests), "bytes": dict(self.bytes),
                "arrivals": [list(a) for a in self.arrivals]}


class _Bucket:
    """An aggregate token bucket: every body chunk of every connection reserves
    its slot of the link in arrival order."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self.free_at = 0.0

    async def take(self, n: int) -> None:
        if not self.rate:
            return
        now = time.monotonic()
        start = max(now, self.free_at)
        self.free_at = start + n / self.rate
        if self.free_at - now > 1e-4:
            await asyncio.sleep(self.free_at - now)


async def _read_head(reader: asyncio.StreamReader) -> bytes | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial.strip():
            raise
        return None
    except asyncio.LimitOverrunError:
        raise ValueError("a head larger than 64 KiB") from None
    return head


def _headers(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return lines[0], headers


class LatencyProxy:
    """See the module docstring. ``latency`` seconds before every response (the
    request is forwarded after it); ``bandwidth`` bytes per second shared by
    every response body (``None``: no cap); ``ports`` endpoints."""

    def __init__(self, upstream: str, latency: float = 0.0, bandwidth: float | None = None, ports: int = 1) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.latency, self.bandwidth, self.n_ports = latency, bandwidth, ports
        self.counts: list[Counts] = [Counts() for _ in range(ports)]
        self.endpoints: list[str] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._servers: list[asyncio.base_events.Server] = []
        self._bucket = _Bucket(bandwidth)
        self._tasks: set[asyncio.Task] = set()
        self._inflight = 0

    # -- life ------------------------------------------------------------------------------
    def start(self, timeout: float = 10.0) -> LatencyProxy:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            for _ in range(self.n_ports):
                server = self._loop.run_until_complete(
                    asyncio.start_server(self._serve, "127.0.0.1", 0, limit=HEAD_LIMIT, backlog=512))
                self._servers.append(server)
                self.endpoints.append(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="latency-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise TimeoutError("the latency proxy did not start")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        loop = self._loop
        if loop is None:
            return

        async def close() -> None:
            for server in self._servers:
                server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), loop).result(timeout)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout)
        self._loop = None

    def __enter__(self) -> LatencyProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- counters --------------------------------------------------------------------------
    def reset(self) -> None:
        self.counts = [Counts() for _ in range(self.n_ports)]

    def settle(self, timeout: float = 10.0) -> None:
        """Wait (bounded) until no response is in flight."""
        deadline = time.monotonic() + timeout
        while self._inflight and time.monotonic() < deadline:
            time.sleep(0.01)

    def snapshot(self) -> list[dict[str, Any]]:
        return [c.as_dict() for c in self.counts]

    # -- serving ---------------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        port = writer.get_extra_info("sockname")[1]
        index = next(i for i, e in enumerate(self.endpoints) if e.endswith(f":{port}"))
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                head = await _read_head(reader)
                if head is None:
                    break
                arrived = time.time()
                line, headers = _headers(head)
                method, target = line.split(" ")[0], line.split(" ")[1]
                if headers.get("expect", "").lower() == "100-continue":
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    head = b"\r\n".join(h for h in head.split(b"\r\n") if not h.lower().startswith(b"expect:"))
                body = b""
                if "content-length" in headers:
                    body = await reader.readexactly(int(headers["content-length"]))
                elif headers.get("transfer-encoding", "").lower() == "chunked":
                    raise ValueError("chunked request bodies are not proxied")
                kind = kind_of(method, target)
                counts = self.counts[index]
                counts.requests[kind] += 1
                arrival = [arrived, kind, 0]
                counts.arrivals.append(arrival)
                self._inflight += 1
                try:
                    if self.latency:
                        await asyncio.sleep(self.latency)
                    if upstream is None:
                        upstream = await asyncio.wait_for(asyncio.open_connection(*self.upstream, limit=HEAD_LIMIT), 30)
                    upstream[1].write(head + body)
                    keep = await self._relay(method, upstream[0], writer, counts, arrival)
                finally:
                    self._inflight -= 1
                if not keep:
                    upstream[1].close()
                    upstream = None
                if headers.get("connection", "").lower() == "close":
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError, ValueError, TimeoutError):
            pass
        finally:
            self._tasks.discard(task)
            for w in (writer, upstream[1] if upstream else None):
                if w is not None:
                    with contextlib.suppress(Exception):
                        w.close()

    async def _relay(self, method: str, upstream: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     counts: Counts, arrival: list[Any]) -> bool:
        """One response from ``upstream`` to the client; whether the upstream
        connection stays open."""
        head = await asyncio.wait_for(_read_head(upstream), 120)
        if head is None:
            raise ConnectionError("moto closed the connection")
        line, headers = _headers(head)
        status = int(line.split(" ")[1])
        writer.write(head)
        keep = headers.get("connection", "").lower() != "close" and not line.startswith("HTTP/1.0")
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            await writer.drain()
            return keep
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size_line = await upstream.readuntil(b"\r\n")
                size = int(size_line.split(b";")[0], 16)
                data = await upstream.readexactly(size + 2) if size else b""
                await self._send(writer, size_line + data, size, counts, arrival)
                if not size:
                    trailer = await upstream.readuntil(b"\r\n")
                    writer.write(trailer)
                    break
        elif "content-length" in headers:
            left = int(headers["content-length"])
            while left:
                data = await upstream.read(min(CHUNK, left))
                if not data:
                    raise ConnectionError("moto closed the connection mid-body")
                left -= len(data)
                await self._send(writer, data, len(data), counts, arrival)
        else:  # delimited by the end of the connection
            while data := await upstream.read(CHUNK):
                await self._send(writer, data, len(data), counts, arrival)
            keep = False
        await writer.drain()
        return keep

    async def _send(self, writer: asyncio.StreamWriter, data: bytes, payload: int, counts: Counts,
                    arrival: list[Any]) -> None:
        await self._bucket.take(payload)
        counts.bytes[arrival[1]] += payload
        arrival[2] += payload
        writer.write(data)
        await writer.drain()


if __name__ == "__main__":  # a manual check: python benchmarks/latency_proxy.py
    with MotoProcess() as moto, LatencyProxy(moto.endpoint, latency=0.02) as proxy:
        print("moto", moto.endpoint, "proxy", proxy.endpoints, file=sys.stderr)
        print(os.getpid())
