"""Receipt at /webhooks/<source> through the app, on both databases."""

from __future__ import annotations

import json
import time

import pytest

from webhook_receiver.events import REDACTED
from webhook_receiver.extensions import db
from webhook_receiver.models import Event, EventConflict, EventDuplicate, Rejection
from webhook_receiver.webhooks.providers import PROVIDERS, redacted_headers

from ..helpers import count, post_webhook, rows
from ..helpers import signing as s


@pytest.fixture
def app(make_app):
    return make_app({"sources": s.SOURCES})


STRIPE_EVENT = {"id": "evt_1", "type": "invoice.paid", "data": {"object": {"id": "in_1"}}}


def test_first_stripe_delivery_is_stored_and_acknowledged(app, client):
    body, headers = s.stripe_delivery(STRIPE_EVENT)
    client.set_cookie("session", "secret-cookie")
    response = post_webhook(
        client,
        "stripe-live",
        body,
        {**headers, "Authorization": "Basic abc", "X-Request-Id": "req-42"},
    )
    assert response.status_code == 200
    event_id = response.get_json()["event_id"]
    assert response.get_json() == {"status": "accepted", "event_id": event_id}
    assert "Idempotent-Replayed" not in response.headers
    assert response.headers["X-Request-Id"] == "req-42"
    (event,) = rows(app, Event)
    assert event.id == event_id
    assert (event.source, event.dedup_key, event.event_type) == (
        "stripe-live",
        "evt_1",
        "invoice.paid",
    )
    assert event.body == body
    assert event.content_type == "application/json"
    assert len(event.fingerprint) == 64
    assert event.correlation_id == "req-42"
    stored = {name.lower(): value for name, value in event.headers}
    assert stored["stripe-signature"] == "[redacted]"
    assert stored["authorization"] == "[redacted]"
    assert stored["cookie"] == "[redacted]"
    assert stored["x-request-id"] == "req-42"
    assert event.duplicate_count == 0


def test_stripe_retry_resigned_later_is_a_duplicate(app, client):
    body, headers = s.stripe_delivery(STRIPE_EVENT, t=int(time.time()) - 120)
    first = post_webhook(client, "stripe-live", body, headers)
    # Stripe re-signs each attempt with a new timestamp, and may re-serialise.
    retry_body = json.dumps(STRIPE_EVENT, indent=2, sort_keys=True).encode()
    import stripe

    retry_headers = {
        "Stripe-Signature": stripe.WebhookSignature.generate_signature_header(
            retry_body.decode(), s.STRIPE_SECRET, timestamp=int(time.time())
        ),
        "Content-Type": "application/json",
    }
    for expected in (1, 2):
        again = post_webhook(client, "stripe-live", retry_body, retry_headers)
        assert again.status_code == 200
        assert again.headers["Idempotent-Replayed"] == "true"
        assert again.get_json() == first.get_json()
        (event,) = rows(app, Event)
        assert event.duplicate_count == expected
        assert event.body == body  # the original is untouched
    assert event.last_duplicate_at is not None
    assert [d.event_id for d in rows(app, EventDuplicate)] == [event.id, event.id]


def test_stripe_retry_after_another_endpoint_acknowledged_is_a_duplicate(app, client):
    # pending_webhooks is the event's count of endpoints Stripe has yet to
    # deliver it to, written into each attempt: once another endpoint of the
    # account acknowledged it, the retry to this one carries a lower number.
    first = post_webhook(
        client, "stripe-live", *s.stripe_delivery({**STRIPE_EVENT, "pending_webhooks": 2})
    )
    assert first.status_code == 200
    retry = post_webhook(
        client, "stripe-live", *s.stripe_delivery({**STRIPE_EVENT, "pending_webhooks": 1})
    )
    assert retry.status_code == 200, retry.get_json()
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.get_json() == first.get_json()
    (event,) = rows(app, Event)
    assert (event.duplicate_count, json.loads(event.body)["pending_webhooks"]) == (1, 2)
    assert count(app, EventConflict) == 0
    # Only the envelope's count is left out: the same name in the object is content.
    changed = {**STRIPE_EVENT, "data": {"object": {"id": "in_1", "pending_webhooks": 1}}}
    assert post_webhook(client, "stripe-live", *s.stripe_delivery(changed)).status_code == 422


def test_same_key_different_content_is_422_and_kept(app, client, caplog):
    post_webhook(client, "stripe-live", *s.stripe_delivery(STRIPE_EVENT))
    changed = {**STRIPE_EVENT, "data": {"object": {"id": "in_2"}}}
    body, headers = s.stripe_delivery(changed)
    with caplog.at_level("ERROR"):
        response = post_webhook(client, "stripe-live", body, headers)
    assert response.status_code == 422
    assert response.mimetype == "application/problem+json"
    problem = response.get_json()
    assert problem["type"] == "/problems/dedup-key-conflict"
    (event,) = rows(app, Event)
    assert problem["event_id"] == event.id
    assert json.loads(event.body)["data"]["object"]["id"] == "in_1"
    assert event.duplicate_count == 0
    assert any(
        r.levelname == "ERROR" and "different content" in r.getMessage() for r in caplog.records
    )
    # the same conflicting content again: still one conflict record, counted
    post_webhook(client, "stripe-live", *s.stripe_delivery(changed))
    (conflict,) = rows(app, EventConflict)
    assert (conflict.event_id, conflict.dedup_key, conflict.body) == (event.id, "evt_1", body)
    assert conflict.seen_count == 2
    assert dict(conflict.headers)["Stripe-Signature"] == "[redacted]"
    # a third content makes a second record
    third = {**STRIPE_EVENT, "type": "invoice.voided"}
    assert post_webhook(client, "stripe-live", *s.stripe_delivery(third)).status_code == 422
    assert count(app, EventConflict) == 2


@pytest.mark.parametrize(
    ("change", "slug"),
    [
        ("bad-signature", "signature-invalid"),
        ("wrong-secret", "signature-invalid"),
        ("tampered", "signature-invalid"),
        ("missing", "signature-invalid"),
        ("stale", "timestamp-out-of-tolerance"),
        ("future", "timestamp-out-of-tolerance"),
    ],
)
def test_unauthentic_deliveries_are_401_and_not_stored(app, client, change, slug):
    now = int(time.time())
    body, headers = s.stripe_delivery(
        STRIPE_EVENT,
        secret="whsec_other" if change == "wrong-secret" else s.STRIPE_SECRET,
        t={"stale": now - 301, "future": now + 301}.get(change, now),
    )
    if change == "bad-signature":
        headers["Stripe-Signature"] = f"t={now},v1={'0' * 64}"
    if change == "tampered":
        body = body.replace(b"in_1", b"in_9")
    if change == "missing":
        del headers["Stripe-Signature"]
    response = post_webhook(client, "stripe-live", body, headers)
    assert response.status_code == 401
    assert response.mimetype == "application/problem+json"
    assert response.get_json()["type"] == f"/problems/{slug}"
    assert count(app, Event) == 0
    (rejection,) = rows(app, Rejection)
    assert rejection.source == "stripe-live"
    assert rejection.reason == ("timestamp" if "timestamp" in slug else "signature")


def test_secret_rotation_accepts_old_and_new(make_app):
    sources = {
        "stripe-live": {"provider": "stripe", "secrets": ["whsec_new_0123", "whsec_old_0123"]}
    }
    app = make_app({"sources": sources})
    client = app.test_client()
    for i, secret in enumerate(["whsec_new_0123", "whsec_old_0123"]):
        event = {**STRIPE_EVENT, "id": f"evt_{i}"}
        assert (
            post_webhook(
                client, "stripe-live", *s.stripe_delivery(event, secret=secret)
            ).status_code
            == 200
        )
    assert (
        post_webhook(
            client, "stripe-live", *s.stripe_delivery(STRIPE_EVENT, secret="whsec_gone")
        ).status_code
        == 401
    )
    assert count(app, Event) == 2


def test_unknown_source_is_404(app, client):
    response = post_webhook(client, "nope", *s.stripe_delivery(STRIPE_EVENT))
    assert response.status_code == 404
    assert response.get_json()["type"] == "/problems/unknown-source"


def test_body_over_limit_is_413(make_app):
    app = make_app({"sources": s.SOURCES}, MAX_BODY_BYTES=500)
    body, headers = s.stripe_delivery({**STRIPE_EVENT, "pad": "x" * 600})
    response = post_webhook(app.test_client(), "stripe-live", body, headers)
    assert response.status_code == 413
    assert response.mimetype == "application/problem+json"
    assert count(app, Event) == 0


def test_signed_non_json_to_a_json_provider_is_400(app, client):
    body = b"not json at all"
    import stripe

    header = stripe.WebhookSignature.generate_signature_header(
        body.decode(), s.STRIPE_SECRET, timestamp=int(time.time())
    )
    response = post_webhook(
        client, "stripe-live", body, {"Stripe-Signature": header, "Content-Type": "text/plain"}
    )
    assert response.status_code == 400
    assert response.get_json()["type"] == "/problems/payload-invalid"
    assert count(app, Event) == 0


def test_missing_event_id_is_400(app, client):
    response = post_webhook(client, "stripe-live", *s.stripe_delivery({"type": "x"}))
    assert response.status_code == 400
    assert response.get_json()["type"] == "/problems/dedup-key-missing"


def test_an_authentic_delivery_refused_for_what_it_holds_is_logged(app, client, caplog):
    # Its sender retries the same delivery, refused each time: only a bad
    # signature was logged, so an operator saw nothing of these.
    body, headers = s.stripe_delivery({"type": "x"})
    caplog.set_level("WARNING", "webhook_receiver")
    response = post_webhook(
        client, "stripe-live", body, {**headers, "X-Request-Id": "req-refused-1"}
    )
    assert response.status_code == 400
    [record] = [r for r in caplog.records if getattr(r, "outcome", "").startswith("refused_")]
    assert record.levelname == "WARNING"
    assert record.outcome == "refused_dedup-key-missing"
    assert record.source == "stripe-live"
    assert record.correlation_id == "req-refused-1"
    assert count(app, Event) == 0


def test_github_delivery_keyed_by_delivery_header(app, client):
    body, headers = s.github_delivery({"action": "opened", "number": 1}, "d-1", "issues")
    assert post_webhook(client, "github", body, headers).status_code == 200
    # a redelivery from GitHub's UI keeps X-GitHub-Delivery
    again = post_webhook(client, "github", body, headers)
    assert again.headers["Idempotent-Replayed"] == "true"
    (event,) = rows(app, Event)
    assert (event.dedup_key, event.event_type, event.duplicate_count) == ("d-1", "issues.opened", 1)
    assert dict(event.headers)["X-Hub-Signature-256"] == "[redacted]"


def test_standard_webhooks_signed_by_svix_sdk(app, client):
    body, headers = s.standard_delivery({"type": "user.created", "id": 5}, "msg_abc")
    assert post_webhook(client, "svix", body, headers).status_code == 200
    # a retry carries the same webhook-id and a new timestamp and signature
    body2, headers2 = s.standard_delivery(
        {"type": "user.created", "id": 5}, "msg_abc", t=int(time.time()) + 5
    )
    assert post_webhook(client, "svix", body2, headers2).headers["Idempotent-Replayed"] == "true"
    (event,) = rows(app, Event)
    assert (event.dedup_key, event.event_type) == ("msg_abc", "user.created")
    stored = dict(event.headers)
    assert stored["Webhook-Signature"] == "[redacted]"


def test_shopify_keyed_by_webhook_id_not_event_id(app, client):
    payload = {"id": 820982911946154508}
    assert (
        post_webhook(client, "shop", *s.shopify_delivery(payload, "wh-1", "evt-9")).status_code
        == 200
    )
    # a second subscription to the same event: same event id, other webhook id
    assert (
        post_webhook(client, "shop", *s.shopify_delivery(payload, "wh-2", "evt-9")).status_code
        == 200
    )
    events = rows(app, Event)
    assert [e.dedup_key for e in events] == ["wh-1", "wh-2"]
    assert [e.meta.get("shopify_event_id") for e in events] == ["evt-9", "evt-9"]


def test_slack_challenge_answered_and_not_stored(app, client):
    body, headers = s.slack_delivery(
        {"type": "url_verification", "challenge": "abc123", "token": "x"}
    )
    response = post_webhook(client, "slack", body, headers)
    assert response.status_code == 200
    assert response.get_json() == {"challenge": "abc123"}
    assert count(app, Event) == 0
    event = {"type": "event_callback", "event_id": "Ev1", "event": {"type": "app_mention"}}
    assert post_webhook(client, "slack", *s.slack_delivery(event)).status_code == 200
    (stored,) = rows(app, Event)
    assert (stored.dedup_key, stored.event_type) == ("Ev1", "app_mention")


PADDLE_EVENT = {
    "event_id": "evt_01h8bzakzx3hm2fmen703n5q45",
    "event_type": "transaction.completed",
    "occurred_at": "2023-08-21T11:57:47.390028Z",
    "notification_id": "ntf_01h8bzam1z32agrxjwhjgqk8w6",
    "data": {"id": "txn_01h8bzakzx3hm2fmen703n5q45", "status": "completed"},
}


def test_paddle_replayed_notification_is_a_duplicate(app, client):
    # Replaying a delivered or failed notification (POST /notifications/{id}/replay)
    # makes a new notification, with a notification_id of its own, for the
    # same event_id: Paddle's advice is to deduplicate on event_id.
    first = post_webhook(client, "paddle", *s.paddle_delivery(PADDLE_EVENT))
    assert first.status_code == 200
    replay = {**PADDLE_EVENT, "notification_id": "ntf_01h8c0replay0000000000000000"}
    again = post_webhook(client, "paddle", *s.paddle_delivery(replay))
    assert again.status_code == 200, again.get_json()
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.get_json() == first.get_json()
    (event,) = rows(app, Event)
    assert event.dedup_key == PADDLE_EVENT["event_id"]
    assert event.meta["paddle_notification_id"] == PADDLE_EVENT["notification_id"]
    assert json.loads(event.body)["notification_id"] == PADDLE_EVENT["notification_id"]
    assert (event.duplicate_count, count(app, EventConflict)) == (1, 0)
    # Other content under the same event id is still a conflict.
    changed = {**replay, "data": {**PADDLE_EVENT["data"], "status": "billed"}}
    assert post_webhook(client, "paddle", *s.paddle_delivery(changed)).status_code == 422


def test_gitlab_token_and_idempotency_key(app, client):
    headers = {
        "X-Gitlab-Token": s.GITLAB_SECRET,
        "X-Gitlab-Event": "Push Hook",
        "Idempotency-Key": "gl-1",
        "X-Gitlab-Event-UUID": "uuid-1",
        "Content-Type": "application/json",
    }
    assert post_webhook(client, "gitlab", b'{"object_kind": "push"}', headers).status_code == 200
    bad = {**headers, "X-Gitlab-Token": "wrong-token"}
    assert post_webhook(client, "gitlab", b'{"object_kind": "push"}', bad).status_code == 401
    (event,) = rows(app, Event)
    assert event.dedup_key == "gl-1"
    assert dict(event.headers)["X-Gitlab-Token"] == "[redacted]"


def test_cloudevents_binary_and_structured_share_one_key_space(app, client):
    data = b'{"temperature": 21}'
    binary = {
        "ce-id": "A-1",
        "ce-source": "/sensors/1",
        "ce-type": "reading",
        "ce-specversion": "1.0",
        "Content-Type": "application/json",
        "X-Signature": f"sha256={s.hmac_hex(data)}",
    }
    assert post_webhook(client, "ce", data, binary).status_code == 200
    structured = json.dumps(
        {
            "specversion": "1.0",
            "id": "A-2",
            "source": "/sensors/1",
            "type": "reading",
            "data": {"temperature": 22},
        }
    ).encode()
    headers = {
        "Content-Type": "application/cloudevents+json",
        "X-Signature": s.hmac_hex(structured),
    }
    assert post_webhook(client, "ce", structured, headers).status_code == 200
    keys = [e.dedup_key for e in rows(app, Event)]
    assert keys == ['["/sensors/1","A-1"]', '["/sensors/1","A-2"]']
    assert (
        post_webhook(client, "ce", data, {**binary, "X-Signature": "sha256=00"}).status_code == 401
    )


def test_generic_json_pointer_key(app, client):
    body = json.dumps({"meta": {"delivery": 77}, "kind": "thing"}).encode()
    headers = {"X-Hub-Signature": f"sha256={s.hmac_hex(body)}", "Content-Type": "application/json"}
    assert post_webhook(client, "generic-json", body, headers).status_code == 200
    assert (
        post_webhook(client, "generic-json", body, headers).headers["Idempotent-Replayed"] == "true"
    )
    (event,) = rows(app, Event)
    assert (event.dedup_key, event.duplicate_count) == ("77", 1)


# -- secrets stored redacted, keys sent twice ------------------------------------


CREDENTIAL_HEADERS = {
    "X-Api-Key": "key-123",
    "X-Auth-Token": "tok-123",
    "X-Client-Secret": "sec-123",
    "X-Access-Key": "acc-123",
    "X-Amz-Security-Token": "amz-123",
    "Proxy-Authorization": "Basic eA==",
    "Cookie": "session=abc",
}


def test_every_providers_secret_headers_and_credentials_are_stored_redacted(app) -> None:
    file_config = app.config["FILE_CONFIG"]
    covered = {file_config.sources[name].provider for name in s.SOURCES}
    assert covered == set(PROVIDERS), "a provider without a source here is not checked"
    client = app.test_client()
    for n, name in enumerate(s.SOURCES):
        body, headers = s.delivery_for(name, f"redact-{name}-{n}")
        response = client.post(
            f"/webhooks/{name}", data=body, headers={**headers, **CREDENTIAL_HEADERS}
        )
        assert response.status_code == 200, (name, response.get_data(as_text=True))
        with app.app_context():
            event = db.session.get(Event, response.get_json()["event_id"])
            stored = {k.lower(): v for k, v in event.headers}
        secret = redacted_headers(file_config.sources[name]) | {
            k.lower() for k in CREDENTIAL_HEADERS
        }
        for header in secret:
            if header in stored:
                assert stored[header] == REDACTED, (name, header)
        sent = {k.lower(): v for k, v in headers.items()}
        # Each provider's own signature (or token) header was sent and is hidden.
        assert any(
            h in sent and stored[h] == REDACTED for h in redacted_headers(file_config.sources[name])
        ), name
        for value in [*CREDENTIAL_HEADERS.values(), *(sent[h] for h in secret if h in sent)]:
            assert value not in json.dumps(event.headers), (name, value)


@pytest.mark.parametrize(
    ("source", "header"),
    [("ce", "ce-id"), ("ce", "ce-source"), ("svix", "webhook-id")],
)
def test_a_dedup_key_header_sent_twice_is_400_and_stores_nothing(app, source, header):
    # gunicorn joins a repeated header with a comma. CloudEvents' binary-mode
    # ce-id and ce-source were read as they came, so "1,1" was a new key and
    # a repeated header let a redelivery through as a new event; a doubled
    # webhook-id was refused as a forgery (401) rather than as malformed.
    client = app.test_client()
    body, headers = s.delivery_for(source, "key-1")
    headers = {**headers, header: f"{headers[header]},{headers[header]}"}
    response = client.post(f"/webhooks/{source}", data=body, headers=headers)
    assert response.status_code == 400, response.get_data(as_text=True)
    assert response.get_json()["type"] == "/problems/payload-invalid"
    assert "more than once" in response.get_json()["detail"]
    assert count(app, Event) == 0
    # Listed as refused once its signature passed, or as unreadable when
    # refused before it could be checked (webhook-id); never as a forgery.
    expected = "unreadable" if header == "webhook-id" else "refused-payload-invalid"
    assert {r.reason for r in rows(app, Rejection)} == {expected}
