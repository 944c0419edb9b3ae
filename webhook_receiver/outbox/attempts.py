"""The attempt log: one row per attempt of a delivery, written with the attempt's outcome.

The worker adds an attempt in the transaction that records its outcome on
the delivery (delivered, retrying, dead, skipped), so the log and the
delivery's state commit together or not at all. Outcomes of one attempt:

- ``delivered``: the consumer took it (a 2xx, a broker's confirmation, a
  handler that returned);
- ``retryable_failure``: a failure worth trying again (5xx, 408, 429, a
  timeout, a connection error, a publish not confirmed, a handler's
  exception); the delivery is retried, or dead once out of attempts;
- ``permanent_failure``: trying again cannot help (another 4xx, a publish
  refused, ``PermanentFailure``, a consumer no longer configured);
- ``skipped``: stale (a newer version of its entity was applied).

Rows go with their delivery (``ON DELETE CASCADE``), so retention purges
them with the event. Data access only: nothing here commits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import insert, select

from ..extensions import db
from ..models import Delivery, DeliveryAttempt

DELIVERED = "delivered"
RETRYABLE_FAILURE = "retryable_failure"
PERMANENT_FAILURE = "permanent_failure"
SKIPPED = "skipped"
OUTCOMES = (DELIVERED, RETRYABLE_FAILURE, PERMANENT_FAILURE, SKIPPED)

# What an attempt keeps of the consumer's answer, and of its error.
MAX_RESPONSE_BODY = 2048
MAX_ERROR = 2000
MAX_CONFIRMATION = 500

_t = DeliveryAttempt.__table__
_d = Delivery.__table__


@dataclass(frozen=True)
class Attempt:
    """One attempt, as the worker records it."""

    delivery_id: int
    number: int
    started_at: datetime
    ended_at: datetime
    outcome: str
    latency_ms: float
    status: int | None = None
    confirmation: str | None = None
    error: str | None = None
    response_body: str | None = None
    worker: str | None = None


def add(attempt: Attempt) -> None:
    """Write one attempt in the current transaction (its outcome's); the caller commits.

    The delivery's ``replay_id`` (the replay that queued it again, if any)
    is copied by the INSERT itself: no read beforehand.
    """
    if attempt.outcome not in OUTCOMES:
        raise ValueError(f"unknown attempt outcome {attempt.outcome!r}")
    db.session.execute(
        insert(_t).values(
            delivery_id=attempt.delivery_id,
            number=attempt.number,
            started_at=attempt.started_at,
            ended_at=attempt.ended_at,
            outcome=attempt.outcome,
            latency_ms=round(attempt.latency_ms, 3),
            status=attempt.status,
            confirmation=_clip(attempt.confirmation, MAX_CONFIRMATION),
            error=_clip(attempt.error, MAX_ERROR),
            response_body=_clip(attempt.response_body, MAX_RESPONSE_BODY),
            replay_id=select(_d.c.replay_id)
            .where(_d.c.id == attempt.delivery_id)
            .scalar_subquery(),
            worker=attempt.worker,
        )
    )


def _clip(text: str | None, size: int) -> str | None:
    return None if text is None else text[:size]


@dataclass(frozen=True)
class DeliveryLog:
    """One delivery of an event, with its attempts, oldest first."""

    id: int
    consumer: str
    kind: str
    state: str
    attempts: list[Any]


def of_event(event_id: int, *, limit: int = 1000) -> list[DeliveryLog]:
    """The event's deliveries by consumer, each with its attempts (the newest ``limit`` in all)."""
    deliveries = db.session.execute(
        select(_d.c.id, _d.c.consumer, _d.c.kind, _d.c.state)
        .where(_d.c.event_id == event_id)
        .order_by(_d.c.consumer)
    ).all()
    found = of_deliveries([row.id for row in deliveries], limit=limit)
    return [
        DeliveryLog(row.id, row.consumer, row.kind, row.state, found.get(row.id, []))
        for row in deliveries
    ]


def of_deliveries(delivery_ids: Sequence[int], *, limit: int = 1000) -> dict[int, list[Any]]:
    """Each delivery's attempts, oldest first; at most the newest ``limit`` of them in all."""
    if not delivery_ids:
        return {}
    rows = db.session.execute(
        select(_t)
        .where(_t.c.delivery_id.in_(list(delivery_ids)))
        .order_by(_t.c.id.desc())
        .limit(limit)
    ).all()
    found: dict[int, list[Any]] = {}
    for row in reversed(rows):
        found.setdefault(row.delivery_id, []).append(row)
    return found
