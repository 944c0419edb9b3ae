"""Identifying a broker message: what of it is stored, with no broker or database involved."""

from __future__ import annotations

from dataclasses import replace

import pytest

from webhook_receiver.brokers.identify import (
    MALFORMED,
    BrokerMessage,
    Unidentified,
    content_fingerprint,
    identify,
)
from webhook_receiver.fingerprint import fingerprint

from ..helpers import RABBIT_SOURCE


def _delivery(**fields: object) -> BrokerMessage:
    values: dict[str, object] = {
        "body": b'{"id": "evt-1"}',
        "content_type": "application/json",
        "properties": {"message_id": "evt-1", "type": "order.paid"},
        "meta": {"broker": "rabbitmq", "queue": "orders", "routing_key": "orders"},
    }
    values.update(fields)
    return BrokerMessage(**values)  # type: ignore[arg-type]


def test_meta_holds_where_it_came_from_and_the_producers_properties():
    message = identify(RABBIT_SOURCE, _delivery())
    assert message.meta == {
        "broker": "rabbitmq",
        "queue": "orders",
        "routing_key": "orders",
        "properties": {"message_id": "evt-1", "type": "order.paid"},
    }


def test_a_nul_in_meta_or_a_header_is_replaced_as_jsonb_cannot_hold_it():
    delivery = _delivery(
        properties={"message_id": "evt-1", "type": "order.paid", "app_id": "a\x00b"},
        meta={"broker": "rabbitmq", "nested": [{"k\x00": 1}], "n": 2.5, "flag": None},
        headers={"X-Trace": "t\x00"},
    )
    message = identify(RABBIT_SOURCE, delivery)
    assert message.meta == {
        "broker": "rabbitmq",
        "nested": [{"k\ufffd": 1}],
        "n": 2.5,
        "flag": None,
        "properties": {"message_id": "evt-1", "type": "order.paid", "app_id": "a\ufffdb"},
    }
    assert message.headers == (("X-Trace", "t\ufffd"),)


def test_text_that_spells_a_nul_escape_is_kept_as_it_is():
    # Six characters, not a NUL: stored unchanged, beside a real NUL replaced.
    spelled = "a\\u0000b"
    delivery = _delivery(
        properties={"message_id": "evt-1", "app_id": spelled},
        meta={"broker": "rabbitmq", "routing_key": spelled, "queue": "q\x00"},
    )
    meta = identify(RABBIT_SOURCE, delivery).meta
    assert meta["routing_key"] == spelled and meta["properties"]["app_id"] == spelled
    assert meta["queue"] == "q\ufffd"
    assert (
        identify(RABBIT_SOURCE, _delivery(meta={"routing_key": spelled})).meta["routing_key"]
        == spelled
    )


def test_the_fingerprint_covers_the_type_and_the_bytes_as_sent():
    # Nothing is parsed for it: a redelivery's bytes are the same.
    first = identify(RABBIT_SOURCE, _delivery(body=b'{"id": "evt-1", "n": 1}'))
    respelled = identify(RABBIT_SOURCE, _delivery(body=b'{"n":1,"id":"evt-1"}'))
    assert first.fingerprint == fingerprint(["order.paid", b'{"id": "evt-1", "n": 1}'])
    assert respelled.fingerprint != first.fingerprint
    # Labelled JSON that is not: identified all the same, by its bytes.
    broken = identify(RABBIT_SOURCE, _delivery(body=b'{"id": '))
    assert broken.fingerprint == fingerprint(["order.paid", b'{"id": '])


def test_the_content_fingerprint_compares_json_once_parsed_and_other_bodies_as_bytes():
    compare = content_fingerprint(RABBIT_SOURCE)
    json_type = "application/json"
    assert compare(b'{"id": "evt-1", "n": 1}', "t", json_type) == compare(
        b'{"n":1,"id":"evt-1"}', "t", json_type
    )
    assert compare(b'{"n": 1}', "t", json_type) != compare(b'{"n": 2}', "t", json_type)
    assert compare(b'{"n": 1}', "t", json_type) != compare(b'{"n": 1}', "u", json_type)
    assert compare(b'{"n": 1}', "t", "text/plain") != compare(b'{"n":1}', "t", "text/plain")
    assert compare(b'{"id": ', "t", json_type) == fingerprint(["t", b'{"id": '])
    # A body a json: spec reads is JSON whatever its label says.
    by_body = content_fingerprint(replace(RABBIT_SOURCE, dedup_key="json:/id"))
    assert by_body(b'{"id": 1, "n": 1}', "t", None) == by_body(b'{"n":1,"id":1}', "t", None)
    # What identify fingerprinted before fingerprints covered the bytes.
    assert compare(b'{"n": 1}', "t", json_type) == fingerprint(["t", b'{"n":1}'])


def test_header_specs_and_correlation_ids_are_read_whatever_the_names_case():
    source = replace(RABBIT_SOURCE, dedup_key="header:Message-Id", event_type="header:type")
    for names in (("Message-Id", "Type", "x-request-id"), ("message-id", "TYPE", "X-REQUEST-ID")):
        key_name, type_name, request_id = names
        delivery = _delivery(
            headers={key_name: "evt-9", type_name: "order.paid", request_id: "r-1"}
        )
        message = identify(source, delivery)
        assert (message.dedup_key, message.event_type) == ("evt-9", "order.paid")
        assert message.correlation_id == "r-1"


def test_secret_headers_are_redacted_in_each_message_that_carries_them():
    # The same names twice (their verdicts are kept per set of names), then others.
    for headers in (
        {"Authorization": "Bearer a", "X-Trace": "t"},
        {"Authorization": "Bearer b", "X-Trace": "u"},
        {"X-Trace": "v", "x-api-key": "k"},
    ):
        message = identify(RABBIT_SOURCE, _delivery(headers=headers))
        assert dict(message.headers) == {
            name: "[redacted]" if name in ("Authorization", "x-api-key") else value
            for name, value in headers.items()
        }


def test_a_header_name_holding_a_nul_makes_the_message_malformed():
    with pytest.raises(Unidentified) as refused:
        identify(RABBIT_SOURCE, _delivery(headers={"X-\x00": "v"}))
    assert refused.value.reason == MALFORMED


BY_BODY = replace(RABBIT_SOURCE, dedup_key="json:/id", event_type="json:/type")


def test_a_lone_surrogate_elsewhere_in_a_json_body_is_stored_as_sent():
    # JSON's \ud800 escape is valid JSON (RFC 8259 section 8.2): a body whose
    # key a json: spec reads was dead-lettered as not JSON, where the same
    # event sent as a webhook is stored. The body is kept byte for byte.
    body = b'{"id": "evt-1", "type": "order.paid", "note": "x\\ud800y"}'
    message = identify(BY_BODY, _delivery(body=body))
    assert (message.dedup_key, message.event_type, message.body) == ("evt-1", "order.paid", body)
    compare = content_fingerprint(BY_BODY)
    same = b'{"note":"x\\ud800y","type":"order.paid","id":"evt-1"}'
    other = b'{"id": "evt-1", "type": "order.paid", "note": "x\\ud801y"}'
    assert compare(body, "order.paid", None) == compare(same, "order.paid", None)
    assert compare(body, "order.paid", None) != compare(other, "order.paid", None)
    # The escape is not the six characters that spell it.
    spelled = b'{"id": "evt-1", "type": "order.paid", "note": "x\\\\ud800y"}'
    assert compare(body, "order.paid", None) != compare(spelled, "order.paid", None)


@pytest.mark.parametrize(
    ("body", "spec"),
    [
        (b'{"id": "evt-\\ud800", "type": "order.paid"}', "json:/id"),
        (b'{"id": "evt-1", "type": "order.\\udfff"}', "json:/type"),
    ],
)
def test_a_key_or_type_holding_a_lone_surrogate_is_refused_naming_its_spec(body, spec):
    # No database stores it as text: dead-lettered, saying which spec read it.
    with pytest.raises(Unidentified) as refused:
        identify(BY_BODY, _delivery(body=body))
    assert refused.value.reason == "payload-invalid"
    assert "lone surrogate" in refused.value.detail
    assert spec in refused.value.detail
