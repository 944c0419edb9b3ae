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
from typing import Any

import pika
import pika.exceptions

from ...config import ForwardConfig, redact_url
from .base import BrokerMessage, PublishError, PublishRefused

log = logging.getLogger(__name__)

SCHEMES = frozenset({"amqp", "amqps"})
_PERSISTENT = 2
# How RabbitMQ closes the channel of a message past its max_message_size
# (128 MiB by default before 4.0, 16 MiB since).
_PRECONDITION_FAILED = 406
_TOO_LARGE = "larger than configured max size"


class _ConfirmTimedOut(Exception):
    """The broker did not confirm within the forward's timeout (raised inside pika's wait)."""


_local = threading.local()


def _amqp_channel(forward: ForwardConfig) -> tuple[Any, Any]:
    """This thread's connection and confirming channel to the forward's broker."""
    channels: dict[str, tuple[Any, Any]] = _local.__dict__.setdefault("amqp", {})
    held = channels.get(forward.url)
    if held is not None and held[0].is_open and held[1].is_open:
        return held
    params = pika.URLParameters(forward.url)
    params.socket_timeout = forward.timeout_seconds
    # Connecting (TCP, TLS, the AMQP handshake) within the same bound: 15 s by default.
    params.stack_timeout = forward.timeout_seconds
    params.blocked_connection_timeout = forward.timeout_seconds
    params.client_properties = {"connection_name": f"webhook-receiver forward {forward.name}"}
    connection = pika.BlockingConnection(params)
    channel = connection.channel()
    channel.confirm_delivery()
    channels[forward.url] = (connection, channel)
    return connection, channel


def _confirmed_publish(
    connection: Any, channel: Any, timeout: float, *args: Any, **kwargs: Any
) -> None:
    """``basic_publish`` on a confirming channel, its wait for the confirm bounded by ``timeout``.

    pika's blocking channel waits for the confirm with no bound of its own,
    and a broker can hold one back while its connection stays alive (a
    quorum queue without a majority of its replicas): the worker would
    hang. A timer of the connection's I/O loop, which runs inside that
    wait, ends it by raising; the connection is then dropped (a confirm may
    still be due on it). pika's blocking ``call_later`` would not do: its
    callbacks only run in ``process_data_events``.
    """
    impl = connection._impl  # private: see above
    timer = impl._adapter_call_later(timeout, _confirm_timed_out)
    try:
        channel.basic_publish(*args, **kwargs)
    finally:
        impl._adapter_remove_timeout(timer)


def _confirm_timed_out() -> None:
    raise _ConfirmTimedOut


def close_thread_connections() -> None:
    """Close this thread's AMQP connections (a worker stopping: the broker sees a clean close)."""
    for url in list(_local.__dict__.get("amqp", {})):
        _drop_amqp(url)


def _drop_amqp(url: str, *, quiet: bool = False) -> None:
    """Close this thread's connection to the forward's broker (``quiet``: it stopped answering).

    pika's close waits for the broker's Close-Ok, for ever: when the broker
    went quiet the socket is shut first, so that the close ends at once.
    """
    held = _local.__dict__.get("amqp", {}).pop(url, None)
    if held is None or not held[0].is_open:
        return
    sock = None
    if quiet:
        transport = getattr(held[0]._impl, "_transport", None)  # private: see above
        sock = getattr(transport, "_sock", None)
        if isinstance(sock, socket.socket):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
    try:
        held[0].close()
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
    # A kept connection may have been closed by the broker while the worker
    # was idle (missed heartbeats): one fresh connection is tried at once.
    for fresh in (False, True):
        try:
            connection, channel = _amqp_channel(forward)
            _confirmed_publish(
                connection,
                channel,
                forward.timeout_seconds,
                forward.exchange,
                routing_key,
                message.body,
                properties,
                mandatory=True,
            )
            return
        except _ConfirmTimedOut as exc:
            _drop_amqp(forward.url, quiet=True)
            raise PublishError(
                f"no confirm from the broker within {forward.timeout_seconds:g} s"
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
        except (pika.exceptions.AMQPError, OSError) as exc:
            _drop_amqp(forward.url)
            if fresh:
                raise PublishError(
                    f"{type(exc).__name__} on {redact_url(forward.url)}: {exc}"
                ) from exc
    raise AssertionError("unreachable")
