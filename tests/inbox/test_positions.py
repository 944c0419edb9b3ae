"""A batch's positions (where a partitioned log's consumer reads on) commit with its events.

Every test runs on SQLite and PostgreSQL. Failures are injected as real
triggers, so a statement fails inside the database, mid-batch, where a
crash between the writes would.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import event, func, select, text
from sqlalchemy.exc import DBAPIError

from webhook_receiver import inbox
from webhook_receiver.brokers import batch as broker_batch
from webhook_receiver.extensions import db
from webhook_receiver.models import BrokerPosition, Event, EventConflict
from webhook_receiver.retention import purge

from ..conftest import CLIENTS
from ..helpers import RABBIT_SOURCE

SOURCE = RABBIT_SOURCE.name
WHEN = datetime(2026, 12, 6, 9, 0, tzinfo=UTC)
Position = inbox.Position


def _config(*, forwards: bool = False) -> dict[str, Any]:
    source: dict[str, Any] = {
        "provider": "generic",
        "secrets": ["orders-secret-0123456789"],
        "signature_header": "X-Signature",
    }
    if forwards:
        source["forward"] = [{"name": "billing", "url": "http://127.0.0.1:9/billing"}]
    return {"clients": CLIENTS, "sources": {SOURCE: source}}


def message(key: str, **fields: Any) -> inbox.Message:
    values: dict[str, Any] = {
        "source": SOURCE,
        "dedup_key": key,
        "fingerprint": "a" * 64,
        "body": b'{"order": 1}',
        "event_type": "order.created",
        "content_type": "application/json",
        "received_at": WHEN,
    }
    values.update(fields)
    return inbox.Message(**values)


def at(partition: int, offset: int, topic: str = "orders", source: str = SOURCE) -> Position:
    return Position(source, topic, partition, offset)


def _count(model: Any) -> int:
    db.session.rollback()
    try:
        return db.session.scalar(select(func.count()).select_from(model)) or 0
    finally:
        db.session.rollback()


def _sqlite() -> bool:
    return db.engine.dialect.name == "sqlite"


@contextmanager
def _failing(table: str, when: str = "") -> Iterator[None]:
    """Every INSERT into ``table`` (whose row matches ``when``, a condition on NEW) fails."""
    db.session.rollback()
    with db.engine.begin() as conn:
        if _sqlite():
            condition = f"WHEN {when} " if when else ""
            conn.execute(
                text(
                    f"CREATE TRIGGER fail_insert BEFORE INSERT ON {table} {condition}"
                    f"BEGIN SELECT RAISE(ABORT, 'injected failure on {table}'); END"
                )
            )
        else:
            condition = when or "true"
            conn.execute(
                text(
                    "CREATE FUNCTION fail_insert() RETURNS trigger LANGUAGE plpgsql AS $$ "
                    f"BEGIN IF {condition} THEN "
                    f"RAISE EXCEPTION 'injected failure on {table}'; END IF; RETURN NEW; END $$"
                )
            )
            conn.execute(
                text(
                    f"CREATE TRIGGER fail_insert BEFORE INSERT ON {table} "
                    "FOR EACH ROW EXECUTE FUNCTION fail_insert()"
                )
            )
    try:
        yield
    finally:
        db.session.rollback()
        with db.engine.begin() as conn:
            conn.execute(text("DROP TRIGGER fail_insert" + ("" if _sqlite() else f" ON {table}")))
            if not _sqlite():
                conn.execute(text("DROP FUNCTION fail_insert()"))


# Each way receive_many stores a batch: PostgreSQL's one statement or SQLite's
# transaction (fast), the plain Core path, and an all-or-nothing batch.
PATHS = {
    "fast": {},
    "core": {"fast": False},
    "all-or-nothing": {"all_or_nothing": True},
}


@pytest.mark.parametrize("path", PATHS)
def test_positions_commit_with_the_batchs_events(make_app, path):
    app = make_app(_config(forwards=True))
    with app.app_context():
        assert inbox.stored_positions(SOURCE) == {}
        moved = [at(0, 3), at(1, 12), at(0, 2, topic="refunds")]
        outcomes = inbox.receive_many(
            [message("k1"), message("k2")], positions=moved, **PATHS[path]
        )
        assert all(isinstance(o, inbox.Accepted) for o in outcomes)
        assert inbox.stored_positions(SOURCE) == {
            ("orders", 0): 3,
            ("orders", 1): 12,
            ("refunds", 0): 2,
        }
        # Another source's positions are its own.
        assert inbox.stored_positions("payments") == {}
        row = db.session.scalars(select(BrokerPosition).where(BrokerPosition.partition == 1)).one()
        assert (row.source, row.topic, row.next_offset) == (SOURCE, "orders", 12)
        assert row.updated_at.tzinfo is not None


@pytest.mark.parametrize("path", PATHS)
def test_a_batch_that_fails_mid_batch_writes_no_position(make_app, path):
    # The outbox insert fails after the events are written: nothing commits.
    app = make_app(_config(forwards=True))
    with app.app_context():
        inbox.receive_many([message("k0")], positions=[at(0, 1)])
        with _failing("deliveries"):
            with pytest.raises(DBAPIError, match="injected failure on deliveries"):
                inbox.receive_many(
                    [message("k1"), message("k2")], positions=[at(0, 3)], **PATHS[path]
                )
        assert inbox.stored_positions(SOURCE) == {("orders", 0): 1}
        assert _count(Event) == 1


@pytest.mark.parametrize("path", PATHS)
def test_a_position_the_database_refuses_leaves_no_event(make_app, path):
    # The other way round: the positions are in the events' transaction (on
    # PostgreSQL's fast path, its one statement).
    app = make_app(_config(forwards=True))
    with app.app_context():
        with _failing("broker_positions"):
            with pytest.raises(DBAPIError, match="injected failure on broker_positions"):
                inbox.receive_many(
                    [message("k1"), message("k2")], positions=[at(0, 3)], **PATHS[path]
                )
        assert _count(Event) == 0
        assert inbox.stored_positions(SOURCE) == {}


def test_a_batch_of_duplicates_writes_its_positions(make_app):
    # Twice over: the second run of redeliveries is read first on SQLite,
    # outside any transaction, and its positions are then its one transaction.
    app = make_app(_config())
    with app.app_context():
        batch = [message(f"k{n}") for n in range(4)]
        stored = inbox.receive_many(batch, positions=[at(0, 4)])
        again = [inbox.Duplicate(o.event_id) for o in stored]
        assert inbox.receive_many(batch, positions=[at(0, 8)]) == again
        assert inbox.stored_positions(SOURCE) == {("orders", 0): 8}
        assert inbox.receive_many(batch, positions=[at(0, 12)]) == again
        assert inbox.stored_positions(SOURCE) == {("orders", 0): 12}
        # Repeated inside the batch too: still duplicates only.
        assert inbox.receive_many([*batch, batch[0]], positions=[at(0, 17)]) == [
            *again,
            again[0],
        ]
        assert inbox.stored_positions(SOURCE) == {("orders", 0): 17}
        assert _count(Event) == 4


def test_an_empty_batch_writes_its_positions(make_app):
    # A batch of poison records only: nothing to store, the offset moves on.
    app = make_app(_config())
    with app.app_context():
        assert inbox.receive_many([], positions=[at(0, 5), at(3, 1)]) == []
        assert inbox.stored_positions(SOURCE) == {("orders", 0): 5, ("orders", 3): 1}
        assert inbox.receive_many([]) == []
        assert _count(Event) == 0


def test_a_position_is_overwritten_even_backwards(make_app):
    app = make_app(_config())
    with app.app_context():
        inbox.receive_many([message("k1")], positions=[at(0, 100), at(1, 7)])
        # A consumer that seeks back on purpose; and the last of one partition's wins.
        inbox.receive_many([message("k2")], positions=[at(0, 40), at(0, 50)])
        assert inbox.stored_positions(SOURCE) == {("orders", 0): 50, ("orders", 1): 7}
        assert _count(BrokerPosition) == 2


@pytest.mark.parametrize("fail", [False, True], ids=["kept", "keeping-fails"])
def test_a_batch_with_a_conflict_moves_its_positions_with_the_conflict(make_app, fail):
    # On PostgreSQL the events commit in the batch's statement and the
    # conflict in a second transaction: the positions go with the second,
    # so that a consumer resuming from them never skips a conflict not kept.
    app = make_app(_config())
    with app.app_context():
        stored = inbox.receive(message("stored"))
        assert isinstance(stored, inbox.Accepted)
        batch = [message("new"), message("stored", fingerprint="c" * 64, body=b"changed")]
        if fail:
            with _failing("event_conflicts"):
                with pytest.raises(DBAPIError, match="injected failure on event_conflicts"):
                    inbox.receive_many(batch, positions=[at(0, 2)])
            assert inbox.stored_positions(SOURCE) == {}
            assert _count(EventConflict) == 0
        outcomes = inbox.receive_many(batch, positions=[at(0, 2)])
        assert outcomes[1] == inbox.Conflict(stored.event_id)
        assert inbox.stored_positions(SOURCE) == {("orders", 0): 2}
        assert _count(EventConflict) == 1
        # A key repeated with other bytes inside the batch: a conflict too.
        repeated = [message("again"), message("again", fingerprint="d" * 64, body=b"other")]
        new, conflict = inbox.receive_many(repeated, positions=[at(0, 4)])
        assert isinstance(new, inbox.Accepted)
        assert conflict == inbox.Conflict(new.event_id)
        assert inbox.stored_positions(SOURCE) == {("orders", 0): 4}


def test_positions_when_a_batch_is_stored_one_message_at_a_time(make_app):
    # The database refuses one message: the batch fails whole, its messages
    # are stored one by one, and its positions are written once after the
    # last one, in a transaction of their own (here the last is refused).
    app = make_app(_config())
    upserts: list[str] = []

    def watch(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if "broker_positions" in statement:
            upserts.append(statement)

    with app.app_context():
        keys = [f"k{n}" for n in range(4)]
        messages = [message(key) for key in keys]
        prepared = broker_batch.Prepared(messages, [None] * 4)
        event.listen(db.engine, "before_cursor_execute", watch)
        try:
            with _failing("events", "NEW.dedup_key = 'k3'"):
                verdicts = broker_batch.store(
                    RABBIT_SOURCE, prepared, positions=[at(0, 4), at(1, 9)]
                )
        finally:
            event.remove(db.engine, "before_cursor_execute", watch)
        assert [v.action for v in verdicts] == ["ack", "ack", "ack", "dead_letter"]
        assert verdicts[3].reason == "unstorable"
        assert inbox.stored_positions(SOURCE) == {("orders", 0): 4, ("orders", 1): 9}
        assert len(upserts) == 1
        assert _count(Event) == 3


def test_poison_records_only_move_the_position_through_the_broker_store(make_app):
    app = make_app(_config())
    with app.app_context():
        poison = broker_batch.Verdict("dead_letter", "payload-invalid", "not JSON")
        prepared = broker_batch.Prepared([], [poison, poison])
        verdicts = broker_batch.store(RABBIT_SOURCE, prepared, positions=[at(2, 30)])
        assert verdicts == [poison, poison]
        assert inbox.stored_positions(SOURCE) == {("orders", 2): 30}


def test_positions_are_not_purged(make_app):
    # Positions are no events: the purge leaves them, however old.
    app = make_app(_config(), DEFAULT_RETENTION_DAYS=1)
    with app.app_context():
        old = WHEN - timedelta(days=400)
        inbox.receive_many([message("old", received_at=old)], positions=[at(0, 1)])
        report = purge(datetime.now(UTC), 100)
        assert report.events == 1
        assert _count(Event) == 0
        assert inbox.stored_positions(SOURCE) == {("orders", 0): 1}
    result = app.test_cli_runner().invoke(args=["purge"])
    assert result.exit_code == 0, result.output
    with app.app_context():
        assert inbox.stored_positions(SOURCE) == {("orders", 0): 1}
