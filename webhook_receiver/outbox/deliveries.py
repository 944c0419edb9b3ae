"""The delivery record as a state machine, and its data access.

One delivery per (event, consumer), written in the same transaction as the
event (the transactional outbox). States:

- ``pending``: waiting for ``next_attempt_at``; after a failure it carries
  ``last_error`` and counts ``attempts``.
- ``in_progress``: claimed by one worker under a lease; an expired lease
  means the worker died and the delivery may be claimed again.
- ``delivered``: done; the handler's writes or the downstream's answer are in.
- ``dead``: a permanent failure or out of attempts; an operator may requeue it.
- ``skipped``: older than what was already applied for its entity.
- ``discarded``: a dead delivery an operator gave up on for good (its
  consumer is gone, or the event must not be delivered); never retried.

``delivered``, ``skipped`` and ``discarded`` are final: nothing moves a
delivery out of them, and retention may delete their event.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import (
    BindParameter,
    ColumnElement,
    CursorResult,
    and_,
    bindparam,
    exists,
    func,
    or_,
    select,
    update,
)

from ..database import is_sqlite
from ..extensions import db
from ..models import Delivery, Event

PENDING = "pending"
IN_PROGRESS = "in_progress"
DELIVERED = "delivered"
DEAD = "dead"
SKIPPED = "skipped"
DISCARDED = "discarded"
FINAL_STATES = (DELIVERED, SKIPPED, DISCARDED)

_t = Delivery.__table__
MAX_ERROR = 2000


def requeue(delivery_ids: Iterable[int], now: datetime) -> int:
    """Put dead, failed or stuck (lease expired) deliveries back in the queue, keeping their key.

    Attempts restart from zero so the retry budget is whole again; the
    Idempotency-Key sent downstream is derived from the event and consumer,
    so it does not change. Returns how many were requeued; delivered and
    skipped ones are left alone. The caller commits.
    """
    ids = list(delivery_ids)
    if not ids:
        return 0
    result = db.session.execute(
        update(_t)
        # The test is in the UPDATE itself: a delivery a worker claimed since
        # the operator looked (a live lease) is left alone.
        .where(_t.c.id.in_(ids), _requeueable(now))
        .values(
            state=PENDING,
            attempts=0,
            next_attempt_at=now,
            lease_token=None,
            lease_expires_at=None,
            updated_at=now,
        )
    )
    return _rowcount(result)


@dataclass(frozen=True)
class Discarded:
    """A delivery that ``discard`` moved from dead to discarded."""

    id: int
    event_id: int
    consumer: str
    source: str


def discard(delivery_ids: Iterable[int], now: datetime) -> list[Discarded]:
    """Give up on dead deliveries for good: they become ``discarded`` and are never retried.

    Only dead ones move; the test is in the UPDATE itself, so a delivery
    requeued (or claimed, or delivered) since the operator looked is left
    alone. ``last_error``, ``attempts`` and ``response_status`` are kept to
    show why it died; ``completed_at`` says when it was discarded. Returns
    the discarded ones with their event's source. The caller commits.
    """
    ids = list(delivery_ids)
    if not ids:
        return []
    rows = db.session.execute(
        update(_t)
        .where(_t.c.id.in_(ids), _t.c.state == DEAD)
        .values(state=DISCARDED, updated_at=now, completed_at=now)
        .returning(_t.c.id, _t.c.event_id, _t.c.consumer)
    ).all()
    if not rows:
        return []
    sources: dict[int, str] = {
        event_id: source
        for event_id, source in db.session.execute(
            select(Event.id, Event.source).where(Event.id.in_({row.event_id for row in rows}))
        )
    }
    return sorted(
        (Discarded(row.id, row.event_id, row.consumer, sources[row.event_id]) for row in rows),
        key=lambda d: d.id,
    )


def _requeueable(now: datetime) -> ColumnElement[bool]:
    return or_(
        _t.c.state == DEAD,
        and_(_t.c.state == PENDING, _t.c.attempts > 0),
        and_(
            _t.c.state == IN_PROGRESS,
            or_(_t.c.lease_expires_at.is_(None), _t.c.lease_expires_at <= now),
        ),
    )


@dataclass(frozen=True)
class Claim:
    """A delivery this worker holds under a lease, until the lease expires."""

    id: int
    event_id: int
    consumer: str
    kind: str
    attempt: int  # this attempt's number, from 1
    token: str
    lease_expires_at: datetime
    # The event's source: with ``consumer``, the target the claim occupies.
    source: str | None = None
    # Which replay's key to send: 0 the original (see outbox/replays.py).
    key_replay: int = 0


def _claimable(now: datetime | BindParameter[datetime]) -> ColumnElement[bool]:
    return or_(
        and_(_t.c.state == PENDING, _t.c.next_attempt_at <= now),
        # The holder of an expired lease died (or hung): take it over.
        and_(_t.c.state == IN_PROGRESS, _t.c.lease_expires_at <= now),
    )


def new_delivery_columns(now: datetime) -> dict[str, Any]:
    """The columns of a fresh delivery besides its event, consumer and kind.

    The one definition of a new outbox row: the inbox writes it with every
    new event, row by row or inside PostgreSQL's one-statement receipt.
    """
    return {
        "state": PENDING,
        "attempts": 0,
        "next_attempt_at": now,
        "created_at": now,
        "updated_at": now,
    }


def claim_next(
    now: datetime, lease: timedelta, skip: Collection[tuple[str, str]] = ()
) -> Claim | None:
    """Claim the most overdue claimable delivery (the caller commits the claim); None if none.

    One conditional UPDATE: on PostgreSQL its subquery locks the row with
    ``FOR UPDATE SKIP LOCKED``, so concurrent workers pick different rows
    rather than queueing on one; SQLite runs the statement under its single
    write lock. Either way one worker gets a row, and its fresh token fences
    off any worker whose lease on it expired.

    ``skip`` names (source, consumer) targets not to claim for now: those
    that already have as many deliveries in flight in this worker as they
    may, so that the other targets get the free threads.
    """
    statement = _claim_statement(is_sqlite(), frozenset(skip))
    token = secrets.token_hex(16)
    row = db.session.execute(
        statement, {"claim_now": now, "claim_token": token, "claim_expires": now + lease}
    ).one_or_none()
    if row is None:
        return None
    delivery_id, event_id, consumer, kind, attempts, source, key_replay = row[:7]
    return Claim(
        delivery_id, event_id, consumer, kind, attempts, token, now + lease, source, key_replay
    )


@functools.lru_cache(maxsize=256)  # per dialect and set of busy targets: a handful
def _claim_statement(sqlite: bool, skip: frozenset[tuple[str, str]]) -> Any:
    """claim_next's UPDATE, built once: the worker's loop runs it for every delivery."""
    now = bindparam("claim_now", type_=_t.c.next_attempt_at.type)
    pick = (
        select(_t.c.id)
        .where(_claimable(now), *_not_busy(skip))
        .order_by(_t.c.next_attempt_at, _t.c.id)
        .limit(1)
        .with_for_update(skip_locked=True)
    )
    returned: list[Any] = [
        _t.c.id,
        _t.c.event_id,
        _t.c.consumer,
        _t.c.kind,
        _t.c.attempts,
        select(Event.source).where(Event.id == _t.c.event_id).scalar_subquery(),
        _t.c.key_replay,
    ]
    if not sqlite:
        # A claim lost in a crash only makes the delivery claimable again: its
        # commit need not wait for the disk (the outcome's commit does). Set
        # for the transaction in the claim's own statement, as SET LOCAL
        # would be in a round trip of its own.
        returned.append(func.set_config("synchronous_commit", "off", True))
    return (
        update(_t)
        .where(_t.c.id == pick.scalar_subquery(), _claimable(now))
        .values(
            state=IN_PROGRESS,
            attempts=_t.c.attempts + 1,
            lease_token=bindparam("claim_token", type_=_t.c.lease_token.type),
            lease_expires_at=bindparam("claim_expires", type_=_t.c.lease_expires_at.type),
            updated_at=now,
        )
        .returning(*returned)
    )


def _not_busy(skip: Collection[tuple[str, str]]) -> list[ColumnElement[bool]]:
    if not skip:
        return []
    # Consumer names are unique per source only: the event's source decides,
    # looked up only for the rows whose consumer name is a busy one.
    busy = exists().where(
        Event.id == _t.c.event_id,
        or_(*(and_(Event.source == source, _t.c.consumer == name) for source, name in skip)),
    )
    return [or_(_t.c.consumer.not_in({name for _, name in skip}), ~busy)]


def hold(claim: Claim, now: datetime) -> bool:
    """Lock the claimed row in the current transaction; False if the lease was lost.

    It is the transaction's first statement and a write, so on SQLite the
    transaction runs under the write lock (waiting on the busy timeout), and
    on PostgreSQL the row lock makes other workers skip the row until commit.
    """
    result = db.session.execute(
        update(_t)
        .where(_t.c.id == claim.id, _t.c.lease_token == claim.token)
        .values(updated_at=now)
    )
    return _rowcount(result) == 1


def _finish(
    claim: Claim, now: datetime, when: ColumnElement[bool] | None = None, **values: Any
) -> bool:
    # Fenced by the lease token: a worker whose lease was taken over
    # changes nothing.
    condition = and_(_t.c.id == claim.id, _t.c.lease_token == claim.token)
    if when is not None:
        condition = and_(condition, when)
    result = db.session.execute(update(_t).where(condition).values(_ended(now, values)))
    return _rowcount(result) == 1


# What every outcome sets besides its own columns: the lease is given up.
_LEASE_ENDED = ("lease_token", "lease_expires_at", "updated_at")


def _ended(now: datetime, values: dict[str, Any]) -> dict[str, Any]:
    return dict(zip(_LEASE_ENDED, (None, None, now), strict=True), **values)


def delivered_values(now: datetime, status: int | None = None) -> dict[str, Any]:
    """The columns a delivered outcome sets (with ``finish``)."""
    return {"state": DELIVERED, "response_status": status, "last_error": None, "completed_at": now}


def storable(text: str, size: int) -> str:
    """``text`` cut at ``size`` characters, a NUL character replaced (U+FFFD), a lone surrogate "?".

    PostgreSQL's text refuses NUL, and an answer's body or an error quoting
    it may hold one; neither database can encode a lone surrogate (half of
    a UTF-16 pair), which a handler's exception message may hold. The
    outcome must still be written (on both databases the same).
    """
    text = text[:size].replace("\x00", "\ufffd")
    if text.isascii():
        return text
    return text.encode("utf-8", "replace").decode("utf-8")


def retry_values(next_attempt_at: datetime, error: str, status: int | None) -> dict[str, Any]:
    """The columns a failed attempt to be tried again sets (with ``finish``)."""
    return {
        "state": PENDING,
        "next_attempt_at": next_attempt_at,
        "last_error": storable(error, MAX_ERROR),
        "response_status": status,
    }


def dead_values(now: datetime, error: str, status: int | None) -> dict[str, Any]:
    """The columns of giving up until an operator requeues it (with ``finish``)."""
    return {
        "state": DEAD,
        "last_error": storable(error, MAX_ERROR),
        "response_status": status,
        "completed_at": now,
    }


def finish(claim: Claim, now: datetime, values: dict[str, Any]) -> bool:
    """Set an outcome's ``values`` on the claimed delivery; False if the lease was lost.

    ``values`` come from ``delivered_values``, ``retry_values`` or
    ``dead_values``. The caller commits.
    """
    statement = finished_update(tuple(values))
    return db.session.execute(statement, finish_parameters(claim, now, values)).first() is not None


def mark_delivered(claim: Claim, now: datetime, status: int | None = None) -> bool:
    """Mark the delivery done (the caller commits); False if the lease was lost."""
    return finish(claim, now, delivered_values(now, status))


def finish_parameters(claim: Claim, now: datetime, values: dict[str, Any]) -> dict[str, Any]:
    """The parameters of ``finished_update(tuple(values))`` for this claim and outcome."""
    return {
        "finish_id": claim.id,
        "finish_token": claim.token,
        **{f"finish_{name}": value for name, value in _ended(now, values).items()},
    }


@functools.lru_cache(maxsize=16)  # per outcome's set of columns: three
def finished_update(columns: tuple[str, ...]) -> Any:
    """The fenced UPDATE of an outcome setting ``columns``, RETURNING the id when it held.

    Built once per shape, with bind parameters (``finish_parameters``):
    ``finish`` runs it, and a statement that writes the outcome with more
    (the attempt's row, in ``outbox/attempts.py``) holds it as a CTE.
    """
    return (
        update(_t)
        .where(
            _t.c.id == bindparam("finish_id", type_=_t.c.id.type),
            _t.c.lease_token == bindparam("finish_token", type_=_t.c.lease_token.type),
        )
        .values(
            {
                name: bindparam(f"finish_{name}", type_=_t.c[name].type)
                for name in (*_LEASE_ENDED, *columns)
            }
        )
        .returning(_t.c.id)
    )


def mark_skipped(
    claim: Claim, now: datetime, reason: str, when: ColumnElement[bool] | None = None
) -> bool:
    """Mark the delivery skipped (if ``when`` holds); False if not, or if the lease was lost."""
    return _finish(claim, now, when, state=SKIPPED, last_error=reason, completed_at=now)


def _rowcount(result: Any) -> int:
    # An UPDATE's result is a CursorResult; Session.execute is typed wider.
    return cast(CursorResult[Any], result).rowcount
