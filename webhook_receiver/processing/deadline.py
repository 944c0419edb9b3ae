"""A whole HTTP attempt bounded in time, not each of its socket operations.

requests' ``timeout`` bounds the connect and each read of the socket: a
target that sends a byte of its answer a little more often than that (a
status line, headers or a body trickled out) holds the call for as long as
it likes, past the delivery's lease, and a second worker then claims the
delivery and sends it again. Here every socket an attempt opens or reuses
is noted while the attempt runs (the adapter's connections register it),
and one watchdog thread shuts them down when the attempt's time is up: the
blocked read returns at once and the call fails, which the forward reports
as a timeout. The Redis and SQS forwards, whose clients time each socket
operation too, register their connections' sockets the same way
(:func:`watch_socket`, :class:`WatchedConnection`).
"""

from __future__ import annotations

import heapq
import itertools
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.poolmanager import ProxyManager

_current = threading.local()


class Deadline:
    """One attempt's end: the sockets it uses, shut down once ``at`` (monotonic) has passed."""

    def __init__(self, at: float) -> None:
        self.at = at
        self.expired = False
        self._ended = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    def watch(self, sock: Any) -> None:
        """Shut ``sock`` down with the attempt, if it is still running then."""
        try:
            # A duplicate of the descriptor: the same connection, still
            # open when TLS wraps (and detaches) the socket urllib3 made.
            copy = socket.fromfd(sock.fileno(), sock.family, sock.type)
        except (OSError, AttributeError):
            return
        with self._lock:
            if self._ended:
                copy.close()
                return
            self._sockets.append(copy)
            if self.expired:
                _shut(copy)

    def expire(self) -> None:
        with self._lock:
            if self._ended:
                return
            self.expired = True
            for sock in self._sockets:
                _shut(sock)

    def end(self) -> None:
        with self._lock:
            self._ended = True
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            sock.close()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # closed already


class _Watchdog:
    """One thread for every attempt's deadline, started at the first."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Deadline]] = []
        self._order = itertools.count()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, deadline: Deadline) -> None:
        with self._changed:
            heapq.heappush(self._heap, (deadline.at, next(self._order), deadline))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="forward-deadlines", daemon=True
                )
                self._thread.start()
            self._changed.notify()

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._heap:
                    self._changed.wait()
                at, _, deadline = self._heap[0]
                wait = at - time.monotonic()
                if wait > 0:
                    self._changed.wait(wait)
                    continue
                heapq.heappop(self._heap)
            deadline.expire()  # a no-op for an attempt that ended


_watchdog = _Watchdog()


@contextmanager
def bounded(seconds: float) -> Iterator[Deadline]:
    """Bound the HTTP attempt this thread runs in the block to ``seconds`` in all."""
    deadline = Deadline(time.monotonic() + seconds)
    _current.deadline = deadline
    _watchdog.add(deadline)
    try:
        yield deadline
    finally:
        _current.deadline = None
        deadline.end()


def watch_socket(sock: Any) -> None:
    """Shut ``sock`` down when this thread's running attempt (if any) is out of time."""
    deadline: Deadline | None = getattr(_current, "deadline", None)
    if deadline is not None and sock is not None:
        deadline.watch(sock)


class WatchedConnection:
    """An urllib3 connection mixin: registers its socket with the running attempt's deadline."""

    sock: Any

    def _new_conn(self) -> socket.socket:
        sock = super()._new_conn()  # type: ignore[misc]
        watch_socket(sock)
        return sock  # type: ignore[no-any-return]

    def request(self, *args: Any, **kwargs: Any) -> None:
        watch_socket(self.sock)  # a kept-alive connection, reused by this attempt
        super().request(*args, **kwargs)  # type: ignore[misc]


class _WatchedHTTPConnection(WatchedConnection, HTTPConnection):
    pass


class _WatchedHTTPSConnection(WatchedConnection, HTTPSConnection):
    pass


class _HTTPPool(HTTPConnectionPool):
    ConnectionCls = _WatchedHTTPConnection


class _HTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPSConnection


_POOLS = {"http": _HTTPPool, "https": _HTTPSPool}


class Adapter(HTTPAdapter):
    """requests' adapter whose connections register with the running attempt's deadline."""

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = _POOLS

    def proxy_manager_for(self, proxy: str, **proxy_kwargs: Any) -> Any:
        manager = super().proxy_manager_for(proxy, **proxy_kwargs)
        if isinstance(manager, ProxyManager):  # not SOCKS, whose pools are its own
            manager.pool_classes_by_scheme = _POOLS
        return manager


def mount(http: requests.Session) -> None:
    """Give ``http`` the adapters whose attempts ``bounded`` can end (once per session)."""
    if not isinstance(http.get_adapter("http://"), Adapter):
        http.mount("http://", Adapter())
        http.mount("https://", Adapter())
