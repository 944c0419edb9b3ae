"""The RabbitMQ consumer against the real broker: stored once, acked after the commit."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import insert

from .conftest import (
    consuming,
    count_conflicts,
    count_events,
    dead_letter_count,
    duplicate_total,
    rabbit_source,
    stored_keys,
    wait_until,
)

SOURCE = "orders"


def _app(make_app, queue, **extra):
    return make_app({"sources": {SOURCE: rabbit_source(queue, **extra)}})


def _message(n: int, **props):
    body = json.dumps({"order": n, "total": n * 10}).encode()
    return body, {
        "message_id": f"msg-{n}",
        "type": "order.created",
        "content_type": "application/json",
        **props,
    }


def test_conflicting_message_kept_and_dead_lettered_unchanged(make_app, amqp_queue):
    app = _app(make_app, amqp_queue)
    original = _message(1)
    conflicting = (b'{"order": 1, "total": 999}', {**original[1], "headers": {"x-shop": "a"}})
    amqp_queue.publish([original])
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1, 30)
        amqp_queue.publish([conflicting])
        assert wait_until(lambda: amqp_queue.ready(amqp_queue.dead) == 1, 30)
    assert count_events(app) == 1
    assert count_conflicts(app) == 1
    [(props, body)] = amqp_queue.take_all(amqp_queue.dead)
    assert body == conflicting[0]
    assert props.message_id == "msg-1"
    assert props.type == "order.created"
    assert props.content_type == "application/json"
    assert props.headers["x-shop"] == "a"
    assert amqp_queue.ready() == 0
    assert dead_letter_count(app, SOURCE, "conflict") == 1


def test_json_serialised_again_under_its_key_is_a_duplicate_not_a_conflict(make_app, amqp_queue):
    # A producer that retries by serialising its message again sends other
    # bytes (key order, spacing) of the same content: acked as a duplicate.
    # Other content in the same spelling is still a conflict.
    app = _app(make_app, amqp_queue)
    body, props = _message(1)
    respelled = json.dumps(json.loads(body), separators=(",", ":"), sort_keys=False)
    reordered = json.dumps(dict(reversed(list(json.loads(body).items()))), indent=2)
    changed = json.dumps({"total": 11, "order": 1}, indent=2)
    amqp_queue.publish([(body, props)])
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1, 30)
        amqp_queue.publish([(respelled.encode(), props), (reordered.encode(), props)])
        assert wait_until(lambda: duplicate_total(app) == 2 and amqp_queue.ready() == 0, 30)
        amqp_queue.publish([(changed.encode(), props)])
        assert wait_until(lambda: amqp_queue.ready(amqp_queue.dead) == 1, 30)
    assert (count_events(app), count_conflicts(app), duplicate_total(app)) == (1, 1, 2)
    assert dead_letter_count(app, SOURCE, "conflict") == 1


def test_an_event_stored_under_its_content_fingerprint_takes_its_redelivery(make_app, amqp_queue):
    # Events stored before fingerprints covered a message's bytes carry the
    # fingerprint of its canonical JSON: their redeliveries are duplicates.
    from webhook_receiver.extensions import db
    from webhook_receiver.fingerprint import canonical_json, fingerprint, loads
    from webhook_receiver.models import Event

    from ..rows import event_row

    app = _app(make_app, amqp_queue)
    body, props = _message(1)
    with app.app_context():
        canonical = fingerprint(["order.created", canonical_json(loads(body))])
        assert canonical != fingerprint(["order.created", body])
        db.session.execute(
            insert(Event),
            event_row(
                source=SOURCE,
                dedup_key="msg-1",
                event_type="order.created",
                content_type="application/json",
                fingerprint=canonical,
                body=body,
            ),
        )
        db.session.commit()
    amqp_queue.publish([(body, props)])
    with consuming(app, SOURCE):
        assert wait_until(lambda: duplicate_total(app) == 1 and amqp_queue.ready() == 0, 30)
    assert (count_events(app), count_conflicts(app)) == (1, 0)
    assert amqp_queue.ready(amqp_queue.dead) == 0


@contextmanager
def _refused_key(app, key: str) -> Iterator[None]:
    """Make the database itself refuse the event under ``key``, with a trigger, for the block."""
    from sqlalchemy import text

    from webhook_receiver.extensions import db

    with app.app_context():
        sqlite = db.engine.dialect.name == "sqlite"
        with db.engine.begin() as conn:
            if sqlite:
                conn.execute(
                    text(
                        "CREATE TRIGGER refuse_key BEFORE INSERT ON events "
                        f"WHEN NEW.dedup_key = '{key}' BEGIN SELECT RAISE(ABORT, 'refused'); END"
                    )
                )
            else:
                conn.execute(
                    text(
                        "CREATE FUNCTION refuse_key() RETURNS trigger LANGUAGE plpgsql AS $$ "
                        f"BEGIN IF NEW.dedup_key = '{key}' THEN RAISE EXCEPTION 'refused'; "
                        "END IF; RETURN NEW; END $$"
                    )
                )
                conn.execute(
                    text(
                        "CREATE TRIGGER refuse_key BEFORE INSERT ON events "
                        "FOR EACH ROW EXECUTE FUNCTION refuse_key()"
                    )
                )
    try:
        yield
    finally:
        # The PostgreSQL schema outlives the test: the trigger must not.
        with app.app_context(), db.engine.begin() as conn:
            conn.execute(text("DROP TRIGGER refuse_key" + ("" if sqlite else " ON events")))
            if not sqlite:
                conn.execute(text("DROP FUNCTION refuse_key()"))


def test_a_message_the_database_refuses_is_dead_lettered_and_its_batch_stored(make_app, amqp_queue):
    # One batch: the database refuses it whole, then the messages are stored
    # one by one, and only the refused one is dead-lettered (not the batch
    # redelivered for ever).
    app = _app(make_app, amqp_queue, prefetch=100)
    amqp_queue.publish([_message(n) for n in range(20)])
    with _refused_key(app, "msg-13"), consuming(app, SOURCE):
        assert wait_until(lambda: amqp_queue.ready(amqp_queue.dead) == 1, 30)
        assert wait_until(lambda: count_events(app) == 19, 30)
    assert sorted(stored_keys(app)) == sorted(f"msg-{n}" for n in range(20) if n != 13)
    [(props, body)] = amqp_queue.take_all(amqp_queue.dead)
    assert props.message_id == "msg-13"
    assert body == _message(13)[0]
    assert amqp_queue.ready() == 0
    assert dead_letter_count(app, SOURCE, "unstorable") == 1


@pytest.mark.parametrize("spec", ["header:x-event-id", "json:/id"])
def test_key_from_a_header_or_the_body(make_app, amqp_queue, spec):
    app = _app(make_app, amqp_queue, dedup_key=spec, event_type="json:/kind")
    body = b'{"id": "e-1", "kind": "paid"}'
    props = {"headers": {"x-event-id": "e-1"}, "content_type": "application/json"}
    amqp_queue.publish([(body, props), (b'{"kind": "paid", "id": "e-1"}', props)])
    with consuming(app, SOURCE):
        assert wait_until(lambda: duplicate_total(app) == 1, 30)
    assert stored_keys(app) == ["e-1"]
    assert amqp_queue.ready() == 0


def test_missing_queue_waits_with_one_clear_line_then_consumes(make_app, amqp_queue, caplog):
    # The queue is deleted first: the source waits for it, saying so once,
    # and consumes once it is declared again.
    caplog.set_level(logging.INFO, logger="webhook_receiver.brokers")
    with amqp_queue.channel() as ch:
        ch.queue_delete(amqp_queue.name)
    app = _app(make_app, amqp_queue)
    with consuming(app, SOURCE):
        assert wait_until(lambda: "does not exist" in caplog.text, 10)
        with amqp_queue.channel() as ch:
            ch.queue_declare(amqp_queue.name, arguments={"x-dead-letter-exchange": amqp_queue.dlx})
        amqp_queue.publish([_message(1)])
        assert wait_until(lambda: count_events(app) == 1, 60)
    starts = [r for r in caplog.records if "queue unavailable" in r.getMessage()]
    assert len(starts) == 1, caplog.text
    assert f"queue '{amqp_queue.name}' does not exist" in starts[0].getMessage()
    assert f"brokers declare {SOURCE}" in starts[0].getMessage()
    assert "guest:guest" not in caplog.text
    assert "queue back after" in caplog.text


def test_broker_source_has_no_webhook_endpoint(make_app, amqp_queue):
    app = _app(make_app, amqp_queue)
    response = app.test_client().post(f"/webhooks/{SOURCE}", data=b"{}")
    assert response.status_code == 404
    assert response.content_type == "application/problem+json"
    assert count_events(app) == 0


def test_broker_source_handler_writes_commit_with_its_delivery(make_app, amqp_queue):
    from sqlalchemy import select

    from webhook_receiver.extensions import db
    from webhook_receiver.processing.worker import Worker

    from ..processing import handlers

    handlers.reset()
    app = make_app(
        {"sources": {"shop": rabbit_source(amqp_queue)}, "handlers": ["tests.processing.handlers"]},
        WORKER_POLL_SECONDS=0.01,
        WORKER_BACKOFF_BASE_SECONDS=0,
    )
    with app.app_context():
        handlers.ledger.create(db.engine, checkfirst=True)
    try:
        body, props = _message(1, type="order.paid")
        amqp_queue.publish([(body, props), (body, props)])
        with consuming(app, "shop"):
            assert wait_until(lambda: duplicate_total(app) == 1, 30)
        # The first audit attempt writes, then fails: its write goes with its rollback.
        handlers.failures["audit"] = 1
        assert Worker(app).run(drain=True, handle_signals=False) == 3
        with app.app_context():
            rows = db.session.execute(select(handlers.ledger.c.consumer)).scalars().all()
            db.session.rollback()
        assert sorted(rows) == ["audit", "ledger"]
    finally:
        with app.app_context():
            handlers.ledger.drop(db.engine, checkfirst=True)
        handlers.reset()


def test_the_consuming_thread_waits_while_a_slow_batch_is_stored(make_app, amqp_queue, monkeypatch):
    # With a batch stored, one prepared and the third arrived, the consuming
    # thread has nothing to do until the store ends (which wakes it). It
    # used to poll the connection without a timeout once the arrivals were
    # older than the batch wait: a busy loop taking the GIL from the store.
    import threading
    import time

    import pika

    from webhook_receiver.brokers import batch, runner

    app = _app(make_app, amqp_queue, prefetch=10)
    amqp_queue.publish([_message(n) for n in range(40)])
    calls = []
    real = pika.BlockingConnection.process_data_events

    def counted(self, *args, **kwargs):
        calls.append(time.monotonic())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pika.BlockingConnection, "process_data_events", counted)
    stop = threading.Event()
    consumer = runner.consumer_for(app, app.config["FILE_CONFIG"].brokers[SOURCE], stop)

    def slow_store(source, prepared):
        time.sleep(0.5)
        return batch.store(source, prepared)

    consumer.store = slow_store
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: count_events(app) == 40 and amqp_queue.ready() == 0, 30)
    finally:
        stop.set()
        thread.join(30)
    # Four stores of 0.5 s: a waiting thread polls a few times per store
    # (arrivals, the 0.25 s idle wait, the wake-up); a spinning one,
    # thousands of times.
    assert len(calls) < 200, f"{len(calls)} polls in 2 s of storing"


def test_a_pool_with_no_connection_to_lend_is_an_outage_not_a_crash(make_app, amqp_queue):
    # A pool timeout is SQLAlchemy's own error, not a driver's: it escaped
    # the batch's handler and stopped every consumer of the process.
    from webhook_receiver.brokers import batch
    from webhook_receiver.brokers.identify import BrokerMessage
    from webhook_receiver.extensions import db

    pool = {"pool_size": 1, "max_overflow": 0, "pool_timeout": 0.2}
    app = make_app({"sources": {SOURCE: rabbit_source(amqp_queue)}}, SQLALCHEMY_ENGINE_OPTIONS=pool)
    source = app.config["FILE_CONFIG"].brokers[SOURCE]
    body, props = _message(1)
    delivery = BrokerMessage(body, "application/json", properties={"message_id": "msg-1"})
    with app.app_context():
        prepared = batch.prepare(source, [delivery], lambda raw: raw)
        with db.engine.connect():  # the pool's one connection, held
            with pytest.raises(batch.DatabaseUnavailable):
                batch.store(source, prepared)
    assert count_events(app) == 0
