"""A new event inside the caller's transaction (``add``), or held back for its own statement.

Inside ``holding()`` on PostgreSQL, ``add`` reserves the event's id (a
block of ids per engine and process) and holds the event for the caller.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from sqlalchemy import event as sa_event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from ..database_driver import driver_cursor, transaction_cursor
from ..extensions import db
from ..models import utcnow
from .messages import Message
from .rows import (
    current_routes,
    event_values,
    insert_deliveries,
    insert_event,
    postgresql_receipt,
    receipt_params,
)
from .statements import events as events_table
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
    consumers = current_routes()(message.source, message.event_type)
    held = _HELD.get()
    if held is not None and fast:
        values["id"] = _reserve_event_id(db.engine)
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


# -- events held back for the caller's own statement -----------------------------


@dataclass(frozen=True)
class HeldEvent:
    """A new event ``add`` held back: its row, with its reserved id, and its consumers."""

    values: dict[str, Any]
    consumers: list[tuple[str, str]]


_HELD: ContextVar[list[HeldEvent] | None] = ContextVar("inbox_held_events", default=None)


@contextmanager
def holding() -> Iterator[list[HeldEvent]]:
    """Hold back the events ``add`` writes in the block, for the caller to write them.

    On PostgreSQL a unit of work made of one new event and a record of the
    caller's own (the Idempotency-Key API's) is then one autocommitted
    statement, where BEGIN, two statements and COMMIT were four round
    trips: the caller writes the held event with ``statements.receive_if``
    and ``receipt_binds``, or, when its unit of work holds more, with
    ``write_held`` in its transaction. On SQLite ``add`` writes at once, in
    the writers' turn, and the list stays empty. A held event's key must
    be new (the API's are fresh uuids): a taken one fails its write.
    """
    held: list[HeldEvent] = []
    postgresql = db.engine.dialect.name == "postgresql"
    token = _HELD.set(held if postgresql else None)
    try:
        yield held
    finally:
        _HELD.reset(token)


def receipt_binds(event: HeldEvent) -> dict[str, Any]:
    """The parameters of a held event's write by ``statements.receive_if``."""
    return receipt_params(event.values, event.consumers, deliveries=bool(event.consumers))


def write_held(held: list[HeldEvent], conn: Connection | None = None) -> None:
    """Write held events and their deliveries in the session's transaction (or ``conn``'s).

    Raises ReservedIdTaken, nothing written, if their ids were handed out
    again (the sequence went back): the caller runs its unit of work anew.
    """
    if not held:
        return
    statements = for_engine(db.engine)
    if conn is None:
        conn = db.session.connection()  # its beginning writes them (_write_held_on_begin)
        if not held:
            return
    check_reserved_ids_current(conn.engine, held)
    try:
        for event in held:
            values = event.values
            if insert_event(conn, statements, values, event.consumers) is None:
                raise RuntimeError(f"a held event's key was taken: {values['dedup_key']!r}")
    except IntegrityError as exc:
        check_reserved_id(conn.engine, exc)
        raise
    held.clear()


def _write_held_on_begin(_session: Any, _transaction: Any, connection: Connection) -> None:
    """The session's transaction begins inside ``holding()``: write the held events into it.

    A view that goes on through the session may read its events or refer
    to them (a foreign key): they must be there. Later ``add`` calls of the
    block write at once, as outside it.
    """
    held = _HELD.get()
    if held is None:
        return
    write_held(held, connection)
    _HELD.set(None)


def init_held(session_class: Any) -> None:
    """Write held events into any session transaction that begins while they are held."""
    if not sa_event.contains(session_class, "after_begin", _write_held_on_begin):
        sa_event.listen(session_class, "after_begin", _write_held_on_begin)


# Ids taken from the events' sequence a block at a time, per engine and
# process (a forked worker must not hand out its parent's). Unused ones
# are gaps, as after any rolled-back insert; nothing relies on density.
_IDS_PER_BLOCK = 50
_RESERVED: weakref.WeakKeyDictionary[Engine, tuple[int, deque[int]]] = weakref.WeakKeyDictionary()
_RESERVING = threading.Lock()


class ReservedIdTaken(Exception):
    """A held event's reserved id was taken: the events sequence went back.

    A restore from a backup or a ``RESTART IDENTITY`` hands out again ids a
    process had reserved before. The reservations are dropped; the caller
    runs its unit of work again, with a fresh id.
    """


def check_reserved_id(engine: Engine, exc: IntegrityError) -> None:
    """Raise ReservedIdTaken if ``exc`` is a held event's id found taken; else return."""
    diag = getattr(exc.orig, "diag", None)
    if getattr(diag, "constraint_name", None) != events_table.primary_key.name:
        return
    forget_reserved_ids(engine)
    raise ReservedIdTaken() from exc


def check_reserved_ids_current(engine: Engine, held: list[HeldEvent]) -> None:
    """Raise ReservedIdTaken if the events sequence went back below a held event's id."""
    last_value = for_engine(engine).events_id_last_value
    with driver_cursor(engine) as cursor:
        (last,) = cursor.execute(last_value.sql, last_value.params({})).fetchone()
    if last is None or max(event.values["id"] for event in held) > last:
        forget_reserved_ids(engine)
        raise ReservedIdTaken()


def forget_reserved_ids(engine: Engine) -> None:
    """Drop this process's reserved ids of ``engine``: the next are taken afresh."""
    with _RESERVING:
        _RESERVED.pop(engine, None)


def _reserve_event_id(engine: Engine) -> int:
    """An events id no other writer will use (PostgreSQL)."""
    with _RESERVING:
        pid, ids = _RESERVED.get(engine, (0, deque()))
        if pid != os.getpid() or not ids:
            reserve = for_engine(engine).reserve_event_ids
            with driver_cursor(engine) as cursor:
                cursor.execute(reserve.sql, reserve.params({"b_count": _IDS_PER_BLOCK}))
                ids = deque(row[0] for row in cursor.fetchall())
            _RESERVED[engine] = (os.getpid(), ids)
        return ids.popleft()
