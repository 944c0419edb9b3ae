from __future__ import annotations

import json
from dataclasses import replace

import pytest

from webhook_receiver.webhooks.providers import (
    CloudEventsProvider,
    MissingKeyError,
    PayloadError,
    SignatureError,
)

from ...helpers.signing import hmac_hex, inbound, source

P = CloudEventsProvider()
SECRET = "ce-secret"
SRC = source("cloudevents", SECRET, signature_header="X-Signature")
# The example event of the CloudEvents HTTP binding spec.
ATTRS = {
    "specversion": "1.0",
    "type": "com.example.someevent",
    "source": "/mycontext",
    "id": "A234-1234-1234",
}


def binary(body: bytes = b"\x00\x01 binary data", content_type: str = "application/octet-stream"):
    h = {f"ce-{k}": v for k, v in ATTRS.items()}
    h["X-Signature"] = "sha256=" + hmac_hex(body, SECRET)
    return inbound(body, h, content_type=content_type)


def structured(event: dict | None = None, body: str | None = None, parsed: bool = True):
    raw = body if body is not None else json.dumps(event or {**ATTRS, "data": {"x": 1}})
    h = {"X-Signature": hmac_hex(raw.encode(), SECRET)}
    d = inbound(raw, h, content_type="application/cloudevents+json; charset=utf-8")
    # A receipt that only parses application/json would leave json None.
    return d if parsed else replace(d, json=None)


def test_binary_mode() -> None:
    d = binary()
    P.verify(d, SRC)
    ident = P.identify(d, SRC)
    assert ident.dedup_key == '["/mycontext","A234-1234-1234"]'
    assert ident.event_type == "com.example.someevent"
    assert ident.meta == {"ce_mode": "binary", "ce_specversion": "1.0"}


def test_binary_mode_with_json_data() -> None:
    d = binary(b'{"not": "attributes", "id": "ignored"}', "application/json")
    assert P.identify(d, SRC).dedup_key == '["/mycontext","A234-1234-1234"]'


@pytest.mark.parametrize("parsed", [True, False])
def test_structured_mode(parsed: bool) -> None:
    d = structured(parsed=parsed)
    P.verify(d, SRC)
    ident = P.identify(d, SRC)
    assert ident.dedup_key == '["/mycontext","A234-1234-1234"]'
    assert ident.event_type == "com.example.someevent"
    assert ident.meta == {"ce_mode": "structured", "ce_specversion": "1.0"}


def test_key_is_unambiguous() -> None:
    a = structured({**ATTRS, "source": "a:b", "id": "c"})
    b = structured({**ATTRS, "source": "a", "id": "b:c"})
    assert P.identify(a, SRC).dedup_key == '["a:b","c"]'
    assert P.identify(b, SRC).dedup_key == '["a","b:c"]'
    quoted = structured({**ATTRS, "source": 'x","y', "id": "é"})
    assert P.identify(quoted, SRC).dedup_key == '["x\\",\\"y","é"]'


def test_structured_unreadable_json() -> None:
    with pytest.raises(PayloadError):
        P.identify(structured(body="{not json", parsed=False), SRC)
    with pytest.raises(PayloadError):
        P.identify(structured(body="[1, 2]"), SRC)


def test_a_batch_is_split_not_identified() -> None:
    batch = json.dumps([{**ATTRS, "id": "1"}, {**ATTRS, "id": "2"}])
    d = inbound(batch, {}, content_type="application/cloudevents-batch+json")
    with pytest.raises(PayloadError):
        P.identify(d, SRC)
    parts = P.parts(d, SRC)
    assert [p.identified.dedup_key for p in parts] == [
        json.dumps([ATTRS["source"], n], separators=(",", ":")) for n in ("1", "2")
    ]
    assert parts[0].json == {**ATTRS, "id": "1"}
    assert P.parts(structured(), SRC) is None


@pytest.mark.parametrize("drop", ["id", "source"])
def test_missing_id_or_source(drop: str) -> None:
    event = {k: v for k, v in ATTRS.items() if k != drop}
    with pytest.raises(MissingKeyError):
        P.identify(structured(event), SRC)
    h = {f"ce-{k}": v for k, v in event.items()}
    with pytest.raises(MissingKeyError):
        P.identify(inbound(b"x", h, content_type="text/plain"), SRC)


def test_non_string_id_is_missing() -> None:
    with pytest.raises(MissingKeyError):
        P.identify(structured({**ATTRS, "id": 42}), SRC)


def test_key_too_long() -> None:
    with pytest.raises(MissingKeyError, match="dedup key too long"):
        P.identify(structured({**ATTRS, "id": "i" * 500}), SRC)


def test_signature_checks() -> None:
    d = binary()
    with pytest.raises(SignatureError, match="signature does not match"):
        P.verify(inbound(d.body + b"!", dict(d.headers)), SRC)
    with pytest.raises(SignatureError, match="missing X-Signature header"):
        P.verify(inbound(d.body, {}), SRC)
    with pytest.raises(SignatureError, match="no signature header configured"):
        P.verify(d, source("cloudevents", SECRET))
    P.verify(d, source("cloudevents", "other", SECRET, signature_header="x-signature"))


def test_handshake_allows_the_origin() -> None:
    from werkzeug.datastructures import Headers

    answer = P.handshake(Headers({"WebHook-Request-Origin": "eventgrid.azure.net"}), SRC)
    # The spec (http-webhook 4.2): a target that allows delivery MUST answer
    # both WebHook-Allowed-Origin and WebHook-Allowed-Rate, asked for a rate or not.
    assert answer == {
        "WebHook-Allowed-Origin": "eventgrid.azure.net",
        "WebHook-Allowed-Rate": "*",
        "Allow": "POST, OPTIONS",
    }
    asked = Headers(
        {"WebHook-Request-Origin": "eventgrid.azure.net", "WebHook-Request-Rate": "120"}
    )
    assert P.handshake(asked, SRC)["WebHook-Allowed-Rate"] == "*"
    assert P.handshake(Headers({}), SRC) is None


@pytest.mark.parametrize("origin", ["a b", "<script>", "x" * 254, "-leading.example"])
def test_handshake_refuses_what_is_not_a_host_name(origin: str) -> None:
    from werkzeug.datastructures import Headers

    with pytest.raises(PayloadError, match="WebHook-Request-Origin"):
        P.handshake(Headers({"WebHook-Request-Origin": origin}), SRC)


def test_a_structured_event_in_canonical_form_is_fingerprinted_as_written() -> None:
    # Structured events fingerprinted as written before binary and structured
    # were read into one form: one already in it keeps its fingerprint, so a
    # retry across the upgrade (or of a batch entry) stays a duplicate.
    event = {**ATTRS, "time": "2018-04-05T17:31:00Z", "ext": "v", "data": {"x": [1, "é"]}}
    assert P.decode(structured(event), SRC).json == event
    text = {**ATTRS, "datacontenttype": "text/xml", "data": "<a/>"}
    assert P.decode(structured(text), SRC).json == text
    raw = {**ATTRS, "datacontenttype": "application/octet-stream", "data_base64": "AP8="}
    assert P.decode(structured(raw), SRC).json == raw


def test_binary_mode_reads_into_the_structured_form() -> None:
    d = binary(b"\x00\xff")
    assert P.decode(d, SRC).json == {
        **ATTRS,
        "datacontenttype": "application/octet-stream",
        "data_base64": "AP8=",
    }
    with_json = binary(b'{"b": 1.0}', "application/json; charset=utf-8")
    assert P.decode(with_json, SRC).json == {**ATTRS, "data": {"b": 1.0}}
    # The signature header is the delivery's, not the event's.
    assert "x-signature" not in P.decode(with_json, SRC).json


def test_a_ce_data_header_is_refused() -> None:
    d = binary()
    headers = {**dict(d.headers), "ce-data": "x"}
    with pytest.raises(PayloadError, match="ce-data"):
        P.decode(inbound(d.body, headers, content_type=d.content_type), SRC)


def test_a_batch_is_left_to_parts() -> None:
    d = inbound(json.dumps([ATTRS]), {}, content_type="application/cloudevents-batch+json")
    assert P.decode(d, SRC) is d


def test_data_beside_data_base64_counts_too() -> None:
    # The format forbids both; a sender that sends them is compared on both.
    both = {**ATTRS, "data_base64": "AP8=", "data": {"a": 1}}
    other = {**both, "data": {"a": 2}}
    assert P.decode(structured(both), SRC).json == both
    assert P.decode(structured(both), SRC).json != P.decode(structured(other), SRC).json
    not_base64 = {**ATTRS, "data_base64": "not base64!"}
    assert P.decode(structured(not_base64), SRC).json == not_base64
