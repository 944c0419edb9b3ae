"""GitHub: ``X-Hub-Signature-256: sha256=<hex>`` over the raw body; key is X-GitHub-Delivery."""

from __future__ import annotations

from . import _common as c
from .base import Identified, Inbound, SignatureError, SourceConfig


class GitHubProvider:
    """GitHub repository, organisation and app webhooks (JSON content type only)."""

    name: str = "github"
    requires_json: bool = True
    # The SHA-1 header is never checked but still carries a signature, so it is redacted too.
    secret_headers: frozenset[str] = frozenset({"x-hub-signature", "x-hub-signature-256"})

    def verify(self, inbound: Inbound, source: SourceConfig) -> None:
        """Check the SHA-256 signature against every secret."""
        value = c.header(inbound, "X-Hub-Signature-256")
        scheme, _, data = value.partition("=")
        digest = c.from_hex(data) if scheme == "sha256" else None
        if digest is None:
            raise SignatureError("malformed X-Hub-Signature-256 header")
        expected = (c.hmac_sha256(s.encode(), inbound.body) for s in c.secrets_of(source))
        if not c.any_match(expected, [digest]):
            raise SignatureError("signature does not match")

    def identify(self, inbound: Inbound, source: SourceConfig) -> Identified:
        """Redeliveries keep the delivery GUID; the type is ``<event>[.<action>]``."""
        payload = c.json_object(inbound)
        key = c.dedup_key(c.key_header(inbound, "X-GitHub-Delivery"))
        event = c.optional_header(inbound, "X-GitHub-Event")
        action = c.str_or_none(payload.get("action"))
        if event and action:
            event = f"{event}.{action}"
        return Identified(dedup_key=key, event_type=event)
