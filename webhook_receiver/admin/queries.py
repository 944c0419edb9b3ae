"""Data access for the admin's lists: events, dead deliveries, keys, refusals; requeueing.

Lists are paged by keyset (paging.py): no OFFSET, and no COUNT(*) over a
whole table. Writes start their transaction with the write (see
database.py), so SQLite never has to upgrade a read lock. The overview's
numbers are in counts.py, the conflicts' list and review in conflict_reviews.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    and_,
    exists,
    func,
    not_,
    or_,
    select,
)

from ..extensions import db
from ..models import (
    Delivery,
    Event,
    EventConflict,
    EventDuplicate,
    IdempotencyRecord,
    Rejection,
)
from ..outbox import deliveries as delivery_states
from .delivery_queries import with_events
from .paging import Cursor, Page, is_row_id, keyset_page

# -- events ------------------------------------------------------------------

# State filters of the event list: what an operator looks for.
EVENT_STATES = {
    "pending": "a delivery pending or in progress",
    "retrying": "a delivery failed and waiting to retry",
    "dead": "a dead delivery",
    "discarded": "a discarded delivery",
    "delivered": "every delivery done",
    "none": "no deliveries",
    "duplicated": "duplicate deliveries received",
    "conflicted": "a conflicting delivery received",
}


@dataclass(frozen=True)
class EventFilters:
    """The event list's filters; empty ones do not filter."""

    source: str = ""
    event_type: str = ""
    state: str = ""
    since: datetime | None = None
    until: datetime | None = None
    q: str = ""

    def active(self) -> bool:
        return any([self.source, self.event_type, self.state, self.since, self.until, self.q])


def _delivery_ids_where(*conditions: ColumnElement[bool]) -> Any:
    return select(Delivery.event_id).where(*conditions)


def _state_condition(state: str) -> ColumnElement[bool] | None:
    d = Delivery
    if state == "pending":
        return Event.id.in_(
            _delivery_ids_where(d.state.in_([delivery_states.PENDING, delivery_states.IN_PROGRESS]))
        )
    if state == "retrying":
        return Event.id.in_(_delivery_ids_where(d.state == delivery_states.PENDING, d.attempts > 0))
    if state == "dead":
        return Event.id.in_(_delivery_ids_where(d.state == delivery_states.DEAD))
    if state == "discarded":
        return Event.id.in_(_delivery_ids_where(d.state == delivery_states.DISCARDED))
    if state == "delivered":
        done = [delivery_states.DELIVERED, delivery_states.SKIPPED]
        return and_(
            exists().where(d.event_id == Event.id),
            not_(exists().where(d.event_id == Event.id, d.state.not_in(done))),
        )
    if state == "none":
        return not_(exists().where(d.event_id == Event.id))
    if state == "duplicated":
        return exists().where(EventDuplicate.event_id == Event.id)
    if state == "conflicted":
        return Event.id.in_(select(EventConflict.event_id))
    return None


def idempotency_key() -> Any:
    """The Idempotency-Key an API client sent with an event (NULL for webhook events).

    JSON_EXTRACT on SQLite, ``->>`` on PostgreSQL's JSONB.
    """
    return Event.meta["idempotency_key"].as_string()


def list_events(
    filters: EventFilters,
    *,
    limit: int,
    before: Cursor | None = None,
    after: Cursor | None = None,
) -> Page:
    """One page of events matching ``filters``, newest first."""
    stmt = select(
        Event.id,
        Event.received_at,
        Event.source,
        Event.event_type,
        Event.dedup_key,
        Event.duplicate_count,
        idempotency_key().label("idempotency_key"),
    )
    if filters.source:
        stmt = stmt.where(Event.source == filters.source)
    if filters.event_type:
        stmt = stmt.where(Event.event_type == filters.event_type)
    if filters.since is not None:
        stmt = stmt.where(Event.received_at >= filters.since)
    if filters.until is not None:
        stmt = stmt.where(Event.received_at < filters.until)
    if filters.q:
        # An API event is found by the Idempotency-Key its client sent (kept
        # in its meta), as a webhook event is by its dedup key.
        matches = [
            Event.dedup_key == filters.q,
            and_(Event.source.startswith("api:", autoescape=True), idempotency_key() == filters.q),
        ]
        if is_row_id(filters.q):
            matches.append(Event.id == int(filters.q))
        stmt = stmt.where(or_(*matches))
    condition = _state_condition(filters.state)
    if condition is not None:
        stmt = stmt.where(condition)
    return keyset_page(stmt, Event.received_at, Event.id, limit=limit, before=before, after=after)


def delivery_states_of(event_ids: Sequence[int]) -> dict[int, dict[str, int]]:
    """For each event, how many of its deliveries are in each state."""
    if not event_ids:
        return {}
    rows = db.session.execute(
        select(Delivery.event_id, Delivery.state, func.count())
        .where(Delivery.event_id.in_(list(event_ids)))
        .group_by(Delivery.event_id, Delivery.state)
    ).all()
    states: dict[int, dict[str, int]] = {}
    for event_id, state, n in rows:
        states.setdefault(event_id, {})[state] = int(n)
    return states


@dataclass
class EventDetail:
    """One event with what happened to it."""

    event: Event
    duplicates: list[Any] = field(default_factory=list)
    conflicts: list[Any] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)
    # All its conflicts, of which ``conflicts`` holds the newest CONFLICTS_SHOWN.
    conflict_count: int = 0


DUPLICATES_SHOWN = 200
# A sender that reuses one key for everything gives its event thousands of
# conflicts: the page lists the newest and counts the rest.
CONFLICTS_SHOWN = 200


def event_detail(event_id: int) -> EventDetail | None:
    """Load an event, its newest duplicates, its conflicts and its deliveries."""
    event = db.session.get(Event, event_id)
    if event is None:
        return None
    duplicates = db.session.execute(
        select(EventDuplicate.id, EventDuplicate.received_at)
        .where(EventDuplicate.event_id == event_id)
        .order_by(EventDuplicate.received_at.desc(), EventDuplicate.id.desc())
        .limit(DUPLICATES_SHOWN)
    ).all()
    conflicts = db.session.execute(
        select(
            EventConflict.id,
            EventConflict.received_at,
            EventConflict.last_seen_at,
            EventConflict.seen_count,
            EventConflict.reviewed_at,
        )
        .where(EventConflict.event_id == event_id)
        .order_by(EventConflict.received_at.desc(), EventConflict.id.desc())
        .limit(CONFLICTS_SHOWN)
    ).all()
    conflict_count = len(conflicts)
    if conflict_count == CONFLICTS_SHOWN:
        conflict_count = (
            db.session.scalar(select(func.count()).where(EventConflict.event_id == event_id)) or 0
        )
    deliveries = list(
        db.session.scalars(
            select(Delivery).where(Delivery.event_id == event_id).order_by(Delivery.consumer)
        )
    )
    return EventDetail(event, list(duplicates), list(conflicts), deliveries, conflict_count)


def stored_body(column: Any, row_id: int) -> bytes | None:
    """A stored body (``Event.body``, ``EventConflict.body``) as it was received, and end the read.

    None: no row of that id.
    """
    try:
        row = db.session.execute(select(column).where(column.class_.id == row_id)).first()
    finally:
        db.session.rollback()
    return None if row is None else bytes(row[0] or b"")


def event_body(event_id: int) -> bytes | None:
    """An event's body as it was received (None: no such event), and end the read."""
    return stored_body(Event.body, event_id)


def can_requeue(delivery: Any, now: datetime) -> bool:
    """Tell whether an operator may requeue this delivery: dead, failed, or stuck."""
    if delivery.state == delivery_states.DEAD:
        return True
    if delivery.state == delivery_states.PENDING:
        # Failed at least once and waiting out its backoff. A requeued one
        # starts again from zero attempts, so it is not offered twice.
        return delivery.attempts > 0
    if delivery.state == delivery_states.IN_PROGRESS:
        # A live lease belongs to a working worker; only an abandoned one is stuck.
        return delivery.lease_expires_at is None or delivery.lease_expires_at <= now
    return False


def requeueable(delivery_ids: Sequence[int], now: datetime) -> list[int]:
    """Those of ``delivery_ids`` an operator may requeue; ends the read transaction.

    The caller then requeues them in a transaction of its own, which on
    SQLite has to start with the write.
    """
    ids = [int(i) for i in delivery_ids]
    if not ids:
        return []
    try:
        rows = db.session.execute(
            select(Delivery.id, Delivery.state, Delivery.attempts, Delivery.lease_expires_at).where(
                Delivery.id.in_(ids)
            )
        ).all()
    finally:
        db.session.rollback()
    return [row.id for row in rows if can_requeue(row, now)]


# -- dead letters ------------------------------------------------------------


def list_dead(
    *,
    limit: int,
    consumer: str = "",
    before: Cursor | None = None,
    after: Cursor | None = None,
) -> Page:
    """One page of dead deliveries, most recently died first, with their events."""
    stmt = with_events(
        Delivery.id,
        Delivery.updated_at,
        Delivery.consumer,
        Delivery.kind,
        Delivery.attempts,
        Delivery.last_error,
        Delivery.response_status,
        Delivery.event_id,
    ).where(Delivery.state == delivery_states.DEAD)
    if consumer:
        stmt = stmt.where(Delivery.consumer == consumer)
    return keyset_page(
        stmt, Delivery.updated_at, Delivery.id, limit=limit, before=before, after=after
    )


# -- idempotency keys --------------------------------------------------------

KEY_STATES = ("in_progress", "completed", "expired")


def list_idempotency_records(
    *,
    limit: int,
    now: datetime,
    client: str = "",
    state: str = "",
    key: str = "",
    before: Cursor | None = None,
    after: Cursor | None = None,
) -> Page:
    """One page of Idempotency-Key records, latest expiry (so newest) first."""
    r = IdempotencyRecord
    stmt = select(
        r.id,
        r.client,
        r.key,
        r.state,
        r.method,
        r.path,
        r.created_at,
        r.expires_at,
        r.lease_expires_at,
        r.completed_at,
        r.response_status,
    )
    if client:
        stmt = stmt.where(r.client == client)
    if key:
        stmt = stmt.where(r.key == key)
    if state == "expired":
        stmt = stmt.where(r.expires_at <= now)
    elif state in ("in_progress", "completed"):
        stmt = stmt.where(r.state == state, r.expires_at > now)
    return keyset_page(stmt, r.expires_at, r.id, limit=limit, before=before, after=after)


# -- rejections --------------------------------------------------------------


def list_rejections(
    *,
    limit: int,
    source: str = "",
    before: Cursor | None = None,
    after: Cursor | None = None,
) -> Page:
    """One page of refused deliveries, newest first."""
    stmt = select(
        Rejection.id,
        Rejection.received_at,
        Rejection.source,
        Rejection.reason,
        Rejection.detail,
        Rejection.remote_addr,
        Rejection.seen_count,
        Rejection.last_seen_at,
    )
    if source:
        stmt = stmt.where(Rejection.source == source)
    return keyset_page(
        stmt, Rejection.received_at, Rejection.id, limit=limit, before=before, after=after
    )


# -- filter values -------------------------------------------------------------
# A filter naming a source, consumer or client that nothing has is a typo:
# answered 400, not an empty list the operator would believe. One that the
# configuration no longer names but stored rows still have (a source or
# consumer since removed) is found, by an indexed lookup but for consumers.


def source_is_stored(source: str, *, rejections: bool = False) -> bool:
    """Whether an event (or, with ``rejections``, a refusal) has this source."""
    table = Rejection if rejections else Event
    return _any(select(table.id).where(table.source == source))


def event_type_is_stored(event_type: str) -> bool:
    """Whether any event has this type (unindexed: a type no event has reads them all, as
    the list filtered by it does anyway)."""
    return _any(select(Event.id).where(Event.event_type == event_type))


def consumer_is_stored(consumer: str) -> bool:
    """Whether any delivery is to this consumer (a scan: asked only for an unconfigured name)."""
    return _any(select(Delivery.id).where(Delivery.consumer == consumer))


def client_is_stored(client: str) -> bool:
    """Whether any Idempotency-Key record is this client's."""
    r = IdempotencyRecord
    return _any(select(r.id).where(r.client == client))


def _any(stmt: Any) -> bool:
    return db.session.execute(stmt.limit(1)).first() is not None
