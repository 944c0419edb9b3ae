"""API views: create an event under an Idempotency-Key, read it back."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

from flask import Blueprint, Response, abort, g, jsonify, request, url_for
from sqlalchemy import select

from .. import correlation, events, inbox, tracing
from ..extensions import db
from ..fingerprint import JSONError, canonical_json, fingerprint, is_json_type, loads
from ..idempotency import Refused, idempotent
from ..idempotency.decorator import JSON_BODY
from ..idempotency.keys import parse_key
from ..inbox.messages import TYPE_LENGTH, Unstorable
from ..models import Event
from ..observability import metrics
from ..problems import PROBLEM_JSON, PROBLEM_TYPES
from .auth import require_client
from .event_records import EventRecords

bp = Blueprint("api", __name__, url_prefix="/api")

_TYPE_RULE = f'"type" must be a non-empty string of at most {TYPE_LENGTH} characters, without NUL'


@bp.after_request
def _count_refusal(response: Response) -> Response:
    # Read from the answer, not where it was raised: a refusal the
    # Idempotency-Key engine turns into another answer (a body refused
    # under a taken key is a 422) is counted once, as answered. A replay
    # is counted as one, never again as a refusal.
    if (
        400 <= response.status_code < 500
        and response.mimetype == PROBLEM_JSON
        and "Idempotent-Replayed" not in response.headers
    ):
        slug = str(json.loads(response.get_data()).get("type", "")).removeprefix("/problems/")
        if slug in PROBLEM_TYPES:  # a bounded label
            metrics.api_refusal(g.get("client"), slug)
    return response


def parse_json_body(body: bytes) -> Any:
    """Parse a request's JSON body or raise the 400 problem (a refusal: it binds no key)."""
    try:
        return loads(body)
    except JSONError as exc:
        raise Refused("invalid-json", str(exc)) from exc


def _parsed(body: bytes) -> tuple[Any, bytes]:
    payload = parse_json_body(body)
    return payload, canonical_json(payload)


@bp.post("/events")
@require_client
# Its only effect is the event, rolled back with the transaction: a retry
# may run it again (speculative), and a new key is then spared its read.
# The event and the key's record are written together (EventRecords).
@idempotent(speculative=True, persistence=EventRecords())
def create_event() -> tuple[Response, int, dict[str, str]]:
    """Store an event posted by an API client."""
    # Every refusal below comes before any work: it binds no Idempotency-Key,
    # and the client may send the corrected request under the same key.
    body = request.get_data(cache=True)
    if not is_json_type(request.content_type):
        raise Refused("unsupported-media-type", "send the event as Content-Type: application/json")
    # Parsed and made canonical once, by @idempotent's fingerprint.
    parsed = request.environ.get(JSON_BODY)
    payload, canonical = parsed if parsed is not None else _parsed(body)
    if not isinstance(payload, dict):
        raise Refused("invalid-event", 'the body must be a JSON object {"type": ..., "data": ...}')
    event_type = payload.get("type")
    if not isinstance(event_type, str) or not event_type:
        raise Refused("invalid-event", _TYPE_RULE)
    if "data" not in payload:
        raise Refused("invalid-event", '"data" is required (any JSON value)')
    source = f"api:{g.client}"
    now = datetime.now(UTC)
    traceparent, tracestate = tracing.current_trace(request.headers)
    try:
        message = inbox.Message.build(
            source=source,
            # Retries are deduplicated by the Idempotency-Key record; the
            # event's own key only has to be unique and stable.
            dedup_key=uuid.uuid4().hex,
            fingerprint=fingerprint([canonical]),
            body=body,
            event_type=event_type,
            content_type=request.content_type,
            headers=events.redact_headers(request.headers.items()),
            # The key as parsed (a quoted sf-string unquoted): the one its
            # record is under, which the admin searches for.
            meta={"idempotency_key": parse_key(request.headers)},
            correlation_id=correlation.current(),
            client=g.client,
            received_at=now,
            traceparent=traceparent,
            tracestate=tracestate,
        )
    except Unstorable as exc:
        # A type or Content-Type no database can store as it is (too long,
        # a NUL): refused before any work, so it binds no key either.
        if exc.field == "content_type":
            raise Refused("unsupported-media-type", f"the Content-Type header: {exc}") from exc
        if exc.field == "event_type":
            raise Refused("invalid-event", f"{_TYPE_RULE}: {exc}") from exc
        raise Refused("invalid-event", str(exc)) from exc
    event_id = inbox.add(message)
    if event_id is None:  # a fresh uuid cannot be taken
        raise RuntimeError("a fresh event key was already taken")
    document = {
        "id": event_id,
        "type": event_type,
        "source": source,
        "data": payload["data"],
        "received_at": events.iso(now),
        "duplicate_count": 0,
    }
    return jsonify(document), 201, {"Location": url_for("api.get_event", event_id=event_id)}


@bp.get("/events/<int:event_id>")
@require_client
def get_event(event_id: int) -> Response:
    """Return one event to the client that created it."""
    # Ids are signed 64-bit: a larger one names no event, and the drivers
    # would refuse to bind it (a 500).
    if event_id >= 2**63:
        abort(404, "no such event for this client")
    # Another client's event is answered exactly like a missing one: the
    # query itself is scoped, so its row (its body) is never read for them,
    # and an id that exists answers no slower than one that does not.
    event = db.session.scalar(select(Event).where(Event.id == event_id, Event.client == g.client))
    if event is None:
        abort(404, "no such event for this client")
    data = parse_json_body(event.body).get("data")
    return jsonify(events.to_json(event, data))
