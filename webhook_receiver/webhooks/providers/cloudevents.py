"""CloudEvents over HTTP, binary and structured mode; key is source and id together.

The CloudEvents spec makes ``source`` + ``id`` unique, so the dedup key is the
compact JSON array ``["<source>","<id>"]`` (``json.dumps`` with ``(",", ":")``
separators, non-ASCII kept): unambiguous whatever characters either holds.
Authentication is the generic scheme on ``source.signature_header`` (HMAC-SHA256
hex of the raw body, optional ``word=`` prefix); that configured header is not
in ``secret_headers``: ``providers.redacted_headers(source)`` adds it.
Batched mode (``application/cloudevents-batch+json``) is refused.
"""

from __future__ import annotations

import json
from typing import Any

from . import _common as c
from .base import Identified, Inbound, MissingKeyError, PayloadError, SourceConfig

STRUCTURED = "application/cloudevents+json"
BATCH = "application/cloudevents-batch+json"


def _media_type(inbound: Inbound) -> str:
    return inbound.content_type.partition(";")[0].strip().lower()


class CloudEventsProvider:
    """Any CloudEvents 1.0 producer that signs with a shared HMAC secret."""

    name: str = "cloudevents"
    # Binary mode carries any content type; structured mode checks its JSON itself.
    requires_json: bool = False
    secret_headers: frozenset[str] = frozenset()

    def verify(self, inbound: Inbound, source: SourceConfig) -> None:
        """Check the configured HMAC header against every secret."""
        c.verify_hex_body(inbound, source)

    def identify(self, inbound: Inbound, source: SourceConfig) -> Identified:
        """Read id, source and type from the JSON (structured) or the ce-* headers (binary)."""
        media_type = _media_type(inbound)
        if media_type == BATCH:
            raise PayloadError("batched CloudEvents are not supported")
        attributes: dict[str, Any]
        if media_type == STRUCTURED:
            event = inbound.json if inbound.json is not None else c.parse_json(inbound.body)
            if not isinstance(event, dict):
                raise PayloadError("structured CloudEvent is not a JSON object")
            attributes = event
        else:
            attributes = {
                name: c.optional_header(inbound, f"ce-{name}")
                for name in ("id", "source", "type", "specversion")
            }
        ce_id, ce_source = (
            c.str_or_none(attributes.get("id")),
            c.str_or_none(attributes.get("source")),
        )
        if ce_id is None or ce_source is None:
            raise MissingKeyError("CloudEvent without id or source")
        key = json.dumps([ce_source, ce_id], separators=(",", ":"), ensure_ascii=False)
        meta = {"ce_mode": "structured" if media_type == STRUCTURED else "binary"}
        specversion = c.str_or_none(attributes.get("specversion"))
        if specversion:
            meta["ce_specversion"] = specversion
        return Identified(
            dedup_key=c.dedup_key(key),
            event_type=c.str_or_none(attributes.get("type")),
            meta=meta,
        )
