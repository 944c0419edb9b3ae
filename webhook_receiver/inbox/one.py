"""Storing one message, committed before ``receive`` returns: its paths per dialect."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from ..database import autocommit_connection, transaction, write_transaction, writer_turn
from ..database_driver import driver_cursor
from ..extensions import db
from ..models import Event, utcnow
from . import duplicates
from .logs import log_delivery, log_outcome
from .messages import Accepted, Conflict, Duplicate, Message, Outcome
from .rows import (
    EventUnderKey,
    current_routes,
    event_values,
    insert_event,
    keep_conflict,
    postgresql_receipt,
)
from .statements import Statements, for_engine

_events = Event.__table__


def receive(message: Message, *, fast: bool = True) -> Outcome:
    """Store one message, committed before this returns; say what became of it.

    ``fast=False`` takes the plain Core path instead of the dialect's fast
    path (the contract tests compare the two).
    """
    engine = db.engine
    statements = for_engine(engine)
    consumers = current_routes()(message.source, message.event_type, message.body)
    for _ in range(3):
        values = event_values(message, message.received_at or utcnow())
        if not fast:
            stored, event_id = _receive_core(engine, statements, values, consumers)
        elif statements.dialect_name == "postgresql":
            stored, event_id = _receive_postgresql(engine, statements, values, consumers)
        elif consumers:
            stored, event_id = _receive_sqlite_with_deliveries(
                engine, statements, values, consumers
            )
        else:
            stored, event_id = _receive_sqlite_alone(engine, statements, values)
        if event_id is not None:
            log_delivery("accepted", message, event_id)
            return Accepted(event_id)
        if stored is not None:
            outcome = _settle_existing(engine, statements, message, values, stored)
            if outcome is not None:
                return outcome
            # Its event was purged since the read: the key is free, store it.
        # A racing copy won the insert after this one's read: read what it stored.
    raise RuntimeError("receipt did not settle")  # pragma: no cover


# -- the paths of one message ------------------------------------------------
# Each returns (the event stored under the key, None) when the key is taken,
# (None, the new event's id) when this message was stored, and (None, None)
# when a racing copy won the insert after this one looked.


def _find_params(values: dict[str, Any]) -> dict[str, Any]:
    """The bind parameters of ``statements.find`` (and its fast twin): the message's key."""
    return {"b_source": values["source"], "b_key": values["dedup_key"]}


def _receive_core(
    engine: Engine,
    statements: Statements,
    values: dict[str, Any],
    consumers: list[tuple[str, str]],
) -> tuple[EventUnderKey | None, int | None]:
    """The plain Core path: insert, and read the key only when it was taken."""
    with transaction(engine) as conn:
        event_id = insert_event(conn, statements, values, consumers)
        if event_id is None:
            keys = _find_params(values)
            row = conn.execute(statements.find, keys).one_or_none()
            return (EventUnderKey(*row) if row else None), None
    return None, event_id


def _receive_sqlite_alone(
    engine: Engine, statements: Statements, values: dict[str, Any]
) -> tuple[EventUnderKey | None, int | None]:
    """SQLite, no deliveries: the read, then an autocommitted INSERT, both on the driver.

    Redeliveries are read-only: a read needs no turn at the write lock, so
    a storm of copies does not queue behind new events. The INSERT is then
    a transaction of its own, durable when it returns.
    """
    find, insert_ = statements.fast_find, statements.fast_insert
    with driver_cursor(engine) as cursor:
        keys = _find_params(values)
        row = cursor.execute(find.sql, find.params(keys)).fetchone()
        if row is not None:
            return EventUnderKey(*row), None
        params = insert_.params(values)
        with writer_turn(engine):
            # fetchall() runs the statement to its end, where SQLite commits
            # it: before the turn passes on, and before any answer.
            rows = cursor.execute(insert_.sql, params).fetchall()
    return None, rows[0][0] if rows else None


def _receive_sqlite_with_deliveries(
    engine: Engine,
    statements: Statements,
    values: dict[str, Any],
    consumers: list[tuple[str, str]],
) -> tuple[EventUnderKey | None, int | None]:
    """SQLite with deliveries: a lone read, then the event and its deliveries in one transaction."""
    with autocommit_connection() as conn:
        keys = _find_params(values)
        row = conn.execute(statements.find, keys).one_or_none()
        if row is not None:
            return EventUnderKey(*row), None
        with write_transaction(conn):
            event_id = insert_event(conn, statements, values, consumers)
    return None, event_id


def _receive_postgresql(
    engine: Engine,
    statements: Statements,
    values: dict[str, Any],
    consumers: list[tuple[str, str]],
) -> tuple[EventUnderKey | None, int | None]:
    """PostgreSQL: read, insert and deliveries in one statement, its own transaction.

    A taken key writes nothing, so its commit is free; a new event commits
    durably, deliveries included, before the statement returns.
    """
    with driver_cursor(engine) as cursor:
        return postgresql_receipt(cursor, statements, values, consumers)


def _settle_existing(
    engine: Engine,
    statements: Statements,
    message: Message,
    values: dict[str, Any],
    stored: EventUnderKey,
) -> Outcome | None:
    """A message whose key is taken: a duplicate, or a conflict kept for review.

    None when the event was purged since it was read (``flask purge``): its
    conflict would refer to no event.
    """
    if stored.fingerprint == message.fingerprint:
        # The answer needs nothing more than the stored event; the count is
        # bookkeeping, written in a batch (see duplicates.py).
        duplicates.record(stored.id, values["received_at"])
        log_delivery("duplicate", message, stored.id)
        return Duplicate(stored.id)
    try:
        with transaction(engine) as conn:
            keep_conflict(conn, statements, stored.id, message, values["received_at"])
    except IntegrityError:
        with autocommit_connection() as conn:
            if conn.execute(select(_events.c.id).where(_events.c.id == stored.id)).first():
                raise
        return None
    outcome = Conflict(stored.id)
    log_outcome(message, outcome)
    return outcome
