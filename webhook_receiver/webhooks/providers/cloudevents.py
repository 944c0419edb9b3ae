"""CloudEvents over HTTP, binary and structured mode; key is source and id together.

The CloudEvents spec makes ``source`` + ``id`` unique, so the dedup key is the
compact JSON array ``["<source>","<id>"]`` (``json.dumps`` with ``(",", ":")``
separators, non-ASCII kept): unambiguous whatever characters either holds.
Authentication is the generic, configurable scheme on ``source.signature_header``
(``_scheme.py``; by default HMAC-SHA256 hex of the raw body, optional ``word=``
prefix); that configured header is not
in ``secret_headers``: ``providers.redacted_headers(source)`` adds it.
The fingerprint covers the event, not its encoding: the HTTP binding lets
a sender pick binary or structured mode for each delivery, so a retry may
come in the other one. :meth:`CloudEventsProvider.decode` gives the receipt
the event's structured form in one canonical shape (:func:`canonical_event`),
which it fingerprints as it would a JSON body; the raw body is what is stored.

Batched mode (``application/cloudevents-batch+json``, a JSON array of
structured events) is verified once over the raw body, then split by
:meth:`CloudEventsProvider.parts`: each event is stored as its own, under its
own key, and fingerprinted in the canonical form, as a structured delivery
of it would be.

A sender that follows CloudEvents' "HTTP 1.1 Web Hooks for Event Delivery"
(Azure Event Grid among them) first asks ``OPTIONS`` with
``WebHook-Request-Origin``: :meth:`CloudEventsProvider.handshake` gives the
answer's headers, allowing that origin.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import replace
from typing import Any
from urllib.parse import unquote

from werkzeug.datastructures import Headers

from ...fingerprint import JSONError, canonical_number, loads
from . import _common as c
from . import _scheme
from .base import Identified, Inbound, MissingKeyError, Part, PayloadError, SourceConfig

STRUCTURED = "application/cloudevents+json"
BATCH = "application/cloudevents-batch+json"
# The spec's origin is a host name (such as eventgrid.azure.net); it is echoed
# back in a header, so anything else is refused rather than reflected.
_ORIGIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9.:_-]{0,252}")
# What JSON format 3.1.1 implies for data without a datacontenttype.
DEFAULT_DATA_TYPE = "application/json"
# The attributes whose values identify the event: kept as sent (a
# non-string id is no id, refused as such, rather than turned into one).
_KEY_ATTRIBUTES = frozenset({"id", "source", "type", "specversion"})
# Attributes a hop stamps on each delivery rather than the producer on the
# event: Knative's broker stamps the time it took the event in, so a
# producer's retry through it carries another. They are not content.
TRANSPORT_ATTRIBUTES = frozenset({"knativearrivaltime"})
# A ce-* header that would be the data itself in the structured form.
_NOT_ATTRIBUTES = frozenset({"data", "data_base64"})


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
        # Allowing delivery, both headers are a MUST (4.2), a rate asked for or
        # not; no limit on the rate: each delivery is one short transaction.
        return {
            "WebHook-Allowed-Origin": origin,
            "WebHook-Allowed-Rate": "*",
            "Allow": "POST, OPTIONS",
        }

    def decode(self, inbound: Inbound, source: SourceConfig) -> Inbound:
        """The delivery with its ``json`` the event in canonical form, for its fingerprint.

        A batch is left as it is (split by :meth:`parts`). Raises PayloadError
        when a structured event is not a JSON object.
        """
        media_type = _media_type(inbound)
        if media_type == BATCH:
            return inbound
        if media_type == STRUCTURED:
            return replace(inbound, json=canonical_structured(_structured_event(inbound)))
        attributes = _binary_attributes(inbound, source)
        data = _binary_data(inbound, attributes.get("datacontenttype"))
        return replace(inbound, json=canonical_event(attributes, data))

    def identify(self, inbound: Inbound, source: SourceConfig) -> Identified:
        """Read id, source and type from the JSON (structured) or the ce-* headers (binary)."""
        media_type = _media_type(inbound)
        if media_type == BATCH:
            raise PayloadError("a batch is stored through parts(), not as one event")
        attributes: dict[str, Any]
        if media_type == STRUCTURED:
            return _identify(_structured_event(inbound), "structured")
        else:
            # id and source are the dedup key: a header sent twice is refused.
            # Either may hold a comma (a URI-reference may), which the binding
            # does not percent-encode.
            attributes = {
                "id": _attribute(_key_attribute(inbound, "ce-id"), "ce-id"),
                "source": _attribute(_key_attribute(inbound, "ce-source"), "ce-source"),
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
        events = _json_of(inbound)
        if not isinstance(events, list):
            raise PayloadError("a CloudEvents batch is a JSON array of events")
        # An empty array is a valid batch (JSON format 4.3): it has no parts.
        found: list[Part] = []
        for n, event in enumerate(events):
            if not isinstance(event, dict):
                raise PayloadError(f"batch entry {n} is not a JSON object")
            try:
                identified = _identify(event, "batch")
            except MissingKeyError as exc:
                raise MissingKeyError(f"batch entry {n}: {exc}") from exc
            found.append(Part(identified, event, canonical_structured(event)))
        return found


def _json_of(inbound: Inbound) -> Any:
    """The delivery's JSON, as the receipt parsed it (or parsed here when it did not)."""
    if inbound.json is not None:
        return inbound.json
    return c.parse_json(inbound.body, lone_surrogates=True)


def _structured_event(inbound: Inbound) -> dict[str, Any]:
    event = _json_of(inbound)
    if not isinstance(event, dict):
        raise PayloadError("structured CloudEvent is not a JSON object")
    return event


def _key_attribute(inbound: Inbound, name: str) -> str | None:
    """ce-id or ce-source, sent once: a field repeated is refused, a comma in one is not.

    gunicorn joins a field sent twice with a comma (RFC 9110 5.3), and a key
    that changed with how often a header was repeated would let a copy
    through as new: a second line, or one value joined to itself, is
    refused. Other commas are the value's own.
    """
    values = inbound.headers.getlist(name)
    if len(values) > 1:
        raise PayloadError(f"the {name} header was sent more than once")
    value = c.optional_header(inbound, name)
    if value is not None and "," in value:
        if len({part.strip() for part in value.split(",")}) == 1:
            raise PayloadError(f"the {name} header was sent more than once")
    return value


def _binary_attributes(inbound: Inbound, source: SourceConfig) -> dict[str, Any]:
    """Every attribute of a binary-mode delivery: its ce-* headers, and the Content-Type."""
    # A signature or timestamp header of the source's is the delivery's, not the event's.
    own = {
        name.lower()
        for name in (source.signature_header, source.extra.get("timestamp_header"))
        if isinstance(name, str)
    }
    attributes: dict[str, Any] = {}
    sent = {name.lower() for name in inbound.headers.keys() if name[:3].lower() == "ce-"}
    for header_name in sorted(sent - own):
        name = header_name[3:]
        if name in _NOT_ATTRIBUTES:
            raise PayloadError(f"{header_name} is no attribute: the data is the body")
        # A field sent on several lines is one value, as a server joins it.
        value = ",".join(inbound.headers.getlist(header_name)).strip()
        try:
            attributes[name] = _attribute(value, header_name)
        except PayloadError:
            # Not percent-encoded UTF-8: identify() refuses such an id,
            # source or type; an extension is compared as it came.
            attributes[name] = value
    content_type = inbound.content_type.strip()
    if content_type:
        attributes["datacontenttype"] = content_type
    return attributes


def _binary_data(inbound: Inbound, content_type: Any) -> tuple[str, Any] | None:
    """A binary-mode delivery's data: its body, read as its Content-Type says."""
    if not inbound.body:
        return None  # an event without data (HTTP binding 3.1.1)
    if _declares_json(content_type) and inbound.json is not None:
        return ("json", inbound.json)
    return _bytes_data(inbound.body, content_type)


def _structured_data(event: dict[str, Any], content_type: Any) -> tuple[str, Any] | None:
    """A structured event's data, as JSON format 3.1.2 reads it."""
    if "data_base64" in event:
        encoded = event["data_base64"]
        decoded = c.from_b64(encoded) if isinstance(encoded, str) else None
        # Not base64 after all, or beside data (the format forbids both):
        # the members are compared as they came, every one counting.
        if decoded is None or "data" in event:
            return ("members", {k: v for k, v in event.items() if k in _NOT_ATTRIBUTES})
        return _bytes_data(decoded, content_type)
    if "data" not in event:
        return None
    data = event["data"]
    if _declares_json(content_type):
        return ("json", data)
    if isinstance(data, str):  # text, encoded as the content type says
        return ("text", data)
    return ("json", data)  # not text under a type that is not JSON: kept as it came


def _bytes_data(data: bytes, content_type: Any) -> tuple[str, Any]:
    """Data that came as bytes: JSON when so declared and it parses, else text, else bytes."""
    if _declares_json(content_type):
        try:
            return ("json", loads(data, lone_surrogates=True))
        except JSONError:
            pass  # declared JSON that is not: the bytes it is
    elif content_type is not None:
        try:
            return ("text", data.decode("utf-8"))
        except UnicodeDecodeError:
            pass
    return ("bytes", data)


def _declares_json(content_type: Any) -> bool:
    """JSON format 3.1.1: ``*/json`` or ``*/*+json``; no datacontenttype is application/json."""
    if content_type is None:
        return True
    if not isinstance(content_type, str):
        return False
    mime = content_type.partition(";")[0].strip().lower()
    subtype = mime.partition("/")[2]
    return subtype == "json" or subtype.endswith("+json")


def canonical_structured(event: dict[str, Any]) -> dict[str, Any]:
    """A structured event (a batch entry too) in the canonical form of :func:`canonical_event`."""
    attributes = {k: v for k, v in event.items() if k not in _NOT_ATTRIBUTES}
    return canonical_event(attributes, _structured_data(event, attributes.get("datacontenttype")))


def canonical_event(attributes: dict[str, Any], data: tuple[str, Any] | None) -> dict[str, Any]:
    """The event in the one structured form both content modes map to.

    What a fingerprint covers, so that the same event sent in binary and in
    structured mode is one: every attribute (extensions included) as its
    canonical string (a JSON Integer or Boolean is the string a header
    carries, spec 3.1.1), null ones left out (JSON format 3: as omitted);
    a JSON datacontenttype without its parameters, and left out when it is
    the default application/json; the data as a JSON value when the type is
    JSON (``data``, or ``data_base64`` and the body parsed), as text when it
    is text under another type (``data``), else as ``data_base64`` in
    standard base64. Attributes a hop stamps per delivery
    (``TRANSPORT_ATTRIBUTES``) are left out.
    """
    event: dict[str, Any] = {}
    for name, value in attributes.items():
        if value is None or name in TRANSPORT_ATTRIBUTES:
            continue
        if name not in _KEY_ATTRIBUTES:
            if isinstance(value, bool):
                value = "true" if value else "false"
            elif isinstance(value, int):
                value = canonical_number(value)
        event[name] = value
    content_type = event.get("datacontenttype")
    if isinstance(content_type, str):
        if _declares_json(content_type):
            mime = content_type.partition(";")[0].strip().lower()
            if mime == DEFAULT_DATA_TYPE:
                del event["datacontenttype"]
            else:
                event["datacontenttype"] = mime
        else:
            event["datacontenttype"] = content_type.strip()
    if data is not None:
        kind, value = data
        if kind == "bytes":
            event["data_base64"] = base64.b64encode(value).decode("ascii")
        elif kind == "members":
            event.update(value)
        else:
            event["data"] = value
    return event


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
        dedup_key=c.dedup_key(key, "source and id"),
        event_type=c.str_or_none(attributes.get("type")),
        meta=meta,
    )
