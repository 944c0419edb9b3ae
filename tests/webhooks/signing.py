"""Sign deliveries the way each provider does, with its official SDK where one exists."""

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
    digest = hmac.new(GITHUB_SECRET.encode(), body, hashlib.sha256).hexdigest()
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
    digest = base64.b64encode(
        hmac.new(SHOPIFY_SECRET.encode(), body, hashlib.sha256).digest()
    ).decode()
    return body, {
        "X-Shopify-Hmac-Sha256": digest,
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


def hmac_hex(body: bytes, secret: str = GENERIC_SECRET) -> str:
    return hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def _bytes(body: str | bytes) -> bytes:
    return body.encode() if isinstance(body, str) else body


def stripe_signature(body: str | bytes, secret: str, t: int) -> str:
    """A ``Stripe-Signature``: HMAC keyed with the whsec_ string over ``<t>.<body>``."""
    return f"t={t},v1={hmac_hex(b'%d.%s' % (t, _bytes(body)), secret)}"


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
