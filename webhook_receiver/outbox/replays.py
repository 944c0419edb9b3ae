"""Replays: putting deliveries back in the queue on an operator's request, and their record.

A replay moves a delivery, whatever its state, back to ``pending`` with a
whole attempt budget, due now: delivered, skipped, dead and discarded ones
as well as pending ones (which stay pending, due now). Only a delivery a
worker holds right now (``in_progress`` under a live lease) is left alone:
it is being sent. The delivery keeps its Idempotency-Key (the downstream
may deduplicate it away) unless a new key is asked for: then its
``key_replay`` goes up by one, and the key sent ends ``:replay-<n>``.

Each replay is a ``replays`` row (who, when, the filter, the count shown
before the confirmation, how many were replayed), and each delivery it
queued names it (``replay_id``), as do the attempts that follow.

A bulk replay walks the matching deliveries by id, in batches: one read of
the next batch's ids, then one short transaction that moves them and adds
them to the record's count. ``up_to`` (the highest matching id when the
count was shown) keeps deliveries made since out of it. Data access only:
the caller commits each batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from sqlalchemy import ColumnElement, CursorResult, Select, func, insert, or_, select, update

from ..extensions import db
from ..models import Delivery, Event, Replay
from . import deliveries
from .deliveries import IN_PROGRESS, PENDING

_d = Delivery.__table__
_r = Replay.__table__
STATES = (
    deliveries.PENDING,
    deliveries.IN_PROGRESS,
    deliveries.DELIVERED,
    deliveries.DEAD,
    deliveries.SKIPPED,
    deliveries.DISCARDED,
)
VIA_ADMIN = "admin"
VIA_CLI = "cli"


@dataclass(frozen=True)
class Filter:
    """Which deliveries a replay (or the Deliveries page) takes; empty fields take all."""

    event_id: int | None = None
    consumer: str = ""
    source: str = ""
    event_type: str = ""
    state: str = ""
    # On the event's receipt time: since inclusive, until exclusive.
    since: datetime | None = None
    until: datetime | None = None

    def to_json(self) -> dict[str, Any]:
        """The filter as the replay's record keeps it: only the fields given."""
        found: dict[str, Any] = {}
        if self.event_id is not None:
            found["event_id"] = self.event_id
        for name in ("consumer", "source", "event_type", "state"):
            if getattr(self, name):
                found[name] = getattr(self, name)
        for name in ("since", "until"):
            moment = getattr(self, name)
            if moment is not None:
                found[name] = moment.isoformat()
        return found

    def conditions(self) -> list[ColumnElement[bool]]:
        """The WHERE conditions over deliveries joined with their events."""
        found: list[ColumnElement[bool]] = []
        if self.event_id is not None:
            found.append(_d.c.event_id == self.event_id)
        if self.consumer:
            found.append(_d.c.consumer == self.consumer)
        if self.state:
            found.append(_d.c.state == self.state)
        if self.source:
            found.append(Event.source == self.source)
        if self.event_type:
            found.append(Event.event_type == self.event_type)
        if self.since is not None:
            found.append(Event.received_at >= self.since)
        if self.until is not None:
            found.append(Event.received_at < self.until)
        return found

    def joins_events(self) -> bool:
        return bool(self.source or self.event_type or self.since or self.until)


def _matching(flt: Filter, up_to: int | None) -> Select[tuple[int]]:
    stmt = select(_d.c.id)
    if flt.joins_events():
        stmt = stmt.join(Event, Event.id == _d.c.event_id)
    stmt = stmt.where(*flt.conditions())
    if up_to is not None:
        stmt = stmt.where(_d.c.id <= up_to)
    return stmt


def count(flt: Filter, *, limit: int | None = None, up_to: int | None = None) -> int:
    """How many deliveries match (at most ``limit``)."""
    inner = _matching(flt, up_to)
    if limit is not None:
        inner = inner.order_by(_d.c.id).limit(limit)
    return int(db.session.scalar(select(func.count()).select_from(inner.subquery())) or 0)


def highest_id(flt: Filter, *, limit: int | None = None) -> int | None:
    """The highest id of the first ``limit`` matching deliveries (by id): where a replay stops."""
    inner = _matching(flt, None).order_by(_d.c.id)
    if limit is not None:
        inner = inner.limit(limit)
    return db.session.scalar(select(func.max(inner.subquery().c.id)))


def next_ids(flt: Filter, *, after: int, up_to: int | None, size: int) -> list[int]:
    """The next ``size`` matching delivery ids above ``after``, in order."""
    stmt = _matching(flt, up_to).where(_d.c.id > after).order_by(_d.c.id).limit(size)
    return list(db.session.scalars(stmt))


def _replayable(now: datetime) -> ColumnElement[bool]:
    # A live lease: a worker is sending it right now.
    return or_(
        _d.c.state != IN_PROGRESS,
        _d.c.lease_expires_at.is_(None),
        _d.c.lease_expires_at <= now,
    )


def requeue(ids: Sequence[int], now: datetime, replay_id: int, *, new_key: bool) -> list[Any]:
    """Put these deliveries back in the queue for replay ``replay_id``; the caller commits.

    The condition is in the UPDATE itself: one a worker took since the read
    is left alone. Returns the (id, consumer) of those moved.
    """
    if not ids:
        return []
    values: dict[str, Any] = {
        "state": PENDING,
        "attempts": 0,
        "next_attempt_at": now,
        "lease_token": None,
        "lease_expires_at": None,
        "completed_at": None,
        "updated_at": now,
        "replay_id": replay_id,
    }
    if new_key:
        values["key_replay"] = _d.c.key_replay + 1
    return list(
        db.session.execute(
            update(_d)
            .where(_d.c.id.in_(list(ids)), _replayable(now))
            .values(**values)
            .returning(_d.c.id, _d.c.consumer)
        ).all()
    )


def create(
    *,
    actor: str,
    via: str,
    flt: Filter,
    new_key: bool,
    matched: int,
    limit: int | None,
    now: datetime,
) -> int:
    """Record a replay before its first batch; the caller commits. Returns its id."""
    filters = flt.to_json()
    if limit is not None:
        filters["limit"] = limit
    return int(
        db.session.execute(
            insert(_r)
            .values(
                created_at=now,
                actor=actor[:200],
                via=via,
                filters=filters,
                new_key=new_key,
                matched=matched,
                replayed=0,
            )
            .returning(_r.c.id)
        ).scalar_one()
    )


def add_replayed(replay_id: int, n: int) -> None:
    """Count ``n`` more deliveries replayed, in the batch's transaction."""
    if n:
        db.session.execute(
            update(_r).where(_r.c.id == replay_id).values(replayed=_r.c.replayed + n)
        )


def finish(replay_id: int, now: datetime) -> bool:
    """Mark the replay done; the caller commits."""
    result = db.session.execute(
        update(_r).where(_r.c.id == replay_id, _r.c.finished_at.is_(None)).values(finished_at=now)
    )
    return cast(CursorResult[Any], result).rowcount == 1


def get(replay_id: int) -> Replay | None:
    """One replay's record."""
    return db.session.get(Replay, replay_id)
