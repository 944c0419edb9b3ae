"""Paddle Billing: ``Paddle-Signature: ts=..;h1=<hex>`` over ``<ts>:<body>``; key: event_id.

The timestamp and the signature share one header, which the configurable
generic scheme cannot express (its timestamp has a header of its own): hence
this small preset. Paddle Classic (an RSA ``p_signature`` form field) is not
Paddle Billing and is not received.
"""

from __future__ import annotations

from . import _common as c
from .base import Identified, Inbound, SourceConfig


class PaddleProvider:
    """Paddle Billing notification destinations, with secret rotation (several h1 values)."""

    name: str = "paddle"
    requires_json: bool = True
    secret_headers: frozenset[str] = frozenset({"paddle-signature"})
    # A replayed notification is a new one, with its own notification_id,
    # for the same event: that id is no part of the content.
    volatile_members: frozenset[str] = frozenset({"notification_id"})

    def verify(self, inbound: Inbound, source: SourceConfig) -> None:
        """Check any h1 signature against every secret, then the timestamp."""
        # Schemes Paddle may add later are ignored: h1 is what is checked.
        c.verify_stamped(inbound, source, "Paddle-Signature", ";", "ts", "h1", "{stamp}:")

    def identify(self, inbound: Inbound, source: SourceConfig) -> Identified:
        """The event id is the same on retries and on replays, which get a new notification id."""
        payload = c.json_object(inbound)
        meta = {}
        notification_id = c.str_or_none(payload.get("notification_id"))
        if notification_id:
            # Kept beside the body, which has it as sent: a lone surrogate as its escape.
            meta["paddle_notification_id"] = c.escaped_surrogates(notification_id)
        return Identified(
            dedup_key=c.dedup_key(payload.get("event_id"), "event_id"),
            event_type=c.str_or_none(payload.get("event_type")),
            meta=meta,
        )
