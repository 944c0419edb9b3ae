"""Data access for the admin's conflicts: the list, one conflict with its event, the review.

The list is paged by keyset (paging.py); the review is one UPDATE that the
caller commits, made only if the review is still the one the operator saw.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import CursorResult, select, update

from ..extensions import db
from ..models import Event, EventConflict
from .paging import EPOCH, Cursor, Page, keyset_page
from .queries import stored_body

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


def conflict_body(conflict_id: int) -> bytes | None:
    """A conflicting delivery's body as it was received (None: no such conflict); ends the read."""
    return stored_body(EventConflict.body, conflict_id)


NOT_REVIEWED = ""
ANY_REVIEW = None


def review_version(conflict: EventConflict) -> str:
    """What names the review an operator sees: when it was saved, or ``NOT_REVIEWED``."""
    if conflict.reviewed_at is None:
        return NOT_REVIEWED
    return str((conflict.reviewed_at - EPOCH) // timedelta(microseconds=1))


def parse_review_version(raw: str | None) -> str | datetime | None:
    """Read ``review_version``'s text back; ValueError when it is not one.

    None (a form without it) is ``ANY_REVIEW``: the review is saved whatever is there.
    """
    if raw is None or raw == NOT_REVIEWED:
        return raw
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 18):
        raise ValueError(f"not a review version: {raw!r}")
    try:
        return EPOCH + timedelta(microseconds=int(raw))
    except OverflowError as exc:  # past the year 9999
        raise ValueError(f"not a review version: {raw!r}") from exc


def review_conflict(
    conflict_id: int, note: str, now: datetime, seen: str | datetime | None = ANY_REVIEW
) -> bool:
    """Mark a conflict reviewed with a note, if its review is still ``seen``.

    False when there is no such conflict, or when another review was saved
    since the operator looked (two operators at once): the first note stays.
    The caller commits.
    """
    stmt = update(EventConflict).where(EventConflict.id == conflict_id)
    if seen == NOT_REVIEWED:
        stmt = stmt.where(EventConflict.reviewed_at.is_(None))
    elif isinstance(seen, datetime):
        stmt = stmt.where(EventConflict.reviewed_at == seen)
    result = cast(
        "CursorResult[Any]",
        db.session.execute(stmt.values(reviewed_at=now, review_note=note or None)),
    )
    return result.rowcount == 1
