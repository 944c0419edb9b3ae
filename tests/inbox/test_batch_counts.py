"""A batch's redelivery counts written with it (``counts_in_transaction``), as a broker's are.

Every test runs on SQLite and PostgreSQL, with the ledger's interval set
long: a count left to the ledger would not be written within the test.
On PostgreSQL the batch's one statement counts what it settles itself,
so each test compares the counts with the outcomes Python settled.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import event, select
from sqlalchemy.exc import DBAPIError

from webhook_receiver import inbox
from webhook_receiver.brokers import batch as broker_batch
from webhook_receiver.extensions import db
from webhook_receiver.inbox import batch_statements, batch_writes, duplicates, statements
from webhook_receiver.models import Event, EventConflict, EventDuplicate, utcnow

from ..helpers import RABBIT_SOURCE, waited_on_a_lock
from .test_positions import SOURCE, WHEN, _config, _count, _failing, _sqlite, at, message

PATHS = {"fast": {}, "core": {"fast": False}}


def _app(make_app: Any, **config: Any) -> Any:
    return make_app(_config(**config), DUPLICATE_FLUSH_SECONDS=3600)


def _ledger(app: Any) -> duplicates.DuplicateLedger:
    ledger: duplicates.DuplicateLedger = app.extensions[duplicates.EXTENSION]
    return ledger


def _counts() -> dict[int, tuple[int, Any]]:
    """Each event with redeliveries: how many, and the latest's time."""
    db.session.rollback()
    rows = db.session.execute(
        select(Event.id, Event.duplicate_count, Event.last_duplicate_at).where(
            Event.duplicate_count > 0
        )
    ).all()
    db.session.rollback()
    return {event_id: (count, last) for event_id, count, last in rows}


def _expected(outcomes: list[inbox.Outcome], before: dict[int, tuple[int, Any]] | None = None):
    counted = Counter(o.event_id for o in outcomes if isinstance(o, inbox.Duplicate))
    expected = {k: v[0] for k, v in (before or {}).items()}
    for event_id, n in counted.items():
        expected[event_id] = expected.get(event_id, 0) + n
    return expected


@pytest.mark.parametrize("path", PATHS)
def test_each_redelivery_of_a_batch_is_counted_in_its_transaction(make_app, path):
    app = _app(make_app, forwards=True)
    later = WHEN + timedelta(minutes=5)
    with app.app_context():
        stored = inbox.receive(message("stored"))
        assert isinstance(stored, inbox.Accepted)
        batch = [
            message("new-1"),
            message("stored", received_at=later),  # a duplicate of a stored event
            message("new-2"),
            message("new-1"),  # a duplicate inside the batch
            message("stored", fingerprint="c" * 64, body=b"changed"),  # a conflict
            message("stored"),  # the stored event's again, after the conflict
            message("new-2", fingerprint="d" * 64, body=b"changed"),  # conflict in the batch
            message("new-2"),  # and new-2's own again
        ]
        outcomes = inbox.receive_many(batch, counts_in_transaction=True, **PATHS[path])
        new_1, new_2 = outcomes[0], outcomes[2]
        assert isinstance(new_1, inbox.Accepted) and isinstance(new_2, inbox.Accepted)
        assert outcomes[4:] == [
            inbox.Conflict(stored.event_id),
            inbox.Duplicate(stored.event_id),
            inbox.Conflict(new_2.event_id),
            inbox.Duplicate(new_2.event_id),
        ]
        counts = _counts()
        assert {k: n for k, (n, _) in counts.items()} == _expected(outcomes)
        assert counts[stored.event_id] == (2, later)
        assert counts[new_1.event_id] == (1, WHEN)
        assert _ledger(app).pending() == 0
        assert _count(EventConflict) == 2


@pytest.mark.parametrize("path", PATHS)
def test_duplicates_found_by_content_are_counted_with_the_batch(make_app, path):
    # Other bytes, the same content: compared after the statement on
    # PostgreSQL, and counted in the transaction that compares them.
    def by_content(body: bytes, event_type: str | None, content_type: str | None) -> str:
        return json.dumps(json.loads(body), sort_keys=True)

    app = _app(make_app)
    with app.app_context():
        stored = inbox.receive(message("stored", body=b'{"a": 1, "b": 2}'))
        assert isinstance(stored, inbox.Accepted)
        batch = [
            message("stored", fingerprint="b" * 64, body=b'{"b":2,"a":1}'),
            message("stored", fingerprint="e" * 64, body=b'{"a": 1, "b": 3}'),
            message("stored"),
        ]
        outcomes = inbox.receive_many(
            batch,
            content_fingerprint=by_content,
            counts_in_transaction=True,
            positions=[at(0, 3)],
            **PATHS[path],
        )
        assert outcomes == [
            inbox.Duplicate(stored.event_id),
            inbox.Conflict(stored.event_id),
            inbox.Duplicate(stored.event_id),
        ]
        assert _counts()[stored.event_id][0] == 2
        assert inbox.stored_positions(SOURCE) == {("orders", 0): 3}
        assert _ledger(app).pending() == 0


def test_runs_of_redeliveries_are_counted_each_batch(make_app):
    # After a batch of redeliveries SQLite reads the next one's keys first,
    # outside any transaction: its counts are then its one transaction.
    app = _app(make_app)
    with app.app_context():
        batch = [message(f"k{n}") for n in range(5)]
        stored = inbox.receive_many(batch, counts_in_transaction=True)
        for run in range(1, 4):
            again = inbox.receive_many([*batch, batch[0]], counts_in_transaction=True)
            assert again == [*(inbox.Duplicate(o.event_id) for o in stored), again[0]]
            counts = _counts()
            assert counts[stored[0].event_id][0] == 2 * run
            assert counts[stored[1].event_id][0] == run
        assert _ledger(app).pending() == 0
        # Without it, the ledger keeps them to write later.
        inbox.receive_many(batch)
        assert _ledger(app).pending() == 5
        assert _counts()[stored[1].event_id][0] == 3


@pytest.mark.parametrize("path", [*PATHS, "read-first"])
def test_a_count_the_database_refuses_leaves_the_batch_unstored(make_app, path):
    # The counts are in the batch's transaction: refused, nothing of it
    # commits (on PostgreSQL's fast path, its one statement fails whole).
    app = _app(make_app, forwards=True)
    with app.app_context():
        old = [message("old-1"), message("old-2")]
        inbox.receive_many(old, positions=[at(0, 2)])
        if path == "read-first":
            inbox.receive_many(old)  # all taken: SQLite reads the next batch first
            batch, kwargs = old, {}
        else:
            batch, kwargs = [*old, message("new")], PATHS[path]
        with _failing("event_duplicates"):
            with pytest.raises(DBAPIError, match="injected failure on event_duplicates"):
                inbox.receive_many(
                    batch, counts_in_transaction=True, positions=[at(0, 5)], **kwargs
                )
        assert _count(Event) == 2
        assert _count(EventDuplicate) == 0
        assert inbox.stored_positions(SOURCE) == {("orders", 0): 2}
        # (The ledger's are the read-first set-up's, left to it.)
        assert _ledger(app).pending() == (2 if path == "read-first" else 0)
        # Sent again, it is stored and counted.
        inbox.receive_many(batch, counts_in_transaction=True, positions=[at(0, 5)], **kwargs)
        assert _count(EventDuplicate) == 2
        assert inbox.stored_positions(SOURCE) == {("orders", 0): 5}


def test_a_batch_whose_conflict_could_not_be_kept_is_counted_once_when_sent_again(make_app):
    # On PostgreSQL the batch's statement commits before its conflict is kept:
    # a batch with a conflict has its counts written with the conflict, so
    # that, should keeping it fail, the batch sent again is counted once.
    app = _app(make_app)
    with app.app_context():
        stored = inbox.receive(message("stored"))
        assert isinstance(stored, inbox.Accepted)
        batch = [message("stored"), message("stored", fingerprint="c" * 64, body=b"changed")]
        with _failing("event_conflicts"):
            with pytest.raises(DBAPIError, match="injected failure on event_conflicts"):
                inbox.receive_many(batch, counts_in_transaction=True)
        assert _counts() == {}
        outcomes = inbox.receive_many(batch, counts_in_transaction=True)
        assert outcomes == [inbox.Duplicate(stored.event_id), inbox.Conflict(stored.event_id)]
        assert _counts() == {stored.event_id: (1, WHEN)}


def test_a_key_taken_while_the_statement_waited_is_counted_after_it(make_app):
    # PostgreSQL: the batch's statement reads the taken keys in its snapshot;
    # a copy committed after that is read back afterwards, and its
    # redelivery counted in a transaction of its own, with the positions.
    app = _app(make_app)
    with app.app_context():
        if _sqlite():
            pytest.skip("SQLite has no lock per key: a writer waits for the database")
        racing = inbox.add(message("race"))  # in this session's transaction: not committed
        assert racing is not None
        outcomes: list[Any] = []

        def batch() -> None:
            with app.app_context():
                outcomes.extend(
                    inbox.receive_many(
                        [message("new"), message("race")],
                        counts_in_transaction=True,
                        positions=[at(0, 9)],
                    )
                )

        thread = threading.Thread(target=batch)
        thread.start()
        waited = waited_on_a_lock(db.engine, thread)  # until the batch waits on the row
        db.session.commit()
        thread.join(30)
        assert waited and not thread.is_alive()
        assert outcomes[1] == inbox.Duplicate(racing)
        assert _counts() == {racing: (1, WHEN)}
        assert inbox.stored_positions(SOURCE) == {("orders", 0): 9}


def test_a_broker_batch_is_counted_before_store_returns(make_app):
    # What the consumers acknowledge after: every count of the batch is
    # written, stored in one go or one message at a time.
    app = _app(make_app)
    with app.app_context():
        messages = [message(f"k{n}") for n in range(4)]
        prepared = broker_batch.Prepared(messages, [None] * 4)
        broker_batch.store(RABBIT_SOURCE, prepared)
        broker_batch.store(RABBIT_SOURCE, prepared)
        assert sum(n for n, _ in _counts().values()) == 4
        with _failing("events", "NEW.dedup_key = 'k9'"):
            refused = [*messages, message("k9")]
            verdicts = broker_batch.store(RABBIT_SOURCE, broker_batch.Prepared(refused, [None] * 5))
        assert [v.action for v in verdicts] == ["ack"] * 4 + ["dead_letter"]
        assert sum(n for n, _ in _counts().values()) == 8
        assert _ledger(app).pending() == 0


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_run_of_redeliveries_commits_its_counts_without_waiting_for_the_disk(make_app):
    # SQLite's batch read first writes only counts and positions: committed
    # at synchronous=NORMAL (durable through a crash of the process), and
    # every connection goes back to the pool at FULL, for events' commits.
    app = _app(make_app)
    levels: list[tuple[str, int]] = []

    def watch(conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        for table in ("broker_positions", "event_conflicts"):
            if f"INTO {table}" in statement:
                level = conn.connection.execute("PRAGMA synchronous").fetchone()[0]
                levels.append((table, level))

    with app.app_context():
        batch = [message(f"k{n}") for n in range(3)]
        stored = inbox.receive_many(batch, counts_in_transaction=True, positions=[at(0, 3)])
        inbox.receive_many(batch, counts_in_transaction=True, positions=[at(0, 6)])
        event.listen(db.engine, "before_cursor_execute", watch)
        try:
            inbox.receive_many(batch, counts_in_transaction=True, positions=[at(0, 9)])
            with _failing("event_conflicts"):  # a conflict's commit waits for the disk
                changed = message("k0", fingerprint="c" * 64, body=b"changed")
                with pytest.raises(DBAPIError):
                    inbox.receive_many([changed], counts_in_transaction=True, positions=[at(0, 10)])
        finally:
            event.remove(db.engine, "before_cursor_execute", watch)
        # NORMAL (1), then FULL (2) for the conflict, which failed before its positions.
        assert levels == [("broker_positions", 1), ("event_conflicts", 2)]
        assert inbox.stored_positions(SOURCE) == {("orders", 0): 9}
        assert _counts()[stored[0].event_id][0] == 2
        pooled = [db.engine.raw_connection() for _ in range(db.engine.pool.checkedin())]
        try:
            assert pooled
            assert {
                c.driver_connection.execute("PRAGMA synchronous").fetchone()[0] for c in pooled
            } == {2}
        finally:
            for c in pooled:
                c.close()


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_batch_of_redeliveries_relaxes_only_its_own_commit(make_app):
    # PostgreSQL: a statement that inserts no event commits without waiting
    # for the log's flush, for its own transaction only: the pooled
    # connections keep the server's setting for every later commit.
    app = _app(make_app)
    with app.app_context():
        batch = [message(f"k{n}") for n in range(3)]
        stored = inbox.receive_many(batch, counts_in_transaction=True, positions=[at(0, 3)])
        inbox.receive_many(batch, counts_in_transaction=True, positions=[at(0, 6)])
        assert _counts()[stored[0].event_id][0] == 1
        assert inbox.stored_positions(SOURCE) == {("orders", 0): 6}
        # Inside a transaction of the test's, the statement's own setting shows.
        assert _commit_level_after(batch) == "off"
        assert _commit_level_after([*batch, message("new")]) == "on"
        pooled = [db.engine.raw_connection() for _ in range(db.engine.pool.checkedin())]
        try:
            assert pooled
            for c in pooled:
                cursor = c.driver_connection.cursor()
                cursor.execute("SHOW synchronous_commit")
                assert cursor.fetchone() == ("on",)
                cursor.close()
        finally:
            for c in pooled:
                c.close()


def _commit_level_after(messages: list[inbox.Message]) -> str:
    """``synchronous_commit`` right after the batch's statement, in a transaction rolled back."""
    engine = db.engine
    now = utcnow()
    first: dict[tuple[str, str], int] = {}
    for index, m in enumerate(messages):
        first.setdefault((m.source, m.dedup_key), index)
    batch = batch_writes.Batch(messages, first, now, None, {}, True)
    pooled = engine.raw_connection()
    driver: Any = pooled.driver_connection
    try:
        cursor = driver.cursor()
        ridden = batch_statements.for_engine(engine).ridden_batch
        batch_writes.write_postgresql(cursor, statements.for_engine(engine), batch, ridden)
        cursor.execute("SHOW synchronous_commit")
        (level,) = cursor.fetchone()
        return str(level)
    finally:
        driver.rollback()
        pooled.close()
