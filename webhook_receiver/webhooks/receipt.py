"""Receiving one provider delivery: verify, identify, then store once.

The event row is the dedup marker: its unique (source, dedup key)
constraint decides between racing copies. One upsert stores a new event or,
for the same key with the same fingerprint, increments its duplicate count
in the database (no read-modify-write); other content under the key is a
conflict, kept for review. On PostgreSQL the upsert, the redelivery's time
and the new event's deliveries are one statement in its own transaction:
one round trip, committed before the answer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import String, bindparam, insert, literal_column, select
from sqlalchemy import true as literal_true
from werkzeug.datastructures import Headers

from .. import correlation, events
from ..database import dialect_insert, end_read, is_sqlite
from ..extensions import db
from ..fingerprint import JSONError, canonical_json, fingerprint, is_json_type, loads
from ..models import Event, EventConflict, EventDuplicate, Rejection, UTCDateTime, utcnow
from ..observability import metrics
from ..problems import Problem
from ..processing import deliveries, outbox
from .providers import (
    Identified,
    Inbound,
    MissingKeyError,
    PayloadError,
    SignatureError,
    SourceConfig,
    TimestampError,
    get_provider,
    needs_json,
    redacted_headers,
)

log = logging.getLogger(__name__)

_events = Event.__table__
_duplicates = EventDuplicate.__table__
_conflicts = EventConflict.__table__


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
    except SignatureError as exc:
        reason = "timestamp" if isinstance(exc, TimestampError) else "signature"
        _reject(source, reason, str(exc), remote_addr)
        raise Problem(
            "timestamp-out-of-tolerance" if reason == "timestamp" else "signature-invalid",
            str(exc),
        ) from exc
    if json_required and not content_type:
        # Providers always label their JSON; unlabelled content is not theirs to guess.
        raise Problem("unsupported-media-type", "send Content-Type: application/json")
    if json_error is not None and json_required:
        raise Problem("payload-invalid", f"{provider.name} deliveries are JSON: {json_error}")
    try:
        identified = provider.identify(inbound, source)
    except MissingKeyError as exc:
        raise Problem("dedup-key-missing", str(exc)) from exc
    except PayloadError as exc:
        raise Problem("payload-invalid", str(exc)) from exc
    if identified.immediate_response is not None:
        return Receipt("immediate", identified.immediate_response)
    _check_storable(identified, content_type)

    is_json = parsed is not None
    content = canonical_json(parsed) if is_json else body
    # The content decides the fingerprint; signatures, timestamps and retry
    # counters change per attempt and must not.
    print_ = fingerprint([identified.event_type or "", content])
    return _store(source, identified, print_, body, content_type, headers)


def _column_length(name: str) -> int:
    """The declared length of one of the events table's String columns."""
    length = cast(String, _events.c[name].type).length
    assert length is not None, name
    return length


_TYPE_LENGTH = _column_length("event_type")
_CONTENT_TYPE_LENGTH = _column_length("content_type")


def _check_storable(identified: Identified, content_type: str) -> None:
    # PostgreSQL refuses a NUL in text and a value longer than its column
    # with an error (a 500, retried for days), where SQLite stores both:
    # refuse them up front, the same way on both, as the bad input they are.
    strings = [identified.dedup_key, identified.event_type or ""]
    strings += [v for v in identified.meta.values() if isinstance(v, str)]
    if any("\x00" in value for value in strings):
        raise Problem("payload-invalid", "the dedup key, type or metadata holds a NUL character")
    if len(identified.event_type or "") > _TYPE_LENGTH:
        raise Problem("payload-invalid", f"the event type is longer than {_TYPE_LENGTH} characters")
    if len(content_type) > _CONTENT_TYPE_LENGTH:
        raise Problem(
            "unsupported-media-type",
            f"the Content-Type header is longer than {_CONTENT_TYPE_LENGTH} characters",
        )


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
    session = db.session
    key = identified.dedup_key
    # Everything is prepared before the first write: on SQLite the write
    # lock is held from it to the commit, and every writer waits meanwhile.
    values: dict[str, Any] = {
        "source": source.name,
        "dedup_key": key,
        "event_type": identified.event_type,
        "fingerprint": print_,
        "content_type": content_type or None,
        "body": body,
        "headers": events.redact_headers(headers.items(), redacted_headers(source)),
        "meta": identified.meta,
        "correlation_id": correlation.current(),
        "duplicate_count": 0,
    }
    for _ in range(3):
        values["received_at"] = utcnow()
        if is_sqlite():
            duplicate_of, event_id = _receive_in_transaction(values)
        else:
            duplicate_of, event_id = _receive_in_one_statement(values)
        if duplicate_of is not None:
            session.commit()
            _log("duplicate", source, key, duplicate_of)
            metrics.duplicate(source.name)
            return Receipt("duplicate", accepted_body(duplicate_of), duplicate_of)
        if event_id is not None:
            session.commit()
            _log("accepted", source, key, event_id)
            metrics.received(source.name)
            return Receipt("accepted", accepted_body(event_id), event_id)
        # The key holds other content (or its event was purged in between:
        # then the next round stores this one).
        session.rollback()
        existing = events.find_by_key(source.name, key)
        end_read()
        if existing is None or existing.fingerprint == print_:
            continue
        _keep_conflict(existing.id, values)
        session.commit()
        log.error(
            "dedup key reused with different content",
            extra={
                "outcome": "conflict",
                "source": source.name,
                "dedup_key": key,
                "event_id": existing.id,
                "correlation_id": correlation.current(),
            },
        )
        metrics.conflict(source.name)
        raise Problem(
            "dedup-key-conflict",
            "an event with this key and different content was already received; "
            "this delivery is kept for review",
            event_id=existing.id,
        )
    raise RuntimeError("receipt did not settle")  # pragma: no cover


# Built once: constructing statements costs more Python than running them.
_RECORD_DUPLICATE = insert(_duplicates)


def _sqlite_upsert() -> Any:
    from sqlalchemy.dialects.sqlite import insert as sqlite_insert

    statement = sqlite_insert(_events)
    return statement.on_conflict_do_update(
        index_elements=["source", "dedup_key"],
        set_={
            "duplicate_count": _events.c.duplicate_count + 1,
            "last_duplicate_at": statement.excluded.received_at,
        },
        where=_events.c.fingerprint == statement.excluded.fingerprint,
    ).returning(_events.c.id, _events.c.duplicate_count)


_UPSERT_SQLITE = _sqlite_upsert()

_EVENT_COLUMNS = (
    "source",
    "dedup_key",
    "event_type",
    "fingerprint",
    "content_type",
    "body",
    "headers",
    "meta",
    "correlation_id",
    "duplicate_count",
    "received_at",
)
_RECEIVE: list[Any] = []


def _receive_in_transaction(values: dict[str, Any]) -> tuple[int | None, int | None]:
    """SQLite: insert the event, or count the redelivery, in the session's transaction.

    One upsert does either: a new key inserts (``duplicate_count`` 0), the
    same key with the same fingerprint increments the count in the database
    (no read-modify-write), other content matches nothing. It is a write and
    comes first, as SQLite needs (see database.py). The caller commits.
    Returns as ``_receive_in_one_statement`` does.
    """
    conn = db.session.connection()
    row = conn.execute(_UPSERT_SQLITE, values).first()
    if row is None:
        return None, None
    if row.duplicate_count == 0:
        events.enqueue_deliveries(row.id, values)
        return None, row.id
    conn.execute(_RECORD_DUPLICATE, {"event_id": row.id, "received_at": values["received_at"]})
    return row.id, None


def _receive_in_one_statement(values: dict[str, Any]) -> tuple[int | None, int | None]:
    """PostgreSQL: receive in one statement, its own transaction, one round trip.

    Returns (the id of the event this duplicates, the id of the new event);
    both None when the key holds other content. Running outside an explicit
    transaction saves the BEGIN and COMMIT round trips: the statement commits
    durably before it returns, so the 2xx that follows still comes after it.
    """
    consumers = outbox.consumers_for(values["source"], values["event_type"])
    bind = {
        **{f"v_{name}": value for name, value in values.items()},
        "v_consumers": [name for name, _ in consumers],
        "v_kinds": [kind for _, kind in consumers],
        "v_pending": deliveries.PENDING,
    }
    with db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        row = conn.execute(_receive_statement(), bind).one()
    return row.duplicate_of, row.event_id


def _receive_statement() -> Any:
    """PostgreSQL's one-statement receipt, built on first use.

    ``upserted`` inserts the event, or increments the count of the one
    stored under the key when its fingerprint matches (the conflict waits
    for a racing copy's commit, then counts it), or does nothing for other
    content; ``recorded`` notes a redelivery's time; ``enqueued`` writes a
    new event's deliveries (the outbox). All of it commits together.
    """
    if not _RECEIVE:
        from sqlalchemy import func
        from sqlalchemy.dialects.postgresql import ARRAY
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        from ..models import Delivery

        now = bindparam("v_received_at", type_=UTCDateTime())
        new_row = select(
            *[bindparam(f"v_{name}", type_=_events.c[name].type) for name in _EVENT_COLUMNS]
        )
        upsert = pg_insert(_events).from_select(list(_EVENT_COLUMNS), new_row)
        upserted = (
            upsert.on_conflict_do_update(
                index_elements=["source", "dedup_key"],
                set_={
                    "duplicate_count": _events.c.duplicate_count + 1,
                    "last_duplicate_at": upsert.excluded.received_at,
                },
                where=_events.c.fingerprint == upsert.excluded.fingerprint,
            )
            .returning(_events.c.id, _events.c.duplicate_count)
            .cte("upserted")
        )
        is_new = upserted.c.duplicate_count == 0
        recorded = (
            insert(_duplicates)
            .from_select(["event_id", "received_at"], select(upserted.c.id, now).where(~is_new))
            .returning(_duplicates.c.event_id)
            .cte("recorded")
        )
        wanted = (
            func.unnest(
                bindparam("v_consumers", type_=ARRAY(String())),
                bindparam("v_kinds", type_=ARRAY(String())),
            )
            .table_valued("consumer", "kind")
            .render_derived(name="wanted")
        )
        _deliveries = Delivery.__table__
        enqueued = (
            insert(_deliveries)
            .from_select(
                [
                    "event_id",
                    "consumer",
                    "kind",
                    "state",
                    "attempts",
                    "next_attempt_at",
                    "created_at",
                    "updated_at",
                ],
                select(
                    upserted.c.id,
                    wanted.c.consumer,
                    wanted.c.kind,
                    bindparam("v_pending", type_=String()),
                    literal_column("0"),  # what select() makes of a bare 0
                    now,
                    now,
                    now,
                )
                .select_from(upserted.join(wanted, literal_true()))
                .where(is_new),
            )
            .returning(_deliveries.c.id)
            .cte("enqueued")
        )
        _RECEIVE.append(
            select(
                select(recorded.c.event_id).scalar_subquery().label("duplicate_of"),
                select(upserted.c.id).where(is_new).scalar_subquery().label("event_id"),
                select(func.count()).select_from(enqueued).scalar_subquery().label("enqueued"),
            )
        )
    return _RECEIVE[0]


def _keep_conflict(event_id: int, values: dict[str, Any]) -> None:
    """Keep a delivery whose content differs from the event stored under its key."""
    now = values["received_at"]
    stmt = dialect_insert(_conflicts).values(
        event_id=event_id,
        seen_count=1,
        last_seen_at=now,
        **{
            name: values[name]
            for name in (
                "source",
                "dedup_key",
                "fingerprint",
                "content_type",
                "body",
                "headers",
                "received_at",
            )
        },
    )
    # One record per distinct content: a repeat of the same conflicting
    # delivery only counts.
    db.session.execute(
        stmt.on_conflict_do_update(
            index_elements=["event_id", "fingerprint"],
            set_={"seen_count": _conflicts.c.seen_count + 1, "last_seen_at": now},
        )
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
    # Counting a refusal must never turn it into a 5xx: if the database is
    # away, the 401 still stands.
    try:
        db.session.execute(
            insert(Rejection.__table__).values(
                source=source.name,
                reason=reason,
                detail=detail[:500],
                remote_addr=(remote_addr or "")[:100] or None,
                received_at=utcnow(),
            )
        )
        db.session.commit()
    except Exception:
        db.session.rollback()
        log.warning("could not record a refused delivery", exc_info=True)


def _log(outcome: str, source: SourceConfig, key: str, event_id: int) -> None:
    log.info(
        "delivery %s",
        outcome,
        extra={
            "outcome": outcome,
            "source": source.name,
            "dedup_key": key,
            "event_id": event_id,
            "correlation_id": correlation.current(),
        },
    )
