"""Signed deliveries refused for what they hold: counted and listed in Rejections.

A signed delivery without a dedup key, with a body that is not JSON, or
without a Content-Type is refused (400, 415) and its sender retries it
unchanged; a WARNING line alone left an operator no counter to alert on and
nothing in the admin's Rejections.
"""

from __future__ import annotations

import time

import pytest
import stripe
from flask import Flask

from webhook_receiver.models import Event, Rejection
from webhook_receiver.observability import metrics

from ..helpers import count, post_webhook, rows
from ..helpers import signing as s

ADDRESS = "203.0.113.9"


@pytest.fixture
def app(make_app):
    return make_app({"sources": s.SOURCES})


def sample(app: Flask, name: str, reason: str) -> float:
    # The registry's gauges read the database: an app context for them.
    with app.app_context():
        registry = app.extensions[metrics.EXTENSION].registry
        found = registry.get_sample_value(name, {"source": "stripe-live", "reason": reason})
    return found or 0.0


def refusals(app: Flask, reason: str) -> float:
    return sample(app, "webhook_receiver_webhook_refusals_total", reason)


def signature_failures(app: Flask) -> float:
    return sample(app, "webhook_receiver_signature_failures_total", "signature")


def signed(body: bytes, **headers: str) -> dict[str, str]:
    header = stripe.WebhookSignature.generate_signature_header(
        body.decode(), s.STRIPE_SECRET, timestamp=int(time.time())
    )
    return {"Stripe-Signature": header, **headers}


def post(client, body: bytes, headers: dict[str, str]):
    return post_webhook(client, "stripe-live", body, headers, environ_base={"REMOTE_ADDR": ADDRESS})


def rejection_rows(app: Flask) -> list[tuple[str, str, str | None, int, str | None]]:
    return sorted(
        (r.source, r.reason, r.remote_addr, r.seen_count, r.detail) for r in rows(app, Rejection)
    )


def test_a_signed_delivery_without_a_dedup_key_is_counted_and_listed(app, client):
    body, headers = s.stripe_delivery({"type": "invoice.paid"})
    for _ in range(2):  # the sender retries it unchanged, refused each time
        assert post(client, body, headers).status_code == 400
    assert refusals(app, "dedup-key-missing") == 2
    [(source, reason, address, seen, detail)] = rejection_rows(app)
    assert (source, reason, address, seen) == (
        "stripe-live",
        "refused-dedup-key-missing",
        ADDRESS,
        2,
    )
    assert detail
    # Refused for what it holds, not for who sent it.
    assert signature_failures(app) == 0
    assert count(app, Event) == 0


def test_a_signed_body_that_is_not_json_is_counted_and_listed(app, client):
    body = b'{"id": "evt_1", "type":'
    response = post(client, body, signed(body, **{"Content-Type": "application/json"}))
    assert response.status_code == 400
    assert response.get_json()["type"] == "/problems/payload-invalid"
    assert refusals(app, "payload-invalid") == 1
    assert [row[:4] for row in rejection_rows(app)] == [
        ("stripe-live", "refused-payload-invalid", ADDRESS, 1)
    ]


def test_a_signed_delivery_without_a_content_type_is_counted_and_listed(app, client):
    body = s.dumps({"id": "evt_1", "type": "invoice.paid"})
    response = post(client, body, signed(body))
    assert response.status_code == 415
    assert refusals(app, "unsupported-media-type") == 1
    assert [row[:4] for row in rejection_rows(app)] == [
        ("stripe-live", "refused-unsupported-media-type", ADDRESS, 1)
    ]


def test_an_unauthentic_delivery_is_a_signature_failure_only(app, client):
    # No key and a forged signature: refused for its signature, and counted
    # there alone, never a second time as a refusal for what it holds.
    body, headers = s.stripe_delivery({"type": "invoice.paid"}, secret="whsec_forged")
    assert post(client, body, headers).status_code == 401
    assert signature_failures(app) == 1
    assert refusals(app, "dedup-key-missing") == 0
    assert [row[:4] for row in rejection_rows(app)] == [("stripe-live", "signature", ADDRESS, 1)]


def test_the_refusals_metric_is_served_before_any_refusal(app, client):
    # An alert on it needs the family in every scrape.
    text = client.get("/metrics").get_data(as_text=True)
    assert "# TYPE webhook_receiver_webhook_refusals_total counter" in text


def test_a_delivery_unreadable_before_its_signature_is_counted_logged_and_listed(
    app, client, caplog
):
    # A doubled webhook-id is refused (400) before any signature is checked:
    # its sender is unknown, so it is counted beside the signature failures,
    # never as a signed delivery's refusal; a flood is one row a minute.
    body, headers = s.delivery_for("svix", "msg_1")
    headers = {**headers, "webhook-id": "msg_1,msg_1", "webhook-signature": "v1,forged"}
    for _ in range(3):
        response = post_webhook(
            client, "svix", body, headers, environ_base={"REMOTE_ADDR": ADDRESS}
        )
        assert response.status_code == 400
        assert response.get_json()["type"] == "/problems/payload-invalid"
    with app.app_context():
        registry = app.extensions[metrics.EXTENSION].registry
        unreadable = registry.get_sample_value(
            "webhook_receiver_signature_failures_total", {"source": "svix", "reason": "unreadable"}
        )
        refused = registry.get_sample_value(
            "webhook_receiver_webhook_refusals_total",
            {"source": "svix", "reason": "payload-invalid"},
        )
    assert (unreadable, refused) == (3, None)
    assert [(r.source, r.reason, r.remote_addr, r.seen_count) for r in rows(app, Rejection)] == [
        ("svix", "unreadable", ADDRESS, 3)
    ]
    logged = [r for r in caplog.records if r.getMessage() == "delivery refused"]
    assert [(r.outcome, r.source) for r in logged] == [("rejected_unreadable", "svix")] * 3
    assert count(app, Event) == 0
