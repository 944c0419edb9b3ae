"""The RabbitMQ consumer: pika's BlockingConnection, manual acks after the commit.

A batch is at most ``prefetch`` messages: what arrived by the time it is
full or a short wait has passed. The inbox stores it in one transaction,
in a second thread, while this one prepares the next batch and a third
arrives (``basic_qos`` allows three batches out unacknowledged); then a run
of messages to acknowledge is one ``basic_ack`` with ``multiple=True``, and
a message to dead-letter a
``basic_nack(requeue=False)`` (the queue's dead-letter exchange gets it,
unchanged). The database away: the batch is nacked with requeue and the
consumer backs off. The broker away: reconnect with backoff; what was not
acknowledged comes back and is recognised as duplicates.

No message stops the consumer: one whose properties pika cannot decode
(tables nested past Python's recursion limit, an unknown field type) is
handed over with no properties and dead-lettered by its delivery tag (see
:class:`_TolerantProperties`); names, ids and routing keys that are not
UTF-8 are dead-lettered, never decoded with replacement characters.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime
from decimal import Decimal
from typing import Any

import orjson
import pika
import pika.exceptions
import pika.spec
from flask import Flask

from ..config import AMQP_PROPERTIES, BrokerSourceConfig
from . import batch
from .identify import (
    MALFORMED,
    MAX_TABLE_DEPTH,
    BrokerMessage,
    Unidentified,
    binary_text,
    exact_text,
)
from .outage import SourceNotReady

log = logging.getLogger(__name__)

# How long a batch waits for more messages after its first one.
BATCH_WAIT_SECONDS = 0.05
# How long an idle consumer waits for a message before looking at the stop flag.
IDLE_WAIT_SECONDS = 0.25
_NOT_FOUND = 404
_CONNECTION_ERRORS = (pika.exceptions.AMQPError, OSError)
# A message as pika hands it over: its method frame, properties and body.
Raw = tuple[Any, Any, bytes]
# Stored with the event; the content type has its own column.
_STORED_PROPERTIES = AMQP_PROPERTIES - {"content_type"}


class _TolerantProperties(pika.spec.BasicProperties):
    """pika's message properties, decoded without failing the connection.

    pika decodes a message's content header inside its I/O loop: an error
    there (a RecursionError for tables nested a few hundred deep, an
    unknown field type) leaves the frame in its buffer, so every
    reconnection meets the same message again and the queue behind it is
    blocked for good. Decoded by this class, such a message arrives with
    no properties and the reason in ``undecodable``, and is dead-lettered
    by its delivery tag like any other message that cannot be stored.
    """

    undecodable: str | None = None

    def decode(self, encoded: bytes, offset: int = 0) -> _TolerantProperties:
        try:
            super().decode(encoded, offset)
        except Exception as exc:  # RecursionError included: the stack is unwound here
            self.__init__()  # type: ignore[misc]  # every property unset
            self.undecodable = f"pika could not decode its properties ({type(exc).__name__})"
        return self


# pika looks a content header's properties class up by its AMQP class id.
pika.spec.props[pika.spec.BasicProperties.INDEX] = _TolerantProperties


class RabbitConsumer(batch.Consumer):
    """Consume one RabbitMQ queue into the inbox until ``stop`` is set."""

    broker_errors = _CONNECTION_ERRORS

    def describe(self, exc: BaseException) -> str:
        return _describe(exc)

    def __init__(self, app: Flask, source: BrokerSourceConfig, stop: threading.Event) -> None:
        super().__init__(app, source, stop)
        self._cancelled = False

    def _connect(self) -> pika.BlockingConnection:
        params = pika.URLParameters(self.source.url)
        params.client_properties = {
            "connection_name": f"webhook-receiver consume {self.source.name} pid {os.getpid()}"
        }
        return pika.BlockingConnection(params)

    def session(self) -> None:
        connection = self._connect()
        try:
            channel = connection.channel()
            self._check_queue(channel)
            # Room for a batch being stored, one prepared and one arriving.
            channel.basic_qos(prefetch_count=min(3 * self.source.batch, 65535))
            pending: list[Raw] = []
            self._cancelled = False
            channel.add_on_cancel_callback(lambda _frame: self._on_cancel())
            channel.basic_consume(
                self.source.queue or "",
                lambda _ch, method, props, body: pending.append((method, props, body)),
                auto_ack=False,
            )
            log.info(
                "source %s: consuming queue %r on %s",
                self.source.name,
                self.source.queue,
                self.source.safe_url,
            )
            self.not_ready.recovered()
            self.broker.recovered()
            self._loop(connection, channel, pending)
            if self._cancelled:
                return  # the queue went away: the next session says so
            channel.close()
        finally:
            if connection.is_open:
                try:
                    connection.close()
                except _CONNECTION_ERRORS:
                    pass

    def _on_cancel(self) -> None:
        self._cancelled = True

    def _check_queue(self, channel: Any) -> None:
        try:
            channel.queue_declare(self.source.queue or "", passive=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code == _NOT_FOUND:
                raise SourceNotReady(
                    f"queue {self.source.queue!r} does not exist on {self.source.safe_url}; "
                    f"declare it (flask --app wsgi brokers declare {self.source.name})"
                ) from exc
            raise

    def _loop(self, connection: Any, channel: Any, pending: list[Raw]) -> None:
        # Three stages overlap: this thread receives a batch and prepares it
        # (identifies its messages) while a second thread stores the batch
        # before it; the QoS lets a third arrive meanwhile. Batches are
        # stored and settled one at a time, in order, on this thread, which
        # owns the channel: an ack with multiple=True never reaches a
        # message of a later batch.
        first_at: float | None = None
        inflight: tuple[list[Raw], Future[list[batch.Verdict]]] | None = None
        ready: tuple[list[Raw], batch.Prepared] | None = None
        with ThreadPoolExecutor(1, thread_name_prefix=f"store-{self.source.name}") as pool:
            while not self._cancelled:
                stopping = self.stop.is_set()
                if inflight is not None and inflight[1].done():
                    taken, future = inflight
                    inflight = None
                    behind = ready[0] if ready else []
                    if not self._settle(connection, channel, taken, future, behind, pending):
                        # Everything received was requeued, prepared or not.
                        ready, first_at = None, None
                        continue
                if stopping and inflight is None:
                    # SIGTERM: the batch stored is settled; what was only
                    # received or prepared goes back with the channel.
                    return
                if inflight is None and ready is not None and not stopping:
                    inflight = self._submit(connection, pool, ready)
                    ready = None
                    continue
                if pending and first_at is None:
                    first_at = time.monotonic()
                full = len(pending) >= self.source.batch
                waited = first_at is not None and time.monotonic() - first_at >= BATCH_WAIT_SECONDS
                if ready is None and pending and (full or waited) and not stopping:
                    taken = pending[: self.source.batch]
                    del pending[: self.source.batch]
                    first_at = time.monotonic() if pending else None
                    ready = (taken, self.prepare_batch(taken, _reader_of(self.source)))
                    continue
                # A stored batch wakes this wait (see _submit). With a batch
                # prepared, nothing more is taken until then: a timeout
                # counted from the arrivals would spin once it ran out.
                if first_at is None or ready is not None:
                    timeout = IDLE_WAIT_SECONDS
                else:
                    timeout = max(0.0, first_at + BATCH_WAIT_SECONDS - time.monotonic())
                connection.process_data_events(time_limit=timeout)

    def _submit(
        self, connection: Any, pool: ThreadPoolExecutor, ready: tuple[list[Raw], batch.Prepared]
    ) -> tuple[list[Raw], Future[list[batch.Verdict]]]:
        """Hand a prepared batch to the storing thread; its end wakes this thread's wait."""
        taken, prepared = ready
        started = threading.Event()
        future = pool.submit(self._store, prepared, started)
        future.add_done_callback(lambda _future: _wake(connection))
        # The storing thread goes first: its statement is on its way before
        # this thread holds the GIL for the next batch's Python (otherwise
        # the statement waits for the interpreter's switch interval, 5 ms).
        started.wait(BATCH_WAIT_SECONDS)
        return taken, future

    def _store(self, prepared: batch.Prepared, started: threading.Event) -> list[batch.Verdict]:
        started.set()
        return self.store_prepared(prepared)

    def _settle(
        self,
        connection: Any,
        channel: Any,
        taken: list[Raw],
        future: Future[list[batch.Verdict]],
        behind: list[Raw],
        pending: list[Raw],
    ) -> bool:
        """Settle a stored batch; False when the database was away (everything requeued)."""
        try:
            verdicts = future.result()
        except batch.DatabaseUnavailable as exc:
            # Nothing committed, so nothing is settled as done: the broker
            # gets back the batch and what arrived behind it, and the
            # consumer waits before taking more. What arrives during the
            # wait lands in the emptied ``pending``, to be stored after it.
            last = (pending or behind or taken)[-1][0].delivery_tag
            pending.clear()
            channel.basic_nack(delivery_tag=last, multiple=True, requeue=True)
            delay = self.database.failed(exc)
            deadline = time.monotonic() + delay
            while not self.stop.is_set() and time.monotonic() < deadline:
                connection.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
            return False
        self.database.recovered()
        run_end: int | None = None
        dead: list[batch.Verdict] = []
        try:
            for (method, _props, _body), verdict in zip(taken, verdicts, strict=True):
                tag = method.delivery_tag
                if verdict.action == batch.ACK:
                    run_end = tag
                    continue
                if run_end is not None:
                    channel.basic_ack(delivery_tag=run_end, multiple=True)
                    run_end = None
                channel.basic_nack(delivery_tag=tag, multiple=False, requeue=False)
                dead.append(verdict)
            if run_end is not None:
                channel.basic_ack(delivery_tag=run_end, multiple=True)
        finally:
            # Those nacked before a lost connection are dead-lettered all the same.
            self.dead_lettered(dead)
        self.settled += len(taken)
        return True


def _reader_of(source: BrokerSourceConfig) -> Any:
    """The function that turns one of ``source``'s raw messages into a BrokerMessage."""
    queue = source.queue

    def read(raw: Raw) -> BrokerMessage:
        method, props, body = raw
        if getattr(props, "undecodable", None):
            raise Unidentified(MALFORMED, props.undecodable)
        # pika's BasicProperties holds every property as an attribute, None when
        # unset; a short string that is not UTF-8 comes as bytes.
        properties = {
            name: value if type(value) is str or type(value) is bytes else str(value)
            for name, value in vars(props).items()
            if value is not None and name in _STORED_PROPERTIES
        }
        headers = (
            {exact_text(k, "a header name"): _header_value(v) for k, v in props.headers.items()}
            if props.headers
            else {}
        )
        content_type = props.content_type
        return BrokerMessage(
            body=body,
            content_type=None if content_type is None else exact_text(content_type, "content_type"),
            headers=headers,
            properties=properties,
            meta={
                "broker": "rabbitmq",
                "queue": queue,
                "exchange": exact_text(method.exchange, "the exchange"),
                "routing_key": exact_text(method.routing_key, "the routing key"),
            },
        )

    return read


def _header_value(value: Any) -> str | bytes:
    """An AMQP header's value as text; bytes where it is not UTF-8 (kept exactly)."""
    if type(value) is str:
        return value
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return value
    if isinstance(value, dict | list):
        # A nested table or array: its JSON text, keys sorted.
        return orjson.dumps(_plain(value, 1), option=orjson.OPT_SORT_KEYS).decode()
    return str(value)


def _plain(value: Any, depth: int) -> Any:
    """An AMQP table's value as JSON can hold it, exactly; Unidentified where it cannot."""
    if isinstance(value, dict | list):
        if depth > MAX_TABLE_DEPTH:
            raise Unidentified(MALFORMED, f"header tables nested deeper than {MAX_TABLE_DEPTH}")
        if isinstance(value, list):
            return [_plain(item, depth + 1) for item in value]
        return {
            exact_text(key, "a header table's key"): _plain(item, depth + 1)
            for key, item in value.items()
        }
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return binary_text(value)
    if isinstance(value, Decimal | datetime):
        return str(value)
    return value


def _wake(connection: Any) -> None:
    # From the storing thread: pika's one thread-safe call ends the
    # consuming thread's process_data_events at once.
    try:
        connection.add_callback_threadsafe(_nothing)
    except _CONNECTION_ERRORS:
        pass  # closed: the consuming thread finds out for itself


def _nothing() -> None:
    pass


def _describe(exc: BaseException) -> str:
    # pika's connection errors print nothing: their cause is in args, told by repr.
    text = str(exc) or ", ".join(map(repr, exc.args)) or "no detail"
    return f"{type(exc).__name__}: {text}"
