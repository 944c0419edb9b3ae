"""Storing received messages: one at a time, in a batch, or inside the caller's transaction.

The event row is the dedup marker: its unique (source, dedup key)
constraint decides between racing copies. A new event is written together
with its deliveries (the outbox); a redelivery with the same fingerprint
writes nothing in its request (its count is bookkeeping, written in a batch:
see duplicates.py); other content under the key is a conflict, kept for
review in ``event_conflicts``.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

import orjson
from flask import current_app
from sqlalchemy import event as sa_event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from ..database import autocommit_connection, transaction, write_transaction, writer_turn
from ..extensions import db
from ..models import utcnow
from ..processing.deliveries import new_delivery_columns
from . import duplicates
from .driver import driver_cursor, transaction_cursor
from .messages import Accepted, BatchRefused, Conflict, Duplicate, Message, Outcome
from .statements import CONFLICT_COLUMNS, Statements, for_engine
from .statements import events as events_table

log = logging.getLogger(__name__)

EXTENSION = "webhook_receiver.inbox"

# (source, event type) -> the (name, kind) of each consumer of a new event.
Routes = Callable[[str, str | None], list[tuple[str, str]]]
# (body, event type, content type) -> the fingerprint of that content, for
# an intake whose messages' fingerprints cover their bytes (see receive_many).
ContentFingerprint = Callable[[bytes, str | None, str | None], str]


def _routes() -> Routes:
    routes: Routes = current_app.extensions[EXTENSION]
    return routes


@dataclass(frozen=True)
class _Stored:
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


def receive(message: Message, *, fast: bool = True) -> Outcome:
    """Store one message, committed before this returns; say what became of it.

    ``fast=False`` takes the plain Core path instead of the dialect's fast
    path (the contract tests compare the two).
    """
    engine = db.engine
    statements = for_engine(engine)
    consumers = _routes()(message.source, message.event_type)
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
            _log("accepted", message, event_id)
            return Accepted(event_id)
        if stored is not None:
            return _settle_existing(engine, statements, message, values, stored)
        # A racing copy won the insert after this one's read: read what it stored.
    raise RuntimeError("receipt did not settle")  # pragma: no cover


def receive_many(
    messages: Sequence[Message],
    *,
    all_or_nothing: bool = False,
    fast: bool = True,
    content_fingerprint: ContentFingerprint | None = None,
) -> list[Outcome]:
    """Store a batch in one transaction, committed before this returns; an outcome per message.

    New events are one multi-row ``INSERT ... ON CONFLICT DO NOTHING
    RETURNING`` and their deliveries one more INSERT; on PostgreSQL both,
    with the read of the keys already taken, are one statement, which is
    then the whole transaction (conflicts are compared and kept in a second one). A key
    repeated inside the batch is settled against its first occurrence.
    Raises the database's error when it is away or locked: nothing was
    committed, or on PostgreSQL only the new events, when keeping a
    conflict failed after them (sent again, they are duplicates, and the
    conflict is found again).

    ``all_or_nothing``: a batch with a conflict stores none of its events;
    the conflicts with stored events are kept for review all the same, and
    BatchRefused says which. ``fast=False`` takes the plain Core statements
    instead of PostgreSQL's one statement (the contract tests compare them).

    ``content_fingerprint``: the messages' fingerprints cover their bytes as
    sent (cheap: nothing parsed), and a message whose fingerprint differs
    from its key's event is compared again by this fingerprint of the
    content (canonical JSON, say), computed for both; the same, it is a
    duplicate. A conflict is then kept under its content fingerprint.
    """
    if not messages:
        return []
    engine = db.engine
    statements = for_engine(engine)
    now = utcnow()
    first: dict[tuple[str, str], int] = {}
    for index, message in enumerate(messages):
        first.setdefault((message.source, message.dedup_key), index)
    rows = [event_values(messages[i], messages[i].received_at or now) for i in first.values()]
    batch = _Batch(messages, first, rows, now, content_fingerprint)
    try:
        outcomes, new_ids, conflicts = _store_batch(engine, statements, batch, all_or_nothing, fast)
    except _Refused as refused:
        outcomes, new_ids, conflicts = refused.args
        # Only a conflict with an event stored before the batch can be kept:
        # the batch's own events were rolled back.
        kept = [(m, event_id) for m, event_id in conflicts if event_id not in new_ids.values()]
        with transaction(engine) as conn:
            _keep_conflicts(conn, statements, kept, now)
        for message, event_id in kept:
            _log_outcome(message, Conflict(event_id))
        raise BatchRefused([Conflict(event_id) for _, event_id in kept]) from None
    redeliveries = []
    for message, outcome in zip(messages, outcomes, strict=True):
        if isinstance(outcome, Duplicate):
            redeliveries.append(duplicates.Redelivery(outcome.event_id, message.received_at or now))
        elif isinstance(outcome, Conflict):
            _log_outcome(message, outcome)  # an ERROR line of its own, whatever the level
    duplicates.record_many(redeliveries)
    if log.isEnabledFor(logging.INFO):
        _log_batch(messages, outcomes)
    return outcomes


class _Refused(Exception):
    """Roll an all-or-nothing batch back; carries its outcomes, new ids and conflicts."""


class _Batch(NamedTuple):
    """A batch as its writers take it."""

    messages: Sequence[Message]
    # Each key's first message, by index: a key repeated in the batch is
    # settled against it.
    first: dict[tuple[str, str], int]
    # The events row of each key, in ``first``'s order.
    rows: list[dict[str, Any]]
    now: datetime
    content_fingerprint: ContentFingerprint | None


# What a batch's writes found: the new events' ids, and the events already
# under the other keys, by (source, dedup key).
_Written = tuple[dict[tuple[str, str], int], dict[tuple[str, str], _Stored]]
# A batch's writes inside its transaction, on one path.
_Writer = Callable[[Connection, Statements, _Batch], _Written]


# Per engine, the sources whose last batch found every key taken: a run of
# redeliveries (a consumer's unacknowledged batches after a crash, a
# producer's retries). On SQLite their next batch's keys are read first.
_ALL_TAKEN: weakref.WeakKeyDictionary[Engine, set[str]] = weakref.WeakKeyDictionary()


def _store_batch(
    engine: Engine, statements: Statements, batch: _Batch, all_or_nothing: bool, fast: bool
) -> tuple[list[Outcome], dict[tuple[str, str], int], list[tuple[Message, int]]]:
    if fast and statements.dialect_name == "sqlite" and not all_or_nothing:
        return _store_batch_sqlite(engine, statements, batch)
    postgresql = fast and statements.dialect_name == "postgresql"
    if postgresql and not all_or_nothing:
        # The new events and their deliveries are one statement, its own
        # transaction: one round trip where BEGIN, the statement and COMMIT
        # were three, each a wait for a consumer's storing thread to get the
        # GIL back.
        with driver_cursor(engine) as cursor:
            new_ids, stored = _write_postgresql(cursor, statements, batch)
        outcomes, conflicts = _settle_batch(batch, new_ids, stored)
        conflicts = _keep_conflicts_after(engine, statements, batch, outcomes, conflicts)
        return outcomes, new_ids, conflicts
    write: _Writer = (
        _write_postgresql_in_transaction if postgresql else _write_sqlite if fast else _write_core
    )
    return _store_in_transaction(engine, statements, batch, all_or_nothing, write)


def _store_batch_sqlite(
    engine: Engine, statements: Statements, batch: _Batch
) -> tuple[list[Outcome], dict[tuple[str, str], int], list[tuple[Message, int]]]:
    """SQLite: the batch's transaction; after a batch of redeliveries only, a read first.

    A batch whose keys are all taken writes no event: read outside any
    transaction, it needs no turn at the database's write lock (a webhook,
    the redeliveries' ledger or another consumer may hold it), nor the rows'
    parameters and INSERT it would skip. Only after such a batch, so that
    new events never pay for the read; a key found free sends the batch to
    its transaction all the same.
    """
    source = batch.messages[0].source
    runs = _ALL_TAKEN.setdefault(engine, set())
    if source in runs:
        with driver_cursor(engine) as cursor:
            stored = _find_taken_sqlite(cursor, statements, list(batch.first))
        if len(stored) == len(batch.first):
            outcomes, conflicts = _settle_batch(batch, {}, stored)
            conflicts = _keep_conflicts_after(engine, statements, batch, outcomes, conflicts)
            return outcomes, {}, conflicts
    settled = _store_in_transaction(engine, statements, batch, False, _write_sqlite)
    if settled[1]:
        runs.discard(source)
    else:
        runs.add(source)
    return settled


def _keep_conflicts_after(
    engine: Engine,
    statements: Statements,
    batch: _Batch,
    outcomes: list[Outcome],
    conflicts: list[tuple[Message, int]],
) -> list[tuple[Message, int]]:
    """Compare and keep a batch's conflicts in a transaction of their own, after its events'.

    Should this fail, receive_many raises before any message is settled,
    and the redelivery finds the same conflict again.
    """
    if conflicts:
        with transaction(engine) as conn:
            conflicts = _compare_contents(conn, statements, batch, outcomes, conflicts)
            _keep_conflicts(conn, statements, conflicts, batch.now)
    return conflicts


class _NotSequential(Exception):
    """SQLite gave a batch's new rows ids other than the next ones (only past 2**63 - 1)."""


def _store_in_transaction(
    engine: Engine, statements: Statements, batch: _Batch, all_or_nothing: bool, write: _Writer
) -> tuple[list[Outcome], dict[tuple[str, str], int], list[tuple[Message, int]]]:
    try:
        return _one_transaction(engine, statements, batch, all_or_nothing, write)
    except _NotSequential:
        # Rolled back: SQLite's rowids reached their largest (2**63 - 1) and
        # it picks new ones at random; Core's RETURNING reads them instead.
        return _one_transaction(engine, statements, batch, all_or_nothing, _write_core)


def _one_transaction(
    engine: Engine, statements: Statements, batch: _Batch, all_or_nothing: bool, write: _Writer
) -> tuple[list[Outcome], dict[tuple[str, str], int], list[tuple[Message, int]]]:
    with transaction(engine) as conn:
        new_ids, stored = write(conn, statements, batch)
        outcomes, conflicts = _settle_batch(batch, new_ids, stored)
        if conflicts:
            conflicts = _compare_contents(conn, statements, batch, outcomes, conflicts)
        if conflicts and all_or_nothing:
            raise _Refused(outcomes, new_ids, conflicts)
        _keep_conflicts(conn, statements, conflicts, batch.now)
    return outcomes, new_ids, conflicts


def _settle_batch(
    batch: _Batch,
    new_ids: dict[tuple[str, str], int],
    stored: dict[tuple[str, str], _Stored],
) -> tuple[list[Outcome], list[tuple[Message, int]]]:
    """Each message's outcome, and the conflicts to keep, from what the writes found."""
    messages, first = batch.messages, batch.first
    outcomes: list[Outcome] = []
    conflicts: list[tuple[Message, int]] = []
    for index, message in enumerate(messages):
        key = (message.source, message.dedup_key)
        if key in new_ids:
            event_id = new_ids[key]
            if first[key] == index:
                outcomes.append(Accepted(event_id))
                continue
            reference = _Stored(event_id, messages[first[key]].fingerprint)
        else:
            reference = stored[key]
        if reference.fingerprint == message.fingerprint:
            outcomes.append(Duplicate(reference.id))
        else:
            outcomes.append(Conflict(reference.id))
            conflicts.append((message, reference.id))
    return outcomes, conflicts


def _compare_contents(
    conn: Connection,
    statements: Statements,
    batch: _Batch,
    outcomes: list[Outcome],
    conflicts: list[tuple[Message, int]],
) -> list[tuple[Message, int]]:
    """The conflicts whose content differs too; the others become duplicates in ``outcomes``.

    Only for a batch with a content fingerprint: its messages' fingerprints
    cover their bytes, so other bytes (JSON serialised again, say) need not
    be other content. The events' contents are read in one statement, this
    batch's new events' included (they are visible in its transaction, or
    committed). A conflict is kept under its content's fingerprint, so that
    its copies, however serialised, are one conflict.
    """
    content_fingerprint = batch.content_fingerprint
    if content_fingerprint is None:
        return conflicts
    ids = sorted({event_id for _, event_id in conflicts})
    stored = {
        event_id: content_fingerprint(body, event_type, content_type)
        for event_id, body, event_type, content_type in conn.execute(
            statements.find_contents, {"b_ids": ids}
        )
    }
    at = [index for index, outcome in enumerate(outcomes) if type(outcome) is Conflict]
    kept = []
    for index, (message, event_id) in zip(at, conflicts, strict=True):
        own = content_fingerprint(message.body, message.event_type, message.content_type)
        # An event purged since the write is not found: a conflict still, whose
        # record then fails, and the batch is stored again one message at a time.
        if own == stored.get(event_id):
            outcomes[index] = Duplicate(event_id)
        else:
            kept.append((message._replace(fingerprint=own), event_id))
    return kept


def _write_core(conn: Connection, statements: Statements, batch: _Batch) -> _Written:
    """The plain Core path: insert the events, read the taken keys, insert the deliveries."""
    inserted = conn.execute(statements.insert_events, batch.rows).all()
    new_ids = {(source, key): event_id for event_id, source, key in inserted}
    taken = [key for key in batch.first if key not in new_ids]
    stored: dict[tuple[str, str], _Stored] = {}
    if taken:
        found = conn.execute(statements.find_many, {"b_keys": taken})
        for event_id, source, key, print_ in found:
            stored[(source, key)] = _Stored(event_id, print_)
    _insert_batch_deliveries(conn, statements, batch, new_ids)
    return new_ids, stored


def _write_sqlite(conn: Connection, statements: Statements, batch: _Batch) -> _Written:
    """SQLite: the Core path's writes, the events and the read on the driver (SqliteBatch)."""
    sql = statements.sqlite_batch
    rows = batch.rows
    new_ids: dict[tuple[str, str], int] = {}
    stored: dict[tuple[str, str], _Stored] = {}
    with transaction_cursor(conn) as cursor:
        first_id, last_id, inserted = 0, 0, 0
        for start in range(0, len(rows), sql.chunk):
            chunk = rows[start : start + sql.chunk]
            cursor.execute(sql.insert_sql(len(chunk)), sql.params(chunk))
            if cursor.rowcount > 0:
                # This statement's new rows: ids last_insert_rowid() - changes() + 1 on.
                first_id = first_id or cursor.lastrowid - cursor.rowcount + 1
                last_id = cursor.lastrowid
                inserted += cursor.rowcount
        if inserted:
            cursor.execute(sql.new_sql, (first_id, last_id))
            (found,) = cursor.fetchone()
            for event_id, source, key in orjson.loads(found):
                new_ids[(source, key)] = event_id
            if len(new_ids) != inserted:
                # Only at the largest rowid, 2**63 - 1, does SQLite pick
                # others, at random.
                raise _NotSequential(f"{inserted} events inserted, {len(new_ids)} found by id")
        taken = [key for key in batch.first if key not in new_ids]
        if taken:
            stored = _find_taken_sqlite(cursor, statements, taken)
    _insert_batch_deliveries(conn, statements, batch, new_ids)
    return new_ids, stored


def _find_taken_sqlite(
    cursor: Any, statements: Statements, keys: list[tuple[str, str]]
) -> dict[tuple[str, str], _Stored]:
    """The events under those of ``keys`` that are taken, in one read (SqliteBatch.find_sql)."""
    cursor.execute(statements.sqlite_batch.find_sql, (orjson.dumps(keys).decode(),))
    (found,) = cursor.fetchone()
    return {
        (source, key): _Stored(event_id, print_)
        for event_id, source, key, print_ in orjson.loads(found)
    }


def _insert_batch_deliveries(
    conn: Connection, statements: Statements, batch: _Batch, new_ids: dict[tuple[str, str], int]
) -> None:
    """The new events' deliveries (the outbox), in the batch's transaction."""
    routes = _routes()
    deliveries = []
    for key, event_id in new_ids.items():
        message = batch.messages[batch.first[key]]
        # As for one message: a new delivery is due from its event's receipt.
        deliveries += _delivery_rows(
            event_id, routes(message.source, message.event_type), message.received_at or batch.now
        )
    if deliveries:
        conn.execute(statements.insert_deliveries, deliveries)


def _write_postgresql_in_transaction(
    conn: Connection, statements: Statements, batch: _Batch
) -> _Written:
    """PostgreSQL's one statement inside the caller's transaction (an all-or-nothing batch)."""
    with transaction_cursor(conn) as cursor:
        return _write_postgresql(cursor, statements, batch)


def _write_postgresql(cursor: Any, statements: Statements, batch: _Batch) -> _Written:
    """PostgreSQL: the taken keys' read, the events and their deliveries in one statement."""
    sql = statements.batch_insert
    messages, first = batch.messages, batch.first
    wanted = _wanted_deliveries([messages[i] for i in first.values()], batch.now)
    new_ids: dict[tuple[str, str], int] = {}
    stored: dict[tuple[str, str], _Stored] = {}
    # Never prepared: planned for each batch, with its rows and the table
    # as they are then. A plan cached early (psycopg prepares a statement on
    # its fifth run) made batches of 100 five times slower as the table grew.
    cursor.execute(sql.sql, sql.params(batch.rows, wanted), prepare=False)
    for event_id, source, key, print_, is_new in cursor.fetchall():
        if is_new:
            new_ids[(source, key)] = event_id
        else:
            stored[(source, key)] = _Stored(event_id, print_)
    # Taken by a copy committed while the statement ran: not in its snapshot.
    raced = [key for key in first if key not in new_ids and key not in stored]
    if raced:
        keys = {"source": [s for s, _ in raced], "dedup_key": [k for _, k in raced]}
        cursor.execute(sql.find_sql, keys)
        for event_id, source, key, print_ in cursor.fetchall():
            stored[(source, key)] = _Stored(event_id, print_)
    return new_ids, stored


def _wanted_deliveries(messages: list[Message], now: datetime) -> list[dict[str, Any]]:
    """The deliveries of each message, were it new, named by its source and dedup key."""
    routes = _routes()
    consumers: dict[tuple[str, str | None], list[tuple[str, str]]] = {}
    columns: dict[datetime, dict[str, Any]] = {}
    wanted = []
    for message in messages:
        route = (message.source, message.event_type)
        if route not in consumers:
            consumers[route] = routes(*route)
        # As for one message: a new delivery is due from its event's receipt.
        received_at = message.received_at or now
        if received_at not in columns:
            columns[received_at] = new_delivery_columns(received_at)
        for name, kind in consumers[route]:
            wanted.append(
                {
                    "source": message.source,
                    "dedup_key": message.dedup_key,
                    "consumer": name,
                    "kind": kind,
                    **columns[received_at],
                }
            )
    return wanted


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
    consumers = _routes()(message.source, message.event_type)
    held = _HELD.get()
    if held is not None and fast:
        values["id"] = _reserve_event_id(db.engine)
        held.append(HeldEvent(values, consumers))
        return int(values["id"])
    conn = db.session.connection()
    if fast and consumers and statements.dialect_name == "postgresql":
        with transaction_cursor(conn) as cursor:
            _stored, event_id = _postgresql_receipt(cursor, statements, values, consumers)
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
        _insert_deliveries(conn, statements, event_id, consumers, values["received_at"])
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
    return _receipt_binds(event.values, event.consumers, deliveries=bool(event.consumers))


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
            event_id = conn.execute(statements.insert_event, values).scalar()
            if event_id is None:
                raise RuntimeError(f"a held event's key was taken: {values['dedup_key']!r}")
            _insert_deliveries(conn, statements, event_id, event.consumers, values["received_at"])
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


# -- the paths of one message ------------------------------------------------
# Each returns (the event stored under the key, None) when the key is taken,
# (None, the new event's id) when this message was stored, and (None, None)
# when a racing copy won the insert after this one looked.


def _receive_core(
    engine: Engine,
    statements: Statements,
    values: dict[str, Any],
    consumers: list[tuple[str, str]],
) -> tuple[_Stored | None, int | None]:
    """The plain Core path: insert, and read the key only when it was taken."""
    with transaction(engine) as conn:
        event_id = conn.execute(statements.insert_event, values).scalar()
        if event_id is None:
            keys = {"b_source": values["source"], "b_key": values["dedup_key"]}
            row = conn.execute(statements.find, keys).one_or_none()
            return (_Stored(*row) if row else None), None
        _insert_deliveries(conn, statements, event_id, consumers, values["received_at"])
    return None, event_id


def _receive_sqlite_alone(
    engine: Engine, statements: Statements, values: dict[str, Any]
) -> tuple[_Stored | None, int | None]:
    """SQLite, no deliveries: the read, then an autocommitted INSERT, both on the driver.

    Redeliveries are read-only: a read needs no turn at the write lock, so
    a storm of copies does not queue behind new events. The INSERT is then
    a transaction of its own, durable when it returns.
    """
    find, insert_ = statements.fast_find, statements.fast_insert
    with driver_cursor(engine) as cursor:
        keys = {"b_source": values["source"], "b_key": values["dedup_key"]}
        row = cursor.execute(find.sql, find.params(keys)).fetchone()
        if row is not None:
            return _Stored(*row), None
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
) -> tuple[_Stored | None, int | None]:
    """SQLite with deliveries: a lone read, then the event and its deliveries in one transaction."""
    with autocommit_connection() as conn:
        keys = {"b_source": values["source"], "b_key": values["dedup_key"]}
        row = conn.execute(statements.find, keys).one_or_none()
        if row is not None:
            return _Stored(*row), None
        with write_transaction(conn):
            event_id = conn.execute(statements.insert_event, values).scalar()
            if event_id is not None:
                _insert_deliveries(conn, statements, event_id, consumers, values["received_at"])
    return None, event_id


def _receive_postgresql(
    engine: Engine,
    statements: Statements,
    values: dict[str, Any],
    consumers: list[tuple[str, str]],
) -> tuple[_Stored | None, int | None]:
    """PostgreSQL: read, insert and deliveries in one statement, its own transaction.

    A taken key writes nothing, so its commit is free; a new event commits
    durably, deliveries included, before the statement returns.
    """
    with driver_cursor(engine) as cursor:
        return _postgresql_receipt(cursor, statements, values, consumers)


def _postgresql_receipt(
    cursor: Any,
    statements: Statements,
    values: dict[str, Any],
    consumers: list[tuple[str, str]],
) -> tuple[_Stored | None, int | None]:
    """Run PostgreSQL's one-statement receipt on ``cursor``, in whatever transaction it is."""
    statement = statements.fast_receive
    stored_id, stored_fingerprint, event_id, _enqueued = cursor.execute(
        statement.sql, statement.params(_receipt_binds(values, consumers))
    ).fetchone()
    if stored_id is not None:
        return _Stored(stored_id, stored_fingerprint), None
    return None, event_id


# -- shared pieces --------------------------------------------------------------


def _receipt_binds(
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


def _delivery_rows(
    event_id: int, consumers: list[tuple[str, str]], now: datetime
) -> list[dict[str, Any]]:
    columns = new_delivery_columns(now)
    return [
        {"event_id": event_id, "consumer": name, "kind": kind, **columns}
        for name, kind in consumers
    ]


def _insert_deliveries(
    conn: Connection,
    statements: Statements,
    event_id: int,
    consumers: list[tuple[str, str]],
    now: datetime,
) -> None:
    rows = _delivery_rows(event_id, consumers, now)
    if rows:
        conn.execute(statements.insert_deliveries, rows)


def _settle_existing(
    engine: Engine,
    statements: Statements,
    message: Message,
    values: dict[str, Any],
    stored: _Stored,
) -> Outcome:
    """A message whose key is taken: a duplicate, or a conflict kept for review."""
    if stored.fingerprint == message.fingerprint:
        # The answer needs nothing more than the stored event; the count is
        # bookkeeping, written in a batch (see duplicates.py).
        duplicates.record(stored.id, values["received_at"])
        _log("duplicate", message, stored.id)
        return Duplicate(stored.id)
    with transaction(engine) as conn:
        _keep_conflict(conn, statements, stored.id, message, values["received_at"])
    outcome = Conflict(stored.id)
    _log_outcome(message, outcome)
    return outcome


def _keep_conflict(
    conn: Connection, statements: Statements, event_id: int, message: Message, now: datetime
) -> None:
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


def _keep_conflicts(
    conn: Connection, statements: Statements, conflicts: list[tuple[Message, int]], now: datetime
) -> None:
    for message, event_id in conflicts:
        _keep_conflict(conn, statements, event_id, message, now)


def _log_outcome(message: Message, outcome: Outcome) -> None:
    if isinstance(outcome, Conflict):
        log.error(
            "dedup key reused with different content",
            extra={
                "outcome": "conflict",
                "source": message.source,
                "dedup_key": message.dedup_key,
                "event_id": outcome.event_id,
                "correlation_id": message.correlation_id,
            },
        )
    else:
        _log(_OUTCOME_NAMES[type(outcome)], message, outcome.event_id)


# Messages named by one batch line: a line stays a few kilobytes, under the
# line limits of log collectors (Docker's json-file driver splits at 16 KiB).
LOGGED_PER_LINE = 50


def _log_batch(messages: Sequence[Message], outcomes: Sequence[Outcome]) -> None:
    """A line per source and up to LOGGED_PER_LINE messages of a batch, each with its outcome.

    A consumer stores thousands of messages a second: a line each cost
    about a quarter of its Python per message. Each message is still named in a line, with
    its dedup key, event id, outcome and correlation id, so a search for a
    key finds it; conflicts have an ERROR line each as well.
    """
    by_source: dict[str, list[dict[str, Any]]] = {}
    for message, outcome in zip(messages, outcomes, strict=True):
        entry = {
            "dedup_key": message.dedup_key,
            "event_id": outcome.event_id,
            "outcome": _OUTCOME_NAMES[type(outcome)],
        }
        if message.correlation_id is not None:
            entry["correlation_id"] = message.correlation_id
        by_source.setdefault(message.source, []).append(entry)
    for source, entries in by_source.items():
        for start in range(0, len(entries), LOGGED_PER_LINE):
            chunk = entries[start : start + LOGGED_PER_LINE]
            counts = Counter(entry["outcome"] for entry in chunk)
            log.info(
                "batch stored: %d accepted, %d duplicates, %d conflicts",
                counts["accepted"],
                counts["duplicate"],
                counts["conflict"],
                extra={"outcome": "batch", "source": source, "messages": chunk},
            )


_OUTCOME_NAMES: dict[type, str] = {
    Accepted: "accepted",
    Duplicate: "duplicate",
    Conflict: "conflict",
}


def _log(outcome: str, message: Message, event_id: int) -> None:
    log.info(
        "delivery %s",
        outcome,
        extra={
            "outcome": outcome,
            "source": message.source,
            "dedup_key": message.dedup_key,
            "event_id": event_id,
            "correlation_id": message.correlation_id,
        },
    )
