"""What the direct S3 client (:mod:`.s3direct`) holds in one process: a thread
pool as large as the largest ``ReadOptions.concurrency`` asked, and keep-alive
``http.client`` connections, one per thread and host.

Fork safety: they belong to the process that made them. In a forked child (a
DataLoader worker) the fork registry marks every hold inherited
(:func:`_after_fork_in_child`); the client's :class:`PerProcess` then makes the
child its own on first use and keeps the parent's referenced, never using or
closing them (closing would shut the parent's sockets).
"""

from __future__ import annotations

import concurrent.futures
import http.client
import ssl
import threading
import weakref

from ...forks import at_fork
from .s3config import Config

__all__ = ["Connections", "PerProcess"]


class Connections:
    """A client's pool and connections in one process."""

    def __init__(self) -> None:
        self.inherited = False  # set in a forked child: the parent's, never used
        self.lock = threading.Lock()
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.size = 0
        self.connections: dict[tuple[int, str], http.client.HTTPConnection] = {}
        self.ssl: ssl.SSLContext | None = None

    def pool_of(self, size: int) -> concurrent.futures.ThreadPoolExecutor:
        """The pool, made again larger if it has fewer than ``size`` threads."""
        pool = self.pool
        if pool is None or self.size < size:
            with self.lock:
                if self.pool is None or self.size < size:
                    old = self.pool
                    self.pool = concurrent.futures.ThreadPoolExecutor(size, thread_name_prefix="distshard-s3")
                    self.size = size
                    if old is not None:
                        old.shutdown(wait=False)  # what it was given still runs
                pool = self.pool
        assert pool is not None
        return pool

    def connection(self, host: str, config: Config) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection to ``host`` and whether it is new."""
        key = (threading.get_ident(), host)
        conn = self.connections.get(key)
        if conn is not None:
            return conn, False
        name, _, port_text = host.partition(":")
        port = int(port_text) if port_text else config.port
        if config.scheme == "https":
            conn = http.client.HTTPSConnection(config.host or name, port, timeout=60.0, context=self.ssl_of(config))
        else:
            conn = http.client.HTTPConnection(config.host or name, port, timeout=60.0)
        with self.lock:
            self.connections[key] = conn
        return conn, True

    def ssl_of(self, config: Config) -> ssl.SSLContext:
        """The https context of this process (made once)."""
        if self.ssl is None:
            self.ssl = ssl.create_default_context(cafile=config.ca_bundle)
        return self.ssl

    def hand_over(self, host: str) -> None:
        """Forget this thread's connection to ``host``: a streamed body's own until
        it is read (see :meth:`give_back`)."""
        with self.lock:
            self.connections.pop((threading.get_ident(), host), None)

    def drop(self, host: str, conn: http.client.HTTPConnection) -> None:
        """Close ``conn`` and forget it as this thread's connection to ``host``."""
        with self.lock:
            if self.connections.get((threading.get_ident(), host)) is conn:
                del self.connections[(threading.get_ident(), host)]
        conn.close()

    def give_back(self, host: str, conn: http.client.HTTPConnection, reusable: bool) -> None:
        """A streamed body's connection, done with: kept as this thread's connection
        to ``host`` if ``reusable`` and the thread has none, else closed; left alone
        in a forked child (the parent's socket)."""
        if self.inherited:
            return
        if reusable:
            with self.lock:
                if (threading.get_ident(), host) not in self.connections:
                    self.connections[(threading.get_ident(), host)] = conn
                    return
        conn.close()


_HELD: "weakref.WeakSet[Connections]" = weakref.WeakSet()  # every client's, in this process
_ORPHANS: list[Connections] = []  # what forked children inherited: kept referenced, never used nor closed


def _made() -> Connections:
    held = Connections()
    _HELD.add(held)
    return held


def _after_fork_in_child() -> None:
    for held in list(_HELD):
        held.inherited = True


at_fork(_after_fork_in_child)


class PerProcess:
    """A client's :class:`Connections` in the process it is used in."""

    def __init__(self) -> None:
        self._held = _made()

    @property
    def current(self) -> Connections:
        held = self._held
        if held.inherited:  # a forked child: its own pool and connections
            _ORPHANS.append(held)
            held = self._held = _made()
        return held
