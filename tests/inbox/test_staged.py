"""A batch staged ahead of its transaction (inbox.stage): what a consumer's reading thread builds.

A consumer stages its next batch while the one before is stored, so that
its storing thread only sends the statement. Staged, a batch must store
exactly what receive_many would have built itself, and staging must need
no database. Every test runs on SQLite and PostgreSQL.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlalchemy import select

from webhook_receiver import inbox
from webhook_receiver.brokers import batch as broker_batch
from webhook_receiver.brokers.identify import BrokerMessage
from webhook_receiver.extensions import db
from webhook_receiver.inbox import rows as inbox_rows
from webhook_receiver.models import Delivery, Event, EventConflict, utcnow

from ..helpers import RABBIT_SOURCE
from .test_positions import SOURCE, _config, at, message


def _outcome_names(outcomes: list[inbox.Outcome]) -> list[str]:
    return [type(outcome).__name__ for outcome in outcomes]


def test_a_staged_batch_is_settled_as_an_unstaged_one(make_app):
    app = make_app(_config(forwards=True))
    with app.app_context():
        inbox.receive_many([message("taken", fingerprint="b" * 64)])
        messages = [
            message("new"),
            message("taken"),  # other content under a stored key
            message("new"),  # the batch's own copy
            message("other", received_at=None),
        ]
        staged = inbox.stage(messages)
        outcomes = inbox.receive_many(messages, staged=staged, positions=[at(0, 4)])
        assert _outcome_names(outcomes) == ["Accepted", "Conflict", "Duplicate", "Accepted"]
        assert inbox.stored_positions(SOURCE) == {("orders", 0): 4}
        rows = db.session.execute(
            select(Event.dedup_key, Event.received_at).order_by(Event.id)
        ).all()
        # A message with no receipt time of its own takes the staged one.
        assert [key for key, _ in rows] == ["taken", "new", "other"]
        assert rows[2].received_at == staged.now
        # The conflict is kept for review, and each new event has its delivery.
        assert db.session.scalar(select(EventConflict.dedup_key)) == "taken"
        new_ids = [outcomes[0].event_id, outcomes[3].event_id]
        assert sorted(_deliveries_of(new_ids)) == sorted(new_ids)


def _deliveries_of(event_ids: list[int]) -> list[int]:
    found = select(Delivery.event_id).where(Delivery.event_id.in_(event_ids))
    return list(db.session.scalars(found))


def _raw(key: str) -> BrokerMessage:
    """An AMQP message as RABBIT_SOURCE reads it (its key in message_id)."""
    properties = {"message_id": key, "type": "order.created"}
    return BrokerMessage(b'{"key": "%s"}' % key.encode(), "application/json", properties=properties)


def test_staging_needs_no_database(make_app, db_url, tmp_path):
    # Built on a reading thread while another batch is stored: CPU only.
    if db_url.startswith("sqlite"):
        away = f"sqlite:///{tmp_path}/no-such-directory/db.sqlite3"
    else:
        away = "postgresql+psycopg://postgres@127.0.0.1:1/away"
    app = make_app(_config(forwards=True), SQLALCHEMY_DATABASE_URI=away)
    with app.app_context():
        before = utcnow()
        staged = inbox.stage([message("a"), message("b"), message("a")])
        assert staged.first == {(SOURCE, "a"): 0, (SOURCE, "b"): 1}
        assert staged.now >= before
        if db.engine.dialect.name == "postgresql":
            assert staged.rows is not None and '"a"' in staged.rows["events"]
        else:
            assert staged.rows is None  # SQLite builds its rows in the transaction


def test_a_batch_staged_for_other_messages_is_refused(make_app):
    app = make_app(_config())
    with app.app_context():
        staged = inbox.stage([message("a")])
        with pytest.raises(ValueError, match="another batch"):
            inbox.receive_many([message("a")], staged=staged)
        assert db.session.scalar(select(Event.id)) is None


def test_a_batch_whose_staging_fails_is_stored_all_the_same(make_app, db_url):
    # A bug met by one message while its batch is staged (here its routes,
    # which PostgreSQL's rows are built with) must not stop the consumer:
    # the batch goes unstaged, its storing thread meets the same failure
    # (on SQLite, first there) and stores the others one by one, and that
    # message alone is dead-lettered.
    app = make_app(_config())
    routes = app.extensions[inbox_rows.EXTENSION]

    def failing_routes(source: str, event_type: str | None, body: bytes) -> Any:
        if b'"bad"' in body:
            raise RuntimeError("a bug while routing")
        return routes(source, event_type, body)

    app.extensions[inbox_rows.EXTENSION] = failing_routes
    consumer = broker_batch.Consumer(app, RABBIT_SOURCE, threading.Event())
    prepared = consumer.prepare_batch([_raw("k1"), _raw("bad"), _raw("k2")], lambda raw: raw)
    # SQLite stages no rows: nothing of it is routed before the transaction.
    assert (prepared.staged is None) == db_url.startswith("postgresql")
    verdicts = consumer.store_prepared(prepared)
    assert [v.action for v in verdicts] == ["ack", "dead_letter", "ack"]
    assert verdicts[1].reason == "consumer-error"
    with app.app_context():
        keys = db.session.scalars(select(Event.dedup_key).order_by(Event.id)).all()
        assert keys == ["k1", "k2"]


def test_a_consumer_stages_its_batches(make_app):
    app = make_app(_config())
    consumer = broker_batch.Consumer(app, RABBIT_SOURCE, threading.Event())
    prepared = consumer.prepare_batch([_raw("s1"), _raw("s2")], lambda raw: raw)
    assert prepared.staged is not None and prepared.staged.messages is prepared.messages
    verdicts = consumer.store_prepared(prepared)
    assert [v.action for v in verdicts] == ["ack", "ack"]
    with app.app_context():
        assert db.session.scalars(select(Event.received_at)).all() == [prepared.staged.now] * 2
