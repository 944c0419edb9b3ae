"""CloudEvents over HTTP, binary and structured mode; key is source and id together.

The CloudEvents spec makes ``source`` + ``id`` unique, so the dedup key is the
compact JSON array ``["<source>","<id>"]`` (``json.dumps`` with ``(",", ":")``
separators, non-ASCII kept): unambiguous whatever characters either holds.
Authentication is the generic, configurable scheme on ``source.signature_header``
(``_scheme.py``; by default HMAC-SHA256 hex of the raw body, optional ``word=``
prefix); that configured header is not
in ``secret_headers``: ``providers.redacted_headers(source)`` adds it.
Batched mode (``application/cloudevents-batch+json``, a JSON array of
structured events) is verified once over the raw body, then split by
:meth:`CloudEventsProvider.parts`: each event is stored as its own, under its
own key, as a structured delivery of it would be.

A sender that follows CloudEvents' "HTTP 1.1 Web Hooks for Event Delivery"
(Azure Event Grid among them) first asks ``OPTIONS`` with
``WebHook-Request-Origin``: :meth:`CloudEventsProvider.handshake` gives the
answer's headers, allowing that origin.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import unquote

from werkzeug.datastructures import Headers

from . import _common as c
from . import _scheme
from .base import Identified, Inbound, MissingKeyError, Part, PayloadError, SourceConfig

STRUCTURED = "application/cloudevents+json"
BATCH = "application/cloudevents-batch+json"
# The spec's origin is a host name (such as eventgrid.azure.net); it is echoed
# back in a header, so anything else is refused rather than reflected.
_ORIGIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9.:_-]{0,252}")


def _media_type(inbound: Inbound) -> str:
    return inbound.content_type.partition(";")[0].strip().lower()


class CloudEventsProvider:
    """Any CloudEvents 1.0 producer that signs with a shared HMAC secret."""

    name: str = "cloudevents"
    # Binary mode carries any content type; structured mode checks its JSON itself.
    requires_json: bool = False
    secret_headers: frozenset[str] = frozenset()

    def verify(self, inbound: Inbound, source: SourceConfig) -> None:
        """Check the configured HMAC header, by the source's scheme, against every secret."""
        _scheme.verify(inbound, source)

    def handshake(self, headers: Headers, source: SourceConfig) -> dict[str, str] | None:
        """Return the headers that answer a webhook validation request; None when not one."""
        origin = (headers.get("WebHook-Request-Origin") or "").strip()
        if not origin:
            return None
        if len(headers.getlist("WebHook-Request-Origin")) > 1 or not _ORIGIN.fullmatch(origin):
            raise PayloadError("WebHook-Request-Origin must be one host name")
        answer = {"WebHook-Allowed-Origin": origin, "Allow": "POST, OPTIONS"}
        if "WebHook-Request-Rate" in headers:
            # No limit on the rate: each delivery is one short transaction.
            answer["WebHook-Allowed-Rate"] = "*"
        return answer

    def identify(self, inbound: Inbound, source: SourceConfig) -> Identified:
        """Read id, source and type from the JSON (structured) or the ce-* headers (binary)."""
        media_type = _media_type(inbound)
        if media_type == BATCH:
            raise PayloadError("a batch is stored through parts(), not as one event")
        attributes: dict[str, Any]
        if media_type == STRUCTURED:
            event = inbound.json if inbound.json is not None else c.parse_json(inbound.body)
            if not isinstance(event, dict):
                raise PayloadError("structured CloudEvent is not a JSON object")
            return _identify(event, "structured")
        else:
            # id and source are the dedup key: a header sent twice is refused.
            attributes = {
                "id": _attribute(c.key_header(inbound, "ce-id"), "ce-id"),
                "source": _attribute(c.key_header(inbound, "ce-source"), "ce-source"),
                "type": _attribute(c.optional_header(inbound, "ce-type"), "ce-type"),
                "specversion": _attribute(
                    c.optional_header(inbound, "ce-specversion"), "ce-specversion"
                ),
            }
        return _identify(attributes, "binary")

    def parts(self, inbound: Inbound, source: SourceConfig) -> list[Part] | None:
        """Split a batch into its events; None when the delivery is not a batch."""
        if _media_type(inbound) != BATCH:
            return None
        events = inbound.json if inbound.json is not None else c.parse_json(inbound.body)
        if not isinstance(events, list):
            raise PayloadError("a CloudEvents batch is a JSON array of events")
        if not events:
            raise PayloadError("the CloudEvents batch is empty")
        found: list[Part] = []
        for n, event in enumerate(events):
            if not isinstance(event, dict):
                raise PayloadError(f"batch entry {n} is not a JSON object")
            try:
                identified = _identify(event, "batch")
            except MissingKeyError as exc:
                raise MissingKeyError(f"batch entry {n}: {exc}") from exc
            found.append(Part(identified, event))
        return found


def _attribute(value: str | None, name: str) -> str | None:
    """A ce-* header's attribute value: percent-decoded, as the HTTP binding (3.1.3.2) says.

    Senders percent-encode a space, '"', '%' and non-ASCII (the SDKs do), so
    the key and type are the event's own attributes, as in structured mode.
    """
    if value is None:
        return None
    try:
        return unquote(value, errors="strict")
    except UnicodeDecodeError as exc:
        raise PayloadError(f"the {name} header is not percent-encoded UTF-8") from exc


def _identify(attributes: dict[str, Any], mode: str) -> Identified:
    """The key (source and id), type and meta of one event's attributes."""
    ce_id, ce_source = (
        c.str_or_none(attributes.get("id")),
        c.str_or_none(attributes.get("source")),
    )
    if ce_id is None or ce_source is None:
        raise MissingKeyError("CloudEvent without id or source")
    key = json.dumps([ce_source, ce_id], separators=(",", ":"), ensure_ascii=False)
    meta = {"ce_mode": mode}
    specversion = c.str_or_none(attributes.get("specversion"))
    if specversion:
        meta["ce_specversion"] = specversion
    return Identified(
        dedup_key=c.dedup_key(key),
        event_type=c.str_or_none(attributes.get("type")),
        meta=meta,
    )
