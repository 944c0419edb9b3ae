"""The schema: every table the receiver writes, in one place.

Timestamps are stored as naive UTC and handed back as aware UTC, so SQLite
and PostgreSQL compare them the same way. The unique constraints here are
what make the receiver idempotent: code inserts and handles the conflict.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Double,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Table,
    Text,
    TypeDecorator,
    UniqueConstraint,
    func,
    select,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, column_property, mapped_column

from .extensions import Base, db

if TYPE_CHECKING:
    # mypy cannot take a class attribute as a base class (python/mypy#8603);
    # db.Model is built on Base, so the checker sees Base, with the Table
    # that every model here has (each names its __tablename__).
    class Model(Base):
        __abstract__ = True
        __table__: ClassVar[Table]

else:
    Model = db.Model

# SQLite only auto-increments an INTEGER PRIMARY KEY.
BigId = BigInteger().with_variant(Integer(), "sqlite")
Json = JSON().with_variant(JSONB(), "postgresql")


def utcnow() -> datetime:
    """Return the current time as an aware UTC datetime."""
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """An aware UTC datetime stored as naive UTC on every database."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        return None if value is None else value.replace(tzinfo=UTC)


class EventDuplicate(Model):
    """One redelivery of an event with the same content: when it came."""

    __tablename__ = "event_duplicates"
    __table_args__ = (Index("ix_event_duplicates_received_at", "received_at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    event_id: Mapped[int] = mapped_column(ForeignKey("events.id", ondelete="CASCADE"), index=True)
    received_at: Mapped[datetime] = mapped_column(UTCDateTime)


class Event(Model):
    """One logical message, from a provider webhook or from the API."""

    __tablename__ = "events"
    __table_args__ = (
        UniqueConstraint("source", "dedup_key"),
        Index("ix_events_received_at_id", "received_at", "id"),
        Index("ix_events_source_received_at", "source", "received_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    source: Mapped[str] = mapped_column(String(200))
    dedup_key: Mapped[str] = mapped_column(String(512))
    event_type: Mapped[str | None] = mapped_column(String(255))
    fingerprint: Mapped[str] = mapped_column(String(64))
    content_type: Mapped[str | None] = mapped_column(String(255))
    body: Mapped[bytes] = mapped_column(LargeBinary)
    # A list of [name, value] pairs, secret-bearing values redacted.
    headers: Mapped[list[list[str]]] = mapped_column(Json)
    meta: Mapped[dict[str, Any]] = mapped_column(Json, default=dict)
    client: Mapped[str | None] = mapped_column(String(200))
    correlation_id: Mapped[str | None] = mapped_column(String(200))
    received_at: Mapped[datetime] = mapped_column(UTCDateTime)
    # Redeliveries are their event_duplicates rows; the count and the latest
    # are read from them. Kept on this row, each redelivery rewrote the
    # wide, five-index row: more database work than the rest of it.
    duplicate_count: Mapped[int] = column_property(
        select(func.count())
        .where(EventDuplicate.event_id == id)
        .correlate_except(EventDuplicate)
        .scalar_subquery()
    )
    last_duplicate_at: Mapped[datetime | None] = column_property(
        select(func.max(EventDuplicate.received_at))
        .where(EventDuplicate.event_id == id)
        .correlate_except(EventDuplicate)
        .scalar_subquery()
    )


class EventConflict(Model):
    """A delivery that reused an event's dedup key with different content, kept for review."""

    __tablename__ = "event_conflicts"
    __table_args__ = (
        UniqueConstraint("event_id", "fingerprint"),
        Index("ix_event_conflicts_received_at", "received_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    event_id: Mapped[int] = mapped_column(ForeignKey("events.id", ondelete="CASCADE"))
    source: Mapped[str] = mapped_column(String(200))
    dedup_key: Mapped[str] = mapped_column(String(512))
    fingerprint: Mapped[str] = mapped_column(String(64))
    content_type: Mapped[str | None] = mapped_column(String(255))
    body: Mapped[bytes] = mapped_column(LargeBinary)
    headers: Mapped[list[list[str]]] = mapped_column(Json)
    received_at: Mapped[datetime] = mapped_column(UTCDateTime)
    seen_count: Mapped[int] = mapped_column(Integer, default=1)
    last_seen_at: Mapped[datetime] = mapped_column(UTCDateTime)
    reviewed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    review_note: Mapped[str | None] = mapped_column(Text)


class Rejection(Model):
    """Deliveries refused before storage (bad signature, stale timestamp): counted, no body.

    One row per source, reason, address and minute (``received_at``, cut to
    the minute), with how many came: a flood of forgeries adds to a count.
    """

    __tablename__ = "rejections"
    __table_args__ = (
        Index("ix_rejections_received_at", "received_at"),
        UniqueConstraint("source", "reason", "remote_addr", "received_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    source: Mapped[str] = mapped_column(String(200))
    reason: Mapped[str] = mapped_column(String(50))
    detail: Mapped[str | None] = mapped_column(String(500))
    remote_addr: Mapped[str | None] = mapped_column(String(100))
    received_at: Mapped[datetime] = mapped_column(UTCDateTime)
    seen_count: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    last_seen_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class IdempotencyRecord(Model):
    """The claim and the saved response of one client's Idempotency-Key."""

    __tablename__ = "idempotency_records"
    __table_args__ = (
        UniqueConstraint("client", "key"),
        Index("ix_idempotency_records_expires_at", "expires_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    client: Mapped[str] = mapped_column(String(200))
    key: Mapped[str] = mapped_column(String(255))
    fingerprint: Mapped[str] = mapped_column(String(64))
    method: Mapped[str] = mapped_column(String(10))
    path: Mapped[str] = mapped_column(String(2000))
    state: Mapped[str] = mapped_column(String(20))
    # The holder's fencing token: only the request that holds it may complete.
    lease_token: Mapped[str | None] = mapped_column(String(64))
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    response_status: Mapped[int | None] = mapped_column(Integer)
    response_headers: Mapped[list[list[str]] | None] = mapped_column(Json)
    response_body: Mapped[bytes | None] = mapped_column(LargeBinary)


class Delivery(Model):
    """One consumer's processing of one event: the outbox row and its state machine."""

    __tablename__ = "deliveries"
    __table_args__ = (
        UniqueConstraint("event_id", "consumer"),
        Index("ix_deliveries_state_next_attempt_at", "state", "next_attempt_at"),
        # The admin overview counts deliveries done and dead per period.
        Index("ix_deliveries_state_completed_at", "state", "completed_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    event_id: Mapped[int] = mapped_column(ForeignKey("events.id", ondelete="CASCADE"))
    consumer: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(20))  # handler | forward
    state: Mapped[str] = mapped_column(String(20))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(UTCDateTime)
    lease_token: Mapped[str | None] = mapped_column(String(64))
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_error: Mapped[str | None] = mapped_column(Text)
    response_status: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # The replay that last put it back in the queue (a ``replays`` row; no
    # foreign key: replays are never deleted), and which replay's key it
    # sends: 0 the original, n the key with ``:replay-<n>`` appended.
    replay_id: Mapped[int | None] = mapped_column(BigInteger)
    key_replay: Mapped[int] = mapped_column(Integer, server_default="0")


class DeliveryAttempt(Model):
    """One attempt of a delivery: when it ran, how it went, what the consumer answered.

    Written by the worker in the transaction that records the attempt's
    outcome on the delivery; deleted with the delivery (so with its event).
    """

    __tablename__ = "delivery_attempts"
    __table_args__ = (Index("ix_delivery_attempts_delivery_id_id", "delivery_id", "id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    delivery_id: Mapped[int] = mapped_column(ForeignKey("deliveries.id", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime] = mapped_column(UTCDateTime)
    outcome: Mapped[str] = mapped_column(String(20))
    latency_ms: Mapped[float] = mapped_column(Float)
    status: Mapped[int | None] = mapped_column(Integer)
    confirmation: Mapped[str | None] = mapped_column(String(500))
    error: Mapped[str | None] = mapped_column(Text)
    response_body: Mapped[str | None] = mapped_column(Text)
    replay_id: Mapped[int | None] = mapped_column(BigInteger)
    worker: Mapped[str | None] = mapped_column(String(200))


class Replay(Model):
    """An operator's replay: who asked, when, for which deliveries, and how many went again."""

    __tablename__ = "replays"
    __table_args__ = (Index("ix_replays_created_at_id", "created_at", "id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    actor: Mapped[str] = mapped_column(String(200))
    via: Mapped[str] = mapped_column(String(20))  # admin | cli
    # The filter as given: event_id, consumer, source, type, state, since, until, limit.
    filters: Mapped[dict[str, Any]] = mapped_column(Json)
    new_key: Mapped[bool] = mapped_column(Boolean)
    # The count shown before the confirmation, and how many were put back since.
    matched: Mapped[int] = mapped_column(Integer)
    replayed: Mapped[int] = mapped_column(Integer, server_default="0")
    # Where it stops: the highest delivery id counted, and at most how many.
    up_to: Mapped[int | None] = mapped_column(BigInteger)
    max_count: Mapped[int | None] = mapped_column(Integer)
    # How far it got: the last delivery id done, and how many ids it walked.
    after_id: Mapped[int] = mapped_column(BigInteger, server_default="0")
    walked: Mapped[int] = mapped_column(Integer, server_default="0")
    # After each batch it waits this many times as long as the batch took.
    rest: Mapped[float] = mapped_column(Float, server_default="0")
    # The process running it holds it under a lease; an expired one is resumed.
    lease_token: Mapped[str | None] = mapped_column(String(64))
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class EntityVersion(Model):
    """The newest version applied per (source, entity), for ordered sources."""

    __tablename__ = "entity_versions"
    __table_args__ = (
        UniqueConstraint("source", "entity"),
        # Each event `flask purge` deletes sets its versions' event_id NULL:
        # found by this index, not by a scan of the table per event.
        Index("ix_entity_versions_event_id", "event_id"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    source: Mapped[str] = mapped_column(String(200))
    entity: Mapped[str] = mapped_column(String(512))
    version: Mapped[str] = mapped_column(String(100))
    event_id: Mapped[int | None] = mapped_column(ForeignKey("events.id", ondelete="SET NULL"))
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    # The forward delivery sending a version of this entity, if any: while it
    # is in flight (claimed, its lease running), no other is sent (see
    # outbox/ordering.take_entity). No foreign key: a delivery gone is one
    # no longer in flight.
    sending_delivery_id: Mapped[int | None] = mapped_column(BigInteger)


class BrokerPosition(Model):
    """Where a broker consumer reads next, per (source, topic, partition): not an event.

    Written in the transaction of the batch it follows (``inbox.receive_many``
    with ``positions``), so a consumer that seeks to it after a crash reads
    on from exactly what was stored. Overwritten, never only moved forward:
    a consumer may seek back on purpose. Not purged with the events, and
    kept when a source is removed from the configuration.
    """

    __tablename__ = "broker_positions"
    __table_args__ = (UniqueConstraint("source", "topic", "partition"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    source: Mapped[str] = mapped_column(String(200))
    topic: Mapped[str] = mapped_column(String(255))
    partition: Mapped[int] = mapped_column(Integer)
    next_offset: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)


class DeliveryTarget(Model):
    """A forward's target (its source and consumer): its circuit and its rate, for every worker.

    No row is a closed circuit that has not failed and has sent nothing
    under a rate limit. The circuit (``closed``, ``open``, ``half_open``)
    counts consecutive failures; ``retry_at`` ends an open circuit's
    cool-down; the probe of a half-open one is held by ``probe_token``
    until ``probe_expires_at``. ``next_send_at`` is the rate limit's
    theoretical arrival time (GCRA), in seconds since the epoch, so that
    one conditional UPDATE does its arithmetic on both databases.
    """

    __tablename__ = "delivery_targets"
    __table_args__ = (UniqueConstraint("source", "consumer"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    source: Mapped[str] = mapped_column(String(200))
    consumer: Mapped[str] = mapped_column(String(200))
    circuit: Mapped[str] = mapped_column(String(20))
    failures: Mapped[int] = mapped_column(Integer)
    opened_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    retry_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    probe_token: Mapped[str | None] = mapped_column(String(64))
    probe_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    next_send_at: Mapped[float | None] = mapped_column(Double)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)


class AdminSession(Model):
    """An open admin session, so that logging out ends it on the server, not only in the cookie."""

    __tablename__ = "admin_sessions"
    __table_args__ = (Index("ix_admin_sessions_expires_at", "expires_at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    # SHA-256 of the random id the cookie carries: a copy of the table opens nothing.
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)


class AdminLoginFailure(Model):
    """A failed admin login, kept briefly to throttle guessing across workers."""

    __tablename__ = "admin_login_failures"
    __table_args__ = (Index("ix_admin_login_failures_remote_addr_at", "remote_addr", "at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    remote_addr: Mapped[str] = mapped_column(String(100))
    at: Mapped[datetime] = mapped_column(UTCDateTime)
