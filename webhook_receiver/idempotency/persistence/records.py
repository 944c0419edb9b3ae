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
saved response, or rolls back with them. The statements are built once,
in statements.py.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import and_, delete, not_, or_, select, update
from sqlalchemy.engine import CursorResult
from sqlalchemy.exc import OperationalError

from ...database import (
    autocommit_connection,
    commit_without_waiting_for_disk,
    is_sqlite,
    unit_of_work,
    writer_turn,
)
from ...database_driver import driver_cursor, transaction_cursor
from ...extensions import db
from ...models import IdempotencyRecord
from .statements import (
    COMPLETE,
    COMPLETED,
    IN_PROGRESS,
    LOOKUP,
    claim_statement,
    driver_statements,
)

__all__ = ["COMPLETED", "IN_PROGRESS"]

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
    statements = driver_statements(db.engine)
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
    """A record as ``find`` reads it (the columns of ``LOOKUP``)."""

    id: int
    state: str
    fingerprint: str
    lease_expires_at: datetime | None
    expires_at: datetime
    response_status: int | None
    response_headers: list[list[str]] | None
    response_body: bytes | None


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

    A record under the key that answers for itself is left alone. A record
    of another transaction not yet committed is waited for: if it commits,
    the key is taken; if it rolls back, this one goes in. On PostgreSQL the
    wait is bounded by ``lock_timeout`` seconds, then KeyLocked; on SQLite
    the writers' turn and the write lock serialise whole transactions,
    bounded by the busy timeout (a 503, as for any write).
    """
    connection = db.session.connection()
    params = completed_params(req, response, now, ttl, lock_timeout, connection.dialect.name)
    statement = driver_statements(connection.engine).upsert
    with key_locked_raised(), transaction_cursor(connection) as cursor:
        row = cursor.execute(statement.sql, statement.params(params)).fetchone()
    return row is not None


def completed_params(
    req: Request,
    response: tuple[int, list[list[str]], bytes],
    now: datetime,
    ttl: timedelta,
    lock_timeout: float,
    dialect: str,
) -> dict[str, Any]:
    """The parameters of ``upsert_statement`` for a record completed at its claim."""
    status, headers, body = response
    values = _claim_values(req, None, now, timedelta(0), ttl)
    values.update(state=COMPLETED, lease_expires_at=None, completed_at=now)
    values.update(response_status=status, response_headers=headers, response_body=body)
    params = {**values, "client": req.client, "key": req.key, "b_now": now}
    if dialect != "sqlite":
        # PostgreSQL's lock_timeout, in whole milliseconds (0 would mean none).
        params["b_lock_timeout"] = f"{max(1, round(lock_timeout * 1000))}ms"
    return params


@contextmanager
def key_locked_raised() -> Iterator[None]:
    """Raise KeyLocked for a statement whose wait for another holder's lock timed out."""
    try:
        yield
    except OperationalError as exc:
        if getattr(exc.orig, "sqlstate", None) == _LOCK_NOT_AVAILABLE:
            raise KeyLocked() from exc
        raise


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
            row = conn.execute(LOOKUP, params).one_or_none()
            if row is not None:
                return row, None
            with writer_turn():
                return None, conn.execute(claim_statement("sqlite"), values).scalar()
        # PostgreSQL: the read and the insert are one statement, its own
        # transaction (one round trip for a replay and for a claim alike).
        row = conn.execute(claim_statement("postgresql"), {**params, **values}).one()
    if row.claimed_id is not None:
        return None, row.claimed_id
    return (row if row.id is not None else None), None


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
        COMPLETE,
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
        # The expiry is checked again on the row deleted: on PostgreSQL a
        # record taken over (the same row, a new expiry) while the DELETE
        # waited on it matches the subquery's snapshot, and must stay.
        db.session.execute(
            delete(_t).where(_t.c.id.in_(ids.scalar_subquery()), _t.c.expires_at <= now)
        ),
    )
    return result.rowcount


EVICTED, RUNNING, GONE = "evicted", "running", "gone"


def _running(now: datetime) -> Any:
    """A record whose request runs now: in progress under a live lease, not expired."""
    return and_(_t.c.state == IN_PROGRESS, _t.c.lease_expires_at > now, _t.c.expires_at > now)


def is_running(record: Any, now: datetime) -> bool:
    """Whether a record already read is one ``evict`` keeps: its request runs now."""
    lease = record.lease_expires_at
    return (
        record.state == IN_PROGRESS
        and lease is not None
        and lease > now
        and record.expires_at > now
    )


def evict(record_id: int, now: datetime) -> str:
    """Delete one record (an operator's action) unless its request is running now.

    Returns ``EVICTED``, ``RUNNING`` (left alone) or ``GONE`` (no such record).
    A running request's record stays: without it the client's retry would
    run the request a second time beside the first. A completed, expired
    or abandoned (lease run out) record goes, so its key runs afresh. The
    test is in the DELETE itself, so a claim racing it cannot slip between.
    The caller commits.
    """
    deleted = db.session.execute(
        delete(_t).where(_t.c.id == record_id, not_(_running(now))).returning(_t.c.id)
    ).first()
    if deleted is not None:
        return EVICTED
    running = db.session.scalar(select(_t.c.id).where(_t.c.id == record_id, _running(now)))
    return RUNNING if running is not None else GONE
