"""Forwards to message brokers: publish the event instead of POSTing it.

A forward whose URL is ``amqp://`` (or ``amqps://``) publishes to an
exchange with publisher confirms and ``mandatory=True``: the delivery is
done only on the broker's confirm; an unroutable return or a nack is a
retryable failure. A ``nats://`` forward publishes to JetStream and is
done on its PubAck (one marked ``duplicate`` too: JetStream's duplicate
window dropped a republish of a message it has).

The message id (AMQP ``message_id``, NATS ``Nats-Msg-Id``) is the forward's
stable key, ``<consumer>:<source>:<dedup key>``: a worker killed between
the publish and marking the delivery done publishes the same id again, which
JetStream drops within its window and a RabbitMQ consumer can deduplicate on.
AMQP's short strings hold 255 bytes: a longer message id is sent as
``sha256:<hex>`` of the stable key (as stable), with the key itself in the
``X-Message-Id`` header; a longer type, correlation id or content type goes
in a header instead of its property; a longer routing key cannot be sent,
and the delivery goes dead at once rather than failing every attempt.

Connections are kept per thread and URL (pika's are not thread-safe), and
opened again after an error.

A ``kafka://`` forward produces through an idempotent producer
(``enable.idempotence``, ``acks=all``), one per forward in a process, made
at its first delivery and shared by the worker's threads (librdkafka's
client is thread-safe); a thread of its own serves its delivery reports.
The delivery is done only on the record's delivery report, awaited at most
``timeout_seconds`` (librdkafka's ``message.timeout.ms`` too): a failed
report, or none in time, is a retryable failure. Within that time the
producer rides out a cut connection by itself: it reconnects and sends the
records in flight again under their sequence numbers, which the broker
writes once. The record carries the event's body, ``message-id`` (the
stable key), ``content-type``, ``type`` (the event type), ``X-Request-Id``
(the correlation id), ``X-Webhook-Source`` and ``X-Webhook-Event-Id``; its
key is the event's dedup key (or its type, as the forward's ``key`` says).

A record that timed out in flight may have been written all the same
(librdkafka calls it possibly persisted): the next attempt writes it again
under the same ``message-id``, which a consumer deduplicates on. A producer
whose delivery failed is replaced by a fresh one (a new producer id) at the
next delivery: after a timeout librdkafka bumps its epoch, which a broker
without KIP-360 fences for good, and it remembers a missing topic as missing
for minutes.
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import logging
import socket
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import confluent_kafka
import nats
import nats.errors
import nats.js.errors
import pika
import pika.exceptions

from ..config import ForwardConfig, redact_url

AMQP_SCHEMES = frozenset({"amqp", "amqps"})
NATS_SCHEMES = frozenset({"nats", "tls"})
KAFKA_SCHEMES = frozenset({"kafka"})
BROKER_SCHEMES = AMQP_SCHEMES | NATS_SCHEMES | KAFKA_SCHEMES
_PERSISTENT = 2
# pika logs a returned message with the start of its body: events stay out of the logs.
logging.getLogger("pika.adapters.blocking_connection").setLevel(logging.ERROR)
log = logging.getLogger(__name__)


class PublishError(Exception):
    """A publish was not confirmed; the delivery is retried."""


class PublishRefused(PublishError):
    """The message cannot be published as configured (whatever the attempt): not retried."""


class _ConfirmTimedOut(Exception):
    """The broker did not confirm within the forward's timeout (raised inside pika's wait)."""


@dataclass(frozen=True)
class BrokerMessage:
    """What a broker forward publishes for one event."""

    body: bytes
    content_type: str | None
    message_id: str
    correlation_id: str
    event_type: str | None
    # Extra headers (AMQP headers table, NATS headers): source, event id.
    headers: dict[str, str] = field(default_factory=dict)


def publish(forward: ForwardConfig, message: BrokerMessage) -> None:
    """Publish ``message`` through ``forward``; return once confirmed, else raise PublishError."""
    if forward.scheme in AMQP_SCHEMES:
        _publish_amqp(forward, message)
    elif forward.scheme in KAFKA_SCHEMES:
        _publish_kafka(forward, message)
    else:
        _publish_nats(forward, message)


# -- RabbitMQ ------------------------------------------------------------------

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


def _publish_amqp(forward: ForwardConfig, message: BrokerMessage) -> None:
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
            raise PublishError(f"channel closed by the broker: {exc.reply_text}") from exc
        except (pika.exceptions.AMQPError, OSError) as exc:
            _drop_amqp(forward.url)
            if fresh:
                raise PublishError(
                    f"{type(exc).__name__} on {redact_url(forward.url)}: {exc}"
                ) from exc
    raise AssertionError("unreachable")


# -- NATS JetStream --------------------------------------------------------------


class _NatsLoop:
    """One event loop thread per process for JetStream publishes, with a connection per URL."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.connections: dict[str, Any] = {}
        # A first connect in progress, per URL: publishes that race for it share it.
        self.connecting: dict[str, asyncio.Future[Any]] = {}
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="nats-publisher", daemon=True
        )
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def jetstream(self, url: str, timeout: float) -> Any:
        nc: Any = self.connections.get(url)
        if nc is None or nc.is_closed:
            pending = self.connecting.get(url)
            if pending is None:
                pending = self.connecting[url] = asyncio.ensure_future(self._connect(url, timeout))
                pending.add_done_callback(lambda _done: self.connecting.pop(url, None))
            # A caller that gives up does not cancel the connect others wait on.
            nc = await asyncio.shield(pending)
        return nc.jetstream()

    async def _connect(self, url: str, timeout: float) -> Any:
        # Once connected, nats-py reconnects by itself for as long as it
        # takes; its first connect would retry just as long, unseen, and
        # every publish retried meanwhile used to start one more. This one
        # is bounded, and closed if it did not finish.
        async def on_error(exc: Exception) -> None:
            # Each failed attempt; the delivery's own error says what failed.
            log.debug("nats forward to %s: %s", redact_url(url), exc)

        nc = nats.NATS()
        try:
            await asyncio.wait_for(
                nc.connect(
                    url,
                    name="webhook-receiver forwards",
                    error_cb=on_error,
                    connect_timeout=max(1, round(timeout)),
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=1,
                ),
                timeout,
            )
        except BaseException:
            try:
                await nc.close()
            except Exception:
                pass
            raise
        self.connections[url] = nc
        return nc

    async def close(self) -> None:
        for nc in self.connections.values():
            try:
                await nc.close()
            except Exception:
                pass


_nats_loop: _NatsLoop | None = None
_nats_lock = threading.Lock()


def _loop() -> _NatsLoop:
    global _nats_loop
    with _nats_lock:
        if _nats_loop is None:
            _nats_loop = _NatsLoop()
        return _nats_loop


@atexit.register
def _close_nats() -> None:
    if _nats_loop is not None:
        try:
            _nats_loop.run(_nats_loop.close(), timeout=2)
        except Exception:
            pass


def _publish_nats(forward: ForwardConfig, message: BrokerMessage) -> None:
    headers = {
        "Nats-Msg-Id": message.message_id,
        "Content-Type": message.content_type or "application/octet-stream",
        "X-Request-Id": message.correlation_id,
        **message.headers,
    }
    if message.event_type:
        headers["X-Webhook-Event-Type"] = message.event_type
    loop = _loop()

    async def go() -> Any:
        js = await loop.jetstream(forward.url, forward.timeout_seconds)
        return await js.publish(
            forward.subject or "", message.body, timeout=forward.timeout_seconds, headers=headers
        )

    try:
        # A PubAck, duplicate or not, means the stream holds the message.
        loop.run(go(), timeout=forward.timeout_seconds * 2)
    except nats.js.errors.NoStreamResponseError as exc:
        raise PublishError(f"no JetStream stream takes subject {forward.subject!r}") from exc
    except (nats.errors.Error, OSError, TimeoutError) as exc:
        raise PublishError(f"{type(exc).__name__} on {redact_url(forward.url)}: {exc}") from exc


# -- Kafka -----------------------------------------------------------------------


class _LibrdkafkaLog:
    """librdkafka's log lines, sent to logging at DEBUG.

    It logs each failed reconnect (tens a second while a SASL handshake
    fails); the delivery's own error, and the worker's line for the attempt,
    say what failed.
    """

    logger = logging.getLogger(__name__ + ".librdkafka")

    def log(self, _level: int, message: str, *args: Any) -> None:
        self.logger.debug(message, *args)


# Delivery errors no attempt gets past: the record is larger than the
# producer or the topic takes.
_TOO_LARGE = frozenset({confluent_kafka.KafkaError.MSG_SIZE_TOO_LARGE})


class _KafkaProducer:
    """One forward's idempotent producer, and the thread that serves its delivery reports."""

    def __init__(self, forward: ForwardConfig) -> None:
        self.forward = forward
        # The last error librdkafka reported outside a delivery (a broker
        # unreachable, a SASL handshake refused): said when a report is late.
        self.last_error: str | None = None
        self.producer = confluent_kafka.Producer(self._settings())
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, name=f"kafka-forward-{forward.name}", daemon=True
        )
        self._thread.start()

    def _settings(self) -> dict[str, Any]:
        forward = self.forward
        timeout_ms = max(1, round(forward.timeout_seconds * 1000))
        return {
            "bootstrap.servers": forward.bootstrap_servers,
            "client.id": f"webhook-receiver-forward-{forward.name}",
            "enable.idempotence": True,
            "acks": "all",
            # A report (delivered or failed) within the forward's timeout.
            "message.timeout.ms": timeout_ms,
            # Each delivery waits for its own report: nothing to wait for to batch.
            "linger.ms": 0,
            # A topic is made by its operator, with its partitions and
            # retention: a misspelt one is a failure, not a new topic. And
            # said to be missing within the timeout, not timed out.
            "allow.auto.create.topics": False,
            "topic.metadata.propagation.max.ms": max(1, timeout_ms // 2),
            # Back within a second of the broker's return, however long it was away.
            "reconnect.backoff.max.ms": 1000,
            "logger": _LibrdkafkaLog(),
            "error_cb": self._on_error,
            **dict(forward.client_settings),
        }

    def _on_error(self, error: confluent_kafka.KafkaError) -> None:
        self.last_error = error.str()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                self.producer.poll(0.2)
            except Exception:
                log.exception("kafka forward %s: serving delivery reports", self.forward.name)

    def close(self, timeout: float) -> None:
        """Wait up to ``timeout`` for what is in flight, fail the rest, and let the client go."""
        self._stop.set()
        self._thread.join()
        if self.producer.flush(timeout):
            # The deliveries still waiting get their failure now.
            self.producer.purge()
            self.producer.flush(0)


_kafka_producers: dict[ForwardConfig, _KafkaProducer] = {}
_kafka_lock = threading.Lock()


def _kafka_producer(forward: ForwardConfig) -> _KafkaProducer:
    """The forward's producer in this process, made at its first delivery."""
    with _kafka_lock:
        held = _kafka_producers.get(forward)
        if held is None:
            held = _kafka_producers[forward] = _KafkaProducer(forward)
        return held


def _replace_kafka_producer(held: _KafkaProducer) -> None:
    """Let a failed producer go: the forward's next delivery makes a fresh one."""
    with _kafka_lock:
        if _kafka_producers.get(held.forward) is held:
            del _kafka_producers[held.forward]
    # The other deliveries waiting on it fail now, and are retried.
    held.close(0)


@atexit.register
def close_kafka_producers(timeout: float = 5.0) -> None:
    """Close this process's Kafka producers (a worker exiting), waiting up to ``timeout`` each."""
    with _kafka_lock:
        held = list(_kafka_producers.values())
        _kafka_producers.clear()
    for producer in held:
        producer.close(timeout)


def _kafka_headers(message: BrokerMessage) -> list[tuple[str, str | bytes | None]]:
    headers = {
        "message-id": message.message_id,
        "content-type": message.content_type or "application/octet-stream",
        "X-Request-Id": message.correlation_id,
        **message.headers,
    }
    if message.event_type:
        headers["type"] = message.event_type
    return [(name, value.encode("utf-8")) for name, value in headers.items()]


def _kafka_key(forward: ForwardConfig, message: BrokerMessage) -> bytes | None:
    """The record's key: the event's dedup key (the end of its stable key) or its type."""
    if forward.key == "{event_type}":
        return message.event_type.encode("utf-8") if message.event_type else None
    # The message id is "<consumer>:<source>:<dedup key>", percent-encoded
    # whole (no ":" left) when it was not printable ASCII.
    stable = message.message_id
    if ":" not in stable:
        stable = unquote(stable)
    prefix = f"{forward.name}:{message.headers.get('X-Webhook-Source', '')}:"
    return stable.removeprefix(prefix).encode("utf-8")


def _kafka_error(exc: confluent_kafka.KafkaException) -> confluent_kafka.KafkaError:
    """The KafkaError a KafkaException carries (librdkafka's code and text)."""
    found = exc.args[0] if exc.args else None
    if isinstance(found, confluent_kafka.KafkaError):
        return found
    return confluent_kafka.KafkaError(confluent_kafka.KafkaError._FAIL, str(exc))


def _publish_kafka(forward: ForwardConfig, message: BrokerMessage) -> None:
    deadline = time.monotonic() + forward.timeout_seconds
    try:
        held = _kafka_producer(forward)
    except confluent_kafka.KafkaException as exc:
        # A setting librdkafka refuses (a CA file it cannot read, a mechanism it lacks).
        raise PublishError(f"kafka forward {forward.name}: {_kafka_error(exc).str()}") from exc
    reports: list[confluent_kafka.KafkaError | None] = []
    reported = threading.Event()

    def on_delivery(error: confluent_kafka.KafkaError | None, _record: Any) -> None:
        reports.append(error)
        reported.set()

    try:
        held.producer.produce(
            forward.topic or "",
            value=message.body,
            key=_kafka_key(forward, message),
            headers=_kafka_headers(message),
            on_delivery=on_delivery,
        )
    except confluent_kafka.KafkaException as exc:
        error = _kafka_error(exc)
        if error.code() in _TOO_LARGE:
            raise PublishRefused(
                f"the record ({len(message.body)} bytes of body) is larger than the "
                f"producer's message.max.bytes: {error.str()}"
            ) from exc
        _replace_kafka_producer(held)
        raise PublishError(f"topic {forward.topic!r}: {error.str()}") from exc
    except BufferError as exc:
        raise PublishError(f"the producer's queue is full: {exc}") from exc
    if not reported.wait(max(0.0, deadline - time.monotonic())):
        _replace_kafka_producer(held)
        detail = f" (last error: {held.last_error})" if held.last_error else ""
        raise PublishError(
            f"no delivery report from {forward.bootstrap_servers} within "
            f"{forward.timeout_seconds:g} s{detail}"
        )
    failed = reports[0]
    if failed is None:
        held.last_error = None  # the broker answers again: an old error explains nothing
        return
    if failed.code() in _TOO_LARGE:
        raise PublishRefused(f"topic {forward.topic!r} refused the record: {failed.str()}")
    _replace_kafka_producer(held)
    detail = ""
    if failed.code() == confluent_kafka.KafkaError._MSG_TIMED_OUT and held.last_error:
        detail = f" (last error: {held.last_error})"
    raise PublishError(f"topic {forward.topic!r} not written: {failed.str()}{detail}")
