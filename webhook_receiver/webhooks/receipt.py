"""Receiving one provider delivery: verify, identify, fingerprint, then hand it to the inbox.

The provider decides whether the delivery is authentic and which stable key
and type it carries; the fingerprint covers its content (canonical JSON when
it is JSON), never the per-attempt signature or timestamp headers. The inbox
stores it once (see webhook_receiver/inbox) and says what became of it: the
answer follows from that, after the commit.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Any

from werkzeug.datastructures import Headers

from .. import correlation, events, inbox, rejections, tracing
from ..fingerprint import JSONError, canonical_json, fingerprint, is_json_type, loads
from ..inbox.messages import Unstorable
from ..observability import metrics
from ..problems import Problem
from .providers import (
    Identified,
    Inbound,
    MissingKeyError,
    Part,
    PayloadError,
    SignatureError,
    SourceConfig,
    TimestampError,
    decoded,
    get_provider,
    needs_json,
    parts,
    redacted_headers,
)

log = logging.getLogger(__name__)

_BATCH_TYPE = re.compile(re.escape("cloudevents-batch+json"), re.IGNORECASE)


@dataclass(frozen=True)
class Receipt:
    """What became of a delivery: accepted, duplicate, or answered without storing."""

    outcome: str  # accepted | duplicate | conflict | immediate
    body: dict[str, Any]
    event_id: int | None = None


def accepted_body(event_id: int) -> dict[str, Any]:
    """The response a stored event is answered with, first time and every time after."""
    return {"status": "accepted", "event_id": event_id}


def receive(
    source: SourceConfig, body: bytes, headers: Headers, remote_addr: str | None
) -> Receipt:
    """Verify and store one delivery to ``source``; raise a Problem to refuse it."""
    provider = get_provider(source.provider)
    content_type = headers.get("Content-Type", "")
    json_required = needs_json(source)
    parsed, json_error = _parse(body, content_type, json_required)
    inbound = Inbound(
        body=body, headers=headers, content_type=content_type, json=parsed, now=time.time()
    )
    try:
        provider.verify(inbound, source)
    except PayloadError as exc:  # malformed before any signature is checked
        raise Problem("payload-invalid", str(exc)) from exc
    except SignatureError as exc:
        reason = "timestamp" if isinstance(exc, TimestampError) else "signature"
        _reject(source, reason, str(exc), remote_addr)
        raise Problem(
            "timestamp-out-of-tolerance" if reason == "timestamp" else "signature-invalid",
            str(exc),
        ) from exc
    try:
        verified = decoded(inbound, source)
    except PayloadError as exc:
        raise Problem("payload-invalid", str(exc)) from exc
    if verified is not inbound:  # the payload was read from a form (GitHub)
        inbound, parsed, json_error = verified, verified.json, None
    if json_required and not content_type:
        # Providers always label their JSON; unlabelled content is not theirs to guess.
        raise Problem("unsupported-media-type", "send Content-Type: application/json")
    if json_error is not None and json_required:
        raise Problem("payload-invalid", f"{provider.name} deliveries are JSON: {json_error}")
    try:
        batch = parts(inbound, source)
    except MissingKeyError as exc:
        raise Problem("dedup-key-missing", str(exc)) from exc
    except PayloadError as exc:
        raise Problem("payload-invalid", str(exc)) from exc
    if batch is not None:
        return _store_batch(source, batch, content_type, headers)
    try:
        identified = provider.identify(inbound, source)
    except MissingKeyError as exc:
        raise Problem("dedup-key-missing", str(exc)) from exc
    except PayloadError as exc:
        raise Problem("payload-invalid", str(exc)) from exc
    if identified.immediate_response is not None:
        return Receipt("immediate", identified.immediate_response)

    is_json = parsed is not None
    content = canonical_json(parsed) if is_json else body
    # The content decides the fingerprint; signatures, timestamps and retry
    # counters change per attempt and must not.
    print_ = fingerprint([identified.event_type or "", content])
    return _store(source, identified, print_, body, content_type, headers)


def _store_batch(
    source: SourceConfig, batch: list[Part], content_type: str, headers: Headers
) -> Receipt:
    """Store each event of a verified batch as its own, all in one transaction, or none."""
    redacted = _redacted(source, headers)
    # Each event is stored as a structured delivery of it would be: its own
    # JSON, so the fingerprint matches that delivery's.
    # (A media type's case is not significant: the batch was read as one in any case.)
    entry_type = _BATCH_TYPE.sub("cloudevents+json", content_type, count=1)
    traceparent = tracing.current_traceparent(headers.get("traceparent"))
    messages = []
    for part in batch:
        content = canonical_json(part.json)
        try:
            message = inbox.Message.build(
                source=source.name,
                dedup_key=part.identified.dedup_key,
                fingerprint=fingerprint([part.identified.event_type or "", content]),
                body=content,
                event_type=part.identified.event_type,
                content_type=entry_type or None,
                headers=redacted,
                meta=part.identified.meta,
                correlation_id=correlation.current(),
                traceparent=traceparent,
            )
        except Unstorable as exc:
            raise _refusal(exc) from exc
        messages.append(message)
    by_key: dict[str, str] = {}
    for message in messages:
        if by_key.setdefault(message.dedup_key, message.fingerprint) != message.fingerprint:
            raise Problem(
                "payload-invalid",
                f"the batch holds two different events with the key {message.dedup_key}",
            )
    try:
        with tracing.span("inbox receive_many", source=source.name, messages=len(messages)):
            outcomes = inbox.receive_many(messages, all_or_nothing=True)
    except inbox.BatchRefused as refused:
        for _ in refused.conflicts:
            metrics.conflict(source.name)
        raise Problem(
            "dedup-key-conflict",
            "an event of this batch has the key of an event already received with different "
            "content; nothing of the batch was stored, the conflicting event is kept for review",
            event_id=refused.conflicts[0].event_id if refused.conflicts else None,
        ) from refused
    entries = []
    for outcome in outcomes:
        new = isinstance(outcome, inbox.Accepted)
        (metrics.received if new else metrics.duplicate)(source.name)
        entries.append({"event_id": outcome.event_id, "status": "accepted" if new else "duplicate"})
    replayed = all(entry["status"] == "duplicate" for entry in entries)
    return Receipt(
        "duplicate" if replayed else "accepted", {"status": "accepted", "events": entries}
    )


def _redacted(source: SourceConfig, headers: Headers) -> tuple[tuple[str, str], ...]:
    return events.redact_headers(headers.items(), redacted_headers(source))


def _refusal(exc: Unstorable) -> Problem:
    """The answer to a delivery Message.build refused: 400, or 415 for its Content-Type."""
    # PostgreSQL refuses a NUL in text and a value longer than its column
    # with an error (a 500, retried for days), where SQLite stores both:
    # Message.build refuses them up front, the same way on both.
    if exc.field == "content_type":
        return Problem("unsupported-media-type", f"the Content-Type header: {exc}")
    return Problem("payload-invalid", str(exc))


def _parse(body: bytes, content_type: str, required: bool) -> tuple[Any, str | None]:
    if not (required or is_json_type(content_type)):
        return None, None
    try:
        return loads(body), None
    except JSONError as exc:
        return None, str(exc)


def _store(
    source: SourceConfig,
    identified: Identified,
    print_: str,
    body: bytes,
    content_type: str,
    headers: Headers,
) -> Receipt:
    try:
        message = inbox.Message.build(
            source=source.name,
            dedup_key=identified.dedup_key,
            fingerprint=print_,
            body=body,
            event_type=identified.event_type,
            content_type=content_type or None,
            headers=_redacted(source, headers),
            meta=identified.meta,
            correlation_id=correlation.current(),
            traceparent=tracing.current_traceparent(headers.get("traceparent")),
        )
    except Unstorable as exc:
        raise _refusal(exc) from exc
    with tracing.span("inbox receive", source=source.name, dedup_key=message.dedup_key):
        outcome = inbox.receive(message)
    if isinstance(outcome, inbox.Accepted):
        metrics.received(source.name)
        return Receipt("accepted", accepted_body(outcome.event_id), outcome.event_id)
    if isinstance(outcome, inbox.Duplicate):
        metrics.duplicate(source.name)
        return Receipt("duplicate", accepted_body(outcome.event_id), outcome.event_id)
    metrics.conflict(source.name)
    raise Problem(
        "dedup-key-conflict",
        "an event with this key and different content was already received; "
        "this delivery is kept for review",
        event_id=outcome.event_id,
    )


def _reject(source: SourceConfig, reason: str, detail: str, remote_addr: str | None) -> None:
    log.warning(
        "delivery refused",
        extra={
            "outcome": f"rejected_{reason}",
            "source": source.name,
            "reason": detail,
            "correlation_id": correlation.current(),
        },
    )
    metrics.signature_failure(source.name, reason)
    rejections.record(source.name, reason, detail, remote_addr)
