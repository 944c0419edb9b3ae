"""Sign deliveries the way each provider does, with its official SDK where one exists.

The test sources (``SOURCES``) and their secrets, a correctly signed delivery
for each (``delivery_for``), the HMAC primitives, and the provider unit
tests' builders (``inbound``, ``source``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import stripe
from slack_sdk.signature import SignatureVerifier
from svix.webhooks import Webhook as SvixWebhook
from werkzeug.datastructures import Headers

from webhook_receiver.webhooks.providers import Inbound, SourceConfig

STRIPE_SECRET = "whsec_test_stripe_secret_0123456789"
GITHUB_SECRET = "It's a Secret to Everybody"
STANDARD_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SHOPIFY_SECRET = "shpss_test_secret_0123456789"
SLACK_SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
GITLAB_SECRET = "gitlab-token-0123456789"
GENERIC_SECRET = "generic-secret-0123456789"
PADDLE_SECRET = "pdl_ntfset_test_secret_0123456789"

SOURCES: dict[str, dict[str, Any]] = {
    "stripe-live": {"provider": "stripe", "secrets": [STRIPE_SECRET]},
    "github": {"provider": "github", "secrets": [GITHUB_SECRET]},
    "svix": {"provider": "standard", "secrets": [STANDARD_SECRET]},
    "shop": {"provider": "shopify", "secrets": [SHOPIFY_SECRET]},
    "slack": {"provider": "slack", "secrets": [SLACK_SECRET]},
    "gitlab": {"provider": "gitlab", "secrets": [GITLAB_SECRET]},
    "ce": {
        "provider": "cloudevents",
        "secrets": [GENERIC_SECRET],
        "signature_header": "X-Signature",
    },
    "generic-json": {
        "provider": "generic",
        "secrets": [GENERIC_SECRET],
        "signature_header": "X-Hub-Signature",
        "dedup_key": "json:/meta/delivery",
    },
    "paddle": {"provider": "paddle", "secrets": [PADDLE_SECRET]},
}


def dumps(payload: Any) -> bytes:
    return json.dumps(payload).encode()


def stripe_delivery(event: dict[str, Any], secret: str = STRIPE_SECRET, t: int | None = None):
    body = dumps(event)
    header = stripe.WebhookSignature.generate_signature_header(
        body.decode(), secret, timestamp=t if t is not None else int(time.time())
    )
    return body, {"Stripe-Signature": header, "Content-Type": "application/json"}


def github_delivery(payload: dict[str, Any], delivery: str | None = None, event="push"):
    body = dumps(payload)
    digest = hmac_hex(body, GITHUB_SECRET)
    return body, {
        "X-Hub-Signature-256": f"sha256={digest}",
        "X-GitHub-Delivery": delivery or str(uuid.uuid4()),
        "X-GitHub-Event": event,
        "Content-Type": "application/json",
    }


def standard_delivery(payload: dict[str, Any], msg_id: str, t: int | None = None):
    body = dumps(payload)
    stamp = datetime.fromtimestamp(t if t is not None else int(time.time()), tz=UTC)
    signature = SvixWebhook(STANDARD_SECRET).sign(msg_id, stamp, body.decode())
    return body, {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(stamp.timestamp())),
        "webhook-signature": signature,
        "Content-Type": "application/json",
    }


def shopify_delivery(payload: dict[str, Any], webhook_id: str, event_id: str = "evt-1"):
    body = dumps(payload)
    return body, {
        "X-Shopify-Hmac-Sha256": hmac_b64(body, SHOPIFY_SECRET),
        "X-Shopify-Webhook-Id": webhook_id,
        "X-Shopify-Event-Id": event_id,
        "X-Shopify-Topic": "orders/create",
        "Content-Type": "application/json",
    }


def slack_delivery(payload: dict[str, Any], t: int | None = None):
    body = dumps(payload)
    stamp = str(t if t is not None else int(time.time()))
    signature = SignatureVerifier(SLACK_SECRET).generate_signature(timestamp=stamp, body=body)
    return body, {
        "X-Slack-Signature": signature,
        "X-Slack-Request-Timestamp": stamp,
        "Content-Type": "application/json",
    }


def _bytes(body: str | bytes) -> bytes:
    return body.encode() if isinstance(body, str) else body


def hmac_digest(body: str | bytes, secret: str | bytes, algorithm: str = "sha256") -> bytes:
    """The HMAC of ``body`` keyed with ``secret`` (text as its UTF-8 bytes)."""
    return hmac.new(_bytes(secret), _bytes(body), getattr(hashlib, algorithm)).digest()


def hmac_hex(body: str | bytes, secret: str = GENERIC_SECRET, algorithm: str = "sha256") -> str:
    """The HMAC of ``body`` as hex, keyed with ``secret`` (the generic sources' by default)."""
    return hmac_digest(body, secret, algorithm).hex()


def hmac_b64(body: str | bytes, secret: str, algorithm: str = "sha256") -> str:
    """The HMAC of ``body`` in base64, as Shopify (and others) send it."""
    return base64.b64encode(hmac_digest(body, secret, algorithm)).decode()


def stripe_signature(body: str | bytes, secret: str, t: int) -> str:
    """A ``Stripe-Signature``: HMAC keyed with the whsec_ string over ``<t>.<body>``."""
    return f"t={t},v1={hmac_hex(b'%d.%s' % (t, _bytes(body)), secret)}"


def stripe_signed(body: bytes, t: int, secret: str = STRIPE_SECRET) -> dict[str, str]:
    """Headers that sign a JSON ``body`` for the Stripe test source at ``t``, however large."""
    return {
        "Stripe-Signature": stripe_signature(body, secret, t),
        "Content-Type": "application/json",
    }


def slack_signature(body: str | bytes, secret: str, ts: int | str) -> str:
    """An ``X-Slack-Signature``: ``v0=`` and the HMAC of ``v0:<ts>:<body>``."""
    return "v0=" + hmac_hex(b"v0:%s:%s" % (str(ts).encode(), _bytes(body)), secret)


def paddle_h1(body: str | bytes, secret: str, ts: int) -> str:
    """A ``Paddle-Signature``'s ``h1``: the HMAC of ``<ts>:<body>``."""
    return hmac_hex(b"%d:%s" % (ts, _bytes(body)), secret)


def paddle_delivery(payload: dict[str, Any], t: int | None = None):
    """A Paddle Billing notification: ``Paddle-Signature: ts=<t>;h1=<hmac of t:body>``."""
    body = dumps(payload)
    ts = t if t is not None else int(time.time())
    digest = paddle_h1(body, PADDLE_SECRET, ts)
    return body, {"Paddle-Signature": f"ts={ts};h1={digest}", "Content-Type": "application/json"}


def delivery_for(source: str, key: str) -> tuple[bytes, dict[str, str]]:
    """A correctly signed delivery to one of the test ``SOURCES``, under ``key``."""
    if source == "stripe-live":
        return stripe_delivery({"id": key, "type": "invoice.paid"})
    if source == "github":
        return github_delivery({"action": "opened"}, delivery=key)
    if source == "svix":
        return standard_delivery({"type": "x"}, msg_id=key)
    if source == "shop":
        return shopify_delivery({"id": 1}, webhook_id=key)
    if source == "slack":
        return slack_delivery({"type": "event_callback", "event_id": key})
    if source == "gitlab":
        return dumps({"object_kind": "push"}), {
            "X-Gitlab-Token": GITLAB_SECRET,
            "X-Gitlab-Event-UUID": key,
            "Content-Type": "application/json",
        }
    if source == "ce":
        body = dumps({"key": key})
        return body, {
            "X-Signature": hmac_hex(body),
            "ce-id": key,
            "ce-source": "/test",
            "ce-type": "t",
            "ce-specversion": "1.0",
            "Content-Type": "application/json",
        }
    if source == "generic-json":
        body = dumps({"meta": {"delivery": key}})
        return body, {"X-Hub-Signature": hmac_hex(body), "Content-Type": "application/json"}
    if source == "paddle":
        return paddle_delivery(
            {"notification_id": f"ntf_{key}", "event_id": key, "event_type": "transaction.created"}
        )
    raise AssertionError(f"no delivery builder for source {source}")


# -- provider unit tests: an Inbound as the receipt code would make it, a source --

NOW = 1_700_000_000


def inbound(
    body: bytes | str,
    headers: dict[str, str] | None = None,
    *,
    now: float = NOW,
    content_type: str = "application/json",
) -> Inbound:
    """Build an Inbound; ``json`` is the parsed body when it parses, else None."""
    raw = _bytes(body)
    try:
        parsed: Any = json.loads(raw)
    except ValueError:
        parsed = None
    return Inbound(
        body=raw, headers=Headers(headers or {}), content_type=content_type, json=parsed, now=now
    )


def source(provider: str, *secrets: str, **kwargs: Any) -> SourceConfig:
    """Build a SourceConfig named after its provider."""
    return SourceConfig(name=f"test-{provider}", provider=provider, secrets=secrets, **kwargs)
