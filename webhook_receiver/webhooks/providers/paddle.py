"""Paddle Billing: ``Paddle-Signature: ts=..;h1=<hex>`` over ``<ts>:<body>``; key: notification_id.

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

    def verify(self, inbound: Inbound, source: SourceConfig) -> None:
        """Check any h1 signature against every secret, then the timestamp."""
        # Schemes Paddle may add later are ignored: h1 is what is checked.
        c.verify_stamped(inbound, source, "Paddle-Signature", ";", "ts", "h1", "{stamp}:")

    def identify(self, inbound: Inbound, source: SourceConfig) -> Identified:
        """Retries keep the notification id; the event id is shared by every destination."""
        payload = c.json_object(inbound)
        meta = {}
        # One event is sent to each destination under its own notification id.
        event_id = c.str_or_none(payload.get("event_id"))
        if event_id:
            meta["paddle_event_id"] = event_id
        return Identified(
            dedup_key=c.dedup_key(payload.get("notification_id")),
            event_type=c.str_or_none(payload.get("event_type")),
            meta=meta,
        )
