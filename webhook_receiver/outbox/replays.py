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
the next batch's ids, then one short transaction that moves them and
records how far it got (``advance``). ``up_to`` (the highest matching id
when the count was shown) keeps deliveries made since out of it, and
the count itself caps how many it walks (``max_count``). The
process running a replay holds it under a lease, renewed by each batch and
fencing its writes: a replay whose process died is claimed by a worker and
resumed after its last batch (``claim``). Data access only: the caller
commits each batch.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import (
    ColumnElement,
    CursorResult,
    Select,
    and_,
    func,
    insert,
    or_,
    select,
    update,
)

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

    @classmethod
    def from_json(cls, found: dict[str, Any]) -> Filter:
        """The filter a replay's record keeps (``to_json``)."""
        times = {
            name: datetime.fromisoformat(found[name]) if found.get(name) else None
            for name in ("since", "until")
        }
        return cls(
            event_id=found.get("event_id"),
            consumer=found.get("consumer", ""),
            source=found.get("source", ""),
            event_type=found.get("event_type", ""),
            state=found.get("state", ""),
            since=times["since"],
            until=times["until"],
        )

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


def requeue(
    ids: Sequence[int], now: datetime, replay_id: int, *, new_key: bool, state: str = ""
) -> list[Any]:
    """Put these deliveries back in the queue for replay ``replay_id``; the caller commits.

    The conditions are in the UPDATE itself: one a worker took since the
    read is left alone, and so is one no longer in the ``state`` the replay
    filters on (a dead one requeued and delivered since: sent again, it
    would go twice). Returns the (id, consumer) of those moved.
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
            .where(_d.c.id.in_(list(ids)), _replayable(now), *_in_state(state))
            .values(**values)
            .returning(_d.c.id, _d.c.consumer)
        ).all()
    )


def _in_state(state: str) -> list[ColumnElement[bool]]:
    # Only the state moves between a batch's read and its write: the
    # consumer, the event and its source, type and receipt time do not.
    return [_d.c.state == state] if state else []


@dataclass(frozen=True)
class Held:
    """A replay this process runs under a lease: what it takes and how far it got."""

    id: int
    token: str
    filter: Filter
    new_key: bool
    up_to: int | None
    max_count: int | None
    after_id: int
    walked: int
    rest: float


def create(
    *,
    actor: str,
    via: str,
    flt: Filter,
    new_key: bool,
    matched: int,
    up_to: int | None,
    limit: int | None,
    rest: float,
    now: datetime,
    lease: timedelta | None = None,
) -> Held:
    """Record a replay before its first batch; the caller commits.

    With ``lease``, the caller holds it and runs it now; without, it waits
    for a worker to claim it.
    """
    filters = flt.to_json()
    if limit is not None:
        filters["limit"] = limit
    # At most the count shown: a delivery that came into the filter since
    # (one retrying when counted, dead now) would take the replay past it.
    max_count = matched if limit is None else min(limit, matched)
    token = secrets.token_hex(16)
    replay_id = int(
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
                up_to=up_to,
                max_count=max_count,
                after_id=0,
                walked=0,
                rest=rest,
                lease_token=token if lease is not None else None,
                lease_expires_at=now + lease if lease is not None else None,
            )
            .returning(_r.c.id)
        ).scalar_one()
    )
    return Held(replay_id, token, flt, new_key, up_to, max_count, 0, 0, rest)


def _free(now: datetime) -> ColumnElement[bool]:
    return and_(
        _r.c.finished_at.is_(None),
        or_(_r.c.lease_expires_at.is_(None), _r.c.lease_expires_at <= now),
    )


def waiting(now: datetime) -> bool:
    """Tell whether a replay waits for a process to run it (a read: no write lock asked)."""
    return db.session.scalar(select(_r.c.id).where(_free(now)).limit(1)) is not None


def claim(now: datetime, lease: timedelta) -> Held | None:
    """Claim the oldest unfinished replay no live process holds; the caller commits."""
    token = secrets.token_hex(16)
    free = _free(now)
    pick = select(_r.c.id).where(free).order_by(_r.c.id).limit(1).with_for_update(skip_locked=True)
    row = db.session.execute(
        update(_r)
        .where(_r.c.id == pick.scalar_subquery(), free)
        .values(lease_token=token, lease_expires_at=now + lease)
        .returning(
            _r.c.id,
            _r.c.filters,
            _r.c.new_key,
            _r.c.up_to,
            _r.c.max_count,
            _r.c.after_id,
            _r.c.walked,
            _r.c.rest,
        )
    ).one_or_none()
    if row is None:
        return None
    return Held(
        row.id,
        token,
        Filter.from_json(row.filters),
        row.new_key,
        row.up_to,
        row.max_count,
        row.after_id,
        row.walked,
        row.rest,
    )


def advance(
    held: Held, *, after_id: int, walked: int, replayed: int, lease_until: datetime
) -> bool:
    """Record a batch's progress in its transaction, renewing the lease; False if lost.

    Fenced by the lease token: a process whose lease was taken over writes
    nothing, and its batch must roll back.
    """
    result = db.session.execute(
        update(_r)
        .where(_r.c.id == held.id, _r.c.lease_token == held.token)
        .values(
            after_id=after_id,
            walked=_r.c.walked + walked,
            replayed=_r.c.replayed + replayed,
            lease_expires_at=lease_until,
        )
    )
    return _rowcount(result) == 1


def renew(held: Held, lease_until: datetime) -> bool:
    """Hold the replay until ``lease_until`` while its process rests; False if lost.

    The caller commits.
    """
    result = db.session.execute(
        update(_r)
        .where(_r.c.id == held.id, _r.c.lease_token == held.token, _r.c.finished_at.is_(None))
        .values(lease_expires_at=lease_until)
    )
    return _rowcount(result) == 1


def finish(held: Held, now: datetime) -> bool:
    """Mark the replay done, letting its lease go; False if it was lost. The caller commits."""
    result = db.session.execute(
        update(_r)
        .where(_r.c.id == held.id, _r.c.lease_token == held.token, _r.c.finished_at.is_(None))
        .values(finished_at=now, lease_token=None, lease_expires_at=None)
    )
    return _rowcount(result) == 1


def release(held: Held) -> None:
    """Let another process resume the replay at once (this one stops); the caller commits."""
    db.session.execute(
        update(_r)
        .where(_r.c.id == held.id, _r.c.lease_token == held.token)
        .values(lease_token=None, lease_expires_at=None)
    )


def get(replay_id: int) -> Replay | None:
    """One replay's record."""
    return db.session.get(Replay, replay_id)


def _rowcount(result: Any) -> int:
    return cast(CursorResult[Any], result).rowcount
