"""Data access for the admin's conflicts: the list, one conflict with its event, the review.

The list is paged by keyset (paging.py); the review is one UPDATE that the
caller commits.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, cast

from sqlalchemy import CursorResult, select, update

from ..extensions import db
from ..models import Event, EventConflict
from .paging import Cursor, Page, keyset_page

CONFLICT_VIEWS = ("unreviewed", "reviewed", "all")


def list_conflicts(
    *,
    limit: int,
    view: str = "unreviewed",
    before: Cursor | None = None,
    after: Cursor | None = None,
) -> Page:
    """One page of conflicting deliveries, newest first, with the broker their event came from."""
    stmt = select(
        EventConflict.id,
        EventConflict.received_at,
        EventConflict.event_id,
        EventConflict.source,
        EventConflict.dedup_key,
        EventConflict.seen_count,
        EventConflict.last_seen_at,
        EventConflict.reviewed_at,
        EventConflict.review_note,
        # NULL but for an event a broker consumer stored (meta.broker).
        Event.meta["broker"].as_string().label("broker"),
    ).join(Event, Event.id == EventConflict.event_id)
    if view == "unreviewed":
        stmt = stmt.where(EventConflict.reviewed_at.is_(None))
    elif view == "reviewed":
        stmt = stmt.where(EventConflict.reviewed_at.is_not(None))
    return keyset_page(
        stmt,
        EventConflict.received_at,
        EventConflict.id,
        limit=limit,
        before=before,
        after=after,
    )


def conflict_with_event(conflict_id: int) -> tuple[EventConflict, Event] | None:
    """Load a conflict and the event whose dedup key it reused."""
    conflict = db.session.get(EventConflict, conflict_id)
    if conflict is None:
        return None
    event = db.session.get(Event, conflict.event_id)
    if event is None:  # pragma: no cover - the foreign key cascades
        return None
    return conflict, event


def review_conflict(conflict_id: int, note: str, now: datetime) -> bool:
    """Mark a conflict reviewed with a note; False when there is no such conflict.

    The caller commits.
    """
    result = cast(
        "CursorResult[Any]",
        db.session.execute(
            update(EventConflict)
            .where(EventConflict.id == conflict_id)
            .values(reviewed_at=now, review_note=note or None)
        ),
    )
    return result.rowcount == 1
