"""Deliveries that providers legitimately send, received through the app on both databases.

GitHub's form content type, Shopify's unprefixed headers (as the official
@shopify/shopify-api validates them), Slack's callbacks without an event_id,
the CloudEvents webhook validation handshake, and events made by the
``cloudevents`` SDK in binary and structured mode.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from urllib.parse import urlencode

import pytest
from cloudevents.core.bindings import http as ce_http
from cloudevents.core.v1.event import CloudEvent

from webhook_receiver.models import Event, EventConflict, Rejection

from ..helpers import count, rows
from ..helpers import signing as s

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
FORM = "application/x-www-form-urlencoded"
ISSUE = {"action": "opened", "issue": {"number": 1, "title": "Forms too"}}


@pytest.fixture
def app(make_app):
    return make_app({"sources": s.SOURCES})


def github_form(payload: dict, delivery: str, event: str = "issues") -> tuple[bytes, dict]:
    """A delivery of a webhook whose content type is application/x-www-form-urlencoded."""
    body = urlencode({"payload": json.dumps(payload, separators=(",", ":"))}).encode()
    json_body, headers = s.github_delivery(payload, delivery, event)
    signature = s.hmac_hex(body, s.GITHUB_SECRET)
    return body, {**headers, "Content-Type": FORM, "X-Hub-Signature-256": f"sha256={signature}"}


# GitHub


def test_github_form_delivery_is_accepted_and_stored_raw(app):
    body, headers = github_form(ISSUE, "d-form-1")
    response = app.test_client().post("/webhooks/github", data=body, headers=headers)
    assert response.status_code == 200, response.get_json()
    (event,) = rows(app, Event)
    assert response.get_json() == {"status": "accepted", "event_id": event.id}
    assert (event.dedup_key, event.event_type) == ("d-form-1", "issues.opened")
    assert event.body == body
    assert event.content_type == FORM


@pytest.mark.parametrize("first", ["form", "json"])
def test_github_form_and_json_delivery_of_the_same_content_are_one_event(app, first):
    # The webhook's content type was changed between the delivery and its redelivery.
    form = github_form(ISSUE, "d-same")
    as_json = s.github_delivery(ISSUE, "d-same", "issues")
    client = app.test_client()
    one, other = (form, as_json) if first == "form" else (as_json, form)
    accepted = client.post("/webhooks/github", data=one[0], headers=one[1])
    replayed = client.post("/webhooks/github", data=other[0], headers=other[1])
    assert accepted.status_code == replayed.status_code == 200
    assert replayed.headers["Idempotent-Replayed"] == "true"
    assert replayed.get_json() == accepted.get_json()
    (event,) = rows(app, Event)
    assert event.body == one[0]


def test_github_form_delivery_with_other_content_is_a_conflict(app):
    client = app.test_client()
    client.post(
        "/webhooks/github", data=github_form(ISSUE, "d-c")[0], headers=github_form(ISSUE, "d-c")[1]
    )
    changed = github_form({**ISSUE, "action": "closed"}, "d-c")
    response = client.post("/webhooks/github", data=changed[0], headers=changed[1])
    assert response.status_code == 422
    assert count(app, EventConflict) == 1


@pytest.mark.parametrize(
    "body", [b"payload=not-json", b"nothing=here", b"payload=%7B%7D&payload=%7B%7D", b"payload=%FF"]
)
def test_github_unreadable_form_is_400_and_stores_nothing(app, body):
    headers = {
        **github_form(ISSUE, "d-bad")[1],
        "X-Hub-Signature-256": "sha256=" + s.hmac_hex(body, s.GITHUB_SECRET),
    }
    response = app.test_client().post("/webhooks/github", data=body, headers=headers)
    assert response.status_code == 400
    assert response.mimetype == "application/problem+json"
    assert response.get_json()["type"] == "/problems/payload-invalid"
    assert count(app, Event) == 0


def test_github_form_with_a_bad_signature_is_401(app):
    body, headers = github_form(ISSUE, "d-401")
    headers["X-Hub-Signature-256"] = "sha256=" + s.hmac_hex(
        json.dumps(ISSUE).encode(), s.GITHUB_SECRET
    )
    response = app.test_client().post("/webhooks/github", data=body, headers=headers)
    assert response.status_code == 401
    assert count(app, Event) == 0
    assert count(app, Rejection) == 1


# Shopify: every case the generator put through @shopify/shopify-api's webhooks.validate.

SHOPIFY = json.loads((FIXTURES / "shopify_validate.json").read_text())


@pytest.mark.parametrize("case", SHOPIFY["cases"], ids=[c["name"] for c in SHOPIFY["cases"]])
def test_shopify_headers_are_judged_as_the_official_library_judges_them(app, case):
    response = app.test_client().post("/webhooks/shop", data=case["body"], headers=case["headers"])
    if not case["library"]["valid"]:
        assert response.status_code == 401
        assert response.get_json()["type"] == "/problems/signature-invalid"
        assert count(app, Event) == 0
        assert count(app, Rejection) == 1
        return
    assert response.status_code == 200, response.get_json()
    (event,) = rows(app, Event)
    assert event.dedup_key == case["library"]["webhookId"]
    assert event.event_type == "orders/create"
    family = "shopify" if "shopify-hmac-sha256" in case["headers"] else "x-shopify"
    assert (
        event.meta["shopify_event_id"]
        == case["headers"][next(k for k in case["headers"] if k.lower() == f"{family}-event-id")]
    )
    stored = {k.lower(): v for k, v in event.headers}
    for name in ("shopify-hmac-sha256", "x-shopify-hmac-sha256"):
        if name in stored:
            assert stored[name] == "[redacted]"
    again = app.test_client().post("/webhooks/shop", data=case["body"], headers=case["headers"])
    assert again.headers["Idempotent-Replayed"] == "true"


# Slack


@pytest.mark.parametrize(
    "payload",
    [
        {
            "token": "Jhj5dZrVaK7ZwHHjRyZWjbDl",
            "type": "app_rate_limited",
            "team_id": "T123456",
            "minute_rate_limited": 1518467820,
            "api_app_id": "A123456",
        },
        {"type": "app_uninstalled_notice", "team_id": "T123456", "api_app_id": "A123456"},
    ],
    ids=["app_rate_limited", "another"],
)
def test_slack_callback_without_event_id_is_ignored(app, payload, caplog):
    body, headers = s.slack_delivery(payload)
    with caplog.at_level("INFO"):
        response = app.test_client().post("/webhooks/slack", data=body, headers=headers)
    assert response.status_code == 200
    assert response.get_json() == {"status": "ignored", "type": payload["type"]}
    assert count(app, Event) == 0
    assert any(
        r.levelname == "INFO" and getattr(r, "outcome", None) == "ignored" for r in caplog.records
    )


def test_slack_callback_without_event_id_must_still_be_signed(app):
    body, headers = s.slack_delivery({"type": "app_rate_limited"})
    headers["X-Slack-Signature"] = "v0=" + "0" * 64
    response = app.test_client().post("/webhooks/slack", data=body, headers=headers)
    assert response.status_code == 401
    assert count(app, Rejection) == 1


@pytest.mark.parametrize(
    "fields",
    [
        # Interactivity (a button pressed): the JSON in a payload field.
        {"payload": json.dumps({"type": "block_actions", "trigger_id": "1.2.a"})},
        # A slash command: the fields themselves.
        {"command": "/deploy", "text": "prod", "trigger_id": "1.2.b"},
    ],
)
def test_slack_form_requests_are_refused_saying_what_they_are(app, fields):
    # Slack signs interactivity and slash commands as it does events, but sends
    # them form-encoded, with no event_id, and waits for an answer of their own:
    # the preset receives Events API requests only, and the refusal says so.
    body = urlencode(fields).encode()
    _, headers = s.slack_delivery({})
    stamp = headers["X-Slack-Request-Timestamp"]
    headers["X-Slack-Signature"] = s.slack_signature(body, s.SLACK_SECRET, stamp)
    headers["Content-Type"] = "application/x-www-form-urlencoded"
    response = app.test_client().post("/webhooks/slack", data=body, headers=headers)
    assert response.status_code == 400
    assert response.json["type"] == "/problems/payload-invalid"
    assert "interactivity" in response.json["detail"]
    assert "Events API" in response.json["detail"]
    assert count(app, Event) == 0
    assert [r.reason for r in rows(app, Rejection)] == ["refused-payload-invalid"]
    # Unsigned, it is a forgery like any other.
    headers["X-Slack-Signature"] = "v0=" + "0" * 64
    response = app.test_client().post("/webhooks/slack", data=body, headers=headers)
    assert response.status_code == 401


# CloudEvents


def test_cloudevents_validation_handshake(app):
    client = app.test_client()
    response = client.options(
        "/webhooks/ce",
        headers={"WebHook-Request-Origin": "eventgrid.azure.net", "WebHook-Request-Rate": "120"},
    )
    assert response.status_code == 200
    assert response.headers["WebHook-Allowed-Origin"] == "eventgrid.azure.net"
    assert response.headers["WebHook-Allowed-Rate"] == "*"
    assert response.headers["Allow"] == "POST, OPTIONS"
    # Allowing delivery, the answer carries both headers, a rate asked for or not (4.2).
    no_rate = client.options("/webhooks/ce", headers={"WebHook-Request-Origin": "a.example"})
    assert no_rate.headers["WebHook-Allowed-Origin"] == "a.example"
    assert no_rate.headers["WebHook-Allowed-Rate"] == "*"
    assert count(app, Event) == 0


@pytest.mark.parametrize(
    ("source", "headers"),
    [
        ("ce", {}),
        ("github", {"WebHook-Request-Origin": "eventgrid.azure.net"}),
        ("no-such-source", {"WebHook-Request-Origin": "eventgrid.azure.net"}),
    ],
)
def test_other_options_requests_are_answered_as_before(app, source, headers):
    response = app.test_client().options(f"/webhooks/{source}", headers=headers)
    assert response.status_code == 200
    assert set(response.headers["Allow"].split(", ")) == {"OPTIONS", "POST"}
    assert "WebHook-Allowed-Origin" not in response.headers


def test_cloudevents_handshake_with_a_bad_origin_is_400(app):
    response = app.test_client().options(
        "/webhooks/ce", headers={"WebHook-Request-Origin": "not a host"}
    )
    assert response.status_code == 400
    assert response.mimetype == "application/problem+json"


@pytest.mark.parametrize("mode", ["binary", "structured"])
def test_cloudevents_sdk_events_are_received_once(app, mode):
    event = CloudEvent(
        attributes={
            "type": "com.example.order.created",
            "source": "/orders",
            "id": str(uuid.uuid4()),
        },
        data={"order": 42},
    )
    convert = ce_http.to_binary_event if mode == "binary" else ce_http.to_structured_event
    message = convert(event)
    headers = {**message.headers, "X-Signature": "sha256=" + s.hmac_hex(message.body)}
    if mode == "binary":
        headers.setdefault("content-type", "application/json")
    client = app.test_client()
    first = client.post("/webhooks/ce", data=message.body, headers=headers)
    assert first.status_code == 200, first.get_json()
    again = client.post("/webhooks/ce", data=message.body, headers=headers)
    assert again.headers["Idempotent-Replayed"] == "true"
    (stored,) = rows(app, Event)
    assert stored.dedup_key == json.dumps(["/orders", event.get_id()], separators=(",", ":"))
    assert stored.event_type == "com.example.order.created"
    assert stored.meta["ce_mode"] == mode


def test_cloudevents_binary_mode_attributes_are_percent_decoded(app):
    # The HTTP binding (3.1.3.2) percent-encodes a space, '"', '%' and
    # non-ASCII in ce-* headers, and the SDK does: the key and type are the
    # event's attributes, decoded, as a structured delivery of it gives them.
    event = CloudEvent(
        attributes={
            "type": "com.example.order created",
            "source": "/shops/Zürich store",
            "id": "order 42%",
        },
        data={"order": 42},
    )
    message = ce_http.to_binary_event(event)
    assert message.headers["ce-source"] == "/shops/Z%C3%BCrich%20store"
    headers = {
        **message.headers,
        "X-Signature": "sha256=" + s.hmac_hex(message.body),
        "content-type": "application/json",
    }
    response = app.test_client().post("/webhooks/ce", data=message.body, headers=headers)
    assert response.status_code == 200, response.get_json()
    (stored,) = rows(app, Event)
    attributes = ["/shops/Zürich store", "order 42%"]
    assert stored.dedup_key == json.dumps(attributes, separators=(",", ":"), ensure_ascii=False)
    assert stored.event_type == "com.example.order created"


def test_cloudevents_binary_mode_header_that_is_not_percent_encoded_utf8_is_400(app):
    body = b'{"order": 1}'
    headers = {
        "X-Signature": "sha256=" + s.hmac_hex(body),
        "ce-id": "o-%FF",
        "ce-source": "/orders",
        "ce-type": "t",
        "ce-specversion": "1.0",
        "Content-Type": "application/json",
    }
    response = app.test_client().post("/webhooks/ce", data=body, headers=headers)
    assert response.status_code == 400
    assert response.mimetype == "application/problem+json"
    assert count(app, Event) == 0
