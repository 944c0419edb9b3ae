"""A batch's writes inside its transaction, one writer per path (Core, SQLite, PostgreSQL)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, NamedTuple

import orjson
from sqlalchemy.engine import Connection

from ..database_driver import transaction_cursor
from .batch_rows import PREPARED_FROM_BYTES
from .batch_statements import Positions, RiddenBatch
from .batch_statements import for_engine as batch_statements_for
from .messages import Message
from .rows import EventUnderKey, current_routes, delivery_rows, event_values
from .statements import Statements

# (body, event type, content type) -> the fingerprint of that content, for
# an intake whose messages' fingerprints cover their bytes (see receive_many).
ContentFingerprint = Callable[[bytes, str | None, str | None], str]


class Batch(NamedTuple):
    """A batch as its writers take it."""

    messages: Sequence[Message]
    # Each key's first message, by index: a key repeated in the batch is
    # settled against it.
    first: dict[tuple[str, str], int]
    now: datetime
    content_fingerprint: ContentFingerprint | None
    # The positions its transaction moves its source to (see batch_statements.py).
    positions: Positions
    # Whether its redeliveries' counts are written with it (receive_many's
    # counts_in_transaction), rather than by the ledger.
    counts: bool
    # PostgreSQL's statement's documents, built ahead (inbox.batch.stage).
    rows: dict[str, str] | None = None

    def firsts(self) -> list[Message]:
        """Each key's first message, in ``first``'s order."""
        messages = self.messages
        return [messages[i] for i in self.first.values()]

    def event_rows(self) -> list[dict[str, Any]]:
        """The events row of each key, in ``first``'s order (PostgreSQL's batch makes its own)."""
        now = self.now
        return [event_values(m, m.received_at or now) for m in self.firsts()]


# What a batch's writes found: the new events' ids, and the events already
# under the other keys, by (source, dedup key).
Written = tuple[dict[tuple[str, str], int], dict[tuple[str, str], EventUnderKey]]
# A batch's writes inside its transaction, on one path.
Writer = Callable[[Connection, Statements, Batch], Written]


class NotSequential(Exception):
    """SQLite gave a batch's new rows ids other than the next ones (only past 2**63 - 1)."""


def write_core(conn: Connection, statements: Statements, batch: Batch) -> Written:
    """The plain Core path: insert the events, read the taken keys, insert the deliveries."""
    inserted = conn.execute(statements.insert_events, batch.event_rows()).all()
    new_ids = {(source, key): event_id for event_id, source, key in inserted}
    taken = [key for key in batch.first if key not in new_ids]
    stored: dict[tuple[str, str], EventUnderKey] = {}
    if taken:
        found = conn.execute(statements.find_many, {"b_keys": taken})
        for event_id, source, key, print_ in found:
            stored[(source, key)] = EventUnderKey(event_id, print_)
    _insert_batch_deliveries(conn, statements, batch, new_ids)
    return new_ids, stored


def write_sqlite(conn: Connection, statements: Statements, batch: Batch) -> Written:
    """SQLite: the Core path's writes, the events and the read on the driver (SqliteBatch)."""
    sql = statements.sqlite_batch
    rows = batch.event_rows()
    new_ids: dict[tuple[str, str], int] = {}
    stored: dict[tuple[str, str], EventUnderKey] = {}
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
                raise NotSequential(f"{inserted} events inserted, {len(new_ids)} found by id")
        taken = [key for key in batch.first if key not in new_ids]
        if taken:
            stored = find_taken_sqlite(cursor, statements, taken)
        sql.deliveries.insert(cursor, _batch_deliveries(batch, new_ids))
    return new_ids, stored


def find_taken_sqlite(
    cursor: Any, statements: Statements, keys: list[tuple[str, str]]
) -> dict[tuple[str, str], EventUnderKey]:
    """The events under those of ``keys`` that are taken, in one read (SqliteBatch.find_sql)."""
    cursor.execute(statements.sqlite_batch.find_sql, (orjson.dumps(keys).decode(),))
    (found,) = cursor.fetchone()
    return {
        (source, key): EventUnderKey(event_id, print_)
        for event_id, source, key, print_ in orjson.loads(found)
    }


def _insert_batch_deliveries(
    conn: Connection, statements: Statements, batch: Batch, new_ids: dict[tuple[str, str], int]
) -> None:
    """The new events' deliveries (the outbox), in the batch's transaction."""
    deliveries = _batch_deliveries(batch, new_ids)
    if deliveries:
        conn.execute(statements.insert_deliveries, deliveries)


def _batch_deliveries(batch: Batch, new_ids: dict[tuple[str, str], int]) -> list[dict[str, Any]]:
    """The rows of the new events' deliveries."""
    routes = current_routes()
    deliveries = []
    for key, event_id in new_ids.items():
        message = batch.messages[batch.first[key]]
        # As for one message: a new delivery is due from its event's receipt.
        deliveries += delivery_rows(
            event_id,
            routes(message.source, message.event_type, message.body),
            message.received_at or batch.now,
        )
    return deliveries


def write_postgresql_in_transaction(
    conn: Connection, statements: Statements, batch: Batch
) -> Written:
    """PostgreSQL's one statement inside the caller's transaction (an all-or-nothing batch)."""
    with transaction_cursor(conn) as cursor:
        written = write_postgresql(cursor, statements, batch)
        return written.new_ids, written.stored


class PostgresqlWritten(NamedTuple):
    """What PostgreSQL's one statement wrote and found."""

    new_ids: dict[tuple[str, str], int]
    stored: dict[tuple[str, str], EventUnderKey]
    # Whether it settled every message itself, and so wrote the batch's
    # riders (its positions, its counts if it counts them).
    whole: bool


def write_postgresql(
    cursor: Any, statements: Statements, batch: Batch, ridden: RiddenBatch | None = None
) -> PostgresqlWritten:
    """PostgreSQL: the taken keys' read, the events and their deliveries in one statement.

    With ``ridden``, the batch's riders too (batch_statements.RiddenBatch):
    its positions, and its redeliveries' counts if it counts them with it,
    when the statement settles every message.
    """
    sql = statements.batch_insert
    messages, first = batch.messages, batch.first
    new_ids: dict[tuple[str, str], int] = {}
    stored: dict[tuple[str, str], EventUnderKey] = {}
    text = sql.sql
    if batch.rows is not None:
        params: dict[str, Any] = dict(batch.rows)
    else:
        params = sql.params(batch.firsts(), batch.now, current_routes())
    if ridden is not None and (batch.positions or batch.counts):
        text = ridden.sql
        params.update(ridden.params(messages, first, batch.positions, batch.counts, batch.now))
    # Prepared only once the events table is large (PREPARED_FROM_BYTES):
    # before, planned for each batch with the table as it is then (a plan
    # kept from an empty table made batches of 100 five times slower as it
    # grew). Behind a transaction pooler psycopg prepares nothing
    # (prepare_threshold None): the next transaction may get another server.
    cursor.execute(text, params, prepare=sql.events_large)
    # whole: RiddenBatch's, the riders were written.
    new, found, whole, events_bytes = cursor.fetchone()
    sql.events_large = events_bytes >= PREPARED_FROM_BYTES
    by_row = list(first)  # the batch's keys, by their row's position
    if new is not None:
        for n, event_id in orjson.loads(new):
            new_ids[by_row[n]] = event_id
    if found is not None:
        for n, event_id, print_ in orjson.loads(found):
            key = by_row[n]
            # Sent back only when not the batch's own (a conflict).
            print_ = messages[first[key]].fingerprint if print_ is None else print_
            stored[key] = EventUnderKey(event_id, print_)
    # Taken by a copy committed while the statement ran: not in its snapshot.
    raced = [key for key in first if key not in new_ids and key not in stored]
    if raced:
        keys = {"source": [s for s, _ in raced], "dedup_key": [k for _, k in raced]}
        cursor.execute(sql.find_sql, keys)
        for event_id, source, key, print_ in cursor.fetchall():
            stored[(source, key)] = EventUnderKey(event_id, print_)
    return PostgresqlWritten(new_ids, stored, bool(whole))


def write_positions(conn: Connection, moved: Positions, now: datetime) -> None:
    """Upsert ``moved`` in ``conn``'s transaction (the batch's, or one of their own)."""
    if moved:
        statements = batch_statements_for(conn.engine)
        conn.execute(statements.upsert_positions, statements.position_rows(moved, now))
