"""Forwards to Kafka (``kafka://``): an idempotent producer, done on the delivery report.

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

import atexit
import logging
import threading
import time
from typing import Any

import confluent_kafka

from ...config import ForwardConfig
from ..stable_keys import dedup_key_of
from .base import BrokerMessage, PublishError, PublishRefused

log = logging.getLogger(__name__)

SCHEMES = frozenset({"kafka"})


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
def close_producers(timeout: float = 5.0) -> None:
    """Close this process's Kafka producers (a worker exiting), waiting up to ``timeout`` each."""
    with _kafka_lock:
        held = list(_kafka_producers.values())
        _kafka_producers.clear()
    for producer in held:
        producer.close(timeout)


def _kafka_headers(message: BrokerMessage) -> list[tuple[str, str | bytes | None]]:
    headers = message.headers_named("message-id", "content-type", "type")
    return [(name, value.encode("utf-8")) for name, value in headers.items()]


def _kafka_key(forward: ForwardConfig, message: BrokerMessage) -> bytes | None:
    """The record's key: the event's dedup key (the end of its stable key) or its type."""
    if forward.key == "{event_type}":
        return message.event_type.encode("utf-8") if message.event_type else None
    source = message.headers.get("X-Webhook-Source", "")
    return dedup_key_of(message.message_id, forward.name, source).encode("utf-8")


def _kafka_error(exc: confluent_kafka.KafkaException) -> confluent_kafka.KafkaError:
    """The KafkaError a KafkaException carries (librdkafka's code and text)."""
    found = exc.args[0] if exc.args else None
    if isinstance(found, confluent_kafka.KafkaError):
        return found
    return confluent_kafka.KafkaError(confluent_kafka.KafkaError._FAIL, str(exc))


def publish(forward: ForwardConfig, message: BrokerMessage) -> None:
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
