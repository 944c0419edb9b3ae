"""GitLab: the shared ``X-Gitlab-Token``; key is Idempotency-Key, else X-Gitlab-Event-UUID."""

from __future__ import annotations

from . import _common as c
from .base import Identified, Inbound, SignatureError, SourceConfig


class GitLabProvider:
    """GitLab project and group webhooks, authenticated by a secret token (no HMAC)."""

    name: str = "gitlab"
    requires_json: bool = True
    secret_headers: frozenset[str] = frozenset({"x-gitlab-token"})

    def verify(self, inbound: Inbound, source: SourceConfig) -> None:
        """The token must equal one of the secrets."""
        # The token's bytes as GitLab wrote them (UTF-8), as the generic scheme signs headers.
        token = c.raw(c.header(inbound, "X-Gitlab-Token"), "X-Gitlab-Token")
        # Every secret is compared, so timing does not tell which (if any) matched.
        if not any([c.same_token(token, s) for s in c.secrets_of(source)]):
            raise SignatureError("token does not match")

    def identify(self, inbound: Inbound, source: SourceConfig) -> Identified:
        """GitLab keeps Idempotency-Key across retries; older versions only send the event UUID."""
        payload = c.json_object(inbound)
        key = c.key_header(inbound, "Idempotency-Key") or c.key_header(
            inbound, "X-Gitlab-Event-UUID"
        )
        event = c.optional_header(inbound, "X-Gitlab-Event") or c.str_or_none(
            payload.get("object_kind")
        )
        return Identified(dedup_key=c.dedup_key(key), event_type=event)
