"""Stripe: ``Stripe-Signature: t=<unix>,v1=<hex>`` over ``<t>.<raw body>``; key is the event id."""

from __future__ import annotations

from . import _common as c
from .base import Identified, Inbound, SourceConfig


class StripeProvider:
    """Stripe webhook endpoints, with secret rotation and a two-sided timestamp window."""

    name: str = "stripe"
    requires_json: bool = True
    secret_headers: frozenset[str] = frozenset({"stripe-signature"})
    # The endpoints the event is still to be delivered to, counted anew on each
    # attempt: a retry after another endpoint acknowledged carries a lower one.
    volatile_members: frozenset[str] = frozenset({"pending_webhooks"})

    def verify(self, inbound: Inbound, source: SourceConfig) -> None:
        """Check any v1 signature against every secret, then the timestamp."""
        # Other schemes (v0 test signatures, future ones) are ignored, as Stripe's SDK does.
        # Stripe keys the HMAC with the whsec_... string itself, not its decoding.
        c.verify_stamped(inbound, source, "Stripe-Signature", ",", "t", "v1", "{signed_at}.")

    def identify(self, inbound: Inbound, source: SourceConfig) -> Identified:
        """The event id stays the same when Stripe retries (and re-signs) a delivery."""
        event = c.json_object(inbound)
        return Identified(
            dedup_key=c.dedup_key(event.get("id"), "id"),
            event_type=c.str_or_none(event.get("type")),
        )
