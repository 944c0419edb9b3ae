"""The overview's numbers: what happened in a window of time, what waits now, per hour.

Each is one aggregate statement over an indexed time or state column.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Select, func, select

from ..extensions import db
from ..models import Delivery, Event, EventConflict, EventDuplicate, Rejection
from ..outbox import deliveries as delivery_states
from .presenters import WEBHOOK_REFUSALS


@dataclass(frozen=True)
class Counts:
    """What happened in one window of time."""

    received: int
    duplicates: int
    conflicts: int
    rejections: int  # webhook deliveries refused for their signature or timestamp
    delivered: int
    dead: int
    discarded: int


def _count(stmt: Select[*tuple[Any, ...]]) -> int:
    return int(db.session.scalar(stmt) or 0)


def counts_since(since: datetime) -> Counts:
    """Count events, duplicates, conflicts, rejections and finished deliveries since ``since``.

    Rejections count only refused webhook deliveries (the overview's
    signature failures), not the broker messages dead-lettered beside them.
    Deliveries count by when they finished: delivered and discarded ones by
    ``completed_at``, dead ones by when they died (``updated_at``).
    """
    d = Delivery
    return Counts(
        received=_count(select(func.count()).where(Event.received_at >= since)),
        duplicates=_count(select(func.count()).where(EventDuplicate.received_at >= since)),
        conflicts=_count(select(func.count()).where(EventConflict.received_at >= since)),
        rejections=_count(
            select(func.sum(Rejection.seen_count)).where(
                Rejection.received_at >= since, Rejection.reason.in_(sorted(WEBHOOK_REFUSALS))
            )
        ),
        delivered=_count(
            select(func.count()).where(
                d.state == delivery_states.DELIVERED, d.completed_at >= since
            )
        ),
        dead=_count(
            select(func.count()).where(d.state == delivery_states.DEAD, d.updated_at >= since)
        ),
        discarded=_count(
            select(func.count()).where(
                d.state == delivery_states.DISCARDED, d.completed_at >= since
            )
        ),
    )


@dataclass(frozen=True)
class Backlog:
    """What waits for someone now."""

    pending: int
    dead: int
    unreviewed_conflicts: int


def backlog() -> Backlog:
    """Count deliveries waiting or dead, and conflicts nobody has reviewed."""
    d = Delivery
    return Backlog(
        pending=_count(
            select(func.count()).where(
                d.state.in_([delivery_states.PENDING, delivery_states.IN_PROGRESS])
            )
        ),
        dead=_count(select(func.count()).where(d.state == delivery_states.DEAD)),
        unreviewed_conflicts=_count(
            select(func.count()).where(EventConflict.reviewed_at.is_(None))
        ),
    )


def _hour_of(column: Any) -> Any:
    # Both databases store naive UTC; each has its own way to cut to the hour.
    if db.engine.dialect.name == "sqlite":
        return func.strftime("%Y-%m-%d %H", column)
    return func.to_char(func.date_trunc("hour", column), "YYYY-MM-DD HH24")


def hourly(column: Any, since: datetime) -> dict[datetime, int]:
    """Count rows per UTC hour of ``column`` from ``since``, in the database."""
    bucket = _hour_of(column).label("bucket")
    rows = db.session.execute(
        select(bucket, func.count()).where(column >= since).group_by(bucket)
    ).all()
    return {
        datetime.strptime(label, "%Y-%m-%d %H").replace(tzinfo=UTC): int(n) for label, n in rows
    }


def hourly_received(since: datetime) -> dict[datetime, int]:
    """Events first received per hour."""
    return hourly(Event.received_at, since)


def hourly_duplicates(since: datetime) -> dict[datetime, int]:
    """Duplicate deliveries per hour."""
    return hourly(EventDuplicate.received_at, since)
