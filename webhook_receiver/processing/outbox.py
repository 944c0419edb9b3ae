"""The transactional outbox: a new event's deliveries, written in the event's transaction."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.engine import Connection

from . import deliveries, registry


def enqueue(
    event_id: int,
    source: str,
    event_type: str | None,
    now: datetime,
    connection: Connection | None = None,
) -> int:
    """Write one pending delivery per consumer of this event; return how many.

    Called by ``events.insert_event`` right after a fresh insert, inside the
    same transaction (PostgreSQL's one-statement receipt does the same): the
    event and its deliveries commit together or not at all, so no event is
    stored without its work, nor work without it.
    """
    consumers = consumers_for(source, event_type)
    deliveries.enqueue(
        [{"event_id": event_id, "consumer": name, "kind": kind} for name, kind in consumers],
        now,
        connection,
    )
    return len(consumers)


def consumers_for(source: str, event_type: str | None) -> list[tuple[str, str]]:
    """The (name, kind) of each consumer that gets a delivery of a new event."""
    return [(c.name, c.kind) for c in registry.get().for_event(source, event_type)]
