"""Replays: send stored events again, one event's deliveries or many chosen by a filter.

:func:`preview` counts what a filter takes (at most ``limit``) and notes the
highest matching delivery id, so that the replay that follows the
operator's confirmation takes the deliveries counted, not those made since.
:func:`run` records the replay, then moves the deliveries back in the queue
(``outbox.replays.requeue``) in batches: a read of the next batch's ids,
then one short transaction per batch, so a replay of 100,000 deliveries
never holds a long transaction, and a rest after each batch (``rest``
times as long as the batch took) leaves the database to the intake. The
worker then sends them as any other pending delivery, with the same
Idempotency-Key, or ``:replay-<n>`` after it when a new key was asked for.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from ..database import end_read, unit_of_work
from ..events import get_event
from ..extensions import db
from ..models import utcnow
from ..outbox import replays
from ..outbox.replays import Filter

log = logging.getLogger(__name__)

BATCH_SIZE = 500
# After each batch, wait this many times as long as it took (see run).
REST = 0.0
SAME_KEY_WARNING = (
    "the Idempotency-Key (message id) is kept: a downstream that deduplicates on it "
    "will drop the replay; ask for a new key to have it taken as new"
)


class ReplayError(Exception):
    """A replay that cannot run as asked: no such event, or no delivery to replay."""


@dataclass(frozen=True)
class Preview:
    """What a replay would take: the count shown before the confirmation."""

    filter: Filter
    count: int
    # The highest delivery id counted: the replay stops there.
    up_to: int | None
    limit: int | None = None


@dataclass(frozen=True)
class Done:
    """What a replay did."""

    replay_id: int
    matched: int
    replayed: int
    consumers: Counter[str] = field(default_factory=Counter)

    @property
    def left_alone(self) -> int:
        """Counted before, not replayed: in progress at a worker, or gone since."""
        return max(0, self.matched - self.replayed)


def preview(flt: Filter, *, limit: int | None = None) -> Preview:
    """Count the deliveries ``flt`` takes (at most ``limit``), and where a replay of them ends."""
    if limit is not None and limit < 1:
        raise ValueError("limit must be at least 1")
    try:
        up_to = replays.highest_id(flt, limit=limit)
        count = 0 if up_to is None else replays.count(flt, limit=limit, up_to=up_to)
    finally:
        db.session.rollback()  # end the read: the replay's batches write
    return Preview(flt, count, up_to, limit)


def run(
    plan: Preview,
    *,
    actor: str,
    via: str,
    new_key: bool = False,
    clock: Callable[[], datetime] = utcnow,
    batch_size: int = BATCH_SIZE,
    rest: float = REST,
) -> Done:
    """Record the replay and queue its deliveries again, a batch per transaction.

    After each batch it waits ``rest`` times as long as the batch took, so
    that the intake keeps the database most of the time.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    if rest < 0:
        raise ValueError("rest must not be negative")
    with unit_of_work():
        replay_id = replays.create(
            actor=actor,
            via=via,
            flt=plan.filter,
            new_key=new_key,
            matched=plan.count,
            limit=plan.limit,
            now=clock(),
        )
    consumers: Counter[str] = Counter()
    seen = 0
    after = 0
    while plan.up_to is not None:
        size = batch_size if plan.limit is None else min(batch_size, plan.limit - seen)
        if size <= 0:
            break
        started = time.monotonic()
        ids = replays.next_ids(plan.filter, after=after, up_to=plan.up_to, size=size)
        end_read()
        if not ids:
            break
        with unit_of_work():
            moved = replays.requeue(ids, clock(), replay_id, new_key=new_key)
            replays.add_replayed(replay_id, len(moved))
        consumers.update(row.consumer for row in moved)
        seen += len(ids)
        after = ids[-1]
        if len(ids) < size:
            break
        if rest:
            time.sleep(rest * (time.monotonic() - started))
    with unit_of_work():
        replays.finish(replay_id, clock())
    done = Done(replay_id, plan.count, sum(consumers.values()), consumers)
    log.info(
        "replay %s by %s: %d of %d deliveries queued again",
        replay_id,
        actor,
        done.replayed,
        done.matched,
        extra={
            "replay_id": replay_id,
            "actor": actor,
            "via": via,
            "filters": plan.filter.to_json(),
            "limit": plan.limit,
            "new_key": new_key,
            "matched": done.matched,
            "replayed": done.replayed,
            "consumers": dict(consumers),
        },
    )
    return done


def replay_event(
    event_id: int,
    consumer: str = "",
    *,
    actor: str,
    via: str,
    new_key: bool = False,
    clock: Callable[[], datetime] = utcnow,
) -> Done:
    """Send one event again to one of its consumers, or to all of them, whatever their state."""
    try:
        found = get_event(event_id) is not None
    finally:
        db.session.rollback()
    if not found:
        raise ReplayError(f"no event {event_id}")
    plan = preview(Filter(event_id=event_id, consumer=consumer))
    if plan.count == 0:
        if consumer:
            raise ReplayError(f"event {event_id} has no delivery to consumer {consumer!r}")
        raise ReplayError(f"event {event_id} has no deliveries (no consumer took it)")
    return run(plan, actor=actor, via=via, new_key=new_key, clock=clock)
