"""Storing a batch in one transaction (``receive_many``): its transactions, outcomes and conflicts.

The writes themselves, one writer per path, are in batch_writes.py.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import NamedTuple

from sqlalchemy.engine import Connection, Engine

from ..database import autocommit_connection, retrying_conflicts, transaction, writer_turn
from ..database_driver import driver_cursor
from ..extensions import db
from ..models import utcnow
from . import batch_statements, duplicates
from .batch_statements import Positions, latest
from .batch_writes import (
    Batch,
    ContentFingerprint,
    NotSequential,
    Writer,
    find_taken_sqlite,
    write_core,
    write_positions,
    write_postgresql,
    write_postgresql_in_transaction,
    write_sqlite,
)
from .logs import log, log_batch, log_outcome
from .messages import Accepted, BatchRefused, Conflict, Duplicate, Message, Outcome
from .rows import EventUnderKey, Position, current_routes, keep_conflicts
from .statements import Statements, for_engine


class Staged(NamedTuple):
    """A batch as receive_many takes it, built ahead of its transaction (:func:`stage`)."""

    messages: Sequence[Message]
    # Each key's first message, by index (Batch.first).
    first: dict[tuple[str, str], int]
    # When it was received: its events' receipt time, unless a message has its own.
    now: datetime
    # PostgreSQL's batch statement's documents of its events and deliveries
    # (BatchRows.params); None when not staged ahead and on the other paths,
    # which build their rows in the transaction.
    rows: dict[str, str] | None = None


def stage(messages: Sequence[Message]) -> Staged:
    """What receive_many builds before its transaction, built now: CPU only, no database.

    A consumer stages its next batch on its reading thread while the batch
    before is stored, so that its storing thread only sends the statement
    and waits: that wait, with no interpreter lock held, then overlaps the
    reading thread's work rather than following a share of it. Needs an
    app context (the engine's statements, the app's routes).
    """
    staged = _received(messages)
    statements = for_engine(db.engine)
    if not messages or statements.dialect_name != "postgresql":
        return staged
    firsts = [messages[i] for i in staged.first.values()]
    rows = statements.batch_insert.params(firsts, staged.now, current_routes())
    return staged._replace(rows=rows)


def _received(messages: Sequence[Message]) -> Staged:
    """``messages`` received now, each key's first found; their rows left to the transaction."""
    first: dict[tuple[str, str], int] = {}
    for index, message in enumerate(messages):
        first.setdefault((message.source, message.dedup_key), index)
    return Staged(messages, first, utcnow())


def receive_many(
    messages: Sequence[Message],
    *,
    all_or_nothing: bool = False,
    fast: bool = True,
    content_fingerprint: ContentFingerprint | None = None,
    positions: Sequence[Position] = (),
    counts_in_transaction: bool = False,
    staged: Staged | None = None,
) -> list[Outcome]:
    """Store a batch in one transaction, committed before this returns; an outcome per message.

    New events are one multi-row ``INSERT ... ON CONFLICT DO NOTHING
    RETURNING`` and their deliveries one more INSERT; on PostgreSQL both,
    with the read of the keys already taken, are one statement, which is
    then the whole transaction (conflicts are compared and kept in a second one). A key
    repeated inside the batch is settled against its first occurrence.
    A batch that loses a race with another transaction (a deadlock, a
    serialization failure) is stored again at once (database.retrying_conflicts).
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

    ``positions``: where the batch's source reads on from, per topic and
    partition (a consumer of a partitioned log), upserted in the batch's
    transaction: they commit with its events and conflicts, or not at all
    (an all-or-nothing batch refused writes none). On PostgreSQL they ride
    in its one statement, or, when a conflict is to be compared and kept
    after it, in that second transaction. Without messages (a batch of
    poison records only) they are a transaction of their own. A later
    position of the same partition wins; an earlier offset overwrites a
    later one (a consumer that seeks back on purpose).

    ``counts_in_transaction``: the batch's redeliveries' counts (their
    ``event_duplicates`` rows) are written with it, as its positions are,
    rather than by the process's ledger a moment later: on PostgreSQL its
    one statement writes those it settles (the others, found by content or
    after a race, go with its second transaction); on SQLite's read-first
    path they are its one transaction. For a broker consumer, which
    acknowledges once this returns: killed outright, it loses no count.

    ``staged``: ``stage(messages)``, built ahead (a consumer's reading thread).
    """
    engine = db.engine
    moved = latest(positions)
    if not messages:
        if moved:
            with transaction(engine) as conn:
                write_positions(conn, moved, utcnow())
        return []
    statements = for_engine(engine)
    if staged is None:
        # Its rows are built in the transaction, on the path it takes.
        staged = _received(messages)
    elif staged.messages is not messages:
        raise ValueError("staged is another batch's: stage(messages) stages this one")
    now, first = staged.now, staged.first
    batch = Batch(
        messages, first, now, content_fingerprint, moved, counts_in_transaction, staged.rows
    )
    try:
        outcomes, new_ids, conflicts = retrying_conflicts(
            lambda: _store_batch(engine, statements, batch, all_or_nothing, fast), what="batch"
        )
    except _Refused as refused:
        outcomes, new_ids, conflicts = refused.args
        # Only a conflict with an event stored before the batch can be kept:
        # the batch's own events were rolled back.
        kept = [(m, event_id) for m, event_id in conflicts if event_id not in new_ids.values()]
        with transaction(engine) as conn:
            keep_conflicts(conn, statements, kept, now)
        for message, event_id in kept:
            log_outcome(message, Conflict(event_id))
        raise BatchRefused([Conflict(event_id) for _, event_id in kept]) from None
    for message, outcome in zip(messages, outcomes, strict=True):
        if isinstance(outcome, Conflict):
            log_outcome(message, outcome)  # an ERROR line of its own, whatever the level
    if not batch.counts:
        duplicates.record_many(_redeliveries(batch, outcomes, range(len(messages))))
    if log.isEnabledFor(logging.INFO):
        log_batch(messages, outcomes)
    return outcomes


def stored_positions(source: str) -> dict[tuple[str, int], int]:
    """The positions stored for ``source``: (topic, partition) -> the next offset to read."""
    statement = batch_statements.for_engine(db.engine).find_positions
    with autocommit_connection() as conn:
        rows = conn.execute(statement, {"p_source": source})
        return {(topic, partition): offset for topic, partition, offset in rows}


class _Refused(Exception):
    """Roll an all-or-nothing batch back; carries its outcomes, new ids and conflicts."""


# Per engine, the sources whose last batch found every key taken: a run of
# redeliveries (a consumer's unacknowledged batches after a crash, a
# producer's retries). On SQLite their next batch's keys are read first.
_ALL_TAKEN: weakref.WeakKeyDictionary[Engine, set[str]] = weakref.WeakKeyDictionary()


def _store_batch(
    engine: Engine, statements: Statements, batch: Batch, all_or_nothing: bool, fast: bool
) -> tuple[list[Outcome], dict[tuple[str, str], int], list[tuple[Message, int]]]:
    if fast and statements.dialect_name == "sqlite" and not all_or_nothing:
        return _store_batch_sqlite(engine, statements, batch)
    postgresql = fast and statements.dialect_name == "postgresql"
    if postgresql and not all_or_nothing:
        # The new events and their deliveries are one statement, its own
        # transaction: one round trip where BEGIN, the statement and COMMIT
        # were three, each a wait for a consumer's storing thread to get the
        # GIL back.
        ridden = batch_statements.for_engine(engine).ridden_batch
        with driver_cursor(engine) as cursor:
            written = write_postgresql(cursor, statements, batch, ridden)
        new_ids = written.new_ids
        outcomes, conflicts = _settle_batch(batch, new_ids, written.stored)
        if written.whole:  # the statement wrote the riders
            left, uncounted = {}, range(0)
        else:
            left, uncounted = batch.positions, range(len(outcomes))
        conflicts = _keep_conflicts_after(
            engine, statements, batch, outcomes, conflicts, left, uncounted
        )
        return outcomes, new_ids, conflicts
    write: Writer = (
        write_postgresql_in_transaction if postgresql else write_sqlite if fast else write_core
    )
    return _store_in_transaction(engine, statements, batch, all_or_nothing, write)


def _store_batch_sqlite(
    engine: Engine, statements: Statements, batch: Batch
) -> tuple[list[Outcome], dict[tuple[str, str], int], list[tuple[Message, int]]]:
    """SQLite: the batch's transaction; after a batch of redeliveries only, a read first.

    A batch whose keys are all taken writes no event: read outside any
    transaction, it needs no turn at the database's write lock (a webhook,
    the redeliveries' ledger or another consumer may hold it), nor the rows'
    parameters and INSERT it would skip. Only after such a batch, so that
    new events never pay for the read; a key found free sends the batch to
    its transaction all the same. What it does write (its conflicts, its
    positions, its counts if it counts them) is then its one transaction, a
    short one: one statement each, no event's row or index touched.
    """
    source = batch.messages[0].source
    runs = _ALL_TAKEN.setdefault(engine, set())
    if source in runs:
        with driver_cursor(engine) as cursor:
            stored = find_taken_sqlite(cursor, statements, list(batch.first))
        if len(stored) == len(batch.first):
            outcomes, conflicts = _settle_batch(batch, {}, stored)
            conflicts = _keep_conflicts_after(
                engine,
                statements,
                batch,
                outcomes,
                conflicts,
                batch.positions,
                range(len(outcomes)),
            )
            return outcomes, {}, conflicts
    settled = _store_in_transaction(engine, statements, batch, False, write_sqlite)
    if settled[1]:
        runs.discard(source)
    else:
        runs.add(source)
    return settled


def _keep_conflicts_after(
    engine: Engine,
    statements: Statements,
    batch: Batch,
    outcomes: list[Outcome],
    conflicts: list[tuple[Message, int]],
    positions: Positions,
    uncounted: Iterable[int],
) -> list[tuple[Message, int]]:
    """Compare and keep a batch's conflicts in a transaction of their own, after its events'.

    What the batch has not written yet goes with them: its ``positions``,
    and if it counts its redeliveries, those at the ``uncounted`` indexes
    and those found by content. Only then is the whole batch stored.
    Should this fail, receive_many raises before any message is settled,
    and the redelivery finds the same conflict again.
    """
    counted = set(uncounted) if batch.counts else set()
    duplicate_at = [i for i in counted if type(outcomes[i]) is Duplicate]
    if conflicts or positions or duplicate_at:
        with transaction(engine) if conflicts else _bookkeeping(engine) as conn:
            if conflicts:
                at = [i for i, outcome in enumerate(outcomes) if type(outcome) is Conflict]
                conflicts = _compare_contents(conn, statements, batch, outcomes, conflicts)
                keep_conflicts(conn, statements, conflicts, batch.now)
                if batch.counts:  # the duplicates found by content
                    duplicate_at += [i for i in at if type(outcomes[i]) is Duplicate]
            duplicates.write_in(conn, _redeliveries(batch, outcomes, duplicate_at))
            write_positions(conn, positions, batch.now)
    return conflicts


def _store_in_transaction(
    engine: Engine, statements: Statements, batch: Batch, all_or_nothing: bool, write: Writer
) -> tuple[list[Outcome], dict[tuple[str, str], int], list[tuple[Message, int]]]:
    try:
        return _one_transaction(engine, statements, batch, all_or_nothing, write)
    except NotSequential:
        # Rolled back: SQLite's rowids reached their largest (2**63 - 1) and
        # it picks new ones at random; Core's RETURNING reads them instead.
        return _one_transaction(engine, statements, batch, all_or_nothing, write_core)


def _one_transaction(
    engine: Engine, statements: Statements, batch: Batch, all_or_nothing: bool, write: Writer
) -> tuple[list[Outcome], dict[tuple[str, str], int], list[tuple[Message, int]]]:
    with transaction(engine) as conn:
        new_ids, stored = write(conn, statements, batch)
        outcomes, conflicts = _settle_batch(batch, new_ids, stored)
        if conflicts:
            conflicts = _compare_contents(conn, statements, batch, outcomes, conflicts)
        if conflicts and all_or_nothing:
            raise _Refused(outcomes, new_ids, conflicts)
        keep_conflicts(conn, statements, conflicts, batch.now)
        if batch.counts:
            redeliveries = _redeliveries(batch, outcomes, range(len(outcomes)))
            duplicates.write_in(conn, redeliveries, fast=write is not write_core)
        write_positions(conn, batch.positions, batch.now)
    return outcomes, new_ids, conflicts


@contextmanager
def _bookkeeping(engine: Engine) -> Iterator[Connection]:
    """A transaction of counts and positions only: on SQLite, its commit waits for no disk.

    SQLite's batch of redeliveries read first writes nothing else: its
    commit at ``synchronous=FULL`` (a flush of the log, milliseconds on a
    disk) would cost the consumer more than the batch's read. At NORMAL, in
    WAL mode, the commit survives the process being killed, not the machine
    losing power; the next durable commit flushes it too. Lost that way, a
    count falls short, a position sends the consumer back over messages it
    finds stored: nothing an acknowledgement promised.
    """
    if engine.dialect.name != "sqlite":
        with transaction(engine) as conn:
            yield conn
        return
    with engine.connect() as conn:
        driver = conn.connection.driver_connection
        assert driver is not None
        # Outside any transaction: SQLite changes its safety level only there.
        driver.execute("PRAGMA synchronous=NORMAL")
        try:
            with writer_turn(engine), conn.begin():
                yield conn
        finally:
            driver.execute("PRAGMA synchronous=FULL")


def _redeliveries(
    batch: Batch, outcomes: list[Outcome], indexes: Iterable[int]
) -> list[duplicates.Redelivery]:
    """The redeliveries among the messages at ``indexes``: one row each in ``event_duplicates``."""
    messages, now = batch.messages, batch.now
    return [
        duplicates.Redelivery(outcome.event_id, messages[i].received_at or now)
        for i in indexes
        if type(outcome := outcomes[i]) is Duplicate
    ]


def _settle_batch(
    batch: Batch,
    new_ids: dict[tuple[str, str], int],
    stored: dict[tuple[str, str], EventUnderKey],
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
            reference = EventUnderKey(event_id, messages[first[key]].fingerprint)
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
    batch: Batch,
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
