"""Forwards to a real loopback downstream: headers, retries, Retry-After, dead letters."""

from __future__ import annotations

import base64
import hashlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from webhook_receiver.config.forwards import parse_forwards
from webhook_receiver.database import unit_of_work
from webhook_receiver.extensions import db
from webhook_receiver.models import Event
from webhook_receiver.outbox import deliveries
from webhook_receiver.processing import forwarding, publishers, registry

from ..servers import Relay, free_port
from .conftest import (
    FAST,
    Reply,
    config_with,
    delivery,
    delivery_rows,
    drain,
    forward,
    outgoing,
    store_event,
)


def _app(make_app, downstream, *forwards, **overrides):
    forwards = forwards or (forward("billing", downstream.url + "/billing"),)
    return make_app(config_with(list(forwards)), **{**FAST, **overrides})


def test_forward_sends_the_event_with_its_key_and_correlation_id(
    make_app, downstream, clock, make_worker
):
    app = _app(make_app, downstream)
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    event_id = store_event(
        app,
        clock,
        dedup_key="evt-1",
        body=b'{"type": "order.paid", "data": {"n": 1}}',
        correlation_id=trace_id,
    )
    assert drain(app, make_worker(app, clock)) == ["delivered"]
    [call] = downstream.calls_to("/billing")
    assert call.body == b'{"type": "order.paid", "data": {"n": 1}}'
    assert call.headers["Content-Type"] == "application/json"
    assert call.headers["Idempotency-Key"] == "billing:shop:evt-1"
    assert call.headers["X-Request-Id"] == trace_id
    assert call.headers["traceparent"].startswith(f"00-{trace_id}-")
    assert call.headers["X-Webhook-Event-Id"] == str(event_id)
    assert call.headers["X-Webhook-Event-Type"] == "order.paid"
    row = delivery(app, event_id, "billing")
    assert (row["state"], row["attempts"], row["response_status"]) == ("delivered", 1, 200)
    assert row["completed_at"] == clock()
    assert row["lease_token"] is None


def test_forward_without_correlation_id_sends_a_stable_one(
    make_app, downstream, clock, make_worker
):
    app = _app(make_app, downstream)
    event_id = store_event(
        app, clock, dedup_key="evt-1", body=b"a=1", content_type="application/x-www-form-urlencoded"
    )
    drain(app, make_worker(app, clock))
    [call] = downstream.calls_to("/billing")
    assert call.headers["X-Request-Id"] == f"event-{event_id}"
    assert "traceparent" not in call.headers
    assert call.headers["Content-Type"] == "application/x-www-form-urlencoded"
    assert call.body == b"a=1"


def test_failures_back_off_exponentially_with_the_same_key(
    make_app, downstream, clock, make_worker
):
    app = _app(make_app, downstream)
    downstream.replies["/billing"] = [Reply(500), Reply(502), Reply(503)]
    event_id = store_event(app, clock, dedup_key="evt-1")
    worker = make_worker(app, clock)
    start = clock()
    schedule = []
    for _ in range(3):
        assert drain(app, worker) == ["retry"]
        row = delivery(app, event_id, "billing")
        schedule.append((row["next_attempt_at"] - clock()).total_seconds())
        assert drain(app, worker) == []  # not due yet
        clock.now = row["next_attempt_at"]
    assert schedule == [1.0, 2.0, 4.0]
    assert drain(app, worker) == ["delivered"]
    row = delivery(app, event_id, "billing")
    assert (row["state"], row["attempts"], row["last_error"]) == ("delivered", 4, None)
    assert clock() - start == timedelta(seconds=7)
    keys = {c.headers["Idempotency-Key"] for c in downstream.calls_to("/billing")}
    assert len(downstream.calls_to("/billing")) == 4
    assert keys == {"billing:shop:evt-1"}
    assert downstream.applied == ["billing:shop:evt-1"]


def test_jitter_spreads_the_delay_within_half_to_one_step(make_app, downstream, clock, make_worker):
    app = _app(make_app, downstream)
    downstream.replies["/billing"] = [Reply(500)]
    event_id = store_event(app, clock, dedup_key="evt-1")
    drain(app, make_worker(app, clock, rand=lambda: 0.0))
    row = delivery(app, event_id, "billing")
    assert row["next_attempt_at"] - clock() == timedelta(seconds=0.5)


def test_retry_after_seconds_is_honoured(make_app, downstream, clock, make_worker):
    app = _app(make_app, downstream)
    downstream.replies["/billing"] = [Reply(503, {"Retry-After": "7"}, b"busy")]
    event_id = store_event(app, clock, dedup_key="evt-1")
    assert drain(app, make_worker(app, clock)) == ["retry"]
    row = delivery(app, event_id, "billing")
    assert row["next_attempt_at"] - clock() == timedelta(seconds=7)
    assert (row["state"], row["response_status"], row["last_error"]) == (
        "pending",
        503,
        "HTTP 503: busy",
    )


def test_retry_after_http_date_is_honoured(make_app, downstream, clock, make_worker):
    app = _app(make_app, downstream)
    when = format_datetime(clock() + timedelta(seconds=30), usegmt=True)
    downstream.replies["/billing"] = [Reply(429, {"Retry-After": when})]
    event_id = store_event(app, clock, dedup_key="evt-1")
    assert drain(app, make_worker(app, clock)) == ["retry"]
    row = delivery(app, event_id, "billing")
    assert row["next_attempt_at"] - clock() == timedelta(seconds=30)
    assert row["response_status"] == 429


def test_a_short_retry_after_does_not_shorten_the_backoff(make_app, downstream, clock, make_worker):
    app = _app(make_app, downstream, WORKER_BACKOFF_BASE_SECONDS=10)
    downstream.replies["/billing"] = [Reply(503, {"Retry-After": "2"})]
    event_id = store_event(app, clock, dedup_key="evt-1")
    drain(app, make_worker(app, clock))
    assert delivery(app, event_id, "billing")["next_attempt_at"] - clock() == timedelta(seconds=10)


@pytest.mark.parametrize("status", [408, 429, 500, 503])
def test_transient_statuses_are_retried(make_app, downstream, clock, make_worker, status):
    app = _app(make_app, downstream)
    downstream.replies["/billing"] = [Reply(status)]
    event_id = store_event(app, clock, dedup_key="evt-1")
    assert drain(app, make_worker(app, clock)) == ["retry"]
    assert delivery(app, event_id, "billing")["state"] == "pending"


@pytest.mark.parametrize("status", [400, 401, 404, 422, 302])
def test_other_answers_make_the_delivery_dead_at_once(
    make_app, downstream, clock, make_worker, status
):
    app = _app(make_app, downstream)
    downstream.replies["/billing"] = [Reply(status, {"Location": "/elsewhere"}, b"no")]
    event_id = store_event(app, clock, dedup_key="evt-1")
    assert drain(app, make_worker(app, clock)) == ["dead"]
    row = delivery(app, event_id, "billing")
    assert (row["state"], row["attempts"], row["response_status"], row["last_error"]) == (
        "dead",
        1,
        status,
        f"HTTP {status}: no",
    )
    assert len(downstream.calls_to("/billing")) == 1
    assert downstream.calls_to("/elsewhere") == []


def test_connection_refused_is_retried(make_app, downstream, clock, make_worker):
    url = f"http://127.0.0.1:{free_port()}/nobody"
    app = _app(make_app, downstream, forward("billing", url))
    event_id = store_event(app, clock, dedup_key="evt-1")
    assert drain(app, make_worker(app, clock)) == ["retry"]
    row = delivery(app, event_id, "billing")
    assert row["last_error"].startswith("ConnectionError: ")
    assert row["response_status"] is None


def test_a_token_in_the_forward_url_stays_out_of_the_stored_error(
    make_app, downstream, clock, make_worker
):
    url = f"http://127.0.0.1:{free_port()}/hooks?token=s3cr3t-value"
    app = _app(make_app, downstream, forward("billing", url))
    event_id = store_event(app, clock, dedup_key="evt-1")
    assert drain(app, make_worker(app, clock)) == ["retry"]
    error = delivery(app, event_id, "billing")["last_error"]
    assert error.startswith("ConnectionError: ")
    assert "s3cr3t-value" not in error
    assert "[redacted]" in error


def test_timeout_is_retried(make_app, downstream, clock, make_worker):
    app = _app(
        make_app, downstream, forward("billing", downstream.url + "/billing", timeout_seconds=0.2)
    )
    downstream.replies["/billing"] = [Reply(200, delay=1.0)]
    event_id = store_event(app, clock, dedup_key="evt-1")
    assert drain(app, make_worker(app, clock)) == ["retry"]
    assert delivery(app, event_id, "billing")["last_error"].startswith("timeout: ")


def test_dead_after_the_attempt_limit(make_app, downstream, clock, make_worker):
    app = _app(make_app, downstream, WORKER_MAX_ATTEMPTS=3)
    downstream.replies["/billing"] = [Reply(500, body=b"down")] * 5
    event_id = store_event(app, clock, dedup_key="evt-1")
    worker = make_worker(app, clock)
    outcomes = []
    for _ in range(3):
        outcomes += drain(app, worker)
        clock.advance(1000)
    assert outcomes == ["retry", "retry", "dead"]
    row = delivery(app, event_id, "billing")
    assert (row["state"], row["attempts"], row["last_error"]) == (
        "dead",
        3,
        "out of attempts (3): HTTP 500: down",
    )
    assert len(downstream.calls_to("/billing")) == 3


def test_a_forward_may_set_its_own_attempt_limit(make_app, downstream, clock, make_worker):
    app = _app(
        make_app, downstream, forward("billing", downstream.url + "/billing", max_attempts=1)
    )
    downstream.replies["/billing"] = [Reply(500)]
    event_id = store_event(app, clock, dedup_key="evt-1")
    assert drain(app, make_worker(app, clock)) == ["dead"]
    assert delivery(app, event_id, "billing")["attempts"] == 1


def test_requeued_dead_delivery_is_delivered_with_the_same_key(
    make_app, downstream, clock, make_worker
):
    app = _app(make_app, downstream)
    downstream.replies["/billing"] = [Reply(410)]
    event_id = store_event(app, clock, dedup_key="evt-1")
    worker = make_worker(app, clock)
    assert drain(app, worker) == ["dead"]
    row = delivery(app, event_id, "billing")
    with app.app_context():
        assert deliveries.requeue([row["id"]], clock()) == 1
        db.session.commit()
    assert drain(app, worker) == ["delivered"]
    row = delivery(app, event_id, "billing")
    assert (row["state"], row["attempts"], row["response_status"]) == ("delivered", 1, 200)
    assert [c.headers["Idempotency-Key"] for c in downstream.calls_to("/billing")] == [
        "billing:shop:evt-1",
        "billing:shop:evt-1",
    ]


def test_a_discarded_dead_letter_is_never_sent_again(make_app, downstream, clock, make_worker):
    app = _app(make_app, downstream)
    downstream.replies["/billing"] = [Reply(410)]
    event_id = store_event(app, clock, dedup_key="evt-1")
    worker = make_worker(app, clock)
    assert drain(app, worker) == ["dead"]
    row = delivery(app, event_id, "billing")
    with app.app_context():
        assert [d.id for d in deliveries.discard([row["id"]], clock())] == [row["id"]]
        # A requeue after the discard (a stale admin page) changes nothing.
        assert deliveries.requeue([row["id"]], clock()) == 0
        db.session.commit()
    clock.advance(86400 * 30)
    assert drain(app, worker) == []
    assert delivery(app, event_id, "billing")["state"] == "discarded"
    assert len(downstream.calls_to("/billing")) == 1


def test_one_failing_consumer_does_not_hold_back_another(make_app, downstream, clock, make_worker):
    app = _app(
        make_app,
        downstream,
        forward("flaky", downstream.url + "/flaky"),
        forward("steady", downstream.url + "/steady"),
    )
    downstream.replies["/flaky"] = [Reply(500)] * 10
    first = store_event(app, clock, dedup_key="evt-1")
    worker = make_worker(app, clock)
    assert sorted(drain(app, worker)) == ["delivered", "retry"]
    second = store_event(app, clock, dedup_key="evt-2")
    assert sorted(drain(app, worker)) == ["delivered", "retry"]
    assert delivery(app, first, "steady")["state"] == "delivered"
    assert delivery(app, second, "steady")["state"] == "delivered"
    assert delivery(app, first, "flaky")["state"] == "pending"
    assert delivery(app, second, "flaky")["state"] == "pending"
    assert [c.headers["Idempotency-Key"] for c in downstream.calls_to("/steady")] == [
        "steady:shop:evt-1",
        "steady:shop:evt-2",
    ]


def test_a_consumer_removed_from_the_config_goes_dead(make_app, downstream, clock, make_worker):
    old = _app(make_app, downstream)
    event_id = store_event(old, clock, dedup_key="evt-1")
    new = make_app(config_with(), **FAST)
    assert drain(new, make_worker(new, clock)) == ["dead"]
    row = delivery(new, event_id, "billing")
    assert row["last_error"] == "consumer 'billing' is no longer configured"
    assert downstream.calls == []


def test_a_lease_lost_on_the_last_attempt_goes_dead(make_app, downstream, clock, make_worker):
    app = _app(make_app, downstream, WORKER_MAX_ATTEMPTS=1)
    event_id = store_event(app, clock, dedup_key="evt-1")
    with app.app_context():
        # A worker claimed it and died.
        with unit_of_work():
            deliveries.claim_next(clock(), timedelta(seconds=5))
    clock.advance(5)
    assert drain(app, make_worker(app, clock)) == ["dead"]
    row = delivery(app, event_id, "billing")
    assert (row["state"], row["attempts"]) == ("dead", 2)
    assert row["last_error"] == "out of attempts (1); the last one's lease expired"


def test_each_attempt_logs_one_line_and_calls_the_outcome_hooks(
    make_app, downstream, clock, make_worker, caplog
):
    app = _app(make_app, downstream)
    seen = []
    registry.get(app).outcome_hooks.append(seen.append)
    downstream.replies["/billing"] = [Reply(500)]
    event_id = store_event(app, clock, dedup_key="evt-1", correlation_id="corr-1")
    worker = make_worker(app, clock)
    with caplog.at_level(logging.INFO, logger="webhook_receiver.processing"):
        drain(app, worker)
        clock.advance(10)
        drain(app, worker)
    # The worker's lines only: the inbox's "delivery accepted" has an outcome too,
    # and is captured when an earlier test left its logger at INFO.
    records = [
        r
        for r in caplog.records
        if r.name.startswith("webhook_receiver.processing") and hasattr(r, "outcome")
    ]
    assert [(r.outcome, r.attempt) for r in records] == [("retry", 1), ("delivered", 2)]
    for record in records:
        assert (record.source, record.consumer, record.dedup_key, record.event_id) == (
            "shop",
            "billing",
            "evt-1",
            event_id,
        )
        assert record.correlation_id == "corr-1"
    assert [(o.outcome, o.status) for o in seen] == [("retry", 500), ("delivered", 200)]


def test_an_event_purged_after_the_claim_is_let_go(make_app, downstream, clock):
    from sqlalchemy import delete

    from webhook_receiver.models import Event
    from webhook_receiver.processing.worker import Worker

    app = _app(make_app, downstream)
    event_id = store_event(app, clock, dedup_key="evt-1")
    worker = Worker(app, clock=clock)
    try:
        with app.app_context():
            with unit_of_work():
                claim = deliveries.claim_next(clock(), timedelta(seconds=5))
            db.session.execute(delete(Event).where(Event.id == event_id))
            db.session.commit()
            outcome = worker.process(claim)
    finally:
        worker.http.close()
    assert (outcome.outcome, outcome.error) == ("lease_lost", "event deleted")
    assert delivery_rows(app) == []
    assert downstream.calls == []


def test_an_unexpected_error_does_not_stop_the_worker(
    make_app, downstream, clock, make_worker, monkeypatch
):
    """A bug while processing one delivery leaves it to its lease; the worker carries on."""
    app = _app(make_app, downstream)
    event_id = store_event(app, clock, dedup_key="evt-1")
    worker = make_worker(app, clock)
    original = worker.process
    seen = []

    def buggy_once(claim):
        seen.append(claim.id)
        if len(seen) == 1:
            raise RuntimeError("a bug")
        return original(claim)

    monkeypatch.setattr(worker, "process", buggy_once)
    assert worker.run(drain=True, handle_signals=False) == 0
    assert delivery(app, event_id, "billing")["state"] == "in_progress"
    clock.advance(worker.lease.total_seconds() + 1)
    assert worker.run(drain=True, handle_signals=False) == 1
    row = delivery(app, event_id, "billing")
    assert (row["state"], row["attempts"]) == ("delivered", 2)
    assert len(downstream.calls) == 1


# -- forwards to brokers, and signed HTTP forwards ---------------------------------


def _publish_then_die(app, clock, worker, forward_name):
    """Claim a delivery and publish it as the worker does, then die before marking it done."""
    with app.app_context():
        with unit_of_work():  # the claim commits on its own, as the worker's does
            claim = deliveries.claim_next(clock(), worker.lease)
        assert claim is not None and claim.consumer == forward_name
        event = db.session.get(Event, claim.event_id)
        out = forwarding.Outgoing(
            event_id=event.id,
            source=event.source,
            dedup_key=event.dedup_key,
            event_type=event.event_type,
            content_type=event.content_type,
            body=event.body,
            correlation_id=event.correlation_id,
        )
        consumer = registry.get(app).find(event.source, forward_name)
        db.session.rollback()
        assert forwarding.send(worker.http, forward_name, consumer.forward, out).ok
    return claim.event_id


def test_amqp_forward_publishes_with_confirms_and_the_stable_message_id(
    make_app, clock, make_worker, amqp_queue
):
    bus = forward("bus", amqp_queue.url, exchange="", routing_key=amqp_queue.name)
    app = make_app(config_with([bus]), **FAST)
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    event_id = store_event(app, clock, dedup_key="evt-1", correlation_id=trace_id)
    assert drain(app, make_worker(app, clock)) == ["delivered"]
    [(props, body)] = amqp_queue.take_all(amqp_queue.name)
    assert body == b'{"type": "order.paid", "data": {}}'
    assert props.message_id == "bus:shop:evt-1"
    assert props.correlation_id == trace_id
    assert props.type == "order.paid"
    assert props.content_type == "application/json"
    assert props.headers["X-Webhook-Event-Id"] == str(event_id)
    assert delivery(app, event_id, "bus")["state"] == "delivered"


def test_amqp_forward_routing_key_takes_the_event_type(make_app, clock, make_worker, amqp_queue):
    with amqp_queue.channel() as ch:
        ch.exchange_declare(amqp_queue.name + ".x", "direct", auto_delete=True)
        ch.queue_bind(amqp_queue.name, amqp_queue.name + ".x", routing_key="order.paid")
    bus = forward(
        "bus", amqp_queue.url, exchange=amqp_queue.name + ".x", routing_key="{event_type}"
    )
    app = make_app(config_with([bus]), **FAST)
    store_event(app, clock, dedup_key="evt-1")
    assert drain(app, make_worker(app, clock)) == ["delivered"]
    assert len(amqp_queue.take_all(amqp_queue.name)) == 1


def test_amqp_forward_unroutable_is_a_retryable_failure(make_app, clock, make_worker, amqp_queue):
    bus = forward("bus", amqp_queue.url, exchange="", routing_key=amqp_queue.name + "-nowhere")
    app = make_app(config_with([bus]), **FAST)
    event_id = store_event(app, clock, dedup_key="evt-1")
    assert drain(app, make_worker(app, clock)) == ["retry"]
    row = delivery(app, event_id, "bus")
    assert row["state"] == "pending"  # due again after its backoff
    assert "unroutable" in row["last_error"]


def test_amqp_forward_sends_what_exceeds_a_short_string_in_headers(
    make_app, clock, make_worker, amqp_queue
):
    # AMQP's short strings hold 255 bytes; a dedup key may be 512 characters.
    bus = forward("bus", amqp_queue.url, exchange="", routing_key=amqp_queue.name)
    app = make_app(config_with([bus]), **FAST)
    key = "k" * 400
    long_type = "order." + "é" * 200  # 206 characters, 406 bytes
    store_event(app, clock, dedup_key=key, event_type=long_type)
    store_event(app, clock, dedup_key="evt-short", event_type="order.paid")
    assert drain(app, make_worker(app, clock)) == ["delivered", "delivered"]
    published = {
        props.headers.get("X-Message-Id", props.message_id): props
        for props, _ in amqp_queue.take_all(amqp_queue.name)
    }
    stable = f"bus:shop:{key}"
    props = published[stable]
    assert props.message_id == "sha256:" + hashlib.sha256(stable.encode()).hexdigest()
    assert props.type is None
    assert props.headers["X-Webhook-Event-Type"] == long_type
    # What fits stays where it was.
    short = published["bus:shop:evt-short"]
    assert short.message_id == "bus:shop:evt-short" and "X-Message-Id" not in short.headers
    assert short.type == "order.paid"


def test_amqp_forward_routing_key_too_long_goes_dead_at_once(
    make_app, clock, make_worker, amqp_queue
):
    bus = forward("bus", amqp_queue.url, exchange="", routing_key="{event_type}")
    app = make_app(config_with([bus]), **FAST)
    event_id = store_event(app, clock, dedup_key="evt-1", event_type="t" * 250 + "é" * 5)
    assert drain(app, make_worker(app, clock)) == ["dead"]
    row = delivery(app, event_id, "bus")
    assert row["state"] == "dead"
    assert "routing key is longer than AMQP's 255 bytes" in row["last_error"]


def test_amqp_forward_nacked_by_the_broker_is_a_retryable_failure(
    make_app, clock, make_worker, amqp_queue
):
    # A queue that is full and rejects publishes: the broker nacks the message.
    full = amqp_queue.name + ".full"
    with amqp_queue.channel() as ch:
        ch.queue_declare(full, arguments={"x-max-length": 0, "x-overflow": "reject-publish"})
    try:
        bus = forward("bus", amqp_queue.url, exchange="", routing_key=full)
        app = make_app(config_with([bus]), **FAST)
        event_id = store_event(app, clock, dedup_key="evt-1")
        assert drain(app, make_worker(app, clock)) == ["retry"]
        row = delivery(app, event_id, "bus")
        assert row["state"] == "pending"  # due again after its backoff
        assert "nacked" in row["last_error"]
    finally:
        with amqp_queue.channel() as ch:
            ch.queue_delete(full)


def test_amqp_forward_unconfirmed_within_its_timeout_is_a_retryable_failure(
    make_app, clock, make_worker, amqp_queue
):
    # A broker can hold a confirm back while its connection lives (a quorum
    # queue without a majority of its replicas): the worker waits no longer
    # than the forward's timeout_seconds. Here a relay drops what the broker
    # answers once the connection is open and has published once.
    broker = urlsplit(amqp_queue.url)
    with Relay(broker.port or 5672) as relay, ThreadPoolExecutor(1) as pool:
        url = urlunsplit(broker._replace(netloc=f"guest:guest@127.0.0.1:{relay.port}"))
        bus = forward("bus", url, exchange="", routing_key=amqp_queue.name, timeout_seconds=1)
        app = make_app(config_with([bus]), **FAST)
        worker = make_worker(app, clock)
        store_event(app, clock, dedup_key="evt-1")
        # The worker's thread keeps its connection: the second publish uses it.
        assert pool.submit(drain, app, worker).result(30) == ["delivered"]
        relay.hold()
        event_id = store_event(app, clock, dedup_key="evt-2")
        started = time.monotonic()
        try:
            assert pool.submit(drain, app, worker).result(30) == ["retry"]
            assert time.monotonic() - started < 10
            row = delivery(app, event_id, "bus")
            assert row["state"] == "pending"
            assert "no confirm from the broker within 1 s" in row["last_error"]
            # The next attempt opens a fresh connection, and is confirmed.
            relay.release()
            clock.advance(60)
            assert pool.submit(drain, app, worker).result(30) == ["delivered"]
        finally:
            relay.release()
            try:
                # As a stopping worker does, in the thread that holds them.
                pool.submit(publishers.close_thread_connections).result(10)
            finally:
                relay.close()  # a worker still waiting sees its connection closed
    assert [props.message_id for props, _ in amqp_queue.take_all(amqp_queue.name)] == [
        "bus:shop:evt-1",
        "bus:shop:evt-2",
        "bus:shop:evt-2",
    ]


# AMQP's Connection.OpenOk method (class 10, method 41): the handshake is over.
_AMQP_OPEN_OK = b"\x00\x0a\x00\x29"


def _amqp_send_through(relay: Relay, amqp_queue: Any, timeout: float) -> tuple[Any, float]:
    """One attempt of a forward to ``amqp_queue`` through ``relay``, as the worker makes it."""
    broker = urlsplit(amqp_queue.url)
    url = urlunsplit(broker._replace(netloc=f"guest:guest@127.0.0.1:{relay.port}"))
    [bus] = parse_forwards(
        [
            {
                "name": "bus",
                "url": url,
                "exchange": "",
                "routing_key": amqp_queue.name,
                "timeout_seconds": timeout,
            }
        ],
        "test",
    )
    out = outgoing()
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        # A hang is a failure, not a stuck test: the worker's lease would end.
        result = pool.submit(forwarding.send, None, "bus", bus, out).result(30)
        elapsed = time.monotonic() - started
        pool.submit(publishers.close_thread_connections).result(10)
    return result, elapsed


def test_amqp_forward_to_a_broker_that_never_answers_ends_within_its_timeout(amqp_queue):
    # No kept connection: the attempt opens one, whose handshake the broker
    # never answers. pika's stack timeout is no AMQPError: it was taken for
    # a publisher's bug ("failed unexpectedly", an ERROR with its
    # traceback). Taken as a connection error, it must not open a second,
    # fresh connection in a whole timeout_seconds more: twice the timeout is
    # all the worker's lease is required to outlast.
    broker = urlsplit(amqp_queue.url)
    with Relay(broker.port or 5672) as relay:
        relay.hold()
        result, elapsed = _amqp_send_through(relay, amqp_queue, timeout=2)
    assert (result.ok, result.retryable) == (False, True)
    assert "unexpectedly" not in (result.error or ""), result.error
    assert "Timeout during AMQP handshake" in (result.error or ""), result.error
    assert elapsed < 3, f"the attempt took {elapsed:.1f} s, its timeout is 2 s"


def test_amqp_forward_whose_channel_is_never_opened_ends_within_its_timeout(amqp_queue):
    # The handshake passes, then the broker answers nothing: pika waits for
    # the channel's opening (and the confirm mode's) with no bound of its
    # own, and the worker hung there past its lease.
    broker = urlsplit(amqp_queue.url)
    with Relay(broker.port or 5672, hold_after=_AMQP_OPEN_OK) as relay:
        result, elapsed = _amqp_send_through(relay, amqp_queue, timeout=2)
    assert (result.ok, result.retryable) == (False, True)
    assert "no open channel from the broker within 2 s" in (result.error or "")
    assert elapsed < 3, f"the attempt took {elapsed:.1f} s, its timeout is 2 s"


def test_amqp_forward_republishes_the_same_message_id_after_a_worker_died(
    make_app, clock, make_worker, amqp_queue
):
    bus = forward("bus", amqp_queue.url, exchange="", routing_key=amqp_queue.name)
    app = make_app(config_with([bus]), **FAST)
    event_id = store_event(app, clock, dedup_key="evt-1")
    _publish_then_die(app, clock, make_worker(app, clock), "bus")
    assert delivery(app, event_id, "bus")["state"] == "in_progress"
    clock.advance(FAST["WORKER_LEASE_SECONDS"] + 1)  # the dead worker's lease runs out
    assert drain(app, make_worker(app, clock)) == ["delivered"]
    published = amqp_queue.take_all(amqp_queue.name)
    # Two copies, one id: a consumer deduplicating on message_id applies it once.
    assert [props.message_id for props, _ in published] == ["bus:shop:evt-1"] * 2


def test_nats_forward_republished_after_a_worker_died_is_stored_once(
    make_app, clock, make_worker, jetstream
):
    stream = forward("stream", jetstream.url, subject=f"{jetstream.prefix}.stripe")
    app = make_app(config_with([stream]), **FAST)
    event_id = store_event(app, clock, dedup_key="evt-1", correlation_id="req-1")
    _publish_then_die(app, clock, make_worker(app, clock), "stream")
    clock.advance(FAST["WORKER_LEASE_SECONDS"] + 1)
    assert drain(app, make_worker(app, clock)) == ["delivered"]
    assert delivery(app, event_id, "stream")["attempts"] == 2

    async def stored(nc):
        js = nc.jetstream()
        info = await js.stream_info(jetstream.name)
        message = await js.get_msg(jetstream.name, info.state.last_seq)
        return info.state.messages, message

    count, message = jetstream.run(stored)
    assert count == 1  # JetStream's duplicate window dropped the republish
    assert message.headers["Nats-Msg-Id"] == "stream:shop:evt-1"
    assert message.headers["X-Request-Id"] == "req-1"
    assert message.headers["X-Webhook-Event-Type"] == "order.paid"
    assert message.data == b'{"type": "order.paid", "data": {}}'


def test_nats_forward_to_a_subject_without_stream_is_retried(
    make_app, clock, make_worker, nats_url
):
    stream = forward("stream", nats_url, subject="wr-no-stream-here.x")
    app = make_app(config_with([stream]), **FAST)
    event_id = store_event(app, clock, dedup_key="evt-1")
    assert drain(app, make_worker(app, clock)) == ["retry"]
    assert "no JetStream stream" in delivery(app, event_id, "stream")["last_error"]


SIGNING_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
OLD_SECRET = "whsec_" + base64.b64encode(b"an older secret of 24 b.").decode()


def test_signed_http_forward_verifies_with_standardwebhooks_and_tampered_does_not(
    make_app, downstream, clock, make_worker
):
    billing = forward("billing", downstream.url + "/billing", signing_secret=SIGNING_SECRET)
    app = make_app(config_with([billing]), **FAST)
    store_event(app, clock, dedup_key="evt-1")
    assert drain(app, make_worker(app, clock)) == ["delivered"]
    [call] = downstream.calls_to("/billing")
    assert call.headers["webhook-id"] == "billing:shop:evt-1"
    verified = Webhook(SIGNING_SECRET).verify(call.body, call.headers)
    assert verified == {"type": "order.paid", "data": {}}
    with pytest.raises(WebhookVerificationError):
        Webhook(SIGNING_SECRET).verify(call.body.replace(b"paid", b"refunded"), call.headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(SIGNING_SECRET).verify(call.body, {**call.headers, "webhook-id": "other"})


def test_signed_http_forward_with_rotated_secrets_signs_with_each(
    make_app, downstream, clock, make_worker
):
    billing = forward(
        "billing", downstream.url + "/billing", signing_secrets=[SIGNING_SECRET, OLD_SECRET]
    )
    app = make_app(config_with([billing]), **FAST)
    store_event(app, clock, dedup_key="evt-1")
    drain(app, make_worker(app, clock))
    [call] = downstream.calls_to("/billing")
    assert len(call.headers["webhook-signature"].split(" ")) == 2
    for secret in (SIGNING_SECRET, OLD_SECRET):
        Webhook(secret).verify(call.body, call.headers)


def test_signed_http_forward_retried_signs_each_attempt_at_its_own_time(
    make_app, downstream, clock, make_worker
):
    billing = forward("billing", downstream.url + "/billing", signing_secret=SIGNING_SECRET)
    app = make_app(config_with([billing]), **FAST)
    downstream.replies["/billing"] = [Reply(503)]
    event_id = store_event(app, clock, dedup_key="evt-1")
    worker = make_worker(app, clock)
    assert drain(app, worker) == ["retry"]
    time.sleep(
        1.1
    )  # the timestamp is in whole seconds, and real: receivers check it against theirs
    clock.now = delivery(app, event_id, "billing")["next_attempt_at"]
    assert drain(app, worker) == ["delivered"]
    first, second = downstream.calls_to("/billing")
    assert first.headers["webhook-id"] == second.headers["webhook-id"] == "billing:shop:evt-1"
    assert int(second.headers["webhook-timestamp"]) > int(first.headers["webhook-timestamp"])
    for call in (first, second):
        Webhook(SIGNING_SECRET).verify(call.body, call.headers)


def _established_to(port: int) -> int:
    """TCP connections of this machine in ESTABLISHED state towards 127.0.0.1:``port``."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "01" and int(fields[2].rpartition(":")[2], 16) == port:
            count += 1
    return count


def test_nats_forward_retried_through_an_outage_keeps_one_connection(tmp_path):
    # nats-py's first connect retries for ever when told to reconnect for
    # ever: each publish retried while NATS was down used to leave one such
    # connect behind, and all of them connected once it was back.
    from webhook_receiver.config import ForwardConfig
    from webhook_receiver.processing import publishers

    from ..brokers.conftest import Stream, private_nats
    from ..servers import wait_until

    with private_nats(tmp_path) as server:
        stream = Stream(server.url, "WRFWDOUTAGE", "wrfwdoutage")
        stream.create()
        out = ForwardConfig(
            name="stream", url=server.url, timeout_seconds=1, subject="wrfwdoutage.x"
        )
        server.stop()
        for n in range(5):
            message = publishers.BrokerMessage(b"{}", "application/json", f"m-{n}", "c", "t")
            with pytest.raises(publishers.PublishError):
                publishers.publish(out, message)
        server.start()
        publishers.publish(out, publishers.BrokerMessage(b"{}", None, "m-ok", "c", "t"))
        time.sleep(2)  # time for any connect left behind to get through
        try:
            assert wait_until(lambda: _established_to(server.port) == 1, 5), _established_to(
                server.port
            )
        finally:
            loop = publishers.jetstream._loop()
            loop.run(loop.connections.pop(server.url).close(), 5)
