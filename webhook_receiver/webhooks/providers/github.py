"""GitHub: ``X-Hub-Signature-256: sha256=<hex>`` over the raw body; key is X-GitHub-Delivery.

A webhook's content type is a setting: ``application/json``, or
``application/x-www-form-urlencoded``, where the body is ``payload=<url-encoded
JSON>``. The signature covers the raw bytes either way; :meth:`GitHubProvider.decode`
then reads the JSON from the ``payload`` field, so a form delivery is
identified and fingerprinted as the JSON delivery of the same content.
"""

from __future__ import annotations

from dataclasses import replace
from urllib.parse import parse_qs

from ...fingerprint import JSONError, loads
from . import _common as c
from .base import Identified, Inbound, PayloadError, SignatureError, SourceConfig

FORM = "application/x-www-form-urlencoded"
# GitHub sends one field; a bound keeps a hostile form from costing much to split.
_MAX_FORM_FIELDS = 16


class GitHubProvider:
    """GitHub repository, organisation and app webhooks, JSON or form-encoded."""

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

    def decode(self, inbound: Inbound, source: SourceConfig) -> Inbound:
        """Return a verified form delivery with the JSON of its ``payload`` field; others as is."""
        if inbound.content_type.partition(";")[0].strip().lower() != FORM:
            return inbound
        try:
            # Form bodies are percent-encoded ASCII; the field's bytes are UTF-8.
            fields = parse_qs(
                inbound.body.decode("ascii"),
                keep_blank_values=True,
                strict_parsing=True,
                errors="strict",
                max_num_fields=_MAX_FORM_FIELDS,
            )
        except (UnicodeDecodeError, ValueError) as exc:
            raise PayloadError("the form body cannot be read as a GitHub delivery") from exc
        payloads = fields.get("payload", [])
        if len(payloads) != 1:
            # Two payloads would leave it open which one is the event.
            raise PayloadError("a GitHub form delivery carries exactly one payload field")
        try:
            # As the receipt reads a JSON body: a lone surrogate's escape is JSON.
            payload = loads(payloads[0].encode(), lone_surrogates=True)
        except JSONError as exc:
            raise PayloadError(f"the payload field is not JSON: {exc}") from exc
        return replace(inbound, json=payload)

    def identify(self, inbound: Inbound, source: SourceConfig) -> Identified:
        """Redeliveries keep the delivery GUID; the type is ``<event>[.<action>]``."""
        payload = c.json_object(inbound)
        key = c.dedup_key(c.key_header(inbound, "X-GitHub-Delivery"))
        event = c.optional_header(inbound, "X-GitHub-Event")
        action = c.str_or_none(payload.get("action"))
        if event and action:
            event = f"{event}.{action}"
        return Identified(dedup_key=key, event_type=event)
