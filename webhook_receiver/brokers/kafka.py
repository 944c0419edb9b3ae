"""The Kafka consumer: confluent-kafka's consumer group, offsets kept with the events.

A source's topics are consumed by one consumer of its group (``group_id``)
with the cooperative-sticky assignor. Each ``consume()`` of up to ``batch``
records is stored by the inbox in one transaction, in a second thread,
while this one takes the next batch; batches are settled one at a time, in
order, on this thread, which owns the consumer.

Offsets (``offsets``):

- ``"inbox"`` (the default): each partition's next offset is written in the
  batch's own transaction (``inbox.Position``). On every assignment (start,
  rebalance) the consumer seeks each partition to its stored offset
  (``inbox.stored_positions``), else the group's committed offset, else the
  earliest. After the commit the offsets are also committed to Kafka,
  asynchronously, for lag tools. Killed at any point, a consumer re-reads
  nothing that was stored.
- ``"kafka"``: committed to Kafka only, after the database commit; what
  follows the last Kafka commit comes back after a crash, and is counted
  as duplicates.

On revocation the batch in hand is finished (stored and its offsets
written) before the partitions are released; what the database could not
store of a revoked partition is dropped (its next owner reads it from the
stored offsets). A record that conflicts with a stored event (kept for review by
the inbox) or cannot be stored (no key, a key that is not UTF-8 text) is
copied to ``dead_letter_topic`` unchanged (key, value, headers), with
Kafka Connect's ``__connect.errors.*`` headers naming where it came from
and why; then its offset moves on. A poison record's copy is delivered
before its batch's transaction, so its offset is written only once it is
there; a conflict is known only from that transaction, so a consumer
killed between the commit and the copy's delivery report leaves the
conflict in the database for review but no copy on the topic.

The database away: nothing is stored or committed; the consumer pauses its
partitions, keeps the records it holds, backs off, and stores them again;
once they are stored it resumes, and librdkafka fetches on from the record
after the last one it handed over. Nothing is sought: the partitions stay
assigned, as librdkafka's pause and resume leave them.
The broker away: librdkafka reconnects by itself; the consumer says so once
per outage, and when it is back.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

from confluent_kafka import (
    OFFSET_INVALID,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from flask import Flask
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from .. import inbox
from ..config import BrokerSourceConfig
from ..database import is_unavailable
from . import batch
from .identify import MALFORMED, BrokerMessage, Unidentified, header
from .outage import Outage, SourceNotReady

log = logging.getLogger(__name__)

# How long one consume() waits for a batch to fill before taking what came.
BATCH_WAIT_SECONDS = 0.05
# How long an idle consume() waits, at most, before looking at the stop flag.
IDLE_WAIT_SECONDS = 0.25
# How long a metadata request (the topics' check, the broker's return) may take.
METADATA_SECONDS = 5.0
# How long a dead letter's delivery report is awaited before it is sent again.
DEAD_LETTER_WAIT_SECONDS = 10.0
# The group's session: a member killed outright gives its partitions back after this.
SESSION_TIMEOUT_MS = 10_000
# How often, while the broker is away, its return is looked for.
BROKER_PROBE_SECONDS = 1.0
# Kafka Connect's dead-letter headers (errors.deadletterqueue.context.headers.enable).
ERRORS_TOPIC = "__connect.errors.topic"
ERRORS_PARTITION = "__connect.errors.partition"
ERRORS_OFFSET = "__connect.errors.offset"
ERRORS_REASON = "__connect.errors.exception.class.name"
ERRORS_MESSAGE = "__connect.errors.exception.message"
ERRORS_CONSUMER = "__connect.errors.connector.name"
# Errors that mean the brokers cannot be reached (librdkafka reconnects by itself).
_BROKER_AWAY = frozenset(
    {
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError._RESOLVE,
        KafkaError._TIMED_OUT,
        KafkaError._AUTHENTICATION,
        KafkaError._SSL,
        KafkaError.NETWORK_EXCEPTION,
        KafkaError.SASL_AUTHENTICATION_FAILED,
    }
)

# What librdkafka refuses to produce whatever the broker's state: a
# dead-letter copy refused so is never sent.
_REFUSED = frozenset({KafkaError.MSG_SIZE_TOO_LARGE})

TopicKey = tuple[str, int]


class DeadLetterUndelivered(Exception):
    """A dead letter's copy was not delivered before the consumer stopped: its offset stays."""


class _Stored(NamedTuple):
    """A batch stored: its records, their verdicts, and the dead letters delivered."""

    records: list[Message]
    verdicts: list[batch.Verdict]
    # Per partition, the next offset the batch settled (its offsets moved on to).
    next_offsets: dict[TopicKey, int]


def client_settings(source: BrokerSourceConfig) -> dict[str, Any]:
    """librdkafka's settings both the consumer and the dead-letter producer share."""
    return {
        "bootstrap.servers": source.url.removeprefix("kafka://"),
        "client.id": f"webhook-receiver consume {source.name} pid {os.getpid()}",
        # librdkafka's own lines say each failed connection; the consumer says
        # an outage once (error_cb), and a fatal error through its exception.
        "log_level": 2,
        **dict(source.client_settings),
    }


class KafkaConsumer(batch.Consumer):
    """Consume one Kafka source's topics into the inbox until ``stop`` is set."""

    broker_errors = (KafkaException,)
    source_noun = "topic"
    logger = log
    settled_without_copy = "its offset moves on"

    def __init__(self, app: Flask, source: BrokerSourceConfig, stop: threading.Event) -> None:
        super().__init__(app, source, stop)
        self.not_ready = Outage(source.name, "topic")
        self._consumer: Any = None
        self._producer: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: tuple[list[Message], Future[_Stored]] | None = None
        # The partitions this consumer holds now.
        self._assigned: set[TopicKey] = set()
        # While the database is away: the records taken but not stored, in
        # the order they came, stored again once the back-off is over; and
        # whether the partitions are paused (until those records are stored).
        self._held: list[Message] = []
        self._paused = False
        self._paused_until: float | None = None
        self._broker_probe_at = 0.0
        # Per partition, the next offset of the batches settled so far.
        self._done: dict[TopicKey, int] = {}
        # The inbox's offsets of partitions just assigned, committed to Kafka
        # on the loop's next turn (see _on_assign).
        self._assigned_at: dict[TopicKey, int] = {}
        # Whether this session's consumer has joined its group (its first assignment).
        self._joined = False

    # -- the session --------------------------------------------------------------

    def describe(self, exc: BaseException) -> str:
        if isinstance(exc, KafkaException):
            return f"{self.source.safe_url}: {_describe(exc)}"
        return super().describe(exc)

    def session(self) -> None:
        self._assigned.clear()
        self._held.clear()
        self._done.clear()
        self._assigned_at.clear()
        self._paused = False
        self._paused_until = None
        consumer = Consumer(
            {
                **client_settings(self.source),
                "group.id": self.source.group_id,
                # Offsets move only when a batch is settled: stored, or committed here.
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "auto.offset.reset": "earliest",
                "partition.assignment.strategy": "cooperative-sticky",
                "session.timeout.ms": SESSION_TIMEOUT_MS,
                "enable.partition.eof": False,
                # A missing topic is this consumer's to say (SourceNotReady).
                "allow.auto.create.topics": False,
                "error_cb": self._on_error,
            }
        )
        self._consumer = consumer
        try:
            self._check_topics(consumer)
            consumer.subscribe(
                list(self.source.topics),
                on_assign=self._on_assign,
                on_revoke=self._on_revoke,
                on_lost=self._on_lost,
            )
            self._joined = False
            self.not_ready.recovered()
            self.broker.recovered()
            with ThreadPoolExecutor(1, thread_name_prefix=f"store-{self.source.name}") as pool:
                self._pool = pool
                try:
                    self._loop(consumer)
                finally:
                    # Stopping or not, the batch in hand is committed and settled first.
                    self._finish_inflight()
        finally:
            self._pool = None
            # On every way out (a stop, a missing topic, an error): leaves the
            # group, so its partitions go to the others now, and frees its threads.
            self._close(consumer)
            self._consumer = None
            if self._producer is not None:
                self._producer.flush(5)
                self._producer = None

    def _close(self, consumer: Any) -> None:
        try:
            consumer.close()
        except Exception:
            # Not raised over the error that ended the session, if any.
            log.exception(
                "source %s: the consumer could not be closed", self.source.name, extra=self._extra()
            )

    def _check_topics(self, consumer: Any) -> None:
        metadata = consumer.list_topics(timeout=METADATA_SECONDS)
        missing = [
            topic
            for topic in self.source.topics
            if topic not in metadata.topics or metadata.topics[topic].error is not None
        ]
        if missing:
            raise SourceNotReady(
                f"topic {', '.join(map(repr, missing))} does not exist on "
                f"{self.source.safe_url}; create it (kafka-topics.sh --create --topic ...)"
            )

    def _on_error(self, error: KafkaError) -> None:
        if error.fatal():
            raise KafkaException(error)
        if error.code() in _BROKER_AWAY and self.broker.since is None:
            # Said once: librdkafka reconnects by itself; its return is looked for.
            self.broker.failed(f"{self.source.safe_url}: {error.str()}")
        else:
            log.debug("source %s: kafka: %s", self.source.name, error.str())

    def _loop(self, consumer: Any) -> None:
        while not self.stop.is_set():
            if self._assigned_at:
                self._commit(self._assigned_at)
                self._assigned_at = {}
            if self._paused_until is not None:
                self._retry_when_due(consumer)
                continue
            wait = BATCH_WAIT_SECONDS if self._inflight is not None else IDLE_WAIT_SECONDS
            records = self._usable(self._take(consumer, wait))
            if self.broker.since is not None:
                self._probe_broker(consumer, bool(records))
            # Identified here while the batch before is stored (CPU beside I/O).
            prepared = self.prepare_batch(records, self._broker_message) if records else None
            if self._inflight is not None and not self._settle_inflight(records):
                continue  # the database was away: those records were dropped too
            if prepared is not None:
                self._submit(records, prepared)

    def _take(self, consumer: Any, wait: float) -> list[Message]:
        """Up to a batch of records: what came within ``wait``, then more for BATCH_WAIT_SECONDS.

        One consume() hands over what one fetch brought (a few record
        batches, as the producers wrote them); a batch of the source's size
        is gathered over several, so that one transaction stores it.
        """
        records: list[Message] = consumer.consume(self.source.batch, wait)
        if not records:
            return records
        deadline = time.monotonic() + BATCH_WAIT_SECONDS
        while len(records) < self.source.batch:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            more = consumer.consume(self.source.batch - len(records), left)
            if not more:
                break
            records += more
        return records

    def _usable(self, records: list[Message]) -> list[Message]:
        """The records to store: none of a partition released during the consume()."""
        usable = []
        for record in records:
            error = record.error()
            if error is not None:
                log.warning(
                    "source %s: kafka: %s", self.source.name, error.str(), extra=self._extra()
                )
            elif _where(record) in self._assigned:
                usable.append(record)
        return usable

    def _probe_broker(self, consumer: Any, got_records: bool) -> None:
        now = time.monotonic()
        if got_records:
            self.broker.recovered()
        elif now >= self._broker_probe_at:
            self._broker_probe_at = now + BROKER_PROBE_SECONDS
            try:
                consumer.list_topics(self.source.topics[0], timeout=BROKER_PROBE_SECONDS)
            except KafkaException:
                return
            self.broker.recovered()

    # -- storing and settling -------------------------------------------------------

    def _submit(self, records: list[Message], prepared: batch.Prepared) -> None:
        assert self._pool is not None
        self._inflight = (records, self._pool.submit(self._store, records, prepared))

    def _store(self, records: list[Message], prepared: batch.Prepared) -> _Stored:
        """The storing thread: copy poison records out, store the batch with its offsets."""
        next_offsets = _next_offsets(records)
        poison = [
            (record, verdict)
            for record, verdict in zip(records, prepared.verdicts, strict=True)
            if verdict is not None
        ]
        if poison:
            undelivered = self._dead_letter(poison)
            if undelivered:
                # Not past a record whose copy is not out: it is read again.
                _hold_back(next_offsets, undelivered)
        positions = self._positions(next_offsets)
        with self.app.app_context():
            verdicts = self._store_prepared(prepared, positions)
        return _Stored(records, verdicts, next_offsets)

    def _store_prepared(
        self, prepared: batch.Prepared, positions: Sequence[inbox.Position]
    ) -> list[batch.Verdict]:
        if positions:
            return self.store(self.source, prepared, positions=positions)  # type: ignore[call-arg]
        return self.store(self.source, prepared)

    def _positions(self, next_offsets: dict[TopicKey, int]) -> list[inbox.Position]:
        if self.source.offsets != "inbox":
            return []
        return [
            inbox.Position(self.source.name, topic, partition, offset)
            for (topic, partition), offset in next_offsets.items()
        ]

    def _settle_inflight(self, arrived: list[Message]) -> bool:
        """Settle the stored batch; False when the database was away: it and ``arrived`` dropped."""
        assert self._inflight is not None
        records, future = self._inflight
        self._inflight = None
        try:
            stored = future.result()
        except batch.DatabaseUnavailable as exc:
            self._hold([*records, *arrived], self.database.failed(exc))
            return False
        self.database.recovered()
        self._settle(stored)
        if self._paused and not self._held:
            self._paused = False
            self._consumer.resume(self._topic_partitions(self._assigned))
        return True

    def _finish_inflight(self) -> None:
        """Store and settle the batch in hand, if any (a revocation, the stop)."""
        if self._inflight is not None:
            self._settle_inflight([])

    def _settle(self, stored: _Stored) -> None:
        records, verdicts, next_offsets = stored
        dead: list[batch.Verdict] = []
        conflicts = []
        for record, verdict in zip(records, verdicts, strict=True):
            if verdict.action == batch.ACK:
                continue
            dead.append(verdict)
            if verdict.reason == batch.CONFLICT:
                conflicts.append((record, verdict))
        if conflicts:
            undelivered = self._dead_letter(conflicts)
            if undelivered:
                if self.source.offsets == "kafka":
                    _hold_back(next_offsets, undelivered)
                else:
                    log.error(
                        "source %s: %d conflict(s) stored for review, but their copies could "
                        "not be delivered to %r before the consumer stopped",
                        self.source.name,
                        len(undelivered),
                        self.source.dead_letter_topic,
                        extra=self._extra(),
                    )
        self._done.update(next_offsets)
        self._commit(next_offsets)
        self.dead_lettered(dead)
        self.settled += len(records)

    def _commit(self, next_offsets: dict[TopicKey, int], *, wait: bool = False) -> None:
        """Commit offsets to Kafka: the truth with offsets = "kafka", for lag tools with "inbox"."""
        offsets = [
            TopicPartition(topic, partition, offset)
            for (topic, partition), offset in next_offsets.items()
            if (topic, partition) in self._assigned
        ]
        if not offsets:
            return
        try:
            self._consumer.commit(offsets=offsets, asynchronous=not wait)
        except KafkaException as exc:
            # Kafka mode: not committed, the records come back and are counted
            # as duplicates. Inbox mode: the stored offsets are the truth.
            log.warning(
                "source %s: offsets not committed to Kafka: %s",
                self.source.name,
                _describe(exc),
                extra=self._extra(),
            )

    def _hold(self, records: Iterable[Message], delay: float) -> None:
        """Keep records the database could not store; pause the partitions for ``delay``.

        Paused, a partition stays assigned and librdkafka hands over nothing
        more of it; resumed, it fetches on from the record after the last
        one handed over, so the held records and what follows them come in
        order, none twice, with no seek.
        """
        self._held += [record for record in records if _where(record) in self._assigned]
        if not self._paused:
            self._paused = True
            self._consumer.pause(self._topic_partitions(self._assigned))
        self._paused_until = time.monotonic() + delay

    def _retry_when_due(self, consumer: Any) -> None:
        """While backing off, serve the group's callbacks; then store the held records again."""
        assert self._paused_until is not None
        left = self._paused_until - time.monotonic()
        if left > 0:
            # Paused, the partitions give nothing; a record queued before the
            # pause may still come, and is held after those before it.
            came = self._usable(consumer.consume(self.source.batch, min(0.1, left)))
            self._held += came
            return
        self._paused_until = None
        records, self._held = self._held, []
        if records:
            # Settled by the loop's next turn: stored, the partitions resume;
            # the database still away, held again for a longer back-off.
            self._submit(records, self.prepare_batch(records, self._broker_message))
        else:
            self._paused = False  # their partitions were all revoked meanwhile
            consumer.resume(self._topic_partitions(self._assigned))

    @staticmethod
    def _topic_partitions(keys: Iterable[TopicKey]) -> list[TopicPartition]:
        return [TopicPartition(topic, partition) for topic, partition in keys]

    # -- rebalances -----------------------------------------------------------------

    def _on_assign(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        if self.source.offsets == "inbox":
            stored = self._stored_positions()
            for tp in partitions:
                offset = stored.get((tp.topic, tp.partition))
                # Else the group's committed offset, else auto.offset.reset.
                tp.offset = OFFSET_INVALID if offset is None else offset
                if offset is not None:
                    # Kafka's own offset may lag the inbox's (a consumer killed
                    # before its asynchronous commit): brought level for lag
                    # tools, even when nothing is left to read.
                    self._assigned_at[_key(tp)] = offset
        self._assigned.update(_key(tp) for tp in partitions)
        consumer.incremental_assign(partitions)
        if self._paused:
            # The database is away: read with the others once the held records are stored.
            consumer.pause(partitions)
        if not self._joined:
            # In the group now (with partitions or none, as it has more members than those).
            self._joined = True
            log.info(
                "source %s: consuming topics %s as group %r on %s (offsets in %s)",
                self.source.name,
                ", ".join(self.source.topics),
                self.source.group_id,
                self.source.safe_url,
                self.source.offsets,
                extra=self._extra(),
            )
        log.info(
            "source %s: assigned %s", self.source.name, _shown(partitions), extra=self._extra()
        )

    def _stored_positions(self) -> dict[TopicKey, int]:
        """The inbox's positions for this source; waits (backing off) while the database is away."""
        while True:
            try:
                with self.app.app_context():
                    positions = inbox.stored_positions(self.source.name)
            except (DBAPIError, PoolTimeoutError) as exc:
                if not is_unavailable(exc):
                    raise
                if self.stop.is_set():
                    return {}  # leaving: it reads nothing from them
                self.stop.wait(self.database.failed(str(getattr(exc, "orig", None) or exc)))
                continue
            self.database.recovered()
            return positions

    def _on_revoke(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        # The batch in hand is finished before the partitions go: its events
        # and offsets committed, or dropped whole (the database away).
        self._finish_inflight()
        revoked = {_key(tp) for tp in partitions}
        if self.source.offsets == "kafka":
            # The next owner reads on from here: committed before it starts.
            self._commit({key: self._done[key] for key in revoked if key in self._done}, wait=True)
        self._release(consumer, partitions)
        log.info("source %s: revoked %s", self.source.name, _shown(partitions), extra=self._extra())

    def _on_lost(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        # Another member may own them already: nothing is committed for them.
        self._assigned -= {_key(tp) for tp in partitions}
        self._finish_inflight()
        self._release(consumer, partitions)
        log.warning(
            "source %s: lost %s (the group's session expired)",
            self.source.name,
            _shown(partitions),
            extra=self._extra(),
        )

    def _release(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        """Unassign what the group takes back; its held records are its next owner's to read."""
        consumer.incremental_unassign(partitions)
        released = {_key(tp) for tp in partitions}
        self._assigned -= released
        self._held = [record for record in self._held if _where(record) not in released]
        for key in released:
            self._done.pop(key, None)
            self._assigned_at.pop(key, None)

    # -- dead letters -----------------------------------------------------------------

    def _dead_letter(self, dead: list[tuple[Message, batch.Verdict]]) -> list[Message]:
        """Copy each record to dead_letter_topic (if set); the records whose copy is not out."""
        topic = self.source.dead_letter_topic
        if topic is None:
            return []
        if self._producer is None:
            self._producer = Producer(
                {
                    **client_settings(self.source),
                    "enable.idempotence": True,
                    "acks": "all",
                    "error_cb": self._on_error,
                }
            )
        waiting = list(dead)
        while waiting:
            failed: list[tuple[Message, batch.Verdict]] = []
            reported: list[tuple[Message, batch.Verdict]] = []
            sent: list[tuple[Message, batch.Verdict]] = []
            for record, verdict in waiting:
                try:
                    self._producer.produce(
                        topic,
                        value=record.value(),
                        key=record.key(),
                        headers=[*_headers_of(record), *self._error_headers(record, verdict)],
                        on_delivery=_on_delivery(failed, reported, (record, verdict)),
                    )
                    sent.append((record, verdict))
                except KafkaException as exc:
                    if _error_code(exc) in _REFUSED:
                        # No copy can ever be sent (larger than the producer's
                        # message.max.bytes): passed without one, said loudly,
                        # rather than stopping the consumer on it for good.
                        self.copy_refused(
                            verdict,
                            _describe(exc),
                            f" of {record.topic()}[{record.partition()}]@{record.offset()}",
                        )
                    else:
                        log.warning("dead letter not sent: %s", _describe(exc))
                        failed.append((record, verdict))
                except BufferError as exc:
                    # The producer's queue is full: sent again after the flush.
                    log.warning("dead letter not sent: %s", exc)
                    failed.append((record, verdict))
            # A copy is out only on its delivery report: one not yet in is
            # waited for (librdkafka retries it), never taken as delivered,
            # nor sent again while it may still arrive.
            while self._producer.flush(DEAD_LETTER_WAIT_SECONDS) and not self.stop.is_set():
                self.broker.failed(f"dead letters to {topic!r} not reported delivered")
            done = {id(item) for item in reported}
            unreported = [item for item in sent if id(item) not in done]
            if not failed and not unreported:
                return []
            if self.stop.is_set():
                return [record for record, _ in failed + unreported]
            waiting = failed
            self.stop.wait(self.broker.failed(f"dead letters to {topic!r} not delivered"))
        return []

    def _error_headers(self, record: Message, verdict: batch.Verdict) -> list[tuple[str, bytes]]:
        reason = verdict.reason or "unknown"
        return [
            (ERRORS_TOPIC, (record.topic() or "").encode()),
            (ERRORS_PARTITION, str(record.partition()).encode()),
            (ERRORS_OFFSET, str(record.offset()).encode()),
            (ERRORS_REASON, reason.encode()),
            (ERRORS_MESSAGE, f"{reason}: {verdict.detail or reason}".encode()),
            (ERRORS_CONSUMER, f"webhook-receiver:{self.source.name}".encode()),
        ]

    # -- a record as the inbox sees it -------------------------------------------------

    def _broker_message(self, record: Message) -> BrokerMessage:
        try:
            pairs = _header_pairs(record)
        except UnicodeDecodeError as exc:
            raise Unidentified(MALFORMED, "a header name is not UTF-8 text") from exc
        # A repeated header: its last value, as Kafka's Headers.lastHeader reads it.
        headers: dict[str, str | bytes] = {}
        for name, value in pairs:
            headers[name] = _text_or_bytes(value or b"")
        properties: dict[str, str | bytes] = {}
        key = record.key()
        if key is not None:
            properties["key"] = _text_or_bytes(key)
        (topic, partition), offset = _where(record), _offset(record)
        if self.source.dedup_key == "offset":
            properties["offset"] = f"{topic}/{partition}/{offset}"
        content_type = header(headers, "content-type")
        timestamp_type, timestamp = record.timestamp()
        return BrokerMessage(
            body=record.value() or b"",
            content_type=content_type if isinstance(content_type, str) else None,
            headers=headers,
            properties=properties,
            subject=topic,
            meta={
                "broker": "kafka",
                "topic": topic,
                "partition": partition,
                "offset": offset,
                "timestamp": timestamp if timestamp_type else None,
            },
        )

    def _extra(self) -> dict[str, Any]:
        return {"source": self.source.name}


def _next_offsets(records: Sequence[Message]) -> dict[TopicKey, int]:
    """Per partition, the offset after the last of ``records`` (Kafka's committed offset)."""
    next_offsets: dict[TopicKey, int] = {}
    for record in records:
        key = _where(record)
        next_offsets[key] = max(next_offsets.get(key, 0), _offset(record) + 1)
    return next_offsets


def _hold_back(next_offsets: dict[TopicKey, int], undelivered: Sequence[Message]) -> None:
    """Keep each partition's offset before its first record whose copy is not delivered."""
    for record in undelivered:
        key, offset = _where(record), _offset(record)
        next_offsets[key] = min(next_offsets.get(key, offset), offset)


def _on_delivery(
    failed: list[tuple[Message, batch.Verdict]],
    reported: list[tuple[Message, batch.Verdict]],
    item: tuple[Message, batch.Verdict],
) -> Callable[[KafkaError | None, Any], None]:
    def report(error: KafkaError | None, _message: Any) -> None:
        reported.append(item)
        if error is not None:
            log.warning("dead letter not delivered: %s", error.str())
            failed.append(item)

    return report


def _where(record: Message) -> TopicKey:
    return record.topic() or "", record.partition() or 0


def _key(tp: TopicPartition) -> TopicKey:
    return tp.topic, tp.partition


def _offset(record: Message) -> int:
    offset = record.offset()
    assert offset is not None  # a consumed record has one
    return offset


def _header_pairs(record: Message) -> list[tuple[str, Any]]:
    """A record's headers in order (a name may repeat); UnicodeDecodeError for a name not UTF-8."""
    headers: Any = record.headers()
    return list(headers or [])


def _headers_of(record: Message) -> list[tuple[str, Any]]:
    try:
        return _header_pairs(record)
    except UnicodeDecodeError:
        return []  # a name that is not UTF-8: the copy goes without its headers


def _text_or_bytes(value: bytes) -> str | bytes:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value  # kept exactly; never read as a key or type


def _shown(partitions: Sequence[TopicPartition]) -> str:
    return ", ".join(f"{tp.topic}[{tp.partition}]" for tp in partitions) or "nothing"


def _error_code(exc: KafkaException) -> int | None:
    error = exc.args[0] if exc.args else None
    return error.code() if isinstance(error, KafkaError) else None


def _describe(exc: KafkaException) -> str:
    error = exc.args[0] if exc.args else None
    return error.str() if isinstance(error, KafkaError) else str(exc)
