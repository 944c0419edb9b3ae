"""Shopify: base64 HMAC-SHA256 of the raw body; key is the webhook id.

Shopify sends one of two header families: the ``X-Shopify-*`` one
(``X-Shopify-Hmac-Sha256``, ``X-Shopify-Webhook-Id``, ...) and the unprefixed
``shopify-*`` one that the official ``@shopify/shopify-api`` validates as its
"events" webhook type. As that library does, a delivery carrying
``shopify-hmac-sha256`` is read entirely from the ``shopify-*`` family, any
other from the ``X-Shopify-*`` family: the two are never mixed.
"""

from __future__ import annotations

from . import _common as c
from .base import Identified, Inbound, SignatureError, SourceConfig

EVENTS = "Shopify"
WEBHOOKS = "X-Shopify"


def _family(inbound: Inbound) -> str:
    """The prefix of the header family the delivery is read from."""
    return EVENTS if c.optional_header(inbound, "Shopify-Hmac-Sha256") else WEBHOOKS


class ShopifyProvider:
    """Shopify app webhooks, signed with the app's client secret."""

    name: str = "shopify"
    requires_json: bool = True
    secret_headers: frozenset[str] = frozenset({"x-shopify-hmac-sha256", "shopify-hmac-sha256"})

    def verify(self, inbound: Inbound, source: SourceConfig) -> None:
        """Check the base64 HMAC against every secret."""
        name = f"{_family(inbound)}-Hmac-Sha256"
        digest = c.from_b64(c.header(inbound, name))
        if digest is None:
            raise SignatureError(f"malformed {name} header")
        expected = (c.hmac_sha256(s.encode(), inbound.body) for s in c.secrets_of(source))
        if not c.any_match(expected, [digest]):
            raise SignatureError("signature does not match")

    def identify(self, inbound: Inbound, source: SourceConfig) -> Identified:
        """Retries keep the webhook id; the event id is shared by all subscriptions."""
        c.json_object(inbound)
        family = _family(inbound)
        meta = {}
        # One event fans out to several webhooks with the same event id, so it is not the key.
        event_id = c.optional_header(inbound, f"{family}-Event-Id")
        if event_id:
            meta["shopify_event_id"] = event_id
        return Identified(
            dedup_key=c.dedup_key(c.key_header(inbound, f"{family}-Webhook-Id")),
            event_type=c.optional_header(inbound, f"{family}-Topic"),
            meta=meta,
        )
