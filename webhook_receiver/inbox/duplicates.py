"""Redeliveries recorded in batches, off the path of the answer.

A redelivery of a stored event changes nothing idempotency rests on: its
answer comes from the event, already committed. What it adds is
bookkeeping for operators: an ``event_duplicates`` row with its time (the
event's ``duplicate_count`` and ``last_duplicate_at`` are read from these
rows).
Written per request, that bookkeeping made each duplicate a write
transaction (on SQLite a turn at the single write lock, on PostgreSQL a
lock on the event's row that a storm of copies queues behind), so a
duplicate cost more than a new event, just when a provider's retry storm
needs them cheap. Instead each process keeps the redeliveries it answered
and writes them together in one short transaction, at most
``DUPLICATE_FLUSH_SECONDS`` later, and again when it exits. The Prometheus
counter counts each one at once.

What this gives up: a process killed outright (SIGKILL, power loss) loses
the redeliveries it had not written yet, at most that many seconds' worth,
so stored counts may fall short. A broker consumer's batch is not left to
this ledger: its redeliveries are written in the batch's own transaction
(``receive_many(..., counts_in_transaction=True)``, through
:func:`write_in`; on PostgreSQL inside its one statement), before any of it
is acknowledged, so a consumer killed outright loses none. A write that fails
(the database away) is tried again on the next round; past
``MAX_PENDING`` unwritten redeliveries the oldest are dropped, with a log
line saying how many. ``DUPLICATE_FLUSH_SECONDS = 0`` writes each one in
its own request instead, before the answer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any, NamedTuple, cast

from flask import Flask, current_app
from sqlalchemy import Integer, bindparam, exists, insert, select
from sqlalchemy.engine import Connection, Engine

from ..background import BackgroundWriter
from ..database import transaction
from ..database_driver import driver_cursor, transaction_cursor
from ..extensions import db
from ..models import Event, EventDuplicate, UTCDateTime

log = logging.getLogger(__name__)

EXTENSION = "webhook_receiver.duplicates"
MAX_PENDING = 100_000

_events = Event.__table__
_duplicates = EventDuplicate.__table__

# An event purged since its redelivery was answered gets no row (nor a
# foreign-key error that would hold up the rest of the batch).
_RECORD = insert(_duplicates).from_select(
    ["event_id", "received_at"],
    select(bindparam("r_id", type_=Integer()), bindparam("r_at", type_=UTCDateTime())).where(
        exists().where(_events.c.id == bindparam("r_id"))
    ),
)


# PostgreSQL: the rows as one statement over column arrays, its own
# transaction. As executemany, each row's parameters cost more Python
# (SQLAlchemy's and psycopg's, row by row) than the rest of a redelivery.
# ORDER BY keeps the batch's order (see DuplicateLedger._write).
_PG_WRITE = """
INSERT INTO event_duplicates (event_id, received_at)
SELECT r.id, r.at
FROM unnest(%(ids)b::bigint[], %(ats)b::timestamp[]) AS r(id, at)
WHERE EXISTS (SELECT FROM events AS e WHERE e.id = r.id)
ORDER BY r.id
"""


def _write_arrays(cursor: Any, batch: list[Redelivery]) -> None:
    # The arrays go in binary: in text format psycopg quotes each time
    # with a regex. A broker batch's redeliveries share their time: each
    # distinct time is converted once.
    naive = {at: _naive_utc(at) for at in {r.received_at for r in batch}}
    params = {
        "ids": [r.event_id for r in batch],
        "ats": [naive[r.received_at] for r in batch],
    }
    # Never prepared: a plan made while the table was small would scan it.
    cursor.execute(_PG_WRITE, params, prepare=False)


# SQLite: the rows as one statement over the batch as a JSON parameter
# (json_each). As executemany through Core, each row's parameters cost
# about 30 us of CPU per redelivery.
_SQLITE_RECORD = """
INSERT INTO event_duplicates (event_id, received_at)
SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]')
FROM json_each(?)
WHERE EXISTS (SELECT 1 FROM events WHERE events.id = json_extract(value, '$[0]'))
"""


def _write_json(cursor: Any, engine: Engine, batch: list[Redelivery]) -> None:
    # Times as SQLAlchemy stores them on SQLite (text, compared as text);
    # a batch's redeliveries share their time: each is converted once.
    stored = _sqlite_time(engine)
    text = {at: stored(at) for at in {r.received_at for r in batch}}
    rows = json.dumps([[r.event_id, text[r.received_at]] for r in batch])
    cursor.execute(_SQLITE_RECORD, (rows,))


def write_in(conn: Connection, redeliveries: list[Redelivery], *, fast: bool = True) -> None:
    """Write ``redeliveries`` in ``conn``'s transaction: they commit with it (a batch's own).

    The dialect's one statement, as the ledger writes them (``fast=False``:
    the plain Core statement).
    """
    if not redeliveries:
        return
    # In event id order: each row's foreign key takes a share lock on its
    # event, so two processes' batches take their locks in one order and
    # cannot deadlock.
    batch = sorted(redeliveries)
    name = conn.dialect.name
    if fast and name in ("postgresql", "sqlite"):
        with transaction_cursor(conn) as cursor:
            if name == "postgresql":
                _write_arrays(cursor, batch)
            else:
                _write_json(cursor, conn.engine, batch)
        return
    conn.execute(_RECORD, [{"r_id": r.event_id, "r_at": r.received_at} for r in batch])


def _sqlite_time(engine: Engine) -> Callable[[datetime], str]:
    process = UTCDateTime().dialect_impl(engine.dialect).bind_processor(engine.dialect)
    if process is None:
        raise TypeError(f"UTCDateTime binds no text on {engine.dialect.name}")
    return cast(Callable[[datetime], str], process)


def _naive_utc(value: datetime) -> datetime:
    # What UTCDateTime binds: the time in UTC, without its zone.
    return cast(datetime, _UTC_BIND(value, None))


_UTC_BIND = UTCDateTime().process_bind_param


class Redelivery(NamedTuple):
    """One redelivery answered: its event and when it came. A NamedTuple: built per message."""

    event_id: int
    received_at: datetime


class DuplicateLedger(BackgroundWriter[list[Redelivery]]):
    """One process's redeliveries not yet written, and the thread that writes them."""

    thread_name = "duplicate-ledger"
    unwritten = "redeliveries"
    unwritten_outcome = "duplicates_unrecorded"

    def __init__(self, engine: Engine, flush_seconds: float) -> None:
        super().__init__(engine, flush_seconds)
        self._pending: list[Redelivery] = []

    def record(self, event_id: int, received_at: datetime) -> None:
        """Note one redelivery of ``event_id``; it is written within the flush interval."""
        self.record_many([Redelivery(event_id, received_at)])

    def record_many(self, redeliveries: list[Redelivery]) -> None:
        """Note a batch's redeliveries at once: one lock and one wake for all of them."""
        if not redeliveries:
            return
        if self.flush_seconds == 0:
            self._write(redeliveries)
            return
        with self._lock:
            self._pending.extend(redeliveries)
        self.wake()

    def pending(self) -> int:
        """How many redeliveries wait to be written."""
        with self._lock:
            return len(self._pending)

    def _take(self) -> list[Redelivery]:
        with self._lock:
            batch, self._pending = self._pending, []
        return batch

    def _size(self, batch: list[Redelivery]) -> int:
        return len(batch)

    def _write(self, batch: list[Redelivery], *, fast: bool = True) -> None:
        """Write one batch in one transaction.

        ``fast=False`` takes the plain Core statements instead of the
        dialect's one statement per write (the contract test compares them).
        """
        if fast and self.engine.dialect.name == "postgresql":
            # One autocommitted statement, its own transaction; in event id
            # order, as write_in writes.
            with driver_cursor(self.engine) as cursor:
                _write_arrays(cursor, sorted(batch))
            return
        with transaction(self.engine) as conn:
            write_in(conn, batch, fast=fast)

    def _put_back(self, batch: list[Redelivery]) -> None:
        with self._lock:
            self._pending[:0] = batch
            overflow = len(self._pending) - MAX_PENDING
            if overflow > 0:
                del self._pending[:overflow]
        if overflow > 0:
            log.error(
                "dropped %d unrecorded redeliveries (more than %d waiting)",
                overflow,
                MAX_PENDING,
                extra={"outcome": "duplicates_dropped"},
            )
        self._due.set()  # try again after the interval


def record(event_id: int, received_at: datetime) -> None:
    """Note a redelivery of ``event_id`` in the current app's ledger."""
    ledger: DuplicateLedger = current_app.extensions[EXTENSION]
    ledger.record(event_id, received_at)


def record_many(redeliveries: list[Redelivery]) -> None:
    """Note a batch's redeliveries in the current app's ledger."""
    ledger: DuplicateLedger = current_app.extensions[EXTENSION]
    ledger.record_many(redeliveries)


def init_app(app: Flask) -> None:
    """Give the app a ledger on its engine."""
    with app.app_context():
        engine = db.engine
    seconds = float(app.config["DUPLICATE_FLUSH_SECONDS"])
    app.extensions[EXTENSION] = DuplicateLedger(engine, seconds)
