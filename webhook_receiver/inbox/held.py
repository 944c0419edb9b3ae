"""Events held back for the caller's own statement (``holding``), and the ids reserved for them.

On PostgreSQL an intake whose unit of work is one new event and one row of
its own (the Idempotency-Key API: the event and the key's record) writes
both in one autocommitted statement, where BEGIN, two statements and
COMMIT were four round trips: ``add`` inside ``holding()`` reserves the
event's id and holds the event; the caller writes it with its own row
through a ``GuardedReceipt``, or with ``write_held`` in its transaction.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from sqlalchemy import event as sa_event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from ..database_driver import DriverStatement, driver_cursor
from ..extensions import db
from .rows import insert_event, receipt_params
from .statements import for_engine, receive_if, reserved_id_is_current
from .tables import events as events_table


@dataclass(frozen=True)
class HeldEvent:
    """A new event ``add`` held back: its row, with its reserved id, and its consumers."""

    values: dict[str, Any]
    consumers: list[tuple[str, str]]


HELD: ContextVar[list[HeldEvent] | None] = ContextVar("inbox_held_events", default=None)


@contextmanager
def holding() -> Iterator[list[HeldEvent]]:
    """Hold back the events ``add`` writes in the block, for the caller to write them.

    On PostgreSQL a unit of work made of one new event and a record of the
    caller's own (the Idempotency-Key API's) is then one autocommitted
    statement, where BEGIN, two statements and COMMIT were four round
    trips: the caller writes the held event with a ``GuardedReceipt``, or,
    when its unit of work holds more, with ``write_held`` in its
    transaction. On SQLite ``add`` writes at once, in
    the writers' turn, and the list stays empty. A held event's key must
    be new (the API's are fresh uuids): a taken one fails its write.
    """
    held: list[HeldEvent] = []
    postgresql = db.engine.dialect.name == "postgresql"
    token = HELD.set(held if postgresql else None)
    try:
        yield held
    finally:
        HELD.reset(token)


class GuardedReceipt:
    """PostgreSQL: a held event and the caller's own write in one statement (the event if it wrote).

    ``guard(only_if)`` builds the caller's write (an INSERT or upsert
    returning an ``id``) with ``only_if`` added to its condition, so that it
    writes nothing for an event whose reserved id the sequence no longer
    covers. The statement is built once per engine.
    """

    def __init__(self, guard: Callable[[Any], Any]) -> None:
        self._guard = guard
        self._built: weakref.WeakKeyDictionary[Engine, tuple[DriverStatement, DriverStatement]] = (
            weakref.WeakKeyDictionary()
        )

    def write(self, event: HeldEvent, params: dict[str, Any]) -> int | None:
        """Write the guard (with ``params``) and the event; the guard's id, or None.

        Nothing else is written when the guard writes nothing. Raises
        ReservedIdTaken, nothing written, if the event's reserved id was
        handed out again (the sequence went back): the caller runs its unit
        of work anew. The event's key must be new (see ``holding``).
        """
        engine = db.engine
        with_deliveries, lone = self._statements(engine)
        statement = with_deliveries if event.consumers else lone
        deliveries = bool(event.consumers)
        binds = {**params, **receipt_params(event.values, event.consumers, deliveries=deliveries)}
        try:
            with driver_cursor(engine) as cursor:
                row = cursor.execute(statement.sql, statement.params(binds)).fetchone()
        except IntegrityError as exc:
            check_reserved_id(engine, exc)
            raise
        guard_id, _written, id_current = row
        if guard_id is None and not id_current:
            # The guard refused an event whose id the sequence went back below.
            forget_reserved_ids(engine)
            raise ReservedIdTaken()
        return None if guard_id is None else int(guard_id)

    def _statements(self, engine: Engine) -> tuple[DriverStatement, DriverStatement]:
        built = self._built.get(engine)
        if built is None:
            guard = self._guard(reserved_id_is_current()).cte("guard")
            built = self._built[engine] = (
                DriverStatement(receive_if(guard, deliveries=True), engine.dialect),
                # For an event no consumer takes: fewer parameters, a smaller plan.
                DriverStatement(receive_if(guard, deliveries=False), engine.dialect),
            )
        return built


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
    held = HELD.get()
    if held is None:
        return
    write_held(held, connection)
    HELD.set(None)


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


def reserve_event_id(engine: Engine) -> int:
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
