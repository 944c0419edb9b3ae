"""Shopify: ``X-Shopify-Hmac-Sha256``, base64 HMAC-SHA256 of the raw body; key is the webhook id."""

from __future__ import annotations

from . import _common as c
from .base import Identified, Inbound, SignatureError, SourceConfig


class ShopifyProvider:
    """Shopify app webhooks, signed with the app's client secret."""

    name: str = "shopify"
    requires_json: bool = True
    secret_headers: frozenset[str] = frozenset({"x-shopify-hmac-sha256"})

    def verify(self, inbound: Inbound, source: SourceConfig) -> None:
        """Check the base64 HMAC against every secret."""
        digest = c.from_b64(c.header(inbound, "X-Shopify-Hmac-Sha256"))
        if digest is None:
            raise SignatureError("malformed X-Shopify-Hmac-Sha256 header")
        expected = (c.hmac_sha256(s.encode(), inbound.body) for s in c.secrets_of(source))
        if not c.any_match(expected, [digest]):
            raise SignatureError("signature does not match")

    def identify(self, inbound: Inbound, source: SourceConfig) -> Identified:
        """Retries keep X-Shopify-Webhook-Id; the event id is shared by all subscriptions."""
        c.json_object(inbound)
        meta = {}
        # One event fans out to several webhooks with the same event id, so it is not the key.
        event_id = c.optional_header(inbound, "X-Shopify-Event-Id")
        if event_id:
            meta["shopify_event_id"] = event_id
        return Identified(
            dedup_key=c.dedup_key(c.key_header(inbound, "X-Shopify-Webhook-Id")),
            event_type=c.optional_header(inbound, "X-Shopify-Topic"),
            meta=meta,
        )
