"""A new event inside the caller's transaction (``add``), or held back for its own statement.

Inside ``holding()`` on PostgreSQL, ``add`` reserves the event's id (a
block of ids per engine and process) and holds the event for the caller
(held.py).
"""

from __future__ import annotations

from ..database_driver import transaction_cursor
from ..extensions import db
from ..models import utcnow
from .held import HELD, HeldEvent, reserve_event_id
from .messages import Message
from .rows import (
    current_routes,
    event_values,
    insert_deliveries,
    postgresql_receipt,
)
from .statements import for_engine


def add(message: Message, *, fast: bool = True) -> int | None:
    """Write a new event and its deliveries in the session's transaction; None if the key is taken.

    For an intake whose unit of work holds more than the event (the
    Idempotency-Key API): the caller commits, or rolls back, everything.
    The event's INSERT runs on the driver in that transaction (on
    PostgreSQL, with deliveries, the one-statement receipt); ``fast=False``
    takes the plain Core statements instead.

    Inside ``holding()`` on PostgreSQL nothing is written yet: the event's
    id is reserved and returned, and the event is held for the caller.
    """
    statements = for_engine(db.engine)
    values = event_values(message, message.received_at or utcnow())
    consumers = current_routes()(message.source, message.event_type, message.body)
    held = HELD.get()
    if held is not None and fast:
        values["id"] = reserve_event_id(db.engine)
        held.append(HeldEvent(values, consumers))
        return int(values["id"])
    conn = db.session.connection()
    if fast and consumers and statements.dialect_name == "postgresql":
        with transaction_cursor(conn) as cursor:
            _stored, event_id = postgresql_receipt(cursor, statements, values, consumers)
        return event_id
    if fast:
        # The event's INSERT on the driver (on SQLite, inside the writers'
        # turn, where every microsecond keeps another writer waiting).
        insert_ = statements.fast_insert
        with transaction_cursor(conn) as cursor:
            row = cursor.execute(insert_.sql, insert_.params(values)).fetchone()
        event_id = None if row is None else row[0]
    else:
        event_id = conn.execute(statements.insert_event, values).scalar()
    if event_id is not None:
        insert_deliveries(conn, statements, event_id, consumers, values["received_at"])
    # Not logged here: the caller's unit of work may still roll back; it logs its outcome.
    return event_id
