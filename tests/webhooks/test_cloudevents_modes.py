"""CloudEvents: one event is one event whichever HTTP content mode carries it.

The HTTP binding lets a sender pick binary mode (``ce-*`` headers, the data
as the body) or structured mode (``application/cloudevents+json``) for each
delivery, so a retry may come in the other mode. The fingerprint covers the
event's attributes and data as the spec defines them, not their encoding:
the same event is a duplicate (200, replayed), other data or attributes under
its source and id a conflict (422). Events are written by the ``cloudevents``
SDK where it can write them, and sent through the app on both databases.
"""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime

import pytest
from cloudevents.core.bindings import http as ce_http
from cloudevents.core.v1.event import CloudEvent

from webhook_receiver.models import Event, EventConflict

from ..helpers import count, post_binary_cloudevent, post_webhook, rows
from ..helpers import signing as s

STRUCTURED = "application/cloudevents+json"
ATTRIBUTES = {
    "specversion": "1.0",
    "type": "com.example.order.created",
    "source": "/orders",
    "id": "o-1",
    "time": "2026-12-03T09:00:00Z",
}


@pytest.fixture
def app(make_app):
    return make_app({"sources": s.SOURCES})


def signed(headers: dict[str, str], body: bytes) -> dict[str, str]:
    return {**headers, "X-Signature": "sha256=" + s.hmac_hex(body)}


def send_structured(client, event: dict) -> object:
    body = json.dumps(event).encode()
    return post_webhook(client, "ce", body, signed({"Content-Type": STRUCTURED}, body))


def send_binary(client, attributes: dict[str, str], body: bytes, content_type: str | None):
    return post_binary_cloudevent(client, attributes, body, content_type)


def assert_replayed(first, again) -> None:
    assert first.status_code == 200, first.get_json()
    assert again.status_code == 200, again.get_json()
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.get_json()["event_id"] == first.get_json()["event_id"]


def assert_conflict(app, first, again) -> None:
    assert first.status_code == 200, first.get_json()
    assert again.status_code == 422, again.get_json()
    assert again.get_json()["type"] == "/problems/dedup-key-conflict"
    assert count(app, Event) == count(app, EventConflict) == 1


def sdk_event(data: object = None, **extra: object) -> CloudEvent:
    attributes = {k: v for k, v in ATTRIBUTES.items() if k not in ("specversion", "time")}
    return CloudEvent(attributes={**attributes, **extra}, data=data)


def sdk_send(client, event: CloudEvent, mode: str, content_type: str | None = None):
    convert = ce_http.to_binary_event if mode == "binary" else ce_http.to_structured_event
    message = convert(event)
    headers = dict(message.headers)
    if content_type is not None:
        headers["content-type"] = content_type
    return post_webhook(client, "ce", message.body, signed(headers, message.body))


@pytest.mark.parametrize("first_mode", ["structured", "binary"])
@pytest.mark.parametrize(
    "binary_type",
    # The SDK labels no JSON data it was given without a datacontenttype
    # (JSON is the default, JSON format 3.1.1); HTTP clients often add a charset.
    [None, "application/json", "application/json; charset=utf-8"],
)
def test_the_sdks_event_in_either_mode_is_one_event(app, first_mode, binary_type):
    event = sdk_event(
        {"order": 1, "lines": [{"sku": "é", "qty": 2.0}]},
        time=datetime(2026, 12, 3, 9, 0, tzinfo=UTC),
    )
    client = app.test_client()
    second_mode = "binary" if first_mode == "structured" else "structured"
    first = sdk_send(client, event, first_mode, binary_type if first_mode == "binary" else None)
    again = sdk_send(client, event, second_mode, binary_type if second_mode == "binary" else None)
    assert_replayed(first, again)
    (stored,) = rows(app, Event)
    assert stored.meta["ce_mode"] == first_mode
    assert count(app, EventConflict) == 0


@pytest.mark.parametrize("first_mode", ["structured", "binary"])
def test_other_data_in_the_other_mode_is_a_conflict(app, first_mode):
    client = app.test_client()
    sent = {
        "structured": lambda: send_structured(
            client, {**ATTRIBUTES, "datacontenttype": "application/json", "data": {"order": 1}}
        ),
        "binary": lambda: send_binary(client, ATTRIBUTES, b'{"order": 2}', "application/json"),
    }
    first = sent[first_mode]()
    again = sent["binary" if first_mode == "structured" else "structured"]()
    assert_conflict(app, first, again)


@pytest.mark.parametrize(
    ("structured", "binary_body", "binary_type"),
    [
        # Binary data: data_base64 in structured mode, the bytes as the body.
        (
            {"datacontenttype": "application/octet-stream", "data_base64": "AP8BAg=="},
            b"\x00\xff\x01\x02",
            "application/octet-stream",
        ),
        # Text data: a JSON string in structured mode, its UTF-8 as the body.
        ({"datacontenttype": "text/plain", "data": "héllo"}, "héllo".encode(), "text/plain"),
        # Text sent as data_base64 is the same text.
        (
            {"datacontenttype": "application/xml", "data_base64": "PGEvPg=="},
            b"<a/>",
            "application/xml",
        ),
        # JSON data sent as data_base64 is the same JSON.
        (
            {
                "datacontenttype": "application/json",
                "data_base64": base64.b64encode(b'{"b": 1, "a": [1.0]}').decode(),
            },
            b'{"a":[1],"b":1}',
            "application/json",
        ),
        # A JSON string is data of its own: quoted in the body (JSON format 3.2).
        ({"data": "I'm just a string"}, b'"I\'m just a string"', "application/json"),
        # An explicit null is data; no data at all is an empty body.
        ({"data": None}, b"null", "application/json"),
        ({}, b"", None),
        # Another +json type is JSON too.
        (
            {"datacontenttype": "application/vnd.example+json", "data": {"a": 1}},
            b'{ "a" : 1 }',
            "application/vnd.example+json",
        ),
    ],
)
def test_data_is_compared_as_the_spec_defines_it(app, structured, binary_body, binary_type):
    client = app.test_client()
    first = send_structured(client, {**ATTRIBUTES, **structured})
    again = send_binary(client, ATTRIBUTES, binary_body, binary_type)
    assert_replayed(first, again)


@pytest.mark.parametrize(
    ("structured", "binary_body", "binary_type"),
    [
        # The same bytes as another content type are another event.
        ({"datacontenttype": "text/plain", "data": "<a/>"}, b"<a/>", "application/xml"),
        # A JSON string is not the text it holds.
        ({"data": "hello"}, b"hello", "text/plain"),
        # Other bytes.
        (
            {"datacontenttype": "application/octet-stream", "data_base64": "AP8="},
            b"\x00\xfe",
            "application/octet-stream",
        ),
        # Null data is not no data.
        ({"data": None}, b"", "application/json"),
    ],
)
def test_other_data_or_content_type_is_a_conflict(app, structured, binary_body, binary_type):
    client = app.test_client()
    first = send_structured(client, {**ATTRIBUTES, **structured})
    again = send_binary(client, ATTRIBUTES, binary_body, binary_type)
    assert_conflict(app, first, again)


def test_extension_attributes_count_in_either_mode(app):
    client = app.test_client()
    # JSON gives an Integer and a Boolean their JSON types; a header gives
    # their canonical strings (spec 3.1.1; JSON format 2.2).
    event = {**ATTRIBUTES, "comexampleothervalue": 5, "flag": True, "data": {"a": 1}}
    first = send_structured(client, event)
    binary = {**ATTRIBUTES, "comexampleothervalue": "5", "flag": "true"}
    again = send_binary(client, binary, b'{"a": 1}', "application/json")
    assert_replayed(first, again)
    other = send_binary(client, {**binary, "comexampleothervalue": "6"}, b'{"a":1}', None)
    assert other.status_code == 422, other.get_json()
    # An extension a retry adds is other content too.
    added = send_structured(client, {**event, "partitionkey": "p"})
    assert added.status_code == 422, added.get_json()
    assert count(app, Event) == 1


def test_a_binary_retry_with_other_extension_attributes_is_a_conflict(app):
    # Binary mode's fingerprint covered its body alone: an event whose
    # attributes changed under its source and id was taken for a duplicate.
    client = app.test_client()
    first = send_binary(client, {**ATTRIBUTES, "subject": "a"}, b'{"a": 1}', "application/json")
    again = send_binary(client, {**ATTRIBUTES, "subject": "b"}, b'{"a": 1}', "application/json")
    assert_conflict(app, first, again)


def test_null_attributes_are_omitted_ones(app):
    # JSON format 3: an OPTIONAL attribute may be written as null, which
    # binary mode cannot carry: it is the attribute left out.
    client = app.test_client()
    first = send_structured(client, {**ATTRIBUTES, "subject": None, "data": {"a": 1}})
    again = send_binary(client, ATTRIBUTES, b'{"a": 1}', "application/json")
    assert_replayed(first, again)


def test_transport_only_attributes_do_not_count(app):
    # Knative's broker stamps knativearrivaltime on each event it takes in:
    # a producer's retry through it carries another, for the same event.
    client = app.test_client()
    stamped = {**ATTRIBUTES, "knativearrivaltime": "2026-12-03T09:00:01Z"}
    first = send_binary(client, stamped, b'{"a": 1}', "application/json")
    restamped = {**stamped, "knativearrivaltime": "2026-12-03T09:05:00Z", "data": {"a": 1}}
    again = send_structured(client, restamped)
    assert_replayed(first, again)


@pytest.mark.parametrize("ce_source", ["https://example.com/a,b", "urn:x:a,b", "/orders?ids=1,2,3"])
def test_a_source_with_a_comma_is_accepted(app, ce_source):
    # The HTTP binding percent-encodes no comma (3.1.3.2): a URI-reference
    # holding one reaches the ce-source header as it is.
    client = app.test_client()
    attributes = {**ATTRIBUTES, "source": ce_source}
    first = send_binary(client, attributes, b'{"a": 1}', "application/json")
    assert first.status_code == 200, first.get_json()
    (stored,) = rows(app, Event)
    assert json.loads(stored.dedup_key) == [ce_source, "o-1"]
    again = send_structured(client, {**attributes, "data": {"a": 1}})
    assert_replayed(first, again)


def test_an_id_with_a_comma_is_accepted_and_keys_stay_apart(app):
    client = app.test_client()
    one = send_binary(client, {**ATTRIBUTES, "source": "a", "id": "b,c"}, b"{}", "application/json")
    two = send_binary(client, {**ATTRIBUTES, "source": "a,b", "id": "c"}, b"{}", "application/json")
    assert one.status_code == two.status_code == 200, (one.get_json(), two.get_json())
    assert one.get_json()["event_id"] != two.get_json()["event_id"]
    assert [json.loads(e.dedup_key) for e in rows(app, Event)] == [["a", "b,c"], ["a,b", "c"]]


def test_a_ce_source_header_sent_twice_is_still_refused(app):
    # gunicorn joins a repeated header with a comma: the same value twice
    # is that, not a source, and a retry sending it once must not be new.
    body = b'{"a": 1}'
    headers = {f"ce-{k}": v for k, v in ATTRIBUTES.items()}
    headers["ce-source"] = "/orders,/orders"
    headers["Content-Type"] = "application/json"
    response = post_webhook(app.test_client(), "ce", body, signed(headers, body))
    assert response.status_code == 400, response.get_json()
    assert "more than once" in response.get_json()["detail"]
    assert count(app, Event) == 0
