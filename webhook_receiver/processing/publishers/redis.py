"""Forwards to Redis Streams (``redis://``, ``rediss://``): an entry added, done on the XADD reply.

The entry's fields: ``message_id`` (the forward's stable key), ``type``
(the event type, when it has one), ``content_type``, ``X-Request-Id`` (the
correlation id), ``X-Webhook-Source``, ``X-Webhook-Event-Id`` and, last,
``body``: what a ``redis`` source reads by default (``dedup_key =
"field:message_id"``, ``body_field = "body"``). A worker killed between the XADD and marking the
delivery done adds the entry again, under the same ``message_id``, which a
consumer deduplicates on. One client (a connection pool) per URL and
process, shared by the worker's threads.

An attempt lasts ``timeout_seconds`` in all: redis-py's timeouts bound the
connect and each read of the socket (a server answering a byte at a time
holds it for ever), so the attempt's sockets are shut down when its time
is up (:mod:`..deadline`), a ``rediss://`` connection's TLS handshake
included, and its host name is resolved within that time too (redis-py's
getaddrinfo had no timeout). redis-py is told to retry nothing (its
defaults differ by version and constructor: ``Redis()`` retries three
times since 6.0, ``from_url``'s pool none in 8.x): the worker retries,
with its backoff.
"""

from __future__ import annotations

import threading
from typing import Any

import redis
import redis.backoff
import redis.exceptions
import redis.retry

from ...config import ForwardConfig, redact_url
from .. import deadline
from .base import BrokerMessage, PublishError

SCHEMES = frozenset({"redis", "rediss"})

_clients: dict[tuple[str, float], Any] = {}
_lock = threading.Lock()


class _Watched:
    """A redis-py connection whose socket the running attempt's deadline shuts down.

    Its name is resolved first, within the attempt's time (redis-py's
    getaddrinfo had none), and each address tried in what is left; ``host``
    is an address only while the TCP connect runs: the TLS handshake that
    follows (SSLConnection) checks the certificate against the name.
    """

    _sock: Any
    host: str
    port: int
    socket_type: int
    socket_connect_timeout: Any

    def _connect(self) -> Any:
        name, timeout = self.host, self.socket_connect_timeout
        addresses = deadline.resolve_in_attempt(name, self.port, self.socket_type)
        try:
            for index, address in enumerate(addresses):
                self.host = address
                self.socket_connect_timeout = deadline.connect_time(timeout)
                try:
                    sock = super()._connect()  # type: ignore[misc]
                    break
                except OSError:
                    if index == len(addresses) - 1:
                        raise
            else:
                raise OSError(f"{name} resolved to no address")
        finally:
            self.host, self.socket_connect_timeout = name, timeout
        deadline.watch_socket(sock)
        return sock

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        deadline.watch_socket(self._sock)  # a pooled connection, reused by this attempt
        super().send_packed_command(command, check_health)  # type: ignore[misc]


class _WatchedConnection(_Watched, redis.Connection):
    pass


class _WatchedSSLConnection(redis.SSLConnection, _WatchedConnection):
    """Watched from its TCP connect on: SSLConnection._connect wraps what ours returns.

    Watched only once wrapped, the TLS handshake had the socket timeout of
    its own, past the attempt's deadline (connect and handshake: up to
    twice timeout_seconds).
    """


def _client(forward: ForwardConfig) -> Any:
    key = (forward.url, forward.timeout_seconds)
    with _lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = redis.Redis.from_url(
                forward.url,
                socket_connect_timeout=forward.timeout_seconds,
                socket_timeout=forward.timeout_seconds,
                client_name="webhook-receiver-forwards",
                retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0),
            )
            pool = client.connection_pool
            # rediss:// makes the pool's connections SSL ones (from the URL).
            ssl = issubclass(pool.connection_class, redis.SSLConnection)
            pool.connection_class = _WatchedSSLConnection if ssl else _WatchedConnection
        return client


def fields(message: BrokerMessage) -> dict[str, str | bytes]:
    """The entry a forward adds for ``message``, the body last."""
    entry: dict[str, str | bytes] = {"message_id": message.message_id}
    if message.event_type:
        entry["type"] = message.event_type
    entry["content_type"] = message.content_type or "application/octet-stream"
    entry["X-Request-Id"] = message.correlation_id
    entry.update(message.headers)
    entry["body"] = message.body
    return entry


def publish(forward: ForwardConfig, message: BrokerMessage) -> None:
    client = _client(forward)
    with deadline.bounded(forward.timeout_seconds) as attempt:
        try:
            client.xadd(forward.stream or "", fields(message))  # type: ignore[arg-type]
        except (redis.exceptions.RedisError, OSError) as exc:
            where = redact_url(forward.url)
            if attempt.unresolved is not None:
                raise PublishError(
                    f"{attempt.unresolved} did not resolve within {forward.timeout_seconds:g} s"
                    f" ({where})"
                ) from exc
            if attempt.expired or not attempt.left():
                raise PublishError(
                    f"no XADD reply from {where} within {forward.timeout_seconds:g} s"
                    f" (its connect included): {type(exc).__name__}: {exc}"
                ) from exc
            raise PublishError(f"{type(exc).__name__} on {where}: {exc}") from exc
