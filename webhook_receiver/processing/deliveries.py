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
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from sqlalchemy import update

from ..extensions import db
from ..models import Delivery

PENDING = "pending"
IN_PROGRESS = "in_progress"
DELIVERED = "delivered"
DEAD = "dead"
SKIPPED = "skipped"
STATES = (PENDING, IN_PROGRESS, DELIVERED, DEAD, SKIPPED)

_t = Delivery.__table__


def requeue(delivery_ids: Iterable[int], now: datetime) -> int:
    """Put dead (or failed, or stuck) deliveries back in the queue, keeping their key.

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
        .where(_t.c.id.in_(ids), _t.c.state.in_([DEAD, PENDING, IN_PROGRESS]))
        .values(
            state=PENDING,
            attempts=0,
            next_attempt_at=now,
            lease_token=None,
            lease_expires_at=None,
            updated_at=now,
        )
    )
    return result.rowcount
