"""CloudEvents batched mode: verified once, each event stored as its own, all or nothing.

Batches are made of events written by the ``cloudevents`` SDK (its JSON
format; the SDK has no batch writer, so the array is joined here), signed
over the raw body, and sent through the app on both databases.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent
from sqlalchemy import select

from webhook_receiver.extensions import db
from webhook_receiver.models import Event, EventConflict

from ..helpers import count, post_hmac, rows
from ..helpers import signing as s

BATCH = "application/cloudevents-batch+json"


@pytest.fixture
def app(make_app):
    return make_app({"sources": s.SOURCES})


def event(n: int, **data: object) -> CloudEvent:
    return CloudEvent(
        # A fixed time: the SDK would stamp each object with its own, and a
        # redelivery carries the first one's.
        attributes={
            "type": "com.example.order.created",
            "source": "/orders",
            "id": f"o-{n}",
            "time": datetime(2026, 12, 3, 9, 0, tzinfo=UTC),
        },
        data={"order": n, **data},
    )


def batch_of(*events: CloudEvent) -> bytes:
    written = [JSONFormat().write(e) for e in events]
    return b"[" + b",".join(written) + b"]"


def post(client, body: bytes, content_type: str = BATCH):
    return post_hmac(client, "ce", body, content_type)


def test_a_batch_stores_each_event_as_its_own(app):
    response = post(app.test_client(), batch_of(event(1), event(2), event(3)))
    assert response.status_code == 200, response.get_json()
    assert "Idempotent-Replayed" not in response.headers
    stored = rows(app)
    assert response.get_json() == {
        "status": "accepted",
        "events": [{"event_id": row.id, "status": "accepted"} for row in stored],
    }
    assert [row.dedup_key for row in stored] == [
        json.dumps(["/orders", f"o-{n}"], separators=(",", ":")) for n in (1, 2, 3)
    ]
    assert {row.event_type for row in stored} == {"com.example.order.created"}
    assert {row.content_type for row in stored} == {"application/cloudevents+json"}
    # Each stored body is that event alone, as JSON.
    assert json.loads(stored[1].body)["data"] == {"order": 2}
    assert stored[0].meta["ce_mode"] == "batch"


def test_a_redelivered_batch_replays(app):
    client = app.test_client()
    body = batch_of(event(1), event(2))
    first = post(client, body)
    again = post(client, body)
    assert again.status_code == 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert [e["event_id"] for e in again.get_json()["events"]] == [
        e["event_id"] for e in first.get_json()["events"]
    ]
    assert {e["status"] for e in again.get_json()["events"]} == {"duplicate"}
    assert count(app, Event) == 2
    with app.app_context():
        assert {row.duplicate_count for row in db.session.scalars(select(Event))} == {1}


def test_a_partly_redelivered_batch_answers_each_event_in_order(app):
    client = app.test_client()
    before = post(client, batch_of(event(2))).get_json()["events"][0]["event_id"]
    response = post(client, batch_of(event(1), event(2), event(3)))
    assert response.status_code == 200
    assert "Idempotent-Replayed" not in response.headers
    statuses = [(e["status"], e["event_id"]) for e in response.get_json()["events"]]
    assert statuses[1] == ("duplicate", before)
    assert [status for status, _ in statuses] == ["accepted", "duplicate", "accepted"]
    assert count(app, Event) == 3


def test_a_structured_delivery_and_a_batch_entry_of_one_event_are_one_event(app):
    client = app.test_client()
    one = JSONFormat().write(event(7))
    single = post(client, one, content_type="application/cloudevents+json")
    assert single.status_code == 200
    response = post(client, batch_of(event(7)))
    assert response.get_json()["events"] == [
        {"event_id": single.get_json()["event_id"], "status": "duplicate"}
    ]


def test_a_batch_conflicting_with_a_stored_event_stores_nothing_of_it(app):
    client = app.test_client()
    post(client, batch_of(event(1)))
    response = post(client, batch_of(event(5), event(1, changed=True), event(6)))
    assert response.status_code == 422
    assert response.mimetype == "application/problem+json"
    problem = response.get_json()
    assert problem["type"].endswith("/dedup-key-conflict")
    (original,) = rows(app)
    assert problem["event_id"] == original.id
    # Nothing of the batch was stored; the conflicting event is kept for review.
    with app.app_context():
        (kept,) = db.session.scalars(select(EventConflict)).all()
        assert kept.event_id == original.id
        assert json.loads(kept.body)["data"] == {"order": 1, "changed": True}


@pytest.mark.parametrize(
    ("body", "slug"),
    [
        (b'{"id": "x"}', "payload-invalid"),
        (b"[1]", "payload-invalid"),
        (b'[{"type": "t", "source": "/s"}]', "dedup-key-missing"),
        (
            b"[" + JSONFormat().write(event(1)) + b"," + JSONFormat().write(event(1, x=1)) + b"]",
            "payload-invalid",
        ),
    ],
    ids=["not-an-array", "not-an-object", "no-id", "one-key-twice-with-other-content"],
)
def test_a_batch_that_cannot_be_stored_whole_is_400_and_stores_nothing(app, body, slug):
    response = post(app.test_client(), body)
    assert response.status_code == 400, response.get_json()
    assert response.mimetype == "application/problem+json"
    assert response.get_json()["type"].endswith(f"/{slug}")
    assert count(app, Event) == 0


def test_an_empty_batch_is_accepted_and_stores_nothing(app):
    # The JSON format (4.3) gives [] as an example batch, "also valid in a
    # request": a sender flushing an empty buffer must not be told to retry.
    client = app.test_client()
    for _ in range(2):
        response = post(client, b"[]")
        assert response.status_code == 200, response.get_json()
        assert response.get_json() == {"status": "accepted", "events": []}
        # Nothing was there to replay.
        assert "Idempotent-Replayed" not in response.headers
    assert count(app, Event) == 0
    unsigned = client.post(
        "/webhooks/ce", data=b"[]", headers={"Content-Type": BATCH, "X-Signature": "sha256=00"}
    )
    assert unsigned.status_code == 401


def test_a_batch_with_a_bad_signature_is_401(app):
    body = batch_of(event(1))
    response = app.test_client().post(
        "/webhooks/ce",
        data=body,
        headers={"Content-Type": BATCH, "X-Signature": "sha256=" + "0" * 64},
    )
    assert response.status_code == 401
    assert count(app, Event) == 0


def test_the_batch_counts_against_the_body_limit_as_a_whole(make_app):
    app = make_app({"sources": s.SOURCES}, MAX_BODY_BYTES=2000)
    events = [event(n, pad="x" * 200) for n in range(12)]
    response = post(app.test_client(), batch_of(*events))
    assert response.status_code == 413
    assert count(app, Event) == 0


def test_a_fresh_batch_after_a_refused_one_is_stored(app):
    client = app.test_client()
    post(client, batch_of(event(1)))
    assert post(client, batch_of(event(2), event(1, changed=True))).status_code == 422
    retry = post(client, batch_of(event(2), event(3)))
    assert retry.status_code == 200
    assert [e["status"] for e in retry.get_json()["events"]] == ["accepted", "accepted"]


def test_a_batch_content_type_in_other_letter_case_stores_structured_events(app):
    # Media types are case-insensitive (RFC 9110 8.3.1): the batch is read as
    # one whatever the case, so each event must be stored as a structured one,
    # not under the batch's type (a forward would send one event as a batch).
    sent = "Application/CloudEvents-Batch+JSON; charset=utf-8"
    response = post(app.test_client(), batch_of(event(1), event(2)), content_type=sent)
    assert response.status_code == 200, response.get_json()
    stored = rows(app)
    assert len(stored) == 2
    assert {row.content_type.partition(";")[0].lower() for row in stored} == {
        "application/cloudevents+json"
    }
