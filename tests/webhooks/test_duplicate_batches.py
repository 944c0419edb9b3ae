"""Redeliveries counted in batches (duplicates.py), on both databases."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from sqlalchemy import delete, func, select

from webhook_receiver.extensions import db
from webhook_receiver.inbox import duplicates
from webhook_receiver.models import Event, EventDuplicate, utcnow

from ..helpers import post_webhook
from ..helpers import signing as s
from ..servers import wait_until

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
    return post_webhook(client, "stripe-live", *s.stripe_delivery(event))


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
    event_id = _new_event(app, "evt_x")
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


def _new_event(app, key: str) -> int:
    with app.app_context():
        event = Event(
            source="stripe-live",
            dedup_key=key,
            fingerprint="f" * 64,
            body=b"{}",
            headers=[],
            meta={},
            received_at=utcnow(),
        )
        db.session.add(event)
        db.session.commit()
        return event.id


def _counted(app, event_id: int) -> tuple[int, object, list[object]]:
    """An event's duplicate count, last duplicate time, and its duplicates' times."""
    with app.app_context():
        event = db.session.get(Event, event_id)
        times = db.session.scalars(
            select(EventDuplicate.received_at)
            .where(EventDuplicate.event_id == event_id)
            .order_by(EventDuplicate.received_at)
        ).all()
        result = (event.duplicate_count, event.last_duplicate_at, list(times))
        db.session.rollback()
        return result


def test_the_fast_path_writes_what_the_core_path_writes(app):
    # Each database writes a batch with one statement per write (PostgreSQL
    # over arrays, SQLite over JSON); the Core statements are the reference.
    fast, core, gone = (_new_event(app, key) for key in ("evt_fast", "evt_core", "evt_gone"))
    with app.app_context():
        db.session.execute(delete(Event).where(Event.id == gone))
        db.session.commit()
    now = utcnow()
    batches = [
        [now, now - timedelta(seconds=5), now],  # one event twice at one time
        # Lands later with an older time, of whole seconds (stored as text on SQLite).
        [(now - timedelta(seconds=60)).replace(microsecond=0)],
        [now + timedelta(microseconds=1)],
    ]
    book = ledger(app)
    for times in batches:
        for event_id, fast_path in ((fast, True), (core, False)):
            redeliveries = [duplicates.Redelivery(event_id, at) for at in times]
            # An event purged meanwhile is skipped, not an error.
            redeliveries.append(duplicates.Redelivery(gone, now))
            book._write(redeliveries, fast=fast_path)
    assert _counted(app, fast) == _counted(app, core)
    count, last, times = _counted(app, fast)
    assert (count, last) == (5, now + timedelta(microseconds=1))
    assert times == sorted(at for batch in batches for at in batch)
    with app.app_context():
        orphans = db.session.scalar(
            select(func.count()).select_from(EventDuplicate).where(EventDuplicate.event_id == gone)
        )
    assert orphans == 0


def test_two_processes_batches_over_the_same_events_neither_deadlock_nor_lose_counts(make_app):
    # Each app is a process's engine and ledger; both write batches over the
    # same events in opposite orders. Rows are locked in id order, so
    # neither waits for the other in a cycle.
    apps = [make_app({"sources": s.SOURCES}, DUPLICATE_FLUSH_SECONDS=3600) for _ in range(2)]
    ids = [_new_event(apps[0], f"evt_{n}") for n in range(60)]
    rounds = 15
    errors: list[BaseException] = []

    def write(app, order) -> None:
        try:
            for _ in range(rounds):
                now = utcnow()
                ledger(app)._write([duplicates.Redelivery(i, now) for i in order])
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=write, args=(apps[0], ids)),
        threading.Thread(target=write, args=(apps[1], ids[::-1])),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    with apps[0].app_context():
        counts = db.session.scalars(select(Event.duplicate_count).where(Event.id.in_(ids))).all()
        rows = db.session.scalar(select(func.count()).select_from(EventDuplicate))
    assert counts == [2 * rounds] * len(ids)
    assert rows == 2 * rounds * len(ids)
