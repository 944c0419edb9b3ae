"""A lone surrogate escape ("\\ud800") in a JSON provider's delivery: stored as sent.

RFC 8259 allows the escape; the receipt read Stripe's, GitHub's, Slack's and
the other JSON providers' bodies strictly, so such a body was a 400 where a
CloudEvent or a broker message holding one is stored. Only a dedup key or an
event type holding one is refused (no database stores it as text), with a
400 naming where it came from. The admin shows the stored event. Sent
through the app on both databases.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import pytest

from webhook_receiver.models import Event, EventConflict

from ..admin.conftest import PASSWORD, login
from ..helpers import count, post_webhook, rows
from ..helpers import signing as s

NOTE = "x\ud800y"
OTHER_NOTE = "x\udc01y"

Delivery = tuple[bytes, dict[str, str]]


def generic(payload: dict[str, Any]) -> Delivery:
    body = s.dumps(payload)
    return body, {"X-Hub-Signature": s.hmac_hex(body), "Content-Type": "application/json"}


def gitlab(payload: dict[str, Any], key: str) -> Delivery:
    return s.dumps(payload), {
        "X-Gitlab-Token": s.GITLAB_SECRET,
        "X-Gitlab-Event-UUID": key,
        "Content-Type": "application/json",
    }


# Each source's delivery under ``key`` with ``note`` in a member that is no key or type.
BUILDERS: dict[str, Callable[[str, str], Delivery]] = {
    "stripe-live": lambda key, note: s.stripe_delivery(
        {"id": key, "type": "invoice.paid", "data": {"note": note}}
    ),
    "paddle": lambda key, note: s.paddle_delivery(
        {"event_id": key, "event_type": "transaction.created", "data": {"note": note}}
    ),
    "slack": lambda key, note: s.slack_delivery(
        {"type": "event_callback", "event_id": key, "event": {"type": "message", "text": note}}
    ),
    "svix": lambda key, note: s.standard_delivery({"type": "x", "note": note}, msg_id=key),
    "github": lambda key, note: s.github_delivery({"action": "opened", "note": note}, key),
    "shop": lambda key, note: s.shopify_delivery({"id": 1, "note": note}, webhook_id=key),
    "gitlab": lambda key, note: gitlab({"object_kind": "push", "note": note}, key),
    "generic-json": lambda key, note: generic({"meta": {"delivery": key}, "note": note}),
}


@pytest.fixture
def app(make_app):
    return make_app({"sources": s.SOURCES}, ADMIN_PASSWORD=PASSWORD)


@pytest.mark.parametrize("source", sorted(BUILDERS))
def test_one_in_another_member_is_stored_as_sent(app, source):
    client = app.test_client()
    body, headers = BUILDERS[source]("key-1", NOTE)
    assert b"\\ud800" in body  # the escape, as JSON text
    first = post_webhook(client, source, body, headers)
    assert first.status_code == 200, first.get_json()
    (stored,) = rows(app, Event)
    assert bytes(stored.body) == body
    again = post_webhook(client, source, *BUILDERS[source]("key-1", NOTE))
    assert again.status_code == 200, again.get_json()
    assert again.headers["Idempotent-Replayed"] == "true"
    # Another surrogate is other content under the same key.
    other = post_webhook(client, source, *BUILDERS[source]("key-1", OTHER_NOTE))
    assert other.status_code == 422, other.get_json()
    assert count(app, Event) == count(app, EventConflict) == 1


def test_a_github_form_delivery_holding_one_is_the_json_one(app):
    client = app.test_client()
    body, headers = BUILDERS["github"]("d-1", NOTE)
    form = b"payload=" + quote(body.decode()).encode()
    form_headers = {
        **headers,
        "X-Hub-Signature-256": "sha256=" + s.hmac_hex(form, s.GITHUB_SECRET),
        "Content-Type": "application/x-www-form-urlencoded",
    }
    first = post_webhook(client, "github", form, form_headers)
    assert first.status_code == 200, first.get_json()
    (stored,) = rows(app, Event)
    assert bytes(stored.body) == form
    again = post_webhook(client, "github", body, headers)
    assert again.headers["Idempotent-Replayed"] == "true", again.get_json()


@pytest.mark.parametrize(
    ("source", "delivery", "said"),
    [
        ("stripe-live", lambda: s.stripe_delivery({"id": "evt_\ud800", "type": "t"}), "(from id)"),
        (
            "paddle",
            lambda: s.paddle_delivery({"event_id": "evt_\ud800", "event_type": "t"}),
            "(from event_id)",
        ),
        (
            "slack",
            lambda: s.slack_delivery({"type": "event_callback", "event_id": "Ev\ud800"}),
            "(from event_id)",
        ),
        (
            "generic-json",
            lambda: generic({"meta": {"delivery": "d\udfff"}}),
            "(from json:/meta/delivery)",
        ),
    ],
)
def test_a_key_holding_one_is_a_400_naming_its_member(app, source, delivery, said):
    response = post_webhook(app.test_client(), source, *delivery())
    assert response.status_code == 400, response.get_json()
    assert response.mimetype == "application/problem+json"
    problem = response.get_json()
    assert problem["type"] == "/problems/payload-invalid"
    assert f"the dedup key {said}" in problem["detail"]
    assert "lone surrogate" in problem["detail"]
    assert count(app, Event) == 0


@pytest.mark.parametrize(
    ("source", "delivery"),
    [
        ("stripe-live", lambda: s.stripe_delivery({"id": "evt_1", "type": "t\ud800"})),
        ("paddle", lambda: s.paddle_delivery({"event_id": "evt_1", "event_type": "t\ud800"})),
        (
            "slack",
            lambda: s.slack_delivery(
                {"type": "event_callback", "event_id": "Ev1", "event": {"type": "m\ud800"}}
            ),
        ),
        ("svix", lambda: s.standard_delivery({"type": "t\ud800"}, msg_id="msg_1")),
        ("github", lambda: s.github_delivery({"action": "opened\ud800"}, "d-1")),
    ],
)
def test_a_type_holding_one_is_a_400_that_says_so(app, source, delivery):
    response = post_webhook(app.test_client(), source, *delivery())
    assert response.status_code == 400, response.get_json()
    problem = response.get_json()
    assert problem["type"] == "/problems/payload-invalid"
    assert "the event type" in problem["detail"] and "lone surrogate" in problem["detail"]
    assert count(app, Event) == 0


def test_the_admin_shows_the_stored_event_and_its_conflict(app):
    client = app.test_client()
    body, headers = BUILDERS["stripe-live"]("evt_1", NOTE)
    assert post_webhook(client, "stripe-live", body, headers).status_code == 200
    conflict = post_webhook(client, "stripe-live", *BUILDERS["stripe-live"]("evt_1", OTHER_NOTE))
    assert conflict.status_code == 422
    (stored,) = rows(app, Event)
    (kept,) = rows(app, EventConflict)
    admin = app.test_client()
    assert login(admin).status_code == 302
    for path in (
        f"/admin/events/{stored.id}",
        "/admin/events",
        f"/admin/conflicts/{kept.id}",
        "/admin/conflicts",
    ):
        page = admin.get(path)
        assert page.status_code == 200, path
    shown = admin.get(f"/admin/events/{stored.id}").get_data(as_text=True)
    # The escape as it was sent: the page has no lone surrogate to encode.
    assert json.dumps(NOTE)[1:-1] in shown


def test_a_paddle_notification_id_holding_one_is_kept_as_its_escape(app):
    # The id is left out of the content (a replay gets a new one) but kept
    # in the meta, which stores text: the surrogate is kept as its escape.
    payload = {"notification_id": "ntf_\ud800", "event_id": "evt_1", "event_type": "t"}
    response = post_webhook(app.test_client(), "paddle", *s.paddle_delivery(payload))
    assert response.status_code == 200, response.get_json()
    (stored,) = rows(app, Event)
    assert stored.meta["paddle_notification_id"] == "ntf_\\ud800"
