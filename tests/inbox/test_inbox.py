"""The inbox: fast paths against the plain Core path, atomicity, batches, races.

Every test runs on SQLite and PostgreSQL (the ``make_app`` fixture's
database). The failures injected (into the outbox insert, into the
conflict record) are real triggers on their tables, so the statement fails
inside the database, where a crash between the writes would.
"""

from __future__ import annotations

import functools
import json
import logging
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import func, insert, select, text
from sqlalchemy.exc import DBAPIError

from webhook_receiver import database, inbox
from webhook_receiver.database_driver import DriverStatement, FastPathError
from webhook_receiver.extensions import db
from webhook_receiver.inbox import logs, statements, tables
from webhook_receiver.models import Delivery, Event, EventConflict

from ..conftest import CLIENTS
from ..helpers import waited_on_a_lock
from ..rows import event_row
from ..webhooks.signing import hmac_hex

WHEN = datetime(2026, 12, 3, 8, 30, 15, 123456, tzinfo=UTC)


def _config(*, forwards: bool) -> dict[str, Any]:
    shop: dict[str, Any] = {
        "provider": "generic",
        "secrets": ["shop-secret-0123456789"],
        "signature_header": "X-Signature",
    }
    if forwards:
        shop["forward"] = [
            {"name": "billing", "url": "http://127.0.0.1:9/billing"},
            {"name": "audit", "url": "http://127.0.0.1:9/audit"},
        ]
    return {"clients": CLIENTS, "sources": {"shop": shop}}


def message(key: str, **fields: Any) -> inbox.Message:
    """A message of source ``shop`` with every column type filled, unless told otherwise."""
    values: dict[str, Any] = {
        "source": "shop",
        "dedup_key": key,
        "fingerprint": "a" * 64,
        # Not UTF-8, with a NUL: bytes must come back as they went in.
        "body": b"\xff\x00binary\x80",
        "event_type": "order.paid",
        "content_type": "application/octet-stream",
        "headers": (("X-Trace", "t-1"), ("X-Signature", "[redacted]"), ("Accept", "é")),
        "meta": {"nested": {"list": [1, 2.5, None, True, "ü"]}, "empty": {}},
        "correlation_id": "corr-1",
        "client": None,
        "received_at": WHEN,
    }
    values.update(fields)
    return inbox.Message(**values)


def _event_row(event_id: int) -> dict[str, Any]:
    row = db.session.get(Event, event_id)
    assert row is not None
    return {c.name: getattr(row, c.name) for c in Event.__table__.columns}


def _delivery_rows(event_id: int) -> list[dict[str, Any]]:
    rows = db.session.scalars(
        select(Delivery).where(Delivery.event_id == event_id).order_by(Delivery.consumer)
    ).all()
    return [{c.name: getattr(r, c.name) for c in Delivery.__table__.columns} for r in rows]


def _count(model: Any) -> int:
    db.session.rollback()  # a fresh snapshot: what is committed now
    try:
        return db.session.scalar(select(func.count()).select_from(model)) or 0
    finally:
        # End the read: on PostgreSQL its lock on the table would hold up the
        # DDL that drops the injected failure (on another connection) for ever.
        db.session.rollback()


@pytest.mark.parametrize("forwards", [False, True], ids=["alone", "with-deliveries"])
@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"event_type": None, "content_type": None, "correlation_id": None, "meta": {}},
        {"headers": (), "body": b"", "client": "acme", "received_at": WHEN + timedelta(days=400)},
    ],
    ids=["every-column", "nulls", "empty"],
)
def test_the_fast_path_stores_what_the_core_path_stores(make_app, forwards, fields):
    app = make_app(_config(forwards=forwards))
    with app.app_context():
        fast = inbox.receive(message("fast", **fields))
        core = inbox.receive(message("core", **fields), fast=False)
        assert isinstance(fast, inbox.Accepted) and isinstance(core, inbox.Accepted)
        db.session.expire_all()
        fast_row, core_row = _event_row(fast.event_id), _event_row(core.event_id)
        for row in (fast_row, core_row):
            del row["id"], row["dedup_key"]
        assert fast_row == core_row
        # And both equal what was sent, read back through the ORM.
        sent = message("x", **fields)
        assert core_row["body"] == sent.body
        assert core_row["headers"] == [list(pair) for pair in sent.headers]
        assert core_row["meta"] == dict(sent.meta)
        assert core_row["received_at"] == sent.received_at
        assert core_row["received_at"].tzinfo is not None
        fast_deliveries = _delivery_rows(fast.event_id)
        core_deliveries = _delivery_rows(core.event_id)
        assert len(fast_deliveries) == (2 if forwards else 0)
        for rows in (fast_deliveries, core_deliveries):
            for row in rows:
                del row["id"], row["event_id"]
        assert fast_deliveries == core_deliveries


def test_fast_and_core_paths_agree_on_duplicates_and_conflicts(make_app):
    app = make_app(_config(forwards=True))
    with app.app_context():
        first = inbox.receive(message("k"))
        assert isinstance(first, inbox.Accepted)
        for fast in (True, False):
            assert inbox.receive(message("k"), fast=fast) == inbox.Duplicate(first.event_id)
            other = message("k", fingerprint="b" * 64, body=b"other")
            assert inbox.receive(other, fast=fast) == inbox.Conflict(first.event_id)
        kept = db.session.scalars(select(EventConflict)).all()
        # One record per distinct content; the repeat only counts.
        assert [(c.event_id, c.body, c.seen_count) for c in kept] == [(first.event_id, b"other", 2)]
        assert _count(Event) == 1
        assert _count(Delivery) == 2


def test_a_statement_needing_sqlalchemys_execution_is_refused_clearly(make_app):
    app = make_app()
    with app.app_context():
        dialect = db.engine.dialect
        expanding = select(Event.id).where(Event.id.in_([1, 2]))
        with pytest.raises(FastPathError, match="expanding IN"):
            DriverStatement(expanding, dialect)


def test_statements_are_built_per_engine(make_app, tmp_path):
    app = make_app()
    other = make_app(SQLALCHEMY_DATABASE_URI=f"sqlite:///{tmp_path / 'other.sqlite3'}")
    with app.app_context():
        mine = statements.for_engine(db.engine)
        assert statements.for_engine(db.engine) is mine
    with other.app_context():
        theirs = statements.for_engine(db.engine)
        assert theirs.dialect_name == "sqlite"
    assert theirs is not mine


def _fail_inserts(table: str = "deliveries") -> None:
    """Make every INSERT into ``table`` (the outbox by default) fail inside the database."""
    failure = f"injected failure on {table}"
    if db.engine.dialect.name == "sqlite":
        ddl = [
            f"CREATE TRIGGER fail_insert BEFORE INSERT ON {table} "
            f"BEGIN SELECT RAISE(ABORT, '{failure}'); END"
        ]
    else:
        ddl = [
            "CREATE FUNCTION fail_insert() RETURNS trigger LANGUAGE plpgsql AS "
            f"$$ BEGIN RAISE EXCEPTION '{failure}'; END $$",
            f"CREATE TRIGGER fail_insert BEFORE INSERT ON {table} "
            "FOR EACH ROW EXECUTE FUNCTION fail_insert()",
        ]
    db.session.rollback()
    with db.engine.begin() as conn:
        for statement in ddl:
            conn.execute(text(statement))


def _drop_failure(table: str = "deliveries") -> None:
    # The session's read holds a lock on the tables that DROP TRIGGER would wait for.
    db.session.rollback()
    with db.engine.begin() as conn:
        conn.execute(text("DROP TRIGGER fail_insert" + ("" if _sqlite() else f" ON {table}")))
        if not _sqlite():
            conn.execute(text("DROP FUNCTION fail_insert()"))


def _sqlite() -> bool:
    return db.engine.dialect.name == "sqlite"


@pytest.mark.parametrize("path", ["fast", "core", "batch"])
def test_a_failed_outbox_insert_leaves_no_event_behind(make_app, path):
    app = make_app(_config(forwards=True))
    with app.app_context():
        _fail_inserts()
        try:
            with pytest.raises(DBAPIError, match="injected failure on deliveries"):
                if path == "batch":
                    inbox.receive_many([message("k1"), message("k2")])
                else:
                    inbox.receive(message("k1"), fast=path == "fast")
            assert _count(Event) == 0
            assert _count(Delivery) == 0
        finally:
            _drop_failure()
        # The retry after the failure stores the event with its deliveries.
        assert isinstance(inbox.receive(message("k1")), inbox.Accepted)
        assert (_count(Event), _count(Delivery)) == (1, 2)


def test_the_webhook_receipt_stores_nothing_when_its_outbox_insert_fails(make_app):
    app = make_app(_config(forwards=True))
    client = app.test_client()
    body = b'{"id": "evt-1"}'
    headers = {
        "Content-Type": "application/json",
        "Idempotency-Key": "evt-1",
        "X-Signature": hmac_hex(body, "shop-secret-0123456789"),
    }
    with app.app_context():
        _fail_inserts()
    try:
        response = client.post("/webhooks/shop", data=body, headers=headers)
        assert response.status_code >= 500
        with app.app_context():
            assert _count(Event) == 0
    finally:
        with app.app_context():
            _drop_failure()
    response = client.post("/webhooks/shop", data=body, headers=headers)
    assert response.status_code == 200, response.get_data(as_text=True)
    with app.app_context():
        assert (_count(Event), _count(Delivery)) == (1, 2)


def test_a_batch_settles_each_message_in_one_transaction(make_app):
    app = make_app(_config(forwards=True))
    with app.app_context():
        stored = inbox.receive(message("stored"))
        assert isinstance(stored, inbox.Accepted)
        batch = [
            message("new-1"),
            message("stored"),  # a duplicate of a stored event
            message("new-2"),
            message("new-1"),  # a duplicate inside the batch
            message("stored", fingerprint="c" * 64, body=b"changed"),  # a conflict
            message("new-2", fingerprint="d" * 64, body=b"changed"),  # conflict in the batch
        ]
        outcomes = inbox.receive_many(batch)
        new_1, new_2 = outcomes[0], outcomes[2]
        assert isinstance(new_1, inbox.Accepted) and isinstance(new_2, inbox.Accepted)
        assert outcomes == [
            new_1,
            inbox.Duplicate(stored.event_id),
            new_2,
            inbox.Duplicate(new_1.event_id),
            inbox.Conflict(stored.event_id),
            inbox.Conflict(new_2.event_id),
        ]
        db.session.expire_all()
        assert _count(Event) == 3
        assert _count(Delivery) == 6
        kept = {(c.event_id, c.body) for c in db.session.scalars(select(EventConflict))}
        assert kept == {(stored.event_id, b"changed"), (new_2.event_id, b"changed")}
        # The redeliveries are counted (written at once under the tests' settings).
        counts = dict(db.session.execute(select(Event.id, Event.duplicate_count)).all())
        assert counts[stored.event_id] == 1
        assert counts[new_1.event_id] == 1
        assert inbox.receive_many([]) == []


def _by_content(body: bytes, event_type: str | None, content_type: str | None) -> str:
    # A content fingerprint as a broker source's: JSON compared once parsed.
    return f"{event_type}:{json.dumps(json.loads(body), sort_keys=True, separators=(',', ':'))}"


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "core"])
def test_other_bytes_with_a_content_fingerprint_are_compared_by_content(make_app, fast):
    # A broker's fingerprints cover the bytes as sent: bytes that differ are
    # compared again by their content before they are called a conflict,
    # whether the key's event was stored before the batch or in it.
    app = make_app(_config(forwards=False))
    json_message = functools.partial(message, content_type="application/json")
    with app.app_context():
        stored = inbox.receive(json_message("stored", body=b'{"a": 1, "b": 2}'))
        assert isinstance(stored, inbox.Accepted)
        batch = [
            json_message("stored", fingerprint="b" * 64, body=b'{"b":2,"a":1}'),
            json_message("new", fingerprint="c" * 64, body=b'{"x": [1, 2]}'),
            json_message("new", fingerprint="d" * 64, body=b'{ "x" : [1,2] }'),
            json_message("stored", fingerprint="e" * 64, body=b'{"a": 1, "b": 3}'),
            json_message("new", fingerprint="f" * 64, body=b'{"x": [2, 1]}'),
        ]
        outcomes = inbox.receive_many(batch, content_fingerprint=_by_content, fast=fast)
        new = outcomes[1]
        assert isinstance(new, inbox.Accepted)
        assert outcomes == [
            inbox.Duplicate(stored.event_id),
            new,
            inbox.Duplicate(new.event_id),
            inbox.Conflict(stored.event_id),
            inbox.Conflict(new.event_id),
        ]
        # Without it, other bytes are other content, as before.
        again = inbox.receive_many(batch[:1])
        assert again == [inbox.Conflict(stored.event_id)]
        db.session.rollback()
        kept = db.session.execute(
            select(EventConflict.event_id, EventConflict.fingerprint, EventConflict.body)
        ).all()
        # Kept under the content's fingerprint: a copy serialised otherwise is the same conflict.
        assert sorted(kept) == sorted(
            [
                (stored.event_id, 'order.paid:{"a":1,"b":3}', b'{"a": 1, "b": 3}'),
                (new.event_id, 'order.paid:{"x":[2,1]}', b'{"x": [2, 1]}'),
                (stored.event_id, "b" * 64, b'{"b":2,"a":1}'),
            ]
        )
        copy = json_message("stored", fingerprint="g" * 64, body=b'{"b":3,"a":1}')
        assert inbox.receive_many([copy], content_fingerprint=_by_content, fast=fast) == [
            inbox.Conflict(stored.event_id)
        ]
        db.session.rollback()
        seen = db.session.scalar(
            select(EventConflict.seen_count).where(
                EventConflict.fingerprint == 'order.paid:{"a":1,"b":3}'
            )
        )
        assert seen == 2
        assert _count(Event) == 2


def test_a_batch_of_redeliveries_waits_for_no_writer(make_app, monkeypatch):
    # Another writer holds its transaction open: SQLite's write lock (after
    # a batch whose keys were all taken, the next one's are read first,
    # outside any transaction: all taken, it writes nothing), or on
    # PostgreSQL an uncommitted event, whose row lock no other key waits
    # for. A batch with a new key needs SQLite's lock, and meets it.
    monkeypatch.setattr(database, "SQLITE_BUSY_TIMEOUT_MS", 300)
    # The redeliveries' ledger writes later, as it does by default.
    app = make_app(_config(forwards=False), DUPLICATE_FLUSH_SECONDS=3600)
    with app.app_context():
        batch = [message(f"k-{n}") for n in range(5)]
        stored = inbox.receive_many(batch)
        again = [inbox.Duplicate(outcome.event_id) for outcome in stored]
        assert inbox.receive_many(batch) == again
        with _another_writer():
            assert inbox.receive_many(batch) == again
            if _sqlite():
                with pytest.raises(DBAPIError, match="locked"):
                    inbox.receive_many([*batch, message("k-new")])
        *duplicates, new = inbox.receive_many([*batch, message("k-new")])
        assert duplicates == again and isinstance(new, inbox.Accepted)
        # A conflict found by the read is compared and kept as ever.
        changed = message("k-0", fingerprint="c" * 64, body=b"changed")
        assert inbox.receive_many(batch) == again
        assert inbox.receive_many([changed]) == [inbox.Conflict(stored[0].event_id)]
        assert _count(EventConflict) == 1
        assert _count(Event) == 6


@contextmanager
def _another_writer() -> Iterator[None]:
    """Another process's open write transaction: SQLite's write lock, or a PostgreSQL event."""
    if _sqlite():
        holder = sqlite3.connect(db.engine.url.database, isolation_level=None)
        try:
            holder.execute("BEGIN IMMEDIATE")
            yield
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        return
    with db.engine.connect() as other:
        other.execute(insert(Event), event_row(source="shop", dedup_key="held-open"))
        yield
        other.rollback()


def test_a_batch_whose_conflict_could_not_be_kept_settles_all_of_it_when_sent_again(make_app):
    # receive_many raises, so a consumer settles nothing and the broker sends
    # the batch again. On PostgreSQL the batch's one statement committed its
    # new event before the conflict's own transaction failed; on SQLite it is
    # all one transaction. Either way the batch sent again gets every outcome
    # right and the conflict is kept.
    app = make_app(_config(forwards=True))
    with app.app_context():
        stored = inbox.receive(message("stored"))
        assert isinstance(stored, inbox.Accepted)
        batch = [message("new"), message("stored", fingerprint="c" * 64, body=b"changed")]
        _fail_inserts("event_conflicts")
        try:
            with pytest.raises(DBAPIError, match="injected failure on event_conflicts"):
                inbox.receive_many(batch)
            assert _count(EventConflict) == 0
            assert _count(Event) == (1 if _sqlite() else 2)
        finally:
            _drop_failure("event_conflicts")
        new, conflict = inbox.receive_many(batch)
        assert isinstance(new, inbox.Accepted if _sqlite() else inbox.Duplicate)
        assert conflict == inbox.Conflict(stored.event_id)
        assert _count(EventConflict) == 1
        assert (_count(Event), _count(Delivery)) == (2, 4)


def test_a_batch_and_a_single_receipt_racing_for_one_key_store_one_event(make_app):
    app = make_app(_config(forwards=True))
    rounds = 25
    results: dict[str, list[Any]] = {"single": [], "batch": []}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def single() -> None:
        try:
            with app.app_context():
                for n in range(rounds):
                    start.wait()
                    results["single"].append(inbox.receive(message(f"race-{n}")))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            start.abort()

    def batch() -> None:
        try:
            with app.app_context():
                for n in range(rounds):
                    start.wait()
                    batch = [message(f"other-{n}-{i}") for i in range(5)] + [message(f"race-{n}")]
                    results["batch"].append(inbox.receive_many(batch)[-1])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            start.abort()

    threads = [threading.Thread(target=single), threading.Thread(target=batch)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    with app.app_context():
        assert _count(Event) == rounds * 6
        assert _count(Delivery) == rounds * 6 * 2
    for n in range(rounds):
        pair = {type(results["single"][n]), type(results["batch"][n])}
        assert pair == {inbox.Accepted, inbox.Duplicate}
        assert results["single"][n].event_id == results["batch"][n].event_id


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"event_type": None, "content_type": None, "correlation_id": None, "meta": {}},
        {"headers": (), "body": b"", "client": "acme"},
        {
            # Escapes and characters beyond the BMP survive the JSON the
            # batch is sent as; a time in another zone is stored as UTC.
            "event_type": "type.\u00fc\U0001f600",
            "headers": (("X-Quote", 'a"b\\c\n\u2028'),),
            "meta": {"big": 2**63 - 1, "tiny": 1e-300, "emoji": "\U0001f600", "nested": [[{}]]},
            "received_at": WHEN.astimezone(timezone(timedelta(hours=5, minutes=30))),
        },
        # What orjson refuses (the batch's serialiser on PostgreSQL) is
        # serialised by json, as the Core path does.
        {"meta": {"huge": 2**70, 7: "a key that is not a string"}},
    ],
    ids=["every-column", "nulls", "empty", "escapes", "beyond-orjson"],
)
def test_a_batch_on_the_fast_path_stores_what_the_core_path_stores(make_app, fields):
    app = make_app(_config(forwards=True))
    with app.app_context():
        # Keys beyond ASCII, with a quote and a backslash: read back through JSON on SQLite.
        fast = inbox.receive_many([message(f'fast-{n}-ü"\\🙂', **fields) for n in range(3)])
        core = inbox.receive_many(
            [message(f'core-{n}-ü"\\🙂', **fields) for n in range(3)], fast=False
        )
        db.session.expire_all()
        for f, c in zip(fast, core, strict=True):
            fast_row, core_row = _event_row(f.event_id), _event_row(c.event_id)
            for row in (fast_row, core_row):
                del row["id"], row["dedup_key"]
            assert fast_row == core_row
            assert fast_row["body"] == message("x", **fields).body
            fast_deliveries, core_deliveries = (
                _delivery_rows(f.event_id),
                _delivery_rows(c.event_id),
            )
            for rows in (fast_deliveries, core_deliveries):
                for row in rows:
                    del row["id"], row["event_id"]
            assert fast_deliveries == core_deliveries
            assert len(fast_deliveries) == 2
        # Taken keys are read back the same way on both paths.
        for fast_path in (True, False):
            again = inbox.receive_many(
                [message('fast-1-ü"\\🙂', **fields), message('core-2-ü"\\🙂', **fields)],
                fast=fast_path,
            )
            assert again == [inbox.Duplicate(fast[1].event_id), inbox.Duplicate(core[2].event_id)]


def test_a_batch_names_each_message_at_info_and_logs_conflicts_whatever_the_level(make_app, caplog):
    app = make_app(_config(forwards=False))
    with app.app_context():
        first = inbox.receive_many([message("k1")])[0]
        batch = [message("k2"), message("k1"), message("k1", fingerprint="e" * 64)]
        caplog.clear()  # the first batch's line, had another test set the level already
        with caplog.at_level(logging.INFO, logger="webhook_receiver.inbox"):
            outcomes = inbox.receive_many(batch)
        conflict, line = caplog.records
        assert (conflict.levelname, conflict.outcome, conflict.dedup_key) == (
            "ERROR",
            "conflict",
            "k1",
        )
        assert (line.levelname, line.outcome, line.source) == ("INFO", "batch", "shop")
        assert line.getMessage() == "batch stored: 1 accepted, 1 duplicates, 1 conflicts"
        assert line.messages == [
            {
                "dedup_key": "k2",
                "event_id": outcomes[0].event_id,
                "outcome": "accepted",
                "correlation_id": "corr-1",
            },
            {
                "dedup_key": "k1",
                "event_id": first.event_id,
                "outcome": "duplicate",
                "correlation_id": "corr-1",
            },
            {
                "dedup_key": "k1",
                "event_id": first.event_id,
                "outcome": "conflict",
                "correlation_id": "corr-1",
            },
        ]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="webhook_receiver.inbox"):
            inbox.receive_many([message("k3"), *batch])
        assert [r.outcome for r in caplog.records] == ["conflict"]


def test_a_large_batch_is_logged_in_lines_of_a_few_kilobytes_per_source(make_app, caplog):
    app = make_app(_config(forwards=False))
    per_line = logs.LOGGED_PER_LINE
    shop = [message(f"s{i}", correlation_id=None) for i in range(per_line * 2 + 3)]
    other = [message("o1", source="other"), message("o2", source="other")]
    with app.app_context(), caplog.at_level(logging.INFO, logger="webhook_receiver.inbox"):
        inbox.receive_many([*shop[:10], *other, *shop[10:]])
    lines = [(r.source, [m["dedup_key"] for m in r.messages]) for r in caplog.records]
    keys = [m.dedup_key for m in shop]
    assert lines == [
        ("shop", keys[:per_line]),
        ("shop", keys[per_line : 2 * per_line]),
        ("shop", keys[2 * per_line :]),
        ("other", ["o1", "o2"]),
    ]
    # A message without a correlation id has none in its entry.
    assert "correlation_id" not in caplog.records[0].messages[0]
    assert "correlation_id" in caplog.records[-1].messages[0]


def test_a_batch_settles_a_key_committed_by_another_while_its_statement_waited(make_app):
    # The batch's statement reads the taken keys in its snapshot; a copy
    # committed after that, while the insert waited on its row, is read
    # back afterwards (PostgreSQL's one-statement batch).
    app = make_app(_config(forwards=True))
    with app.app_context():
        if _sqlite():
            pytest.skip("SQLite has no lock per key: a writer waits for the database")
        racing = inbox.add(message("race"))  # in this session's transaction: not committed
        assert racing is not None
        outcomes: list[Any] = []

        def batch() -> None:
            with app.app_context():
                outcomes.extend(inbox.receive_many([message("new"), message("race")]))

        thread = threading.Thread(target=batch)
        thread.start()
        waited = waited_on_a_lock(db.engine, thread)  # until the batch waits on the row
        db.session.commit()
        thread.join(30)
        assert waited and not thread.is_alive()
        new = outcomes[0]
        assert isinstance(new, inbox.Accepted)
        assert outcomes == [new, inbox.Duplicate(racing)]
        assert (_count(Event), _count(Delivery)) == (2, 4)


# SQLite's own limit: PostgreSQL sends a batch as one JSON parameter, whatever its size.
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_batch_larger_than_one_statement_is_stored_in_chunks(make_app):
    # SQLite binds at most 32,766 parameters in a statement: a batch is
    # inserted a chunk of rows at a time (made small here), in one transaction.
    app = make_app(_config(forwards=True))
    with app.app_context():
        batch = statements.for_engine(db.engine).sqlite_batch
        batch.chunk = 3
        try:
            first = inbox.receive_many([message(f"c-{n}") for n in range(4)])
            again = inbox.receive_many([message(f"c-{n}") for n in range(2, 9)] + [message("c-8")])
        finally:
            batch.chunk = batch.MAX_PARAMETERS // len(tables.EVENT_COLUMNS)
        assert all(isinstance(o, inbox.Accepted) for o in first)
        assert again[:2] == [inbox.Duplicate(first[2].event_id), inbox.Duplicate(first[3].event_id)]
        assert all(isinstance(o, inbox.Accepted) for o in again[2:7])
        assert again[7] == inbox.Duplicate(again[6].event_id)
        ids = [o.event_id for o in first + again[2:7]]
        assert len(set(ids)) == 9
        assert _count(Event) == 9
        assert _count(Delivery) == 9 * 2


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_sqlite_batch_past_the_largest_rowid_is_stored_through_core(make_app):
    # SQLite's batch reads its new events back by id, the ids after the
    # largest; at 2**63 - 1 SQLite picks others at random, and the batch is
    # stored again through Core's RETURNING.
    app = make_app(_config(forwards=True))
    with app.app_context():
        db.session.execute(
            insert(Event).values(
                event_row(id=2**63 - 1, source="elsewhere", dedup_key="last", received_at=WHEN)
            )
        )
        db.session.commit()
        outcomes = inbox.receive_many([message(f"past-{n}") for n in range(5)])
        assert all(isinstance(o, inbox.Accepted) for o in outcomes)
        rows = db.session.execute(
            select(Event.id, Event.dedup_key).where(Event.source == message("x").source)
        ).all()
        assert {key: event_id for event_id, key in rows} == {
            f"past-{n}": o.event_id for n, o in enumerate(outcomes)
        }
        assert _count(Delivery) == 5 * 2
