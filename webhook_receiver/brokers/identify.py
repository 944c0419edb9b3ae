"""Turning one broker message into an inbox Message: its stable key, type and fingerprint.

The key and type come from what the producer set on the message (an AMQP
property or header, a NATS header or subject, a JSON pointer into the
body), never from what the broker sets per delivery (delivery tag,
redelivered flag, delivery count, stream sequence, timestamps), so a
redelivery is recognised as the same message.

The fingerprint covers the type and the bytes as sent: a redelivery's bytes
are the same, and nothing need be parsed for it (a body is parsed only
when a ``json:`` spec reads it). Bytes that differ under a taken key are
compared again by :func:`content_fingerprint` (canonical JSON, as for
webhooks) before they are called a conflict: see ``inbox.receive_many``.
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple, cast

import orjson

from .. import events, pointers, tracing
from ..config import BrokerSourceConfig, parse_broker_spec
from ..fingerprint import (
    JSONError,
    canonical_json,
    canonical_number,
    fingerprint,
    is_json_type,
    loads,
)
from ..inbox import ContentFingerprint, Message
from ..inbox.messages import CORRELATION_ID_LENGTH, Unstorable
from ..observability.logging import loggable

# Reasons a message is dead-lettered without being stored.
MISSING_KEY = "dedup-key-missing"
PAYLOAD_INVALID = "payload-invalid"
# Its broker's framing holds what no text field can carry exactly: a name,
# subject, routing key or id that is not UTF-8, a NUL, tables nested too deep,
# or properties the client library could not decode at all.
MALFORMED = "message-malformed"
# Anything else that failed while one message was identified or stored: a
# bug, logged with its traceback, that must not stop the consumer.
CONSUMER_ERROR = "consumer-error"
# How deep an AMQP table may nest; deeper tables are malformed (their text
# would be refused by the JSON the event is stored as).
MAX_TABLE_DEPTH = 64
# How a binary value (not UTF-8 text) is kept among the stored headers: exactly.
BINARY_PREFIX = "base64:"


class Unidentified(Exception):
    """The message cannot be stored: no usable key, or a body its specs cannot read."""

    def __init__(
        self,
        reason: str,
        detail: str,
        dedup_key: str | None = None,
        correlation_id: str | None = None,
    ) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        # What the dead letter's log line names, when read and fit for a line.
        self.dedup_key = dedup_key
        self.correlation_id = correlation_id


_NONE: Mapping[str, Any] = MappingProxyType({})


class BrokerMessage(NamedTuple):
    """One message as its broker handed it over, before identification.

    A NamedTuple, as the inbox's Message: immutable and cheap to build.
    """

    body: bytes
    content_type: str | None = None
    # The AMQP headers table or the NATS headers: values as text, or bytes
    # where they are not UTF-8 (kept exactly, never read as a key or type).
    headers: Mapping[str, str | bytes] = _NONE
    # The AMQP basic properties the producer set (none for NATS), the same way.
    properties: Mapping[str, str | bytes] = _NONE
    subject: str | None = None
    # Where it came from: exchange and routing key, or subject and stream.
    meta: Mapping[str, Any] = _NONE


def identify(source: BrokerSourceConfig, message: BrokerMessage) -> Message:
    """Build the inbox Message of ``message``, or raise Unidentified."""
    key_spec, type_spec, needs_json = _specs(source.dedup_key, source.event_type, source.provider)
    parsed: Any = None
    if needs_json:
        try:
            # A lone surrogate's escape is JSON: the body is stored as it came,
            # and only a key or type holding one is refused (Message.build).
            parsed = loads(message.body, lone_surrogates=True)
        except JSONError as exc:
            raise Unidentified(
                PAYLOAD_INVALID, str(exc), correlation_id=loggable(_correlation_id(message))
            ) from exc
    names = _Names.of(message.headers)
    key = _read(key_spec, message, names, parsed)
    if not key:
        raise Unidentified(
            MISSING_KEY,
            f"no dedup key at {source.dedup_key}",
            correlation_id=loggable(_correlation_id(message, names)),
        )
    event_type = _read(type_spec, message, names, parsed) or None
    traceparent = tracing.traceparent_in(message.headers)
    try:
        return Message.build(
            source=source.name,
            dedup_key=key,
            # Only what the producer sent decides it; delivery counters must not.
            fingerprint=fingerprint([event_type or "", message.body]),
            body=message.body,
            event_type=event_type,
            content_type=message.content_type or None,
            headers=_headers(message.headers, names),
            meta=_clean_meta(message),
            correlation_id=_correlation_id(message, names),
            traceparent=traceparent,
            # Read only beside a valid traceparent: W3C's tracestate needs one.
            tracestate=tracing.tracestate_in(message.headers) if traceparent else None,
        )
    except Unstorable as exc:
        # PostgreSQL refuses a NUL in text and a value longer than its column,
        # and that error would fail the whole batch on every redelivery: such
        # a message is dead-lettered instead, the same way on both databases.
        spec = {"dedup_key": source.dedup_key, "event_type": source.event_type}.get(exc.field)
        detail = f"{exc} (read from {spec})" if spec else str(exc)
        raise Unidentified(
            PAYLOAD_INVALID,
            detail,
            loggable(key),
            loggable(_correlation_id(message, names)),
        ) from exc


def content_fingerprint(source: BrokerSourceConfig) -> ContentFingerprint:
    """The fingerprint by which a source's messages are compared when their bytes differ.

    The type and the content: canonical JSON for a body labelled JSON (or
    read by a ``json:`` spec), so that JSON serialised again (key order,
    whitespace) is the same content; other bodies as their bytes. It is
    what this module fingerprinted before fingerprints covered the bytes,
    so events stored then compare the same way.
    """
    needs_json = _specs(source.dedup_key, source.event_type, source.provider)[2]
    return functools.partial(_content_fingerprint, needs_json)


def _content_fingerprint(
    needs_json: bool, body: bytes, event_type: str | None, content_type: str | None
) -> str:
    content = body
    if needs_json or is_json_type(content_type):
        try:
            content = canonical_json(loads(body, lone_surrogates=True))
        except JSONError:
            pass  # labelled JSON that is not: compared as the bytes it is
    return fingerprint([event_type or "", content])


_Spec = tuple[str, str]


@functools.cache
def _specs(dedup_key: str, event_type: str, provider: str) -> tuple[_Spec, _Spec, bool]:
    """A source's key and type specs, and whether they read the body as JSON.

    Validated with the config; parsed once per source rather than per message.
    """
    key_spec = parse_broker_spec(dedup_key, provider, "dedup_key")
    type_spec = parse_broker_spec(event_type, provider, "event_type")
    return key_spec, type_spec, "json" in (key_spec[0], type_spec[0])


class _Names(NamedTuple):
    """What a message's header names say, worked out once per set of names (they repeat).

    A producer sends the same names message after message: which of them
    name a secret, whether one holds a NUL, and each by its lower case
    (header names are matched without regard to case) are kept per tuple of
    names, not looked for again in every message.
    """

    # The header names, in the message's order.
    names: tuple[str, ...]
    # Each name by its lower case (the first of a name repeated in other cases).
    by_lower: Mapping[str, str]
    # The positions of the names whose values are redacted (events.is_secret_header).
    secret: tuple[int, ...]
    # Whether a name holds a NUL: PostgreSQL's jsonb holds none, and a name
    # is an identifier: the message is malformed rather than repaired.
    has_nul: bool

    @staticmethod
    def of(headers: Mapping[str, str | bytes]) -> _Names:
        return _names(tuple(headers)) if headers else _NO_NAMES


@functools.lru_cache(maxsize=1024)  # per source, a few sets of names; bounded for the rest
def _names(names: tuple[str, ...]) -> _Names:
    by_lower: dict[str, str] = {}
    for name in names:
        by_lower.setdefault(name.lower(), name)
    secret = tuple(i for i, name in enumerate(names) if events.is_secret_header(name))
    return _Names(names, by_lower, secret, any("\x00" in name for name in names))


_NO_NAMES = _Names((), {}, (), False)


def _read(spec: _Spec, message: BrokerMessage, names: _Names, parsed: Any) -> str | None:
    kind, arg = spec
    value: Any
    if kind == "subject":
        value = message.subject
    elif kind == "property":
        value = message.properties.get(arg)
    elif kind == "header":
        value = _header(message.headers, names, arg)
    else:
        value = pointers.resolve(parsed, arg)
    if value is None or isinstance(value, dict | list):
        return None
    if isinstance(value, bytes):
        # Decoded with replacement characters, two different ids would be one key.
        raise Unidentified(MALFORMED, f"{kind}:{arg} is not UTF-8 text")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float | int):
        # As canonical JSON writes it (RFC 8785): 1, 1.0 and 1e0 are the key "1".
        return canonical_number(value)
    return str(value)


def header(headers: Mapping[str, str | bytes], name: str) -> str | bytes | None:
    """The header ``name``'s value: under that name exactly, else under it in another case."""
    return _header(headers, _Names.of(headers), name)


def _header(headers: Mapping[str, str | bytes], names: _Names, name: str) -> str | bytes | None:
    if name in headers:
        return headers[name]
    stored = names.by_lower.get(name.lower())
    return None if stored is None else headers[stored]


def _correlation_id(message: BrokerMessage, names: _Names | None = None) -> str | None:
    names = names or _Names.of(message.headers)
    value = (
        message.properties.get("correlation_id")
        or _header(message.headers, names, "X-Request-Id")
        or _header(message.headers, names, "Correlation-Id")
    )
    if not value or isinstance(value, bytes) or "\x00" in value:
        return None
    return value[:CORRELATION_ID_LENGTH]


def _headers(headers: Mapping[str, str | bytes], names: _Names) -> tuple[tuple[str, str], ...]:
    if not headers:
        return ()
    if names.has_nul:
        raise Unidentified(MALFORMED, "a header name holds a NUL character")
    values = cast(list[str], list(headers.values()))
    try:
        # One C call for the usual case: every value text, none with a NUL
        # (join refuses bytes).
        clean = "\x00" not in "".join(values)
    except TypeError:
        clean = False
    if not clean:
        values = [_clean(value) for value in headers.values()]
    for position in names.secret:
        values[position] = events.REDACTED
    return tuple(zip(names.names, values, strict=True))


def _clean(value: str | bytes) -> str:
    if isinstance(value, bytes):
        return binary_text(value)
    # Stored as JSON: PostgreSQL's jsonb holds no NUL character.
    return value.replace("\x00", "\ufffd")


def binary_text(value: bytes) -> str:
    """A value that is not UTF-8 text, kept exactly as stored text (see docs/brokers.md)."""
    return BINARY_PREFIX + base64.b64encode(value).decode("ascii")


def _clean_meta(message: BrokerMessage) -> dict[str, Any]:
    meta = dict(message.meta)
    if message.properties:
        meta["properties"] = {
            name: binary_text(value) if isinstance(value, bytes) else value
            for name, value in message.properties.items()
        }
    # Looked for in orjson's text, at C speed (a NUL is always escaped
    # there); the walk replaces them only where one may be. What orjson
    # refuses is walked too.
    try:
        if b"\\u0000" not in orjson.dumps(meta):
            return meta
    except TypeError:
        pass
    return cast(dict[str, Any], _without_nul(meta))


def _without_nul(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {_without_nul(key): _without_nul(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_without_nul(item) for item in value]
    return value


def exact_text(value: str | bytes, what: str) -> str:
    """An identifier the broker handed over as bytes, decoded exactly, or Unidentified.

    Never decoded with replacement characters: two different names or ids
    would become one. A NUL is refused too (PostgreSQL's text holds none).
    """
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise Unidentified(MALFORMED, f"{what} is not UTF-8 text") from exc
    if "\x00" in value:
        raise Unidentified(MALFORMED, f"{what} holds a NUL character")
    return value
