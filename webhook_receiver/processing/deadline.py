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

Resolving the target's name comes before any socket: getaddrinfo blocks in
C for as long as the system resolver takes, with no timeout to give it.
:func:`resolve` runs it in a thread of its own and stops waiting when the
attempt's time is up (:class:`NameNotResolved`); the connections then
connect to the addresses, in the time left, and keep the name for TLS
(SNI, the certificate's check) and the Host header.
"""

from __future__ import annotations

import heapq
import ipaddress
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
from urllib3.exceptions import ConnectTimeoutError, NameResolutionError, NewConnectionError
from urllib3.poolmanager import ProxyManager
from urllib3.util.connection import allowed_gai_family

_current = threading.local()


class Deadline:
    """One attempt's end: the sockets it uses, shut down once ``at`` (monotonic) has passed."""

    def __init__(self, at: float, seconds: float) -> None:
        self.at = at
        self.seconds = seconds
        self.expired = False
        # The name that did not resolve in time, if the attempt ended there.
        self.unresolved: str | None = None
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

    def left(self) -> float:
        """The seconds left (none once the time is up)."""
        return max(0.0, self.at - time.monotonic())

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
    deadline = Deadline(time.monotonic() + seconds, seconds)
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


class NameNotResolved(OSError):
    """The target's name did not resolve within the attempt's time."""


# Resolutions running in threads of their own. A resolver that never
# answers leaves each behind until the system resolver gives up (its
# timeout, per name server and try): no more than this many at once; an
# attempt that finds none free waits for one in its time.
MAX_RESOLVING = 16
_resolving = threading.BoundedSemaphore(MAX_RESOLVING)


def resolve(host: str, port: int, *, by: float, within: float, family: int = 0) -> list[str]:
    """The addresses ``host`` resolves to (for TCP), unless ``by`` (monotonic) passes first.

    Then NameNotResolved, saying the name did not resolve ``within`` seconds
    (the attempt's timeout). An address is its own answer, without a thread.
    """
    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if _is_address(name):
        return [name]
    late = NameNotResolved(f"{name} did not resolve within {within:g} s")
    slots = _resolving  # the one its thread gives its slot back to
    if not slots.acquire(timeout=max(0.0, by - time.monotonic())):
        raise late
    answer: list[Any] = []
    done = threading.Event()

    def run() -> None:
        try:
            answer.append(socket.getaddrinfo(name, port, family, socket.SOCK_STREAM))
        except Exception as exc:  # gaierror, or a name idna cannot encode
            answer.append(exc)
        finally:
            slots.release()
            done.set()

    try:
        threading.Thread(target=run, name=f"resolve {name}", daemon=True).start()
    except BaseException:
        slots.release()
        raise
    if not done.wait(max(0.0, by - time.monotonic())):
        raise late
    [found] = answer
    if isinstance(found, Exception):
        raise found
    return list(dict.fromkeys(_address(record[4]) for record in found))


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.partition("%")[0])  # an IPv6 address may name its scope
    except ValueError:
        return False
    return True


def _address(sockaddr: tuple[Any, ...]) -> str:
    """A resolved socket address's host, with an IPv6 address's scope if it has one."""
    if len(sockaddr) == 4 and sockaddr[3]:
        return f"{sockaddr[0]}%{sockaddr[3]}"
    return str(sockaddr[0])


def resolve_in_attempt(host: str, port: int, family: int = 0) -> list[str]:
    """``resolve`` by the end of this thread's running attempt (none: as long as it takes)."""
    deadline: Deadline | None = getattr(_current, "deadline", None)
    if deadline is None:
        found = socket.getaddrinfo(host.strip("[]"), port, family, socket.SOCK_STREAM)
        return list(dict.fromkeys(_address(record[4]) for record in found))
    try:
        return resolve(host, port, by=deadline.at, within=deadline.seconds, family=family)
    except NameNotResolved:
        deadline.unresolved = host
        raise


def connect_time(timeout: Any) -> Any:
    """A connect's ``timeout``, cut to what is left of this thread's running attempt."""
    deadline: Deadline | None = getattr(_current, "deadline", None)
    if deadline is None:
        return timeout
    left = deadline.left()
    if left <= 0:
        raise TimeoutError(f"no time left within {deadline.seconds:g} s")
    return min(timeout, left) if isinstance(timeout, (int, float)) else left


class WatchedConnection:
    """An urllib3 connection mixin: registers its socket with the running attempt's deadline.

    Its name is resolved first, within the attempt's time; each address
    is then tried in what is left. ``_dns_host`` (what urllib3 connects
    to; ``host`` reads it) is an address only while the connect runs.
    """

    sock: Any
    _dns_host: str
    host: str
    port: int
    timeout: Any

    def _new_conn(self) -> socket.socket:
        connection: Any = self  # an HTTPConnection, as urllib3's errors want
        name, timeout = self._dns_host, self.timeout
        try:
            addresses = resolve_in_attempt(name, self.port, allowed_gai_family())
        except NameNotResolved as exc:
            raise ConnectTimeoutError(self, str(exc)) from exc
        except socket.gaierror as exc:
            raise NameResolutionError(self.host, connection, exc) from exc
        try:
            for index, address in enumerate(addresses):
                self._dns_host = address
                try:
                    self.timeout = connect_time(timeout)
                except TimeoutError as exc:
                    raise ConnectTimeoutError(self, f"Connection to {name} timed out") from exc
                try:
                    sock = super()._new_conn()  # type: ignore[misc]
                    break
                except (ConnectTimeoutError, NewConnectionError):
                    if index == len(addresses) - 1:
                        raise
            else:
                raise NewConnectionError(connection, f"{name} resolved to no address")
        finally:
            self._dns_host, self.timeout = name, timeout
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
