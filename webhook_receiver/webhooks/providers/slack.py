"""Slack: ``X-Slack-Signature: v0=<hex>`` over ``v0:<timestamp>:<raw body>``; key is event_id.

Events API requests only: Slack sends interactivity (``payload=<JSON>``)
and slash commands form-encoded, with no event_id and never retried, and
waits for an answer of their own (a modal's ``response_action``, a menu's
options), which a receiver that stores and forwards cannot give; they are
refused (400) saying so, once their signature is checked.

Only ``event_callback`` requests carry an ``event_id``. The others are
notices about the app, such as ``app_rate_limited``: they are answered 200
``{"status": "ignored", "type": ...}`` once their signature is checked, logged,
and stored nowhere (``url_verification`` gets its challenge back).
"""

from __future__ import annotations

import logging

from . import _common as c
from .base import Identified, Inbound, PayloadError, SignatureError, SourceConfig

log = logging.getLogger(__name__)

# The one callback type that is an event: it must have its event_id.
EVENT_CALLBACK = "event_callback"
# An ignored callback's type is logged and echoed: real ones are short words.
_MAX_TYPE_LENGTH = 100
FORM = "application/x-www-form-urlencoded"


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

    def decode(self, inbound: Inbound, source: SourceConfig) -> Inbound:
        """Refuse a verified form request (interactivity, a slash command); others as is."""
        if inbound.content_type.partition(";")[0].strip().lower() == FORM:
            raise PayloadError(
                "a form-encoded Slack request (interactivity, a slash command) is not "
                "received: the slack preset takes Events API requests (JSON) only"
            )
        return inbound

    def identify(self, inbound: Inbound, source: SourceConfig) -> Identified:
        """Answer the handshake and id-less notices at once; event_id survives Slack's retries."""
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
        callback = c.str_or_none(payload.get("type"))
        if payload.get("event_id") is None and callback and callback != EVENT_CALLBACK:
            # A notice (app_rate_limited, ...), not an event: acknowledged, so
            # Slack does not retry it, and nothing is stored.
            if len(callback) > _MAX_TYPE_LENGTH:
                raise PayloadError(f"callback type longer than {_MAX_TYPE_LENGTH} characters")
            log.info(
                "slack callback ignored",
                extra={"outcome": "ignored", "source": source.name, "callback_type": callback},
            )
            return Identified(
                dedup_key="",
                event_type=callback,
                immediate_response={"status": "ignored", "type": callback},
            )
        event = payload.get("event")
        event_type = c.str_or_none(event.get("type")) if isinstance(event, dict) else None
        return Identified(
            dedup_key=c.dedup_key(payload.get("event_id"), "event_id"),
            event_type=event_type or c.str_or_none(payload.get("type")),
        )
