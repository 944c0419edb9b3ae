"""A CloudEvents batch entry is fingerprinted in the canonical form a structured delivery is.

An entry was fingerprinted as it was written, so the same event sent alone
(structured or binary mode, read into the canonical form) and then in a
batch was a 422 conflict whenever the two spellings differ: an explicit
``"datacontenttype": "application/json"``, a number or boolean extension,
a ``null`` attribute, text sent as ``data_base64``. Sent through the app on
both databases; the entry's body is stored as before (its own JSON).
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from webhook_receiver.models import Event, EventConflict

from ..helpers import count, post_binary_cloudevent, post_hmac, rows
from ..helpers import signing as s

STRUCTURED = "application/cloudevents+json"
BATCH = "application/cloudevents-batch+json"
BASE = {"specversion": "1.0", "type": "t", "source": "/orders", "id": "o-1"}

# Each spelling a batch entry may have that the canonical form writes otherwise.
CASES: dict[str, dict[str, Any]] = {
    "explicit application/json": {
        **BASE,
        "datacontenttype": "application/json",
        "data": {"order": 1},
    },
    "number and boolean extensions": {**BASE, "priority": 5, "urgent": True, "data": {"order": 1}},
    "null attribute": {**BASE, "subject": None, "data": {"order": 1}},
    "text as data_base64": {
        **BASE,
        "datacontenttype": "text/plain",
        "data_base64": base64.b64encode(b"hello").decode(),
    },
}


@pytest.fixture
def app(make_app):
    return make_app({"sources": s.SOURCES})


def batch_of(*events: dict[str, Any]) -> bytes:
    return json.dumps(list(events)).encode()


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_event_sent_alone_then_in_a_batch_is_a_duplicate(app, case):
    client = app.test_client()
    entry = CASES[case]
    alone = post_hmac(client, "ce", json.dumps(entry).encode(), STRUCTURED)
    assert alone.status_code == 200, alone.get_json()
    batched = post_hmac(client, "ce", batch_of(entry), BATCH)
    assert batched.status_code == 200, batched.get_json()
    assert batched.get_json()["events"] == [
        {"event_id": alone.get_json()["event_id"], "status": "duplicate"}
    ]
    assert batched.headers["Idempotent-Replayed"] == "true"
    assert count(app, Event) == 1 and count(app, EventConflict) == 0


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_batched_event_then_alone_is_a_duplicate_and_its_body_is_its_own(app, case):
    client = app.test_client()
    entry = CASES[case]
    batched = post_hmac(client, "ce", batch_of(entry), BATCH)
    assert batched.status_code == 200, batched.get_json()
    (stored,) = rows(app, Event)
    # Stored as its own JSON, as written (not the canonical form).
    assert json.loads(stored.body) == entry
    alone = post_hmac(client, "ce", json.dumps(entry).encode(), STRUCTURED)
    assert alone.headers.get("Idempotent-Replayed") == "true", alone.get_json()


def test_a_binary_delivery_then_the_batch_entry_is_a_duplicate(app):
    client = app.test_client()
    data = b'{"order":1}'
    attributes = {"specversion": "1.0", "type": "t", "source": "/orders", "id": "o-1"}
    alone = post_binary_cloudevent(client, {**attributes, "priority": "5"}, data)
    assert alone.status_code == 200, alone.get_json()
    entry = {**BASE, "datacontenttype": "application/json", "priority": 5, "data": {"order": 1}}
    batched = post_hmac(client, "ce", batch_of(entry), BATCH)
    assert batched.status_code == 200, batched.get_json()
    assert batched.get_json()["events"][0]["status"] == "duplicate"


@pytest.mark.parametrize("case", sorted(CASES))
def test_other_data_in_the_batch_is_a_conflict(app, case):
    client = app.test_client()
    entry = CASES[case]
    assert post_hmac(client, "ce", json.dumps(entry).encode(), STRUCTURED).status_code == 200
    if "data_base64" in entry:
        changed = {**entry, "data_base64": base64.b64encode(b"hellO").decode()}
    else:
        changed = {**entry, "data": {"order": 2}}
    batched = post_hmac(client, "ce", batch_of(changed), BATCH)
    assert batched.status_code == 422, batched.get_json()
    assert batched.get_json()["type"] == "/problems/dedup-key-conflict"
    assert count(app, Event) == count(app, EventConflict) == 1


def test_one_event_spelled_twice_in_a_batch_is_one_event(app):
    # The same event, once canonical and once not: no "two different events".
    canonical = {**BASE, "data": {"order": 1}}
    spelled = {**canonical, "datacontenttype": "application/json", "subject": None}
    response = post_hmac(app.test_client(), "ce", batch_of(canonical, spelled), BATCH)
    assert response.status_code == 200, response.get_json()
    first, second = response.get_json()["events"]
    assert first["event_id"] == second["event_id"]
    assert count(app, Event) == 1
