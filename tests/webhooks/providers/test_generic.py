from __future__ import annotations

import json

import pytest

from webhook_receiver.config import parse_spec
from webhook_receiver.webhooks.providers import (
    GenericProvider,
    MissingKeyError,
    PayloadError,
    SignatureError,
)

from ...helpers.signing import hmac_hex, inbound, source

P = GenericProvider()
SECRET = "generic-secret"
BODY = json.dumps({"order": {"id": 4711, "ref": "A/1"}, "kind": "order.paid", "a/b": {"~": "x"}})


def src(**kwargs):
    kwargs.setdefault("signature_header", "X-Signature")
    return source("generic", SECRET, **kwargs)


def delivery(body: str = BODY, sig: str | None = None, **extra: str):
    h = {"X-Signature": sig if sig is not None else hmac_hex(body.encode(), SECRET)}
    h.update(extra)
    return inbound(body, h)


@pytest.mark.parametrize("prefix", ["", "sha256=", "hmac-sha256=", "v1="])
def test_signature_with_optional_prefix(prefix: str) -> None:
    P.verify(delivery(sig=prefix + hmac_hex(BODY.encode(), SECRET)), src())


def test_rotation() -> None:
    for signer in ("old", "new"):
        d = delivery(sig=hmac_hex(BODY.encode(), signer))
        P.verify(d, source("generic", "old", "new", signature_header="X-Signature"))


@pytest.mark.parametrize(
    "sig",
    ["sha256=" + hmac_hex(BODY.encode(), "wrong"), "sha256=" + hmac_hex(b"other", SECRET)],
)
def test_wrong_signature(sig: str) -> None:
    with pytest.raises(SignatureError, match="signature does not match"):
        P.verify(delivery(sig=sig), src())


@pytest.mark.parametrize("sig", ["sha256=", "sha256=nothex", "a=b=" + "00" * 32, "=" + "00" * 32])
def test_malformed_signature(sig: str) -> None:
    with pytest.raises(SignatureError, match="malformed X-Signature header"):
        P.verify(delivery(sig=sig), src())


def test_missing_signature_header() -> None:
    with pytest.raises(SignatureError, match="missing X-Signature header"):
        P.verify(inbound(BODY, {}), src())


def test_no_signature_header_configured() -> None:
    with pytest.raises(SignatureError):
        P.verify(delivery(), source("generic", SECRET))


def test_tampered_body() -> None:
    d = delivery()
    with pytest.raises(SignatureError):
        P.verify(inbound(BODY + "\n", dict(d.headers)), src())


def test_default_key_is_idempotency_key_header() -> None:
    ident = P.identify(delivery(**{"Idempotency-Key": "idem-1"}), src())
    assert (ident.dedup_key, ident.event_type) == ("idem-1", None)
    with pytest.raises(MissingKeyError):
        P.identify(delivery(), src())


def test_header_key_on_non_json_body() -> None:
    d = inbound(b"\xff raw", {"X-Delivery": "d-9"}, content_type="application/octet-stream")
    assert P.identify(d, src(dedup_key="header:X-Delivery")).dedup_key == "d-9"


@pytest.mark.parametrize(
    ("pointer", "key"),
    [("/order/id", "4711"), ("/order/ref", "A/1"), ("/a~1b/~0", "x"), ("/kind", "order.paid")],
)
def test_json_pointer_key(pointer: str, key: str) -> None:
    assert P.identify(delivery(), src(dedup_key=f"json:{pointer}")).dedup_key == key


@pytest.mark.parametrize("pointer", ["/order", "/missing", "/order/id/x"])
def test_json_pointer_key_not_a_scalar(pointer: str) -> None:
    with pytest.raises(MissingKeyError):
        P.identify(delivery(), src(dedup_key=f"json:{pointer}"))


def test_json_key_booleans_are_not_keys() -> None:
    with pytest.raises(MissingKeyError):
        P.identify(delivery(json.dumps({"id": True})), src(dedup_key="json:/id"))


def test_json_key_on_non_json_body() -> None:
    with pytest.raises(PayloadError):
        P.identify(inbound("not json", {}), src(dedup_key="json:/id"))


def test_event_type_specs() -> None:
    hdr = src(dedup_key="json:/order/id", extra={"event_type": "header:X-Event"})
    assert P.identify(delivery(**{"X-Event": "paid"}), hdr).event_type == "paid"
    assert P.identify(delivery(), hdr).event_type is None
    js = src(dedup_key="json:/order/id", extra={"event_type": "json:/kind"})
    assert P.identify(delivery(), js).event_type == "order.paid"
    # A json: type on a non-JSON body is just unknown; the key comes from a header.
    raw = inbound("raw", {"Idempotency-Key": "k"})
    assert P.identify(raw, src(extra={"event_type": "json:/kind"})).event_type is None


def test_requires_json_for() -> None:
    assert P.requires_json_for(src(dedup_key="json:/id")) is True
    assert P.requires_json_for(src()) is False


@pytest.mark.parametrize("spec", ["id", "query:id", "header:", "json:id"])
def test_invalid_specs(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_spec(spec)
    with pytest.raises(PayloadError):
        P.identify(delivery(), src(dedup_key=spec))


def test_valid_specs() -> None:
    assert parse_spec("header:X-Id") == ("header", "X-Id")
    assert parse_spec("json:/a/0") == ("json", "/a/0")
    assert parse_spec("json:") == ("json", "")
