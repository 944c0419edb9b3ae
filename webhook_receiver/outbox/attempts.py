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

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, bindparam, func, insert, select

from ..extensions import db
from ..models import Delivery, DeliveryAttempt
from . import deliveries
from .deliveries import Claim

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
    db.session.execute(_insert(), _parameters(attempt))


def add_with_outcome(
    connection: Connection, attempt: Attempt, claim: Claim, now: datetime, values: dict[str, Any]
) -> bool:
    """Write the attempt and its outcome in one statement; False if the lease was lost.

    ``values`` are the outcome's columns (``deliveries.delivered_values``,
    ``retry_values``, ``dead_values``), set fenced by the claim's lease as
    ``deliveries.finish`` sets them. On ``connection`` outside a transaction
    it is a unit of work by itself, committed in one round trip. As in
    the outcome's transaction (``add``, then ``finish``), the attempt's row
    is written even when the lease was lost. PostgreSQL only: a
    data-modifying CTE, which SQLite has not.
    """
    statement = _insert_with_outcome(tuple(values))
    parameters = {**_parameters(attempt), **deliveries.finish_parameters(claim, now, values)}
    return bool(connection.execute(statement, parameters).scalar_one())


# The attempt's columns the worker gives, each a bind parameter of the INSERT.
_GIVEN = (
    "delivery_id",
    "number",
    "started_at",
    "ended_at",
    "outcome",
    "latency_ms",
    "status",
    "confirmation",
    "error",
    "response_body",
    "worker",
)


def _parameters(attempt: Attempt) -> dict[str, Any]:
    if attempt.outcome not in OUTCOMES:
        raise ValueError(f"unknown attempt outcome {attempt.outcome!r}")
    values = {
        "delivery_id": attempt.delivery_id,
        "number": attempt.number,
        "started_at": attempt.started_at,
        "ended_at": attempt.ended_at,
        "outcome": attempt.outcome,
        "latency_ms": round(attempt.latency_ms, 3),
        "status": attempt.status,
        "confirmation": _clip(attempt.confirmation, MAX_CONFIRMATION),
        "error": _clip(attempt.error, MAX_ERROR),
        "response_body": _clip(attempt.response_body, MAX_RESPONSE_BODY),
        "worker": attempt.worker,
    }
    return {f"attempt_{name}": value for name, value in values.items()}


@functools.cache
def _insert() -> Any:
    """The attempt's INSERT, built once: the worker runs it for every attempt."""
    given = {name: bindparam(f"attempt_{name}", type_=_t.c[name].type) for name in _GIVEN}
    replay = select(_d.c.replay_id).where(_d.c.id == given["delivery_id"]).scalar_subquery()
    return insert(_t).values({**given, "replay_id": replay})


@functools.lru_cache(maxsize=16)  # per outcome's set of columns: three
def _insert_with_outcome(columns: tuple[str, ...]) -> Any:
    """The attempt's INSERT under the fenced UPDATE of its outcome, as a CTE.

    WITH finished AS (UPDATE deliveries ... RETURNING id) INSERT INTO
    delivery_attempts ... RETURNING (SELECT count(*) FROM finished): every
    part of the statement sees the same snapshot, so the INSERT's
    ``replay_id`` is read as before the UPDATE, which does not change it.
    """
    finished = deliveries.finished_update(columns).cte("finished")
    held = select(func.count()).select_from(finished).scalar_subquery()
    return _insert().add_cte(finished).returning(held)


def _clip(text: str | None, size: int) -> str | None:
    return None if text is None else deliveries.storable(text, size)


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
