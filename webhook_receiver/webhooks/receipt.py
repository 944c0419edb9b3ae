"""Receiving one provider delivery: verify, identify, then store once.

The event row is the dedup marker: its unique (source, dedup key)
constraint decides between racing copies. The key is read first, since
redeliveries are common and a read is cheaper than a failed write: a
redelivery with the same fingerprint is answered from the stored event and
writes nothing in the request (its count is recorded in a batch, see
duplicates.py); other content under the key is a conflict, kept for review;
an absent key is inserted, and a racing copy that loses the insert reads the
winner's event. On PostgreSQL the read, the insert and the new event's
deliveries are one statement in its own transaction: one round trip,
committed before the answer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import String, bindparam, insert, literal_column, select
from sqlalchemy import true as literal_true
from werkzeug.datastructures import Headers

from .. import correlation, duplicates, events, rejections
from ..database import (
    DriverStatement,
    autocommit_connection,
    dialect_insert,
    driver_cursor,
    is_sqlite,
    write_transaction,
    writer_turn,
)
from ..extensions import db
from ..fingerprint import JSONError, canonical_json, fingerprint, is_json_type, loads
from ..models import Event, EventConflict, UTCDateTime, utcnow
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
            stored, event_id = _receive_in_transaction(values)
        else:
            stored, event_id = _receive_in_one_statement(values)
        if event_id is not None:
            _log("accepted", source, key, event_id)
            metrics.received(source.name)
            return Receipt("accepted", accepted_body(event_id), event_id)
        if stored is None:
            continue  # a racing copy won the insert: read what it stored
        if stored.fingerprint == print_:
            # The answer needs nothing more than the stored event; the count
            # is bookkeeping, written in a batch (see duplicates.py).
            duplicates.record(stored.id, values["received_at"])
            _log("duplicate", source, key, stored.id)
            metrics.duplicate(source.name)
            return Receipt("duplicate", accepted_body(stored.id), stored.id)
        _keep_conflict(stored.id, values)
        db.session.commit()
        log.error(
            "dedup key reused with different content",
            extra={
                "outcome": "conflict",
                "source": source.name,
                "dedup_key": key,
                "event_id": stored.id,
                "correlation_id": correlation.current(),
            },
        )
        metrics.conflict(source.name)
        raise Problem(
            "dedup-key-conflict",
            "an event with this key and different content was already received; "
            "this delivery is kept for review",
            event_id=stored.id,
        )
    raise RuntimeError("receipt did not settle")  # pragma: no cover


def _receive_in_transaction(values: dict[str, Any]) -> tuple[Any, int | None]:
    """SQLite: read the key; only when it is absent, insert and commit.

    Redeliveries are read-only: a read needs no turn at the write lock, so
    a storm of copies does not queue behind new events. The insert's
    unique constraint still decides between racing first copies: the loser
    inserts nothing and reads the winner's event on the next round.
    Returns as ``_receive_in_one_statement`` does.
    """
    if not outbox.consumers_for(values["source"], values["event_type"]):
        return _receive_event_alone(values)
    with autocommit_connection() as conn:
        stored = events.find_by_key(values["source"], values["dedup_key"], conn)
        if stored is not None:
            return stored, None
        # The session is left out: on this path its bookkeeping cost more
        # than the statements (measured: bench/README.md).
        with write_transaction(conn):
            event_id = events.insert_event(values, conn)
    return None, event_id


_SQLITE: dict[str, DriverStatement] = {}


def _receive_event_alone(values: dict[str, Any]) -> tuple[Any, int | None]:
    """SQLite, no consumer: the event is all there is to write.

    Its INSERT is then a transaction of its own (the driver autocommits
    each statement, durably), and both statements run on the driver:
    through SQLAlchemy's execution they cost about 170 µs more CPU per new
    event, a fifth of the request (bench/README.md).
    """
    if not _SQLITE:
        dialect = db.engine.dialect
        _SQLITE["find"] = DriverStatement(events.FIND_BY_KEY, dialect)
        _SQLITE["insert"] = DriverStatement(events.insert_statement(), dialect, _EVENT_COLUMNS)
    find, insert_ = _SQLITE["find"], _SQLITE["insert"]
    with driver_cursor() as cursor:
        keys = {"b_source": values["source"], "b_key": values["dedup_key"]}
        row = cursor.execute(find.sql, find.params(keys)).fetchone()
        if row is not None:
            return _Stored(*row), None
        params = insert_.params(values)
        with writer_turn():
            # fetchall() runs the statement to its end, where SQLite commits
            # it: before the turn passes on, and before any answer.
            rows = cursor.execute(insert_.sql, params).fetchall()
    return None, rows[0][0] if rows else None


def _receive_in_one_statement(values: dict[str, Any]) -> tuple[Any, int | None]:
    """PostgreSQL: receive in one statement, its own transaction, one round trip.

    Returns (the (id, fingerprint) stored under the key, None) when the key
    is taken, (None, the new event's id) when this delivery was stored, and
    (None, None) when a racing copy won the insert after this statement's
    snapshot. A taken key writes nothing, so its commit is free; a new
    event commits durably, deliveries included, before the statement returns,
    so the 2xx that follows still comes after it.
    """
    consumers = outbox.consumers_for(values["source"], values["event_type"])
    bind = {
        **{f"v_{name}": value for name, value in values.items()},
        "v_consumers": [name for name, _ in consumers],
        "v_kinds": [kind for _, kind in consumers],
        "v_pending": deliveries.PENDING,
    }
    statement = _receive_statement()
    with driver_cursor() as cursor:
        row = cursor.execute(statement.sql, statement.params(bind)).fetchone()
    stored_id, stored_fingerprint, event_id, _enqueued = row
    if stored_id is not None:
        return _Stored(stored_id, stored_fingerprint), None
    return None, event_id


@dataclass(frozen=True)
class _Stored:
    id: int
    fingerprint: str


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
_RECEIVE: list[DriverStatement] = []


def _receive_statement() -> DriverStatement:
    """PostgreSQL's one-statement receipt, built on first use.

    ``stored`` reads the event under the key; ``inserted`` inserts this one
    only when there is none (``ON CONFLICT DO NOTHING`` for a racing copy
    committed after the snapshot); ``enqueued`` writes a new event's
    deliveries (the outbox). All of it commits together.
    """
    if not _RECEIVE:
        from sqlalchemy import func
        from sqlalchemy.dialects.postgresql import ARRAY
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        from ..models import Delivery

        now = bindparam("v_received_at", type_=UTCDateTime())
        stored = (
            select(_events.c.id, _events.c.fingerprint)
            .where(
                _events.c.source == bindparam("v_source"),
                _events.c.dedup_key == bindparam("v_dedup_key"),
            )
            .cte("stored")
        )
        new_row = select(
            *[bindparam(f"v_{name}", type_=_events.c[name].type) for name in _EVENT_COLUMNS]
        ).where(~select(stored.c.id).exists())
        inserted = (
            pg_insert(_events)
            .from_select(list(_EVENT_COLUMNS), new_row)
            .on_conflict_do_nothing(index_elements=["source", "dedup_key"])
            .returning(_events.c.id)
            .cte("inserted")
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
                    inserted.c.id,
                    wanted.c.consumer,
                    wanted.c.kind,
                    bindparam("v_pending", type_=String()),
                    literal_column("0"),  # what select() makes of a bare 0
                    now,
                    now,
                    now,
                ).select_from(inserted.join(wanted, literal_true())),
            )
            .returning(_deliveries.c.id)
            .cte("enqueued")
        )
        receive = select(
            select(stored.c.id).scalar_subquery().label("stored_id"),
            select(stored.c.fingerprint).scalar_subquery().label("stored_fingerprint"),
            select(inserted.c.id).scalar_subquery().label("event_id"),
            select(func.count()).select_from(enqueued).scalar_subquery().label("enqueued"),
        )
        _RECEIVE.append(DriverStatement(receive, db.engine.dialect))
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
    rejections.record(source.name, reason, detail, remote_addr)


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
