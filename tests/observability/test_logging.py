"""Structured logs: one JSON line per receipt or request, with its fields and nothing secret."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys

import pytest
import requests
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from webhook_receiver import create_app
from webhook_receiver.config import ConfigError
from webhook_receiver.extensions import db
from webhook_receiver.observability import logging as obs_logging

from ..brokers.conftest import (
    consuming,
    count_events,
    dead_letter_count,
    rabbit_source,
    wait_until,
)
from ..conftest import ACME_TOKEN, CLIENTS, SECRET_KEY, bearer
from ..helpers import signing as s
from ..servers import ROOT, gunicorn

CONFIG = {"sources": {"stripe-live": s.SOURCES["stripe-live"]}, "clients": CLIENTS}
# A body marker that must never reach a log line.
MARKER = "body-marker-5f1c2e"
FIELDS = {"source", "dedup_key", "event_id", "outcome", "correlation_id"}


@pytest.fixture
def app(make_app):
    return make_app(CONFIG)


def lines(buffer: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


def assert_clean(output: str) -> None:
    for secret in (s.STRIPE_SECRET, MARKER, ACME_TOKEN, "v1="):
        assert secret not in output


def stripe_body(event_id: str = "evt_log"):
    return s.stripe_delivery({"id": event_id, "type": "invoice.paid", "data": {"note": MARKER}})


def test_a_receipt_logs_one_json_line_with_its_fields(app, client, captured):
    body, headers = stripe_body()
    first = client.post(
        "/webhooks/stripe-live", data=body, headers={**headers, "X-Request-Id": "r-1"}
    )
    again = client.post("/webhooks/stripe-live", data=body, headers=headers)
    event_id = first.get_json()["event_id"]
    accepted, duplicate = lines(captured)
    assert FIELDS <= accepted.keys()
    assert {k: accepted[k] for k in FIELDS} == {
        "source": "stripe-live",
        "dedup_key": "evt_log",
        "event_id": event_id,
        "outcome": "accepted",
        "correlation_id": "r-1",
    }
    assert accepted["level"] == "INFO" and accepted["logger"] == "webhook_receiver.inbox.store"
    assert accepted["time"].endswith("+00:00")
    # Without an id of the caller's, one is made up, returned and logged.
    assert duplicate["outcome"] == "duplicate"
    assert duplicate["correlation_id"] == again.headers["X-Request-Id"]
    assert len(duplicate["correlation_id"]) == 32
    assert_clean(captured.getvalue())


def test_traceparent_gives_the_correlation_id(app, client, captured):
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    body, headers = stripe_body()
    response = client.post(
        "/webhooks/stripe-live",
        data=body,
        headers={**headers, "traceparent": f"00-{trace}-00f067aa0ba902b7-01"},
    )
    assert response.headers["X-Request-Id"] == trace
    (line,) = lines(captured)
    assert line["correlation_id"] == trace


def test_refusals_and_api_requests_log_their_outcome(app, client, captured):
    body, headers = stripe_body()
    client.post("/webhooks/stripe-live", data=body + b" ", headers=headers)  # signature fails
    order = json.dumps({"type": "order.created", "data": {"note": MARKER}})
    for payload in (order, order, order.replace("order.created", "order.changed")):
        client.post(
            "/api/events",
            data=payload,
            content_type="application/json",
            headers={**bearer(), "Idempotency-Key": "key-1", "X-Request-Id": "api-req"},
        )
    refused, completed, replay, mismatch = lines(captured)
    assert refused["outcome"] == "rejected_signature" and refused["source"] == "stripe-live"
    assert [completed["outcome"], replay["outcome"], mismatch["outcome"]] == [
        "completed",
        "replay",
        "mismatch",
    ]
    for line in (completed, replay, mismatch):
        assert line["source"] == "api:acme" and line["dedup_key"] == "key-1"
        assert line["correlation_id"] == "api-req"
    assert (completed["status"], replay["status"], mismatch["status"]) == (201, 201, 422)
    assert_clean(captured.getvalue())


def test_a_dedup_key_with_a_newline_cannot_forge_a_line(app, client, captured):
    forged = 'evt_1\n{"level": "INFO", "outcome": "accepted"}'
    body, headers = s.stripe_delivery({"id": forged, "type": "t", "data": {}})
    assert client.post("/webhooks/stripe-live", data=body, headers=headers).status_code == 200
    (line,) = lines(captured)
    assert line["dedup_key"] == forged


def test_text_format_shows_the_fields(app, client):
    logger = logging.getLogger(obs_logging.PACKAGE_LOGGER)
    saved = (list(logger.handlers), logger.level, logger.propagate)
    buffer = io.StringIO()
    try:
        obs_logging.configure("text", stream=buffer)
        body, headers = stripe_body()
        client.post("/webhooks/stripe-live", data=body, headers={**headers, "X-Request-Id": "t-1"})
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved
    output = buffer.getvalue()
    assert "INFO webhook_receiver.inbox.store: delivery accepted" in output
    assert "source='stripe-live' dedup_key='evt_log'" in output
    assert "correlation_id='t-1'" in output


def test_failed_statements_keep_their_parameters_out_of_messages(app):
    with app.app_context(), pytest.raises(DBAPIError) as caught:
        db.session.execute(text("SELECT * FROM no_such_table WHERE x = :p"), {"p": MARKER})
    assert MARKER not in str(caught.value)


def test_log_format_is_validated(tmp_path):
    with pytest.raises(ConfigError, match="LOG_FORMAT"):
        create_app(
            {
                "TESTING": True,
                "LOG_FORMAT": "xml",
                "SQLALCHEMY_DATABASE_URI": f"sqlite:///{tmp_path}/x.sqlite3",
                "RECEIVER_CONFIG": {},
            }
        )


def test_create_app_configures_json_logs_unless_configured_already(tmp_path):
    # A fresh interpreter: pytest's own handlers on the root logger count as
    # "configured" here.
    script = f"""
import logging
from webhook_receiver import create_app
base = {{"SECRET_KEY": {SECRET_KEY!r}, "RECEIVER_CONFIG": {{}},
        "SQLALCHEMY_DATABASE_URI": "sqlite:///{tmp_path}/x.sqlite3"}}
create_app({{**base, "TESTING": True}})
logging.getLogger("webhook_receiver.x").warning("testing: not configured")
create_app(base).logger.info("json", extra={{"outcome": "ok"}})
create_app({{**base, "LOG_FORMAT": "text"}}).logger.info("as text")
logging.basicConfig()
create_app(base)  # the root logger is configured: left alone, ours stays
logging.getLogger("webhook_receiver.x").info("still text")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    out = done.stderr.splitlines()
    assert out[0] == "testing: not configured"  # Python's last-resort handler
    assert json.loads(out[1])["outcome"] == "ok"
    assert out[2].endswith("INFO webhook_receiver: as text")
    assert out[3].endswith("INFO webhook_receiver.x: still text")
    assert len(out) == 4


GUNICORN_CONFIG = f"""
[sources.stripe-live]
provider = "stripe"
secrets = ["{s.STRIPE_SECRET}"]

[clients.acme]
token = "{ACME_TOKEN}"
"""


@pytest.mark.slow
def test_gunicorn_writes_json_receipt_lines_to_stderr(db_url, tmp_path):
    body, headers = stripe_body("evt_gunicorn")
    with gunicorn(db_url, GUNICORN_CONFIG, tmp_path, workers=2) as server:
        response = requests.post(
            f"{server.url}/webhooks/stripe-live",
            data=body,
            headers={**headers, "X-Request-Id": "gunicorn-1"},
            timeout=10,
        )
        assert response.status_code == 200
        api = requests.post(
            f"{server.url}/api/events",
            data=json.dumps({"type": "t", "data": MARKER}),
            headers={**bearer(), "Idempotency-Key": "g-1", "Content-Type": "application/json"},
            timeout=10,
        )
        assert api.status_code == 201
        # The default multiprocess directory of gunicorn.conf.py is in use.
        scraped = requests.get(f"{server.url}/metrics", timeout=10).text
        assert 'webhook_receiver_received_total{source="stripe-live"} 1.0' in scraped
        assert 'webhook_receiver_received_total{source="api:acme"} 1.0' in scraped
    log = server.log()
    # Every line is a JSON object: gunicorn's own (start, workers, stop) too.
    records = [json.loads(line) for line in log.splitlines() if line.strip()]
    listening = f"Listening at: {server.url} ({server.process.pid})"
    assert listening in {r["message"] for r in records if r["logger"] == "gunicorn.error"}
    (receipt,) = [r for r in records if r.get("correlation_id") == "gunicorn-1"]
    assert receipt["outcome"] == "accepted" and receipt["dedup_key"] == "evt_gunicorn"
    assert receipt["event_id"] == response.json()["event_id"]
    (created,) = [r for r in records if r.get("source") == "api:acme"]
    assert created["outcome"] == "completed" and created["dedup_key"] == "g-1"
    assert_clean(log)


@pytest.mark.parametrize("level", ["verbose", "loud", True, 1.5])
def test_log_level_is_validated(tmp_path, level):
    # An unknown WEBHOOK_RECEIVER_LOG_LEVEL ended create_app with logging's
    # ValueError: a traceback under the flask CLI and gunicorn, where a bad
    # LOG_FORMAT is one line naming the setting.
    with pytest.raises(ConfigError, match="LOG_LEVEL"):
        create_app(
            {
                "TESTING": True,
                "LOG_LEVEL": level,
                "SQLALCHEMY_DATABASE_URI": f"sqlite:///{tmp_path}/x.sqlite3",
                "RECEIVER_CONFIG": {},
            }
        )


@pytest.mark.parametrize("level", ["debug", "WARNING", 10, "", None])
def test_known_log_levels_are_taken(tmp_path, level):
    create_app(
        {
            "TESTING": True,
            "LOG_LEVEL": level,
            "SQLALCHEMY_DATABASE_URI": f"sqlite:///{tmp_path}/x.sqlite3",
            "RECEIVER_CONFIG": {},
        }
    )


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("a" * 200, True),
        ("a" * 201, False),
        ("req\x01id", False),
        ("req\tid", False),
        ("req id", False),
        ("rëq", False),
    ],
)
def test_a_callers_request_id_is_kept_only_when_bounded_and_plain(
    app, client, captured, given, kept
):
    from webhook_receiver.models import Event

    response = client.post(
        "/api/events",
        data=json.dumps({"type": "t", "data": 1}),
        content_type="application/json",
        headers={**bearer(), "Idempotency-Key": "rid-1", "X-Request-Id": given},
    )
    assert response.status_code == 201
    echoed = response.headers["X-Request-Id"]
    assert (echoed == given) is kept
    assert len(echoed) <= 200 and echoed.isprintable() and " " not in echoed
    (line,) = lines(captured)
    assert line["correlation_id"] == echoed
    with app.app_context():
        assert db.session.get(Event, response.get_json()["id"]).correlation_id == echoed


def test_a_broker_message_dead_lettered_logs_its_key_and_correlation_id(
    make_app, amqp_queue, captured
):
    # An over-long type is refused once the key is read; a keyless message has
    # none to name. Both name the producer's correlation id, as a stored one does.
    source = rabbit_source(amqp_queue, event_type="json:/type")
    app = make_app({"sources": {"orders": source}})
    props = {"content_type": "application/json", "correlation_id": "corr-7"}
    amqp_queue.publish(
        [
            (b'{"type": "%s"}' % (b"t" * 300), {**props, "message_id": "m-long"}),
            (b'{"type": "order"}', {**props, "correlation_id": "corr-8"}),
            (b'{"type": "order"}', {**props, "message_id": "m-ok"}),
        ]
    )
    with consuming(app, "orders"):
        assert wait_until(lambda: count_events(app) == 1)
        assert wait_until(
            lambda: (
                dead_letter_count(app, "orders", "payload-invalid") == 1
                and dead_letter_count(app, "orders", "dedup-key-missing") == 1
            )
        )
    logged = lines(captured)
    dead = {line["reason"]: line for line in logged if line.get("outcome") == "dead_letter"}
    assert dead["payload-invalid"]["dedup_key"] == "m-long"
    assert dead["payload-invalid"]["correlation_id"] == "corr-7"
    assert "dedup_key" not in dead["dedup-key-missing"]
    assert dead["dedup-key-missing"]["correlation_id"] == "corr-8"
    [stored] = [line for line in logged if line.get("outcome") == "batch"]
    assert stored["messages"][0]["correlation_id"] == "corr-7"


def test_a_signed_delivery_refused_after_its_key_was_read_logs_the_key(app, client, captured):
    # Refused by the storage boundary once identified: a Content-Type too long
    # to store (415), a type holding a NUL (400). The key was read: the line
    # names it, so the provider's delivery can be found. A key too long to
    # read is named by no line.
    body, headers = stripe_body("evt_long_type")
    long_type = {**headers, "Content-Type": "application/json; x=" + "a" * 300}
    assert client.post("/webhooks/stripe-live", data=body, headers=long_type).status_code == 415
    body, headers = s.stripe_delivery({"id": "evt_nul", "type": "invoice\x00paid"})
    assert client.post("/webhooks/stripe-live", data=body, headers=headers).status_code == 400
    body, headers = s.stripe_delivery({"id": "k" * 513, "type": "invoice.paid"})
    assert client.post("/webhooks/stripe-live", data=body, headers=headers).status_code == 400
    refused = [line for line in lines(captured) if line["message"] == "delivery refused"]
    assert [(line["outcome"], line.get("dedup_key")) for line in refused] == [
        ("refused_unsupported-media-type", "evt_long_type"),
        ("refused_payload-invalid", "evt_nul"),
        ("refused_dedup-key-missing", None),
    ]
    assert_clean(captured.getvalue())
