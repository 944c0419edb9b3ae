"""The idempotency record as a small state machine, and its data access.

States: ``in_progress`` (claimed by one request) and ``completed`` (the
response is saved). A record past ``expires_at`` counts as absent; an
``in_progress`` record past its lease was left by a crashed holder and may
be taken over. Every transition is one conditional statement, so the
database decides every race.

Two ways to hold a key (docs/idempotency.md): a two-phase claim commits on
its own under a lease (``claim``), for views whose effects reach other
services; a claim in the view's own transaction, made with the saved
response at once after the view (``save_in_transaction``), is never seen
uncommitted, needs no lease, and commits with the view's writes and the
saved response, or rolls back with them.
"""

from __future__ import annotations

import math
import secrets
import weakref
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import and_, bindparam, delete, func, or_, select, update
from sqlalchemy.engine import CursorResult, Engine
from sqlalchemy.exc import IntegrityError, OperationalError

from ..database import (
    autocommit_connection,
    commit_without_waiting_for_disk,
    insert_ignoring_conflicts,
    is_sqlite,
    unit_of_work,
    writer_turn,
)
from ..database_driver import DriverStatement, driver_cursor, transaction_cursor
from ..extensions import db
from ..inbox import (
    HeldEvent,
    ReservedIdTaken,
    check_reserved_id,
    forget_reserved_ids,
    receipt_binds,
)
from ..inbox.statements import receive_if, reserved_id_is_current
from ..models import IdempotencyRecord

IN_PROGRESS = "in_progress"
COMPLETED = "completed"

_t = IdempotencyRecord.__table__


@dataclass(frozen=True)
class Request:
    """What identifies one request for the engine."""

    client: str
    key: str
    fingerprint: str
    method: str
    path: str


@dataclass(frozen=True)
class Claimed:
    """This request holds the key: run the view, then complete or release."""

    record_id: int
    token: str


@dataclass(frozen=True)
class Replay:
    """A completed record with the same fingerprint: answer its saved response."""

    status: int
    headers: list[list[str]]
    body: bytes


@dataclass(frozen=True)
class Mismatch:
    """The key was used for a different request."""


@dataclass(frozen=True)
class InFlight:
    """Another request holds the key under a live lease."""

    retry_after: int


Outcome = Claimed | Replay | Mismatch | InFlight


class LeaseLost(Exception):
    """The lease expired and another request took the key over."""


class KeyLocked(Exception):
    """Another transaction holds the key uncommitted for longer than the lock timeout."""


# PostgreSQL's lock_not_available: the lock timeout ran out.
_LOCK_NOT_AVAILABLE = "55P03"


def claim(req: Request, now: datetime, lease: timedelta, ttl: timedelta) -> Outcome:
    """Claim the key for a two-phase view, under a lease, or say why not.

    The key is read first, since retries are the common case and a read is
    cheaper than a failed insert; the insert's unique constraint still
    decides between racing first requests. A fresh claim commits on its own
    before the view runs, so that concurrent retries see it (409).
    """
    for _ in range(5):
        token = secrets.token_hex(16)
        row, inserted = _lookup_or_claim(req, _claim_values(req, token, now, lease, ttl))
        if inserted is not None:
            return Claimed(inserted, token)
        if row is None:
            continue  # another first request won the insert: read its record
        answer = _answer(row, req, now)
        if answer is not None:
            return answer
        if _take_over(row.id, req, token, now, lease, ttl):
            return Claimed(row.id, token)
        # Somebody else took it over or finished: read again.
    raise RuntimeError("idempotency claim did not settle")  # pragma: no cover


def _answer(row: Any, req: Request, now: datetime) -> Replay | Mismatch | InFlight | None:
    """What a stored record answers this request; None when it is expired or abandoned."""
    expired = row.expires_at <= now
    abandoned = row.state == IN_PROGRESS and row.lease_expires_at <= now
    if expired or abandoned:
        return None
    if row.state == IN_PROGRESS:
        # Whatever its body: the holder may still fail and release the
        # key, so "in flight, retry later" is the honest answer.
        remaining = (row.lease_expires_at - now).total_seconds()
        return InFlight(max(1, math.ceil(remaining)))
    if row.fingerprint != req.fingerprint:
        return Mismatch()
    return Replay(row.response_status, row.response_headers or [], row.response_body or b"")


def find(req: Request, now: datetime) -> Replay | Mismatch | InFlight | None:
    """Read the key's record outside any transaction: its answer, or None if the key is free.

    A lone read (no BEGIN, no ROLLBACK), so a replay is one round trip. An
    uncommitted claim is not seen: its holder decides, see
    ``save_in_transaction``.
    """
    statements = _driver_statements(db.engine)
    statement, processors = statements.find, statements.find_processors
    with driver_cursor(db.engine) as cursor:
        params = statement.params({"b_client": req.client, "b_key": req.key})
        row = cursor.execute(statement.sql, params).fetchone()
    if row is None:
        return None
    stored = _FoundRecord(
        *[value if p is None else p(value) for p, value in zip(processors, row, strict=True)]
    )
    return _answer(stored, req, now)


@dataclass(frozen=True)
class _FoundRecord:
    """A record as ``find`` reads it (the columns of ``_LOOKUP``)."""

    id: int
    state: str
    fingerprint: str
    lease_expires_at: datetime | None
    expires_at: datetime
    response_status: int | None
    response_headers: list[list[str]] | None
    response_body: bytes | None


@dataclass(frozen=True)
class _DriverStatements:
    """The record's statements on one engine's driver (each engine its own dialect)."""

    find: DriverStatement
    # Each column of ``_LOOKUP``'s conversion of the value read.
    find_processors: list[Any]
    upsert: DriverStatement
    # PostgreSQL: the upsert with the view's one new event (save_with_event),
    # with its deliveries, and for an event no consumer takes.
    upsert_with_event: DriverStatement | None
    upsert_with_lone_event: DriverStatement | None


# Per engine: the tests run apps on both databases.
_BY_ENGINE: weakref.WeakKeyDictionary[Engine, _DriverStatements] = weakref.WeakKeyDictionary()


def _driver_statements(engine: Engine) -> _DriverStatements:
    """``_LOOKUP`` and the upsert of ``_upsert`` on ``engine``'s driver, built on first use.

    A replay is the read and nothing else: through SQLAlchemy's execution
    (a Connection, its result) the read cost about as much CPU as the rest
    of the replay; the upsert too cost more than its statement. The
    columns' own types still convert each value.
    """
    built = _BY_ENGINE.get(engine)
    if built is None:
        dialect = engine.dialect
        built = _BY_ENGINE[engine] = _DriverStatements(
            find=DriverStatement(_LOOKUP, dialect),
            find_processors=[
                column.type.dialect_impl(dialect).result_processor(dialect, None)
                for column in _LOOKUP.selected_columns
            ],
            upsert=DriverStatement(_upsert_statement(dialect.name), dialect),
            upsert_with_event=_with_event(dialect, deliveries=True),
            upsert_with_lone_event=_with_event(dialect, deliveries=False),
        )
    return built


def _with_event(dialect: Any, *, deliveries: bool) -> DriverStatement | None:
    if dialect.name != "postgresql":
        return None
    # No claim with an event whose reserved id the sequence no longer covers.
    claimed = _upsert_statement(dialect.name, only_if=reserved_id_is_current()).cte("claimed")
    return DriverStatement(receive_if(claimed, deliveries=deliveries), dialect)


def save_in_transaction(
    req: Request,
    response: tuple[int, list[list[str]], bytes],
    now: datetime,
    ttl: timedelta,
    lock_timeout: float,
) -> bool:
    """Claim the key and save its response in one statement, after the view ran.

    The claim and the completion at once (one round trip fewer than a
    claim before the view and a completion after it), in the session's
    transaction, which commits the view's writes with it. False if the key
    is taken: roll back, and answer from its record (``find``).
    """
    values = _completed_values(req, response, now, ttl)
    return _upsert(req, values, now, lock_timeout) is not None


def save_with_event(
    req: Request,
    response: tuple[int, list[list[str]], bytes],
    now: datetime,
    ttl: timedelta,
    lock_timeout: float,
    event: HeldEvent,
) -> bool:
    """PostgreSQL: claim the key, save its response and write the view's event, in one statement.

    For a view whose only write is one new event (``inbox.holding``): the
    statement is its own transaction, so BEGIN and COMMIT cost no round
    trips of their own. The event and its deliveries are written only if
    the claim is; False if the key is taken (nothing was written). A
    racing request's uncommitted claim is waited for as in ``_upsert``.
    Raises ``inbox.ReservedIdTaken`` (nothing written) if the event's
    reserved id was handed out again by a sequence that went back.
    """
    values = _completed_values(req, response, now, ttl)
    params = {**values, "client": req.client, "key": req.key, "b_now": now}
    params["b_lock_timeout"] = _lock_timeout_setting(lock_timeout)
    params.update(receipt_binds(event))
    statements = _driver_statements(db.engine)
    statement = (
        statements.upsert_with_event if event.consumers else statements.upsert_with_lone_event
    )
    if statement is None:
        raise RuntimeError("save_with_event is PostgreSQL's: on SQLite inbox.add writes at once")
    try:
        with driver_cursor(db.engine) as cursor:
            row = cursor.execute(statement.sql, statement.params(params)).fetchone()
    except OperationalError as exc:
        if getattr(exc.orig, "sqlstate", None) == _LOCK_NOT_AVAILABLE:
            raise KeyLocked() from exc
        raise
    except IntegrityError as exc:
        check_reserved_id(db.engine, exc)  # ReservedIdTaken: run the view again
        raise
    claimed_id, _written, id_current = row
    if claimed_id is None and not id_current:
        # Nothing was written as the sequence went back below the event's
        # id, which the claim refused: run the view again with a fresh one.
        forget_reserved_ids(db.engine)
        raise ReservedIdTaken()
    # Otherwise None: nothing was written, the key is taken.
    return claimed_id is not None


def _completed_values(
    req: Request, response: tuple[int, list[list[str]], bytes], now: datetime, ttl: timedelta
) -> dict[str, Any]:
    """The columns of a record completed with ``response`` at its claim."""
    status, headers, body = response
    values = _claim_values(req, None, now, timedelta(0), ttl)
    values.update(state=COMPLETED, lease_expires_at=None, completed_at=now)
    values.update(response_status=status, response_headers=headers, response_body=body)
    return values


def _lock_timeout_setting(seconds: float) -> str:
    # PostgreSQL's lock_timeout, in whole milliseconds (0 would mean none).
    return f"{max(1, round(seconds * 1000))}ms"


def _upsert(req: Request, values: dict[str, Any], now: datetime, lock_timeout: float) -> int | None:
    """Insert the record, or take over an expired or abandoned one; its id, or None if taken.

    A record under the key that answers for itself is left alone. A record
    of another transaction not yet committed is waited for: if it commits,
    the key is taken; if it rolls back, this one goes in. On PostgreSQL the
    wait is bounded by ``lock_timeout`` seconds, then KeyLocked; on SQLite
    the writers' turn and the write lock serialise whole transactions,
    bounded by the busy timeout (a 503, as for any write).
    """
    params = {**values, "client": req.client, "key": req.key, "b_now": now}
    connection = db.session.connection()
    dialect = connection.dialect.name
    if dialect != "sqlite":
        params["b_lock_timeout"] = _lock_timeout_setting(lock_timeout)
    statement = _driver_statements(connection.engine).upsert
    try:
        with transaction_cursor(connection) as cursor:
            row = cursor.execute(statement.sql, statement.params(params)).fetchone()
    except OperationalError as exc:
        if getattr(exc.orig, "sqlstate", None) == _LOCK_NOT_AVAILABLE:
            raise KeyLocked() from exc
        raise
    return None if row is None else cast(int, row[0])


_UPSERT_COLUMNS = (
    *("client", "key", "fingerprint", "method", "path", "state", "lease_token"),
    *("lease_expires_at", "created_at", "expires_at", "completed_at", "response_status"),
    *("response_headers", "response_body"),
)


def _upsert_statement(dialect: str, only_if: Any = None) -> Any:
    """The upsert of ``_upsert`` for this dialect; on PostgreSQL, only if ``only_if`` holds."""
    params = {name: bindparam(name, type_=_t.c[name].type) for name in _UPSERT_COLUMNS}
    now = bindparam("b_now", type_=_t.c.expires_at.type)
    takeable = or_(
        _t.c.expires_at <= now, and_(_t.c.state == IN_PROGRESS, _t.c.lease_expires_at <= now)
    )
    if dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        insert: Any = sqlite_insert(_t).values(params)
    else:
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        # The statement sets the lock timeout itself (for the rest of the
        # transaction) before its row can meet an uncommitted one: a
        # SET LOCAL of its own would cost a round trip per new key.
        lock_timeout = func.set_config("lock_timeout", bindparam("b_lock_timeout"), True)
        row = select(*params.values()).where(lock_timeout.is_not(None))
        if only_if is not None:
            row = row.where(only_if)
        insert = pg_insert(_t).from_select(list(_UPSERT_COLUMNS), row)
    statement = insert.on_conflict_do_update(
        index_elements=["client", "key"],
        set_={name: insert.excluded[name] for name in _UPSERT_COLUMNS[2:]},
        where=takeable,
    ).returning(_t.c.id)
    return statement


_LOOKUP = select(
    _t.c.id,
    _t.c.state,
    _t.c.fingerprint,
    _t.c.lease_expires_at,
    _t.c.expires_at,
    _t.c.response_status,
    _t.c.response_headers,
    _t.c.response_body,
).where(_t.c.client == bindparam("b_client"), _t.c.key == bindparam("b_key"))


def _claim_values(
    req: Request, token: str | None, now: datetime, lease: timedelta, ttl: timedelta
) -> dict[str, Any]:
    # The columns of a fresh claim, whether inserted or taken over.
    return {
        "fingerprint": req.fingerprint,
        "method": req.method,
        "path": req.path,
        "state": IN_PROGRESS,
        "lease_token": token,
        "lease_expires_at": now + lease,
        "created_at": now,
        "expires_at": now + ttl,
    }


_CLAIM_COLUMNS = (
    "client",
    "key",
    "fingerprint",
    "method",
    "path",
    "state",
    "lease_token",
    "lease_expires_at",
    "created_at",
    "expires_at",
)


def _lookup_or_claim(req: Request, claim_values: dict[str, Any]) -> tuple[Any, int | None]:
    """Read the record under the key or, when there is none, insert this claim.

    Returns (the record, None) when the key is taken, (None, the new id)
    when this request claimed it, and (None, None) when a racing first
    request won the insert. Outside any transaction: a taken key writes
    nothing, a replay is one round trip, and a claim commits on its own.
    """
    params = {"b_client": req.client, "b_key": req.key}
    values = {**claim_values, "client": req.client, "key": req.key}
    with autocommit_connection() as conn:
        if is_sqlite():
            # A read needs no turn at the write lock; only a fresh key writes.
            row = conn.execute(_LOOKUP, params).one_or_none()
            if row is not None:
                return row, None
            with writer_turn():
                return None, conn.execute(_claim_statement("sqlite"), values).scalar()
        # PostgreSQL: the read and the insert are one statement, its own
        # transaction (one round trip for a replay and for a claim alike).
        row = conn.execute(_claim_statement("postgresql"), {**params, **values}).one()
    if row.claimed_id is not None:
        return None, row.claimed_id
    return (row if row.id is not None else None), None


_CLAIMS: dict[str, Any] = {}


def _claim_statement(dialect: str) -> Any:
    """The claim's INSERT (SQLite), or the read-or-insert statement (PostgreSQL)."""
    statement = _CLAIMS.get(dialect)
    if statement is not None:
        return statement
    if dialect == "sqlite":
        statement = (
            insert_ignoring_conflicts(_t, ["client", "key"])
            .values({name: bindparam(name, type_=_t.c[name].type) for name in _CLAIM_COLUMNS})
            .returning(_t.c.id)
        )
    else:
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        stored = _LOOKUP.cte("stored")
        new_row = select(
            *[bindparam(name, type_=_t.c[name].type) for name in _CLAIM_COLUMNS]
        ).where(~select(stored.c.id).exists())
        claimed = (
            pg_insert(_t)
            .from_select(list(_CLAIM_COLUMNS), new_row)
            .on_conflict_do_nothing(index_elements=["client", "key"])
            .returning(_t.c.id)
            .cte("claimed")
        )
        statement = select(
            *[select(column).scalar_subquery().label(column.name) for column in stored.c],
            select(claimed.c.id).scalar_subquery().label("claimed_id"),
        )
    _CLAIMS[dialect] = statement
    return statement


def _take_over(
    record_id: int, req: Request, token: str, now: datetime, lease: timedelta, ttl: timedelta
) -> bool:
    # The takeover is the claim's own unit of work, committed before the view runs.
    with unit_of_work():
        commit_without_waiting_for_disk()
        result = _conditional_take_over(record_id, req, token, now, lease, ttl)
    return result.rowcount == 1


def _conditional_take_over(
    record_id: int, req: Request, token: str, now: datetime, lease: timedelta, ttl: timedelta
) -> Any:
    # One conditional UPDATE: it matches only while the record is still
    # expired or abandoned, so two requests cannot both take it over.
    return db.session.connection().execute(
        update(_t)
        .where(
            _t.c.id == record_id,
            or_(
                _t.c.expires_at <= now,
                and_(_t.c.state == IN_PROGRESS, _t.c.lease_expires_at <= now),
            ),
        )
        .values(
            **_claim_values(req, token, now, lease, ttl),
            completed_at=None,
            response_status=None,
            response_headers=None,
            response_body=None,
        )
    )


def hold(claimed: Claimed) -> None:
    """On SQLite, open the view's transaction with a write to the claimed record.

    The view's reads and writes then run under the write lock instead of
    failing when a read transaction cannot be upgraded. PostgreSQL needs no
    such step: ``complete`` is fenced by the lease token, so a request that
    lost its lease meanwhile rolls back there, and one round trip is saved.
    Raises LeaseLost if the lease is already gone.
    """
    if not is_sqlite():
        return
    result = db.session.connection().execute(
        update(_t)
        .where(_t.c.id == claimed.record_id, _t.c.lease_token == claimed.token)
        .values(state=IN_PROGRESS)
    )
    if result.rowcount != 1:
        raise LeaseLost()


def complete(
    claimed: Claimed, status: int, headers: list[list[str]], body: bytes, now: datetime
) -> None:
    """Save the response in the current transaction; raise LeaseLost if the lease was lost."""
    result = db.session.connection().execute(
        _COMPLETE,
        {
            "b_id": claimed.record_id,
            "b_token": claimed.token,
            "b_now": now,
            "b_status": status,
            "b_headers": headers,
            "b_body": body,
        },
    )
    if result.rowcount != 1:
        raise LeaseLost()


# Built once: building it per request cost more CPU than running it.
_COMPLETE = (
    update(_t)
    .where(_t.c.id == bindparam("b_id"), _t.c.lease_token == bindparam("b_token"))
    .values(
        state=COMPLETED,
        lease_token=None,
        lease_expires_at=None,
        completed_at=bindparam("b_now", type_=_t.c.completed_at.type),
        response_status=bindparam("b_status", type_=_t.c.response_status.type),
        response_headers=bindparam("b_headers", type_=_t.c.response_headers.type),
        response_body=bindparam("b_body", type_=_t.c.response_body.type),
    )
)


def release(claimed: Claimed) -> None:
    """Give the key back after a failure, so that a retry runs again; the caller commits."""
    db.session.connection().execute(
        delete(_t).where(_t.c.id == claimed.record_id, _t.c.lease_token == claimed.token)
    )


def purge_expired_batch(now: datetime, batch_size: int) -> int:
    """Delete up to ``batch_size`` expired records; return how many. The caller commits."""
    ids = select(_t.c.id).where(_t.c.expires_at <= now).limit(batch_size)
    # Session.execute is typed for any statement; a DELETE gives a CursorResult.
    result = cast(
        CursorResult[Any],
        db.session.execute(delete(_t).where(_t.c.id.in_(ids.scalar_subquery()))),
    )
    return result.rowcount


def evict(record_id: int) -> bool:
    """Delete one record (an operator's action); return whether it existed. The caller commits."""
    result = cast(CursorResult[Any], db.session.execute(delete(_t).where(_t.c.id == record_id)))
    return result.rowcount == 1
