"""Redeliveries counted in batches (duplicates.py), on both databases."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import delete, func, select

from webhook_receiver.extensions import db
from webhook_receiver.inbox import duplicates
from webhook_receiver.models import Event, EventDuplicate, utcnow

from ..servers import wait_until
from . import signing as s

EVENT = {"id": "evt_batch", "type": "invoice.paid", "data": {"object": {"id": "in_1"}}}


@pytest.fixture
def app(make_app):
    return make_app({"sources": s.SOURCES}, DUPLICATE_FLUSH_SECONDS=0.2)


def ledger(app) -> duplicates.DuplicateLedger:
    return app.extensions[duplicates.EXTENSION]


def stored(app) -> tuple[int, int, object]:
    """The event's duplicate count, its duplicates' rows, and its last duplicate's time."""
    with app.app_context():
        event = db.session.scalars(select(Event)).one()
        rows = db.session.scalar(select(func.count()).select_from(EventDuplicate))
        return event.duplicate_count, rows, event.last_duplicate_at


def deliver(client, event=EVENT):
    body, headers = s.stripe_delivery(event)
    return client.post("/webhooks/stripe-live", data=body, headers=headers)


def test_redelivery_is_answered_before_its_count_is_written(app, client):
    first = deliver(client)
    again = deliver(client)
    assert again.status_code == 200
    assert again.get_json() == first.get_json()
    assert again.headers["Idempotent-Replayed"] == "true"
    # Answered from the stored event; the count follows within the interval.
    assert ledger(app).pending() == 1
    assert wait_until(lambda: stored(app)[:2] == (1, 1), timeout=10)
    assert ledger(app).pending() == 0


def test_redeliveries_of_one_interval_are_written_together(app, client):
    deliver(client)
    for _ in range(5):
        assert deliver(client).status_code == 200
    assert wait_until(lambda: stored(app)[:2] == (5, 5), timeout=10)
    count, rows, last = stored(app)
    with app.app_context():
        times = db.session.scalars(select(EventDuplicate.received_at)).all()
    assert last == max(times)


def test_close_writes_what_is_pending(make_app):
    app = make_app({"sources": s.SOURCES}, DUPLICATE_FLUSH_SECONDS=3600)
    client = app.test_client()
    deliver(client)
    deliver(client)
    deliver(client)
    assert stored(app)[:2] == (0, 0)
    ledger(app).close()
    assert stored(app)[:2] == (2, 2)


def test_counts_add_up_across_batches_and_keep_the_latest_time(app):
    with app.app_context():
        event = Event(
            source="stripe-live",
            dedup_key="evt_x",
            fingerprint="f" * 64,
            body=b"{}",
            headers=[],
            meta={},
            received_at=utcnow(),
            duplicate_count=0,
        )
        db.session.add(event)
        db.session.commit()
        event_id = event.id
    now = utcnow()
    book = ledger(app)
    book.record(event_id, now)
    book.record(event_id, now - timedelta(seconds=5))
    assert book.flush() == 2
    # A batch that lands later with an older time keeps the newer one.
    book.record(event_id, now - timedelta(seconds=60))
    assert book.flush() == 1
    assert stored(app) == (3, 3, now)


def test_an_event_purged_before_the_write_is_skipped_not_failed(app, client):
    event_id = deliver(client).get_json()["event_id"]
    deliver(client)
    deliver(client, {**EVENT, "id": "evt_other"})
    deliver(client, {**EVENT, "id": "evt_other"})
    with app.app_context():
        db.session.execute(delete(Event).where(Event.id == event_id))
        db.session.commit()
    assert ledger(app).flush() == 2
    with app.app_context():
        other = db.session.scalars(select(Event)).one()
        rows = db.session.scalars(select(EventDuplicate.event_id)).all()
    assert other.duplicate_count == 1
    assert rows == [other.id]


def test_a_failed_write_is_kept_and_tried_again(make_app, monkeypatch):
    app = make_app({"sources": s.SOURCES}, DUPLICATE_FLUSH_SECONDS=3600)
    client = app.test_client()
    deliver(client)
    deliver(client)
    book = ledger(app)
    real_write = book._write
    calls = []

    def failing(batch):
        calls.append(len(batch))
        raise RuntimeError("database away")

    monkeypatch.setattr(book, "_write", failing)
    assert book.flush() == 0
    assert book.pending() == 1
    monkeypatch.setattr(book, "_write", real_write)
    assert book.flush() == 1
    assert calls == [1]
    assert stored(app)[:2] == (1, 1)


def test_past_the_limit_the_oldest_unwritten_are_dropped(make_app, monkeypatch, caplog):
    app = make_app({"sources": s.SOURCES}, DUPLICATE_FLUSH_SECONDS=3600)
    monkeypatch.setattr(duplicates, "MAX_PENDING", 3)
    book = ledger(app)
    monkeypatch.setattr(book, "_write", lambda batch: (_ for _ in ()).throw(RuntimeError("x")))
    now = utcnow()
    for n in range(5):
        book.record(n + 1, now + timedelta(seconds=n))
    assert book.flush() == 0
    assert book.pending() == 3
    assert "dropped 2 unrecorded redeliveries" in caplog.text


def test_zero_interval_writes_in_the_request(make_app):
    app = make_app({"sources": s.SOURCES}, DUPLICATE_FLUSH_SECONDS=0)
    client = app.test_client()
    deliver(client)
    deliver(client)
    assert ledger(app).pending() == 0
    assert stored(app)[:2] == (1, 1)
