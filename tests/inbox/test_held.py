"""``inbox.holding``: a new event held back, then written with the caller's record in one statement.

On PostgreSQL the Idempotency-Key API's unit of work (the view's event,
the key's record and its saved answer) is one autocommitted statement:
``inbox.add`` reserves the event's id and holds the event, and
``api.event_records.EventRecords`` writes both (``inbox.GuardedReceipt``
with the record's upsert as its guard). The transaction path (the event
in the session's transaction, then ``records.save_in_transaction``) is
the reference, and the path a view that writes more than its one event
takes. On SQLite nothing is held: ``add`` writes at once, in the writers'
turn. Both databases, as every inbox test.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from flask import Flask, g, jsonify
from sqlalchemy import func, insert, select, text
from sqlalchemy.exc import DBAPIError

from webhook_receiver import inbox
from webhook_receiver.api.auth import require_client
from webhook_receiver.api.event_records import EventRecords
from webhook_receiver.database import unit_of_work
from webhook_receiver.extensions import db
from webhook_receiver.idempotency import idempotent
from webhook_receiver.idempotency.persistence import records
from webhook_receiver.inbox import held as held_events
from webhook_receiver.models import Delivery, Event, IdempotencyRecord
from webhook_receiver.problems import Problem

from ..conftest import bearer
from ..rows import event_row
from .test_inbox import (
    _config,
    _count,
    _delivery_rows,
    _drop_failure,
    _event_row,
    _fail_inserts,
    message,
)

NOW = datetime(2026, 12, 4, 9, 0, 0, 250000, tzinfo=UTC)
TTL = timedelta(hours=24)
EVENT = {"type": "order.created", "data": {"order": 42}}
ANSWER = (201, [["Content-Type", "application/json"], ["Location", "/x/1"]], b'{"id":1}\n')


def _request(key: str) -> records.Request:
    return records.Request(
        client="acme", key=key, fingerprint="f" * 64, method="POST", path="/api/events"
    )


def _save(unit: Any, key: str) -> bool:
    """Save the key's answer as the one-commit decorator does, with or without a held event."""
    return unit.save(_request(key), ANSWER, NOW, TTL, 5.0)


def _record_row(key: str) -> dict[str, Any]:
    row = db.session.scalars(select(IdempotencyRecord).where(IdempotencyRecord.key == key)).one()
    values = {c.name: getattr(row, c.name) for c in IdempotencyRecord.__table__.columns}
    del values["id"], values["key"]
    return values


def _events_seen_elsewhere() -> int:
    # Counted on a connection of its own: through the session, the count
    # would begin its transaction, which writes the held events first.
    with db.engine.connect() as conn:
        return conn.scalar(select(func.count()).select_from(Event)) or 0


def _postgresql() -> bool:
    return db.engine.dialect.name == "postgresql"


@pytest.mark.parametrize("forwards", [False, True], ids=["alone", "with-deliveries"])
@pytest.mark.parametrize(
    "fields",
    [{}, {"event_type": None, "content_type": None, "correlation_id": None, "meta": {}}],
    ids=["every-column", "nulls"],
)
def test_a_held_event_is_written_with_its_record_as_the_transaction_path_writes_them(
    make_app, forwards, fields
):
    app = make_app(_config(forwards=forwards))
    with app.app_context():
        with EventRecords().transaction() as unit:
            one_statement_id = inbox.add(message("held", **fields))
            # PostgreSQL holds the event (its id reserved), SQLite writes it.
            assert len(unit.held) == (1 if _postgresql() else 0)
            if unit.held:
                assert _events_seen_elsewhere() == 0
            assert _save(unit, "key-held")
        with unit_of_work():
            reference_id = inbox.add(message("reference", **fields), fast=False)
            assert records.save_in_transaction(_request("key-ref"), ANSWER, NOW, TTL, 5.0)
        db.session.expire_all()
        assert one_statement_id is not None and reference_id is not None
        # The id the view was given is the stored event's.
        written, reference = _event_row(one_statement_id), _event_row(reference_id)
        for row in (written, reference):
            del row["id"], row["dedup_key"]
        assert written == reference
        written_deliveries = _delivery_rows(one_statement_id)
        reference_deliveries = _delivery_rows(reference_id)
        assert len(written_deliveries) == (2 if forwards else 0)
        for rows in (written_deliveries, reference_deliveries):
            for row in rows:
                del row["id"], row["event_id"]
        assert written_deliveries == reference_deliveries
        assert _record_row("key-held") == _record_row("key-ref")


def test_a_held_event_is_not_written_when_the_key_is_taken(make_app):
    app = make_app(_config(forwards=True))
    with app.app_context():
        with unit_of_work():
            assert records.save_in_transaction(_request("taken"), ANSWER, NOW, TTL, 5.0)
        with EventRecords().transaction() as unit:
            inbox.add(message("second"))
            # The key's record answers for itself: nothing of this request is written.
            assert not _save(unit, "taken")
            if not unit.held:
                db.session.rollback()  # SQLite: the decorator rolls back what add wrote
        assert (_count(Event), _count(Delivery), _count(IdempotencyRecord)) == (0, 0, 1)


def test_a_failed_outbox_insert_leaves_neither_the_event_nor_the_record(make_app):
    app = make_app(_config(forwards=True))
    with app.app_context():
        _fail_inserts()
        try:
            with pytest.raises(DBAPIError, match="injected failure on deliveries"):
                with EventRecords().transaction() as unit:
                    inbox.add(message("k1"))
                    _save(unit, "key-1")
            assert (_count(Event), _count(Delivery), _count(IdempotencyRecord)) == (0, 0, 0)
        finally:
            _drop_failure()
        with EventRecords().transaction() as unit:
            inbox.add(message("k1"))
            assert _save(unit, "key-1")
        assert (_count(Event), _count(Delivery), _count(IdempotencyRecord)) == (1, 2, 1)


def test_reserved_ids_are_taken_afresh_in_another_process(make_app, monkeypatch):
    app = make_app(_config(forwards=False))
    with app.app_context():
        if not _postgresql():
            # SQLite reserves nothing: its events are written at once.
            with inbox.holding() as held, unit_of_work():
                assert inbox.add(message("k1")) is not None
            assert held == [] and _count(Event) == 1
            return
        with inbox.holding():
            first = inbox.add(message("k1"))
            # A forked worker inherits the parent's block: it must take its
            # own (another pid stands for the fork here).
            monkeypatch.setattr(os, "getpid", lambda: -1)
            second = inbox.add(message("k2"))
        assert first is not None and second is not None
        assert second - first >= held_events._IDS_PER_BLOCK


# -- through the decorator: a view that writes more than its one event --------


def _two_events() -> Any:
    first = inbox.add(message(f"{g.client}-a", source="shop"))
    second = inbox.add(message(f"{g.client}-b", source="shop"))
    return jsonify({"ids": [first, second]}), 201


def _add_then_refuse() -> Any:
    inbox.add(message("refused", source="shop"))
    raise Problem("invalid-event", "refused after adding its event")


def _app_with_views(make_app: Any) -> Flask:
    app = make_app(_config(forwards=True))
    for rule, view in (("/test/two-events", _two_events), ("/test/refuse", _add_then_refuse)):
        app.add_url_rule(rule, view.__name__, require_client(idempotent(view)), methods=["POST"])
    return app


def test_a_view_writing_two_events_commits_both_with_its_record(make_app):
    app = _app_with_views(make_app)
    client = app.test_client()
    headers = {**bearer(), "Idempotency-Key": "two"}
    first = client.post("/test/two-events", headers=headers)
    assert first.status_code == 201, first.get_data(as_text=True)
    ids = first.get_json()["ids"]
    with app.app_context():
        # Both held events went into the session's transaction with the record.
        assert sorted(db.session.scalars(select(Event.id))) == sorted(ids)
        assert _count(Delivery) == 4 and _count(IdempotencyRecord) == 1
    replay = client.post("/test/two-events", headers=headers)
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.get_json()["ids"] == ids
    with app.app_context():
        assert _count(Event) == 2


def test_a_view_that_refuses_after_adding_keeps_its_answer_not_its_event(make_app):
    app = _app_with_views(make_app)
    client = app.test_client()
    headers = {**bearer(), "Idempotency-Key": "refused"}
    answer = client.post("/test/refuse", headers=headers)
    assert answer.status_code == 400
    with app.app_context():
        assert (_count(Event), _count(Delivery), _count(IdempotencyRecord)) == (0, 0, 1)
    replay = client.post("/test/refuse", headers=headers)
    assert replay.status_code == 400
    assert replay.headers["Idempotent-Replayed"] == "true"


def _first_api_event_on_postgresql(make_app: Any) -> tuple[Flask, Any, Any]:
    """An app on PostgreSQL (SQLite reserves no ids: skipped), its client, and a first 201."""
    app = make_app(_config(forwards=False))
    client = app.test_client()
    with app.app_context():
        if not _postgresql():
            pytest.skip("SQLite reserves no ids: its events are written at once")
    first = client.post("/api/events", json=EVENT, headers={**bearer(), "Idempotency-Key": "a"})
    assert first.status_code == 201
    return app, client, first


def test_a_reserved_id_handed_out_again_is_replaced_and_the_request_runs_again(make_app):
    app, client, first = _first_api_event_on_postgresql(make_app)
    taken = first.get_json()["id"] + 1  # the next id of this process's block
    with app.app_context():
        # The sequence went back (a restore): another writer got that id.
        db.session.execute(
            insert(Event).values(
                event_row(id=taken, source="elsewhere", dedup_key="x", received_at=NOW)
            )
        )
        db.session.commit()
    second = client.post("/api/events", json=EVENT, headers={**bearer(), "Idempotency-Key": "b"})
    assert second.status_code == 201, second.get_data(as_text=True)
    assert second.get_json()["id"] != taken
    with app.app_context():
        assert _count(Event) == 3 and _count(IdempotencyRecord) == 2


def test_ids_reserved_before_the_sequence_went_back_are_not_used(make_app):
    app, client, first = _first_api_event_on_postgresql(make_app)
    with app.app_context():
        # A restore to an empty database: the sequence starts again at 1,
        # while this process still holds the rest of its block.
        db.session.execute(text("TRUNCATE events, idempotency_records RESTART IDENTITY CASCADE"))
        db.session.commit()
    second = client.post("/api/events", json=EVENT, headers={**bearer(), "Idempotency-Key": "b"})
    assert second.status_code == 201, second.get_data(as_text=True)
    with app.app_context():
        # Writers taking ids from the sequence meet none of this process's.
        outcomes = [inbox.receive(message(f"plain-{i}")) for i in range(3)]
        assert all(isinstance(outcome, inbox.Accepted) for outcome in outcomes)
        ids = [second.get_json()["id"], *(outcome.event_id for outcome in outcomes)]
        assert len(set(ids)) == 4 and _count(Event) == 4


def _add_then_read_back() -> Any:
    event_id = inbox.add(message(f"{g.client}-read", source="shop"))
    stored = db.session.get(Event, event_id)  # the session's first use
    assert stored is not None, "the held event was not written when the session began"
    return jsonify({"id": event_id, "type": stored.event_type}), 201


def test_a_view_that_reads_its_event_back_through_the_session_finds_it(make_app):
    app = make_app(_config(forwards=True))
    app.add_url_rule(
        "/test/read-back",
        "read_back",
        require_client(idempotent(_add_then_read_back)),
        methods=["POST"],
    )
    answer = app.test_client().post("/test/read-back", headers={**bearer(), "Idempotency-Key": "r"})
    assert answer.status_code == 201, answer.get_data(as_text=True)
    assert answer.get_json()["type"] == "order.paid"
    with app.app_context():
        assert (_count(Event), _count(Delivery), _count(IdempotencyRecord)) == (1, 2, 1)


def test_a_new_api_key_is_written_by_the_dialects_path(make_app, monkeypatch):
    # PostgreSQL: one statement (GuardedReceipt.write); SQLite: the
    # transaction (save_in_transaction). The other one fails here if taken.
    app = make_app()
    with app.app_context():
        postgresql = _postgresql()

    def not_this_path(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("the other path was taken")

    if postgresql:
        monkeypatch.setattr(records, "save_in_transaction", not_this_path)
    else:
        monkeypatch.setattr(inbox.GuardedReceipt, "write", not_this_path)
    answer = app.test_client().post(
        "/api/events", json=EVENT, headers={**bearer(), "Idempotency-Key": "path"}
    )
    assert answer.status_code == 201, answer.get_data(as_text=True)
    with app.app_context():
        assert _count(Event) == 1 and _count(IdempotencyRecord) == 1
