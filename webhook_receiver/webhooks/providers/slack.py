"""Slack: ``X-Slack-Signature: v0=<hex>`` over ``v0:<timestamp>:<raw body>``; key is event_id."""

from __future__ import annotations

from . import _common as c
from .base import Identified, Inbound, PayloadError, SignatureError, SourceConfig


class SlackProvider:
    """Slack Events API requests, including the url_verification handshake."""

    name: str = "slack"
    requires_json: bool = True
    # The retry headers change on every attempt, so they must stay out of the fingerprint.
    secret_headers: frozenset[str] = frozenset(
        {
            "x-slack-signature",
            "x-slack-request-timestamp",
            "x-slack-retry-num",
            "x-slack-retry-reason",
        }
    )

    def verify(self, inbound: Inbound, source: SourceConfig) -> None:
        """Check the v0 signature against every secret, then the timestamp."""
        stamp = c.header(inbound, "X-Slack-Request-Timestamp")
        signed_at = c.timestamp(stamp, "X-Slack-Request-Timestamp")
        scheme, _, data = c.header(inbound, "X-Slack-Signature").partition("=")
        digest = c.from_hex(data) if scheme == "v0" else None
        if digest is None:
            raise SignatureError("malformed X-Slack-Signature header")
        message = f"v0:{stamp}:".encode() + inbound.body
        expected = (c.hmac_sha256(s.encode(), message) for s in c.secrets_of(source))
        if not c.any_match(expected, [digest]):
            raise SignatureError("signature does not match")
        c.check_tolerance(signed_at, inbound, source)

    def identify(self, inbound: Inbound, source: SourceConfig) -> Identified:
        """Answer the handshake at once; otherwise the event_id survives Slack's retries."""
        payload = c.json_object(inbound)
        if payload.get("type") == "url_verification":
            challenge = payload.get("challenge")
            if not isinstance(challenge, str):
                raise PayloadError("url_verification without a challenge")
            return Identified(
                dedup_key="",
                event_type="url_verification",
                immediate_response={"challenge": challenge},
            )
        event = payload.get("event")
        event_type = c.str_or_none(event.get("type")) if isinstance(event, dict) else None
        return Identified(
            dedup_key=c.dedup_key(payload.get("event_id")),
            event_type=event_type or c.str_or_none(payload.get("type")),
        )
