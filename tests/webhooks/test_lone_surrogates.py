"""JSON's lone surrogate escape (\\ud800) in a delivery: stored as sent, unless its key holds one.

RFC 8259 allows the escape (section 8.2 leaves its meaning to the reader),
Python's json reads it as a lone surrogate, which UTF-8 cannot encode. The
body is stored as it came (the escape is ASCII), the fingerprint is taken
over canonical JSON that writes the escape back; only a derived text field
(the dedup key, the event type) holding one is refused, with a 400 that says
so. Sent through the app on both databases.
"""

from __future__ import annotations

import json

import pytest

from webhook_receiver.models import Event, EventConflict

from ..helpers import count, post_binary_cloudevent, post_hmac, rows

STRUCTURED = "application/cloudevents+json"
NOTE = b'"x\\ud800y"'  # JSON text: the escape, six ASCII characters
EVENT = (
    b'{"specversion":"1.0","type":"t","source":"/s","id":"1","data":{"note":'
    + NOTE
    + b',"ok":"\xc3\xa9"}}'
)


@pytest.fixture
def app(make_app):
    from ..helpers import signing as s

    return make_app({"sources": s.SOURCES})


def test_a_structured_event_holding_one_is_stored_as_sent_and_replayed(app):
    client = app.test_client()
    first = post_hmac(client, "ce", EVENT, STRUCTURED)
    assert first.status_code == 200, first.get_json()
    (stored,) = rows(app, Event)
    assert bytes(stored.body) == EVENT
    # The same event re-serialised, or in binary mode, is a duplicate.
    again = post_hmac(client, "ce", json.dumps(json.loads(EVENT), indent=1).encode(), STRUCTURED)
    assert again.status_code == 200, again.get_json()
    assert again.headers["Idempotent-Replayed"] == "true"
    # Another surrogate is other content: a conflict, not a duplicate.
    other = post_hmac(client, "ce", EVENT.replace(b"d800", b"d801"), STRUCTURED)
    assert other.status_code == 422, other.get_json()
    assert count(app, Event) == count(app, EventConflict) == 1


def test_a_binary_event_holding_one_is_the_structured_one(app):
    client = app.test_client()
    data = b'{"note":' + NOTE + b',"ok":"\xc3\xa9"}'
    attributes = {"specversion": "1.0", "type": "t", "source": "/s", "id": "1"}
    first = post_binary_cloudevent(client, attributes, data)
    assert first.status_code == 200, first.get_json()
    (stored,) = rows(app, Event)
    assert bytes(stored.body) == data
    again = post_hmac(client, "ce", EVENT, STRUCTURED)
    assert again.status_code == 200, again.get_json()
    assert again.headers["Idempotent-Replayed"] == "true"


def test_a_batch_entry_holding_one_is_stored(app):
    client = app.test_client()
    batch = b"[" + EVENT + b"]"
    response = post_hmac(client, "ce", batch, "application/cloudevents-batch+json")
    assert response.status_code == 200, response.get_json()
    (stored,) = rows(app, Event)
    assert json.loads(stored.body)["data"]["note"] == "x\ud800y"
    single = post_hmac(client, "ce", EVENT, STRUCTURED)
    assert single.headers["Idempotent-Replayed"] == "true", single.get_json()


@pytest.mark.parametrize(
    ("member", "field", "said"),
    [
        (b'"id":"1\\ud800"', "id", "the dedup key (from source and id)"),
        (b'"source":"/s\\udc00"', "source", "the dedup key (from source and id)"),
        (b'"type":"t\\ud800"', "type", "the event type"),
    ],
)
def test_a_key_or_type_holding_one_is_a_400_that_names_it(app, member, field, said):
    event = json.loads(EVENT)
    del event[field]
    body = json.dumps(event).encode()[:-1] + b"," + member + b"}"
    response = post_hmac(app.test_client(), "ce", body, STRUCTURED)
    assert response.status_code == 400, response.get_json()
    assert response.mimetype == "application/problem+json"
    problem = response.get_json()
    assert problem["type"] == "/problems/payload-invalid"
    assert said in problem["detail"]
    assert "lone surrogate" in problem["detail"]
    assert count(app, Event) == 0
