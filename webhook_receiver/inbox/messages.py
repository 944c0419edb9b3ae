"""What the inbox takes (a Message) and what it answers (an Outcome)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from types import MappingProxyType
from typing import Any, NamedTuple, cast

import orjson
from sqlalchemy import String

from ..models import Event
from ..tracing import META_KEY as TRACEPARENT_META
from ..tracing import TRACESTATE_META, valid_traceparent, valid_tracestate

_NO_META: Mapping[str, Any] = MappingProxyType({})


def _length(column: str) -> int:
    length = cast(String, Event.__table__.c[column].type).length
    if length is None:
        raise TypeError(f"events.{column} has no declared length to check against")
    return length


# What a message may hold to be stored the same way on PostgreSQL and SQLite.
# The lengths are the events table's columns (PostgreSQL refuses a longer
# value with an error, SQLite stores it); text holds no NUL (PostgreSQL's
# text and jsonb refuse one) and is UTF-8 (no lone surrogate): the text
# fields, the headers' names and values, and the meta's keys and strings at
# any depth (jsonb refuses the whole document). An integer in the meta has
# at most MAX_META_DIGITS digits (Python writes no longer one as JSON).
# Checked by Message.build, for every intake; documented in
# docs/architecture.md.
SOURCE_LENGTH = _length("source")
KEY_LENGTH = _length("dedup_key")
TYPE_LENGTH = _length("event_type")
CONTENT_TYPE_LENGTH = _length("content_type")
CLIENT_LENGTH = _length("client")
CORRELATION_ID_LENGTH = _length("correlation_id")
# PostgreSQL's unique index on (source, dedup_key) holds a row of at most
# 2704 bytes, some 20 of them its own: the two in UTF-8 at most this many
# (only a non-ASCII source or key can pass it within their lengths).
KEY_INDEX_BYTES = 2680
MAX_META_DIGITS = 4300  # sys.int_info.default_max_str_digits
_META_INT_BOUND = 10**MAX_META_DIGITS
_META_INT_FLOOR = -_META_INT_BOUND  # negated once: each negation copies 4,300 digits

_NAMES = {
    "source": "the source name",
    "dedup_key": "the dedup key",
    "event_type": "the event type",
    "content_type": "the content type",
    "client": "the client name",
    "correlation_id": "the correlation id",
    "headers": "the headers",
    "meta": "the metadata",
}


class Unstorable(ValueError):
    """A message that no database can store as it is: refused before anything is written.

    ``field`` names the Message field (``dedup_key``, ``event_type``,
    ``content_type``, ``source``, ``client``, ``correlation_id``,
    ``headers``, ``meta``);
    ``reason`` is ``empty``, ``too-long``, ``nul`` or ``not-utf8``; ``detail``
    says it in a sentence. Each intake maps it to its protocol: a 400 (or
    415 for the content type) over HTTP, a dead letter for a broker.
    """

    def __init__(self, field: str, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.field = field
        self.reason = reason
        self.detail = detail


class Message(NamedTuple):
    """One received message, verified and identified by its intake, ready to store.

    ``dedup_key`` is the stable key of the logical message (never a value
    that changes per attempt); ``fingerprint`` covers its content (canonical
    JSON for webhooks and the API; a broker message's type and bytes as sent,
    compared again by content in ``receive_many``), so the same key with
    other content is told apart as a conflict. ``headers``
    are already redacted. ``received_at`` None: the inbox stamps it.

    A NamedTuple rather than a frozen dataclass: as immutable, and built
    four times faster (a frozen dataclass sets each field through
    ``object.__setattr__``), which a broker batch of thousands a second feels.
    """

    source: str
    dedup_key: str
    fingerprint: str
    body: bytes
    event_type: str | None = None
    content_type: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    meta: Mapping[str, Any] = _NO_META
    correlation_id: str | None = None
    client: str | None = None
    received_at: datetime | None = None

    @classmethod
    def build(
        cls,
        source: str,
        dedup_key: str,
        fingerprint: str,
        body: bytes,
        event_type: str | None = None,
        content_type: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
        meta: Mapping[str, Any] = _NO_META,
        correlation_id: str | None = None,
        client: str | None = None,
        received_at: datetime | None = None,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> Message:
        """Build a message an intake hands to the inbox, or raise Unstorable.

        The one way an intake makes a Message: it checks the limits above
        (a few length and NUL tests; the slow walk only names what failed).
        ``traceparent`` (W3C; one that is not is left out, never refused) is
        kept in the meta, for the delivery attempts to continue its trace;
        ``tracestate`` beside it, only with a valid traceparent (one that is
        malformed or too long is left out whole, never refused).
        """
        # One scan of the text fields together for a NUL and for non-ASCII
        # (only then is it encoded, to find a lone surrogate).
        text = f"{source}{dedup_key}{event_type or ''}{content_type or ''}{client or ''}"
        if correlation_id:
            text += correlation_id
        if headers:
            text += "".join([part for pair in headers for part in pair])
        if (
            not dedup_key
            or len(dedup_key) > KEY_LENGTH
            or len(source) > SOURCE_LENGTH
            or (event_type is not None and len(event_type) > TYPE_LENGTH)
            or (content_type is not None and len(content_type) > CONTENT_TYPE_LENGTH)
            or (client is not None and len(client) > CLIENT_LENGTH)
            or (correlation_id is not None and len(correlation_id) > CORRELATION_ID_LENGTH)
            or "\x00" in text
            or not (text.isascii() or (_is_utf8(text) and _key_fits(source, dedup_key)))
            or (meta and _meta_unstorable(meta))
        ):
            _refuse(
                source, dedup_key, event_type, content_type, client, correlation_id, headers, meta
            )
        if traceparent is not None:
            traceparent = valid_traceparent(traceparent)
            if traceparent is not None:
                # W3C: a tracestate means something only with its traceparent.
                state = valid_tracestate(tracestate) if tracestate else None
                if state is None:
                    meta = {**meta, TRACEPARENT_META: traceparent}
                else:
                    meta = {**meta, TRACEPARENT_META: traceparent, TRACESTATE_META: state}
        return cls(
            source,
            dedup_key,
            fingerprint,
            body,
            event_type,
            content_type,
            headers,
            meta,
            correlation_id,
            client,
            received_at,
        )


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def _key_fits(source: str, dedup_key: str) -> bool:
    """Whether PostgreSQL's unique index takes the key's row (both UTF-8)."""
    return len(source.encode()) + len(dedup_key.encode()) <= KEY_INDEX_BYTES


def _text_reason(text: str) -> str | None:
    """Why ``text`` cannot be stored alike on both databases (``nul``, ``not-utf8``), or None."""
    if "\x00" in text:
        return "nul"
    if not (text.isascii() or _is_utf8(text)):
        return "not-utf8"
    return None


def _meta_unstorable(meta: Mapping[str, Any]) -> bool:
    # A loop, not any() over a generator: it runs per message. What is not
    # plainly storable (a nested value, non-ASCII text or a key) is walked.
    for value in meta.values():
        cls = value.__class__
        if cls is str:
            if "\x00" in value or not value.isascii():
                break
        elif cls is int:
            if not _META_INT_FLOOR < value < _META_INT_BOUND:
                return True
        elif value is not None and cls is not float and cls is not bool:
            break
    else:
        try:
            keys = "".join(meta)
        except TypeError:  # a key that is no text
            keys = "\x00"
        if "\x00" not in keys and keys.isascii():
            return False
    # A nested value (a broker's properties, say): one C call reads it all.
    # orjson refuses a lone surrogate, a key that is no text and an integer
    # past 64 bits, and writes a NUL as \u0000; only then is it walked.
    try:
        if b"\\u0000" not in orjson.dumps(meta):
            return False
    except TypeError:  # orjson.JSONEncodeError
        pass
    return _json_reason(meta) is not None


def _json_reason(value: Any) -> str | None:
    """Why a meta value cannot be stored alike on both databases, at any depth, or None."""
    if isinstance(value, str):
        return _text_reason(value)
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return "too-long" if not _META_INT_FLOOR < value < _META_INT_BOUND else None
    if isinstance(value, Mapping):
        for key, item in value.items():
            reason = (_text_reason(key) if isinstance(key, str) else None) or _json_reason(item)
            if reason is not None:
                return reason
        return None
    if isinstance(value, list | tuple):
        for item in value:
            reason = _json_reason(item)
            if reason is not None:
                return reason
    return None


_DETAILS = {"nul": "{} hold a NUL character", "not-utf8": "{} are not UTF-8 text"}
_META_DETAILS = {
    "nul": "the metadata holds a NUL character",
    "not-utf8": "the metadata is not UTF-8 text",
    "too-long": f"the metadata holds an integer of more than {MAX_META_DIGITS} digits",
}

_LIMITS = {
    "source": SOURCE_LENGTH,
    "dedup_key": KEY_LENGTH,
    "event_type": TYPE_LENGTH,
    "content_type": CONTENT_TYPE_LENGTH,
    "client": CLIENT_LENGTH,
    "correlation_id": CORRELATION_ID_LENGTH,
}


def _refuse(
    source: str,
    dedup_key: str,
    event_type: str | None,
    content_type: str | None,
    client: str | None,
    correlation_id: str | None,
    headers: tuple[tuple[str, str], ...],
    meta: Mapping[str, Any],
) -> None:
    """Raise the Unstorable that names the first field over a limit."""
    if not dedup_key:
        raise Unstorable("dedup_key", "empty", "the dedup key is empty")
    fields = {
        "source": source,
        "dedup_key": dedup_key,
        "event_type": event_type,
        "content_type": content_type,
        "client": client,
        "correlation_id": correlation_id,
    }
    for field, value in fields.items():
        if value is None:
            continue
        name, limit = _NAMES[field], _LIMITS[field]
        if len(value) > limit:
            raise Unstorable(field, "too-long", f"{name} is longer than {limit} characters")
        if "\x00" in value:
            raise Unstorable(field, "nul", f"{name} holds a NUL character")
        if not _is_utf8(value):
            # Only a lone surrogate makes a str no UTF-8: JSON's \uD800-\uDFFF escape.
            raise Unstorable(
                field,
                "not-utf8",
                f"{name} holds a lone surrogate (\\uD800-\\uDFFF), not UTF-8 text",
            )
    if not _key_fits(source, dedup_key):
        raise Unstorable(
            "dedup_key",
            "too-long",
            f"the source name and the dedup key are longer than {KEY_INDEX_BYTES} bytes in UTF-8",
        )
    for pair in headers:
        for value in pair:
            reason = _text_reason(value)
            if reason is not None:
                raise Unstorable("headers", reason, _DETAILS[reason].format(_NAMES["headers"]))
    reason = _json_reason(dict(meta))
    if reason is not None:
        raise Unstorable("meta", reason, _META_DETAILS[reason])
    raise AssertionError("Message.build refused a storable message")  # pragma: no cover


@dataclass(frozen=True)
class Accepted:
    """The message was new: stored as ``event_id``, with its deliveries."""

    event_id: int


@dataclass(frozen=True)
class Duplicate:
    """The same message was stored before as ``event_id``; nothing new was written."""

    event_id: int


@dataclass(frozen=True)
class Conflict:
    """Other content was stored under this key as ``event_id``; this one is kept for review."""

    event_id: int


Outcome = Accepted | Duplicate | Conflict


class BatchRefused(Exception):
    """An all-or-nothing batch held a conflict: none of it was stored.

    ``conflicts`` are those with events stored before the batch, kept for
    review; a key used twice inside the batch with other content has none.
    """

    def __init__(self, conflicts: list[Conflict]) -> None:
        super().__init__(f"{len(conflicts)} message(s) conflict with stored events")
        self.conflicts = conflicts
