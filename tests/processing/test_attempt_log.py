"""The attempt log: one row per attempt, forwards and handlers, read back by the CLI."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import select

from webhook_receiver import retention
from webhook_receiver.extensions import db
from webhook_receiver.models import DeliveryAttempt, Event
from webhook_receiver.processing import attempts

from . import handlers as test_handlers
from .conftest import (
    FAST,
    Reply,
    config_with,
    delivery,
    drain,
    forward,
    store_event,
)


def _app(make_app, *forwards, **overrides):
    return make_app(config_with(list(forwards)), **{**FAST, **overrides})


def attempt_rows(app) -> list[dict[str, Any]]:
    """Every attempt, oldest first, as dicts."""
    with app.app_context():
        rows = db.session.scalars(select(DeliveryAttempt).order_by(DeliveryAttempt.id)).all()
        found = [
            {c.name: getattr(r, c.name) for c in DeliveryAttempt.__table__.columns} for r in rows
        ]
        db.session.rollback()
    return found


def run_until_done(app, worker, clock, rounds: int = 10) -> list[str]:
    """Drain, moving the clock to each retry, until nothing is left to do."""
    outcomes: list[str] = []
    for _ in range(rounds):
        done = drain(app, worker)
        outcomes += done
        if not done:
            return outcomes
        clock.advance(3600)
    raise AssertionError(f"still running after {rounds} rounds: {outcomes}")


def test_a_forward_failing_twice_then_succeeding_has_three_attempts(
    make_app, downstream, clock, make_worker
):
    app = _app(make_app, forward("billing", downstream.url + "/billing"))
    downstream.replies["/billing"] = [
        Reply(500, body=b"database on fire"),
        Reply(503, {"Retry-After": "2"}, b"busy", delay=0.05),
        Reply(201, body=b'{"received": true}'),
    ]
    event_id = store_event(app, clock, dedup_key="evt-1")
    worker = make_worker(app, clock)
    started = []
    for expected in (["retry"], ["retry"], ["delivered"]):
        started.append(clock())
        assert drain(app, worker) == expected
        clock.now = max(clock(), delivery(app, event_id, "billing")["next_attempt_at"])

    rows = attempt_rows(app)
    assert [r["number"] for r in rows] == [1, 2, 3]
    assert [r["outcome"] for r in rows] == [
        "retryable_failure",
        "retryable_failure",
        "delivered",
    ]
    assert [r["status"] for r in rows] == [500, 503, 201]
    assert [r["error"] for r in rows] == ["HTTP 500: database on fire", "HTTP 503: busy", None]
    assert [r["response_body"] for r in rows] == [
        "database on fire",
        "busy",
        '{"received": true}',
    ]
    assert [r["started_at"] for r in rows] == started
    assert all(r["ended_at"] == r["started_at"] for r in rows)  # the test's clock stands still
    assert rows[1]["latency_ms"] >= 50  # the downstream took 50 ms to answer
    assert all(r["latency_ms"] > 0 for r in rows)
    assert {r["delivery_id"] for r in rows} == {delivery(app, event_id, "billing")["id"]}
    assert all(r["worker"] == worker.name and r["replay_id"] is None for r in rows)

    result = app.test_cli_runner().invoke(args=["deliveries", "attempts", str(event_id)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("delivery ") and lines[0].endswith(
        "to billing (forward): delivered, 3 attempts"
    )
    assert [line.split()[0] for line in lines[1:]] == ["#1", "#2", "#3"]
    assert "retryable_failure  500" in lines[1] and "error: HTTP 500: database on fire" in lines[1]
    assert "retryable_failure  503" in lines[2] and "error: HTTP 503: busy" in lines[2]
    assert "delivered  201" in lines[3] and "error" not in lines[3]


def test_a_permanent_failure_is_one_attempt_and_out_of_attempts_says_so(
    make_app, downstream, clock, make_worker
):
    app = _app(
        make_app,
        forward("gone", downstream.url + "/gone"),
        forward("flaky", downstream.url + "/flaky", max_attempts=2),
    )
    downstream.replies["/gone"] = [Reply(410, body=b"no such hook")]
    downstream.replies["/flaky"] = [Reply(502), Reply(502)]
    event_id = store_event(app, clock, dedup_key="evt-1")
    run_until_done(app, make_worker(app, clock), clock)
    rows = attempt_rows(app)
    gone = delivery(app, event_id, "gone")
    flaky = delivery(app, event_id, "flaky")
    assert (gone["state"], flaky["state"]) == ("dead", "dead")
    by_delivery = {
        d: [
            (r["number"], r["outcome"], r["status"], r["error"])
            for r in rows
            if r["delivery_id"] == d
        ]
        for d in (gone["id"], flaky["id"])
    }
    assert by_delivery[gone["id"]] == [(1, "permanent_failure", 410, "HTTP 410: no such hook")]
    assert by_delivery[flaky["id"]] == [
        (1, "retryable_failure", 502, "HTTP 502: ok"),
        (2, "retryable_failure", 502, "out of attempts (2): HTTP 502: ok"),
    ]


def test_a_connection_refused_is_a_retryable_attempt_without_status(make_app, clock, make_worker):
    from ..servers import free_port

    app = _app(make_app, forward("nobody", f"http://127.0.0.1:{free_port()}/hook"))
    store_event(app, clock, dedup_key="evt-1")
    assert drain(app, make_worker(app, clock)) == ["retry"]
    [row] = attempt_rows(app)
    assert (row["outcome"], row["status"], row["response_body"]) == (
        "retryable_failure",
        None,
        None,
    )
    assert row["error"].startswith("ConnectionError")


def test_handlers_attempts_delivered_failed_and_refused(make_app, clock, make_worker, ledger):
    app = make_app(config_with(handlers=True), **FAST)
    ledger(app)
    test_handlers.failures["ledger"] = 1
    test_handlers.permanent.add("audit")
    event_id = store_event(app, clock, dedup_key="evt-1", event_type="order.paid")
    run_until_done(app, make_worker(app, clock), clock)
    rows = attempt_rows(app)
    by = {
        name: [
            (r["outcome"], r["error"])
            for r in rows
            if r["delivery_id"] == delivery(app, event_id, name)["id"]
        ]
        for name in ("ledger", "audit")
    }
    assert by["ledger"] == [
        ("retryable_failure", "RuntimeError: ledger is down"),
        ("delivered", None),
    ]
    assert by["audit"] == [
        ("permanent_failure", f"PermanentFailure: audit refuses event {event_id}")
    ]
    assert all(r["status"] is None and r["response_body"] is None for r in rows)


def test_a_stale_event_is_a_skipped_attempt(make_app, downstream, clock, make_worker):
    app = make_app(
        config_with([forward("billing", downstream.url + "/billing")], ordered=True), **FAST
    )
    newer = {"object": {"id": "o1", "version": 2}}
    older = {"object": {"id": "o1", "version": 1}}
    store_event(app, clock, dedup_key="v2", data=newer)
    stale = store_event(app, clock, dedup_key="v1", data=older)
    worker = make_worker(app, clock)
    assert drain(app, worker) == ["delivered", "skipped"]
    rows = attempt_rows(app)
    assert [r["outcome"] for r in rows] == ["delivered", "skipped"]
    assert rows[1]["delivery_id"] == delivery(app, stale, "billing")["id"]
    assert rows[1]["error"].startswith("stale")


def test_the_response_body_is_cut_at_2_kb_with_credentials_redacted(
    make_app, downstream, clock, make_worker
):
    app = _app(
        make_app,
        forward("billing", downstream.url + "/billing?token=query-secret-value"),
    )
    answer = (
        json.dumps(
            {
                "access_token": "tok_live_abcdef123456",
                "note": "echo of query-secret-value",
                "client_secret": "shh-very-secret",
                "amount": 42,
            }
        )
        + "\nAuthorization: Bearer eyJhbGciOiJIUzI1NiJ9.payload.signature\n"
        + "password=hunter2&user=alice\n"
        + "x" * 5000
    ).encode()
    # The downstream scripts a path with its query.
    downstream.replies["/billing?token=query-secret-value"] = [Reply(200, body=answer)]
    store_event(app, clock, dedup_key="evt-1")
    drain(app, make_worker(app, clock))
    [row] = attempt_rows(app)
    kept = row["response_body"]
    assert len(kept) <= 2048
    for secret in ("tok_live_abcdef123456", "query-secret-value", "shh-very-secret", "hunter2"):
        assert secret not in kept
    assert "eyJhbGciOiJIUzI1NiJ9" not in kept
    assert '"access_token": "[redacted]"' in kept
    assert '"client_secret": "[redacted]"' in kept
    assert "echo of [redacted]" in kept
    assert '"amount": 42' in kept and "user=alice" in kept
    assert kept.endswith("x")


def test_a_secret_cut_at_2_kb_is_redacted_all_the_same(make_app, downstream, clock, make_worker):
    app = _app(make_app, forward("billing", downstream.url + "/billing"))
    padding = "p" * 2015
    answer = json.dumps({"padding": padding, "api_key": "key-0123456789abcdef"}).encode()
    downstream.replies["/billing"] = [Reply(200, body=answer)]
    store_event(app, clock, dedup_key="evt-1")
    drain(app, make_worker(app, clock))
    [row] = attempt_rows(app)
    assert len(row["response_body"]) == 2048
    assert row["response_body"].endswith('"api_key": "[reda')
    assert "key-01" not in row["response_body"]


def test_redaction_leaves_ordinary_text_alone():
    text = 'HTTP 400: {"error": "missing field", "field": "amount"} retry=later'
    assert attempts.redact(text) == text
    assert attempts.redact("api_key: k-123456 and token=abc") == (
        "api_key: [redacted] and token=[redacted]"
    )


def test_a_broker_forward_attempt_records_its_confirmation(
    make_app, clock, make_worker, amqp_queue
):
    bus = forward("bus", amqp_queue.url, exchange="", routing_key=amqp_queue.name)
    app = _app(make_app, bus)
    store_event(app, clock, dedup_key="evt-1")
    assert drain(app, make_worker(app, clock)) == ["delivered"]
    [row] = attempt_rows(app)
    assert (row["outcome"], row["status"], row["confirmation"]) == (
        "delivered",
        None,
        "amqp: publish confirmed",
    )
    assert len(amqp_queue.take_all(amqp_queue.name)) == 1


def test_the_log_can_be_switched_off(make_app, downstream, clock, make_worker):
    app = _app(make_app, forward("billing", downstream.url + "/billing"), WORKER_ATTEMPT_LOG=False)
    event_id = store_event(app, clock, dedup_key="evt-1")
    assert drain(app, make_worker(app, clock)) == ["delivered"]
    assert delivery(app, event_id, "billing")["state"] == "delivered"
    assert attempt_rows(app) == []


def test_attempts_are_purged_with_their_event(make_app, downstream, clock, make_worker):
    app = _app(make_app, forward("billing", downstream.url + "/billing"))
    old = store_event(app, clock, dedup_key="old")
    drain(app, make_worker(app, clock))
    clock.advance(400 * 86400)
    kept = store_event(app, clock, dedup_key="new")
    drain(app, make_worker(app, clock))
    assert len(attempt_rows(app)) == 2
    with app.app_context():
        report = retention.purge(clock(), 100)
        assert report.events == 1
        assert db.session.get(Event, old) is None
    [row] = attempt_rows(app)
    assert row["delivery_id"] == delivery(app, kept, "billing")["id"]


def test_an_error_quoting_the_answer_keeps_its_credentials_out_everywhere(
    make_app, downstream, clock, make_worker
):
    """A failed answer's text is redacted once, where the error is made: the
    delivery's last error (the admin shows it) and the attempt row are the same."""
    secret = "whsec_" + "c2lnbmluZy1zZWNyZXQtMDEyMzQ1Njc4OWFi"
    app = _app(
        make_app,
        forward(
            "billing",
            downstream.url + "/billing?token=query-secret-value",
            signing_secret=secret,
        ),
    )
    answer = json.dumps(
        {"error": "refused", "api_key": "key-0123456789abcdef", "echo": secret}
    ).encode()
    downstream.replies["/billing?token=query-secret-value"] = [Reply(500, body=answer)]
    event_id = store_event(app, clock, dedup_key="evt-1")
    assert drain(app, make_worker(app, clock)) == ["retry"]
    last_error = delivery(app, event_id, "billing")["last_error"]
    [row] = attempt_rows(app)
    for stored in (last_error, row["error"]):
        assert stored.startswith('HTTP 500: {"error": "refused"')
        for leaked in ("key-0123456789abcdef", secret, "query-secret-value"):
            assert leaked not in stored
        assert '"api_key": "[redacted]"' in stored
    assert last_error == row["error"]
