"""What every entry point of the inbox writes: the event's row, its deliveries, a conflict.

The event row is the dedup marker: its unique (source, dedup key)
constraint decides between racing copies. A new event is written together
with its deliveries (the outbox); a redelivery with the same fingerprint
writes nothing in its request (its count is bookkeeping, written in a batch:
see duplicates.py); other content under the key is a conflict, kept for
review in ``event_conflicts``. The consumers of a new event come from the
routes the app factory hands to the inbox (``init_app``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from flask import current_app
from sqlalchemy.engine import Connection

from ..outbox.deliveries import new_delivery_columns
from .messages import Message
from .statements import Statements
from .tables import CONFLICT_COLUMNS

EXTENSION = "webhook_receiver.inbox"

# (source, event type, body) -> the (name, kind) of each consumer of a new
# event (a consumer's filter reads the body).
Routes = Callable[[str, str | None, bytes], list[tuple[str, str]]]


def current_routes() -> Routes:
    """The app's routes: the consumers of a new event, by its source, type and body."""
    routes: Routes = current_app.extensions[EXTENSION]
    return routes


class Position(NamedTuple):
    """Where a consumer of a partitioned log reads next: stored with the batch it follows.

    ``next_offset`` is the offset of the first record not yet stored (the
    last stored one's plus one), as Kafka commits it.
    """

    source: str
    topic: str
    partition: int
    next_offset: int


@dataclass(frozen=True)
class EventUnderKey:
    """The event already under a key."""

    id: int
    fingerprint: str


def event_values(message: Message, received_at: datetime) -> dict[str, Any]:
    """The events row of ``message``, column by column."""
    return {
        "source": message.source,
        "dedup_key": message.dedup_key,
        "event_type": message.event_type,
        "fingerprint": message.fingerprint,
        "content_type": message.content_type or None,
        "body": message.body,
        "headers": [list(pair) for pair in message.headers],
        "meta": dict(message.meta),
        "correlation_id": message.correlation_id,
        "client": message.client,
        "received_at": received_at,
    }


def receipt_params(
    values: dict[str, Any], consumers: list[tuple[str, str]], *, deliveries: bool = True
) -> dict[str, Any]:
    """The parameters of PostgreSQL's one-statement receipts (``v_`` event, ``d_`` deliveries)."""
    bind = {f"v_{name}": value for name, value in values.items()}
    if deliveries:
        bind["v_consumers"] = [name for name, _ in consumers]
        bind["v_kinds"] = [kind for _, kind in consumers]
        for name, value in new_delivery_columns(values["received_at"]).items():
            bind[f"d_{name}"] = value
    return bind


def postgresql_receipt(
    cursor: Any,
    statements: Statements,
    values: dict[str, Any],
    consumers: list[tuple[str, str]],
) -> tuple[EventUnderKey | None, int | None]:
    """Run PostgreSQL's one-statement receipt on ``cursor``, in whatever transaction it is."""
    statement = statements.fast_receive
    stored_id, stored_fingerprint, event_id, _enqueued = cursor.execute(
        statement.sql, statement.params(receipt_params(values, consumers))
    ).fetchone()
    if stored_id is not None:
        return EventUnderKey(stored_id, stored_fingerprint), None
    return None, event_id


def delivery_rows(
    event_id: int, consumers: list[tuple[str, str]], now: datetime
) -> list[dict[str, Any]]:
    """The deliveries (the outbox) of a new event, one row per consumer, due from ``now``."""
    columns = new_delivery_columns(now)
    return [
        {"event_id": event_id, "consumer": name, "kind": kind, **columns}
        for name, kind in consumers
    ]


def insert_deliveries(
    conn: Connection,
    statements: Statements,
    event_id: int,
    consumers: list[tuple[str, str]],
    now: datetime,
) -> None:
    """Insert a new event's deliveries, if it has consumers."""
    rows = delivery_rows(event_id, consumers, now)
    if rows:
        conn.execute(statements.insert_deliveries, rows)


def insert_event(
    conn: Connection,
    statements: Statements,
    values: dict[str, Any],
    consumers: list[tuple[str, str]],
) -> int | None:
    """The event's Core INSERT and, when it is new, its deliveries; None if the key is taken."""
    event_id: int | None = conn.execute(statements.insert_event, values).scalar()
    if event_id is not None:
        insert_deliveries(conn, statements, event_id, consumers, values["received_at"])
    return event_id


def keep_conflict(
    conn: Connection, statements: Statements, event_id: int, message: Message, now: datetime
) -> None:
    """Keep ``message`` for review: other content under ``event_id``'s key."""
    values = event_values(message, message.received_at or now)
    conn.execute(
        statements.keep_conflict,
        {
            "event_id": event_id,
            "seen_count": 1,
            "last_seen_at": now,
            **{name: values[name] for name in CONFLICT_COLUMNS},
        },
    )


def keep_conflicts(
    conn: Connection, statements: Statements, conflicts: list[tuple[Message, int]], now: datetime
) -> None:
    """Keep each of ``conflicts`` (a message, the event under its key) for review."""
    for message, event_id in conflicts:
        keep_conflict(conn, statements, event_id, message, now)
