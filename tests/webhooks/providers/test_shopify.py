from __future__ import annotations

import json

import pytest

from webhook_receiver.webhooks.providers import MissingKeyError, ShopifyProvider, SignatureError

from ...helpers.signing import hmac_b64, hmac_hex, inbound, source

P = ShopifyProvider()

# Shopify/shopify_app test/shopify_app/controller_concerns/webhook_verification_test.rb:
# config.secret = "secret", config.old_secret = "old_secret", the request body is the
# form-encoded params {foo: "anything"}.
VEC_BODY = "foo=anything"
VEC_NEW = ("secret", "yCGX/RrK4fcuNtr3ztk5tQGsOBjcAzHpGLdMUrbV8yI=")
VEC_OLD = ("old_secret", "XqRcjrSv57VACn6apEO9znyu/wkN1VC7QxdSPwK3Hzs=")

SECRET = "shpss_client_secret"
BODY = json.dumps({"id": 820982911946154508, "email": "jon@example.com"})
WEBHOOK_ID = "b54557e4-bdd9-4b37-8a5f-bf7d70bcd043"
EVENT_ID = "98880550-7158-44d4-b7cd-2c97c8a091b5"


def delivery(body: str = BODY, secret: str = SECRET, **extra: str):
    h = {
        "X-Shopify-Hmac-Sha256": hmac_b64(body, secret),
        "X-Shopify-Topic": "orders/create",
        "X-Shopify-Webhook-Id": WEBHOOK_ID,
        "X-Shopify-Event-Id": EVENT_ID,
        "X-Shopify-Shop-Domain": "example.myshopify.com",
    }
    h.update(extra)
    return inbound(body, h)


@pytest.mark.parametrize("vector", [VEC_NEW, VEC_OLD])
def test_published_vectors_with_rotation(vector: tuple[str, str]) -> None:
    _, signature = vector
    d = inbound(VEC_BODY, {"X-Shopify-Hmac-Sha256": signature})
    P.verify(d, source("shopify", VEC_NEW[0], VEC_OLD[0]))


def test_published_vector_needs_its_secret() -> None:
    d = inbound(VEC_BODY, {"X-Shopify-Hmac-Sha256": VEC_OLD[1]})
    with pytest.raises(SignatureError, match="signature does not match"):
        P.verify(d, source("shopify", VEC_NEW[0]))


def test_tampered_body_rejected() -> None:
    h = dict(delivery().headers)
    with pytest.raises(SignatureError):
        P.verify(inbound(BODY.replace("jon", "joe"), h), source("shopify", SECRET))


def test_missing_header() -> None:
    with pytest.raises(SignatureError, match="missing X-Shopify-Hmac-Sha256 header"):
        P.verify(inbound(BODY, {}), source("shopify", SECRET))


@pytest.mark.parametrize("value", ["invalid_hmac", "sha256=" + hmac_b64(BODY, SECRET), "@@@@"])
def test_malformed_or_wrong_header(value: str) -> None:
    with pytest.raises(SignatureError):
        P.verify(delivery(**{"X-Shopify-Hmac-Sha256": value}), source("shopify", SECRET))


def test_hex_is_not_base64() -> None:
    hexed = hmac_hex(BODY, SECRET)
    with pytest.raises(SignatureError):
        P.verify(delivery(**{"X-Shopify-Hmac-Sha256": hexed}), source("shopify", SECRET))


def test_identify_keeps_event_id_in_meta_not_as_key() -> None:
    d = delivery()
    P.verify(d, source("shopify", SECRET))
    ident = P.identify(d, source("shopify", SECRET))
    assert ident.dedup_key == WEBHOOK_ID
    assert ident.event_type == "orders/create"
    assert ident.meta == {"shopify_event_id": EVENT_ID}


def test_identify_without_event_id() -> None:
    d = inbound(BODY, {"X-Shopify-Webhook-Id": WEBHOOK_ID})
    ident = P.identify(d, source("shopify", SECRET))
    assert (ident.dedup_key, ident.event_type, ident.meta) == (WEBHOOK_ID, None, {})


def test_event_id_is_never_the_key() -> None:
    d = inbound(BODY, {"X-Shopify-Event-Id": EVENT_ID})
    with pytest.raises(MissingKeyError):
        P.identify(d, source("shopify", SECRET))


def events_delivery(body: str = BODY, secret: str = SECRET, **extra: str):
    """The unprefixed family, as @shopify/shopify-api's "events" webhook type reads it."""
    h = {
        "shopify-hmac-sha256": hmac_b64(body, secret),
        "shopify-topic": "orders/create",
        "shopify-webhook-id": "events-" + WEBHOOK_ID,
        "shopify-event-id": "events-" + EVENT_ID,
        "shopify-shop-domain": "example.myshopify.com",
        "shopify-api-version": "2025-10",
    }
    h.update(extra)
    return inbound(body, h)


def test_unprefixed_family_is_verified_and_identified() -> None:
    d = events_delivery()
    P.verify(d, source("shopify", SECRET))
    ident = P.identify(d, source("shopify", SECRET))
    assert ident.dedup_key == "events-" + WEBHOOK_ID
    assert ident.event_type == "orders/create"
    assert ident.meta == {"shopify_event_id": "events-" + EVENT_ID}


def test_unprefixed_family_wrong_secret() -> None:
    with pytest.raises(SignatureError, match="signature does not match"):
        P.verify(events_delivery(secret="other"), source("shopify", SECRET))


def test_families_are_never_mixed() -> None:
    # shopify-hmac-sha256 present: only the shopify-* family is read, as the library does.
    d = events_delivery(**{"X-Shopify-Webhook-Id": "legacy-id"})
    assert P.identify(d, source("shopify", SECRET)).dedup_key == "events-" + WEBHOOK_ID
    mixed = inbound(
        BODY, {"shopify-hmac-sha256": hmac_b64(BODY, SECRET), "X-Shopify-Webhook-Id": "x"}
    )
    with pytest.raises(MissingKeyError):
        P.identify(mixed, source("shopify", SECRET))


def test_both_signature_headers_are_redacted() -> None:
    assert {"x-shopify-hmac-sha256", "shopify-hmac-sha256"} <= P.secret_headers
