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
from dataclasses import dataclass, replace
from typing import Any

from werkzeug.datastructures import Headers

from .. import correlation, events, inbox, rejections, tracing
from ..fingerprint import JSONError, canonical_json, fingerprint, is_json_type, loads
from ..inbox.messages import Unstorable
from ..observability import metrics
from ..observability.logging import loggable
from ..problems import Problem
from .providers import (
    Identified,
    Inbound,
    MissingKeyError,
    Part,
    PayloadError,
    Provider,
    SignatureError,
    SourceConfig,
    TimestampError,
    decoded,
    fingerprinted,
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


# What an authentic delivery may be refused for: logged, counted and listed in Rejections.
_REFUSED_AUTHENTIC = frozenset({"payload-invalid", "dedup-key-missing", "unsupported-media-type"})
# A delivery refused before its signature could be checked: a signature failure's reason.
UNREADABLE = "unreadable"


class _Refusal(Problem):
    """A delivery refused once its key was read: the key is for the log line, not the answer."""

    def __init__(self, slug: str, detail: str, dedup_key: str) -> None:
        super().__init__(slug, detail)
        self.dedup_key = loggable(dedup_key)


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
    # The body is parsed only once its signature is checked: a forged body
    # just under the limit could take a second to parse, the HMAC a millisecond.
    inbound = Inbound(
        body=body, headers=headers, content_type=content_type, json=None, now=time.time()
    )
    try:
        provider.verify(inbound, source)
    except PayloadError as exc:  # malformed before any signature is checked
        # Its sender is unknown: counted and listed beside the forgeries (one
        # row a minute per address), never as a signed delivery's refusal.
        _reject(source, UNREADABLE, str(exc), remote_addr)
        raise Problem("payload-invalid", str(exc)) from exc
    except SignatureError as exc:
        reason = "timestamp" if isinstance(exc, TimestampError) else "signature"
        _reject(source, reason, str(exc), remote_addr)
        raise Problem(
            "timestamp-out-of-tolerance" if reason == "timestamp" else "signature-invalid",
            str(exc),
        ) from exc
    parsed, json_error = _parse(body, content_type, json_required)
    inbound = replace(inbound, json=parsed)
    try:
        return _receive_verified(
            source,
            provider,
            inbound,
            parsed,
            json_error,
            json_required,
            content_type,
            headers,
            body,
        )
    except Problem as problem:
        if problem.slug in _REFUSED_AUTHENTIC:
            _refused(source, problem, remote_addr)
        raise


def _receive_verified(
    source: SourceConfig,
    provider: Provider,
    inbound: Inbound,
    parsed: Any,
    json_error: str | None,
    json_required: bool,
    content_type: str,
    headers: Headers,
    body: bytes,
) -> Receipt:
    """Identify and store a delivery whose signature passed; raise a Problem to refuse it."""
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
    content = canonical_json(fingerprinted(parsed, source)) if is_json else body
    # The content decides the fingerprint; signatures, timestamps and retry
    # counters change per attempt and must not.
    print_ = fingerprint([identified.event_type or "", content])
    return _store(source, identified, print_, body, content_type, headers)


def _store_batch(
    source: SourceConfig, batch: list[Part], content_type: str, headers: Headers
) -> Receipt:
    """Store each event of a verified batch as its own, all in one transaction, or none."""
    if not batch:
        # A valid batch with nothing to store: new, never a replay of anything.
        return Receipt("accepted", {"status": "accepted", "events": []})
    redacted = _redacted(source, headers)
    # Each event is stored as its own JSON, and fingerprinted as a
    # structured or binary delivery of it would be (the canonical form), so
    # the same event sent alone and in a batch is one.
    # (A media type's case is not significant: the batch was read as one in any case.)
    entry_type = _BATCH_TYPE.sub("cloudevents+json", content_type, count=1)
    traceparent, tracestate = tracing.current_trace(headers)
    messages = []
    for part in batch:
        content = canonical_json(part.json)
        covered = canonical_json(fingerprinted(part.canonical, source))
        try:
            message = inbox.Message.build(
                source=source.name,
                dedup_key=part.identified.dedup_key,
                fingerprint=fingerprint([part.identified.event_type or "", covered]),
                body=content,
                event_type=part.identified.event_type,
                content_type=entry_type or None,
                headers=redacted,
                meta=part.identified.meta,
                correlation_id=correlation.current(),
                traceparent=traceparent,
                tracestate=tracestate,
            )
        except Unstorable as exc:
            raise _refusal(exc, part.identified.dedup_key) from exc
        messages.append(message)
    by_key: dict[str, str] = {}
    for message in messages:
        if by_key.setdefault(message.dedup_key, message.fingerprint) != message.fingerprint:
            raise _Refusal(
                "payload-invalid",
                f"the batch holds two different events with the key {message.dedup_key}",
                message.dedup_key,
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


def _refusal(exc: Unstorable, dedup_key: str) -> Problem:
    """The answer to a delivery Message.build refused: 400, or 415 for its Content-Type."""
    # PostgreSQL refuses a NUL in text and a value longer than its column
    # with an error (a 500, retried for days), where SQLite stores both:
    # Message.build refuses them up front, the same way on both.
    if exc.field == "content_type":
        return _Refusal("unsupported-media-type", f"the Content-Type header: {exc}", dedup_key)
    return _Refusal("payload-invalid", str(exc), dedup_key)


def _parse(body: bytes, content_type: str, required: bool) -> tuple[Any, str | None]:
    if not (required or is_json_type(content_type)):
        return None, None
    try:
        # A lone surrogate's escape ("\ud800", RFC 8259 8.2) is JSON: the body
        # is stored as sent (the escape is ASCII) and canonical_json writes it
        # back; only a key or type holding one is refused, naming it.
        return loads(body, lone_surrogates=True), None
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
    traceparent, tracestate = tracing.current_trace(headers)
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
            traceparent=traceparent,
            tracestate=tracestate,
        )
    except Unstorable as exc:
        raise _refusal(exc, identified.dedup_key) from exc
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


def _refused(source: SourceConfig, problem: Problem, remote_addr: str | None) -> None:
    """Log, count and list an authentic delivery refused for what it holds."""
    # The sender is who it says: it will retry the same delivery, refused
    # each time; an operator must see it (a log line, a counter, a row).
    detail = problem.detail or problem.title
    # The key, when it was read: the provider's delivery is found by it.
    key = problem.dedup_key if isinstance(problem, _Refusal) else None
    log.warning(
        "delivery refused",
        extra={
            "outcome": f"refused_{problem.slug}",
            "source": source.name,
            "reason": detail,
            "correlation_id": correlation.current(),
            **({"dedup_key": key} if key is not None else {}),
        },
    )
    metrics.webhook_refusal(source.name, problem.slug)
    # Its own reason, not the slug: a broker message dead-lettered for the
    # same problem is listed as "dedup-key-missing" or "payload-invalid".
    rejections.record(source.name, f"refused-{problem.slug}", detail, remote_addr)


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
