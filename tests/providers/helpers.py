"""Builders for provider unit tests: an Inbound as the receipt code would make it, a source."""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from werkzeug.datastructures import Headers

from webhook_receiver.webhooks.providers import Inbound, SourceConfig

NOW = 1_700_000_000


def inbound(
    body: bytes | str,
    headers: dict[str, str] | None = None,
    *,
    now: float = NOW,
    content_type: str = "application/json",
) -> Inbound:
    """Build an Inbound; ``json`` is the parsed body when it parses, else None."""
    raw = body.encode() if isinstance(body, str) else body
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


def hex_hmac(secret: str, message: bytes) -> str:
    """HMAC-SHA256 of message keyed with the secret's UTF-8 bytes, as hex."""
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()
