"""Data access for the Deliveries and Replays pages, and the event page's attempts.

The Deliveries list walks events newest first (their index on
``received_at, id``) and each one's deliveries by its (event, consumer)
key: the filters on the event (source, type, time) use the events' indexes,
those on the delivery (consumer, state) are checked row by row. Paged by
keyset on (the event's receipt time, the delivery's id): no OFFSET, and no
COUNT(*).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Select, select

from ..models import Delivery, Event, Replay
from ..outbox import attempts
from ..outbox.replays import Filter
from .paging import Cursor, Page, keyset_page


def with_events(*columns: Any) -> Select[*tuple[Any, ...]]:
    """Deliveries' ``columns``, then their events' source, type and key: a list of deliveries."""
    return select(*columns, Event.source, Event.event_type, Event.dedup_key).join(
        Event, Event.id == Delivery.event_id
    )


def list_deliveries(
    flt: Filter,
    *,
    limit: int,
    before: Cursor | None = None,
    after: Cursor | None = None,
) -> Page:
    """One page of deliveries matching ``flt``, newest event first."""
    stmt = with_events(
        Delivery.id,
        Delivery.event_id,
        Delivery.consumer,
        Delivery.kind,
        Delivery.state,
        Delivery.attempts,
        Delivery.response_status,
        Delivery.last_error,
        Delivery.next_attempt_at,
        Delivery.updated_at,
        Delivery.key_replay,
        Delivery.replay_id,
        Event.received_at,
    ).where(*flt.conditions())
    return keyset_page(
        stmt,
        Event.received_at,
        Delivery.id,
        limit=limit,
        before=before,
        after=after,
        row_key=lambda row: (row.received_at, row.id),
    )


# The event page's attempts, of all its deliveries together: the newest ones.
ATTEMPTS_SHOWN = 1000


def attempts_of(delivery_ids: Sequence[int]) -> dict[int, list[Any]]:
    """Each delivery's attempts, oldest first (the event page's panel); ATTEMPTS_SHOWN at most."""
    return attempts.of_deliveries(delivery_ids, limit=ATTEMPTS_SHOWN)


def list_replays(*, limit: int, before: Cursor | None = None, after: Cursor | None = None) -> Page:
    """One page of replays, newest first."""
    r = Replay
    stmt = select(
        r.id,
        r.created_at,
        r.finished_at,
        r.actor,
        r.via,
        r.filters,
        r.new_key,
        r.matched,
        r.replayed,
        r.walked,
        r.lease_expires_at,
    )
    return keyset_page(stmt, r.created_at, r.id, limit=limit, before=before, after=after)
