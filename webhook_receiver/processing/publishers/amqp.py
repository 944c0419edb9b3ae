"""Forwards to RabbitMQ (``amqp://``, ``amqps://``): publisher confirms and ``mandatory=True``.

The delivery is done only on the broker's confirm; an unroutable return or
a nack is a retryable failure; a message past the broker's
``max_message_size`` goes dead at once. AMQP's short strings hold 255 bytes: a
longer message id is sent as ``sha256:<hex>`` of the stable key (as
stable), with the key itself in the ``X-Message-Id`` header; a longer type,
correlation id or content type goes in a header instead of its property; a
longer routing key cannot be sent, and the delivery goes dead at once
rather than failing every attempt.

Connections are kept per thread and URL (pika's are not thread-safe), and
opened again after an error.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import pika
import pika.exceptions
from pika.adapters.utils.connection_workflow import AMQPConnectorException

from ...config import ForwardConfig, redact_url
from ..deadline import NameNotResolved, resolve
from .base import BrokerMessage, PublishError, PublishRefused

log = logging.getLogger(__name__)

T = TypeVar("T")

SCHEMES = frozenset({"amqp", "amqps"})
_PERSISTENT = 2
# How RabbitMQ closes the channel of a message past its max_message_size
# (128 MiB by default before 4.0, 16 MiB since).
_PRECONDITION_FAILED = 406
_TOO_LARGE = "larger than configured max size"


class _TimedOut(Exception):
    """The attempt's time is up (raised inside pika's wait for the broker)."""


_local = threading.local()


def _amqp_channel(forward: ForwardConfig, deadline: float) -> tuple[Any, Any]:
    """This thread's connection and confirming channel to the forward's broker.

    A new one is opened by ``deadline`` (``time.monotonic()``): the
    connection (TCP, TLS, the AMQP handshake) within what is left of it,
    then its channel and the confirm mode, whose answers pika's blocking
    connection would wait for with no bound.
    """
    channels: dict[str, tuple[Any, Any]] = _local.__dict__.setdefault("amqp", {})
    held = channels.get(forward.url)
    if held is not None and held[0].is_open and held[1].is_open:
        return held
    params = pika.URLParameters(forward.url)
    params.blocked_connection_timeout = forward.timeout_seconds
    params.client_properties = {"connection_name": f"webhook-receiver forward {forward.name}"}
    connection = _connect(params, deadline, forward.timeout_seconds)
    try:
        channel = _by_deadline(connection, deadline, connection.channel)
        _by_deadline(connection, deadline, channel.confirm_delivery)
    except BaseException:
        _close(connection, quiet=True)
        raise
    channels[forward.url] = (connection, channel)
    return connection, channel


def _connect(params: pika.URLParameters, deadline: float, timeout: float) -> Any:
    """A connection by ``deadline``, whatever the addresses and tries.

    pika gives each try (each address the host resolves to, each of the
    URL's ``connection_attempts``) its socket and stack timeouts in full,
    with ``retry_delay`` between: an attempt could take several times its
    timeout. Here the addresses are resolved first, by the deadline too
    (getaddrinfo has no timeout: a slow resolver held the attempt; past it,
    NameNotResolved), and pika tries one at a time, in the time left; a
    pause that would outlast it ends the attempt.
    """
    if params.ssl_options is not None and params.ssl_options.server_hostname is None:
        params.ssl_options.server_hostname = params.host  # the name, not an address, is verified
    addresses = resolve(params.host, params.port, by=deadline, within=timeout)
    cycles, pause = params.connection_attempts, params.retry_delay
    params.connection_attempts = 1
    error: Exception | None = None
    for cycle in range(cycles):
        if cycle:
            if pause >= deadline - time.monotonic():
                break
            time.sleep(pause)
        for address in addresses:
            if error is not None and time.monotonic() >= deadline:
                raise error
            params.host = address
            params.socket_timeout = params.stack_timeout = _left(deadline)
            try:
                return pika.BlockingConnection(params)
            except (pika.exceptions.AMQPError, AMQPConnectorException, OSError) as exc:
                error = exc
    assert error is not None
    raise error


def _left(deadline: float) -> float:
    """The seconds left until ``deadline``; the attempt's time is up when none are."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise _TimedOut
    return left


def _by_deadline(connection: Any, deadline: float, call: Callable[[], T]) -> T:
    """``call()`` on ``connection``, its waits for the broker ended at ``deadline``.

    pika's blocking connection waits for a confirm (or a channel's opening)
    with no bound of its own, and a broker can hold one back while its
    connection stays alive (a quorum queue without a majority of its
    replicas): the worker would hang. A timer of the connection's I/O loop,
    which runs inside that wait, ends it by raising; the connection is then
    dropped (an answer may still be due on it). pika's blocking
    ``call_later`` would not do: its callbacks only run in
    ``process_data_events``.
    """
    impl = connection._impl  # private: see above
    timer = impl._adapter_call_later(_left(deadline), _timed_out)
    try:
        return call()
    finally:
        impl._adapter_remove_timeout(timer)


def _timed_out() -> None:
    raise _TimedOut


def close_thread_connections() -> None:
    """Close this thread's AMQP connections (a worker stopping: the broker sees a clean close)."""
    for url in list(_local.__dict__.get("amqp", {})):
        _drop_amqp(url)


def _drop_amqp(url: str, *, quiet: bool = False) -> None:
    """Close this thread's connection to the forward's broker (``quiet``: it stopped answering)."""
    held = _local.__dict__.get("amqp", {}).pop(url, None)
    if held is not None:
        _close(held[0], quiet=quiet)


def _close(connection: Any, *, quiet: bool) -> None:
    """Close ``connection`` (``quiet``: the broker stopped answering).

    pika's close waits for the broker's Close-Ok, for ever: when the broker
    went quiet the socket is shut first, so that the close ends at once.
    """
    if not connection.is_open:
        return
    sock = None
    if quiet:
        transport = getattr(connection._impl, "_transport", None)  # private: see above
        sock = getattr(transport, "_sock", None)
        if isinstance(sock, socket.socket):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
    try:
        connection.close()
    except (pika.exceptions.AMQPError, OSError):
        pass
    if isinstance(sock, socket.socket):
        sock.close()  # pika's close on a lost stream leaves it open


# AMQP's short strings (the routing key, message_id, type, ...) hold at most 255 bytes.
_SHORT_STRING = 255
# Where a property too long for a short string travels instead (headers have no such limit).
_LONG_PROPERTY_HEADERS = {
    "correlation_id": "X-Request-Id",
    "type": "X-Webhook-Event-Type",
    "content_type": "X-Content-Type",
}


def _fits(value: str | None) -> bool:
    return value is None or len(value.encode("utf-8")) <= _SHORT_STRING


def _amqp_properties(message: BrokerMessage) -> pika.BasicProperties:
    """The message's properties; what would not fit a short string goes in the headers."""
    headers = dict(message.headers)
    message_id = message.message_id
    if not _fits(message_id):
        # A dedup key may be 512 characters: a digest of the stable key is
        # as stable, and the key itself travels in a header.
        headers["X-Message-Id"] = message_id
        message_id = "sha256:" + hashlib.sha256(message_id.encode("utf-8")).hexdigest()
    values: dict[str, str | None] = {
        "correlation_id": message.correlation_id,
        "type": message.event_type,
        "content_type": message.content_type or "application/octet-stream",
    }
    for name, value in list(values.items()):
        if value is not None and not _fits(value):
            headers[_LONG_PROPERTY_HEADERS[name]] = value
            del values[name]
    return pika.BasicProperties(
        message_id=message_id, delivery_mode=_PERSISTENT, headers=headers, **values
    )


def publish(forward: ForwardConfig, message: BrokerMessage) -> None:
    routing_key = (forward.routing_key or "").replace("{event_type}", message.event_type or "")
    if not _fits(routing_key):
        raise PublishRefused(
            f"the routing key is longer than AMQP's {_SHORT_STRING} bytes: {routing_key[:60]!r}..."
        )
    properties = _amqp_properties(message)
    # The whole attempt, a new connection's opening included, ends within
    # the forward's timeout: the worker's lease is only required to
    # outlast twice that.
    deadline = time.monotonic() + forward.timeout_seconds
    # A kept connection may have been closed by the broker while the worker
    # was idle (missed heartbeats): one fresh connection is tried at once,
    # in the time left.
    for fresh in (False, True):
        opened = False
        try:
            connection, channel = _amqp_channel(forward, deadline)
            opened = True
            _by_deadline(
                connection,
                deadline,
                partial(
                    channel.basic_publish,
                    forward.exchange,
                    routing_key,
                    message.body,
                    properties,
                    mandatory=True,
                ),
            )
            return
        except _TimedOut as exc:
            _drop_amqp(forward.url, quiet=True)
            waited = "confirm" if opened else "open channel"
            raise PublishError(
                f"no {waited} from the broker within {forward.timeout_seconds:g} s"
            ) from exc
        except pika.exceptions.UnroutableError as exc:
            raise PublishError(
                f"unroutable: exchange {forward.exchange!r} has no queue for {routing_key!r}"
            ) from exc
        except pika.exceptions.NackError as exc:
            raise PublishError("the broker nacked the message") from exc
        except pika.exceptions.ChannelClosedByBroker as exc:
            _drop_amqp(forward.url)
            if exc.reply_code == _PRECONDITION_FAILED and _TOO_LARGE in exc.reply_text:
                # Past the broker's max_message_size: no attempt gets through.
                raise PublishRefused(
                    f"the message ({len(message.body)} bytes of body) is refused by the "
                    f"broker: {exc.reply_text}"
                ) from exc
            raise PublishError(f"channel closed by the broker: {exc.reply_text}") from exc
        except NameNotResolved as exc:  # the attempt's time is up
            raise PublishError(f"{exc} ({redact_url(forward.url)})") from exc
        # pika raises its connection workflow's own errors (a handshake past
        # stack_timeout), which are not AMQPErrors.
        except (pika.exceptions.AMQPError, AMQPConnectorException, OSError) as exc:
            _drop_amqp(forward.url)
            if fresh or deadline - time.monotonic() <= 0:
                raise PublishError(
                    f"{type(exc).__name__} on {redact_url(forward.url)}: {exc}"
                ) from exc
    raise AssertionError("unreachable")
